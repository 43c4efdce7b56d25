//! Two UCX workers in one process (standing in for a prefill and a decode
//! worker): the reader pulls blocks from the owner's registered memory with
//! one-sided gets, in one batch, and gets exactly the owner's bytes.

#![allow(unsafe_code)]

use std::time::Instant;

use turbine_ucx::{Context, MemoryRegion, Worker};

#[test]
fn a_batch_of_one_sided_reads_copies_registered_blocks() {
    const BLOCK: usize = 4096;
    const BLOCKS: usize = 1000;
    let mut owned: Vec<u8> = (0..BLOCK * BLOCKS).map(|i| (i * 31 % 251) as u8).collect();

    // Owner: a context, a worker, the registered region.
    let owner_context = Context::new().unwrap();
    let owner = Worker::new(&owner_context).unwrap();
    // SAFETY: `owned` outlives the region and does not move.
    let region = unsafe { MemoryRegion::register(&owner_context, owned.as_mut_ptr(), owned.len()) }.unwrap();
    let (owner_address, rkey, base) = (owner.address().unwrap(), region.packed_rkey().unwrap(), region.address());

    // Reader: what it learns over the control path is three byte strings.
    let reader_context = Context::new().unwrap();
    let reader = Worker::new(&reader_context).unwrap();
    let endpoint = reader.connect(&owner_address, true).unwrap();
    let key = endpoint.remote_key(&rkey).unwrap();

    // Every other block, in reverse order, into a packed buffer.
    let wanted: Vec<usize> = (0..BLOCKS).rev().step_by(2).collect();
    let mut pulled = vec![0u8; wanted.len() * BLOCK];
    let posted = Instant::now();
    let requests: Vec<_> =
        pulled.chunks_mut(BLOCK).zip(&wanted).map(|(into, &block)| endpoint.get(into, base + (block * BLOCK) as u64, &key).unwrap()).collect();
    let post_time = posted.elapsed();
    // The owner's worker must make progress too for transports that need
    // it (tcp); a real owner runs a progress thread.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let progress = std::thread::spawn({
        let stop = stop.clone();
        move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                owner.progress();
            }
            owner
        }
    });
    let done = reader.wait_all(requests);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let _owner = progress.join().unwrap();
    done.unwrap();
    println!("posted {} reads of {BLOCK} B in {post_time:?}, all done in {:?}", wanted.len(), posted.elapsed());
    for (chunk, &block) in pulled.chunks(BLOCK).zip(&wanted) {
        assert_eq!(chunk, &owned[block * BLOCK..(block + 1) * BLOCK], "block {block}");
    }
    drop(key);
    drop(endpoint);
}

/// Memory UCX allocates in shared memory is mapped by a same-machine
/// reader (`local_ptr`) and read with no help from its owner, which never
/// progresses here; a get through the same key reads the same bytes.
#[test]
fn shared_memory_a_peer_allocated_is_read_without_the_peer() {
    const BYTES: usize = 4 << 20;
    let owner_context = Context::with_transports("posix,self").unwrap();
    let owner = Worker::new(&owner_context).unwrap();
    let region = MemoryRegion::allocate(&owner_context, BYTES).unwrap();
    assert!(region.len() >= BYTES);
    // SAFETY: the region is ours, BYTES long, and nothing reads it yet.
    let owned = unsafe { std::slice::from_raw_parts_mut(region.as_ptr(), BYTES) };
    assert!(owned.iter().all(|&byte| byte == 0), "allocated memory is zeroed");
    for (i, byte) in owned.iter_mut().enumerate() {
        *byte = (i * 7 % 253) as u8;
    }
    let (owner_address, rkey, base) = (owner.address().unwrap(), region.packed_rkey().unwrap(), region.address());

    let reader_context = Context::with_transports("posix,self").unwrap();
    let reader = Worker::new(&reader_context).unwrap();
    let endpoint = reader.connect(&owner_address, false).unwrap();
    let key = endpoint.remote_key(&rkey).unwrap();
    let mapped = key.local_ptr(base + 4096).expect("shared memory allocated by UCX is mapped by a same-machine peer");
    // SAFETY: the mapping covers the region and lives as long as `key`.
    let seen = unsafe { std::slice::from_raw_parts(mapped, 4096) };
    assert_eq!(seen, &owned[4096..8192]);

    let mut pulled = vec![0u8; 4096];
    endpoint.get(&mut pulled, base + 8192, &key).unwrap().wait(&reader).unwrap();
    assert_eq!(pulled, &owned[8192..12288]);

    // A key unpacked for one endpoint is refused by another.
    let other = reader.connect(&owner_address, false).unwrap();
    assert!(other.get(&mut pulled, base, &key).is_err());
    drop(key);
    drop(other);
    drop(endpoint);
    drop(region);
    drop(owner);
}

/// A UCX that cannot move CUDA memory (Debian's is built without CUDA; no
/// GPU here) refuses to register device memory rather than treating the
/// address as host memory.
#[test]
fn device_memory_is_refused_by_a_ucx_without_cuda() {
    let context = Context::new().unwrap();
    if context.supports_cuda() {
        eprintln!("this UCX supports CUDA; nothing to check here");
        return;
    }
    // SAFETY: refused before UCX looks at the address.
    let refused = unsafe { MemoryRegion::register_cuda(&context, 0x7000_0000_0000, 1 << 20) };
    assert!(refused.unwrap_err().to_string().contains("no CUDA support"));
}

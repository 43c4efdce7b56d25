//! KV tiers below the engine's pool (G1): host memory (G2), local disk
//! (G3) and a shared store (G4).
//!
//! **Offload.** A block registered in G1 is full and never written again,
//! so it is copied to the host tier as soon as it is registered
//! (write-through), by a thread of its own: the engine pins the block (one
//! more reference, so it is neither evicted nor reused) and hands it over;
//! the thread copies its bytes out of the pool, checksums them, stores them
//! under the block's sequence hash and gives the block back. Nothing of
//! this runs on a step's critical path, and a G1 eviction loses nothing the
//! host tier holds. What the host tier evicts is written to the disk tier,
//! by another thread. When copies fall behind, blocks are skipped rather
//! than held without bound.
//!
//! **Onboard.** As a waiting request comes up for admission (it is at the
//! front of the queue and fits the free blocks: blocks onboarded for a
//! request further back would likely be evicted again before its turn), the
//! lower tiers are asked for the blocks that continue its G1 prefix hit:
//! each is checked against its checksum and written into a free G1 block,
//! then registered, exactly as blocks read from another worker are
//! installed; its admission then hits them like any cached prefix. Host
//! blocks are at hand and installed at once; disk blocks are read by a
//! reader thread while the engine keeps stepping the other sequences, the
//! request suspended meanwhile (counted as waiting) and put back at the
//! front of the queue once they are in. A block whose bytes do not match
//! its checksum is dropped from its tier, never served.
//!
//! **Events.** Every block a tier stores or evicts is a `Stored`/`Removed`
//! event with the tier's name, numbered by the engine loop with the pool's
//! own events, so routers credit lower-tier hits.
//!
//! - [`HostTier`] (`host.rs`): a byte-bounded `moka` cache in memory.
//! - [`RemoteTier`] (`remote.rs`): the shared tier (G4) over a
//!   [`RemoteStore`] the worker supplies: every block the host tier stores
//!   is written through to it; a waiting request whose prefix continues
//!   past the host and disk tiers by at least its `min_blocks` asks it on
//!   the reader thread (one round trip, the sequence suspended meanwhile);
//!   whatever it fails to return is computed.
//! - [`DiskTier`] (`disk.rs`): one file per block ([`block_file`], in
//!   `turbine-kv`: a format the kv-store's disk tier shares), its index a byte-bounded
//!   `moka` cache rebuilt from the files at start.
//!
//! **Modelled transfers.** An engine that holds no KV bytes (the mocker)
//! still gets both tiers, with [`ModelledTransfer`]: each block is a stamp
//! of its hashes (checksummed and written to disk like real bytes) that
//! counts as the modelled block size against the tiers' capacities, and
//! onboarding takes the modelled bytes over the tier's bandwidth. Every
//! onboard then waits off the engine thread, as disk reads do, so the other
//! sequences keep stepping meanwhile (as copies overlap compute on a GPU),
//! and onboards queue behind each other on one link.

mod disk;
pub mod fetch;
mod host;
mod remote;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use turbine_kv::{BlockHashes, KvEvent, SequenceHash, Tier};

use turbine_kv::{KvMemory, block_checksum};

pub use disk::DiskTier;
pub use fetch::{FetchEstimates, FetchPolicy};
pub use host::HostTier;
pub use remote::{RemoteGetError, RemoteOffload, RemoteStore, RemoteTier};
pub use turbine_kv::HostBlock;
pub use turbine_kv::block_file;

/// Counters of one tier, readable from any thread.
#[derive(Debug, Default)]
pub struct TierStats {
    /// Blocks copied into the tier.
    pub offloaded_blocks: AtomicU64,
    /// Bytes copied into the tier.
    pub offloaded_bytes: AtomicU64,
    /// Blocks not copied into the tier because copies fell behind (or, on
    /// disk, a write failed).
    pub offloads_skipped: AtomicU64,
    /// Blocks onboarded from the tier into G1.
    pub onboarded_blocks: AtomicU64,
    /// Bytes read from the tier for onboards (disk and shared tiers: what
    /// the reader thread fetched, installed or not).
    pub read_bytes: AtomicU64,
    /// Microseconds the reader thread spent reading from the tier (read
    /// bytes over it: the tier's bandwidth as onboards see it).
    pub read_micros: AtomicU64,
    /// Reads or writes that failed (the shared tier: the store down, slow
    /// or refusing).
    pub failures: AtomicU64,
    /// Blocks dropped because their bytes no longer matched their checksum
    /// (or, on disk, could not be read).
    pub corrupt_blocks: AtomicU64,
    /// Blocks evicted for room.
    pub evicted_blocks: AtomicU64,
    /// Of `evicted_blocks`, those evicted because their tenant held more
    /// than its fair share of the tier (its capacity over the tenants
    /// holding blocks) when another block needed room.
    pub fair_share_evictions: AtomicU64,
}

/// Events of a tier, waiting for the engine loop to number them.
type PendingEvents = Arc<Mutex<Vec<KvEvent>>>;

/// Where the lowest local tier's evictions go when the shared tier takes
/// blocks on eviction ([`RemoteOffload::OnEvict`]); unconnected, nowhere.
#[derive(Clone, Default)]
pub(crate) struct EvictionSink(Arc<std::sync::OnceLock<EvictedBlocks>>);

/// The queue of evicted blocks on their way to the shared tier, and that
/// tier's counters (a full queue skips the block).
struct EvictedBlocks {
    queue: std::sync::mpsc::SyncSender<(SequenceHash, Arc<HostBlock>)>,
    stats: Arc<TierStats>,
}

impl EvictionSink {
    /// Whether evictions are wanted (then they are worth reading back).
    pub(crate) fn is_connected(&self) -> bool {
        self.0.get().is_some()
    }

    /// Hands an evicted block over, without waiting.
    pub(crate) fn offer(&self, hash: SequenceHash, block: Arc<HostBlock>) {
        if let Some(evicted) = self.0.get()
            && evicted.queue.try_send((hash, block)).is_err()
        {
            evicted.stats.offloads_skipped.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn connect(&self, evicted: EvictedBlocks) {
        let _ = self.0.set(evicted);
    }
}

fn push_removed(events: &PendingEvents, hash: SequenceHash, tier: Tier) {
    let mut events = events.lock();
    match events.last_mut() {
        Some(KvEvent::Removed { sequence_hashes, tier: last }) if *last == tier => sequence_hashes.push(hash),
        _ => events.push(KvEvent::Removed { sequence_hashes: vec![hash], tier }),
    }
}

/// The tiers an engine keeps below its pool.
#[derive(Debug, Clone, Default)]
pub struct KvTiers {
    /// Host memory (G2); its evictions go to its disk tier, if it has one
    /// ([`HostTier::with_disk`]).
    pub host: Option<HostTier>,
    /// The pool's bytes, where offloads copy from. Without it (an engine
    /// that exposes no KV memory, such as the mocker) nothing is offloaded,
    /// unless transfers are modelled.
    pub memory: Option<KvMemory>,
    /// For an engine without KV memory: the block size and bandwidths its
    /// tiers model (the tiers are then built with
    /// [`HostTier::modelled`] and [`DiskTier::open_modelled`]).
    pub modelled: Option<ModelledTransfer>,
    /// The shared tier (G4): every block the host tier stores is written
    /// through to it, and a waiting request's prefix that continues there
    /// is fetched from it. Needs the host tier.
    pub remote: Option<RemoteTier>,
    /// Whether a prefix found on disk or in the shared tier is read or
    /// computed ([`fetch`]).
    pub fetch: FetchPolicy,
}

/// Transfers modelled for an engine that holds no KV bytes (the mocker).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelledTransfer {
    /// Bytes one block stands for.
    pub block_bytes: u64,
    /// Host memory to the pool, bytes per second.
    pub host_bytes_per_sec: f64,
    /// Disk to the pool, bytes per second.
    pub disk_bytes_per_sec: f64,
    /// The shared tier (a kv-store over the network) to the pool, bytes
    /// per second: blocks it returns take this long on top of the call.
    pub remote_bytes_per_sec: f64,
}

impl ModelledTransfer {
    /// Time to move `blocks` blocks from the shared tier.
    pub fn remote_time(&self, blocks: usize) -> Duration {
        Duration::from_secs_f64(blocks as f64 * self.block_bytes as f64 / self.remote_bytes_per_sec.max(f64::MIN_POSITIVE))
    }

    /// Time to onboard `host` blocks from host memory and `disk` blocks
    /// from disk.
    pub fn onboard_time(&self, host: usize, disk: usize) -> Duration {
        let bytes = |blocks: usize| blocks as f64 * self.block_bytes as f64;
        Duration::from_secs_f64(bytes(host) / self.host_bytes_per_sec.max(f64::MIN_POSITIVE) + bytes(disk) / self.disk_bytes_per_sec.max(f64::MIN_POSITIVE))
    }
}

/// The bytes of a modelled block as tiers and the kv-store hold it
/// ([`ModelledTransfer`]): its two hashes.
pub const STAMP_BYTES: usize = 16;

/// A modelled block: its hashes, standing in for its bytes.
fn stamp(hashes: BlockHashes, parent: Option<SequenceHash>) -> HostBlock {
    let mut bytes = [0u8; STAMP_BYTES];
    bytes[..8].copy_from_slice(&hashes.sequence.0.to_le_bytes());
    bytes[8..].copy_from_slice(&hashes.local.0.to_le_bytes());
    HostBlock { local: hashes.local, parent, checksum: block_checksum(&bytes), bytes: bytes.into(), tenant: turbine_kv::KvTenant::SHARED }
}

/// Where offloaded blocks' bytes come from.
pub(crate) enum BlockSource {
    /// The pool's memory.
    Memory(KvMemory),
    /// Nowhere: blocks are stamps ([`ModelledTransfer`]).
    Modelled,
}

/// A registered block handed to the offload thread, pinned until it is
/// given back.
#[derive(Debug, Clone, Copy)]
pub(crate) struct OffloadBlock {
    pub block: u32,
    pub parent: Option<SequenceHash>,
    pub hashes: BlockHashes,
    pub tenant: turbine_kv::KvTenant,
}

/// Starts the thread that copies pinned blocks from `memory` into `host`;
/// every batch's blocks come back on the returned receiver once copied
/// (or found unreadable), to be unpinned by the engine.
pub(crate) fn spawn_offload(
    source: BlockSource,
    host: HostTier,
    remote: Option<RemoteTier>,
) -> (std::sync::mpsc::Sender<Vec<OffloadBlock>>, std::sync::mpsc::Receiver<Vec<u32>>) {
    let (jobs, job_receiver) = std::sync::mpsc::channel::<Vec<OffloadBlock>>();
    let (done_sender, done) = std::sync::mpsc::channel();
    let host_of_run = host.clone();
    // A run goes to the host tier and, written through, to the shared one.
    let remote = remote.filter(|remote| remote.offload() == RemoteOffload::WriteThrough);
    let store_run = move |run: Vec<(SequenceHash, HostBlock)>| {
        let run: Vec<(SequenceHash, Arc<HostBlock>)> = run.into_iter().map(|(hash, block)| (hash, Arc::new(block))).collect();
        if let Some(remote) = &remote {
            remote.put_run(&run);
        }
        host.insert_shared_run(run);
    };
    std::thread::Builder::new()
        .name("turbine-kv-offload".into())
        .spawn(move || {
            let mut scratch = Vec::new();
            while let Ok(batch) = job_receiver.recv() {
                let mut run: Vec<(SequenceHash, HostBlock)> = Vec::new();
                for item in &batch {
                    // A new run where the chain breaks.
                    if run.last().map(|(hash, _)| Some(*hash)) != Some(item.parent) {
                        store_run(std::mem::take(&mut run));
                    }
                    if host_of_run.contains(item.hashes.sequence) {
                        // Onboarded from this tier, or stored by another sequence.
                        store_run(std::mem::take(&mut run));
                        continue;
                    }
                    let copied = match &source {
                        #[allow(unsafe_code)]
                        // SAFETY: the engine pinned the block (a full, registered
                        // block it never writes) until this batch is given back.
                        BlockSource::Memory(memory) => unsafe {
                            memory.with_block(item.block, &mut scratch, |bytes| HostBlock {
                                local: item.hashes.local,
                                parent: item.parent,
                                checksum: block_checksum(bytes),
                                bytes: bytes.into(),
                                tenant: item.tenant,
                            })
                        },
                        BlockSource::Modelled => Ok(HostBlock { tenant: item.tenant, ..stamp(item.hashes, item.parent) }),
                    };
                    match copied {
                        Ok(block) => run.push((item.hashes.sequence, block)),
                        Err(error) => tracing::warn!(%error, "cannot copy a KV block to the host tier"),
                    }
                }
                store_run(run);
                if done_sender.send(batch.iter().map(|item| item.block).collect()).is_err() {
                    break;
                }
            }
        })
        .expect("spawn the KV offload thread");
    (jobs, done)
}

/// Most evicted blocks queued for the shared tier; beyond it they are
/// skipped (counted), nothing waits.
const EVICTED_QUEUE: usize = 1024;

/// With [`RemoteOffload::OnEvict`]: connects the lowest local tier's
/// evictions (the disk's if `host` has one, else the host tier's) to a
/// thread that puts them to `remote` in chain runs.
pub(crate) fn offload_evictions(host: &HostTier, remote: &RemoteTier) {
    let (queue, evicted) = std::sync::mpsc::sync_channel::<(SequenceHash, Arc<HostBlock>)>(EVICTED_QUEUE);
    let sink = match host.disk() {
        Some(disk) => disk.eviction_sink(),
        None => host.eviction_sink(),
    };
    sink.connect(EvictedBlocks { queue, stats: remote.shared_stats() });
    let remote = remote.clone();
    std::thread::Builder::new()
        .name("turbine-kv-evicted".into())
        .spawn(move || {
            while let Ok(first) = evicted.recv() {
                // Whatever else was evicted meanwhile goes in the same call,
                // cut into runs where the chain breaks.
                let mut batch = vec![first];
                while batch.len() < 256
                    && let Ok(next) = evicted.try_recv()
                {
                    batch.push(next);
                }
                let mut run: Vec<(SequenceHash, Arc<HostBlock>)> = Vec::new();
                for (hash, block) in batch {
                    if run.last().map(|(last, _)| Some(*last)) != Some(block.parent) {
                        remote.put_run(&std::mem::take(&mut run));
                    }
                    run.push((hash, block));
                }
                remote.put_run(&run);
            }
        })
        .expect("spawn the KV eviction offload thread");
}

/// Disk (and shared-tier) blocks to read for a waiting request.
pub(crate) struct ReadJob {
    /// The suspended sequence.
    pub id: crate::scheduler::SeqId,
    /// The hashes of the blocks after the host tier's, in chain order
    /// (empty: none to read): read from disk while it has them, then from
    /// the shared tier if `remote`.
    pub hashes: Vec<BlockHashes>,
    /// Whether to read the disk first (false: the shared tier is asked
    /// for every block, the disk's included).
    pub disk: bool,
    /// Whether to ask the shared tier for what the disk lacks.
    pub remote: bool,
    /// Host-tier blocks onboarded with them (their time is modelled, if
    /// transfers are).
    pub host_blocks: usize,
}

/// What a [`ReadJob`] found: the leading blocks that were on disk or in
/// host memory (then in the shared tier) and intact.
pub(crate) struct ReadDone {
    pub id: crate::scheduler::SeqId,
    pub blocks: Vec<Arc<HostBlock>>,
    /// How many of `blocks` came from host memory (a chain's tail, still
    /// there after its head went to disk).
    pub from_host: usize,
    /// How many of `blocks` (the last ones) came from the shared tier.
    pub from_remote: usize,
}

/// Counts a read of `blocks` that began at `started` against `stats`.
fn count_read(stats: &TierStats, blocks: &[Arc<HostBlock>], started: Instant) {
    use std::sync::atomic::Ordering::Relaxed;
    let bytes: usize = blocks.iter().map(|block| block.bytes.len()).sum();
    stats.read_bytes.fetch_add(bytes as u64, Relaxed);
    stats.read_micros.fetch_add(started.elapsed().as_micros() as u64, Relaxed);
}

/// The leading blocks of `hashes` on `disk` or in `host` memory, each
/// read from where it is, and how many came from `host`. A chain leaves
/// host memory head first (its oldest blocks are the least recently used),
/// so its head is often on disk while its tail is still in memory: a read
/// of the disk alone would end where the disk's part does.
fn read_disk_or_host(disk: &DiskTier, host: &HostTier, hashes: &[BlockHashes]) -> (Vec<Arc<HostBlock>>, usize) {
    let mut blocks = Vec::new();
    let mut from_host = 0;
    loop {
        let on_disk = disk.read_run(&hashes[blocks.len()..]);
        let in_memory = host.lookup_run(&hashes[blocks.len() + on_disk.len()..]);
        if on_disk.is_empty() && in_memory.is_empty() {
            return (blocks, from_host);
        }
        from_host += in_memory.len();
        blocks.extend(on_disk);
        blocks.extend(in_memory);
    }
}

/// Starts the thread that reads disk blocks (and host blocks after them)
/// for waiting requests and, with modelled transfers, takes each onboard's
/// modelled time.
pub(crate) fn spawn_reader(
    host: HostTier,
    remote: Option<RemoteTier>,
    modelled: Option<ModelledTransfer>,
    fetch: Arc<Mutex<fetch::FetchModel>>,
) -> (std::sync::mpsc::Sender<ReadJob>, std::sync::mpsc::Receiver<ReadDone>) {
    let (jobs, job_receiver) = std::sync::mpsc::channel::<ReadJob>();
    let (done_sender, done) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("turbine-kv-onboard".into())
        .spawn(move || {
            while let Ok(job) = job_receiver.recv() {
                let started = Instant::now();
                let (mut blocks, from_host) = match host.disk() {
                    Some(disk) if job.disk && !job.hashes.is_empty() => {
                        let (read, from_host) = read_disk_or_host(disk, &host, &job.hashes);
                        count_read(disk.stats(), &read, started);
                        (read, from_host)
                    }
                    _ => (Vec::new(), 0),
                };
                let from_disk = blocks.len() - from_host;
                let disk_read = started.elapsed();
                if let Some(modelled) = modelled {
                    std::thread::sleep(modelled.onboard_time(job.host_blocks + from_host, from_disk).saturating_sub(started.elapsed()));
                }
                if job.disk {
                    // The disk's share of the time (modelled, if transfers are).
                    let took = disk_read + modelled.map_or(Duration::ZERO, |modelled| modelled.onboard_time(0, from_disk));
                    fetch.lock().observe_disk(from_disk, 0, took, Instant::now());
                }
                if let Some(remote) = remote.as_ref().filter(|_| job.remote) {
                    // The store is the worker's code: one that panics is a
                    // miss, and the reader lives on for the next request.
                    let asked = Instant::now();
                    let wanted = &job.hashes[from_disk + from_host..];
                    let fetched = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| remote.get_run(wanted)));
                    let returned = match &fetched {
                        Ok(Ok(fetched)) => fetched.len(),
                        _ => 0,
                    };
                    if let Some(modelled) = modelled {
                        // Stamps stand for the blocks' bytes: their transfer is modelled.
                        std::thread::sleep(modelled.remote_time(returned).saturating_sub(asked.elapsed()));
                    }
                    fetch.lock().observe_remote(returned, wanted.len(), asked.elapsed(), Instant::now());
                    match fetched {
                        Ok(Ok(fetched)) => {
                            count_read(remote.stats(), &fetched, asked);
                            blocks.extend(fetched);
                        }
                        Ok(Err(_)) => {
                            remote.stats().failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        }
                        Err(_) => {
                            remote.stats().failures.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            tracing::error!("the shared KV tier failed (panicked) on a fetch; computing the prefix instead");
                        }
                    }
                }
                let from_remote = blocks.len() - from_disk - from_host;
                if done_sender.send(ReadDone { id: job.id, blocks, from_host, from_remote }).is_err() {
                    break;
                }
            }
        })
        .expect("spawn the KV onboard thread");
    (jobs, done)
}

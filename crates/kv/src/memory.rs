//! The KV pool's memory as other parts of a worker see it: one contiguous,
//! page-aligned allocation in which every block is one contiguous span of
//! `block_bytes`, so a block moves between workers as one read (a UCX get,
//! a TCP chunk) and is checked with one checksum.
//!
//! The engine computes into the buffer; a transfer reads blocks out of it
//! (a prefill worker's pinned blocks, read by a decode worker). The rule
//! that keeps this sound: a block is read by a transfer only while it is
//! pinned, and a pinned block is full, so the engine never writes it (the
//! engine writes only the positions a sequence is computing, which lie in
//! blocks no other sequence or pin holds).

#![allow(unsafe_code)]

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::KvLayout;

/// Alignment of the buffer: a page, as memory registration prefers.
const ALIGN: usize = 4096;

/// The KV pool's bytes, shared by the engine and transfers: a zeroed,
/// page-aligned heap allocation, or memory someone else provides (shared
/// memory that peers on the same machine can map, see [`KvAllocator`]; a
/// tensor's storage).
pub struct KvBuffer {
    ptr: NonNull<u8>,
    len: usize,
    /// Who frees the memory: `None` for the heap, else the provider's
    /// handle, dropped with the buffer.
    owner: Option<Box<dyn Send + Sync>>,
}

// SAFETY: the buffer is plain memory; who may touch which bytes when is the
// module's pinning rule, upheld by the engine and the transfer service.
unsafe impl Send for KvBuffer {}
unsafe impl Sync for KvBuffer {}

impl std::fmt::Debug for KvBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvBuffer").field("len", &self.len).field("provided", &self.owner.is_some()).finish()
    }
}

impl KvBuffer {
    /// Allocates `len` zeroed bytes (at least one page) on the heap.
    pub fn zeroed(len: usize) -> Self {
        let layout = Layout::from_size_align(len.max(ALIGN), ALIGN).expect("KV buffer size overflows");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        Self { ptr, len, owner: None }
    }

    /// Wraps memory someone else allocated; dropping the buffer drops
    /// `owner`, which frees it.
    ///
    /// # Safety
    /// `ptr` points to `len` initialised, writable bytes, aligned for the
    /// pool's element type (page alignment is best for registration), that
    /// stay mapped until `owner` drops and that only the engine owning the
    /// pool writes, under this module's pinning rule.
    pub unsafe fn provided(ptr: NonNull<u8>, len: usize, owner: Box<dyn Send + Sync>) -> Self {
        Self { ptr, len, owner: Some(owner) }
    }

    /// Whether the memory came from a provider rather than the heap.
    pub fn is_provided(&self) -> bool {
        self.owner.is_some()
    }

    /// The first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Bytes in the buffer.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes, while nothing else can see the buffer (before it is
    /// shared).
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: `len` bytes allocated; `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for KvBuffer {
    fn drop(&mut self) {
        if self.owner.take().is_some() {
            // The provider's handle, just dropped, freed the memory.
            return;
        }
        let layout = Layout::from_size_align(self.len.max(ALIGN), ALIGN).expect("layout was valid at allocation");
        // SAFETY: allocated in `zeroed` with this layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) };
    }
}

/// Where an engine gets its KV pool's memory when the heap will not do:
/// called once with the pool's size in bytes. A provider that cannot
/// allocate falls back to [`KvBuffer::zeroed`] itself.
#[derive(Clone)]
pub struct KvAllocator(Arc<dyn Fn(usize) -> KvBuffer + Send + Sync>);

impl KvAllocator {
    /// An allocator calling `allocate`.
    pub fn new(allocate: impl Fn(usize) -> KvBuffer + Send + Sync + 'static) -> Self {
        Self(Arc::new(allocate))
    }

    /// A buffer of `len` bytes.
    pub fn allocate(&self, len: usize) -> KvBuffer {
        (self.0)(len)
    }
}

impl PartialEq for KvAllocator {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for KvAllocator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KvAllocator")
    }
}

/// A KV pool in device (GPU) memory: peers read it where it is (UCX
/// registers it with its memory type), and this worker copies blocks to the
/// host through the engine's device when it must (checksums, the TCP
/// stream).
pub trait DeviceKv: Send + Sync + std::fmt::Debug {
    /// Device address of the pool's first byte.
    fn address(&self) -> u64;
    /// Bytes in the pool.
    fn len(&self) -> usize;
    /// Whether the pool is empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The memory's kind and device, e.g. CUDA device 0.
    fn kind(&self) -> DeviceMemory;
    /// Copies `into.len()` bytes at `offset` to the host.
    fn read(&self, offset: usize, into: &mut [u8]) -> Result<(), DeviceReadError>;
}

/// Why a device pool's bytes could not be copied to the host.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceReadError {
    /// The bytes asked for are not (whole rows) inside the pool.
    #[error("bytes {offset}..{end} are not whole rows inside the device pool of {len} bytes")]
    OutOfRange {
        /// First byte asked for.
        offset: usize,
        /// One past the last.
        end: usize,
        /// Bytes in the pool.
        len: usize,
    },
    /// The device's copy failed, in its runtime's words.
    #[error("the device copy failed: {0}")]
    Copy(String),
}

/// Kinds of device memory a pool can live in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceMemory {
    /// A CUDA device (ordinal).
    Cuda(usize),
}

/// Where a pool's bytes are.
#[derive(Debug, Clone)]
enum Storage {
    Host(Arc<KvBuffer>),
    Device(Arc<dyn DeviceKv>),
}

/// A worker's KV pool as transfers see it: where its bytes are and their
/// layout.
#[derive(Debug, Clone)]
pub struct KvMemory {
    storage: Storage,
    layout: KvLayout,
    num_blocks: usize,
}

impl KvMemory {
    /// Describes `buffer` as `num_blocks` blocks of `layout.block_bytes`.
    pub fn new(buffer: Arc<KvBuffer>, layout: KvLayout, num_blocks: usize) -> Self {
        assert!(num_blocks * layout.block_bytes <= buffer.len(), "the blocks exceed the buffer");
        Self { storage: Storage::Host(buffer), layout, num_blocks }
    }

    /// Describes a device pool as `num_blocks` blocks of `layout.block_bytes`.
    pub fn on_device(device: Arc<dyn DeviceKv>, layout: KvLayout, num_blocks: usize) -> Self {
        assert!(num_blocks * layout.block_bytes <= device.len(), "the blocks exceed the device pool");
        Self { storage: Storage::Device(device), layout, num_blocks }
    }

    /// The layout.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// The host buffer (for memory registration); `None` for a device pool.
    pub fn buffer(&self) -> Option<&Arc<KvBuffer>> {
        match &self.storage {
            Storage::Host(buffer) => Some(buffer),
            Storage::Device(_) => None,
        }
    }

    /// The device pool; `None` for a host pool.
    pub fn device(&self) -> Option<&Arc<dyn DeviceKv>> {
        match &self.storage {
            Storage::Host(_) => None,
            Storage::Device(device) => Some(device),
        }
    }

    /// Byte offset of a block in the pool.
    pub fn block_offset(&self, block: u32) -> usize {
        block as usize * self.layout.block_bytes
    }

    /// The bytes of a host pool's block; `None` for a device pool (see
    /// [`with_block`](Self::with_block)).
    ///
    /// # Safety
    /// The block must be pinned (see the module's rule) for as long as the
    /// slice is used.
    pub unsafe fn block(&self, block: u32) -> Option<&[u8]> {
        assert!((block as usize) < self.num_blocks, "block {block} is outside the pool");
        let Storage::Host(buffer) = &self.storage else { return None };
        // SAFETY: in bounds (checked); not written while pinned (caller).
        Some(unsafe { std::slice::from_raw_parts(buffer.as_ptr().add(self.block_offset(block)), self.layout.block_bytes) })
    }

    /// Calls `f` with a block's bytes: in place for a host pool, copied to
    /// the host (into `scratch`) for a device pool.
    ///
    /// # Safety
    /// The block must be pinned (see the module's rule) during the call.
    pub unsafe fn with_block<R>(&self, block: u32, scratch: &mut Vec<u8>, f: impl FnOnce(&[u8]) -> R) -> Result<R, DeviceReadError> {
        // SAFETY: the caller's promise.
        if let Some(bytes) = unsafe { self.block(block) } {
            return Ok(f(bytes));
        }
        let Storage::Device(device) = &self.storage else { unreachable!("a host pool has its blocks in place") };
        scratch.resize(self.layout.block_bytes, 0);
        device.read(self.block_offset(block), scratch)?;
        Ok(f(scratch))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(block_bytes: usize) -> KvLayout {
        KvLayout { block_bytes, block_size: 1, layers: 1, kv_heads: 1, head_dim: 1, dtype: "bytes".into(), order: "test".into() }
    }

    /// Device memory as seen from the host: the copies a GPU pool's reads
    /// make, out of a buffer standing in for the device.
    #[derive(Debug)]
    struct CopiedOut(Vec<u8>);

    impl DeviceKv for CopiedOut {
        fn address(&self) -> u64 {
            0x1000
        }
        fn len(&self) -> usize {
            self.0.len()
        }
        fn kind(&self) -> DeviceMemory {
            DeviceMemory::Cuda(0)
        }
        fn read(&self, offset: usize, into: &mut [u8]) -> Result<(), DeviceReadError> {
            let end = offset + into.len();
            let bytes = self.0.get(offset..end).ok_or(DeviceReadError::OutOfRange { offset, end, len: self.0.len() })?;
            into.copy_from_slice(bytes);
            Ok(())
        }
    }

    #[test]
    #[allow(unsafe_code)]
    fn blocks_are_read_in_place_on_the_host_and_copied_out_of_a_device() {
        let mut buffer = KvBuffer::zeroed(4 * 8);
        for (i, byte) in buffer.as_mut_slice().iter_mut().enumerate() {
            *byte = i as u8;
        }
        let host = KvMemory::new(Arc::new(buffer), layout(8), 4);
        let device = KvMemory::on_device(Arc::new(CopiedOut((0..32).collect())), layout(8), 4);
        assert!(host.buffer().is_some() && host.device().is_none());
        assert!(device.buffer().is_none() && device.device().is_some());
        let mut scratch = Vec::new();
        for block in 0..4 {
            // SAFETY: nothing writes these pools.
            let (on_host, on_device) = unsafe {
                (host.with_block(block, &mut scratch, |bytes| bytes.to_vec()).unwrap(), device.with_block(block, &mut scratch, |bytes| bytes.to_vec()).unwrap())
            };
            assert_eq!(on_host, (block as u8 * 8..block as u8 * 8 + 8).collect::<Vec<u8>>());
            assert_eq!(on_device, on_host);
            // SAFETY: as above.
            assert!(unsafe { device.block(block) }.is_none(), "a device block has no host slice");
        }
    }
}

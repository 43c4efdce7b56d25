//! The UCX shared-memory context a prefill worker allocates its KV pool
//! from.

use std::ptr::NonNull;
use std::sync::Arc;

use parking_lot::Mutex;
use turbine_kv::{KvAllocator, KvBuffer, KvMemory};
use turbine_ucx::{Context, MemoryRegion, UcxError};

/// The UCX shared-memory context a prefill worker allocates its KV pool
/// from, so that same-machine peers can map it.
pub struct ShmPool {
    pub(crate) context: Context,
    region: Mutex<Option<Arc<MemoryRegion>>>,
}

impl std::fmt::Debug for ShmPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmPool").field("allocated", &self.region.lock().as_ref().map(|region| region.len())).finish()
    }
}

/// Why the KV pool could not be allocated in shared memory (it then stays
/// on the heap).
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    /// The shared-memory file system's free space could not be read.
    #[error("cannot read the free space of {0}")]
    Unreadable(String),
    /// It has too little room for the pool.
    #[error("{dir} has {free_mib} MiB free, the pool needs {needed_mib} MiB (give the container more shared memory, e.g. compose `shm_size`)")]
    TooSmall {
        /// The file system (`UCX_POSIX_DIR`, else `/dev/shm`).
        dir: String,
        /// Its free space.
        free_mib: u64,
        /// The pool's size.
        needed_mib: u64,
    },
    /// UCX refused the allocation.
    #[error(transparent)]
    Ucx(#[from] UcxError),
    /// UCX returned memory not aligned to a page.
    #[error("UCX returned unaligned memory")]
    Unaligned,
    /// UCX returned less than was asked for.
    #[error("UCX allocated {allocated} of {asked} bytes")]
    Short {
        /// Bytes returned.
        allocated: usize,
        /// Bytes asked for.
        asked: usize,
    },
}

impl ShmPool {
    /// The shared-memory context; `None` when `UCX_TLS` chooses transports
    /// (the operator's choice wins) or UCX cannot start one.
    pub fn open() -> Option<Arc<Self>> {
        match shm_context() {
            Ok(context) => Some(Arc::new(Self { context: context?, region: Mutex::new(None) })),
            Err(error) => {
                tracing::debug!(%error, "no shared-memory UCX context; the KV pool stays on the heap");
                None
            }
        }
    }

    /// An allocator for the engine: the pool in shared memory when the
    /// shared-memory file system has room for it, else on the heap.
    pub fn allocator(self: &Arc<Self>) -> KvAllocator {
        let pool = self.clone();
        KvAllocator::new(move |bytes| {
            pool.allocate(bytes).unwrap_or_else(|why| {
                tracing::warn!(mib = bytes >> 20, %why, "the KV pool stays on the heap; same-machine decode workers read it with UCX gets (slower)");
                KvBuffer::zeroed(bytes)
            })
        })
    }

    fn allocate(&self, bytes: usize) -> Result<KvBuffer, ShmError> {
        // Shared memory lives in a tmpfs (a container's is often 64 MiB):
        // touching pages past its size would kill the worker, so make sure
        // the pool fits before asking for it.
        let dir = std::env::var("UCX_POSIX_DIR").unwrap_or_else(|_| "/dev/shm".into());
        let free = free_bytes(&dir).ok_or_else(|| ShmError::Unreadable(dir.clone()))?;
        if free < bytes as u64 + (64 << 20) {
            return Err(ShmError::TooSmall { dir, free_mib: free >> 20, needed_mib: bytes as u64 >> 20 });
        }
        let region = Arc::new(MemoryRegion::allocate(&self.context, bytes)?);
        let ptr = NonNull::new(region.as_ptr()).filter(|ptr| (ptr.as_ptr() as usize).is_multiple_of(4096)).ok_or(ShmError::Unaligned)?;
        if region.len() < bytes {
            return Err(ShmError::Short { allocated: region.len(), asked: bytes });
        }
        *self.region.lock() = Some(region.clone());
        // SAFETY: UCX allocated `bytes` fresh (zeroed), page-aligned bytes
        // for us alone; the region (the owner) keeps them mapped.
        #[allow(unsafe_code)]
        Ok(unsafe { KvBuffer::provided(ptr, bytes, Box::new(region)) })
    }

    /// The region backing `memory`, when it is the one this pool allocated.
    pub(crate) fn region_of(&self, memory: &KvMemory) -> Option<Arc<MemoryRegion>> {
        let buffer = memory.buffer()?;
        self.region.lock().clone().filter(|region| region.as_ptr() == buffer.as_ptr())
    }
}

/// Free bytes of the file system holding `dir`.
fn free_bytes(dir: &str) -> Option<u64> {
    let path = std::ffi::CString::new(dir).ok()?;
    // SAFETY: a valid C string and a zeroed out-struct.
    #[allow(unsafe_code)]
    unsafe {
        let mut stat: libc::statvfs = std::mem::zeroed();
        (libc::statvfs(path.as_ptr(), &mut stat) == 0).then(|| stat.f_bavail as u64 * stat.f_frsize as u64)
    }
}

/// A context on the shared-memory transports only; `None` when `UCX_TLS`
/// chooses the transports (the operator's choice wins).
pub(crate) fn shm_context() -> Result<Option<Context>, UcxError> {
    if std::env::var_os("UCX_TLS").is_some() {
        return Ok(None);
    }
    Context::with_transports("posix,self").map(Some)
}

//! Where a prefill worker's KV pool lives.

use turbine_engine::KvAllocator;

use crate::config::{KvTransport, WorkerRole};

/// Shared memory for a prefill worker's KV pool: with UCX, the pool is
/// allocated by UCX's shared-memory allocator so that decode workers on
/// the same machine map it and copy blocks out without the prefill
/// worker's help. Empty (the heap) for other roles, for `--kv-transport
/// tcp`, when `UCX_TLS` is set, and without the `ucx` feature.
#[derive(Debug, Clone, Default)]
pub struct SharedKvPool {
    #[cfg(feature = "ucx")]
    shm: Option<std::sync::Arc<turbine_ucx_agent::ShmPool>>,
}

impl SharedKvPool {
    /// The pool for a worker of `role` moving blocks over `transport`.
    pub fn for_role(role: WorkerRole, transport: KvTransport) -> Self {
        #[cfg(feature = "ucx")]
        return Self { shm: (role == WorkerRole::Prefill && transport != KvTransport::Tcp).then(turbine_ucx_agent::ShmPool::open).flatten() };
        #[cfg(not(feature = "ucx"))]
        {
            let _ = (role, transport);
            Self::default()
        }
    }

    /// The allocator to give the engine (None: the heap).
    pub fn allocator(&self) -> Option<KvAllocator> {
        #[cfg(feature = "ucx")]
        return self.shm.as_ref().map(turbine_ucx_agent::ShmPool::allocator);
        #[cfg(not(feature = "ucx"))]
        None
    }

    /// The shared-memory pool, when the KV pool was allocated there.
    #[cfg(feature = "ucx")]
    pub fn shm(&self) -> Option<std::sync::Arc<turbine_ucx_agent::ShmPool>> {
        self.shm.clone()
    }
}

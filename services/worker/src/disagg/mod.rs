//! Disaggregated serving on a worker.
//!
//! A **prefill** worker computes a prompt ([`Disagg::prefill`], in
//! [`share`]), keeps the prompt's full KV blocks pinned under a lease and
//! returns a [`KvHandle`]: where the blocks are, their hashes and
//! checksums, the layout. A **decode** worker given that handle
//! ([`Disagg::import`], in [`import`]) reads the blocks it does not already
//! cache — UCX one-sided reads of the prefill worker's registered pool when
//! both have UCX, else the `KvTransfer/ReadBlocks` stream — checks every
//! block's checksum, releases the handle, and installs the blocks into its
//! own prefix cache before decoding. Anything wrong on the way (the prefill
//! worker gone, the lease expired, a checksum or layout mismatch, no room)
//! turns into computing the prompt locally: slower, never wrong.
//!
//! [`KvHandle`]: turbine_api::worker::KvHandle

mod import;
mod pool;
mod share;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::Semaphore;
use turbine_api::worker::HandleToken;
use turbine_engine::{EngineHandle, KvLayout, KvMemory};
use turbine_kv::WorkerId;

pub use pool::SharedKvPool;

use crate::config::{KvTransport, WorkerRole};

/// Blocks pinned for a decode worker.
#[derive(Debug)]
struct Pin {
    pin_id: u64,
    /// Who asked for the prefill (counted against its share of the pool).
    requester: Arc<str>,
    /// The handle's capability: calls naming the handle must carry it.
    token: HandleToken,
    blocks: Vec<u32>,
    /// The handle's blocks registered for it alone (a pool keyed per
    /// handle), unregistered when the pin goes.
    #[cfg(feature = "ucx")]
    exposed: Option<share::HandleKeys>,
}

impl Pin {
    /// Unregisters the handle's own UCX keys, if any, and gives the
    /// engine's pin to let go of: the blocks must not be reused while a
    /// key still reaches them.
    fn revoke(self) -> u64 {
        // `exposed` goes with `self`, before the caller unpins.
        self.pin_id
    }
}

/// A worker's disaggregated-serving state.
pub struct Disagg {
    worker_id: WorkerId,
    role: WorkerRole,
    engine: EngineHandle,
    memory: Option<KvMemory>,
    /// Random per start: tells readers when cached descriptions go stale.
    memory_id: u64,
    lease: Duration,
    /// Blocks handles may pin: (in all, per requester).
    pinned_blocks: (usize, usize),
    transport: KvTransport,
    simulated: Option<SimulatedTransfer>,
    /// MiB of blocks in flight to this worker.
    budget: Arc<Semaphore>,
    budget_mib: usize,
    /// Where peers reach this worker's KvTransfer.
    endpoint: OnceLock<String>,
    /// Handles by id. The lock is held while a block is copied out, so a
    /// release (which unpins after removing) never overlaps a copy.
    pins: Arc<Mutex<HashMap<u64, Pin>>>,
    /// Read buffers given back after their blocks were installed (reused:
    /// fresh pages would be faulted in on every read).
    staging: Arc<Mutex<Vec<Vec<u8>>>>,
    #[cfg(feature = "ucx")]
    ucx: Option<turbine_ucx_agent::UcxAgent>,
    /// Peers' UCX regions by memory id (None: the peer has no UCX), for
    /// peers that key their pool whole (one keyed per handle is described
    /// for each handle).
    #[cfg(feature = "ucx")]
    regions: Mutex<HashMap<u64, Option<turbine_engine::UcxRegion>>>,
}

impl std::fmt::Debug for Disagg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Disagg").field("role", &self.role).field("pins", &self.pins.lock().len()).finish_non_exhaustive()
    }
}

/// Settings of [`Disagg::new`].
#[derive(Debug, Clone)]
pub struct DisaggOptions {
    /// The worker's role.
    pub role: WorkerRole,
    /// How long pins wait for a release.
    pub lease: Duration,
    /// How to read peers' blocks.
    pub transport: KvTransport,
    /// MiB of blocks in flight to this worker.
    pub transfer_mib: usize,
    /// How much of the pool handles may pin.
    pub pinned: PinBudget,
    /// The network devices UCX may use.
    pub network: turbine_kv::UcxNetwork,
    /// Whether peers get the pool's key or each handle's own.
    pub keys: turbine_kv::UcxKeys,
    /// Engines without KV memory (the mocker): hand-offs move no bytes but
    /// take the time these would take.
    pub simulated: Option<SimulatedTransfer>,
    /// Where the engine's pool was allocated (see [`SharedKvPool`]).
    pub pool: SharedKvPool,
}

/// How much of a prefill worker's KV pool its handles may pin at once, in
/// all and per requester (shares of the pool's blocks): handles past
/// either are not made (the decode worker computes the prompt).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PinBudget {
    /// Share of the pool all handles together may pin.
    pub pool_share: f64,
    /// Share of the pool one requester's handles may pin.
    pub requester_share: f64,
}

impl PinBudget {
    /// No bound but the pool (a benchmark that shares the whole pool).
    pub const WHOLE_POOL: PinBudget = PinBudget { pool_share: 1.0, requester_share: 1.0 };

    /// Blocks of a `pool_blocks` pool: (all handles, one requester's).
    fn blocks(&self, pool_blocks: usize) -> (usize, usize) {
        let share = |share: f64| (pool_blocks as f64 * share).floor() as usize;
        (share(self.pool_share), share(self.requester_share))
    }
}

/// A modelled KV transfer (for mocker workers): blocks of `block_bytes`
/// read at `bytes_per_sec`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimulatedTransfer {
    /// Bytes of one block of the modelled model.
    pub block_bytes: usize,
    /// Modelled bandwidth (already divided by any simulation speedup).
    pub bytes_per_sec: f64,
}

impl SimulatedTransfer {
    fn layout(&self) -> KvLayout {
        KvLayout::opaque(self.block_bytes, "simulated")
    }
}

impl Disagg {
    /// The state of a worker whose engine exposes `memory` (None: this
    /// worker computes every prompt itself and serves no blocks).
    pub fn new(worker_id: &WorkerId, engine: EngineHandle, memory: Option<KvMemory>, options: &DisaggOptions) -> Self {
        #[cfg(feature = "ucx")]
        let ucx = match (options.transport, options.role) {
            // An aggregated worker neither serves nor reads peers' blocks
            // (the router hands prompts over only from prefill to decode
            // workers): no UCX thread to start, wake and stop.
            (_, WorkerRole::Aggregated) => None,
            _ if options.simulated.is_some() => None,
            _ => match turbine_ucx_agent::UcxAgent::start(memory.as_ref(), options.pool.shm(), &options.network, options.keys) {
                Ok(agent) => Some(agent),
                Err(error) => {
                    tracing::warn!(%error, "UCX is unavailable; KV blocks move over TCP");
                    None
                }
            },
        };
        let pinned_blocks = options.pinned.blocks(engine.config().num_blocks);
        Self {
            worker_id: worker_id.clone(),
            role: options.role,
            engine,
            memory,
            memory_id: rand_u64(),
            lease: options.lease,
            pinned_blocks,
            transport: options.transport,
            simulated: options.simulated,
            budget: Arc::new(Semaphore::new(options.transfer_mib)),
            budget_mib: options.transfer_mib,
            endpoint: OnceLock::new(),
            pins: Arc::new(Mutex::new(HashMap::new())),
            staging: Arc::new(Mutex::new(Vec::new())),
            #[cfg(feature = "ucx")]
            ucx,
            #[cfg(feature = "ucx")]
            regions: Mutex::new(HashMap::new()),
        }
    }

    /// The layout of the blocks this worker hands over and takes in (the
    /// modelled one for a mocker); `None` when it does neither.
    fn layout(&self) -> Option<KvLayout> {
        self.memory.as_ref().map(|memory| memory.layout().clone()).or_else(|| self.simulated.map(|simulated| simulated.layout()))
    }

    /// The worker's role.
    pub fn role(&self) -> WorkerRole {
        self.role
    }

    /// Sets where peers reach this worker's KvTransfer (once).
    pub fn set_endpoint(&self, endpoint: String) {
        let _ = self.endpoint.set(endpoint);
    }

    /// Where peers reach this worker's KvTransfer, once served.
    pub fn endpoint(&self) -> Option<&str> {
        self.endpoint.get().map(String::as_str)
    }

    /// Handles currently pinned.
    pub fn pinned_handles(&self) -> usize {
        self.pins.lock().len()
    }

    /// Whether this worker reads peers' blocks over UCX.
    pub fn has_ucx(&self) -> bool {
        #[cfg(feature = "ucx")]
        return self.ucx.is_some();
        #[cfg(not(feature = "ucx"))]
        false
    }
}

fn rand_u64() -> u64 {
    uuid::Uuid::new_v4().as_u64_pair().0
}

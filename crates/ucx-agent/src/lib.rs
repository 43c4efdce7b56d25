//! The worker's UCX side: one thread owns the UCX workers, keeps the
//! engine's KV pool registered (so peers read pinned blocks with one-sided
//! gets, the engine uninvolved), and runs this worker's own reads of peers'
//! blocks. It sleeps in UCX's wakeup while idle, woken by the network
//! (transports such as TCP need the owner to progress) or by a new job.
//!
//! Two UCX contexts: the main one (UCX's transport choice, endpoints with
//! peer error handling, so a dead peer fails reads instead of hanging
//! them), and, unless `UCX_TLS` restricts transports, a shared-memory-only
//! one for peers on the same machine: UCX's shared-memory transports do not
//! support peer error handling, so with it they would never be chosen and
//! same-machine reads would go over TCP at a tenth of the bandwidth.
//!
//! A prefill worker's pool itself comes from UCX's shared-memory allocator
//! ([`ShmPool`]) when it can: a decode worker on the same machine then maps
//! the pool (`ucp_rkey_ptr`) and its copy threads read the blocks straight
//! out of it, with nothing asked of the prefill worker (not even progress)
//! and nothing a dead prefill worker could leave hanging. Pools UCX did not
//! allocate, and peers on other machines, are read with `ucp_get_nbx`.

mod copy;
mod serve;
mod shm;
mod store_link;

use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use turbine_kv::{DeviceMemory, KvMemory, UcxRangeKey, UcxRegion};

pub use turbine_kv::{UcxKeys, UcxNetwork};
use turbine_ucx::{Context, MemoryRegion, UcxError, Waker, Worker};

pub use shm::{ShmError, ShmPool};
pub use store_link::{KvStoreLink, LinkReadError};

/// How long cancelled reads get to let go of their buffers.
pub(crate) const ABANDON_GRACE: Duration = Duration::from_millis(200);

/// Blocks read from a peer.
#[derive(Debug)]
pub struct Pulled {
    /// The blocks back to back.
    pub bytes: Vec<u8>,
    /// Time spent posting the reads (not waiting for them).
    pub post: Duration,
    /// Time from the first post to the last completion.
    pub total: Duration,
    /// Whether the blocks were copied out of the peer's pool mapped into
    /// this process (else read with gets).
    pub mapped: bool,
}

/// One read for the UCX thread.
pub(crate) struct Job {
    pub(crate) peer: Vec<u8>,
    /// Packed keys over the main context; `key_of[i]` is address i's.
    pub(crate) remote_keys: Vec<Vec<u8>>,
    pub(crate) key_of: Vec<usize>,
    pub(crate) shm_peer: Vec<u8>,
    pub(crate) shm_remote_key: Vec<u8>,
    pub(crate) addresses: Vec<u64>,
    pub(crate) block_bytes: usize,
    pub(crate) into: Vec<u8>,
    pub(crate) deadline: Instant,
    pub(crate) reply: tokio::sync::oneshot::Sender<Result<Pulled, PullError>>,
}

/// Why a read of a peer's blocks failed.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    /// A block asked for lies outside the region the peer described.
    #[error("block at offset {0} lies outside the peer's region")]
    OutsideRegion(u64),
    /// The UCX thread has stopped (the agent is shutting down).
    #[error("the UCX thread stopped")]
    Stopped,
    /// The UCX thread dropped the read or did not answer in time.
    #[error("the UCX thread did not answer in time")]
    NoAnswer,
    /// UCX failed the read (the peer, its key, the transfer, the deadline).
    #[error(transparent)]
    Failed(#[from] turbine_ucx::WaitError),
}
/// Why the UCX thread did not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// UCX refused (its context, a worker, a registration, an address).
    #[error("UCX: {0}")]
    Ucx(#[from] UcxError),
    /// The thread could not be spawned.
    #[error("cannot start the UCX thread: {0}")]
    Thread(#[from] std::io::Error),
    /// The thread died before it said it had started.
    #[error("the UCX thread died while starting")]
    Died,
    /// Memory was given to register, and UCX registered no region for it.
    #[error("UCX registered no region for the memory given")]
    NoRegion,
}

/// The UCX thread of a worker.
pub struct UcxAgent {
    jobs: Option<mpsc::Sender<Job>>,
    waker: Waker,
    region: Option<UcxRegion>,
    /// What registers a handle's runs, when the pool is keyed per handle.
    exposer: Option<Exposer>,
    thread: Option<JoinHandle<()>>,
}

/// Registers parts of the pool on the main context
/// ([`UcxKeys::PerHandle`]).
struct Exposer {
    context: Context,
    memory: KvMemory,
}

/// Runs of a pool registered for one handle ([`UcxAgent::expose`]):
/// unregistered when dropped, after which (on fabrics that check remote
/// keys) their keys read nothing.
pub struct Exposed {
    regions: Vec<MemoryRegion>,
    keys: Vec<UcxRangeKey>,
    /// Keeps the pool allocated until the regions (dropped first) go.
    _memory: KvMemory,
}

impl std::fmt::Debug for Exposed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Exposed").field("runs", &self.regions.len()).finish()
    }
}

impl Exposed {
    /// The runs' keys, for `Describe`.
    pub fn range_keys(&self) -> &[UcxRangeKey] {
        &self.keys
    }
}

impl std::fmt::Debug for UcxAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxAgent").field("serves_memory", &self.region.is_some()).finish()
    }
}

impl UcxAgent {
    /// Starts the thread; registers `memory` for peers when given (with
    /// `pool`'s region, when `pool` allocated it). The main context uses
    /// only the devices `network` allows (see [`UcxNetwork`]); the
    /// shared-memory one reaches only this machine's processes of this
    /// user.
    ///
    /// Keyed [`UcxKeys::PerHandle`], the main context registers none of
    /// the pool: [`expose`](Self::expose) registers a handle's runs, and
    /// the registration cache is off there, so that an unregistered run's
    /// key is revoked at once rather than kept cached.
    pub fn start(memory: Option<&KvMemory>, pool: Option<Arc<ShmPool>>, network: &UcxNetwork, keys: UcxKeys) -> Result<Self, StartError> {
        let (jobs, receiver) = mpsc::channel();
        let (ready, started) = mpsc::channel();
        let memory = memory.cloned();
        let memory_for_exposer = memory.clone();
        let network = network.clone();
        let thread = std::thread::Builder::new().name("turbine-ucx".into()).spawn(move || {
            // Host pools are registered with both contexts; a device
            // pool only with the main one (shared memory cannot map it).
            let register = |context: &Context, main: bool| -> Result<Option<Arc<MemoryRegion>>, UcxError> {
                let Some(memory) = &memory else { return Ok(None) };
                // SAFETY: the pool lives as long as `memory`, which this
                // thread holds past the regions' drop.
                #[allow(unsafe_code)]
                let region = match (memory.buffer(), memory.device()) {
                    (Some(buffer), _) => unsafe { MemoryRegion::register(context, buffer.as_ptr(), buffer.len()) }?,
                    (None, Some(device)) if main => match device.kind() {
                        DeviceMemory::Cuda(_) => unsafe { MemoryRegion::register_cuda(context, device.address(), device.len()) }?,
                    },
                    _ => return Ok(None),
                };
                Ok(Some(Arc::new(region)))
            };
            type Region = Option<Arc<MemoryRegion>>;
            type Setup = (Worker, Region, Option<(Worker, Region)>, Option<UcxRegion>, Option<Context>);
            let per_handle = keys == UcxKeys::PerHandle && memory.is_some();
            let setup = || -> Result<Setup, UcxError> {
                let mut settings: Vec<(&str, &str)> = match &network {
                    UcxNetwork::Any => Vec::new(),
                    UcxNetwork::Devices(devices) => vec![("NET_DEVICES", devices)],
                    // Loopback within the process only: nothing listens.
                    UcxNetwork::Off => vec![("TLS", "self")],
                };
                if per_handle {
                    settings.extend(NO_REGISTRATION_CACHE);
                }
                let context = if settings.is_empty() { Context::with_wakeup()? } else { Context::with_settings(&settings)? };
                let worker = Worker::new(&context)?;
                let region = if per_handle { None } else { register(&context, true)? };
                let shm_context = match &pool {
                    Some(pool) => Ok(Some(pool.context.clone())),
                    None => shm::shm_context(),
                };
                let shm = shm_context.and_then(|context| {
                    let Some(context) = context else { return Ok(None) };
                    let allocated = match (&pool, &memory) {
                        (Some(pool), Some(memory)) => pool.region_of(memory),
                        _ => None,
                    };
                    let region = match allocated {
                        Some(region) => Some(region),
                        None => register(&context, false)?,
                    };
                    Ok(Some((Worker::new(&context)?, region)))
                });
                let shm = shm.unwrap_or_else(|error: UcxError| {
                    tracing::debug!(%error, "no shared-memory UCX context; same-machine reads use the main one");
                    None
                });
                // The pool's place: its registration's, or (keyed per
                // handle, nothing registered) the memory's own.
                let pool_key = match (&region, &memory) {
                    (Some(region), _) => Some((region.packed_rkey()?, region.address(), region.len() as u64)),
                    (None, Some(memory)) if per_handle => Some((Vec::new(), pool_address(memory), pool_length(memory))),
                    (None, _) => None,
                };
                let described = match pool_key {
                    Some((remote_key, base_address, length)) => Some(UcxRegion {
                        worker_address: worker.address()?,
                        remote_key,
                        base_address,
                        length,
                        shm_worker_address: match &shm {
                            Some((shm_worker, Some(_))) => shm_worker.address()?,
                            _ => Vec::new(),
                        },
                        shm_remote_key: match &shm {
                            Some((_, Some(shm_region))) => shm_region.packed_rkey()?,
                            _ => Vec::new(),
                        },
                        range_keys: Vec::new(),
                    }),
                    None => None,
                };
                Ok((worker, region, shm, described, per_handle.then(|| context.clone())))
            };
            match setup() {
                Ok((worker, region, shm, described, exposing)) => {
                    let _ = ready.send(Ok((worker.waker(), described, exposing)));
                    serve::serve(&worker, shm.as_ref().map(|(shm_worker, _)| shm_worker), &receiver);
                    drop(region);
                    drop(shm);
                    drop(memory);
                }
                Err(error) => {
                    let _ = ready.send(Err(error));
                }
            }
        })?;
        let (waker, region, exposing) = started.recv().map_err(|_| StartError::Died)??;
        let exposer = exposing.zip(memory_for_exposer).map(|(context, memory)| Exposer { context, memory });
        Ok(Self { jobs: Some(jobs), waker, region, exposer, thread: Some(thread) })
    }

    /// Registers runs of the pool, `(offset, length)` each, on the main
    /// context for one handle, when the pool is keyed per handle (`None`
    /// otherwise: the pool's own key serves). The runs must lie within
    /// the pool; they may be read until the result is dropped.
    pub fn expose(&self, runs: &[(u64, u64)]) -> Option<Result<Exposed, UcxError>> {
        let exposer = self.exposer.as_ref()?;
        Some(exposer.expose(runs))
    }

    /// What peers need to read this worker's KV pool (None without one).
    pub fn region(&self) -> Option<&UcxRegion> {
        self.region.as_ref()
    }

    /// Reads `block_bytes` at each of `offsets` (relative to the peer's
    /// region) into `into` (resized; pass a used buffer back to skip
    /// faulting in fresh pages), giving up after `timeout`.
    /// Keyed per handle, each block must lie within one of the peer's
    /// range keys.
    pub async fn pull(&self, peer: &UcxRegion, offsets: &[u64], block_bytes: usize, into: Vec<u8>, timeout: Duration) -> Result<Pulled, PullError> {
        let mut key_of = Vec::with_capacity(offsets.len());
        for &offset in offsets {
            match peer.key_for(offset, block_bytes as u64) {
                Some(key) => key_of.push(key.map_or(0, |range| range + 1)),
                None => return Err(PullError::OutsideRegion(offset)),
            }
        }
        // Key 0 is the pool's own, then the range keys in order.
        let remote_keys = std::iter::once(peer.remote_key.clone()).chain(peer.range_keys.iter().map(|range| range.remote_key.clone())).collect();
        let (reply, answer) = tokio::sync::oneshot::channel();
        let give_up = tokio::time::Instant::now() + timeout + ABANDON_GRACE + Duration::from_secs(1);
        let job = Job {
            peer: peer.worker_address.clone(),
            remote_keys,
            key_of,
            shm_peer: peer.shm_worker_address.clone(),
            shm_remote_key: peer.shm_remote_key.clone(),
            addresses: offsets.iter().map(|offset| peer.base_address + offset).collect(),
            block_bytes,
            into,
            deadline: Instant::now() + timeout,
            reply,
        };
        self.jobs.as_ref().ok_or(PullError::Stopped)?.send(job).map_err(|_| PullError::Stopped)?;
        self.waker.wake();
        match tokio::time::timeout_at(give_up, answer).await {
            Ok(answer) => answer.map_err(|_| PullError::NoAnswer)?,
            Err(_) => Err(PullError::NoAnswer),
        }
    }
}

/// Runs of adjacent pieces, `(offset, length)`, covering the pieces of
/// `piece` bytes at `offsets` (in any order, repeats allowed) and nothing
/// else: what [`UcxAgent::expose`] registers for one handle or lease.
pub fn runs(offsets: &[u64], piece: u64) -> Vec<(u64, u64)> {
    let mut sorted = offsets.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for offset in sorted {
        match runs.last_mut() {
            Some((start, length)) if *start + *length == offset => *length += piece,
            _ => runs.push((offset, piece)),
        }
    }
    runs
}

/// UCX settings that keep no registration cached past its unmapping
/// (UCP's own cache, and the InfiniBand memory domain's, which registers
/// each region directly: neither cached nor on-demand paging, whose
/// implicit form would cover the whole address space): an unregistered
/// run's remote key must stop working when its handle is released.
const NO_REGISTRATION_CACHE: [(&str, &str); 2] = [("RCACHE_ENABLE", "n"), ("IB_REG_METHODS", "direct")];

fn pool_address(memory: &KvMemory) -> u64 {
    match (memory.buffer(), memory.device()) {
        (Some(buffer), _) => buffer.as_ptr() as u64,
        (None, Some(device)) => device.address(),
        (None, None) => 0,
    }
}

fn pool_length(memory: &KvMemory) -> u64 {
    match (memory.buffer(), memory.device()) {
        (Some(buffer), _) => buffer.len() as u64,
        (None, Some(device)) => device.len() as u64,
        (None, None) => 0,
    }
}

impl Exposer {
    fn expose(&self, runs: &[(u64, u64)]) -> Result<Exposed, UcxError> {
        let (base, length) = (pool_address(&self.memory), pool_length(&self.memory));
        let mut regions = Vec::with_capacity(runs.len());
        let mut keys = Vec::with_capacity(runs.len());
        for &(offset, run) in runs {
            if offset.checked_add(run).is_none_or(|end| end > length) || run == 0 {
                return Err(UcxError {
                    call: "ucp_mem_map",
                    status: -5,
                    message: format!("a run of {run} bytes at {offset} is outside the {length}-byte pool"),
                });
            }
            // SAFETY: within the pool (checked above), which `self.memory`
            // keeps allocated; every region is dropped before the agent,
            // which holds the memory.
            #[allow(unsafe_code)]
            let region = unsafe {
                match self.memory.device().map(|device| device.kind()) {
                    Some(DeviceMemory::Cuda(_)) if self.memory.buffer().is_none() => MemoryRegion::register_cuda(&self.context, base + offset, run as usize),
                    _ => MemoryRegion::register(&self.context, (base + offset) as *mut u8, run as usize),
                }
            }?;
            keys.push(UcxRangeKey { offset, length: run, remote_key: region.packed_rkey()? });
            regions.push(region);
        }
        Ok(Exposed { regions, keys, _memory: self.memory.clone() })
    }
}

impl Drop for UcxAgent {
    fn drop(&mut self) {
        self.jobs = None;
        self.waker.wake();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_read_outside_the_peers_region_is_refused_before_ucx_sees_it() {
        let agent = UcxAgent::start(None, None, &UcxNetwork::Off, UcxKeys::WholePool).expect("a UCX agent without memory");
        let peer = UcxRegion { worker_address: vec![1], remote_key: vec![1], base_address: 4096, length: 100, ..UcxRegion::default() };
        let refused = agent.pull(&peer, &[0, 96], 8, Vec::new(), Duration::from_secs(1)).await;
        assert!(matches!(refused, Err(PullError::OutsideRegion(96))), "{refused:?}");
        assert_eq!(refused.unwrap_err().to_string(), "block at offset 96 lies outside the peer's region");
    }

    #[test]
    fn pieces_are_registered_in_runs_of_adjacent_pieces_and_nothing_between() {
        assert_eq!(runs(&[], 10), []);
        assert_eq!(runs(&[30], 10), [(30, 10)]);
        // Chain order is not pool order; repeats are covered once.
        assert_eq!(runs(&[50, 10, 20, 30, 70, 20, 60], 10), [(10, 30), (50, 30)]);
        assert_eq!(runs(&[0, 20, 40], 10), [(0, 10), (20, 10), (40, 10)]);
    }

    const BLOCK: usize = 4096;

    /// A pool of `blocks` blocks, each byte its block's number plus its
    /// place.
    fn pool(blocks: usize) -> KvMemory {
        let mut buffer = turbine_kv::KvBuffer::zeroed(blocks * BLOCK);
        for (i, byte) in buffer.as_mut_slice().iter_mut().enumerate() {
            *byte = (i / BLOCK * 31 + i) as u8;
        }
        let bytes = buffer.as_mut_slice().to_vec();
        let memory = KvMemory::new(Arc::new(buffer), turbine_kv::KvLayout::opaque(BLOCK, "test"), blocks);
        assert_eq!(bytes.len(), blocks * BLOCK);
        memory
    }

    fn expected(blocks: &[usize]) -> Vec<u8> {
        blocks.iter().flat_map(|&block| (block * BLOCK..(block + 1) * BLOCK).map(|i| (i / BLOCK * 31 + i) as u8)).collect()
    }

    #[tokio::test]
    async fn a_pool_keyed_per_handle_gives_out_only_its_runs_keys_and_is_read_through_them() {
        let lo = UcxNetwork::Devices("lo".into());
        let memory = pool(8);
        let owner = UcxAgent::start(Some(&memory), None, &lo, UcxKeys::PerHandle).expect("an owner keyed per handle");
        let region = owner.region().cloned().expect("the pool's place");
        assert!(region.remote_key.is_empty(), "no key of the whole pool is given out");
        assert_eq!(region.length, (8 * BLOCK) as u64);
        // A handle of blocks 1-2 and 6 (two runs).
        let exposed = owner.expose(&[(BLOCK as u64, 2 * BLOCK as u64), (6 * BLOCK as u64, BLOCK as u64)]).expect("keyed per handle").expect("registered");
        let keys = exposed.range_keys().to_vec();
        assert_eq!(keys.iter().map(|key| (key.offset, key.length)).collect::<Vec<_>>(), [(4096, 8192), (24576, 4096)]);
        assert!(keys.iter().all(|key| !key.remote_key.is_empty()));
        // Read over the network (TCP on loopback), not shared memory.
        let described = UcxRegion { range_keys: keys, shm_worker_address: Vec::new(), shm_remote_key: Vec::new(), ..region };
        let reader = UcxAgent::start(None, None, &lo, UcxKeys::WholePool).expect("a reader");
        let offsets = [BLOCK as u64, 2 * BLOCK as u64, 6 * BLOCK as u64];
        let pulled = reader.pull(&described, &offsets, BLOCK, Vec::new(), Duration::from_secs(10)).await.expect("the handle's blocks");
        assert!(!pulled.mapped);
        assert!(pulled.bytes == expected(&[1, 2, 6]), "the blocks read back");
        // Blocks of the pool outside the handle's runs are refused.
        for outside in [0, 3 * BLOCK as u64, 7 * BLOCK as u64] {
            let refused = reader.pull(&described, &[outside], BLOCK, Vec::new(), Duration::from_secs(10)).await;
            assert!(matches!(refused, Err(PullError::OutsideRegion(offset)) if offset == outside), "{refused:?}");
        }
        // Runs beyond the pool are never registered.
        let beyond = owner.expose(&[(7 * BLOCK as u64, 2 * BLOCK as u64)]).expect("keyed per handle");
        assert!(beyond.is_err(), "{beyond:?}");
        drop(exposed);
        // A pool keyed whole gives its key out, and registers nothing per handle.
        let whole = UcxAgent::start(Some(&memory), None, &lo, UcxKeys::WholePool).expect("an owner keyed whole");
        assert!(!whole.region().expect("the pool").remote_key.is_empty());
        assert!(whole.expose(&[(0, BLOCK as u64)]).is_none());
    }
}

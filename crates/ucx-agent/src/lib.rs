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

use turbine_kv::{DeviceMemory, KvMemory, UcxRegion};

pub use turbine_kv::UcxNetwork;
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
    pub(crate) remote_key: Vec<u8>,
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
    thread: Option<JoinHandle<()>>,
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
    pub fn start(memory: Option<&KvMemory>, pool: Option<Arc<ShmPool>>, network: &UcxNetwork) -> Result<Self, StartError> {
        let (jobs, receiver) = mpsc::channel();
        let (ready, started) = mpsc::channel();
        let memory = memory.cloned();
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
            type Setup = (Worker, Region, Option<(Worker, Region)>, Option<UcxRegion>);
            let setup = || -> Result<Setup, UcxError> {
                let context = match &network {
                    UcxNetwork::Any => Context::with_wakeup()?,
                    UcxNetwork::Devices(devices) => Context::with_settings(&[("NET_DEVICES", devices)])?,
                    // Loopback within the process only: nothing listens.
                    UcxNetwork::Off => Context::with_transports("self")?,
                };
                let worker = Worker::new(&context)?;
                let region = register(&context, true)?;
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
                let described = match &region {
                    Some(region) => Some(UcxRegion {
                        worker_address: worker.address()?,
                        remote_key: region.packed_rkey()?,
                        base_address: region.address(),
                        length: region.len() as u64,
                        shm_worker_address: match &shm {
                            Some((shm_worker, Some(_))) => shm_worker.address()?,
                            _ => Vec::new(),
                        },
                        shm_remote_key: match &shm {
                            Some((_, Some(shm_region))) => shm_region.packed_rkey()?,
                            _ => Vec::new(),
                        },
                    }),
                    None => None,
                };
                Ok((worker, region, shm, described))
            };
            match setup() {
                Ok((worker, region, shm, described)) => {
                    let _ = ready.send(Ok((worker.waker(), described)));
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
        let (waker, region) = started.recv().map_err(|_| StartError::Died)??;
        Ok(Self { jobs: Some(jobs), waker, region, thread: Some(thread) })
    }

    /// What peers need to read this worker's KV pool (None without one).
    pub fn region(&self) -> Option<&UcxRegion> {
        self.region.as_ref()
    }

    /// Reads `block_bytes` at each of `offsets` (relative to the peer's
    /// region) into `into` (resized; pass a used buffer back to skip
    /// faulting in fresh pages), giving up after `timeout`.
    pub async fn pull(&self, peer: &UcxRegion, offsets: &[u64], block_bytes: usize, into: Vec<u8>, timeout: Duration) -> Result<Pulled, PullError> {
        if let Some(&offset) = offsets.iter().find(|&&offset| offset.saturating_add(block_bytes as u64) > peer.length) {
            return Err(PullError::OutsideRegion(offset));
        }
        let (reply, answer) = tokio::sync::oneshot::channel();
        let give_up = tokio::time::Instant::now() + timeout + ABANDON_GRACE + Duration::from_secs(1);
        let job = Job {
            peer: peer.worker_address.clone(),
            remote_key: peer.remote_key.clone(),
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
        let agent = UcxAgent::start(None, None, &UcxNetwork::Off).expect("a UCX agent without memory");
        let peer = UcxRegion { worker_address: vec![1], remote_key: vec![1], base_address: 4096, length: 100, ..UcxRegion::default() };
        let refused = agent.pull(&peer, &[0, 96], 8, Vec::new(), Duration::from_secs(1)).await;
        assert!(matches!(refused, Err(PullError::OutsideRegion(96))), "{refused:?}");
        assert_eq!(refused.unwrap_err().to_string(), "block at offset 96 lies outside the peer's region");
    }
}

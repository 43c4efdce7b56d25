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

use std::collections::HashMap;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use turbine_engine::KvMemory;
use turbine_proto::worker::v1 as pb;
use turbine_ucx::{Context, Endpoint, MemoryRegion, UcxError, WaitError, Waker, Worker};

/// How long cancelled reads get to let go of their buffers.
const ABANDON_GRACE: Duration = Duration::from_millis(200);

/// Blocks read from a peer.
#[derive(Debug)]
pub struct Pulled {
    /// The blocks back to back.
    pub bytes: Vec<u8>,
    /// Time spent posting the reads (not waiting for them).
    pub post: Duration,
    /// Time from the first post to the last completion.
    pub total: Duration,
}

struct Job {
    peer: Vec<u8>,
    remote_key: Vec<u8>,
    shm_peer: Vec<u8>,
    shm_remote_key: Vec<u8>,
    addresses: Vec<u64>,
    block_bytes: usize,
    into: Vec<u8>,
    deadline: Instant,
    reply: tokio::sync::oneshot::Sender<Result<Pulled, String>>,
}

/// The UCX thread of a worker.
pub struct UcxAgent {
    jobs: Option<mpsc::Sender<Job>>,
    waker: Waker,
    region: Option<pb::UcxRegion>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for UcxAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxAgent").field("serves_memory", &self.region.is_some()).finish()
    }
}

impl UcxAgent {
    /// Starts the thread; registers `memory` for peers when given.
    pub fn start(memory: Option<&KvMemory>) -> Result<Self, String> {
        let (jobs, receiver) = mpsc::channel();
        let (ready, started) = mpsc::channel();
        let memory = memory.cloned();
        let thread = std::thread::Builder::new()
            .name("turbine-ucx".into())
            .spawn(move || {
                let register = |context: &Context| -> Result<Option<MemoryRegion>, UcxError> {
                    let Some(memory) = &memory else { return Ok(None) };
                    let buffer = memory.buffer();
                    // SAFETY: the buffer lives as long as `memory`, which
                    // this thread holds past the regions' drop.
                    #[allow(unsafe_code)]
                    let region = unsafe { MemoryRegion::register(context, buffer.as_ptr(), buffer.len()) }?;
                    Ok(Some(region))
                };
                type Setup = (Worker, Option<MemoryRegion>, Option<(Worker, Option<MemoryRegion>)>, Option<pb::UcxRegion>);
                let setup = || -> Result<Setup, UcxError> {
                    let context = Context::with_wakeup()?;
                    let worker = Worker::new(&context)?;
                    let region = register(&context)?;
                    let shm = match std::env::var_os("UCX_TLS") {
                        Some(_) => None,
                        None => match Context::with_transports("posix,self").and_then(|context| Ok((Worker::new(&context)?, register(&context)?))) {
                            Ok(shm) => Some(shm),
                            Err(error) => {
                                tracing::debug!(%error, "no shared-memory UCX context; same-machine reads use the main one");
                                None
                            }
                        },
                    };
                    let described = match &region {
                        Some(region) => Some(pb::UcxRegion {
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
                        serve(&worker, shm.as_ref().map(|(shm_worker, _)| shm_worker), &receiver);
                        drop(region);
                        drop(shm);
                        drop(memory);
                    }
                    Err(error) => {
                        let _ = ready.send(Err(error.to_string()));
                    }
                }
            })
            .map_err(|error| format!("cannot start the UCX thread: {error}"))?;
        let (waker, region) = started.recv().map_err(|_| "the UCX thread died while starting".to_owned())??;
        Ok(Self { jobs: Some(jobs), waker, region, thread: Some(thread) })
    }

    /// What peers need to read this worker's KV pool (None without one).
    pub fn region(&self) -> Option<&pb::UcxRegion> {
        self.region.as_ref()
    }

    /// Reads `block_bytes` at each of `offsets` (relative to the peer's
    /// region) into `into` (resized; pass a used buffer back to skip
    /// faulting in fresh pages), giving up after `timeout`.
    pub async fn pull(&self, peer: &pb::UcxRegion, offsets: &[u64], block_bytes: usize, into: Vec<u8>, timeout: Duration) -> Result<Pulled, String> {
        if let Some(&offset) = offsets.iter().find(|&&offset| offset.saturating_add(block_bytes as u64) > peer.length) {
            return Err(format!("block at offset {offset} lies outside the peer's region"));
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
        self.jobs.as_ref().ok_or("the UCX thread stopped")?.send(job).map_err(|_| "the UCX thread stopped".to_owned())?;
        self.waker.wake();
        match tokio::time::timeout_at(give_up, answer).await {
            Ok(answer) => answer.map_err(|_| "the UCX thread dropped the read".to_owned())?,
            Err(_) => Err("the UCX thread did not answer in time".to_owned()),
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

/// Endpoints of one UCX worker by peer address.
struct Endpoints<'w> {
    worker: &'w Worker,
    peer_errors: bool,
    open: HashMap<Vec<u8>, Endpoint<'w>>,
    /// Peers this worker cannot reach (shared memory: another machine).
    unreachable: std::collections::HashSet<Vec<u8>>,
    /// A read was abandoned: this worker must not be used again.
    poisoned: bool,
}

impl<'w> Endpoints<'w> {
    fn new(worker: &'w Worker, peer_errors: bool) -> Self {
        Self { worker, peer_errors, open: HashMap::new(), unreachable: Default::default(), poisoned: false }
    }

    fn get(&mut self, peer: &[u8]) -> Result<&Endpoint<'w>, UcxError> {
        if !self.open.contains_key(peer) {
            let endpoint = self.worker.connect(peer, self.peer_errors)?;
            self.open.insert(peer.to_vec(), endpoint);
        }
        Ok(&self.open[peer])
    }
}

/// The thread's loop: run jobs, progress, sleep when there is nothing to do.
fn serve(worker: &Worker, mut shm_worker: Option<&Worker>, jobs: &mpsc::Receiver<Job>) {
    let mut main = Endpoints::new(worker, true);
    let mut shm = shm_worker.map(|shm_worker| Endpoints::new(shm_worker, false));
    loop {
        // A shared-memory peer that died mid-read leaves reads UCX cannot
        // cancel: stop using (and progressing) shared memory; everything
        // goes through the main context from then on.
        if shm.as_ref().is_some_and(|shm| shm.poisoned) {
            tracing::warn!("a shared-memory UCX read could not be cancelled; this worker reads and serves KV blocks without shared memory until it restarts");
            if let Some(poisoned) = shm.take() {
                // Its endpoints must not be closed (that could hang too).
                std::mem::forget(poisoned.open);
            }
            shm_worker = None;
        }
        match jobs.try_recv() {
            Ok(job) => {
                run(&mut main, shm.as_mut(), job);
                continue;
            }
            Err(mpsc::TryRecvError::Disconnected) => return,
            Err(mpsc::TryRecvError::Empty) => {}
        }
        // Progress both workers until neither has anything to do.
        if worker.progress() | shm_worker.is_some_and(Worker::progress) {
            continue;
        }
        let armed = worker.arm().and_then(|main| Ok(main && shm_worker.map_or(Ok(true), Worker::arm)?));
        match armed {
            Ok(false) => continue,
            Ok(true) => {
                // A job sent before arming may have had its wake-up drained
                // by the arm: look once more before sleeping.
                match jobs.try_recv() {
                    Ok(job) => run(&mut main, shm.as_mut(), job),
                    Err(mpsc::TryRecvError::Disconnected) => return,
                    Err(mpsc::TryRecvError::Empty) => sleep(worker, shm_worker),
                }
            }
            Err(error) => {
                tracing::warn!(%error, "UCX arm failed; polling");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// Sleeps until either worker has events (or a waker signals the main one).
fn sleep(worker: &Worker, shm_worker: Option<&Worker>) {
    let Some(shm_worker) = shm_worker else {
        if let Err(error) = worker.wait() {
            tracing::warn!(%error, "UCX wait failed; polling");
            std::thread::sleep(Duration::from_millis(1));
        }
        return;
    };
    match (worker.event_fd(), shm_worker.event_fd()) {
        (Ok(main), Ok(shm)) => {
            let mut fds = [libc::pollfd { fd: main, events: libc::POLLIN, revents: 0 }, libc::pollfd { fd: shm, events: libc::POLLIN, revents: 0 }];
            // SAFETY: two valid pollfd entries we own; an interrupted or
            // failed poll only means we progress again sooner.
            #[allow(unsafe_code)]
            let _ = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        }
        _ => std::thread::sleep(Duration::from_millis(1)),
    }
}

/// Reads a job's blocks: over shared memory when both sides have it and
/// the peer is on this machine, else over the main context.
fn run(main: &mut Endpoints<'_>, shm: Option<&mut Endpoints<'_>>, mut job: Job) {
    if let Some(shm) = shm
        && !job.shm_peer.is_empty()
        && !shm.unreachable.contains(&job.shm_peer)
    {
        match shm.get(&job.shm_peer) {
            Ok(endpoint) => {
                let key = std::mem::take(&mut job.shm_remote_key);
                let result = read(endpoint, &key, &mut job);
                match &result {
                    Err(WaitError::Abandoned) => shm.poisoned = true,
                    Err(_) => {
                        shm.open.remove(&job.shm_peer);
                    }
                    Ok(_) => {}
                }
                let _ = job.reply.send(result.map_err(|error| error.to_string()));
                return;
            }
            Err(error) => {
                tracing::debug!(%error, "peer not reachable over shared memory");
                shm.unreachable.insert(job.shm_peer.clone());
            }
        }
    }
    let remote_key = std::mem::take(&mut job.remote_key);
    let result = main.get(&job.peer).map_err(WaitError::from).and_then(|endpoint| read(endpoint, &remote_key, &mut job));
    match &result {
        Err(WaitError::Abandoned) => {
            // Peer error handling should never leave reads behind; if it
            // did, keep the endpoint (closing it could hang) and move on.
            if let Some(endpoint) = main.open.remove(&job.peer) {
                std::mem::forget(endpoint);
            }
            tracing::error!("UCX reads over the main context could not be cancelled");
        }
        // A failed endpoint stays failed; the next read reconnects.
        Err(_) => {
            main.open.remove(&job.peer);
        }
        Ok(_) => {}
    }
    let _ = job.reply.send(result.map_err(|error| error.to_string()));
}

fn read(endpoint: &Endpoint<'_>, remote_key: &[u8], job: &mut Job) -> Result<Pulled, WaitError> {
    let worker = endpoint.worker();
    let key = endpoint.remote_key(remote_key)?;
    let mut bytes = std::mem::take(&mut job.into);
    bytes.resize(job.addresses.len() * job.block_bytes, 0);
    let started = Instant::now();
    let post;
    {
        let mut requests = Vec::with_capacity(job.addresses.len());
        let mut refused = None;
        for (into, &address) in bytes.chunks_mut(job.block_bytes).zip(&job.addresses) {
            match endpoint.get(into, address, &key) {
                Ok(request) => requests.push(request),
                Err(error) => {
                    refused = Some(error);
                    break;
                }
            }
        }
        post = started.elapsed();
        // Reads already posted write into `bytes`: wait for them whatever
        // happens, before the buffer can go.
        // SAFETY: on Abandoned the buffer is leaked below.
        #[allow(unsafe_code)]
        let waited = unsafe { worker.wait_all_until(requests, job.deadline, ABANDON_GRACE) };
        if waited == Err(WaitError::Abandoned) {
            std::mem::forget(bytes);
            return Err(WaitError::Abandoned);
        }
        if let Some(error) = refused {
            return Err(error.into());
        }
        waited?;
    }
    Ok(Pulled { bytes, post, total: started.elapsed() })
}

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

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::{Arc, mpsc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use turbine_engine::{DeviceMemory, KvAllocator, KvBuffer, KvMemory};
use turbine_proto::worker::v1 as pb;
use turbine_ucx::{Context, Endpoint, MemoryRegion, RemoteKey, UcxError, WaitError, Waker, Worker};

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
    /// Whether the blocks were copied out of the peer's pool mapped into
    /// this process (else read with gets).
    pub mapped: bool,
}

/// The UCX shared-memory context a prefill worker allocates its KV pool
/// from, so that same-machine peers can map it.
pub struct ShmPool {
    context: Context,
    region: Mutex<Option<Arc<MemoryRegion>>>,
}

impl std::fmt::Debug for ShmPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmPool").field("allocated", &self.region.lock().as_ref().map(|region| region.len())).finish()
    }
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
        KvAllocator::new(move |bytes| pool.allocate(bytes).unwrap_or_else(|why| {
            tracing::warn!(mib = bytes >> 20, %why, "the KV pool stays on the heap; same-machine decode workers read it with UCX gets (slower)");
            KvBuffer::zeroed(bytes)
        }))
    }

    fn allocate(&self, bytes: usize) -> Result<KvBuffer, String> {
        // Shared memory lives in a tmpfs (a container's is often 64 MiB):
        // touching pages past its size would kill the worker, so make sure
        // the pool fits before asking for it.
        let dir = std::env::var("UCX_POSIX_DIR").unwrap_or_else(|_| "/dev/shm".into());
        let free = free_bytes(&dir).ok_or_else(|| format!("cannot read the free space of {dir}"))?;
        if free < bytes as u64 + (64 << 20) {
            return Err(format!("{dir} has {} MiB free, the pool needs {} MiB (give the container more shared memory, e.g. compose `shm_size`)", free >> 20, bytes >> 20));
        }
        let region = Arc::new(MemoryRegion::allocate(&self.context, bytes).map_err(|error| error.to_string())?);
        let ptr = NonNull::new(region.as_ptr()).filter(|ptr| (ptr.as_ptr() as usize).is_multiple_of(4096)).ok_or("UCX returned unaligned memory")?;
        if region.len() < bytes {
            return Err(format!("UCX allocated {} of {bytes} bytes", region.len()));
        }
        *self.region.lock() = Some(region.clone());
        // SAFETY: UCX allocated `bytes` fresh (zeroed), page-aligned bytes
        // for us alone; the region (the owner) keeps them mapped.
        #[allow(unsafe_code)]
        Ok(unsafe { KvBuffer::provided(ptr, bytes, Box::new(region)) })
    }

    /// The region backing `memory`, when it is the one this pool allocated.
    fn region_of(&self, memory: &KvMemory) -> Option<Arc<MemoryRegion>> {
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
fn shm_context() -> Result<Option<Context>, UcxError> {
    if std::env::var_os("UCX_TLS").is_some() {
        return Ok(None);
    }
    Context::with_transports("posix,self").map(Some)
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
    /// Starts the thread; registers `memory` for peers when given (with
    /// `pool`'s region, when `pool` allocated it).
    pub fn start(memory: Option<&KvMemory>, pool: Option<Arc<ShmPool>>) -> Result<Self, String> {
        let (jobs, receiver) = mpsc::channel();
        let (ready, started) = mpsc::channel();
        let memory = memory.cloned();
        let thread = std::thread::Builder::new()
            .name("turbine-ucx".into())
            .spawn(move || {
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
                type Setup = (Worker, Region, Option<(Worker, Region)>, Option<pb::UcxRegion>);
                let setup = || -> Result<Setup, UcxError> {
                    let context = Context::with_wakeup()?;
                    let worker = Worker::new(&context)?;
                    let region = register(&context, true)?;
                    let shm_context = match &pool {
                        Some(pool) => Ok(Some(pool.context.clone())),
                        None => shm_context(),
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
    /// Unpacked remote keys by peer, kept while in use: unpacking a
    /// shared-memory key maps the peer's pool, and a fresh mapping faults
    /// its pages in again on every read.
    keys: HashMap<Vec<u8>, CachedKey<'w>>,
    /// Peers this worker cannot reach (shared memory: another machine).
    unreachable: std::collections::HashSet<Vec<u8>>,
    /// A read was abandoned: this worker must not be used again.
    poisoned: bool,
}

struct CachedKey<'w> {
    packed: Vec<u8>,
    key: RemoteKey<'w>,
    used: Instant,
}

/// How long an unused remote key (and the mapping of a peer's pool that
/// it may hold) is kept.
const KEY_IDLE: Duration = Duration::from_secs(30);

impl<'w> Endpoints<'w> {
    fn new(worker: &'w Worker, peer_errors: bool) -> Self {
        Self { worker, peer_errors, open: HashMap::new(), keys: HashMap::new(), unreachable: Default::default(), poisoned: false }
    }

    fn get(&mut self, peer: &[u8]) -> Result<&Endpoint<'w>, UcxError> {
        if !self.open.contains_key(peer) {
            let endpoint = self.worker.connect(peer, self.peer_errors)?;
            self.open.insert(peer.to_vec(), endpoint);
        }
        Ok(&self.open[peer])
    }

    /// The endpoint to `peer` and its key `packed`, unpacked once and kept.
    fn get_with_key(&mut self, peer: &[u8], packed: &[u8]) -> Result<(&Endpoint<'w>, &RemoteKey<'w>), UcxError> {
        self.get(peer)?;
        let endpoint = &self.open[peer];
        if self.keys.get(peer).is_none_or(|cached| cached.packed != packed) {
            let key = endpoint.remote_key(packed)?;
            self.keys.insert(peer.to_vec(), CachedKey { packed: packed.to_vec(), key, used: Instant::now() });
        }
        let cached = self.keys.get_mut(peer).expect("inserted above");
        cached.used = Instant::now();
        Ok((endpoint, &cached.key))
    }

    /// Forgets a failed peer's endpoint and key.
    fn drop_peer(&mut self, peer: &[u8]) {
        self.keys.remove(peer);
        self.open.remove(peer);
    }

    /// Drops keys unused for [`KEY_IDLE`]; returns how long until the next
    /// one expires.
    fn expire_keys(&mut self) -> Option<Duration> {
        let now = Instant::now();
        self.keys.retain(|_, cached| now.duration_since(cached.used) < KEY_IDLE);
        self.keys.values().map(|cached| (cached.used + KEY_IDLE).saturating_duration_since(now)).min()
    }
}

/// The thread's loop: run jobs, progress, sleep when there is nothing to do.
fn serve(worker: &Worker, mut shm_worker: Option<&Worker>, jobs: &mpsc::Receiver<Job>) {
    let mut main = Endpoints::new(worker, true);
    let mut shm = shm_worker.map(|shm_worker| Endpoints::new(shm_worker, false));
    // Started at the first read of a mapped pool: prefill workers never
    // need it.
    let copier = std::cell::OnceCell::new();
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
                run(&mut main, shm.as_mut(), &copier, job);
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
                    Ok(job) => run(&mut main, shm.as_mut(), &copier, job),
                    Err(mpsc::TryRecvError::Disconnected) => return,
                    Err(mpsc::TryRecvError::Empty) => {
                        let expiry = shm.as_mut().and_then(Endpoints::expire_keys);
                        sleep(worker, shm_worker, expiry);
                    }
                }
            }
            Err(error) => {
                tracing::warn!(%error, "UCX arm failed; polling");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

/// Sleeps until either worker has events (or a waker signals the main
/// one), or `timeout` passes.
fn sleep(worker: &Worker, shm_worker: Option<&Worker>, timeout: Option<Duration>) {
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
            let timeout = timeout.map_or(-1, |timeout| timeout.as_millis().min(i32::MAX as u128 - 1) as i32 + 1);
            // SAFETY: two valid pollfd entries we own; an interrupted or
            // failed poll only means we progress again sooner.
            #[allow(unsafe_code)]
            let _ = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout) };
        }
        _ => std::thread::sleep(Duration::from_millis(1)),
    }
}

/// Reads a job's blocks: over shared memory when both sides have it and
/// the peer is on this machine, else over the main context.
fn run(main: &mut Endpoints<'_>, shm: Option<&mut Endpoints<'_>>, copier: &std::cell::OnceCell<Copier>, mut job: Job) {
    if let Some(shm) = shm
        && !job.shm_peer.is_empty()
        && !shm.unreachable.contains(&job.shm_peer)
    {
        let packed = std::mem::take(&mut job.shm_remote_key);
        match shm.get_with_key(&job.shm_peer, &packed) {
            Ok((endpoint, key)) => {
                let result = read(endpoint, key, copier, &mut job);
                match &result {
                    Err(WaitError::Abandoned) => shm.poisoned = true,
                    Err(_) => shm.drop_peer(&job.shm_peer),
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
    let result = main.get(&job.peer).map_err(WaitError::from).and_then(|endpoint| {
        let key = endpoint.remote_key(&remote_key)?;
        read(endpoint, &key, copier, &mut job)
    });
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

/// Reads a job's blocks through `endpoint`: copied out of the peer's
/// mapped pool when UCX maps it here, else with one get per block.
fn read(endpoint: &Endpoint<'_>, key: &RemoteKey<'_>, copier: &std::cell::OnceCell<Copier>, job: &mut Job) -> Result<Pulled, WaitError> {
    let worker = endpoint.worker();
    let mut bytes = std::mem::take(&mut job.into);
    bytes.resize(job.addresses.len() * job.block_bytes, 0);
    let started = Instant::now();
    let sources: Option<Vec<*const u8>> = job.addresses.iter().map(|&address| key.local_ptr(address)).collect();
    if let Some(sources) = sources {
        // SAFETY: each source is a mapping of `block_bytes` of the peer's
        // region (`pull` checked the offsets against its length), alive
        // while `key` is, which outlives the wait below; the destinations
        // are disjoint chunks of `bytes`, untouched until the copies end.
        #[allow(unsafe_code)]
        let copies = unsafe { copier.get_or_init(|| Copier::new(copy_threads())).post(&sources, bytes.as_mut_ptr(), job.block_bytes) };
        let post = started.elapsed();
        copies.wait();
        return Ok(Pulled { bytes, post, total: started.elapsed(), mapped: true });
    }
    let post;
    {
        let mut requests = Vec::with_capacity(job.addresses.len());
        let mut refused = None;
        for (into, &address) in bytes.chunks_mut(job.block_bytes).zip(&job.addresses) {
            match endpoint.get(into, address, key) {
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
    Ok(Pulled { bytes, post, total: started.elapsed(), mapped: false })
}

/// Copy threads: more than one core copies a batch of blocks (one thread
/// does not reach the memory bandwidth).
struct Copier {
    lanes: Vec<mpsc::Sender<CopyTask>>,
    threads: Vec<JoinHandle<()>>,
}

/// Spans for one copy thread: `(source, destination)` addresses of `len`
/// bytes each.
struct CopyTask {
    spans: Vec<(usize, usize)>,
    len: usize,
    done: Arc<Countdown>,
}

impl CopyTask {
    /// Copies the spans, then counts the task done.
    ///
    /// # Safety
    /// As [`Copier::post`]'s contract.
    #[allow(unsafe_code)]
    unsafe fn run(&self) {
        for &(source, destination) in &self.spans {
            // SAFETY: the caller's contract.
            unsafe { std::ptr::copy_nonoverlapping(source as *const u8, destination as *mut u8, self.len) };
        }
        self.done.finish_one();
    }
}

/// Counts copy tasks down to zero.
struct Countdown {
    left: Mutex<usize>,
    zero: Condvar,
}

impl Countdown {
    fn finish_one(&self) {
        let mut left = self.left.lock();
        *left -= 1;
        if *left == 0 {
            self.zero.notify_all();
        }
    }

    /// Returns when every task is done.
    fn wait(&self) {
        let mut left = self.left.lock();
        while *left > 0 {
            self.zero.wait(&mut left);
        }
    }
}

/// Copy threads per worker: the cores, up to four.
fn copy_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |cores| cores.get().min(4))
}

impl Copier {
    fn new(threads: usize) -> Self {
        let mut lanes = Vec::new();
        let mut handles = Vec::new();
        for lane in 0..threads.max(1) {
            let (sender, tasks) = mpsc::channel::<CopyTask>();
            let spawned = std::thread::Builder::new().name(format!("turbine-kv-copy-{lane}")).spawn(move || {
                for task in tasks {
                    // SAFETY: per `Copier::post`'s contract.
                    #[allow(unsafe_code)]
                    unsafe {
                        task.run()
                    };
                }
            });
            match spawned {
                Ok(handle) => {
                    lanes.push(sender);
                    handles.push(handle);
                }
                Err(error) => tracing::warn!(%error, "cannot start a KV copy thread"),
            }
        }
        Self { lanes, threads: handles }
    }

    /// Hands the copies of `len` bytes from each source to
    /// `destination + i × len` to the copy threads; the countdown reaches
    /// zero when all are done (at once without threads: copied here).
    ///
    /// # Safety
    /// Every source stays readable for `len` bytes, and the destination
    /// writable for `sources.len() × len` bytes and otherwise untouched,
    /// until the countdown reaches zero.
    #[allow(unsafe_code)]
    unsafe fn post(&self, sources: &[*const u8], destination: *mut u8, len: usize) -> Arc<Countdown> {
        let per_lane = sources.len().div_ceil(self.lanes.len().max(1)).max(1);
        let chunks: Vec<&[*const u8]> = sources.chunks(per_lane).collect();
        let done = Arc::new(Countdown { left: Mutex::new(chunks.len()), zero: Condvar::new() });
        for (lane, chunk) in chunks.into_iter().enumerate() {
            let first = lane * per_lane;
            let spans = chunk.iter().enumerate().map(|(i, &source)| (source as usize, destination as usize + (first + i) * len)).collect();
            let task = CopyTask { spans, len, done: done.clone() };
            let refused = match self.lanes.get(lane) {
                Some(sender) => sender.send(task).err().map(|mpsc::SendError(task)| task),
                None => Some(task),
            };
            if let Some(task) = refused {
                // No thread for this lane: copy here.
                // SAFETY: per the caller's contract.
                unsafe { task.run() };
            }
        }
        done
    }
}

impl Drop for Copier {
    fn drop(&mut self) {
        self.lanes.clear();
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

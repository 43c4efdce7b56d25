//! The UCX thread's loop: endpoints and remote keys per peer, reads over
//! shared memory or the main context, sleeping in UCX's wakeup.

use std::collections::HashMap;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use turbine_ucx::{Endpoint, RemoteKey, UcxError, WaitError, Worker};

use crate::copy::{Copier, copy_threads};
use crate::{ABANDON_GRACE, Job, PullError, Pulled};

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
pub(crate) fn serve(worker: &Worker, mut shm_worker: Option<&Worker>, jobs: &mpsc::Receiver<Job>) {
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

/// Longest the thread sleeps without looking at its jobs again: a wake-up
/// that got lost between UCX's signal and its arm then costs this much,
/// never a hang (a worker that stops joins this thread).
const IDLE_LOOK: Duration = Duration::from_millis(500);

/// Sleeps until either worker has events (or a waker signals the main
/// one), `timeout` passes, or [`IDLE_LOOK`] does.
fn sleep(worker: &Worker, shm_worker: Option<&Worker>, timeout: Option<Duration>) {
    let timeout = timeout.map_or(IDLE_LOOK, |timeout| timeout.min(IDLE_LOOK));
    let fds = match (worker.event_fd(), shm_worker.map(Worker::event_fd).transpose()) {
        (Ok(main), Ok(shm)) => [Some(main), shm],
        (Err(error), _) | (_, Err(error)) => {
            tracing::warn!(%error, "no UCX event fd; polling");
            std::thread::sleep(Duration::from_millis(1));
            return;
        }
    };
    let mut fds: Vec<libc::pollfd> = fds.into_iter().flatten().map(|fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
    // Rounded up, so a key's expiry has passed when the poll returns.
    let millis = timeout.as_millis().min(i32::MAX as u128 - 1) as i32 + 1;
    // SAFETY: valid pollfd entries we own; an interrupted or failed poll
    // only means we progress again sooner.
    #[allow(unsafe_code)]
    let _ = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, millis) };
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
                let result = read(endpoint, &[key], None, copier, &mut job);
                match &result {
                    Err(WaitError::Abandoned) => shm.poisoned = true,
                    Err(_) => shm.drop_peer(&job.shm_peer),
                    Ok(_) => {}
                }
                let _ = job.reply.send(result.map_err(PullError::from));
                return;
            }
            Err(error) => {
                tracing::debug!(%error, "peer not reachable over shared memory");
                shm.unreachable.insert(job.shm_peer.clone());
            }
        }
    }
    let remote_keys = std::mem::take(&mut job.remote_keys);
    let key_of = std::mem::take(&mut job.key_of);
    let result = main.get(&job.peer).map_err(WaitError::from).and_then(|endpoint| {
        // Only the keys some address uses are unpacked (a pool keyed per
        // handle sends no key of its own), numbered in order of use.
        let mut unpacked: Vec<RemoteKey<'_>> = Vec::new();
        let mut number: Vec<Option<usize>> = vec![None; remote_keys.len()];
        let mut uses = Vec::with_capacity(key_of.len());
        for &key in &key_of {
            // `pull` numbered every address's key among those it sent.
            let index = match number[key] {
                Some(index) => index,
                None => {
                    unpacked.push(endpoint.remote_key(&remote_keys[key])?);
                    number[key] = Some(unpacked.len() - 1);
                    unpacked.len() - 1
                }
            };
            uses.push(index);
        }
        let keys: Vec<&RemoteKey<'_>> = unpacked.iter().collect();
        read(endpoint, &keys, Some(&uses), copier, &mut job)
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
    let _ = job.reply.send(result.map_err(PullError::from));
}

/// Reads a job's blocks through `endpoint`: copied out of the peer's
/// mapped pool when UCX maps it here, else with one get per block.
/// `keys[key_of[i]]` is address i's key (`None`: `keys[0]` for all).
fn read(
    endpoint: &Endpoint<'_>,
    keys: &[&RemoteKey<'_>],
    key_of: Option<&[usize]>,
    copier: &std::cell::OnceCell<Copier>,
    job: &mut Job,
) -> Result<Pulled, WaitError> {
    let key = |i: usize| keys[key_of.map_or(0, |key_of| key_of[i])];
    let worker = endpoint.worker();
    let mut bytes = std::mem::take(&mut job.into);
    bytes.resize(job.addresses.len() * job.block_bytes, 0);
    let started = Instant::now();
    let sources: Option<Vec<*const u8>> = job.addresses.iter().enumerate().map(|(i, &address)| key(i).local_ptr(address)).collect();
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
        for (i, (into, &address)) in bytes.chunks_mut(job.block_bytes).zip(&job.addresses).enumerate() {
            match endpoint.get(into, address, key(i)) {
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

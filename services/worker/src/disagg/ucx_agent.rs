//! The worker's UCX side: one thread owns a UCX worker, keeps the engine's
//! KV pool registered (so peers read pinned blocks with one-sided gets, the
//! engine uninvolved), and runs this worker's own reads of peers' blocks.
//! It sleeps in UCX's wakeup while idle, woken by the network (transports
//! such as TCP need the owner to progress) or by a new job.

use std::collections::HashMap;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use turbine_engine::KvMemory;
use turbine_proto::worker::v1 as pb;
use turbine_ucx::{Context, Endpoint, MemoryRegion, UcxError, Waker, Worker};

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
    addresses: Vec<u64>,
    block_bytes: usize,
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
                let setup = || -> Result<(Worker, Option<MemoryRegion>, Option<pb::UcxRegion>), UcxError> {
                    let context = Context::with_wakeup()?;
                    let worker = Worker::new(&context)?;
                    let (region, described) = match &memory {
                        Some(memory) => {
                            let buffer = memory.buffer();
                            // SAFETY: the buffer lives as long as `memory`,
                            // which this thread holds past the region's drop.
                            #[allow(unsafe_code)]
                            let region = unsafe { MemoryRegion::register(&context, buffer.as_ptr(), buffer.len()) }?;
                            let described = pb::UcxRegion {
                                worker_address: worker.address()?,
                                remote_key: region.packed_rkey()?,
                                base_address: region.address(),
                                length: region.len() as u64,
                            };
                            (Some(region), Some(described))
                        }
                        None => (None, None),
                    };
                    Ok((worker, region, described))
                };
                match setup() {
                    Ok((worker, region, described)) => {
                        let _ = ready.send(Ok((worker.waker(), described)));
                        serve(&worker, &receiver);
                        drop(region);
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
    /// region) into one buffer, giving up after `timeout`.
    pub async fn pull(&self, peer: &pb::UcxRegion, offsets: &[u64], block_bytes: usize, timeout: Duration) -> Result<Pulled, String> {
        if let Some(&offset) = offsets.iter().find(|&&offset| offset.saturating_add(block_bytes as u64) > peer.length) {
            return Err(format!("block at offset {offset} lies outside the peer's region"));
        }
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job = Job {
            peer: peer.worker_address.clone(),
            remote_key: peer.remote_key.clone(),
            addresses: offsets.iter().map(|offset| peer.base_address + offset).collect(),
            block_bytes,
            deadline: Instant::now() + timeout,
            reply,
        };
        self.jobs.as_ref().ok_or("the UCX thread stopped")?.send(job).map_err(|_| "the UCX thread stopped".to_owned())?;
        self.waker.wake();
        answer.await.map_err(|_| "the UCX thread dropped the read".to_owned())?
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

/// The thread's loop: run jobs, progress, sleep when there is nothing to do.
fn serve(worker: &Worker, jobs: &mpsc::Receiver<Job>) {
    let mut endpoints: HashMap<Vec<u8>, Endpoint<'_>> = HashMap::new();
    loop {
        match jobs.try_recv() {
            Ok(job) => {
                run(worker, &mut endpoints, job);
                continue;
            }
            Err(mpsc::TryRecvError::Disconnected) => return,
            Err(mpsc::TryRecvError::Empty) => {}
        }
        if worker.progress() {
            continue;
        }
        match worker.arm() {
            Ok(false) => continue,
            Ok(true) => {
                // A job sent before arming may have had its wake-up drained
                // by the arm: look once more before sleeping.
                match jobs.try_recv() {
                    Ok(job) => run(worker, &mut endpoints, job),
                    Err(mpsc::TryRecvError::Disconnected) => return,
                    Err(mpsc::TryRecvError::Empty) => {
                        if let Err(error) = worker.wait() {
                            tracing::warn!(%error, "UCX wait failed; polling");
                            std::thread::sleep(Duration::from_millis(1));
                        }
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

fn run<'w>(worker: &'w Worker, endpoints: &mut HashMap<Vec<u8>, Endpoint<'w>>, job: Job) {
    if !endpoints.contains_key(&job.peer) {
        match worker.connect(&job.peer) {
            Ok(endpoint) => {
                endpoints.insert(job.peer.clone(), endpoint);
            }
            Err(error) => {
                let _ = job.reply.send(Err(error.to_string()));
                return;
            }
        }
    }
    let endpoint = &endpoints[&job.peer];
    let result = read(worker, endpoint, &job);
    if result.is_err() {
        // A failed endpoint stays failed; the next read reconnects.
        endpoints.remove(&job.peer);
    }
    let _ = job.reply.send(result.map_err(|error| error.to_string()));
}

fn read(worker: &Worker, endpoint: &Endpoint<'_>, job: &Job) -> Result<Pulled, UcxError> {
    let key = endpoint.remote_key(&job.remote_key)?;
    // Zeroed allocation of this size maps fresh pages: no upfront cost.
    let mut bytes = vec![0u8; job.addresses.len() * job.block_bytes];
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
        let waited = worker.wait_all_until(requests, job.deadline);
        if let Some(error) = refused {
            return Err(error);
        }
        waited?;
    }
    Ok(Pulled { bytes, post, total: started.elapsed() })
}

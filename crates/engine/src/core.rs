//! The engine loop: one dedicated thread that owns the scheduler and the
//! executor and runs steps back to back while there is work.
//!
//! Requests arrive through an [`EngineHandle`]; each gets an unbounded
//! channel of [`EngineOutput`]s (bounded in practice by its `max_tokens`).
//! Dropping the receiver cancels the sequence: the loop checks for closed
//! receivers before every step, so a cancelled sequence stops computing and
//! frees its blocks within one step.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::thread;
use std::time::{Duration, Instant};

use tokio::sync::{broadcast, mpsc as tokio_mpsc};

use crate::block_manager::BlockId;
use crate::request::{EngineOutput, GenerateRequest, Handoff, ImportedPrefix, Load, PinnedPrefix, Sampled, TokenLogprobs};
use crate::scheduler::{Batch, ScheduledChunk, Scheduler, SchedulerConfig, SeqId};
use crate::tiers::fetch::FetchModel;
use crate::tiers::{
    BlockSource, FetchEstimates, HostBlock, HostTier, KvTiers, ModelledTransfer, OffloadBlock, ReadDone, ReadJob, RemoteOffload, RemoteTier, offload_evictions,
    spawn_offload, spawn_reader,
};
use crate::{EngineError, ExecutorError, Result};
use turbine_kv::BlockHashes;
use turbine_kv::{CachedBlock, Dump, KvEvent, NumberedEvent, SequenceHash};

/// Runs the model for a planned step.
///
/// Implementations compute the KV of every item's `start..start + len`
/// tokens into the item's blocks and, for items with `sample`, return the
/// next token; the result has one entry per item (`None` where nothing is
/// sampled).
pub trait Executor: Send + 'static {
    /// Computes one step.
    fn execute(&mut self, batch: &Batch<'_>) -> std::result::Result<Vec<Option<Sampled>>, ExecutorError>;

    /// Called when a sequence ends or is aborted, to drop per-sequence state.
    fn release(&mut self, _seq_id: SeqId) {}

    /// Writes a block's bytes (laid out as the executor's
    /// [`KvMemory`](crate::KvMemory) describes) into `block` of the pool:
    /// installing KV computed by another worker. Engines without such
    /// memory refuse, and the sequence is computed here instead.
    fn write_block(&mut self, _block: BlockId, _bytes: &[u8]) -> std::result::Result<(), ExecutorError> {
        Err(ExecutorError::CannotInstall)
    }
}

/// Statistics the loop keeps, readable from any thread.
#[derive(Debug, Default)]
pub struct EngineStats {
    running: AtomicU32,
    waiting: AtomicU32,
    blocks_used: AtomicU32,
    blocks_total: AtomicU32,
    /// Steps run since start.
    pub steps: AtomicU64,
    /// Tokens generated since start.
    pub generated_tokens: AtomicU64,
    /// Prompt tokens computed since start (prefix hits excluded).
    pub prefill_tokens: AtomicU64,
    /// Prompt tokens served from the prefix cache since start.
    pub cached_prompt_tokens: AtomicU64,
    /// Preemptions since start.
    pub preemptions: AtomicU64,
    /// Cached pool blocks evicted because their tenant held more than its
    /// share of the pool (the pool over the tenants holding cached blocks),
    /// since start.
    pub fair_share_evictions: AtomicU64,
    /// Nanoseconds spent executing steps since start.
    pub busy_nanos: AtomicU64,
    /// Blocks installed from other workers since start.
    pub imported_blocks: AtomicU64,
    /// Prompt tokens onboarded from a lower tier (then hit in G1) since start.
    pub onboarded_prompt_tokens: AtomicU64,
}

impl EngineStats {
    /// The latest occupancy snapshot.
    pub fn load(&self) -> Load {
        Load {
            running: self.running.load(Ordering::Relaxed),
            waiting: self.waiting.load(Ordering::Relaxed),
            blocks_used: self.blocks_used.load(Ordering::Relaxed),
            blocks_total: self.blocks_total.load(Ordering::Relaxed),
        }
    }

    fn set_load(&self, load: Load) {
        self.running.store(load.running, Ordering::Relaxed);
        self.waiting.store(load.waiting, Ordering::Relaxed);
        self.blocks_used.store(load.blocks_used, Ordering::Relaxed);
        self.blocks_total.store(load.blocks_total, Ordering::Relaxed);
    }
}

// Submit, the large one, is the common message: boxing it would allocate once more per request.
#[allow(clippy::large_enum_variant)]
enum Command {
    Submit { request: GenerateRequest, handoff: Handoff, outputs: tokio_mpsc::UnboundedSender<EngineOutput> },
    Dump { reply: tokio::sync::oneshot::Sender<Dump> },
    Unpin { pin_id: u64 },
    CachedPrefix { hashes: Vec<SequenceHash>, reply: tokio::sync::oneshot::Sender<usize> },
    Shutdown,
}

/// A cheap, cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    commands: mpsc::Sender<Command>,
    config: Arc<SchedulerConfig>,
    stats: Arc<EngineStats>,
    host: Option<HostTier>,
    remote: Option<RemoteTier>,
    fetch: Option<Arc<parking_lot::Mutex<FetchModel>>>,
    events: broadcast::Sender<NumberedEvent>,
    thread: Arc<parking_lot::Mutex<Option<thread::JoinHandle<()>>>>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle").field("load", &self.stats.load()).finish()
    }
}

/// How often an idle engine looks for finished copies to the host tier.
const OFFLOAD_POLL: Duration = Duration::from_millis(2);

/// Capacity of the KV event broadcast; a consumer lagging further sees a gap
/// and resynchronises from a dump.
const EVENT_BUFFER: usize = 4096;

impl EngineHandle {
    /// Starts the engine thread.
    pub fn spawn(config: SchedulerConfig, eos_token_ids: Vec<u32>, executor: Box<dyn Executor>) -> Self {
        Self::spawn_with_tiers(config, eos_token_ids, executor, KvTiers::default())
    }

    /// Starts the engine thread with KV tiers below its pool (see
    /// [`tiers`](crate::tiers)).
    pub fn spawn_with_tiers(config: SchedulerConfig, eos_token_ids: Vec<u32>, executor: Box<dyn Executor>, tiers: KvTiers) -> Self {
        let (commands, receiver) = mpsc::channel();
        let stats = Arc::new(EngineStats::default());
        let (events, _) = broadcast::channel(EVENT_BUFFER);
        let mut scheduler = Scheduler::new(config.clone(), eos_token_ids);
        stats.set_load(scheduler.load());
        let source = match (tiers.memory, tiers.modelled) {
            (Some(memory), _) => Some(BlockSource::Memory(memory)),
            (None, Some(_)) => Some(BlockSource::Modelled),
            (None, None) => None,
        };
        let offload = match (&tiers.host, source) {
            (Some(host), Some(source)) if config.prefix_caching => {
                scheduler.record_registered();
                scheduler.look_up_before_admission();
                let (jobs, done) = spawn_offload(source, host.clone(), tiers.remote.clone());
                Some(Offload { jobs, done, pinned: 0, limit: (config.num_blocks / 4).max(1), queued: Default::default(), queue_limit: config.num_blocks })
            }
            _ => None,
        };
        if let (Some(host), Some(remote), Some(_)) = (&tiers.host, &tiers.remote, &offload)
            && remote.offload() == RemoteOffload::OnEvict
        {
            offload_evictions(host, remote);
        }
        // What reads from the tiers cost against computing: measured
        // whenever there is a tier below the pool.
        let fetch = offload.as_ref().map(|_| Arc::new(parking_lot::Mutex::new(FetchModel::new(tiers.fetch, config.block_size, config.max_batched_tokens))));
        let reader = match (&tiers.host, &fetch) {
            (Some(host), Some(fetch)) if host.disk().is_some() || tiers.modelled.is_some() || tiers.remote.is_some() => {
                let (jobs, done) = spawn_reader(host.clone(), tiers.remote.clone(), tiers.modelled, fetch.clone());
                Some(Reader { jobs, done, waiting: HashMap::new(), fetch: fetch.clone() })
            }
            _ => None,
        };
        let engine_loop = EngineLoop {
            scheduler,
            executor,
            receiver,
            outputs: HashMap::new(),
            stats: stats.clone(),
            events: events.clone(),
            next_event_id: 0,
            event_buffer: Vec::new(),
            pins: HashMap::new(),
            next_pin_id: 1,
            host: tiers.host.clone(),
            modelled: tiers.modelled,
            remote: tiers.remote.clone(),
            offload,
            reader,
            fetch: fetch.clone(),
        };
        let thread = thread::Builder::new().name("turbine-engine".into()).spawn(move || engine_loop.run()).expect("spawn engine thread");
        Self {
            commands,
            config: Arc::new(config),
            stats,
            host: tiers.host,
            remote: tiers.remote,
            fetch,
            events,
            thread: Arc::new(parking_lot::Mutex::new(Some(thread))),
        }
    }

    /// Submits a request without blocking. A request that can never run,
    /// or one arriving while the queue is full, is refused here rather than
    /// on the stream.
    pub fn generate(&self, request: GenerateRequest) -> Result<tokio_mpsc::UnboundedReceiver<EngineOutput>> {
        self.submit(request, Handoff::None)
    }

    /// Submits a request with its part in disaggregated serving (see
    /// [`Handoff`]); checked like [`generate`](Self::generate).
    pub fn submit(&self, request: GenerateRequest, handoff: Handoff) -> Result<tokio_mpsc::UnboundedReceiver<EngineOutput>> {
        self.config.validate(&request).map_err(EngineError::from)?;
        if matches!(handoff, Handoff::Prefill) && request.stop.max_tokens != 1 {
            return Err(EngineError::InvalidRequest("a prefill samples exactly one token (max_tokens 1)".into()));
        }
        let waiting = self.stats.waiting.load(Ordering::Relaxed) as usize;
        if waiting >= self.config.max_waiting {
            return Err(EngineError::Overloaded(waiting));
        }
        let (outputs, receiver) = tokio_mpsc::unbounded_channel();
        self.commands.send(Command::Submit { request, handoff, outputs }).map_err(|_| EngineError::ShuttingDown)?;
        Ok(receiver)
    }

    /// Releases a prefill's pinned blocks (unknown ids are ignored: a pin
    /// is released once).
    pub fn unpin(&self, pin_id: u64) {
        let _ = self.commands.send(Command::Unpin { pin_id });
    }

    /// How many leading blocks of `hashes` this engine's prefix cache holds.
    pub async fn cached_prefix(&self, hashes: Vec<SequenceHash>) -> Result<usize> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.commands.send(Command::CachedPrefix { hashes, reply }).map_err(|_| EngineError::ShuttingDown)?;
        answer.await.map_err(|_| EngineError::ShuttingDown)
    }

    /// The scheduler limits this engine runs with.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// The latest occupancy snapshot.
    pub fn load(&self) -> Load {
        self.stats.load()
    }

    /// Counters since start.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// The host-memory tier below the pool, if any.
    pub fn host_tier(&self) -> Option<&HostTier> {
        self.host.as_ref()
    }

    /// The shared tier (G4), if the engine has one.
    pub fn remote_tier(&self) -> Option<&RemoteTier> {
        self.remote.as_ref()
    }

    /// What the fetch-or-recompute decision knows and has decided (None
    /// without a tier below the pool).
    pub fn fetch_estimates(&self) -> Option<FetchEstimates> {
        self.fetch.as_ref().map(|fetch| fetch.lock().estimates())
    }

    /// Subscribes to the engine's KV events.
    pub fn subscribe_events(&self) -> broadcast::Receiver<NumberedEvent> {
        self.events.subscribe()
    }

    /// Every block in the prefix cache, as of an event number: a consumer
    /// that lagged (or joined late) loads this, then applies events from
    /// `next_event_id` on.
    pub async fn dump(&self) -> Result<Dump> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.commands.send(Command::Dump { reply }).map_err(|_| EngineError::ShuttingDown)?;
        answer.await.map_err(|_| EngineError::ShuttingDown)
    }

    /// Stops the loop (sequences still running fail) and joins the thread.
    pub fn shutdown(&self) {
        let _ = self.commands.send(Command::Shutdown);
        if let Some(thread) = self.thread.lock().take() {
            let _ = thread.join();
        }
    }
}

struct EngineLoop {
    scheduler: Scheduler,
    executor: Box<dyn Executor>,
    receiver: mpsc::Receiver<Command>,
    outputs: HashMap<SeqId, tokio_mpsc::UnboundedSender<EngineOutput>>,
    stats: Arc<EngineStats>,
    events: broadcast::Sender<NumberedEvent>,
    next_event_id: u64,
    event_buffer: Vec<KvEvent>,
    /// Prefills' pinned blocks by pin id.
    pins: HashMap<u64, Vec<BlockId>>,
    next_pin_id: u64,
    /// The host tier (G2), onboarded from at admission.
    host: Option<HostTier>,
    /// Modelled transfer times (an engine without KV memory): every
    /// onboard waits for its time on the reader thread.
    modelled: Option<ModelledTransfer>,
    /// The shared tier (G4), read after the disk for a long enough remainder.
    remote: Option<RemoteTier>,
    /// Copies of registered blocks to the host tier.
    offload: Option<Offload>,
    /// Reads of disk blocks for requests waiting on them.
    reader: Option<Reader>,
    /// What reads from the tiers and prompt compute cost (with a tier
    /// below the pool).
    fetch: Option<Arc<parking_lot::Mutex<FetchModel>>>,
}

/// Sequences suspended while their prefix is read from disk (or its
/// modelled transfer time passes), by sequence id.
struct Reader {
    jobs: mpsc::Sender<ReadJob>,
    done: mpsc::Receiver<ReadDone>,
    waiting: HashMap<SeqId, OnboardPlan>,
    /// Whether to read or compute, and what it is decided from.
    fetch: Arc<parking_lot::Mutex<FetchModel>>,
}

/// The lower-tier blocks that continue a prompt's G1 prefix hit.
struct OnboardPlan {
    /// The prompt's block hashes.
    hashes: Vec<BlockHashes>,
    /// Leading blocks in G1 when planned.
    in_device: usize,
    /// The blocks that follow them, in order (host first, then disk, then
    /// any host blocks after the disk's).
    blocks: Vec<Arc<HostBlock>>,
    /// How many of `blocks` came from the host tier.
    from_host: usize,
    /// How many (the last ones) came from the shared tier.
    from_remote: usize,
}

/// Registered blocks on their way to the host tier.
struct Offload {
    jobs: mpsc::Sender<Vec<OffloadBlock>>,
    /// Batches copied, their blocks to unpin.
    done: mpsc::Receiver<Vec<BlockId>>,
    /// Blocks pinned for copies now.
    pinned: usize,
    /// Most blocks pinned for copies at once.
    limit: usize,
    /// Registered blocks waiting for their copy, oldest first (not pinned:
    /// one evicted meanwhile is skipped).
    queued: std::collections::VecDeque<OffloadBlock>,
    /// Most blocks queued; past it the oldest are skipped (copies fell
    /// behind).
    queue_limit: usize,
}

impl EngineLoop {
    fn run(mut self) {
        loop {
            // Block while idle; otherwise take whatever arrived since the last step.
            if !self.scheduler.has_work() {
                let command = if self.tier_work_in_flight() {
                    // Copies or reads in flight: wake for their completion too.
                    match self.receiver.recv_timeout(OFFLOAD_POLL) {
                        Ok(command) => Some(command),
                        Err(mpsc::RecvTimeoutError::Timeout) => None,
                        Err(mpsc::RecvTimeoutError::Disconnected) => break,
                    }
                } else {
                    match self.receiver.recv() {
                        Ok(command) => Some(command),
                        Err(_) => break,
                    }
                };
                if let Some(command) = command
                    && !self.handle(command)
                {
                    break;
                }
            }
            self.unpin_offloaded();
            self.finish_reads();
            let mut shutting_down = false;
            while let Ok(command) = self.receiver.try_recv() {
                if !self.handle(command) {
                    shutting_down = true;
                    break;
                }
            }
            if shutting_down {
                break;
            }
            self.drop_cancelled();
            self.onboard_due();
            if !self.scheduler.has_work() {
                self.publish();
                continue;
            }
            self.step();
        }
        self.fail_all();
    }

    /// Returns false on shutdown.
    fn handle(&mut self, command: Command) -> bool {
        match command {
            Command::Submit { request, handoff, outputs } => {
                let (generated, pin, imported) = match handoff {
                    Handoff::None | Handoff::Prefill => (Vec::new(), matches!(handoff, Handoff::Prefill), 0),
                    Handoff::Decode { generated, import } => {
                        let imported = self.install(import) * self.scheduler.config().block_size;
                        (generated, false, imported)
                    }
                };
                self.admit(request, generated, pin, imported, outputs);
                true
            }
            Command::Dump { reply } => {
                // Publish first, so the dump reflects every numbered event.
                self.publish();
                let _ = reply.send(Dump { next_event_id: self.next_event_id, blocks: self.cached_blocks() });
                true
            }
            Command::Unpin { pin_id } => {
                if let Some(blocks) = self.pins.remove(&pin_id) {
                    self.scheduler.release_pinned(&blocks);
                    self.publish();
                }
                true
            }
            Command::CachedPrefix { hashes, reply } => {
                let _ = reply.send(self.scheduler.cached_prefix(&hashes));
                true
            }
            Command::Shutdown => false,
        }
    }

    /// Installs blocks read from another worker into the prefix cache;
    /// returns how many.
    fn install(&mut self, import: ImportedPrefix) -> usize {
        let hashes = &import.hashes;
        if hashes.is_empty() {
            return 0;
        }
        let executor = &mut self.executor;
        let installed =
            self.scheduler.install_prefix(import.parent, import.tenant, hashes, |block, index| match executor.write_block(block, import.block(index)) {
                Ok(()) => true,
                Err(error) => {
                    tracing::warn!(%error, "cannot install a transferred KV block; computing it here");
                    false
                }
            });
        self.stats.imported_blocks.fetch_add(installed as u64, Ordering::Relaxed);
        self.offload_registered();
        if installed < hashes.len() {
            tracing::debug!(installed, offered = hashes.len(), "installed part of a transferred prefix");
        }
        if let Some(recycle) = import.recycle {
            recycle(import.bytes);
        }
        installed
    }

    /// Queues a request in the scheduler.
    fn admit(&mut self, request: GenerateRequest, generated: Vec<u32>, pin: bool, imported: usize, outputs: tokio_mpsc::UnboundedSender<EngineOutput>) {
        match self.scheduler.add_imported(request, generated, pin, imported) {
            Ok(seq_id) => {
                self.outputs.insert(seq_id, outputs);
                // Keep the queue length the handle checks current.
                self.set_load();
            }
            // Raced past the handle's check; tell the caller on the stream.
            Err(error) => {
                let _ = outputs.send(EngineOutput::Failed(EngineError::from(error)));
            }
        }
    }

    /// Looks the sequences the next step may admit up in the lower tiers,
    /// so that their admission hits what those hold: host-tier blocks are
    /// installed at once; a prefix that continues on disk (or any prefix,
    /// when transfers are modelled) is fetched by the reader thread while
    /// the sequence is suspended, and installed as it rejoins the front of
    /// the queue.
    fn onboard_due(&mut self) {
        let Some(host) = self.host.clone() else { return };
        let due = self.scheduler.due_for_onboard();
        let block_size = self.scheduler.config().block_size;
        // Prompt tokens computed before the next due sequence's own: the
        // running sequences' rest, then what each due sequence before it
        // computes.
        let mut prefill_ahead = self.scheduler.prefill_running();
        for (seq_id, hashes) in due {
            let sequence: Vec<SequenceHash> = hashes.iter().map(|h| h.sequence).collect();
            let in_device = self.scheduler.cached_prefix(&sequence);
            let blocks = host.lookup_run(&hashes[in_device..]);
            let disk_from = in_device + blocks.len();
            // On disk, or in host memory again after the disk's part (a
            // chain's head leaves host memory first): the reader reads both.
            let on_disk = host
                .disk()
                .map_or(0, |disk| hashes[disk_from..].iter().take_while(|next| disk.contains(next.sequence) || host.contains(next.sequence)).count());
            // The shared tier costs a round trip: asked only for a long
            // enough remainder.
            let past_disk = hashes.len() - disk_from - on_disk;
            let for_remote = if self.remote.as_ref().is_some_and(|remote| remote.worth_asking(past_disk)) { past_disk } else { 0 };
            let plan = OnboardPlan { from_host: blocks.len(), hashes, in_device, blocks, from_remote: 0 };
            let ahead = prefill_ahead;
            // Counted as computed unless read below.
            prefill_ahead += (past_disk + on_disk) * block_size;
            let modelled_host = match self.modelled {
                Some(modelled) if !plan.blocks.is_empty() => modelled.onboard_time(plan.from_host, 0),
                _ => Duration::ZERO,
            };
            if let Some(fetch) = self.fetch.as_ref().filter(|_| !modelled_host.is_zero()) {
                fetch.lock().observe_host(plan.from_host, modelled_host, Instant::now());
            }
            if let Some(reader) = &mut self.reader
                && (on_disk > 0 || for_remote > 0 || !modelled_host.is_zero())
            {
                let choice = reader.fetch.lock().choose(Instant::now(), on_disk, for_remote, modelled_host, ahead);
                if choice.limit.is_none() {
                    let read = match (choice.disk, choice.remote) {
                        (false, false) => 0,
                        (true, false) => on_disk,
                        (_, true) => on_disk + for_remote,
                    };
                    prefill_ahead -= read.min(past_disk + on_disk) * block_size;
                }
                if !(choice.disk || choice.remote || !modelled_host.is_zero()) {
                    self.install_onboarded(seq_id, plan);
                    continue;
                }
                let end = choice.limit.map_or(plan.hashes.len(), |limit| (disk_from + limit).min(plan.hashes.len()));
                let hashes = if choice.disk || choice.remote { plan.hashes[disk_from..end].to_vec() } else { Vec::new() };
                let job = ReadJob { id: seq_id, hashes, disk: choice.disk, remote: choice.remote, host_blocks: plan.from_host };
                if reader.jobs.send(job).is_ok() {
                    reader.waiting.insert(seq_id, plan);
                    self.scheduler.suspend(seq_id);
                    continue;
                }
            }
            self.install_onboarded(seq_id, plan);
        }
    }

    /// Writes a plan's blocks into free G1 blocks and registers them, so
    /// that the request's admission hits them. The G1 part of the prefix is
    /// held meanwhile; if it left G1 since the plan was made, nothing is
    /// installed. The scheduler is told how far the tiers hold `seq_id`'s
    /// prefix, so that it looks it up again if less of it is in the pool at
    /// the admission.
    fn install_onboarded(&mut self, seq_id: SeqId, plan: OnboardPlan) {
        let OnboardPlan { hashes, in_device, blocks, from_host, from_remote } = plan;
        if blocks.is_empty() {
            return;
        }
        let sequence: Vec<SequenceHash> = hashes.iter().map(|h| h.sequence).collect();
        let now_in_device = self.scheduler.cached_prefix(&sequence[..in_device + blocks.len()]);
        // The whole prefix, even where the pool lost its start meanwhile or
        // has no room for all of it: the rest is looked up again before the
        // admission rather than computed (the tiers likely still hold it).
        self.scheduler.onboarded(seq_id, in_device + blocks.len());
        if now_in_device < in_device {
            return;
        }
        // Blocks cached meanwhile are not installed again.
        let skip = now_in_device - in_device;
        let held = self.scheduler.hold_prefix(&sequence[..now_in_device]);
        let parent = now_in_device.checked_sub(1).map(|i| sequence[i]);
        let executor = &mut self.executor;
        let started = Instant::now();
        let tenant = self.scheduler.kv_tenant(seq_id);
        let onboarded = self.scheduler.install_prefix(parent, tenant, &hashes[now_in_device..in_device + blocks.len()], |block, index| {
            match executor.write_block(block, &blocks[skip + index].bytes) {
                Ok(()) => true,
                Err(error) => {
                    tracing::warn!(%error, "cannot onboard a KV block from a lower tier; computing it here");
                    false
                }
            }
        });
        let took = started.elapsed();
        self.scheduler.release_pinned(&held);
        // Blocks skipped or not installed are counted off the nearest
        // tiers first.
        let from_host = from_host.saturating_sub(skip).min(onboarded);
        // A host block's read is its copy into the pool, which costs the
        // same for every installed block (modelled transfers were timed
        // by the model).
        if let Some(fetch) = self.fetch.as_ref().filter(|_| self.modelled.is_none() && from_host > 0) {
            fetch.lock().observe_host(onboarded, took, Instant::now());
        }
        let from_remote = from_remote.min(onboarded - from_host);
        if let Some(host) = &self.host {
            host.stats().onboarded_blocks.fetch_add(from_host as u64, Ordering::Relaxed);
            if let Some(disk) = host.disk() {
                disk.stats().onboarded_blocks.fetch_add((onboarded - from_host - from_remote) as u64, Ordering::Relaxed);
            }
        }
        if let Some(remote) = &self.remote {
            remote.stats().onboarded_blocks.fetch_add(from_remote as u64, Ordering::Relaxed);
        }
        let block_size = self.scheduler.config().block_size;
        self.stats.onboarded_prompt_tokens.fetch_add((onboarded * block_size) as u64, Ordering::Relaxed);
        // Host blocks are in the host tier already; disk blocks are copied
        // up again (they are hot).
        let registered = self.scheduler.take_registered();
        if let Some(offload) = &mut self.offload {
            let host = self.host.as_ref();
            offload.queued.extend(
                registered.into_iter().filter(|item| !host.is_some_and(|host| host.contains(item.hashes.sequence))).map(|item| OffloadBlock {
                    block: item.block,
                    parent: item.parent,
                    hashes: item.hashes,
                    tenant: item.tenant,
                }),
            );
            self.dispatch_offloads();
        }
    }

    /// Installs the prefixes whose reads finished and puts their sequences
    /// back at the front of the queue.
    fn finish_reads(&mut self) {
        let Some(reader) = &mut self.reader else { return };
        let mut finished = Vec::new();
        while let Ok(done) = reader.done.try_recv() {
            if let Some(plan) = reader.waiting.remove(&done.id) {
                finished.push((done.id, plan, done.blocks, done.from_host, done.from_remote));
            }
        }
        if reader.waiting.is_empty() {
            reader.fetch.lock().reader_idle();
        }
        for (seq_id, mut plan, blocks, from_host, from_remote) in finished {
            plan.blocks.extend(blocks);
            plan.from_host += from_host;
            plan.from_remote = from_remote;
            self.install_onboarded(seq_id, plan);
            // False when it was cancelled meanwhile: the blocks stay cached.
            self.scheduler.resume(seq_id);
        }
    }

    /// Whether copies to the host tier or disk reads are in flight.
    fn tier_work_in_flight(&self) -> bool {
        self.offload.as_ref().is_some_and(|offload| offload.pinned > 0) || self.reader.as_ref().is_some_and(|reader| !reader.waiting.is_empty())
    }

    /// Publishes the scheduler's load (sequences suspended for their
    /// prefix's blocks count as waiting).
    fn set_load(&self) {
        self.stats.set_load(self.scheduler.load());
    }

    /// Queues the blocks registered since the last call for the offload
    /// thread, and hands it what fits.
    fn offload_registered(&mut self) {
        let Some(offload) = &mut self.offload else { return };
        let registered = self.scheduler.take_registered();
        if registered.is_empty() {
            return;
        }
        offload.queued.extend(registered.into_iter().map(|item| OffloadBlock {
            block: item.block,
            parent: item.parent,
            hashes: item.hashes,
            tenant: item.tenant,
        }));
        let mut skipped = 0;
        while offload.queued.len() > offload.queue_limit {
            offload.queued.pop_front();
            skipped += 1;
        }
        self.count_skipped(skipped);
        self.dispatch_offloads();
    }

    /// Pins queued blocks (those still cached) up to the limit and sends
    /// them to the offload thread.
    fn dispatch_offloads(&mut self) {
        let Some(offload) = &mut self.offload else { return };
        let mut batch = Vec::new();
        let mut skipped = 0;
        while offload.pinned + batch.len() < offload.limit {
            let Some(item) = offload.queued.pop_front() else { break };
            if self.scheduler.pin_cached(item.block, item.hashes.sequence) {
                batch.push(item);
            } else {
                // Evicted before its turn.
                skipped += 1;
            }
        }
        if !batch.is_empty() {
            let blocks: Vec<BlockId> = batch.iter().map(|item| item.block).collect();
            offload.pinned += batch.len();
            if offload.jobs.send(batch).is_err() {
                // The copy thread is gone: give the blocks back at once.
                offload.pinned -= blocks.len();
                self.scheduler.release_pinned(&blocks);
            }
        }
        self.count_skipped(skipped);
    }

    fn count_skipped(&self, skipped: usize) {
        if let Some(host) = &self.host
            && skipped > 0
        {
            host.stats().offloads_skipped.fetch_add(skipped as u64, Ordering::Relaxed);
        }
    }

    /// Unpins the blocks whose copies finished, and sends the next ones.
    fn unpin_offloaded(&mut self) {
        let Some(offload) = &mut self.offload else { return };
        let mut released = false;
        while let Ok(blocks) = offload.done.try_recv() {
            offload.pinned -= blocks.len();
            self.scheduler.release_pinned(&blocks);
            released = true;
        }
        if released {
            self.dispatch_offloads();
            self.publish();
        }
    }

    /// Every cached block in any tier, for a dump.
    fn cached_blocks(&self) -> Vec<CachedBlock> {
        let mut blocks = self.scheduler.cached_blocks();
        if let Some(host) = &self.host {
            let mut at: HashMap<SequenceHash, usize> = blocks.iter().enumerate().map(|(i, b)| (b.sequence_hash, i)).collect();
            let lower = host.cached_blocks().into_iter().chain(host.disk().map(|disk| disk.cached_blocks()).unwrap_or_default());
            for block in lower {
                match at.get(&block.sequence_hash) {
                    Some(&i) => blocks[i].tiers.0 |= block.tiers.0,
                    None => {
                        at.insert(block.sequence_hash, blocks.len());
                        blocks.push(block);
                    }
                }
            }
        }
        blocks
    }

    fn drop_cancelled(&mut self) {
        let cancelled: Vec<SeqId> = self.outputs.iter().filter(|(_, sender)| sender.is_closed()).map(|(&id, _)| id).collect();
        for seq_id in cancelled {
            self.outputs.remove(&seq_id);
            self.scheduler.abort(seq_id);
            self.executor.release(seq_id);
            tracing::debug!(seq_id, "sequence cancelled by its caller");
        }
    }

    fn step(&mut self) {
        let plan: Vec<ScheduledChunk> = self.scheduler.schedule();
        if plan.is_empty() {
            if self.scheduler.awaits_look_up() {
                // The head of the queue is looked up before the next step.
                return;
            }
            // Nothing fits right now (e.g. the head of the queue waits for
            // blocks held by nobody running): should not happen, but never spin.
            tracing::warn!(load = ?self.scheduler.load(), "scheduler planned an empty step");
            std::thread::sleep(std::time::Duration::from_millis(1));
            return;
        }
        let started = Instant::now();
        let (prompt_tokens, sampled) = {
            let batch = self.scheduler.batch(&plan);
            let prompt_tokens = batch.prefill_tokens();
            self.stats.prefill_tokens.fetch_add(prompt_tokens as u64, Ordering::Relaxed);
            (prompt_tokens, self.executor.execute(&batch))
        };
        let took = started.elapsed();
        self.stats.busy_nanos.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        if let Some(fetch) = &self.fetch {
            fetch.lock().observe_step(prompt_tokens, took);
        }
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        let sampled = match sampled {
            Ok(sampled) if sampled.len() == plan.len() => sampled,
            Ok(sampled) => {
                self.fail_batch(&plan, ExecutorError::WrongResults { expected: plan.len(), got: sampled.len() });
                return;
            }
            Err(error) => {
                self.fail_batch(&plan, error);
                return;
            }
        };
        let tokens: Vec<Option<u32>> = sampled.iter().map(|s| s.as_ref().map(|s| s.token)).collect();
        let updates = self.scheduler.complete(&plan, &tokens);
        self.offload_registered();
        // Log-probabilities ride along with the token the scheduler accepted.
        let mut logprobs: Vec<(SeqId, TokenLogprobs)> =
            plan.iter().zip(sampled).filter_map(|(chunk, sampled)| Some((chunk.seq_id, sampled?.logprobs?))).collect();
        // Load first: a caller that sees its sequence finish sees its blocks freed.
        self.set_load();
        for update in updates {
            let Some(sender) = self.outputs.get(&update.seq_id) else { continue };
            if let Some(blocks) = update.pinned {
                let pin_id = self.next_pin_id;
                self.next_pin_id += 1;
                self.pins.insert(pin_id, blocks.iter().map(|(block, _)| *block).collect());
                if sender.send(EngineOutput::Pinned(PinnedPrefix { pin_id, blocks })).is_err() {
                    // Nobody will ever release it.
                    let blocks = self.pins.remove(&pin_id).unwrap_or_default();
                    self.scheduler.release_pinned(&blocks);
                }
            }
            if let Some(token) = update.token {
                self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
                let token_logprobs = logprobs.iter().position(|(id, _)| *id == update.seq_id).map(|i| logprobs.swap_remove(i).1);
                let _ = sender.send(EngineOutput::Token(token, token_logprobs));
            }
            if let Some((reason, usage)) = update.finished {
                self.stats.cached_prompt_tokens.fetch_add(usage.cached_prompt_tokens as u64, Ordering::Relaxed);
                let _ = sender.send(EngineOutput::Finished { reason, usage });
                self.outputs.remove(&update.seq_id);
                self.executor.release(update.seq_id);
            }
        }
        self.stats.preemptions.store(self.scheduler.total_preemptions(), Ordering::Relaxed);
        self.stats.fair_share_evictions.store(self.scheduler.fair_share_evictions(), Ordering::Relaxed);
        self.publish();
    }

    /// Publishes load and KV events.
    fn publish(&mut self) {
        self.set_load();
        self.scheduler.drain_events(&mut self.event_buffer);
        if let Some(host) = &self.host {
            host.drain_events(&mut self.event_buffer);
        }
        for event in self.event_buffer.drain(..) {
            let numbered = NumberedEvent { event_id: self.next_event_id, event };
            self.next_event_id += 1;
            // No subscriber is fine: events are only for whoever listens.
            let _ = self.events.send(numbered);
        }
    }

    fn fail_batch(&mut self, plan: &[ScheduledChunk], error: ExecutorError) {
        tracing::error!(%error, "executor failed a step");
        for chunk in plan {
            if let Some(sender) = self.outputs.remove(&chunk.seq_id) {
                let _ = sender.send(EngineOutput::Failed(EngineError::Executor(error.clone())));
            }
            self.scheduler.abort(chunk.seq_id);
            self.executor.release(chunk.seq_id);
        }
        self.publish();
    }

    fn fail_all(&mut self) {
        if let Some(reader) = &mut self.reader {
            reader.waiting.clear();
        }
        let ids: Vec<SeqId> = self.scheduler.sequence_ids().collect();
        for seq_id in ids {
            if let Some(sender) = self.outputs.remove(&seq_id) {
                let _ = sender.send(EngineOutput::Failed(EngineError::ShuttingDown));
            }
            self.scheduler.abort(seq_id);
            self.executor.release(seq_id);
        }
        self.publish();
    }
}

//! Continuous batching: which tokens of which sequences run in the next
//! engine step.
//!
//! Each step has a token budget. Running sequences come first, oldest
//! first: a decoding sequence needs one token, a sequence still prefilling
//! gets the next chunk of its prompt (chunked prefill). Then waiting
//! sequences are admitted in arrival order while the budget, the sequence
//! limit and the block pool allow; admission reuses every cached leading
//! block of the prompt. When a running sequence needs a block and none is
//! free, the youngest running sequence is preempted: its blocks are released
//! (cached ones stay reusable) and it goes back to the front of the queue to
//! be recomputed later. Nothing is dropped.
//!
//! The scheduler knows nothing of models or transports; an executor runs the
//! [`Batch`] it plans and hands back one sampled token per sampling item.

use std::collections::{HashMap, VecDeque};

use turbine_kv::{BlockHasher, BlockHashes, KvTenant, SequenceHash};

use crate::block_manager::{BlockId, BlockManager, RegisteredBlock};
use crate::request::{FinishReason, GenerateRequest, Load, SamplingParams, StopConditions, Usage};
use turbine_kv::KvEvent;

/// Engine-local sequence id.
pub type SeqId = u64;

/// Limits of the scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Blocks in the KV pool.
    pub num_blocks: usize,
    /// Sequences running at once.
    pub max_num_seqs: usize,
    /// Tokens computed per step (prefill chunks plus decodes).
    pub max_batched_tokens: usize,
    /// Prompt plus generated tokens per sequence.
    pub max_model_len: usize,
    /// Sequences allowed to wait; more are refused as overload.
    pub max_waiting: usize,
    /// Reuse cached prefix blocks across requests.
    pub prefix_caching: bool,
    /// Split long prompts across steps; when off, a prompt is admitted only
    /// when it fits the budget whole.
    pub chunked_prefill: bool,
    /// Block-hash seed (a salt separates tenants or adapters).
    pub hash_seed: u64,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 4096,
            max_num_seqs: 256,
            max_batched_tokens: 8192,
            max_model_len: 8192,
            max_waiting: 4096,
            prefix_caching: true,
            chunked_prefill: true,
            hash_seed: turbine_kv::DEFAULT_SEED,
        }
    }
}

impl SchedulerConfig {
    /// Checks a request against the limits: an error means it can never run.
    pub fn validate(&self, request: &GenerateRequest) -> Result<(), AdmissionError> {
        let prompt_len = request.prompt.len();
        if prompt_len == 0 {
            return Err(AdmissionError::Invalid("the prompt is empty".into()));
        }
        if request.stop.max_tokens == 0 {
            return Err(AdmissionError::Invalid("max_tokens must be at least 1".into()));
        }
        let total = prompt_len + request.stop.max_tokens as usize;
        if total > self.max_model_len {
            return Err(AdmissionError::Invalid(format!(
                "prompt ({prompt_len} tokens) plus max_tokens ({}) exceeds the context length of {} tokens",
                request.stop.max_tokens, self.max_model_len
            )));
        }
        let needed = total.div_ceil(self.block_size);
        if needed > self.num_blocks {
            return Err(AdmissionError::Invalid(format!("the request needs {needed} KV blocks but the pool has {}", self.num_blocks)));
        }
        Ok(())
    }
}

/// Why a request was refused at submission.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    /// The request can never run (empty prompt, too long, bigger than the pool).
    #[error("{0}")]
    Invalid(String),
    /// The waiting queue is full; retry later.
    #[error("engine queue is full ({0} requests waiting)")]
    QueueFull(usize),
}

#[derive(Debug)]
struct Sequence {
    /// Prompt, then generated tokens.
    tokens: Vec<u32>,
    prompt_len: usize,
    /// Tokens whose KV is in the cache.
    num_computed: usize,
    /// The block table.
    blocks: Vec<BlockId>,
    /// Hashes of the complete blocks of `tokens` computed so far.
    hashes: Vec<BlockHashes>,
    /// Hashes its blocks in its request's KV namespace.
    hasher: BlockHasher,
    /// Whose blocks it computes.
    kv_tenant: KvTenant,
    /// Its turn in the queue among the tenants' requests ([`Turns`]).
    turn: u64,
    /// Leading blocks already registered in (or taken from) the prefix cache.
    num_registered: usize,
    sampling: SamplingParams,
    stop: StopConditions,
    /// Prompt tokens found in the prefix cache at first admission.
    cached_prompt_tokens: Option<usize>,
    /// Times this sequence was preempted and recomputed.
    preemptions: u32,
    /// A prefill for another worker: keep the prompt's full blocks pinned
    /// when it finishes.
    pin: bool,
    /// Prompt tokens installed from another worker's prefill (not counted
    /// as cached: they were computed for this request).
    imported_tokens: usize,
    /// Whether its prefix was looked up in the lower KV tiers since it last
    /// joined the queue.
    onboard_checked: bool,
    /// Admission would have taken it, but it was not looked up: it is due
    /// at the head of the queue whether or not it fits the look-up's
    /// reckoning.
    look_up_now: bool,
    /// Leading blocks a lower tier's look-up found for it, which its
    /// admission should find in the pool (0: none since it joined the
    /// queue).
    onboarded_prefix: usize,
    /// Times that prefix was short in the pool at its admission (evicted
    /// meanwhile, or installed only in part) and was looked up again.
    onboard_retries: u32,
}

impl Sequence {
    fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// Times a sequence whose onboarded prefix is short in the pool at its
/// admission (evicted meanwhile, or installed only in part) is looked up
/// again; then it computes what is missing. Each retry reads the tier
/// again; 4 against 2 took the QA replay's hit rate from 0.755 to 0.772
/// (docs/benchmarks.md).
pub const MAX_ONBOARD_RETRIES: u32 = 4;

/// One sequence's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledChunk {
    /// The sequence.
    pub seq_id: SeqId,
    /// First token position computed this step.
    pub start: usize,
    /// Tokens computed this step.
    pub len: usize,
    /// Whether the chunk reaches the last known token, so the executor must
    /// sample the next one.
    pub sample: bool,
}

/// What the executor must compute for one sequence in a step.
#[derive(Debug)]
pub struct BatchItem<'a> {
    /// The sequence.
    pub seq_id: SeqId,
    /// Every token of the sequence so far (prompt and generated).
    pub tokens: &'a [u32],
    /// Tokens `start..start + len` are computed this step.
    pub start: usize,
    /// See `start`.
    pub len: usize,
    /// The sequence's block table, covering at least `start + len` tokens.
    pub block_table: &'a [BlockId],
    /// Sample the next token after this chunk.
    pub sample: bool,
    /// How to sample.
    pub sampling: &'a SamplingParams,
    /// Tokens generated so far (for seeded sampling streams).
    pub generated: usize,
    /// End-of-sequence tokens do not end this sequence.
    pub ignore_eos: bool,
}

/// One engine step: the chunks to compute, in order.
#[derive(Debug)]
pub struct Batch<'a> {
    /// Per-sequence work.
    pub items: Vec<BatchItem<'a>>,
    /// Tokens in the pool's blocks per block.
    pub block_size: usize,
    /// Fraction of the block pool in use (0..1), for timing models.
    pub kv_usage: f64,
}

impl Batch<'_> {
    /// Tokens computed in prefill chunks (every chunk but single-token decodes).
    pub fn prefill_tokens(&self) -> usize {
        self.items.iter().filter(|item| !is_decode(item)).map(|item| item.len).sum()
    }

    /// Sequences decoding one token.
    pub fn decode_sequences(&self) -> usize {
        self.items.iter().filter(|item| is_decode(item)).count()
    }
}

fn is_decode(item: &BatchItem<'_>) -> bool {
    item.len == 1 && item.sample && item.start + 1 == item.tokens.len() && item.start > 0
}

/// The result of one sequence in a completed step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SequenceUpdate {
    /// The sequence.
    pub seq_id: SeqId,
    /// A token to stream to the client, if one was produced.
    pub token: Option<u32>,
    /// Set when the sequence ended; it is gone from the scheduler.
    pub finished: Option<(FinishReason, Usage)>,
    /// A prefill's full prompt blocks, still referenced (release them with
    /// [`Scheduler::release_pinned`]).
    pub pinned: Option<Vec<(BlockId, BlockHashes)>>,
}

/// Whose turn it is in the waiting queue: the tenants' requests take
/// turns weighted by the tokens each may cost (start-time fair queueing),
/// so that one tenant's thousand queued requests, or its few very long
/// ones, do not keep another's first one waiting behind them all. A
/// request's turn starts where its tenant's previous request's tokens
/// end (its prompt plus `max_tokens`), or at the turn of the last request
/// admitted where that is later (a tenant that had nothing queued starts
/// now, not back where it left off). An open deployment's requests are
/// all the shared tenant's, first come first served.
#[derive(Debug, Default)]
struct Turns {
    /// The turn of the last request admitted.
    now: u64,
    /// Where each tenant's latest request's tokens end.
    latest: HashMap<KvTenant, u64>,
}

impl Turns {
    /// The turn of a new request of `tenant` that may cost `tokens`.
    fn next(&mut self, tenant: KvTenant, tokens: u64) -> u64 {
        let latest = self.latest.entry(tenant).or_default();
        let turn = (*latest).max(self.now);
        *latest = turn.saturating_add(tokens.max(1));
        turn
    }

    /// A request of turn `turn` was admitted.
    fn taken(&mut self, turn: u64) {
        self.now = self.now.max(turn);
    }

    /// Forgets the tenants with no request among `waiting`'s (each then
    /// starts at `now` again, as a tenant new to the queue does), once
    /// more are remembered than requests wait, give or take: their number
    /// stays bounded by the queue's.
    fn forget_idle(&mut self, queued: usize, waiting: impl Iterator<Item = KvTenant>) {
        if self.latest.len() > queued + 16 {
            let waiting: std::collections::HashSet<KvTenant> = waiting.collect();
            self.latest.retain(|tenant, _| waiting.contains(tenant));
        }
    }
}

/// The scheduler: queues, sequences and the block pool.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    blocks: BlockManager,
    /// Tokens that end generation unless a request ignores them.
    eos_token_ids: Vec<u32>,
    sequences: HashMap<SeqId, Sequence>,
    /// In turn order ([`Turns`]), save that preempted and resumed
    /// sequences go back to the front.
    waiting: VecDeque<SeqId>,
    turns: Turns,
    /// Oldest first.
    running: VecDeque<SeqId>,
    /// Taken out of the queue while their prefix comes back from a lower
    /// KV tier ([`suspend`](Self::suspend)); they count as waiting.
    /// Each suspended sequence's blocks, held back from admission so that
    /// its prefix finds room when its read finishes.
    suspended: HashMap<SeqId, usize>,
    /// Their sum.
    reserved_blocks: usize,
    /// A lower tier can hold prefixes: a sequence is admitted only once its
    /// prefix was looked up there.
    look_up_first: bool,
    next_id: SeqId,
    total_preemptions: u64,
}

impl Scheduler {
    /// A scheduler with an empty pool; `eos_token_ids` end every sequence
    /// that does not ask to ignore them.
    pub fn new(config: SchedulerConfig, eos_token_ids: Vec<u32>) -> Self {
        let blocks = BlockManager::new(config.num_blocks, config.block_size, config.prefix_caching);
        Self {
            config,
            blocks,
            eos_token_ids,
            sequences: HashMap::new(),
            waiting: VecDeque::new(),
            turns: Turns::default(),
            running: VecDeque::new(),
            suspended: HashMap::new(),
            reserved_blocks: 0,
            look_up_first: false,
            next_id: 0,
            total_preemptions: 0,
        }
    }

    /// The configuration.
    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues a request.
    pub fn add(&mut self, request: GenerateRequest) -> Result<SeqId, AdmissionError> {
        self.add_with(request, Vec::new(), false)
    }

    /// Queues a request whose first `generated` output tokens were produced
    /// elsewhere (a decode after a remote prefill), or, with `pin`, a
    /// prefill whose full prompt blocks stay referenced when it finishes.
    pub fn add_with(&mut self, request: GenerateRequest, generated: Vec<u32>, pin: bool) -> Result<SeqId, AdmissionError> {
        self.add_imported(request, generated, pin, 0)
    }

    /// [`add_with`](Self::add_with) for a sequence whose first
    /// `imported_tokens` prompt tokens were just installed from another
    /// worker: they are hits, but not reported as cached.
    pub fn add_imported(&mut self, request: GenerateRequest, generated: Vec<u32>, pin: bool, imported_tokens: usize) -> Result<SeqId, AdmissionError> {
        self.config.validate(&request)?;
        if generated.len() >= request.stop.max_tokens as usize {
            return Err(AdmissionError::Invalid(format!("{} tokens were already generated of max_tokens {}", generated.len(), request.stop.max_tokens)));
        }
        let waiting = self.waiting.len() + self.suspended.len();
        if waiting >= self.config.max_waiting {
            return Err(AdmissionError::QueueFull(waiting));
        }
        let id = self.next_id;
        self.next_id += 1;
        self.turns.forget_idle(self.waiting.len(), self.waiting.iter().map(|queued| self.sequences[queued].kv_tenant));
        let tokens = (request.prompt.len() + request.stop.max_tokens as usize) as u64;
        let turn = self.turns.next(request.kv_tenant, tokens);
        let prompt_len = request.prompt.len();
        let mut tokens = request.prompt;
        tokens.extend(generated);
        self.sequences.insert(
            id,
            Sequence {
                tokens,
                prompt_len,
                num_computed: 0,
                blocks: Vec::new(),
                hashes: Vec::new(),
                hasher: BlockHasher::salted(self.config.hash_seed, request.cache_salt),
                kv_tenant: request.kv_tenant,
                turn,
                num_registered: 0,
                sampling: request.sampling,
                stop: request.stop,
                cached_prompt_tokens: None,
                preemptions: 0,
                pin,
                imported_tokens,
                onboard_checked: false,
                look_up_now: false,
                onboarded_prefix: 0,
                onboard_retries: 0,
            },
        );
        // Behind every request whose turn is not after its own.
        let behind = self.waiting.iter().rposition(|queued| self.sequences[queued].turn <= turn).map_or(0, |at| at + 1);
        self.waiting.insert(behind, id);
        Ok(id)
    }

    /// Removes a sequence wherever it is, releasing its blocks. Returns
    /// whether it existed.
    pub fn abort(&mut self, seq_id: SeqId) -> bool {
        let Some(sequence) = self.sequences.remove(&seq_id) else { return false };
        self.waiting.retain(|&id| id != seq_id);
        self.running.retain(|&id| id != seq_id);
        self.unreserve(seq_id);
        self.blocks.release(sequence.blocks.into_iter().rev());
        true
    }

    /// Whether any sequence is queued or running (suspended ones aside:
    /// nothing can be scheduled for them).
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// The waiting sequences at the front of the queue that the next step
    /// could admit (those that fit the free blocks, the free seats and the
    /// step's token budget together), whose prefix was not looked up in the
    /// lower KV tiers since they joined the queue, each with the hashes of
    /// the blocks admission could reuse; they are marked looked up. (A
    /// preempted sequence is looked up again.) Blocks onboarded for a
    /// sequence further back would likely be evicted again before its turn.
    /// The head of the queue is due, whether or not it fits this
    /// reckoning, when admission would have taken it but found it not
    /// looked up (see [`look_up_before_admission`](Self::look_up_before_admission)).
    pub fn due_for_onboard(&mut self) -> Vec<(SeqId, Vec<BlockHashes>)> {
        let block_size = self.config.block_size;
        let mut due = Vec::new();
        // As admission reckons: running sequences take a token each at least,
        // a prompt longer than what is left of the budget is admitted with
        // its first chunk.
        let mut budget = self.config.max_batched_tokens.saturating_sub(self.running.len());
        let mut free = self.blocks.num_free().saturating_sub(self.reserved_blocks);
        let mut seats = self.config.max_num_seqs.saturating_sub(self.running.len());
        for (position, &seq_id) in self.waiting.iter().enumerate() {
            let sequence = self.sequences.get_mut(&seq_id).expect("waiting sequence exists");
            let chunk = sequence.tokens.len().min(budget);
            let needed = self.blocks.blocks_for(chunk);
            let fits = budget > 0 && seats > 0 && needed <= free;
            if !(fits || (position == 0 && sequence.look_up_now)) {
                break;
            }
            free = free.saturating_sub(needed);
            seats = seats.saturating_sub(1);
            budget -= chunk;
            if sequence.onboard_checked {
                continue;
            }
            sequence.onboard_checked = true;
            sequence.look_up_now = false;
            extend_hashes(sequence, block_size);
            let reusable = ((sequence.tokens.len() - 1) / block_size).min(sequence.hashes.len());
            due.push((seq_id, sequence.hashes[..reusable].to_vec()));
        }
        due
    }

    /// Takes a waiting sequence out of the queue while its prefix is
    /// fetched from a lower tier; [`resume`](Self::resume) puts it back.
    /// The blocks its first chunk needs stay reserved meanwhile: sequences
    /// behind it are admitted only into what is left, so the fetched prefix
    /// finds room when it is installed (save one whose own onboarded prefix
    /// is in the pool, which needs only the blocks past it).
    pub fn suspend(&mut self, seq_id: SeqId) {
        let before = self.waiting.len();
        self.waiting.retain(|&id| id != seq_id);
        if self.waiting.len() < before {
            let chunk = self.sequences[&seq_id].tokens.len().min(self.config.max_batched_tokens);
            let reserved = self.blocks.blocks_for(chunk);
            self.suspended.insert(seq_id, reserved);
            self.reserved_blocks += reserved;
        }
    }

    /// Ends a suspension; whether the sequence was suspended.
    fn unreserve(&mut self, seq_id: SeqId) -> bool {
        match self.suspended.remove(&seq_id) {
            Some(reserved) => {
                self.reserved_blocks -= reserved;
                true
            }
            None => false,
        }
    }

    /// Puts a suspended sequence back at the front of the queue (it waited
    /// its turn already). Returns false if it is gone (aborted meanwhile).
    pub fn resume(&mut self, seq_id: SeqId) -> bool {
        if self.unreserve(seq_id) {
            self.waiting.push_front(seq_id);
            true
        } else {
            false
        }
    }

    /// Prompt tokens the running sequences have still to compute (their
    /// prefill's rest; a decoding sequence's one token is not prefill): the
    /// steps compute these before any waiting sequence's.
    pub fn prefill_running(&self) -> usize {
        self.running
            .iter()
            .map(|seq_id| {
                let sequence = &self.sequences[seq_id];
                sequence.tokens.len() - sequence.num_computed
            })
            .filter(|&rest| rest > 1)
            .sum()
    }

    /// Ids of every live sequence.
    pub fn sequence_ids(&self) -> impl Iterator<Item = SeqId> + '_ {
        self.sequences.keys().copied()
    }

    /// Current occupancy.
    pub fn load(&self) -> Load {
        Load {
            running: self.running.len() as u32,
            waiting: (self.waiting.len() + self.suspended.len()) as u32,
            blocks_used: self.blocks.num_used() as u32,
            blocks_total: self.blocks.num_blocks() as u32,
        }
    }

    /// Preemptions since start.
    pub fn total_preemptions(&self) -> u64 {
        self.total_preemptions
    }

    /// Cached pool blocks evicted because their tenant held more than its
    /// share of the pool, since start.
    pub fn fair_share_evictions(&self) -> u64 {
        self.blocks.fair_share_evictions()
    }

    /// The block pool (read-only).
    pub fn block_manager(&self) -> &BlockManager {
        &self.blocks
    }

    /// Moves the KV events recorded since the last call into `out`.
    pub fn drain_events(&mut self, out: &mut Vec<KvEvent>) {
        self.blocks.drain_events(out);
    }

    /// Every block in the prefix cache (events drained or not).
    pub fn cached_blocks(&self) -> Vec<turbine_kv::CachedBlock> {
        self.blocks.cached_blocks()
    }

    /// Plans the next step. An empty plan means nothing can run now.
    pub fn schedule(&mut self) -> Vec<ScheduledChunk> {
        let mut budget = self.config.max_batched_tokens;
        let mut plan = Vec::new();
        let mut preempted = false;

        let mut index = 0;
        while index < self.running.len() && budget > 0 {
            let seq_id = self.running[index];
            let sequence = &self.sequences[&seq_id];
            let len = (sequence.tokens.len() - sequence.num_computed).min(budget);
            if !self.reserve_blocks(seq_id, len, &mut preempted) {
                // The sequence preempted itself: it was the youngest.
                break;
            }
            let sequence = &self.sequences[&seq_id];
            let sample = sequence.num_computed + len == sequence.tokens.len();
            plan.push(ScheduledChunk { seq_id, start: sequence.num_computed, len, sample });
            budget -= len;
            index += 1;
        }

        if !preempted {
            self.admit(&mut budget, &mut plan);
        }
        plan
    }

    /// Makes sure `seq_id` (running) has blocks for `len` more tokens,
    /// preempting the youngest running sequences if needed. Returns false if
    /// the sequence itself had to be preempted.
    fn reserve_blocks(&mut self, seq_id: SeqId, len: usize, preempted: &mut bool) -> bool {
        loop {
            let sequence = &self.sequences[&seq_id];
            let needed = self.blocks.blocks_for(sequence.num_computed + len).saturating_sub(sequence.blocks.len());
            if needed == 0 {
                return true;
            }
            if let Some(new_blocks) = self.blocks.allocate(needed, sequence.kv_tenant) {
                self.sequences.get_mut(&seq_id).expect("running sequence exists").blocks.extend(new_blocks);
                return true;
            }
            let victim = *self.running.back().expect("the sequence itself is running");
            self.preempt(victim);
            *preempted = true;
            if victim == seq_id {
                return false;
            }
        }
    }

    fn preempt(&mut self, seq_id: SeqId) {
        self.running.retain(|&id| id != seq_id);
        let sequence = self.sequences.get_mut(&seq_id).expect("preempted sequence exists");
        let blocks = std::mem::take(&mut sequence.blocks);
        sequence.num_computed = 0;
        sequence.num_registered = 0;
        sequence.preemptions += 1;
        sequence.onboard_checked = false;
        sequence.onboarded_prefix = 0;
        self.blocks.release(blocks.into_iter().rev());
        self.waiting.push_front(seq_id);
        self.total_preemptions += 1;
        tracing::debug!(seq_id, "preempted sequence for recompute");
    }

    fn admit(&mut self, budget: &mut usize, plan: &mut Vec<ScheduledChunk>) {
        // Keep a little headroom so newly admitted sequences do not force
        // immediate preemptions when the pool is nearly full.
        let watermark = if self.running.is_empty() { 0 } else { self.config.num_blocks / 100 };
        while *budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(&seq_id) = self.waiting.front() else { break };
            let block_size = self.config.block_size;
            let sequence = self.sequences.get_mut(&seq_id).expect("waiting sequence exists");
            extend_hashes(sequence, block_size);
            // Always compute at least the last token, so there is something to sample from.
            let reusable = ((sequence.tokens.len() - 1) / block_size).min(sequence.hashes.len());
            let wanted: Vec<SequenceHash> = sequence.hashes[..reusable].iter().map(|h| h.sequence).collect();
            let hit = self.blocks.match_prefix(&wanted);
            // Its onboarded prefix left the pool while it waited for room
            // (the steps meanwhile evicted it): the lower tier still holds
            // it, so it is looked up again before the next step rather
            // than computed, a bounded number of times.
            if hit < sequence.onboarded_prefix && sequence.onboard_retries < MAX_ONBOARD_RETRIES {
                sequence.onboard_retries += 1;
                sequence.onboarded_prefix = 0;
                sequence.onboard_checked = false;
                break;
            }
            let num_computed = hit * block_size;
            let remaining = sequence.tokens.len() - num_computed;
            let len = if remaining <= *budget {
                remaining
            } else if self.config.chunked_prefill {
                *budget
            } else {
                break;
            };
            let new_blocks = self.blocks.blocks_for(num_computed + len) - hit;
            let free_hits = self.blocks.count_free_among_cached(&wanted[..hit]);
            // A sequence whose onboarded prefix is in the pool needs only
            // the blocks past it: the room kept for the reads of suspended
            // sequences behind it does not hold it back, since waiting, its
            // prefix would be evicted (by those very installs) and read
            // again. A read that then finds too little room is looked up
            // again in turn.
            let onboarded = sequence.onboarded_prefix > 0 && hit >= sequence.onboarded_prefix;
            let reserved = if onboarded { 0 } else { self.reserved_blocks };
            if new_blocks + watermark + reserved > self.blocks.num_free() - free_hits {
                break;
            }
            // It fits, but its prefix was not looked up in the lower tier
            // (admission takes it in a smaller first chunk than the look-up
            // reckons with: the running sequences' chunks take the step's
            // budget, a hit in the pool needs no new blocks): it is, before
            // the next step, rather than computing what the tier may hold.
            if self.look_up_first && !sequence.onboard_checked {
                self.sequences.get_mut(&seq_id).expect("waiting sequence exists").look_up_now = true;
                break;
            }
            let mut table = self.blocks.acquire_cached(&wanted[..hit]);
            table.extend(self.blocks.allocate(new_blocks, sequence.kv_tenant).expect("checked free blocks"));
            let sequence = self.sequences.get_mut(&seq_id).expect("waiting sequence exists");
            sequence.blocks = table;
            sequence.num_computed = num_computed;
            sequence.num_registered = hit;
            sequence.cached_prompt_tokens.get_or_insert(num_computed.min(sequence.prompt_len).saturating_sub(sequence.imported_tokens));
            let sample = num_computed + len == sequence.tokens.len();
            self.waiting.pop_front();
            self.turns.taken(sequence.turn);
            self.running.push_back(seq_id);
            plan.push(ScheduledChunk { seq_id, start: num_computed, len, sample });
            *budget -= len;
        }
    }

    /// The executor's view of a plan.
    pub fn batch<'a>(&'a self, plan: &[ScheduledChunk]) -> Batch<'a> {
        let items = plan
            .iter()
            .map(|chunk| {
                let sequence = &self.sequences[&chunk.seq_id];
                BatchItem {
                    seq_id: chunk.seq_id,
                    tokens: &sequence.tokens,
                    start: chunk.start,
                    len: chunk.len,
                    block_table: &sequence.blocks,
                    sample: chunk.sample,
                    sampling: &sequence.sampling,
                    generated: sequence.generated(),
                    ignore_eos: sequence.stop.ignore_eos,
                }
            })
            .collect();
        let total = self.blocks.num_blocks() as f64;
        Batch { items, block_size: self.config.block_size, kv_usage: self.blocks.num_used() as f64 / total }
    }

    /// Applies a computed step: `sampled[i]` is the token sampled for
    /// `plan[i]` (ignored unless the chunk samples). Registers newly full
    /// blocks in the prefix cache, appends tokens, and ends sequences that
    /// hit a stop condition.
    pub fn complete(&mut self, plan: &[ScheduledChunk], sampled: &[Option<u32>]) -> Vec<SequenceUpdate> {
        debug_assert_eq!(plan.len(), sampled.len());
        let mut updates = Vec::with_capacity(plan.len());
        for (chunk, token) in plan.iter().zip(sampled) {
            let Some(sequence) = self.sequences.get_mut(&chunk.seq_id) else { continue };
            sequence.num_computed = chunk.start + chunk.len;
            self.register_full_blocks(chunk.seq_id);
            let (Some(token), true) = (*token, chunk.sample) else { continue };
            let sequence = self.sequences.get_mut(&chunk.seq_id).expect("sequence exists");
            let stop_token = sequence.stop.stop_token_ids.contains(&token) || (!sequence.stop.ignore_eos && self.eos_token_ids.contains(&token));
            let (emitted, reason) = if stop_token {
                (None, Some(FinishReason::Stop))
            } else {
                sequence.tokens.push(token);
                let at_limit = sequence.generated() >= sequence.stop.max_tokens as usize || sequence.tokens.len() >= self.config.max_model_len;
                (Some(token), at_limit.then_some(FinishReason::Length))
            };
            let (finished, pinned) = match reason {
                Some(reason) => {
                    let (usage, pinned) = self.finish(chunk.seq_id);
                    (Some((reason, usage)), pinned)
                }
                None => (None, None),
            };
            updates.push(SequenceUpdate { seq_id: chunk.seq_id, token: emitted, finished, pinned });
        }
        updates
    }

    fn register_full_blocks(&mut self, seq_id: SeqId) {
        let block_size = self.config.block_size;
        let sequence = self.sequences.get_mut(&seq_id).expect("sequence exists");
        let full = sequence.num_computed / block_size;
        if full <= sequence.num_registered {
            return;
        }
        extend_hashes(sequence, block_size);
        let parent = sequence.num_registered.checked_sub(1).map(|i| sequence.hashes[i].sequence);
        let pairs: Vec<(BlockId, BlockHashes)> = (sequence.num_registered..full).map(|i| (sequence.blocks[i], sequence.hashes[i])).collect();
        sequence.num_registered = full;
        let tenant = sequence.kv_tenant;
        self.blocks.register(parent, tenant, &pairs);
    }

    fn finish(&mut self, seq_id: SeqId) -> (Usage, Option<Vec<(BlockId, BlockHashes)>>) {
        let sequence = self.sequences.remove(&seq_id).expect("finished sequence exists");
        self.running.retain(|&id| id != seq_id);
        // A prefill keeps its full prompt blocks (all computed) referenced.
        let kept = if sequence.pin { (sequence.prompt_len / self.config.block_size).min(sequence.hashes.len()) } else { 0 };
        self.blocks.release(sequence.blocks[kept..].iter().rev().copied());
        let pinned = sequence.pin.then(|| sequence.blocks[..kept].iter().copied().zip(sequence.hashes[..kept].iter().copied()).collect());
        let usage = Usage {
            prompt_tokens: sequence.prompt_len as u32,
            completion_tokens: sequence.generated() as u32,
            cached_prompt_tokens: sequence.cached_prompt_tokens.unwrap_or(0) as u32,
        };
        (usage, pinned)
    }

    /// Drops the references a finished prefill kept on its blocks.
    pub fn release_pinned(&mut self, blocks: &[BlockId]) {
        self.blocks.release(blocks.iter().rev().copied());
    }

    /// Admits a sequence only once [`due_for_onboard`](Self::due_for_onboard)
    /// handed it out (for an engine with a lower tier, whose caller looks
    /// every due prefix up there): one that admission would take before
    /// that is due at the next call instead, so a prefix the tier holds is
    /// never computed because admission took a smaller first chunk than
    /// the look-up reckoned with.
    pub fn look_up_before_admission(&mut self) {
        self.look_up_first = true;
    }

    /// Whether the head of the queue waits for its look-up (admission
    /// would have taken it): the next [`due_for_onboard`](Self::due_for_onboard)
    /// hands it out.
    pub fn awaits_look_up(&self) -> bool {
        self.waiting.front().is_some_and(|seq_id| self.sequences[seq_id].look_up_now)
    }

    /// Keeps every newly registered block for
    /// [`take_registered`](Self::take_registered) (a lower tier copies them).
    pub fn record_registered(&mut self) {
        self.blocks.record_stored();
    }

    /// The blocks registered in the prefix cache since the last call.
    pub fn take_registered(&mut self) -> Vec<RegisteredBlock> {
        self.blocks.take_stored()
    }

    /// Holds `block` while a lower tier copies it, if it is still cached
    /// under `hash`; release it with [`release_pinned`](Self::release_pinned).
    pub fn pin_cached(&mut self, block: BlockId, hash: SequenceHash) -> bool {
        self.blocks.pin_cached(block, hash)
    }

    /// Takes a reference on the cached block of each of `hashes` (all must
    /// be cached), so that installing what follows them cannot evict them;
    /// release them with [`release_pinned`](Self::release_pinned).
    pub fn hold_prefix(&mut self, hashes: &[SequenceHash]) -> Vec<BlockId> {
        self.blocks.acquire_cached(hashes)
    }

    /// Whose blocks sequence `seq_id` computes (the shared namespace's
    /// for a sequence no longer held).
    pub fn kv_tenant(&self, seq_id: SeqId) -> KvTenant {
        self.sequences.get(&seq_id).map_or(KvTenant::SHARED, |sequence| sequence.kv_tenant)
    }

    /// How many leading blocks of `hashes` are in the prefix cache.
    pub fn cached_prefix(&self, hashes: &[SequenceHash]) -> usize {
        self.blocks.match_prefix(hashes)
    }

    /// Installs blocks computed elsewhere into the prefix cache, in chain
    /// order after `parent`: each gets a free block, `write(block, index)`
    /// fills it (false stops the install), and the filled ones are
    /// registered (emitting `Stored` events) and left free-but-cached for
    /// the next admission to hit. Stops early when the pool has no free
    /// block. Returns how many were installed.
    pub fn install_prefix(
        &mut self,
        parent: Option<SequenceHash>,
        tenant: KvTenant,
        hashes: &[BlockHashes],
        mut write: impl FnMut(BlockId, usize) -> bool,
    ) -> usize {
        if !self.config.prefix_caching {
            return 0;
        }
        let mut filled = Vec::with_capacity(hashes.len());
        for (index, &block_hashes) in hashes.iter().enumerate() {
            let Some(block) = self.blocks.allocate(1, tenant).map(|blocks| blocks[0]) else { break };
            if !write(block, index) {
                self.blocks.release([block]);
                break;
            }
            filled.push((block, block_hashes));
        }
        self.blocks.register(parent, tenant, &filled);
        let installed = filled.len();
        self.blocks.release(filled.into_iter().rev().map(|(block, _)| block));
        installed
    }

    /// Records that a prefix was onboarded for `seq_id` (waiting or
    /// suspended): a lower tier held its first `prefix_blocks` blocks. If
    /// fewer are in the pool at its admission (they were evicted meanwhile,
    /// or the pool had no room to install them all), it is looked up again.
    pub fn onboarded(&mut self, seq_id: SeqId, prefix_blocks: usize) {
        if let Some(sequence) = self.sequences.get_mut(&seq_id) {
            sequence.onboarded_prefix = prefix_blocks;
        }
    }

    /// Times the sequence was preempted (None if unknown).
    pub fn preemptions(&self, seq_id: SeqId) -> Option<u32> {
        self.sequences.get(&seq_id).map(|s| s.preemptions)
    }

    /// Checks queue and pool invariants; panics on a violation.
    pub fn check_invariants(&self) {
        self.blocks.check_invariants();
        assert_eq!(self.waiting.len() + self.running.len() + self.suspended.len(), self.sequences.len(), "every sequence is in one queue");
        assert_eq!(self.reserved_blocks, self.suspended.values().sum::<usize>(), "reservations add up");
        assert!(self.running.len() <= self.config.max_num_seqs);
        let mut referenced = HashMap::<BlockId, u32>::new();
        for &seq_id in &self.running {
            let sequence = &self.sequences[&seq_id];
            assert!(sequence.blocks.len() * self.config.block_size >= sequence.num_computed, "blocks cover computed tokens");
            for &block in &sequence.blocks {
                *referenced.entry(block).or_default() += 1;
            }
        }
        for &seq_id in &self.waiting {
            assert!(self.sequences[&seq_id].blocks.is_empty(), "waiting sequences hold no blocks");
        }
        for (block, count) in referenced {
            assert_eq!(self.blocks.ref_count(block), count, "block {block} reference count");
        }
    }
}

/// Computes the hashes of every complete block of the sequence's tokens not
/// hashed yet.
fn extend_hashes(sequence: &mut Sequence, block_size: usize) {
    let (hasher, full) = (sequence.hasher, sequence.tokens.len() / block_size);
    for index in sequence.hashes.len()..full {
        let local = hasher.local(&sequence.tokens[index * block_size..(index + 1) * block_size]);
        let parent = index.checked_sub(1).map(|i| sequence.hashes[i].sequence);
        sequence.hashes.push(BlockHashes { local, sequence: hasher.chain(parent, local) });
    }
}

#[cfg(test)]
mod tests;

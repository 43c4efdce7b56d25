//! Where a router's `kv` decisions get their matches: a [`KvIndexClient`]
//! over the router's own replica (or the process's shared index), or over
//! a kv-index service; and approximate mode's record of past decisions.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use turbine_api::kv_index::{KvIndexClient, MatchAnswer, MatchQuery};
use turbine_kv::{BlockHasher, CacheSalt, KvEvent, KvIndex, SequenceHash, StoredBlock, Tier, WorkerId, WorkerMatch};
use turbine_kv_log::FollowerStatus;
use turbine_kv_log::LocalKvIndex;

use super::{KvConfig, KvWeights};

/// Each matching worker's leading blocks by best tier (index: [`Tier`] as
/// usize), keyed by worker. The answer's ids are moved in, not cloned.
pub type MatchesByWorker = FxHashMap<WorkerId, [u32; 4]>;

/// What the index said about one prompt.
#[derive(Debug, Clone, Default)]
pub struct KvLookup {
    /// Per block size: the prompt's hashes and each worker's match.
    by_size: Vec<(u32, Vec<SequenceHash>, MatchesByWorker)>,
    /// The workers asked about and their cached tree sizes (the
    /// tie-break), side by side.
    asked: Vec<WorkerId>,
    cached_trees: Vec<usize>,
}

impl KvLookup {
    /// `worker_id`'s match in block size `block_size` (leading blocks by
    /// best tier), if it matched.
    pub fn matched(&self, block_size: u32, worker_id: &str) -> Option<&[u32; 4]> {
        self.by_size.iter().find(|(size, _, _)| *size == block_size)?.2.get(worker_id)
    }

    /// The prompt's hashes in `block_size` (empty if not looked up).
    pub fn hashes(&self, block_size: u32) -> &[SequenceHash] {
        self.by_size.iter().find(|(size, _, _)| *size == block_size).map_or(&[], |(_, hashes, _)| hashes)
    }

    /// Blocks `worker_id` caches in all (0 if unknown).
    pub fn cached_tree(&self, worker_id: &str) -> usize {
        self.asked.iter().position(|asked| asked.as_str() == worker_id).map_or(0, |at| self.cached_trees[at])
    }

    /// [`cached_tree`](Self::cached_tree) of each of `workers`, in their
    /// order. The walk expects them in the order they were asked about (a
    /// router asks about its workers and then decides over them, some left
    /// out): each is then found at the next step or a few further, its id
    /// shared with the asked list and compared by pointer. Any order is
    /// answered right, just more slowly.
    pub fn cached_trees_of<'a>(&self, workers: impl IntoIterator<Item = &'a WorkerId>) -> Vec<usize> {
        let asked = self.asked.len();
        let mut next = 0;
        workers
            .into_iter()
            .map(|id| {
                (next..asked).chain(0..next).find(|&at| &self.asked[at] == id).map_or(0, |at| {
                    next = at + 1;
                    self.cached_trees[at]
                })
            })
            .collect()
    }
}

/// What a decision knows of the KV index.
#[derive(Debug, Clone, Default)]
pub enum KvView {
    /// The decision is not a `kv` one.
    #[default]
    NotAsked,
    /// The index could not answer (down, slow, or its log unreachable):
    /// route by load.
    Unavailable,
    /// The index answered.
    Matched(KvLookup),
}

/// Why a lookup gave no usable answer (a metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LookupError {
    /// The index could not be reached or failed the call.
    Unreachable,
    /// No answer within the lookup timeout.
    TimedOut,
    /// It answered, but its event log is unreachable (the answer may be stale).
    Stale,
}

impl LookupError {
    fn name(self) -> &'static str {
        match self {
            LookupError::Unreachable => "unreachable",
            LookupError::TimedOut => "timed_out",
            LookupError::Stale => "stale",
        }
    }
}

/// How long a failed kv-index is left alone.
const REMOTE_REST: Duration = Duration::from_millis(500);

/// A kv-index service's lookups: bounded in time, and skipped for a while
/// after a failure, so a dead or hung kv-index does not cost every request
/// a timeout.
#[derive(Debug)]
struct RemoteLookups {
    timeout: Duration,
    resting_until: Mutex<Option<Instant>>,
}

/// The index a router routes on.
#[derive(Debug)]
pub struct KvState {
    config: KvConfig,
    weights: KvWeights,
    index: KvIndexClient,
    /// The index when it lives in this process (approximate mode writes to
    /// it; workers that leave are dropped from it).
    replica: Option<Arc<KvIndex>>,
    approx: Option<Mutex<ApproxLog>>,
    /// Set when `index` is a kv-index service.
    remote: Option<RemoteLookups>,
}

#[derive(Debug, Default)]
struct ApproxLog {
    /// (expiry, worker, blocks) in decision order.
    entries: VecDeque<(Instant, WorkerId, Vec<SequenceHash>)>,
    /// Sum of the entries' lengths.
    blocks: usize,
    /// The latest expiry recorded for each (worker, block).
    latest: HashMap<(WorkerId, SequenceHash), Instant>,
}

impl KvState {
    /// Routing on `replica`, an index in this process: fed by worker
    /// events (through `follower` when it follows the event log, which says
    /// when the index may be stale) or, in approximate mode, by the
    /// router's own decisions.
    pub fn local(config: KvConfig, replica: Arc<KvIndex>, follower: Option<Arc<FollowerStatus>>) -> Self {
        let local = LocalKvIndex::new(replica.clone()).with_follower(follower);
        Self::with_client(config, KvIndexClient::new(Arc::new(local)), Some(replica), None)
    }

    /// Routing on a kv-index service's answers (`config.index_timeout_ms`
    /// each at most).
    pub fn remote(config: KvConfig, index: KvIndexClient) -> Self {
        let remote = RemoteLookups { timeout: Duration::from_millis(config.index_timeout_ms), resting_until: Mutex::new(None) };
        Self::with_client(config, index, None, Some(remote))
    }

    fn with_client(config: KvConfig, index: KvIndexClient, replica: Option<Arc<KvIndex>>, remote: Option<RemoteLookups>) -> Self {
        let approx = config.approximate.then(|| Mutex::new(ApproxLog::default()));
        Self { weights: config.weights(), config, index, replica, approx, remote }
    }

    /// The configuration.
    pub fn config(&self) -> &KvConfig {
        &self.config
    }

    /// The configured cost-function weights.
    pub fn weights(&self) -> KvWeights {
        self.weights
    }

    /// The index, when it lives in this process.
    pub fn replica(&self) -> Option<&Arc<KvIndex>> {
        self.replica.as_ref()
    }

    /// Each candidate's match for the prompt `tokens` in every block size
    /// of `block_sizes`, and the candidates' cached tree sizes.
    pub async fn look_up(&self, tokens: &[u32], salt: CacheSalt, candidates: Vec<WorkerId>, block_sizes: &[u32]) -> KvView {
        match self.ask(tokens, salt, candidates, block_sizes).await {
            Ok(lookup) => KvView::Matched(lookup),
            Err(error) => {
                if self.remote.is_some() {
                    crate::metrics::kv_index_error(error.name());
                }
                KvView::Unavailable
            }
        }
    }

    async fn ask(&self, tokens: &[u32], salt: CacheSalt, candidates: Vec<WorkerId>, block_sizes: &[u32]) -> Result<KvLookup, LookupError> {
        if let Some(remote) = &self.remote
            && remote.resting_until.lock().is_some_and(|until| Instant::now() < until)
        {
            return Err(LookupError::Unreachable);
        }
        // The workers' hashes: the default seed, salted by the request's
        // namespace.
        let hasher = BlockHasher::salted(turbine_kv::DEFAULT_SEED, salt);
        let mut lookup = KvLookup::default();
        let mut asked_trees = candidates;
        // Without a block size (workers that report none) the tree sizes
        // are still asked for.
        let sizes: &[u32] = if block_sizes.is_empty() { &[0] } else { block_sizes };
        for &size in sizes {
            let hashes = if size == 0 { Vec::new() } else { hasher.sequence_hashes(tokens, size as usize) };
            // Tree sizes with the first lookup only.
            let query = MatchQuery { hashes, cached_blocks_of: std::mem::take(&mut asked_trees) };
            if query.hashes.is_empty() && query.cached_blocks_of.is_empty() {
                lookup.by_size.push((size, query.hashes, MatchesByWorker::default()));
                continue;
            }
            let answer = match &self.remote {
                None => self.index.find_matches(&query).await.map_err(|_| LookupError::Unreachable)?,
                Some(remote) => self.ask_remote(remote, &query).await?,
            };
            if !answer.log_reachable {
                return Err(LookupError::Stale);
            }
            if !query.cached_blocks_of.is_empty() {
                (lookup.asked, lookup.cached_trees) = (query.cached_blocks_of, answer.cached_blocks);
            }
            lookup.by_size.push((size, query.hashes, answer.matches.into_iter().map(|WorkerMatch { worker_id, by_tier, .. }| (worker_id, by_tier)).collect()));
        }
        Ok(lookup)
    }

    async fn ask_remote(&self, remote: &RemoteLookups, query: &MatchQuery) -> Result<MatchAnswer, LookupError> {
        match tokio::time::timeout(remote.timeout, self.index.find_matches(query)).await {
            Ok(Ok(answer)) => {
                if remote.resting_until.lock().take().is_some() {
                    tracing::info!("kv-index answers again; routing kv requests by cache overlap");
                }
                Ok(answer)
            }
            failed => {
                let was_resting = remote.resting_until.lock().replace(Instant::now() + REMOTE_REST).is_some();
                let error = if failed.is_err() { LookupError::TimedOut } else { LookupError::Unreachable };
                if !was_resting {
                    tracing::warn!(error = error.name(), "kv-index lookup failed; routing kv requests by load until it answers");
                }
                Err(error)
            }
        }
    }

    /// Approximate mode: remembers that `worker_id` now holds `hashes`.
    pub fn record_decision(&self, worker_id: &WorkerId, hashes: &[SequenceHash], now: Instant) {
        let (Some(approx), Some(replica)) = (&self.approx, &self.replica) else {
            return;
        };
        if hashes.is_empty() {
            return;
        }
        let blocks = hashes.iter().map(|&h| StoredBlock { sequence_hash: h, local_hash: turbine_kv::LocalBlockHash(h.0) }).collect();
        replica.apply_unnumbered(worker_id, &KvEvent::Stored { parent: None, blocks, tier: Tier::Device });
        let ttl = Duration::from_secs_f64(self.config.approx_ttl_secs);
        let mut log = approx.lock();
        log.blocks += hashes.len();
        for &hash in hashes {
            log.latest.insert((worker_id.clone(), hash), now + ttl);
        }
        log.entries.push_back((now + ttl, worker_id.clone(), hashes.to_vec()));
        self.expire_locked(replica, &mut log, now);
    }

    /// Approximate mode: forgets decisions past their TTL.
    pub fn expire(&self, now: Instant) {
        if let (Some(approx), Some(replica)) = (&self.approx, &self.replica) {
            self.expire_locked(replica, &mut approx.lock(), now);
        }
    }

    fn expire_locked(&self, replica: &KvIndex, log: &mut ApproxLog, now: Instant) {
        while let Some((expiry, _, _)) = log.entries.front() {
            if *expiry > now && log.blocks <= self.config.approx_max_blocks {
                break;
            }
            let (expiry, worker, hashes) = log.entries.pop_front().expect("front exists");
            log.blocks -= hashes.len();
            // Forget only blocks no later decision recorded again.
            let forget: Vec<SequenceHash> = hashes
                .into_iter()
                .filter(|&hash| {
                    let key = (worker.clone(), hash);
                    if log.latest.get(&key) == Some(&expiry) {
                        log.latest.remove(&key);
                        true
                    } else {
                        false
                    }
                })
                .collect();
            replica.apply_unnumbered(&worker, &KvEvent::Removed { sequence_hashes: forget, tier: Tier::Device });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn approximate(config: KvConfig) -> (KvState, Arc<KvIndex>) {
        let index = Arc::new(KvIndex::new());
        (KvState::local(KvConfig { approximate: true, ..config }, index.clone(), None), index)
    }

    #[test]
    fn approximate_mode_remembers_decisions_until_the_ttl() {
        let (state, index) = approximate(KvConfig { approx_ttl_secs: 10.0, ..KvConfig::default() });
        let hashes = [SequenceHash(1), SequenceHash(2)];
        let now = Instant::now();
        state.record_decision(&"a".into(), &hashes, now);
        assert_eq!(index.find_matches(&hashes).deepest(), 2);
        state.record_decision(&"a".into(), &hashes[..1], now + Duration::from_secs(5));
        state.expire(now + Duration::from_secs(11));
        // Block 1 was re-recorded at 5 s; block 2 expired.
        assert_eq!(index.find_matches(&hashes).deepest(), 1);
        state.expire(now + Duration::from_secs(16));
        assert_eq!(index.find_matches(&hashes).deepest(), 0);
    }

    #[test]
    fn approximate_mode_is_bounded_in_size() {
        let (state, index) = approximate(KvConfig { approx_max_blocks: 3, ..KvConfig::default() });
        let now = Instant::now();
        state.record_decision(&"a".into(), &[SequenceHash(1), SequenceHash(2)], now);
        state.record_decision(&"b".into(), &[SequenceHash(3), SequenceHash(4)], now);
        assert_eq!(index.stats().entries, 2, "the oldest decision made room");
        assert_eq!(index.cached_blocks("a"), 0);
    }

    #[tokio::test]
    async fn a_lookup_gives_matches_per_block_size_and_tree_sizes() {
        let index = Arc::new(KvIndex::new());
        let tokens: Vec<u32> = (0..64).collect();
        let blocks = BlockHasher::default().hash_blocks(&tokens, 16);
        let stored = blocks[..2].iter().map(|h| StoredBlock { sequence_hash: h.sequence, local_hash: h.local }).collect();
        index.apply_unnumbered("a", &KvEvent::Stored { parent: None, blocks: stored, tier: Tier::Device });
        let state = KvState::local(KvConfig::default(), index, None);
        let KvView::Matched(lookup) = state.look_up(&tokens, CacheSalt::SHARED, vec!["a".into(), "b".into()], &[16]).await else {
            panic!("the local index answers")
        };
        assert_eq!(lookup.matched(16, "a").map(|by_tier| by_tier.iter().sum::<u32>()), Some(2));
        assert!(lookup.matched(16, "b").is_none());
        assert_eq!((lookup.cached_tree("a"), lookup.cached_tree("b")), (2, 0));
        let (a, b, c): (WorkerId, WorkerId, WorkerId) = ("a".into(), "b".into(), "c".into());
        assert_eq!(lookup.cached_trees_of([&a, &b, &c]), [2, 0, 0], "in order, one not asked about");
        assert_eq!(lookup.cached_trees_of([&c, &b, &a, &a]), [0, 0, 2, 2], "out of order");
        assert_eq!(lookup.hashes(16).len(), 4);
    }

    #[tokio::test]
    async fn a_stale_replica_routes_by_load() {
        let status = Arc::new(FollowerStatus::default());
        let state = KvState::local(KvConfig::default(), Arc::new(KvIndex::new()), Some(status));
        assert!(
            matches!(state.look_up(&[1; 32], CacheSalt::SHARED, vec!["a".into()], &[16]).await, KvView::Unavailable),
            "a follower that never read its log is not trusted"
        );
    }
}

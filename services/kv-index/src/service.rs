//! The `turbine.kvindex.v1.KvIndex` gRPC shell over one index replica.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use turbine_kv::{BlockHasher, KvIndex, SequenceHash, Tier};
use turbine_kv_log::convert::{batch_from_proto, dump_to_proto};
use turbine_kv_log::{EventLog, FollowerStatus};
use turbine_proto::kvindex::v1 as pb;
use turbine_proto::kvindex::v1::kv_index_server::KvIndex as KvIndexRpc;

/// Batches accepted by one PublishEvents call.
pub const MAX_PUBLISH_BATCHES: usize = 1024;
/// Largest block size FindMatches hashes tokens in.
pub const MAX_BLOCK_SIZE: u32 = 1 << 16;

/// What this replica did besides following the log (reported by Stats).
#[derive(Debug, Default)]
pub struct ReplicaCounters {
    /// Workers dropped because their registry lease expired.
    pub workers_expired: AtomicU64,
    /// Snapshots written to Redis.
    pub snapshots_written: AtomicU64,
    /// The position of the snapshot this replica started from ("" if none).
    pub started_from_snapshot: parking_lot::Mutex<String>,
}

/// The gRPC service of one replica.
#[derive(Clone)]
pub struct KvIndexService {
    index: Arc<KvIndex>,
    log: EventLog,
    status: Arc<FollowerStatus>,
    counters: Arc<ReplicaCounters>,
}

impl KvIndexService {
    /// Serves `index`, publishing to `log`; `status` is the follower's.
    pub fn new(index: Arc<KvIndex>, log: EventLog, status: Arc<FollowerStatus>, counters: Arc<ReplicaCounters>) -> Self {
        Self { index, log, status, counters }
    }
}

/// The prompt of a FindMatches request as sequence hashes.
fn query_hashes(request: &pb::FindMatchesRequest) -> Result<Vec<SequenceHash>, Status> {
    if !request.sequence_hashes.is_empty() {
        return Ok(request.sequence_hashes.iter().map(|&h| SequenceHash(h)).collect());
    }
    if request.token_ids.is_empty() {
        if !request.cached_blocks_of.is_empty() {
            // Only tree sizes asked (e.g. a prompt shorter than one block).
            return Ok(Vec::new());
        }
        return Err(Status::invalid_argument("FindMatches needs sequence_hashes, or token_ids with a block_size"));
    }
    if request.block_size == 0 || request.block_size > MAX_BLOCK_SIZE {
        return Err(Status::invalid_argument(format!("block_size must be between 1 and {MAX_BLOCK_SIZE} with token_ids, got {}", request.block_size)));
    }
    let hasher = if request.seed == 0 { BlockHasher::default() } else { BlockHasher::with_seed(request.seed) };
    Ok(hasher.sequence_hashes(&request.token_ids, request.block_size as usize))
}

type DumpStream = Pin<Box<dyn Stream<Item = Result<pb::WorkerDump, Status>> + Send>>;

#[tonic::async_trait]
impl KvIndexRpc for KvIndexService {
    async fn publish_events(&self, request: Request<pb::PublishEventsRequest>) -> Result<Response<pb::PublishEventsResponse>, Status> {
        let batches = request.into_inner().batches;
        if batches.len() > MAX_PUBLISH_BATCHES {
            return Err(Status::invalid_argument(format!("at most {MAX_PUBLISH_BATCHES} batches per call, got {}", batches.len())));
        }
        // All or nothing: validate every batch before appending any.
        for (number, batch) in batches.iter().enumerate() {
            batch_from_proto(batch.clone()).map_err(|error| Status::invalid_argument(format!("batch {number}: {error}")))?;
        }
        let mut entry_ids = Vec::with_capacity(batches.len());
        for batch in &batches {
            let id = self.log.publish(batch).await.map_err(|error| Status::unavailable(format!("the KV event log (Redis) is unreachable: {error}")))?;
            entry_ids.push(id);
        }
        Ok(Response::new(pb::PublishEventsResponse { entry_ids }))
    }

    async fn find_matches(&self, request: Request<pb::FindMatchesRequest>) -> Result<Response<pb::FindMatchesResponse>, Status> {
        let hashes = query_hashes(request.get_ref())?;
        let found = self.index.find_matches(&hashes);
        let mut matches: Vec<pb::WorkerMatch> = found
            .iter()
            .map(|m| pb::WorkerMatch {
                worker_id: m.worker_id.to_string(),
                matched_blocks: m.blocks,
                device_blocks: m.in_tier(Tier::Device),
                host_blocks: m.in_tier(Tier::Host),
                disk_blocks: m.in_tier(Tier::Disk),
                remote_blocks: m.in_tier(Tier::Remote),
            })
            .collect();
        matches.sort_by(|a, b| b.matched_blocks.cmp(&a.matched_blocks).then_with(|| a.worker_id.cmp(&b.worker_id)));
        let names = &request.get_ref().cached_blocks_of;
        let sizes = self.index.cached_blocks_of(names.iter().map(String::as_str));
        let cached_blocks = names.iter().cloned().zip(sizes.into_iter().map(|n| n as u64)).collect();
        Ok(Response::new(pb::FindMatchesResponse { query_blocks: hashes.len() as u32, matches, log_reachable: self.status.reachable(), cached_blocks }))
    }

    type DumpStream = DumpStream;

    async fn dump(&self, request: Request<pb::DumpRequest>) -> Result<Response<DumpStream>, Status> {
        let worker_id = request.into_inner().worker_id;
        let ids = if worker_id.is_empty() {
            self.index.worker_ids()
        } else if self.index.has_worker(&worker_id) {
            vec![worker_id]
        } else {
            return Err(Status::not_found(format!("worker {worker_id:?} has no view in this index")));
        };
        // One worker at a time, so a big index is never copied whole.
        let index = self.index.clone();
        let dumps = tokio_stream::iter(ids).filter_map(move |id| index.dump(&id).map(|(instance, dump)| Ok(dump_to_proto(&id, instance, &dump))));
        Ok(Response::new(Box::pin(dumps)))
    }

    async fn remove_worker(&self, request: Request<pb::RemoveWorkerRequest>) -> Result<Response<pb::RemoveWorkerResponse>, Status> {
        let worker_id = request.into_inner().worker_id;
        if worker_id.is_empty() {
            return Err(Status::invalid_argument("worker_id is required"));
        }
        let blocks = self.index.cached_blocks(&worker_id) as u64;
        let removed = self.index.remove_worker(&worker_id);
        if removed {
            tracing::info!(worker = worker_id, blocks, "worker removed from the KV index on request");
        }
        Ok(Response::new(pb::RemoveWorkerResponse { removed, blocks: if removed { blocks } else { 0 } }))
    }

    async fn stats(&self, _request: Request<pb::StatsRequest>) -> Result<Response<pb::StatsResponse>, Status> {
        let stats = self.index.stats();
        Ok(Response::new(pb::StatsResponse {
            workers: stats.workers as u64,
            blocks: stats.nodes as u64,
            entries: stats.entries as u64,
            events_applied: self.status.events_applied(),
            batches_read: self.status.batches(),
            resyncs: self.status.resyncs(),
            log_reachable: self.status.reachable(),
            log_position: self.status.position(),
            workers_expired: self.counters.workers_expired.load(Ordering::Relaxed),
            snapshots_written: self.counters.snapshots_written.load(Ordering::Relaxed),
            started_from_snapshot: self.counters.started_from_snapshot.lock().clone(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_hash_tokens_or_take_hashes() {
        let tokens: Vec<u32> = (1..=34).collect();
        let by_tokens = pb::FindMatchesRequest { token_ids: tokens.clone(), block_size: 16, ..Default::default() };
        let hashes = query_hashes(&by_tokens).unwrap();
        assert_eq!(hashes, vec![SequenceHash(0xea06_fc71_a5ee_6e88), SequenceHash(0xad01_835a_37dd_294c)]);
        let salted = pb::FindMatchesRequest { seed: 7, ..by_tokens.clone() };
        assert_ne!(query_hashes(&salted).unwrap(), hashes);
        let by_hashes = pb::FindMatchesRequest { sequence_hashes: vec![5, 6], ..by_tokens };
        assert_eq!(query_hashes(&by_hashes).unwrap(), vec![SequenceHash(5), SequenceHash(6)]);
    }

    #[test]
    fn malformed_queries_are_refused() {
        assert_eq!(query_hashes(&pb::FindMatchesRequest::default()).unwrap_err().code(), tonic::Code::InvalidArgument);
        let sizes_only = pb::FindMatchesRequest { cached_blocks_of: vec!["w".into()], ..Default::default() };
        assert_eq!(query_hashes(&sizes_only).unwrap(), vec![], "tree sizes alone are a valid question");
        let no_block_size = pb::FindMatchesRequest { token_ids: vec![1, 2], ..Default::default() };
        assert!(query_hashes(&no_block_size).unwrap_err().message().contains("block_size"));
        let huge = pb::FindMatchesRequest { token_ids: vec![1], block_size: MAX_BLOCK_SIZE + 1, ..Default::default() };
        assert_eq!(query_hashes(&huge).unwrap_err().code(), tonic::Code::InvalidArgument);
    }
}

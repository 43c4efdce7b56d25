//! The `turbine.kvindex.v1.KvIndex` gRPC shell over one replica: the wire
//! is converted at the edge and the calls go to the same
//! `LocalKvIndex` an in-process client calls.

use std::pin::Pin;

use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use turbine_kv::{BlockHasher, EventBatch, SequenceHash, WorkerId};
use turbine_proto::kvindex::v1 as pb;
use turbine_proto::kvindex::v1::kv_index_server::KvIndex as KvIndexRpc;

use turbine_api::kv_index::{KvIndexApi, MatchAnswer, MatchQuery, match_to_wire};
use turbine_kv_log::{LocalKvIndex, MAX_PUBLISH_BATCHES, may_publish_for};
use turbine_runtime::trust::{Peer, Refusal, refuse};

/// The rpc whose writes are checked against the caller.
const PUBLISH_EVENTS: &str = "/turbine.kvindex.v1.KvIndex/PublishEvents";

/// Largest block size FindMatches hashes tokens in.
pub const MAX_BLOCK_SIZE: u32 = 1 << 16;

/// The gRPC service of one replica.
#[derive(Debug, Clone)]
pub struct KvIndexService {
    replica: LocalKvIndex,
}

impl KvIndexService {
    /// Serves `replica`.
    pub fn new(replica: LocalKvIndex) -> Self {
        Self { replica }
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
        let caller = request.extensions().get::<Peer>().cloned();
        let batches = request.into_inner().batches;
        if batches.len() > MAX_PUBLISH_BATCHES {
            return Err(Status::invalid_argument(format!("at most {MAX_PUBLISH_BATCHES} batches per call, got {}", batches.len())));
        }
        // All or nothing: every batch converts before any is appended.
        let batches = batches
            .into_iter()
            .enumerate()
            .map(|(number, batch)| EventBatch::try_from(batch).map_err(|error| Status::invalid_argument(format!("batch {number}: {error}"))))
            .collect::<Result<Vec<_>, _>>()?;
        // With certificates, each writes only its own events.
        if let Some(caller) = caller
            && let Some(other) = batches.iter().find(|batch| !may_publish_for(&caller, &batch.worker_id))
        {
            refuse(crate::serve::ROLES, PUBLISH_EVENTS, Refusal::WrongWriter);
            return Err(Status::permission_denied(format!(
                "{caller} may not publish the KV events of {:?}: a worker publishes its own",
                other.worker_id.as_str()
            )));
        }
        let positions = self.replica.publish_events(batches).await?;
        Ok(Response::new(pb::PublishEventsResponse { entry_ids: positions.iter().map(ToString::to_string).collect() }))
    }

    async fn find_matches(&self, request: Request<pb::FindMatchesRequest>) -> Result<Response<pb::FindMatchesResponse>, Status> {
        let request = request.into_inner();
        let query = MatchQuery { hashes: query_hashes(&request)?, cached_blocks_of: request.cached_blocks_of.into_iter().map(WorkerId::from).collect() };
        let MatchAnswer { query_blocks, mut matches, cached_blocks, log_reachable } = self.replica.find_matches(&query).await?;
        // Deepest first, for people reading the answer.
        matches.sort_by(|a, b| b.blocks.cmp(&a.blocks).then_with(|| a.worker_id.cmp(&b.worker_id)));
        Ok(Response::new(pb::FindMatchesResponse {
            query_blocks,
            matches: matches.into_iter().map(match_to_wire).collect(),
            log_reachable,
            cached_blocks: query.cached_blocks_of.iter().map(ToString::to_string).zip(cached_blocks.into_iter().map(|blocks| blocks as u64)).collect(),
        }))
    }

    type DumpStream = DumpStream;

    async fn dump(&self, request: Request<pb::DumpRequest>) -> Result<Response<DumpStream>, Status> {
        let worker_id = request.into_inner().worker_id;
        let ids = if worker_id.is_empty() {
            self.replica.index().worker_ids()
        } else if self.replica.index().has_worker(&worker_id) {
            vec![WorkerId::from(worker_id)]
        } else {
            return Err(Status::not_found(format!("worker {worker_id:?} has no view in this index")));
        };
        // One worker at a time, so a big index is never copied whole.
        let replica = self.replica.clone();
        let dumps = tokio_stream::iter(ids).filter_map(move |id| replica.dump_of(&id).map(|dump| Ok(pb::WorkerDump::from(&dump))));
        Ok(Response::new(Box::pin(dumps)))
    }

    async fn remove_worker(&self, request: Request<pb::RemoveWorkerRequest>) -> Result<Response<pb::RemoveWorkerResponse>, Status> {
        let removed = self.replica.remove_worker(WorkerId::from(request.into_inner().worker_id)).await?;
        Ok(Response::new(pb::RemoveWorkerResponse { removed: removed.is_some(), blocks: removed.unwrap_or(0) }))
    }

    async fn stats(&self, _request: Request<pb::StatsRequest>) -> Result<Response<pb::StatsResponse>, Status> {
        Ok(Response::new(pb::StatsResponse::from(self.replica.stats().await?)))
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

//! The kv-index's client: [`KvIndexApi`] (what an index does for its
//! callers: a replica in the caller's process, `turbine_kv_log::LocalKvIndex`,
//! or the service over gRPC, [`GrpcKvIndex`]) and [`KvIndexClient`], the
//! handle callers hold. Domain types in and out; every failure is a
//! [`KvIndexError`], which maps through [`ErrorCode`] both ways.

use std::sync::Arc;

use turbine_kv::{EventBatch, WorkerDump, WorkerId, WorkerMatch};
use turbine_proto::kvindex::v1 as pb;
use turbine_proto::kvindex::v1::kv_index_client::KvIndexClient as PbKvIndexClient;
use turbine_proto::{ConversionError, ConversionResult, MessageLimits};
use turbine_runtime::grpc::TracedChannel;
use turbine_runtime::host::Role;

use super::{IndexStats, LogPosition, MatchAnswer, MatchQuery};
use crate::error::{ApiError, ErrorCode, from_status};

/// The role a kv-index's certificate names: who this client calls.
pub const ROLE: Role = Role::Index;

/// Why an index call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvIndexError {
    /// The request is malformed.
    #[error("{0}")]
    InvalidArgument(String),
    /// The worker asked about has no view in the index.
    #[error("{0}")]
    NotFound(String),
    /// The index or its event log cannot be reached, or did not answer in
    /// time.
    #[error("{0}")]
    Unavailable(String),
    /// The caller may not make this call.
    #[error("the kv-index denied the call ({code:?}): {message}")]
    Denied {
        /// Unauthenticated or PermissionDenied.
        code: ErrorCode,
        /// The index's words.
        message: String,
    },
    /// The index failed.
    #[error("{0}")]
    Internal(String),
}

impl ApiError for KvIndexError {
    fn code(&self) -> ErrorCode {
        match self {
            KvIndexError::InvalidArgument(_) => ErrorCode::InvalidArgument,
            KvIndexError::NotFound(_) => ErrorCode::NotFound,
            KvIndexError::Unavailable(_) => ErrorCode::Unavailable,
            KvIndexError::Denied { code, .. } => *code,
            KvIndexError::Internal(_) => ErrorCode::Internal,
        }
    }

    fn message(&self) -> String {
        match self {
            KvIndexError::InvalidArgument(message)
            | KvIndexError::NotFound(message)
            | KvIndexError::Unavailable(message)
            | KvIndexError::Denied { message, .. }
            | KvIndexError::Internal(message) => message.clone(),
        }
    }

    fn from_parts(code: ErrorCode, _reason: Option<&str>, message: String) -> Self {
        match code {
            ErrorCode::InvalidArgument | ErrorCode::FailedPrecondition => KvIndexError::InvalidArgument(message),
            ErrorCode::NotFound => KvIndexError::NotFound(message),
            ErrorCode::Unavailable | ErrorCode::DeadlineExceeded | ErrorCode::Cancelled | ErrorCode::ResourceExhausted => KvIndexError::Unavailable(message),
            ErrorCode::Unauthenticated | ErrorCode::PermissionDenied => KvIndexError::Denied { code, message },
            ErrorCode::DataLoss | ErrorCode::Unimplemented | ErrorCode::Internal => KvIndexError::Internal(message),
        }
    }
}

impl From<tonic::Status> for KvIndexError {
    fn from(status: tonic::Status) -> Self {
        from_status(&status)
    }
}

impl From<KvIndexError> for tonic::Status {
    fn from(error: KvIndexError) -> Self {
        crate::error::to_status(&error)
    }
}

impl From<ConversionError> for KvIndexError {
    fn from(error: ConversionError) -> Self {
        KvIndexError::InvalidArgument(error.to_string())
    }
}

/// What a KV index does for its callers: a replica in this process
/// (`turbine_kv_log::LocalKvIndex`) or the service over gRPC
/// ([`GrpcKvIndex`]).
#[cfg_attr(feature = "mock", mockall::automock)]
#[tonic::async_trait]
pub trait KvIndexApi: Send + Sync + 'static {
    /// Which workers cache the query's leading blocks.
    async fn find_matches(&self, query: &MatchQuery) -> Result<MatchAnswer, KvIndexError>;

    /// Appends batches to the event log, all or none: every batch is
    /// checked before the first is appended. Returns their positions.
    async fn publish_events(&self, batches: Vec<EventBatch>) -> Result<Vec<LogPosition>, KvIndexError>;

    /// The view of one worker, or of all (`None`).
    async fn dump(&self, worker_id: Option<WorkerId>) -> Result<Vec<WorkerDump>, KvIndexError>;

    /// Drops a worker's view; the blocks it held, `None` if it had none.
    async fn remove_worker(&self, worker_id: WorkerId) -> Result<Option<u64>, KvIndexError>;

    /// Sizes and progress.
    async fn stats(&self) -> Result<IndexStats, KvIndexError>;
}

/// A KV index, in this process or behind gRPC; cheap to clone.
#[derive(Clone)]
pub struct KvIndexClient {
    inner: Arc<dyn KvIndexApi>,
}

impl std::fmt::Debug for KvIndexClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvIndexClient").finish_non_exhaustive()
    }
}

impl KvIndexClient {
    /// A client for `index`, called directly.
    pub fn new(index: Arc<dyn KvIndexApi>) -> Self {
        Self { inner: index }
    }

    /// The kv-index service at `endpoint`, over the process's shared
    /// channel to it (connected on first use).
    pub fn connect(endpoint: &str) -> Result<Self, KvIndexError> {
        let channel = turbine_runtime::grpc::channel(endpoint, ROLE)
            .map_err(|error| KvIndexError::InvalidArgument(format!("bad kv-index endpoint {endpoint:?}: {error}")))?;
        Ok(Self::new(Arc::new(GrpcKvIndex { client: PbKvIndexClient::new(channel).with_message_limits() })))
    }

    /// See [`KvIndexApi::find_matches`].
    pub async fn find_matches(&self, query: &MatchQuery) -> Result<MatchAnswer, KvIndexError> {
        self.inner.find_matches(query).await
    }

    /// See [`KvIndexApi::publish_events`].
    pub async fn publish_events(&self, batches: Vec<EventBatch>) -> Result<Vec<LogPosition>, KvIndexError> {
        self.inner.publish_events(batches).await
    }

    /// See [`KvIndexApi::dump`].
    pub async fn dump(&self, worker_id: Option<WorkerId>) -> Result<Vec<WorkerDump>, KvIndexError> {
        self.inner.dump(worker_id).await
    }

    /// See [`KvIndexApi::remove_worker`].
    pub async fn remove_worker(&self, worker_id: WorkerId) -> Result<Option<u64>, KvIndexError> {
        self.inner.remove_worker(worker_id).await
    }

    /// See [`KvIndexApi::stats`].
    pub async fn stats(&self) -> Result<IndexStats, KvIndexError> {
        self.inner.stats().await
    }
}

/// [`KvIndexApi`] over gRPC.
#[derive(Debug, Clone)]
pub struct GrpcKvIndex {
    client: PbKvIndexClient<TracedChannel>,
}

#[tonic::async_trait]
impl KvIndexApi for GrpcKvIndex {
    async fn find_matches(&self, query: &MatchQuery) -> Result<MatchAnswer, KvIndexError> {
        let MatchQuery { hashes, cached_blocks_of } = query;
        let request = pb::FindMatchesRequest {
            sequence_hashes: hashes.iter().map(|h| h.0).collect(),
            cached_blocks_of: cached_blocks_of.iter().map(WorkerId::to_string).collect(),
            ..Default::default()
        };
        let pb::FindMatchesResponse { query_blocks, matches, log_reachable, cached_blocks } = self.client.clone().find_matches(request).await?.into_inner();
        Ok(MatchAnswer {
            query_blocks,
            matches: matches.into_iter().map(worker_match).collect(),
            cached_blocks: cached_blocks_of.iter().map(|id| cached_blocks.get(id.as_str()).map_or(0, |&blocks| blocks as usize)).collect(),
            log_reachable,
        })
    }

    async fn publish_events(&self, batches: Vec<EventBatch>) -> Result<Vec<LogPosition>, KvIndexError> {
        let request = pb::PublishEventsRequest { batches: batches.iter().map(pb::EventBatch::from).collect() };
        let entry_ids = self.client.clone().publish_events(request).await?.into_inner().entry_ids;
        entry_ids.iter().map(|id| id.parse().map_err(|error: super::BadPosition| KvIndexError::Internal(error.to_string()))).collect()
    }

    async fn dump(&self, worker_id: Option<WorkerId>) -> Result<Vec<WorkerDump>, KvIndexError> {
        let request = pb::DumpRequest { worker_id: worker_id.map(String::from).unwrap_or_default() };
        let mut stream = self.client.clone().dump(request).await?.into_inner();
        let mut dumps = Vec::new();
        while let Some(dump) = stream.message().await? {
            dumps.push(WorkerDump::try_from(dump).map_err(|error| KvIndexError::Internal(error.to_string()))?);
        }
        Ok(dumps)
    }

    async fn remove_worker(&self, worker_id: WorkerId) -> Result<Option<u64>, KvIndexError> {
        let pb::RemoveWorkerResponse { removed, blocks } =
            self.client.clone().remove_worker(pb::RemoveWorkerRequest { worker_id: worker_id.to_string() }).await?.into_inner();
        Ok(removed.then_some(blocks))
    }

    async fn stats(&self) -> Result<IndexStats, KvIndexError> {
        IndexStats::try_from(self.client.clone().stats(pb::StatsRequest {}).await?.into_inner()).map_err(|error| KvIndexError::Internal(error.to_string()))
    }
}

/// A match as sent.
pub fn match_to_wire(found: WorkerMatch) -> pb::WorkerMatch {
    let WorkerMatch { worker_id, blocks, by_tier: [device, host, disk, remote] } = found;
    pb::WorkerMatch {
        worker_id: worker_id.to_string(),
        matched_blocks: blocks,
        device_blocks: device,
        host_blocks: host,
        disk_blocks: disk,
        remote_blocks: remote,
    }
}

fn worker_match(found: pb::WorkerMatch) -> WorkerMatch {
    let pb::WorkerMatch { worker_id, matched_blocks, device_blocks, host_blocks, disk_blocks, remote_blocks } = found;
    WorkerMatch { worker_id: WorkerId::from(worker_id), blocks: matched_blocks, by_tier: [device_blocks, host_blocks, disk_blocks, remote_blocks] }
}

impl From<IndexStats> for pb::StatsResponse {
    fn from(stats: IndexStats) -> Self {
        let IndexStats {
            workers,
            blocks,
            entries,
            events_applied,
            batches_read,
            resyncs,
            log_reachable,
            log_position,
            workers_expired,
            snapshots_written,
            started_from_snapshot,
        } = stats;
        pb::StatsResponse {
            workers,
            blocks,
            entries,
            events_applied,
            batches_read,
            resyncs,
            log_reachable,
            log_position: log_position.to_string(),
            workers_expired,
            snapshots_written,
            started_from_snapshot: started_from_snapshot.map(|position| position.to_string()).unwrap_or_default(),
        }
    }
}

impl TryFrom<pb::StatsResponse> for IndexStats {
    type Error = ConversionError;

    fn try_from(stats: pb::StatsResponse) -> ConversionResult<Self> {
        let pb::StatsResponse {
            workers,
            blocks,
            entries,
            events_applied,
            batches_read,
            resyncs,
            log_reachable,
            log_position,
            workers_expired,
            snapshots_written,
            started_from_snapshot,
        } = stats;
        let position = |field: &'static str, text: &str| text.parse::<LogPosition>().map_err(|error| ConversionError::invalid(field, error.to_string()));
        Ok(IndexStats {
            workers,
            blocks,
            entries,
            events_applied,
            batches_read,
            resyncs,
            log_reachable,
            log_position: position("log_position", &log_position)?,
            workers_expired,
            snapshots_written,
            started_from_snapshot: (!started_from_snapshot.is_empty()).then(|| position("started_from_snapshot", &started_from_snapshot)).transpose()?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::to_status;

    #[test]
    fn every_error_an_index_sends_comes_back_as_itself() {
        let sent = [
            KvIndexError::InvalidArgument("worker_id is required".into()),
            KvIndexError::NotFound("worker \"w\" has no view in this index".into()),
            KvIndexError::Unavailable("the KV event log (Redis) is unreachable".into()),
            KvIndexError::Denied { code: ErrorCode::PermissionDenied, message: "not a router".into() },
            KvIndexError::Internal("the index failed".into()),
        ];
        for error in sent {
            assert_eq!(KvIndexError::from(to_status(&error)), error);
        }
        for code in ErrorCode::ALL {
            let error = KvIndexError::from_parts(code, None, "m".into());
            assert_eq!(KvIndexError::from_parts(error.code(), None, error.message()), error, "{code:?}");
        }
        assert!(matches!(KvIndexError::from(tonic::Status::deadline_exceeded("slow")), KvIndexError::Unavailable(_)));
    }

    #[test]
    fn stats_convert_both_ways_and_a_bad_position_is_refused() {
        let stats = IndexStats { workers: 2, log_position: "5-1".parse().unwrap(), started_from_snapshot: Some("3-0".parse().unwrap()), ..Default::default() };
        assert_eq!(IndexStats::try_from(pb::StatsResponse::from(stats.clone())), Ok(stats));
        let bad = pb::StatsResponse { log_position: "x".into(), ..Default::default() };
        assert!(IndexStats::try_from(bad).unwrap_err().to_string().contains("log_position"));
    }
}

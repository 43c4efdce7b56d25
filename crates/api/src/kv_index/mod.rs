//! The kv-index's words (a match query and its answer, a replica's stats,
//! a position in the KV event log) and, with the `grpc` feature, its
//! client ([`KvIndexClient`]).

use turbine_kv::{SequenceHash, WorkerId, WorkerMatch};

#[cfg(feature = "grpc")]
mod client;
mod position;

#[cfg(feature = "mock")]
pub use client::MockKvIndexApi;
#[cfg(feature = "grpc")]
pub use client::{GrpcKvIndex, KvIndexApi, KvIndexClient, KvIndexError, ROLE, match_to_wire};
pub use position::{BadPosition, LogPosition};

/// Which workers cache a prompt's leading blocks.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MatchQuery {
    /// The prompt's sequence hashes (in the block size and salt its
    /// workers hash with).
    pub hashes: Vec<SequenceHash>,
    /// Workers whose cached tree size to report too (a router's tie-break).
    pub cached_blocks_of: Vec<WorkerId>,
}

/// The answer to a [`MatchQuery`].
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MatchAnswer {
    /// Blocks in the query.
    pub query_blocks: u32,
    /// Every worker holding at least the first block (in no particular
    /// order).
    pub matches: Vec<WorkerMatch>,
    /// The cached tree size of each worker asked about, in the order asked.
    pub cached_blocks: Vec<usize>,
    /// Whether the replica follows its event log (false: the answer may be
    /// stale; route by load).
    pub log_reachable: bool,
}

/// How far a replica got, and how big its index is.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IndexStats {
    /// Workers with a view.
    pub workers: u64,
    /// Distinct blocks.
    pub blocks: u64,
    /// (worker, block) entries.
    pub entries: u64,
    /// Events applied.
    pub events_applied: u64,
    /// Event-log entries read.
    pub batches_read: u64,
    /// Dumps loaded after gaps.
    pub resyncs: u64,
    /// Whether the last read of the log succeeded.
    pub log_reachable: bool,
    /// The last log entry applied.
    pub log_position: LogPosition,
    /// Workers dropped because their registry lease expired.
    pub workers_expired: u64,
    /// Snapshots written to Redis.
    pub snapshots_written: u64,
    /// The snapshot this replica started from, if any.
    pub started_from_snapshot: Option<LogPosition>,
}

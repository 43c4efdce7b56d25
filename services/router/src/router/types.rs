//! What the router is asked and what it answers.

use std::sync::Arc;

use turbine_kv::WorkerId;
use turbine_registry::{WorkerLoad, WorkerRole};

use crate::kv::KvOverrides;
use crate::policy::Policy;

/// A request to route.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RouteRequest {
    /// Caller's id, unique per request; `finished` refers to it.
    pub request_id: String,
    /// Requested model.
    pub model: String,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Overrides the configured policy.
    pub policy: Option<Policy>,
    /// Workers not to choose.
    pub exclude_worker_ids: Vec<WorkerId>,
    /// The prompt's token ids (the `kv` policy matches them against the
    /// index; other policies ignore them).
    pub token_ids: Arc<[u32]>,
    /// Per-request overrides of the `kv` cost function.
    pub kv: Option<KvOverrides>,
}

/// A routing decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed {
    /// The chosen worker.
    pub worker: RoutedWorker,
    /// Requests booked against it, this one included.
    pub in_flight: u32,
    /// Prompt blocks (complete and partial) in the chosen worker's block size.
    pub prompt_blocks: u32,
    /// Leading prompt blocks the chosen worker caches, per the index
    /// (0 unless the `kv` policy routed).
    pub overlap_blocks: u32,
    /// Disaggregated serving: compute the prompt on this prefill worker,
    /// then decode on `worker`. `None`: `worker` does everything.
    pub prefill: Option<RoutedWorker>,
}

/// When a prompt is computed on a prefill worker instead of its decode
/// worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DisaggPolicy {
    /// Prompts with more uncached tokens than this (on the chosen decode
    /// worker) go to a prefill worker; shorter ones are computed locally.
    pub threshold_tokens: u32,
    /// The prefill pool is saturated (prompts are computed locally) when
    /// every prefill worker has this many prefills booked or queued.
    pub max_prefill_queue: u32,
}

impl Default for DisaggPolicy {
    fn default() -> Self {
        Self { threshold_tokens: 256, max_prefill_queue: 8 }
    }
}

/// A live worker as the router reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutedWorker {
    /// Worker id.
    pub worker_id: WorkerId,
    /// Where to reach it (`http://...`).
    pub endpoint: String,
    /// Model served.
    pub model: String,
    /// Last reported load.
    pub load: WorkerLoad,
    /// Requests booked against it.
    pub in_flight: u32,
    /// Its part in disaggregated serving.
    pub role: WorkerRole,
}

/// Why no worker was chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No live worker serves the model (or all that do were excluded).
    #[error("no live worker serves model {0:?}")]
    NoWorkers(String),
    /// The request is malformed.
    #[error("{0}")]
    InvalidRequest(String),
}

impl RouteError {
    /// The outcome label of a failed decision, for metrics.
    pub fn outcome(&self) -> &'static str {
        match self {
            RouteError::NoWorkers(_) => "no_workers",
            RouteError::InvalidRequest(_) => "invalid",
        }
    }
}

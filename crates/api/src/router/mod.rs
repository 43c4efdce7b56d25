//! The router's words (a request to route, the decision, a live worker as
//! the router reports it, the policies and per-request `kv` weights) and,
//! with the `grpc` feature, its client ([`RouterClient`]).

use std::sync::Arc;

use turbine_kv::WorkerId;

use crate::{FormatKind, Load, WorkerRole};

#[cfg(feature = "grpc")]
mod client;

#[cfg(feature = "mock")]
pub use client::MockRouterApi;
#[cfg(feature = "grpc")]
pub use client::{GrpcRouter, NO_WORKERS, ROLE, RouterApi, RouterCallError, RouterClient};

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
    /// The request's KV namespace: its prompt is hashed with it, so it
    /// matches only blocks cached under the same salt.
    pub cache_salt: turbine_kv::CacheSalt,
    /// Whose request it is: only workers allowed this KV tenant are
    /// chosen, its own pool first.
    pub kv_tenant: turbine_kv::KvTenant,
    /// A worker generating another sequence of the same prompt now (another
    /// choice of the request): the `kv` policy credits the prompt's blocks
    /// there as cached in its engine, if it is an aggregated worker.
    pub prefix_worker: Option<WorkerId>,
    /// The kind of output its tokens are held to: only workers whose
    /// engine keeps to it are chosen.
    pub output: FormatKind,
    /// That output goes on from tokens generated under it on another
    /// worker: only workers whose engine resumes it are chosen.
    pub output_continued: bool,
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
    pub load: Load,
    /// Requests booked against it.
    pub in_flight: u32,
    /// Its part in disaggregated serving.
    pub role: WorkerRole,
    /// The KV tenants its certificate limits it to; empty: any tenant.
    pub kv_tenants: Vec<turbine_kv::KvTenant>,
    /// The output formats its engine holds its output to.
    pub output_formats: crate::OutputFormats,
}

/// How the router chooses among live workers serving the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Policy {
    /// Cycle through the workers in id order.
    RoundRobin,
    /// Uniformly at random.
    Random,
    /// Fewest booked requests, then least reported queue and KV use.
    LeastLoaded,
    /// Cache overlap against booked load (DESIGN §5's cost function);
    /// needs a KV index.
    Kv,
}

impl Policy {
    /// The policy's name as used in flags and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Policy::RoundRobin => "round-robin",
            Policy::Random => "random",
            Policy::LeastLoaded => "least-loaded",
            Policy::Kv => "kv",
        }
    }
}

/// Per-request overrides of the router's `kv` cost weights; unset fields
/// keep the router's.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct KvOverrides {
    /// Credit for a matched block in engine memory.
    pub device_credit: Option<f64>,
    /// Credit for a matched block in host memory (unmeasured tier).
    pub host_credit: Option<f64>,
    /// Credit for a matched block on local disk (unmeasured tier).
    pub disk_credit: Option<f64>,
    /// Credit for a matched block in the shared store (unmeasured tier).
    pub remote_credit: Option<f64>,
    /// Weight of prefill work against decode load.
    pub prefill_load_scale: Option<f64>,
    /// 0 picks the cheapest worker; above 0 samples, hotter is more random.
    pub temperature: Option<f64>,
}

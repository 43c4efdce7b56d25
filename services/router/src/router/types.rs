//! What the router is asked and what it answers.

pub use turbine_api::router::{RouteRequest, Routed, RoutedWorker};

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

/// Why no worker was chosen.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    /// No live worker serves the model (or all that do were excluded).
    #[error("no live worker serves model {0:?}")]
    NoWorkers(String),
    /// Workers serve the model, but every one shares a single cache among
    /// all requests (engines behind the plain OpenAI API), and the request
    /// is of its own namespace (a tenant's, or a client's `cache_salt`).
    #[error(
        "no live worker of model {0:?} can keep this request's cached prompts apart from others' (the workers serving it front engines with one shared cache): a tenant's request or one with a cache_salt is not served there"
    )]
    NoneKeepsApart(String),
    /// Workers serve the model, but none keeps to the output format the
    /// request asks for (or resumes it mid-output, when `continued`).
    #[error("no live worker of model {model:?} holds its output to {format}{}: its workers' engines do not keep to it", if *continued { " from output begun on another worker" } else { "" })]
    NoneHoldsFormat {
        /// The model.
        model: String,
        /// The format, as named in the OpenAI API.
        format: &'static str,
        /// The output goes on from another worker's.
        continued: bool,
    },
    /// The request is malformed.
    #[error("{0}")]
    InvalidRequest(String),
}

impl RouteError {
    /// The outcome label of a failed decision, for metrics.
    pub fn outcome(&self) -> &'static str {
        match self {
            RouteError::NoWorkers(_) | RouteError::NoneKeepsApart(_) => "no_workers",
            RouteError::InvalidRequest(_) => "invalid",
            RouteError::NoneHoldsFormat { .. } => "unserved",
        }
    }
}

//! Gateway metrics.

use std::sync::LazyLock;
use std::time::Duration;

use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};
use turbine_api::Usage;
use turbine_runtime::metrics::{counter, gauge, histogram, latency_buckets, slo_latency_buckets};

static REQUESTS: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter("turbine_gateway_requests_total", "Requests by endpoint and HTTP status", &["endpoint", "status"]));
static IN_FLIGHT: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("turbine_gateway_in_flight_requests", "Requests being served", &[]).with_label_values(&[] as &[&str]));
static ARRIVALS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "turbine_gateway_arrivals_total",
        "Generation requests as they arrive, by model, before they are routed (those refused later included): the demand, which the rate of first tokens is not once the workers are saturated",
        &["model"],
    )
});
static REFUSED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "turbine_gateway_refused_total",
        "Generation requests refused for want of capacity, by reason: gateway_full (the gateway's limit of concurrent requests) and client_share (nearly at it, the client holding its share of it), both refused before the body is read, so not among the arrivals; workers_full (every worker tried was at capacity), no_worker (none could take it)",
        &["reason"],
    )
});
static UNAUTHENTICATED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "turbine_gateway_unauthenticated_total",
        "Calls refused for their API key (REST 401, gRPC UNAUTHENTICATED), by reason: missing (no Authorization: Bearer) or unknown (a key not in the keys file)",
        &["reason"],
    )
});
static RATE_LIMITED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "turbine_gateway_rate_limited_total",
        "Calls refused (429, RESOURCE_EXHAUSTED) because their API key was over a limit, by limit: requests (per minute), tokens (per minute) or concurrency (not by key: the gateway's /metrics shares its port with every tenant; the log names the key)",
        &["limit"],
    )
});
pub(crate) static KEY_RELOADS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "turbine_gateway_api_key_reloads_total",
        "Times the API keys (file or database) were read again, by outcome: applied (changed: its keys answer from then on), refused (changed but invalid) or unreadable (the file or database did not answer); in the last two the keys before stay in force",
        &["outcome"],
    )
});
static SHARED_LIMIT_FAILURES: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "turbine_gateway_shared_limit_failures_total",
        "Calls to the shared limits' Redis (--redis) that got no answer in time: the call was decided by this gateway's own limits",
        &[],
    )
    .with_label_values(&[] as &[&str])
});
static BODIES_TIMED_OUT: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "turbine_gateway_request_bodies_timed_out_total",
        "Requests answered 408 because their body had not arrived within --body-timeout-secs of their headers",
        &[],
    )
    .with_label_values(&[] as &[&str])
});
static STREAMS_STALLED: LazyLock<IntCounter> = LazyLock::new(|| {
    counter(
        "turbine_gateway_streams_stalled_total",
        "gRPC Generate streams ended because their client read nothing of them for --stream-stall-secs (REST connections that do so are counted in turbine_connections_closed_total{reason=\"unread\"})",
        &[],
    )
    .with_label_values(&[] as &[&str])
});
static KEYS: LazyLock<IntGauge> =
    LazyLock::new(|| gauge("turbine_gateway_api_keys", "API keys in force (the keys file's, as last applied)", &[]).with_label_values(&[] as &[&str]));
static KEY_EXPIRIES: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    gauge(
        "turbine_gateway_api_key_expires_at_seconds",
        "When each API key in force that expires does (Unix seconds; keys without an expiry are not listed): alert before it comes",
        &["key"],
    )
});
static KEYS_FOLLOWED: LazyLock<IntGauge> = LazyLock::new(|| {
    gauge(
        "turbine_gateway_api_keys_following",
        "1 while the gateway hears each change to its API keys table as it is made (PostgreSQL's announcements), 0 while it cannot listen (a revoked key is then refused only at the next read, every --api-keys-reload-secs); absent for a keys file or SQLite",
        &[],
    )
    .with_label_values(&[] as &[&str])
});
static AWAITING_FIRST_TOKEN: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    gauge(
        "turbine_gateway_awaiting_first_token",
        "Requests arrived that have not had their first token yet (being routed, queued at a worker, or in prefill): the backlog",
        &["model"],
    )
});
static TTFT: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram("turbine_gateway_time_to_first_token_seconds", "Time from request to the first generated token", &["model"], slo_latency_buckets())
});
static ITL: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram(
        "turbine_gateway_inter_token_latency_seconds",
        "Per request of two or more tokens: the mean time between tokens after the first",
        &["model"],
        slo_latency_buckets(),
    )
});
static TOKEN_GAP: LazyLock<HistogramVec> = LazyLock::new(|| {
    histogram(
        "turbine_gateway_token_gap_seconds",
        "Time between a stream's tokens after the first, as they reach the gateway, read while requests run (a chunk of several tokens counts its gap once per token, split evenly; a gap across a migration to another worker includes its re-routing and re-prefill)",
        &["model"],
        slo_latency_buckets(),
    )
});
static STARTED_PROMPT_TOKENS: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter("turbine_gateway_started_prompt_tokens_total", "Prompt tokens of the requests that got their first token", &["model"]));
static DURATION: LazyLock<HistogramVec> =
    LazyLock::new(|| histogram("turbine_gateway_request_duration_seconds", "Time from request to the last token", &["model"], latency_buckets()));
static TOKENS: LazyLock<IntCounterVec> =
    LazyLock::new(|| counter("turbine_gateway_tokens_total", "Tokens by model and kind (prompt, cached_prompt, completion)", &["model", "kind"]));
static RETRIES: LazyLock<IntCounter> =
    LazyLock::new(|| counter("turbine_gateway_worker_retries_total", "Requests re-routed before their first token", &[]).with_label_values(&[] as &[&str]));
static CONTROL_TEXTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "turbine_gateway_control_texts_in_messages_total",
        "Control-token texts (<|im_start|> and the like) found in chat messages' roles and content, by what they became: text (--content-control-tokens text, the default: a turn cannot be forged) or control (parse: they became control tokens)",
        &["model", "became"],
    )
});
static MIGRATIONS: LazyLock<IntCounter> = LazyLock::new(|| {
    counter("turbine_gateway_migrations_total", "Requests continued on another worker after one failed mid-stream", &[]).with_label_values(&[] as &[&str])
});

/// Counts control-token texts found in a chat request's messages.
pub fn control_texts(model: &str, count: usize, became_control: bool) {
    if count > 0 {
        CONTROL_TEXTS.with_label_values(&[model, if became_control { "control" } else { "text" }]).inc_by(count as u64);
    }
}

/// Counts a response by endpoint and status.
pub fn response(endpoint: &str, status: u16) {
    REQUESTS.with_label_values(&[endpoint, itoa(status)]).inc();
}

fn itoa(status: u16) -> &'static str {
    match status {
        200 => "200",
        400 => "400",
        404 => "404",
        405 => "405",
        413 => "413",
        429 => "429",
        500 => "500",
        503 => "503",
        _ => "other",
    }
}

/// A generation request for `model` arrived (it passed the checks that
/// need no worker: the model exists, the prompt fits).
pub(crate) fn arrival(model: &str) {
    ARRIVALS.with_label_values(&[model]).inc();
}

/// Why a request was refused for want of capacity.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Refusal {
    /// The gateway's own limit of concurrent requests.
    GatewayFull,
    /// Nearly at that limit, and the client holds its share of it.
    ClientShare,
    /// Every worker tried was at capacity.
    WorkersFull,
    /// No worker could take the request.
    NoWorker,
}

/// A request refused for want of capacity.
pub(crate) fn refused(why: Refusal) {
    let reason = match why {
        Refusal::GatewayFull => "gateway_full",
        Refusal::ClientShare => "client_share",
        Refusal::WorkersFull => "workers_full",
        Refusal::NoWorker => "no_worker",
    };
    REFUSED.with_label_values(&[reason]).inc();
}

/// One request counted in `turbine_gateway_awaiting_first_token` from its
/// arrival until its first token, or until it ends without one.
#[derive(Debug)]
pub(crate) struct AwaitingFirstToken(Option<IntGauge>);

impl AwaitingFirstToken {
    pub(crate) fn start(model: &str) -> Self {
        let gauge = AWAITING_FIRST_TOKEN.with_label_values(&[model]);
        gauge.inc();
        Self(Some(gauge))
    }

    /// The first token came.
    pub(crate) fn end(&mut self) {
        if let Some(gauge) = self.0.take() {
            gauge.dec();
        }
    }
}

impl Drop for AwaitingFirstToken {
    fn drop(&mut self) {
        self.end();
    }
}

/// Tracks one request in flight while alive.
#[derive(Debug)]
pub struct InFlight;

impl InFlight {
    /// Starts tracking.
    pub fn start() -> Self {
        IN_FLIGHT.inc();
        InFlight
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.dec();
    }
}

/// A request's first token, `elapsed` after it arrived, for a prompt of
/// `prompt_tokens`.
pub(crate) fn time_to_first_token(model: &str, elapsed: Duration, prompt_tokens: u32) {
    TTFT.with_label_values(&[model]).observe(elapsed.as_secs_f64());
    STARTED_PROMPT_TOKENS.with_label_values(&[model]).inc_by(prompt_tokens.into());
}

/// The gaps between one stream's tokens, its model's series looked up once
/// per stream rather than per chunk.
#[derive(Debug, Clone)]
pub(crate) struct TokenGaps(Histogram);

impl TokenGaps {
    pub(crate) fn new(model: &str) -> Self {
        TokenGaps(TOKEN_GAP.with_label_values(&[model]))
    }

    /// `tokens` more tokens of the stream, `gap` after its last ones.
    pub(crate) fn observe(&self, gap: Duration, tokens: usize) {
        let each = gap.as_secs_f64() / tokens.max(1) as f64;
        for _ in 0..tokens {
            self.0.observe(each);
        }
    }
}

/// A finished request: its duration, tokens, and (`decoding`: from its
/// first token to its last) its inter-token latency.
pub(crate) fn request_tokens(model: &str, usage: &Usage, elapsed: Duration, decoding: Option<Duration>) {
    DURATION.with_label_values(&[model]).observe(elapsed.as_secs_f64());
    if let Some(decoding) = decoding
        && usage.completion_tokens >= 2
    {
        ITL.with_label_values(&[model]).observe(decoding.as_secs_f64() / f64::from(usage.completion_tokens - 1));
    }
    TOKENS.with_label_values(&[model, "prompt"]).inc_by(usage.prompt_tokens.into());
    TOKENS.with_label_values(&[model, "cached_prompt"]).inc_by(usage.cached_prompt_tokens.into());
    TOKENS.with_label_values(&[model, "completion"]).inc_by(usage.completion_tokens.into());
}

static DISAGGREGATED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    counter(
        "turbine_gateway_disaggregated_requests_total",
        "Requests routed to a prefill worker, by outcome: remote (prefill then decode), prefill_only (the first token finished it), prefill_failed (the decode worker computed the prompt)",
        &["outcome"],
    )
});

pub(crate) fn disaggregated(outcome: &str) {
    DISAGGREGATED.with_label_values(&[outcome]).inc();
}

pub(crate) fn retry() {
    RETRIES.inc();
}

pub(crate) fn migration() {
    MIGRATIONS.inc();
}

/// Counts a call refused for its API key (`missing` or `unknown`).
pub fn unauthenticated(reason: &str) {
    UNAUTHENTICATED.with_label_values(&[reason]).inc();
}

/// Counts a reading of a changed keys file: applied or refused.
pub fn key_reload(outcome: &str) {
    KEY_RELOADS.with_label_values(&[outcome]).inc();
}

/// Counts a shared-limits call Redis did not answer.
pub fn shared_limit_failure() {
    SHARED_LIMIT_FAILURES.inc();
}

/// The number of API keys in force.
pub fn keys_in_force(count: usize) {
    KEYS.set(count as i64);
}

/// The expiries of the keys in force, by name (Unix milliseconds): only
/// these are listed from now on.
pub fn key_expiries(expiries: impl Iterator<Item = (String, i64)>) {
    KEY_EXPIRIES.reset();
    for (name, at) in expiries {
        KEY_EXPIRIES.with_label_values(&[name.as_str()]).set(at.div_euclid(1_000));
    }
}

/// A request answered 408: its body came too slowly.
pub fn body_timed_out() {
    BODIES_TIMED_OUT.inc();
}

/// A gRPC stream ended: its client read nothing of it.
pub fn stream_stalled() {
    STREAMS_STALLED.inc();
}

/// Counts a call refused for its key's `limit`.
pub fn rate_limited(limit: &str) {
    RATE_LIMITED.with_label_values(&[limit]).inc();
}

/// Whether the gateway hears its API keys table's changes as they are made.
pub fn keys_following(following: bool) {
    KEYS_FOLLOWED.set(i64::from(following));
}

//! A worker in front of an external engine server (`--engine external`):
//! it speaks `turbine.worker.v1` to the rest of Turbine exactly as a
//! worker with its own engine does, and the engine's HTTP API to the
//! engine.
//!
//! - Prompts go to the engine as token ids and generated token ids come
//!   back ([`vllm`], [`llama_cpp`]; [`openai`] streams text, re-tokenized
//!   with the card's tokenizer, and its card says so): the gateway's
//!   tokenizer and chat template stay the one source of truth, so the card
//!   (`--model`) must be the model the engine serves.
//! - A caller that goes away drops its stream, which closes the engine's
//!   response: the engine aborts the request.
//! - [`ExternalWorker::watch`] polls the engine's `/health` and
//!   `/metrics`: load reports (running, waiting, KV usage) are the
//!   engine's own, and an engine that stops answering is reported
//!   unhealthy: the worker leaves the registry and fails its streams
//!   UNAVAILABLE, so the gateway migrates them to another worker.
//! - [`events`]: the engine's own KV events (vLLM's ZMQ publisher, over
//!   [`zmtp`] and [`msgpack`]) mirrored in Turbine's block hashes, so
//!   routers route on what it caches.
//! - What the adapter cannot do is refused when it starts
//!   ([`WorkerConfig`] validation): disaggregation and Turbine's KV
//!   tiers need blocks on Turbine's transfer plane.

pub mod events;
pub mod link;
pub mod llama_cpp;
pub mod msgpack;
pub mod openai;
pub mod prom;
pub mod serve;
pub mod vllm;
pub mod zmtp;

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use futures::StreamExt;
use tokio::sync::watch;
use turbine_api::worker::{Prefilled, RemotePrefill, TokenChunk, TokenStream, WorkerApi, WorkerError};
use turbine_api::{GenerateRequest, Load, OutputFormat, OutputFormats};
use turbine_kv::{WorkerDump, WorkerId};
use turbine_runtime::CancellationToken;
use turbine_tokens::pull::{Progress, default_cache_dir, resolve_model};
use turbine_tokens::{ModelCard, Tokenizer};

pub use self::link::{EngineLink, EngineRequest, EngineResponse, LinkError, LinkSettings};
use crate::config::{UpstreamKind, WorkerConfig};
use crate::metrics;

/// How long one probe of the engine (`/health`, `/metrics`) may take.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// Probes between the engine's health checks.
const PROBE_INTERVAL: Duration = Duration::from_secs(1);
/// Failed probes in a row before the engine counts as unhealthy (one
/// slow answer under load is not a dead engine).
const FAILED_PROBES: u32 = 2;
/// How long the engine may take to answer a request's headers.
const HEADERS_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a request with constrained output waits for its stream's
/// first event before its stream is handed on (a grammar the engine
/// refuses is that event, sent at once).
const GRAMMAR_REFUSAL_WAIT: Duration = Duration::from_secs(2);
/// What the worker last saw of its engine.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct EngineState {
    /// The engine answered its last probes.
    pub healthy: bool,
    /// Its occupancy, from its own metrics.
    pub load: Load,
}

/// A worker fronting an engine server.
#[derive(Debug)]
pub struct ExternalWorker {
    id: WorkerId,
    card: ModelCard,
    instance: u64,
    /// What serves at `base`, and how to speak to it.
    dialect: Dialect,
    /// The engine's base URL, without a trailing slash.
    base: String,
    http: EngineLink,
    state: watch::Sender<EngineState>,
    /// Streams open to the engine (the load of an engine whose metrics
    /// say none: [`UpstreamKind::Openai`]).
    open: Arc<AtomicU32>,
    /// The engine's cache as its KV events say, when it publishes them.
    mirror: Option<Arc<parking_lot::Mutex<events::KvMirror>>>,
    /// Where the engine's KV events arrive, until [`Self::receive_events`].
    events_listener: parking_lot::Mutex<Option<tokio::net::TcpListener>>,
    /// The engine's replay socket, asked for the events missed.
    events_replay: Option<std::net::SocketAddr>,
}

impl ExternalWorker {
    /// Loads the card, waits for the engine to answer (up to
    /// `--upstream-wait-secs`, or until `shutdown`) and learns what it
    /// serves: the model, its context window and its KV block size.
    pub async fn connect(config: &WorkerConfig, shutdown: &CancellationToken) -> anyhow::Result<Arc<Self>> {
        let engine = &config.engine;
        let kind = engine.upstream_kind;
        let base = engine.upstream.clone().context("an external engine needs --upstream")?.trim_end_matches('/').to_owned();
        let id = WorkerId::from(config.worker_id.clone().unwrap_or_else(|| format!("worker-{}", &uuid::Uuid::new_v4().simple().to_string()[..12])));
        let card = tokio::task::spawn_blocking({
            let engine = engine.clone();
            move || -> anyhow::Result<ModelCard> {
                let cache_dir = engine.cache_dir.clone().unwrap_or_else(default_cache_dir);
                let model = resolve_model(&engine.model, engine.served_model_name.as_deref(), &cache_dir, Progress::Quiet)?;
                Ok(ModelCard::from_path(&model.name, &model.path, engine.block_size() as u32)?)
            }
        })
        .await
        .context("loading the model card panicked")??;
        // Listening first: the engine's first events are not lost.
        let events_listener = match engine.upstream_kv_events_addr().map_err(anyhow::Error::msg)? {
            Some(address) => {
                Some(tokio::net::TcpListener::bind(address).await.with_context(|| format!("cannot listen for the engine's KV events at {address}"))?)
            }
            None => None,
        };
        let http = EngineLink::new(&engine_link_settings(config)).context("the link to the engine")?;

        let deadline = Instant::now() + Duration::from_secs(engine.upstream_wait_secs);
        let mut waited = false;
        let (models, stats) = loop {
            let probe =
                async { Ok::<_, WorkerError>((get_json::<vllm::Models>(&http, &format!("{base}/v1/models")).await?, probe(&http, &base, kind).await?)) };
            match probe.await {
                Ok(answer) => break answer,
                Err(error) if Instant::now() >= deadline => {
                    let hint = match base.starts_with("https://") && config.server.tls.tls_cert.is_none() {
                        true => " (an engine that requires a client certificate refuses a worker without --tls-cert)",
                        false => "",
                    };
                    anyhow::bail!("the engine at {base} did not answer within {} s: {error}{hint}", engine.upstream_wait_secs)
                }
                Err(error) => {
                    if !std::mem::replace(&mut waited, true) {
                        tracing::info!(upstream = %base, %error, "waiting for the engine to answer");
                    }
                }
            }
            tokio::select! {
                () = shutdown.cancelled() => anyhow::bail!("stopped while waiting for the engine at {base}"),
                () = tokio::time::sleep(PROBE_INTERVAL) => {}
            }
        };
        let served = match &engine.upstream_model {
            Some(name) => models.data.iter().find(|model| &model.id == name).with_context(|| {
                format!("the engine at {base} does not serve {name:?}; it serves {:?}", models.data.iter().map(|model| &model.id).collect::<Vec<_>>())
            })?,
            None => match models.data.as_slice() {
                [model] => model,
                listed => {
                    anyhow::bail!("the engine at {base} serves {:?}: name one with --upstream-model", listed.iter().map(|model| &model.id).collect::<Vec<_>>())
                }
            },
        };
        let mut card = card;
        let block_size = match kind {
            UpstreamKind::Vllm => {
                let block_size = stats.block_size.context("the engine's /metrics does not say its KV block size (vllm:cache_config_info)")?;
                if let Some(configured) = engine.block_size
                    && configured as u32 != block_size
                {
                    anyhow::bail!("--block-size {configured} is not the engine's: it caches blocks of {block_size} tokens");
                }
                block_size
            }
            // Its cache is per slot (llama.cpp) or unknown (the OpenAI
            // API): the block size is only the unit routers credit
            // prefixes in.
            UpstreamKind::LlamaCpp | UpstreamKind::Openai => engine.block_size() as u32,
        };
        card.kv_block_size = block_size;
        if let Some(engine_context) = served.context_length() {
            card.context_length = card.context_length.min(engine_context);
        }
        if let Some(context_length) = engine.context_length {
            card.context_length = card.context_length.min(context_length);
        }
        // An engine that streams text: the worker re-tokenizes it.
        card.retokenized = kind == UpstreamKind::Openai;
        let dialect = Dialect::new(kind, &served.id, &card)?;
        let mirror = events_listener.as_ref().map(|_| Arc::new(parking_lot::Mutex::new(events::KvMirror::new(&id, block_size as usize))));
        tracing::info!(
            worker = %id, upstream = %base, ?kind, upstream_model = %served.id, model = %card.name,
            context_length = card.context_length, block_size, blocks = stats.load.blocks_total, "fronting the engine"
        );
        let (state, _) = watch::channel(EngineState { healthy: true, load: stats.load });
        let instance = uuid::Uuid::new_v4().as_u64_pair().0;
        let events_listener = parking_lot::Mutex::new(events_listener);
        let open = Arc::new(AtomicU32::new(0));
        let events_replay = engine.upstream_kv_replay_addr().map_err(anyhow::Error::msg)?;
        Ok(Arc::new(Self { id, card, instance, dialect, base, http, state, open, mirror, events_listener, events_replay }))
    }

    /// The worker id.
    pub fn id(&self) -> &WorkerId {
        &self.id
    }

    /// The served model's card.
    pub fn card(&self) -> &ModelCard {
        &self.card
    }

    /// This start's random incarnation number.
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// Whether its engine shares one cache among every request, unable to
    /// keep a namespace's prompts apart: the plain OpenAI API's (it
    /// refuses any but the shared namespace's, and its record says so).
    pub fn shared_cache_only(&self) -> bool {
        self.dialect.kind() == UpstreamKind::Openai
    }

    /// The output formats its engine holds output to, as its record
    /// announces them ([`Dialect::output_formats`]).
    pub fn output_formats(&self) -> OutputFormats {
        self.dialect.output_formats()
    }

    /// The engine as last probed, as it changes.
    pub fn state(&self) -> watch::Receiver<EngineState> {
        self.state.subscribe()
    }

    /// Receives the engine's KV events until `shutdown` (if it publishes
    /// them: `--upstream-kv-events`).
    pub async fn receive_events(self: Arc<Self>, shutdown: CancellationToken) {
        let listener = self.events_listener.lock().take();
        if let (Some(listener), Some(mirror)) = (listener, &self.mirror) {
            events::receive(listener, mirror.clone(), self.events_replay, shutdown).await;
        }
    }

    /// The KV events mirrored from the engine (none unless it publishes
    /// them).
    pub fn subscribe_events(&self) -> tokio::sync::broadcast::Receiver<turbine_kv::NumberedEvent> {
        match &self.mirror {
            Some(mirror) => mirror.lock().subscribe(),
            None => tokio::sync::broadcast::channel(1).1,
        }
    }

    /// What the mirror holds, as of its next event.
    pub fn dump(&self) -> turbine_kv::Dump {
        self.mirror.as_ref().map(|mirror| mirror.lock().dump()).unwrap_or_default()
    }

    /// Probes the engine every second until `shutdown`: its load, and
    /// whether it answers.
    pub async fn watch(self: Arc<Self>, shutdown: CancellationToken) {
        let mut failures = 0;
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(PROBE_INTERVAL) => {}
            }
            match probe(&self.http, &self.base, self.dialect.kind()).await {
                Ok(mut stats) => {
                    if self.dialect.kind() == UpstreamKind::Openai {
                        stats.load.running = self.open.load(Ordering::Relaxed);
                    }
                    failures = 0;
                    let was = self.state.send_replace(EngineState { healthy: true, load: stats.load });
                    if !was.healthy {
                        tracing::info!(worker = %self.id, upstream = %self.base, "the engine answers again");
                    }
                }
                Err(error) => {
                    failures += 1;
                    if failures == FAILED_PROBES {
                        tracing::warn!(worker = %self.id, upstream = %self.base, %error, "the engine stopped answering: unhealthy");
                        self.state.send_modify(|state| state.healthy = false);
                    }
                }
            }
            metrics::upstream_healthy(&self.id, self.state.borrow().healthy);
        }
    }

    fn refuse_if_unhealthy(&self) -> Result<(), WorkerError> {
        match self.state.borrow().healthy {
            true => Ok(()),
            false => Err(WorkerError::Unavailable(format!("the engine at {} does not answer", self.base))),
        }
    }

    /// Refuses token ids outside the model's vocabulary.
    fn check_vocabulary(&self, tokens: &[u32]) -> Result<(), WorkerError> {
        let vocab = self.card.tokenizer.tokens.len();
        match tokens.iter().find(|&&token| token as usize >= vocab) {
            Some(bad) => Err(WorkerError::InvalidArgument(format!("prompt token id {bad} is outside the vocabulary of {vocab} tokens"))),
            None => Ok(()),
        }
    }
}

#[tonic::async_trait]
impl WorkerApi for ExternalWorker {
    async fn generate(&self, request: GenerateRequest, remote: Option<RemotePrefill>) -> Result<TokenStream, WorkerError> {
        if remote.is_some() {
            return Err(WorkerError::InvalidArgument("an external engine's worker decodes no remote prefill (it serves whole requests)".into()));
        }
        self.check_vocabulary(&request.prompt)?;
        self.refuse_if_unhealthy()?;
        let (post, completion) = self.dialect.request(&self.http, &self.base, &request)?;
        let open = OpenStream::new(&self.open);
        let sent = tokio::time::timeout(HEADERS_TIMEOUT, self.http.send(&post)).await;
        let response = match sent {
            Ok(Ok(response)) => response,
            Ok(Err(error)) => return Err(WorkerError::Unavailable(format!("the engine at {} cannot be reached: {error}", self.base))),
            Err(_) => return Err(WorkerError::Unavailable(format!("the engine at {} did not answer within {HEADERS_TIMEOUT:?}", self.base))),
        };
        let status = response.status();
        if !status.is_success() {
            let text = tokio::time::timeout(PROBE_TIMEOUT, response.text()).await.ok().and_then(Result::ok).unwrap_or_default();
            return Err(vllm::refusal(status.as_u16(), &text));
        }
        let follow = Follow {
            bytes: Box::pin(response.bytes_stream()),
            events: vllm::EventStream::default(),
            completion,
            state: self.state(),
            over: false,
            _open: open,
        };
        let mut stream = follow.into_stream();
        // vLLM compiles a request's grammar after answering 200 and says it
        // cannot as the stream's first event, at once: waited for briefly,
        // that refusal is the call's, so the gateway answers its client
        // with the status (not a 200 and then the error). A first event
        // slower than that (the request queued) streams as ever.
        if request.sampling.output != OutputFormat::Text
            && let Ok(first) = tokio::time::timeout(GRAMMAR_REFUSAL_WAIT, stream.next()).await
        {
            match first {
                Some(Err(refused @ WorkerError::InvalidArgument(_))) => return Err(refused),
                Some(first) => stream = Box::pin(futures::stream::once(async { first }).chain(stream)),
                None => {}
            }
        }
        Ok(metrics::observe_stream(self.id.clone(), stream))
    }

    async fn prefill(&self, _request: GenerateRequest, _lease: Option<Duration>) -> Result<Prefilled, WorkerError> {
        Err(WorkerError::InvalidArgument("an external engine's worker hands over no prefills (it serves whole requests)".into()))
    }

    async fn model_card(&self) -> Result<ModelCard, WorkerError> {
        Ok(self.card.clone())
    }

    async fn load(&self) -> Result<Load, WorkerError> {
        Ok(self.state.borrow().load)
    }

    async fn dump_kv_cache(&self) -> Result<WorkerDump, WorkerError> {
        Ok(WorkerDump { worker_id: self.id.clone(), instance: self.instance, dump: self.dump() })
    }
}

type Bytes = std::pin::Pin<Box<dyn futures::Stream<Item = Result<bytes::Bytes, hyper::Error>> + Send>>;

/// How the adapter speaks to its engine: the dialect, the model's name
/// there, the ids generation ends on, and (for an engine that streams
/// text) the tokenizer that turns its text back into ids. Public so that
/// a benchmark can call the engine exactly as the adapter does.
#[derive(Debug, Clone)]
pub struct Dialect {
    kind: UpstreamKind,
    model: String,
    /// The card's end-of-generation ids.
    stop_ids: Vec<u32>,
    /// The card's tokenizer, for [`UpstreamKind::Openai`].
    tokenizer: Option<Arc<Tokenizer>>,
}

impl Dialect {
    /// The output formats the engine holds output to: vLLM and llama.cpp
    /// compile a JSON object's or a schema's grammar, from the first token
    /// only; the plain OpenAI API holds a completion to none.
    pub fn output_formats(&self) -> OutputFormats {
        match self.kind {
            UpstreamKind::Openai => OutputFormats::TEXT,
            _ => OutputFormats { json_object: true, json_schema: true, json_schema_core: false, resumes: false },
        }
    }

    /// The dialect of `kind`, for the engine's `model`, whose card is `card`.
    pub fn new(kind: UpstreamKind, model: &str, card: &ModelCard) -> anyhow::Result<Self> {
        let tokenizer = match kind {
            UpstreamKind::Openai => Some(Arc::new(Tokenizer::from_spec(card.tokenizer.clone()).context("compiling the card's tokenizer")?)),
            UpstreamKind::Vllm | UpstreamKind::LlamaCpp => None,
        };
        Ok(Self { kind, model: model.to_owned(), stop_ids: card.tokenizer.eog_token_ids.clone(), tokenizer })
    }

    /// What serves.
    pub fn kind(&self) -> UpstreamKind {
        self.kind
    }

    /// What the adapter posts to the engine at `base` for `request`, and
    /// the reader of its answer; or why the engine cannot serve it.
    pub fn request(&self, http: &EngineLink, base: &str, request: &GenerateRequest) -> Result<(EngineRequest, Completion), WorkerError> {
        self.check_output(&request.sampling.output)?;
        Ok(match (self.kind, &self.tokenizer) {
            (UpstreamKind::Vllm, _) => {
                let body = vllm::completion_body(&self.model, request, &self.stop_ids);
                let completion = Completion::Vllm(vllm::Completion::new(request.prompt.len(), &body));
                (http.post_json(&format!("{base}/v1/completions"), &body).map_err(link_refused)?, completion)
            }
            (UpstreamKind::LlamaCpp, _) => {
                let body = llama_cpp::completion_body(request);
                let completion = Completion::LlamaCpp(llama_cpp::Completion::new(request, &self.stop_ids));
                (http.post_json(&format!("{base}/completion"), &body).map_err(link_refused)?, completion)
            }
            (UpstreamKind::Openai, Some(tokenizer)) => {
                let body = openai::completion_body(&self.model, request, &self.stop_ids, tokenizer)?;
                let completion = Completion::Openai(openai::Completion::new(request.prompt.len(), tokenizer.clone()));
                (http.post_json(&format!("{base}/v1/completions"), &body).map_err(link_refused)?, completion)
            }
            (UpstreamKind::Openai, None) => return Err(WorkerError::Internal("the openai dialect has no tokenizer".into())),
        })
    }
}

impl Dialect {
    /// Refuses an output format the engine cannot be held to, rather than
    /// answer unconstrained. vLLM and llama.cpp constrain their sampling
    /// to one JSON object or a schema's value (a grammar of their own); the plain OpenAI API
    /// constrains no completion's output. Neither engine's grammar goes on
    /// from an object begun before the prompt's end (a request continued
    /// here after its first worker failed mid-object).
    fn check_output(&self, output: &OutputFormat) -> Result<(), WorkerError> {
        let continued = output.continued();
        if !self.output_formats().holds(output.kind(), continued > 0) {
            return Err(WorkerError::InvalidArgument(match self.kind {
                UpstreamKind::Openai => {
                    "this worker's engine speaks the plain OpenAI API, whose completions are not held to a format: JSON output is not served here".into()
                }
                kind => format!(
                    "this worker's engine ({kind:?}) holds its output to a JSON object from its first token only: it cannot go on from the {continued} tokens of one begun on another worker"
                ),
            }));
        }
        match output {
            // The bodies take the schema as parsed here.
            OutputFormat::JsonSchema { schema, .. } if serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(schema).is_err() => {
                Err(WorkerError::InvalidArgument("json_schema must be one JSON object".into()))
            }
            _ => Ok(()),
        }
    }
}

/// A completion stream as its engine's dialect reads it (the events of
/// its response, [`vllm::EventStream`], one at a time).
#[derive(Debug)]
pub enum Completion {
    Vllm(vllm::Completion),
    LlamaCpp(llama_cpp::Completion),
    Openai(openai::Completion),
}

impl Completion {
    /// One event's data: the chunk to pass on, if it carries anything.
    pub fn event(&mut self, data: &str) -> Result<Option<TokenChunk>, WorkerError> {
        match self {
            Self::Vllm(completion) => completion.event(data),
            Self::LlamaCpp(completion) => completion.event(data),
            Self::Openai(completion) => completion.event(data),
        }
    }

    /// Whether the finishing chunk went out.
    pub fn is_done(&self) -> bool {
        match self {
            Self::Vllm(completion) => completion.is_done(),
            Self::LlamaCpp(completion) => completion.is_done(),
            Self::Openai(completion) => completion.is_done(),
        }
    }
}

/// One request's response from the engine, followed into token chunks.
/// Dropping it closes the response: the engine aborts the request.
struct Follow {
    bytes: Bytes,
    events: vllm::EventStream,
    completion: Completion,
    state: watch::Receiver<EngineState>,
    /// The finishing chunk or an error went out.
    over: bool,
    _open: OpenStream,
}

/// One stream counted open to the engine, until dropped.
#[derive(Debug)]
struct OpenStream(Arc<AtomicU32>);

impl OpenStream {
    fn new(open: &Arc<AtomicU32>) -> Self {
        open.fetch_add(1, Ordering::Relaxed);
        Self(open.clone())
    }
}

impl Drop for OpenStream {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Follow {
    fn into_stream(self) -> TokenStream {
        Box::pin(futures::stream::unfold(self, |mut follow| async move {
            if follow.over {
                return None;
            }
            let next = follow.next().await;
            follow.over = !matches!(next, Ok(TokenChunk { finished: None, .. }));
            Some((next, follow))
        }))
    }

    async fn next(&mut self) -> Result<TokenChunk, WorkerError> {
        let mut chunk = TokenChunk::default();
        loop {
            let read = tokio::select! {
                read = self.bytes.next() => read,
                () = unhealthy(&mut self.state) => {
                    return Err(WorkerError::Unavailable("the engine stopped answering its health checks".into()));
                }
            };
            let bytes = match read {
                Some(Ok(bytes)) => bytes,
                Some(Err(error)) => return Err(WorkerError::Unavailable(format!("the engine's stream broke: {error}"))),
                None => return Err(WorkerError::Unavailable("the engine's stream ended before the request finished".into())),
            };
            for data in self.events.push(&bytes)? {
                if let Some(more) = self.completion.event(&data)? {
                    chunk.tokens.extend(more.tokens);
                    chunk.logprobs.extend(more.logprobs);
                    chunk.finished = more.finished;
                }
            }
            if chunk.finished.is_some() || !chunk.tokens.is_empty() {
                return Ok(chunk);
            }
        }
    }
}

/// Returns once the engine is unhealthy (or the worker is gone).
pub(crate) async fn unhealthy(state: &mut watch::Receiver<EngineState>) {
    let _ = state.wait_for(|state| !state.healthy).await;
}

/// The engine's health and stats: `/health` answers 200 and `/metrics`
/// reads.
async fn probe(http: &EngineLink, base: &str, kind: UpstreamKind) -> Result<vllm::EngineStats, WorkerError> {
    if kind == UpstreamKind::Openai {
        // The API has no health or metrics: an engine that lists its
        // models answers; its load is the worker's count of open streams.
        return get_json::<vllm::Models>(http, &format!("{base}/v1/models")).await.map(|_| vllm::EngineStats::default());
    }
    let health = tokio::time::timeout(PROBE_TIMEOUT, async { http.send_once(&http.get(&format!("{base}/health"))?).await }).await;
    match health {
        Ok(Ok(response)) if response.status().is_success() => {}
        Ok(Ok(response)) => return Err(WorkerError::Unavailable(format!("/health answered {}", response.status()))),
        Ok(Err(error)) => return Err(WorkerError::Unavailable(format!("/health: {error}"))),
        Err(_) => return Err(WorkerError::Unavailable(format!("/health did not answer within {PROBE_TIMEOUT:?}"))),
    }
    let metrics = get_text(http, &format!("{base}/metrics")).await;
    match (kind, metrics) {
        (UpstreamKind::Vllm, metrics) => vllm::engine_stats(&metrics?),
        (_, Ok(text)) => Ok(vllm::EngineStats { load: llama_cpp::engine_stats(&text)?, block_size: None }),
        (_, Err(WorkerError::Unavailable(message))) if message.contains("answered 501") => {
            Err(WorkerError::Unavailable(format!("{message}: start llama-server with --metrics (its load comes from there)")))
        }
        (_, Err(error)) => Err(error),
    }
}

async fn get_text(http: &EngineLink, url: &str) -> Result<String, WorkerError> {
    let read = async {
        let response = http.send_once(&http.get(url).map_err(link_refused)?).await.map_err(|error| WorkerError::Unavailable(format!("{url}: {error}")))?;
        if !response.status().is_success() {
            return Err(WorkerError::Unavailable(format!("{url} answered {}", response.status())));
        }
        response.text().await.map_err(|error| WorkerError::Unavailable(format!("{url}: {error}")))
    };
    tokio::time::timeout(PROBE_TIMEOUT, read).await.unwrap_or_else(|_| Err(WorkerError::Unavailable(format!("{url} did not answer within {PROBE_TIMEOUT:?}"))))
}

async fn get_json<T: serde::de::DeserializeOwned>(http: &EngineLink, url: &str) -> Result<T, WorkerError> {
    let text = get_text(http, url).await?;
    serde_json::from_str(&text).map_err(|error| WorkerError::Internal(format!("{url}: {error}")))
}

/// The link settings a worker's configuration names: `--upstream-ca`,
/// its own certificate, `--upstream-api-key-file`.
pub fn engine_link_settings(config: &WorkerConfig) -> LinkSettings {
    let tls = &config.server.tls;
    LinkSettings {
        ca: config.engine.upstream_ca.clone(),
        identity: tls.tls_cert.clone().zip(tls.tls_key.clone()),
        api_key: config.engine.upstream_api_key_file.clone(),
    }
}

/// A URL or body the link cannot send: the worker's own fault.
fn link_refused(error: LinkError) -> WorkerError {
    WorkerError::Internal(error.to_string())
}

#[cfg(test)]
mod tests;

//! One request, from text to a text stream: template, tokenize, check
//! limits, route, call the worker, detokenize incrementally, apply stop
//! strings, account tokens. Shared by the REST and gRPC front ends.
//!
//! Failures before the first token are retried on another worker. A worker
//! that fails mid-stream is replaced: the request continues on another
//! worker with the prompt plus the tokens generated so far, and the client
//! sees one continuous stream.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use turbine_api::kv_transfer::KvTransferClient;
use turbine_api::router::{RouteRequest, RoutedWorker, RouterClient};
use turbine_api::worker::{KvHandle, RemotePrefill, TokenStream, WorkerClient, WorkerClients, WorkerError};
use turbine_api::{CacheSalt, FinishReason, GenerateRequest, KvTenant, SamplingParams, StopConditions, TokenLogprobs, Usage};
use turbine_kv::WorkerId;

use crate::keys::ApiKey;
use turbine_tokens::{ChatMessage, ContentControlTokens, IncrementalDecoder, Preprocessor, TokenBytes};

use crate::catalog::ModelCatalog;
use crate::error::{ErrorKind, GatewayError};
use crate::metrics;
use crate::stop::StopMatcher;

/// Default `max_tokens` of raw completions (OpenAI's).
pub const DEFAULT_COMPLETION_MAX_TOKENS: u32 = 16;

/// What to complete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// A conversation rendered with the model's chat template.
    Chat(Vec<ChatMessage>),
    /// Raw text.
    Text(String),
    /// Token ids of the model's vocabulary.
    Tokens(Vec<u32>),
}

/// A validated text generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct TextRequest {
    /// Model name.
    pub model: String,
    /// Input.
    pub prompt: Prompt,
    /// Tokens to generate at most; `None`: up to the context window for
    /// chats, 16 for raw prompts.
    pub max_tokens: Option<u32>,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Stop strings (not included in the output).
    pub stop: Vec<String>,
    /// Generate past end-of-sequence tokens (for benchmarks).
    pub ignore_eos: bool,
    /// The client's prompt-cache namespace (`cache_salt`), if any.
    pub cache_salt: Option<String>,
    /// The caller's namespace (its API key's; set by the handler).
    pub namespace: Namespace,
    /// The caller's key, charged the request's tokens (set by the handler).
    pub caller: Option<Arc<ApiKey>>,
}

/// Whose prompt cache a caller's requests use.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Namespace {
    /// No API keys: the deployment's one open namespace.
    #[default]
    Open,
    /// A tenant's own.
    Tenant(String),
    /// A cache shared by every key that opts into this name.
    Shared(String),
}

impl Namespace {
    /// The KV salt of a request in this namespace, narrowed by the
    /// client's own salt. Blocks of different salts are never shared, so a
    /// request neither hits nor times another namespace's prefix. Each
    /// kind is its own slot: no tenant can name a shared cache's salt, nor
    /// the open one's.
    pub fn cache_salt(&self, client: Option<&str>) -> CacheSalt {
        let client = client.unwrap_or("");
        match self {
            Namespace::Open if client.is_empty() => CacheSalt::SHARED,
            Namespace::Open => CacheSalt::of(&["open", client]),
            Namespace::Tenant(tenant) => CacheSalt::of(&["tenant", tenant, client]),
            Namespace::Shared(name) => CacheSalt::of(&["shared", name, client]),
        }
    }

    /// Whose fair share of the kv-store the blocks of a request in this
    /// namespace count against: the tenant's (whatever its clients'
    /// salts), a shared cache's own, the open deployment's one.
    pub fn kv_tenant(&self) -> KvTenant {
        match self {
            Namespace::Open => KvTenant::SHARED,
            Namespace::Tenant(tenant) => KvTenant::of_tenant(tenant),
            Namespace::Shared(name) => KvTenant::of_shared(name),
        }
    }
}

/// How often a request that failed mid-stream may be dispatched (first
/// try included).
const MAX_ATTEMPTS: usize = 3;

/// Most workers tried for a request's first token. Each worker that
/// refuses (draining, gone, at capacity) is excluded and the router asked
/// again, until it has none left: when a scale-down drains many workers at
/// once, routers still list them for a moment, and a few tries could all
/// land on leaving ones.
const MAX_ROUTES: usize = 16;

/// The pipeline's dependencies.
#[derive(Debug, Clone)]
pub struct Pipeline {
    router: RouterClient,
    workers: WorkerClients,
    catalog: Arc<ModelCatalog>,
    content_control_tokens: ContentControlTokens,
}

/// A generated token with its log-probabilities (requests that asked).
#[derive(Debug, Clone, PartialEq)]
pub struct GeneratedLogprob {
    /// The token.
    pub token: u32,
    /// Its log-probability and the most likely alternatives.
    pub logprobs: TokenLogprobs,
}

/// Something the client sees.
#[derive(Debug, Clone, PartialEq)]
pub enum TextEvent {
    /// More text, with the log-probabilities of the tokens generated since
    /// the last delta when the request asked for them (text may be empty
    /// only when log-probabilities come with it).
    Delta {
        /// The text.
        text: String,
        /// Log-probabilities of the tokens behind it.
        logprobs: Vec<GeneratedLogprob>,
    },
    /// The end.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Token accounting.
        usage: Usage,
    },
}

impl Pipeline {
    /// A pipeline over a router, worker clients and the model catalog;
    /// control-token texts in chat messages become `content_control_tokens`.
    pub fn new(router: RouterClient, workers: WorkerClients, catalog: Arc<ModelCatalog>, content_control_tokens: ContentControlTokens) -> Self {
        Self { router, workers, catalog, content_control_tokens }
    }

    /// The client of a routed worker.
    fn client(&self, worker: &RoutedWorker) -> Result<WorkerClient, WorkerError> {
        self.workers.client(&worker.worker_id, &worker.endpoint)
    }

    /// The model catalog.
    pub fn catalog(&self) -> &Arc<ModelCatalog> {
        &self.catalog
    }

    /// Validates, tokenizes, routes and starts generating. Errors here are
    /// the client's (4xx) or capacity (429/503); once a stream is returned,
    /// text follows.
    pub async fn start(&self, request: TextRequest, request_id: String) -> Result<TextStream, GatewayError> {
        self.start_beside(request, request_id, None).await
    }

    /// [`start`](Self::start) for another choice of a request whose first
    /// choice `beside` generates (its [`TextStream::worker`]): the router
    /// credits the prompt's blocks there, so the choices share its prefill.
    pub async fn start_beside(&self, request: TextRequest, request_id: String, beside: Option<&WorkerId>) -> Result<TextStream, GatewayError> {
        let started = Instant::now();
        let model = self.catalog.get(&request.model).await?;
        let prompt = tokenize(&model, &request.model, request.prompt, self.content_control_tokens)?;
        let context = model.card().context_length;
        let prompt_len = prompt.len() as u64;
        if prompt_len >= u64::from(context) {
            return Err(GatewayError::invalid(
                "messages",
                format!("This model's maximum context length is {context} tokens. However, your prompt is {prompt_len} tokens."),
            ));
        }
        let max_tokens = match request.max_tokens {
            Some(max_tokens) => {
                if prompt_len + u64::from(max_tokens) > u64::from(context) {
                    return Err(GatewayError::invalid(
                        "max_tokens",
                        format!(
                            "This model's maximum context length is {context} tokens. However, you requested {} tokens ({prompt_len} in the prompt, {max_tokens} in the completion). Please reduce the prompt or the completion length.",
                            prompt_len + u64::from(max_tokens)
                        ),
                    ));
                }
                max_tokens
            }
            None => context - prompt_len as u32,
        };
        if let Some(key) = &request.caller {
            key.charge(prompt_len as u32);
        }
        metrics::arrival(&request.model);
        let awaiting = metrics::AwaitingFirstToken::start(&request.model);
        let engine_request = GenerateRequest {
            request_id: request_id.clone(),
            prompt,
            sampling: request.sampling,
            stop: StopConditions { max_tokens, stop_token_ids: Vec::new(), ignore_eos: request.ignore_eos },
            cache_salt: request.namespace.cache_salt(request.cache_salt.as_deref()),
            kv_tenant: request.namespace.kv_tenant(),
        };
        let booking = Booking { router: self.router.clone(), request_id: request_id.clone() };
        let mut excluded = Vec::new();
        let (serving, tokens) = self.dispatch(&request.model, &engine_request, &mut excluded, beside).await.inspect_err(|error| match error.kind {
            ErrorKind::Overloaded => metrics::refused(metrics::Refusal::WorkersFull),
            ErrorKind::Unavailable => metrics::refused(metrics::Refusal::NoWorker),
            _ => {}
        })?;
        Ok(TextStream {
            pipeline: self.clone(),
            token_gaps: metrics::TokenGaps::new(&request.model),
            model: request.model,
            request: engine_request,
            token_bytes: model.tokenizer().token_bytes().clone(),
            decoder: model.tokenizer().decoder(),
            logprobs: Vec::new(),
            stop: StopMatcher::new(request.stop),
            tokens: Some(tokens),
            serving,
            generated: Vec::new(),
            excluded,
            attempts: 1,
            cached_prompt_tokens: None,
            pending: VecDeque::new(),
            started,
            first_token_at: None,
            last_token_at: None,
            booking,
            awaiting,
            caller: request.caller,
            charged: false,
        })
    }

    /// Routes and opens a worker stream, trying other workers when one is
    /// unavailable or full: the worker whose tokens it carries (the decode
    /// worker when disaggregated) and the stream.
    async fn dispatch(
        &self,
        model: &str,
        request: &GenerateRequest,
        excluded: &mut Vec<WorkerId>,
        prefix_worker: Option<&WorkerId>,
    ) -> Result<(WorkerId, TokenStream), GatewayError> {
        let mut last_error = None;
        for _ in 0..MAX_ROUTES {
            let route = RouteRequest {
                request_id: request.request_id.clone(),
                model: model.to_owned(),
                prompt_tokens: request.prompt.len() as u32,
                policy: None,
                exclude_worker_ids: excluded.clone(),
                token_ids: request.prompt.as_slice().into(),
                kv: None,
                cache_salt: request.cache_salt,
                kv_tenant: request.kv_tenant,
                prefix_worker: prefix_worker.cloned(),
                output: request.sampling.output.kind(),
                output_continued: request.sampling.output.continued() > 0,
            };
            let (worker, prefill): (RoutedWorker, Option<RoutedWorker>) = match self.router.route(&route).await {
                Ok(routed) => (routed.worker, routed.prefill),
                // Every worker was tried: report the last worker error.
                Err(error) => return Err(last_error.unwrap_or_else(|| error.into())),
            };
            let client = self.client(&worker)?;
            let started = match prefill {
                Some(prefill) => self.disaggregated(&client, &prefill, request).await,
                None => client.generate(request.clone()).await,
            };
            match started {
                Ok(stream) => return Ok((worker.worker_id, stream)),
                // Nothing was streamed yet: a worker that is gone, full, or
                // failed to start it (its connection reset as it stopped
                // reads as Internal) leaves the request to another, as a
                // failure mid-stream does.
                Err(error @ (WorkerError::Unavailable(_) | WorkerError::Overloaded(_) | WorkerError::Internal(_))) => {
                    tracing::warn!(worker = %worker.worker_id, %error, "worker refused or failed the request; trying another");
                    metrics::retry();
                    excluded.push(worker.worker_id);
                    last_error = Some(GatewayError::from(error));
                }
                Err(error) => return Err(error.into()),
            }
        }
        Err(last_error.unwrap_or_else(|| GatewayError::new(ErrorKind::Unavailable, "no worker could serve the request")))
    }
}

impl Pipeline {
    /// Prefill on `prefill`, then decode on `decode` from the handle; the
    /// returned stream starts with the prefill's first token, handed out
    /// as soon as the prefill answers: the decode worker is asked only
    /// after it (its hand-off and its admission are no part of the time
    /// to first token). A decode worker that then refuses or fails is a
    /// failure mid-stream, and the request continues on another worker.
    /// A prefill that fails leaves the decode worker to compute the prompt
    /// itself.
    async fn disaggregated(&self, decode: &WorkerClient, prefill: &RoutedWorker, request: &GenerateRequest) -> Result<TokenStream, WorkerError> {
        let prefilled = match self.client(prefill) {
            Ok(client) => client.prefill(request.clone()).await,
            Err(error) => Err(error),
        };
        let prefilled = match prefilled {
            Ok(prefilled) => prefilled,
            Err(error) => {
                tracing::warn!(prefill_worker = %prefill.worker_id, %error, "prefill failed; the decode worker computes the prompt");
                metrics::disaggregated("prefill_failed");
                return decode.generate(request.clone()).await;
            }
        };
        let first = prefilled.first;
        if first.finished.is_some() {
            // The first token ended the request (or it asked for one).
            metrics::disaggregated("prefill_only");
            return Ok(Box::pin(futures::stream::once(async move { Ok(first) })));
        }
        // Released if this request goes away before a decode worker has it.
        let guard = prefilled.handle.map(ReleaseOnDrop::new);
        let remote = RemotePrefill { handle: guard.as_ref().map(|guard| guard.handle.clone()), generated_token_ids: first.tokens.clone() };
        // Cached prompt tokens: the prefill's hits plus the decode worker's
        // own (it does not count the blocks it read).
        let prefill_cached = prefilled.cached_prompt_tokens;
        let (decode, request) = (decode.clone(), request.clone());
        // Asked once the first token is out (polled after it).
        let rest = futures::stream::once(async move {
            match decode.generate_after_prefill(request, remote).await {
                Ok(rest) => {
                    // The decode worker releases the handle once it has read the blocks.
                    if let Some(guard) = guard {
                        guard.disarm();
                    }
                    metrics::disaggregated("remote");
                    rest
                }
                Err(error) => Box::pin(futures::stream::once(async move { Err(error) })),
            }
        })
        .flatten()
        .map(move |chunk| {
            chunk.map(|mut chunk| {
                if let Some((_, usage)) = &mut chunk.finished {
                    usage.cached_prompt_tokens = (usage.cached_prompt_tokens + prefill_cached).min(usage.prompt_tokens);
                }
                chunk
            })
        });
        Ok(Box::pin(futures::stream::once(async move { Ok(first) }).chain(rest)))
    }
}

/// Releases a prefill handle on drop unless disarmed.
struct ReleaseOnDrop {
    handle: KvHandle,
    armed: bool,
}

impl ReleaseOnDrop {
    fn new(handle: KvHandle) -> Self {
        Self { handle, armed: true }
    }

    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        match KvTransferClient::connect(&self.handle.transfer_endpoint) {
            Ok(client) => client.release_in_background(self.handle.key()),
            Err(error) => {
                tracing::debug!(%error, handle_id = self.handle.handle_id, "the handle's lease frees its blocks")
            }
        }
    }
}

fn tokenize(model: &Preprocessor, name: &str, prompt: Prompt, content: ContentControlTokens) -> Result<Vec<u32>, GatewayError> {
    let tokens = match prompt {
        Prompt::Chat(messages) => {
            let chat = model.encode_chat_with(&messages, content)?;
            metrics::control_texts(name, chat.control_texts, content == ContentControlTokens::Parse);
            chat.ids
        }
        Prompt::Text(text) => model.encode_text(&text)?,
        Prompt::Tokens(tokens) => {
            if let Some(bad) = tokens.iter().find(|&&t| !model.is_valid_token(t)) {
                return Err(GatewayError::invalid("prompt", format!("token id {bad} is outside the model's vocabulary")));
            }
            tokens
        }
    };
    if tokens.is_empty() {
        return Err(GatewayError::invalid("prompt", "the prompt is empty"));
    }
    Ok(tokens)
}

/// Releases the router booking when the request ends, however it ends.
#[derive(Debug)]
struct Booking {
    router: RouterClient,
    request_id: String,
}

impl Booking {
    /// Tells the router the prompt is computed (the first token came).
    fn prefill_done(&self) {
        self.router.prefill_done_in_background(&self.request_id);
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        self.router.finished_in_background(&self.request_id);
    }
}

/// The text of one request as it is generated. Dropping it cancels the
/// worker's sequence and releases the booking.
pub struct TextStream {
    pipeline: Pipeline,
    model: String,
    request: GenerateRequest,
    token_bytes: Arc<TokenBytes>,
    decoder: IncrementalDecoder,
    /// Log-probabilities of tokens whose text has not been handed out yet.
    logprobs: Vec<GeneratedLogprob>,
    stop: StopMatcher,
    tokens: Option<TokenStream>,
    /// The worker `tokens` come from: excluded once it fails mid-stream.
    serving: WorkerId,
    generated: Vec<u32>,
    excluded: Vec<WorkerId>,
    attempts: usize,
    cached_prompt_tokens: Option<u32>,
    /// Events ready to hand out (the last delta and `Finished`).
    pending: VecDeque<TextEvent>,
    started: Instant,
    first_token_at: Option<Instant>,
    /// When the latest tokens arrived.
    last_token_at: Option<Instant>,
    token_gaps: metrics::TokenGaps,
    booking: Booking,
    /// Counted as awaiting its first token until it comes.
    awaiting: metrics::AwaitingFirstToken,
    /// The caller's key, charged the completion's tokens at the end.
    caller: Option<Arc<ApiKey>>,
    /// Whether they were charged.
    charged: bool,
}

impl Drop for TextStream {
    fn drop(&mut self) {
        // A stream cut short (a client gone, an error) still cost what it
        // generated.
        self.charge_completion();
    }
}

impl std::fmt::Debug for TextStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextStream")
            .field("request_id", &self.request.request_id)
            .field("model", &self.model)
            .field("generated", &self.generated.len())
            .field("attempts", &self.attempts)
            .finish_non_exhaustive()
    }
}

impl TextStream {
    /// The request id.
    pub fn request_id(&self) -> &str {
        &self.request.request_id
    }

    /// The raw bytes of every token of the model's vocabulary (to spell out
    /// log-probabilities).
    pub fn token_bytes(&self) -> &Arc<TokenBytes> {
        &self.token_bytes
    }

    /// The worker generating it now.
    pub fn worker(&self) -> &WorkerId {
        &self.serving
    }

    /// Whether the request asked for log-probabilities.
    pub fn wants_logprobs(&self) -> bool {
        self.request.sampling.logprobs.is_some()
    }

    /// Prompt length in tokens.
    pub fn prompt_tokens(&self) -> u32 {
        self.request.prompt.len() as u32
    }

    /// The next event; `None` after `Finished` or an error.
    pub async fn next(&mut self) -> Option<Result<TextEvent, GatewayError>> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(Ok(event));
            }
            let tokens = self.tokens.as_mut()?;
            let chunk = match tokens.next().await {
                Some(Ok(chunk)) => chunk,
                // A worker gone, failing, or (a decode worker asked after
                // the prefill's first token) full: continue on another.
                Some(Err(WorkerError::Unavailable(cause) | WorkerError::Internal(cause) | WorkerError::Overloaded(cause))) => {
                    if let Err(error) = self.migrate(&cause).await {
                        return Some(Err(error));
                    }
                    continue;
                }
                Some(Err(error)) => {
                    self.tokens = None;
                    return Some(Err(error.into()));
                }
                None => {
                    if let Err(error) = self.migrate("the worker stream ended early").await {
                        return Some(Err(error));
                    }
                    continue;
                }
            };
            if !chunk.tokens.is_empty() {
                let now = Instant::now();
                match self.last_token_at {
                    // The first token's chunk may carry more: they count
                    // no gap.
                    None => {
                        metrics::time_to_first_token(&self.model, now - self.started, self.prompt_tokens());
                        self.first_token_at = Some(now);
                        self.awaiting.end();
                        self.booking.prefill_done();
                    }
                    Some(last) => self.token_gaps.observe(now - last, chunk.tokens.len()),
                }
                self.last_token_at = Some(now);
            }
            let mut text = String::new();
            for &token in &chunk.tokens {
                self.generated.push(token);
                self.decoder.push(token, &mut text);
            }
            self.logprobs.extend(chunk.tokens.iter().zip(chunk.logprobs).map(|(&token, logprobs)| GeneratedLogprob { token, logprobs }));
            if let Some((_, usage)) = &chunk.finished {
                self.cached_prompt_tokens.get_or_insert(usage.cached_prompt_tokens.min(self.prompt_tokens()));
                self.decoder.finish(&mut text);
            }
            let scan = self.stop.push(&text);
            match chunk.finished {
                _ if scan.stopped => self.finish(scan.emit, FinishReason::Stop),
                Some((reason, _)) => {
                    let mut last = scan.emit;
                    last.push_str(&self.stop.finish());
                    self.finish(last, reason);
                }
                None if scan.emit.is_empty() => {}
                None => return Some(Ok(TextEvent::Delta { text: scan.emit, logprobs: std::mem::take(&mut self.logprobs) })),
            }
        }
    }

    /// Charges the caller's key the tokens generated (once).
    fn charge_completion(&mut self) {
        if let Some(key) = &self.caller
            && !self.charged
        {
            key.charge(self.generated.len() as u32);
            self.charged = true;
        }
    }

    /// Ends the stream: queues the last text and the `Finished` event and
    /// drops the worker stream (cancelling it if still running).
    fn finish(&mut self, last_text: String, reason: FinishReason) {
        self.tokens = None;
        self.charge_completion();
        let usage = Usage {
            prompt_tokens: self.prompt_tokens(),
            completion_tokens: self.generated.len() as u32,
            cached_prompt_tokens: self.cached_prompt_tokens.unwrap_or(0),
        };
        metrics::request_tokens(&self.model, &usage, self.started.elapsed(), self.first_token_at.map(|first| first.elapsed()));
        if !last_text.is_empty() || !self.logprobs.is_empty() {
            self.pending.push_back(TextEvent::Delta { text: last_text, logprobs: std::mem::take(&mut self.logprobs) });
        }
        self.pending.push_back(TextEvent::Finished { reason, usage });
    }

    /// Continues on another worker with the prompt plus the tokens so far.
    /// The worker that failed is not asked again for this request: a
    /// decode worker refuses a disaggregated request only once its prompt
    /// is prefilled (mid-stream), and a draining or dead worker the
    /// routers still list would otherwise be routed the continuation again
    /// (its cached prefix draws it) until the attempts run out.
    async fn migrate(&mut self, cause: &str) -> Result<(), GatewayError> {
        self.tokens = None;
        if !self.excluded.contains(&self.serving) {
            self.excluded.push(self.serving.clone());
        }
        let generated = self.generated.len() as u32;
        if generated >= self.request.stop.max_tokens {
            // Everything asked for arrived; only the end marker was lost.
            let mut text = String::new();
            self.decoder.finish(&mut text);
            text.push_str(&self.stop.finish());
            self.finish(text, FinishReason::Length);
            return Ok(());
        }
        if self.attempts >= MAX_ATTEMPTS {
            tracing::error!(request_id = %self.request.request_id, worker = %self.serving, cause, "worker failed mid-stream; no attempts left");
            return Err(GatewayError::new(ErrorKind::Unavailable, "the worker serving this request failed"));
        }
        self.attempts += 1;
        let mut continuation = self.request.clone();
        continuation.prompt.extend_from_slice(&self.generated);
        // A JSON object goes on from what was generated of it.
        continuation.sampling.output = continuation.sampling.output.continued_by(generated);
        continuation.stop.max_tokens = self.request.stop.max_tokens - generated;
        tracing::warn!(request_id = %self.request.request_id, worker = %self.serving, cause, generated, "worker failed mid-stream; continuing on another");
        metrics::migration();
        let (serving, stream) = self.pipeline.dispatch(&self.model, &continuation, &mut self.excluded, None).await?;
        self.serving = serving;
        self.tokens = Some(stream);
        Ok(())
    }
}

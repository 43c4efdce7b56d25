//! The OpenAI-compatible REST API: `/v1/chat/completions`,
//! `/v1/completions` (streaming over SSE or not), `/v1/models`, plus
//! `/openapi.json` and `/health`.

pub mod body;
pub mod responses;
pub mod types;

use std::convert::Infallible;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Body;
use axum::extract::{ConnectInfo, Extension, Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::stream::{BoxStream, SelectAll};
use futures::{Stream, StreamExt};
use serde::Serialize;
use tower_http::trace::TraceLayer;
use turbine_api::Usage;
use turbine_runtime::health::Readiness;
use turbine_runtime::propagation::set_parent_from_headers;
use turbine_runtime::proxies::{FORWARDED_FOR, TrustedProxies};

use crate::admission::{Admission, Client, Place, Refused};
use crate::error::{ErrorKind, GatewayError};
use crate::keys::{Access, ApiKey, KeyPermit};
use crate::metrics::{self, InFlight};
use crate::openai::body::read_limited;
use crate::openai::responses::{Choice, ChunkContent, Endpoint, ResponseMeta, chunk, combined_usage, logprobs_body, whole};
use crate::openai::types::{Delivery, parse_chat, parse_completion};
use crate::pipeline::{GeneratedLogprob, Pipeline, TextEvent, TextRequest, TextStream};

/// The OpenAPI description of this API.
pub const OPENAPI_JSON: &str = include_str!("../../openapi.json");

/// What every handler shares.
#[derive(Debug, Clone)]
pub struct AppState {
    /// Who may call.
    pub access: Access,
    /// The generation pipeline.
    pub pipeline: Pipeline,
    /// Admission control: one place per request in flight, shared
    /// fairly among clients.
    pub admission: Arc<Admission>,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// How long a request's body may take to arrive.
    pub body_timeout: std::time::Duration,
    /// How long a gRPC stream's client may read nothing of it.
    pub stream_stall_timeout: std::time::Duration,
    /// Readiness (for `/health`).
    pub readiness: Readiness,
    /// Proxies trusted to name their clients (`--trusted-proxies`).
    pub proxies: TrustedProxies,
}

impl AppState {
    /// The caller of a request with these headers (`None`: access is
    /// open), or 401.
    pub fn caller(&self, headers: &HeaderMap) -> Result<Option<Arc<ApiKey>>, GatewayError> {
        self.access.caller(headers.get(header::AUTHORIZATION).and_then(|value| value.to_str().ok()))
    }

    /// The client of a request over a connection from `peer` with these
    /// `X-Forwarded-For` values: `peer`, or the client a trusted proxy
    /// named ([`turbine_runtime::proxies`]).
    pub fn client_address<'a>(&self, peer: Option<IpAddr>, forwarded_for: impl IntoIterator<Item = &'a str>) -> Option<IpAddr> {
        peer.map(|peer| self.proxies.client(peer, forwarded_for))
    }

    /// A place for one more request of `caller` calling from `address`,
    /// or 429: the gateway is full, or nearly and this client holds its
    /// share (see [`crate::admission`]).
    pub fn admit(&self, caller: Option<&ApiKey>, address: Option<IpAddr>) -> Result<Place, GatewayError> {
        let client = Client::of(caller.map(|key| key.tenant.as_str()), address);
        self.admission.admit(client).map_err(|refused| match refused {
            Refused::Full => {
                metrics::refused(metrics::Refusal::GatewayFull);
                GatewayError::new(ErrorKind::Overloaded, "The server is at its limit of concurrent requests; retry shortly.")
            }
            Refused::Share { share } => {
                metrics::refused(metrics::Refusal::ClientShare);
                GatewayError::new(
                    ErrorKind::Overloaded,
                    format!("The server is nearly at its limit of concurrent requests, and this client has {share} or more in flight, its share while other clients wait; retry shortly."),
                )
            }
        })
    }
}

/// The REST router.
pub fn router(state: AppState) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(list_models))
        .route("/v1/models/{model}", get(get_model))
        .route("/openapi.json", get(|| async { ([(header::CONTENT_TYPE, "application/json")], OPENAPI_JSON) }))
        .route("/health", get(health))
        .fallback(|| async { GatewayError::new(ErrorKind::NotFound, "Unknown path; see /openapi.json.") })
        .method_not_allowed_fallback(|| async { GatewayError::new(ErrorKind::MethodNotAllowed, "Method not allowed for this path.") })
        .with_state(state.clone());
    // The service host adds the admin routes (/metrics, /livez, /readyz).
    api.layer(TraceLayer::new_for_http().make_span_with(http_span))
}

fn http_span(request: &axum::http::Request<Body>) -> tracing::Span {
    let span = tracing::info_span!(
        "http.request",
        otel.name = %format!("{} {}", request.method(), request.uri().path()),
        otel.kind = "server",
        http.method = %request.method(),
        http.path = %request.uri().path(),
    );
    set_parent_from_headers(&span, request.headers());
    span
}

async fn health(State(state): State<AppState>) -> Response {
    if state.readiness.is_ready() {
        (StatusCode::OK, axum::Json(serde_json::json!({"status": "ok"}))).into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, axum::Json(serde_json::json!({"status": "unavailable"}))).into_response()
    }
}

#[derive(Serialize)]
struct ModelObject<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    context_length: u32,
}

async fn list_models(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(refused) = state.caller(&headers) {
        return refused.into_response();
    }
    let models = state.pipeline.catalog().listed();
    let data: Vec<ModelObject<'_>> = models
        .iter()
        .map(|model| ModelObject { id: &model.name, object: "model", created: 0, owned_by: "turbine", context_length: model.context_length })
        .collect();
    axum::Json(serde_json::json!({"object": "list", "data": data})).into_response()
}

async fn get_model(State(state): State<AppState>, headers: HeaderMap, Path(model): Path<String>) -> Response {
    if let Err(refused) = state.caller(&headers) {
        return refused.into_response();
    }
    let models = state.pipeline.catalog().listed();
    match models.iter().find(|listed| listed.name == model) {
        Some(listed) => axum::Json(ModelObject { id: &listed.name, object: "model", created: 0, owned_by: "turbine", context_length: listed.context_length })
            .into_response(),
        None => GatewayError::model_not_found(&model).into_response(),
    }
}

async fn chat_completions(State(state): State<AppState>, peer: Option<Extension<ConnectInfo<SocketAddr>>>, headers: HeaderMap, body: Body) -> Response {
    let address = client_address(&state, peer, &headers);
    let response = generate(&state, Endpoint::Chat, address, &headers, body).await.unwrap_or_else(IntoResponse::into_response);
    metrics::response("chat_completions", response.status().as_u16());
    response
}

async fn completions(State(state): State<AppState>, peer: Option<Extension<ConnectInfo<SocketAddr>>>, headers: HeaderMap, body: Body) -> Response {
    let address = client_address(&state, peer, &headers);
    let response = generate(&state, Endpoint::Completion, address, &headers, body).await.unwrap_or_else(IntoResponse::into_response);
    metrics::response("completions", response.status().as_u16());
    response
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or_default()
}

/// The client a REST call came from, where the server says: its
/// connection's address, or the client its trusted proxy named (a header
/// line that is not text names none).
fn client_address(state: &AppState, peer: Option<Extension<ConnectInfo<SocketAddr>>>, headers: &HeaderMap) -> Option<IpAddr> {
    let forwarded_for = headers.get_all(FORWARDED_FOR).iter().map(|value| value.to_str().unwrap_or(""));
    state.client_address(peer.map(|Extension(ConnectInfo(address))| address.ip()), forwarded_for)
}

/// Holds what a request keeps while it streams.
struct Guards {
    _key: Option<KeyPermit>,
    /// One per choice.
    _places: Vec<Place>,
    _in_flight: InFlight,
}

async fn generate(state: &AppState, endpoint: Endpoint, address: Option<IpAddr>, headers: &HeaderMap, body: Body) -> Result<Response, GatewayError> {
    // Who is calling, before the body is read.
    let caller = state.caller(headers)?;
    let key_permit = match &caller {
        Some(key) => Some(key.admit().await?),
        None => None,
    };
    let mut guards = Guards { _key: key_permit, _places: vec![state.admit(caller.as_deref(), address)?], _in_flight: InFlight::start() };
    let bytes = read_limited(headers, body, state.max_body_bytes, state.body_timeout).await?;
    let (mut request, delivery): (TextRequest, Delivery) = match endpoint {
        Endpoint::Chat => parse_chat(&bytes)?,
        Endpoint::Completion => parse_completion(&bytes)?,
    };
    // Each further choice is a sequence of its own: it takes a place too.
    let capacity = state.admission.capacity();
    if delivery.choices as usize > capacity {
        return Err(GatewayError::invalid(
            "n",
            format!("'n' is {}, more than the {capacity} requests this server runs at once; ask for fewer choices.", delivery.choices),
        ));
    }
    for _ in 1..delivery.choices {
        guards._places.push(state.admit(caller.as_deref(), address)?);
    }
    request.namespace = Access::namespace(caller.as_deref());
    request.caller = caller;
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completion => "cmpl",
    };
    let meta = ResponseMeta { id: format!("{prefix}-{}", uuid::Uuid::new_v4().simple()), created: unix_now(), model: request.model.clone(), endpoint };
    // Every choice starts before the response does: one that cannot is the
    // response's error (the others, dropped, are cancelled). The first is
    // routed as any request; the others are routed beside it, where its
    // prompt is being computed, so they share that prefill.
    let choice = |index: u32| {
        let mut choice = request.clone();
        // A seeded request's choices differ from each other and come out
        // the same each time: choice i samples with seed + i.
        choice.sampling.seed = choice.sampling.seed.map(|seed| seed.wrapping_add(u64::from(index)));
        let request_id = if delivery.choices == 1 { meta.id.clone() } else { format!("{}-{index}", meta.id) };
        (choice, request_id)
    };
    let (first, first_id) = choice(0);
    let first = state.pipeline.start(first, first_id).await?;
    let beside = first.worker().clone();
    let others = futures::future::try_join_all((1..delivery.choices).map(|index| {
        let (choice, request_id) = choice(index);
        state.pipeline.start_beside(choice, request_id, Some(&beside))
    }))
    .await?;
    let texts: Vec<TextStream> = std::iter::once(first).chain(others).collect();
    if delivery.stream {
        let events = sse_events(texts, meta, delivery.include_usage, guards);
        Ok(Sse::new(events).keep_alive(KeepAlive::default()).into_response())
    } else {
        let vocabulary = texts[0].wants_logprobs().then(|| texts[0].token_bytes().clone());
        let results = futures::future::try_join_all(texts.into_iter().map(collect)).await?;
        drop(guards);
        let usage = combined_usage(results.iter().map(|(_, _, usage, _)| *usage));
        let choices: Vec<Choice> = results
            .into_iter()
            .map(|(text, reason, _, logprobs)| Choice {
                text,
                reason,
                logprobs: vocabulary.as_ref().map(|vocabulary| logprobs_body(endpoint, &logprobs, vocabulary, &mut 0)),
            })
            .collect();
        Ok(([(header::CONTENT_TYPE, "application/json")], whole(&meta, &choices, usage)).into_response())
    }
}

/// Runs a stream to its end, concatenating the text (and the
/// log-probabilities, if asked).
pub async fn collect(mut text: TextStream) -> Result<(String, turbine_api::FinishReason, Usage, Vec<GeneratedLogprob>), GatewayError> {
    let mut content = String::new();
    let mut all_logprobs = Vec::new();
    while let Some(event) = text.next().await {
        match event? {
            TextEvent::Delta { text, logprobs } => {
                content.push_str(&text);
                all_logprobs.extend(logprobs);
            }
            TextEvent::Finished { reason, usage } => return Ok((content, reason, usage, all_logprobs)),
        }
    }
    Err(GatewayError::new(ErrorKind::Internal, "generation ended without finishing"))
}

/// What one choice's stream hands the response.
enum ChoiceEvent {
    /// Text, with its tokens' log-probabilities when asked.
    Text(String, Option<serde_json::Value>),
    /// The choice's end.
    Finished(turbine_api::FinishReason, Usage),
    /// The choice failed: the response ends with this error.
    Failed(GatewayError),
}

/// One choice's events, tagged with its index; it ends after its
/// `Finished` or its failure.
fn choice_events(index: u32, text: TextStream, endpoint: Endpoint) -> BoxStream<'static, (u32, ChoiceEvent)> {
    // Completions: characters of text streamed so far (`text_offset`).
    futures::stream::unfold(Some((text, 0usize)), move |choice| async move {
        let (mut text, mut offset) = choice?;
        let event = match text.next().await? {
            Ok(TextEvent::Delta { text: delta, logprobs }) => {
                let logprobs = text.wants_logprobs().then(|| logprobs_body(endpoint, &logprobs, text.token_bytes(), &mut offset));
                return Some(((index, ChoiceEvent::Text(delta, logprobs)), Some((text, offset))));
            }
            Ok(TextEvent::Finished { reason, usage }) => ChoiceEvent::Finished(reason, usage),
            Err(error) => ChoiceEvent::Failed(error),
        };
        Some(((index, event), None))
    })
    .boxed()
}

enum Phase {
    /// Chat: the opening chunk of each choice, the next one's index.
    Opening(u32),
    Streaming,
    Done,
    End,
}

struct SseState {
    /// Every choice's events as they come; dropped (cancelling the choices
    /// still generating) once one fails.
    choices: Option<SelectAll<BoxStream<'static, (u32, ChoiceEvent)>>>,
    count: u32,
    meta: ResponseMeta,
    include_usage: bool,
    /// The usage of each choice that finished.
    usages: Vec<Usage>,
    phase: Phase,
    _guards: Guards,
}

/// The SSE event stream of one response: an opening chunk per choice
/// (chat), text chunks of the choices as they are generated (each naming
/// its choice's index), a finish chunk per choice, the usage chunk if
/// asked, then `[DONE]`. A client that disconnects drops this stream,
/// which cancels the workers' sequences and releases the router bookings.
fn sse_events(texts: Vec<TextStream>, meta: ResponseMeta, include_usage: bool, guards: Guards) -> impl Stream<Item = Result<Event, Infallible>> {
    let phase = if meta.endpoint == Endpoint::Chat { Phase::Opening(0) } else { Phase::Streaming };
    let count = texts.len() as u32;
    let choices = futures::stream::select_all(texts.into_iter().zip(0..).map(|(text, index)| choice_events(index, text, meta.endpoint)));
    let state = SseState { choices: Some(choices), count, meta, include_usage, usages: Vec::new(), phase, _guards: guards };
    futures::stream::unfold(state, |mut state| async move {
        let data = match std::mem::replace(&mut state.phase, Phase::Streaming) {
            Phase::Opening(index) => {
                if index + 1 < state.count {
                    state.phase = Phase::Opening(index + 1);
                }
                chunk(&state.meta, index, ChunkContent::Role, state.include_usage)
            }
            Phase::Streaming => match state.choices.as_mut()?.next().await {
                Some((index, ChoiceEvent::Text(text, logprobs))) => {
                    chunk(&state.meta, index, ChunkContent::Text(&text, logprobs.as_ref()), state.include_usage)
                }
                Some((index, ChoiceEvent::Finished(reason, usage))) => {
                    state.usages.push(usage);
                    chunk(&state.meta, index, ChunkContent::Finish(reason), state.include_usage)
                }
                Some((index, ChoiceEvent::Failed(error))) => {
                    tracing::warn!(%error, id = %state.meta.id, choice = index, "stream failed after it started");
                    state.choices = None;
                    state.phase = Phase::Done;
                    serde_json::to_string(&error.body()).expect("error bodies serialize")
                }
                None if state.include_usage && state.usages.len() == state.count as usize => {
                    state.phase = Phase::Done;
                    chunk(&state.meta, 0, ChunkContent::Usage(combined_usage(std::mem::take(&mut state.usages))), true)
                }
                None => {
                    state.phase = Phase::End;
                    "[DONE]".to_owned()
                }
            },
            Phase::Done => {
                state.phase = Phase::End;
                "[DONE]".to_owned()
            }
            Phase::End => return None,
        };
        Some((Ok(Event::default().data(data)), state))
    })
}

//! `turbine.gateway.v1.Inference`: the same pipeline as the REST API, for
//! gRPC clients, streaming text deltas.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tonic::{Request, Response, Status};
use turbine_api::{FinishReason, OutputFormat};
use turbine_proto::gateway::v1 as pb;
use turbine_tokens::ChatMessage;

use crate::error::GatewayError;
use crate::keys::{Access, ApiKey};
use crate::metrics::InFlight;
use crate::openai::AppState;
use crate::openai::types::{CommonParams, StopField};
use crate::pipeline::{DEFAULT_COMPLETION_MAX_TOKENS, Prompt, TextEvent, TextRequest};

/// The gRPC Inference service.
#[derive(Debug, Clone)]
pub struct InferenceService {
    state: AppState,
}

impl InferenceService {
    /// Serves requests through the same state as the REST API.
    pub fn new(state: AppState) -> Self {
        Self { state }
    }
}

impl InferenceService {
    /// The caller of `request`, by its `authorization: Bearer KEY`
    /// metadata (`None`: access is open), or UNAUTHENTICATED.
    fn caller<T>(&self, request: &Request<T>) -> Result<Option<Arc<ApiKey>>, GatewayError> {
        let caller = self.state.access.caller(request.metadata().get("authorization").and_then(|value| value.to_str().ok()));
        if caller.is_err() {
            // Refused call after call on one connection (keys guessed, a
            // revoked key in a loop), the client loses it.
            turbine_runtime::strikes::strike_caller();
        }
        caller
    }
}

fn text_request(request: pb::GenerateRequest) -> Result<TextRequest, GatewayError> {
    let pb::GenerateRequest {
        model,
        input,
        max_tokens,
        temperature,
        top_p,
        seed,
        stop,
        presence_penalty,
        frequency_penalty,
        ignore_eos,
        cache_salt,
        output_format,
        output_schema,
    } = request;
    let output = output(output_format, &output_schema)?;
    let common = CommonParams {
        model,
        max_tokens: max_tokens.map(i64::from),
        temperature: temperature.map(f64::from),
        top_p: top_p.map(f64::from),
        seed: seed.map(|seed| seed as i64),
        stop: Some(StopField::Many(stop)),
        presence_penalty: presence_penalty.map(f64::from),
        frequency_penalty: frequency_penalty.map(f64::from),
        ignore_eos: Some(ignore_eos),
        cache_salt,
        ..Default::default()
    };
    let (prompt, default_max_tokens) = match input {
        Some(pb::generate_request::Input::Chat(chat)) => {
            if chat.messages.is_empty() {
                return Err(GatewayError::invalid("chat.messages", "a chat needs at least one message"));
            }
            let messages = chat.messages.into_iter().map(|m| ChatMessage::new(m.role, m.content)).collect();
            (Prompt::Chat(messages), None)
        }
        Some(pb::generate_request::Input::Prompt(prompt)) => (Prompt::Text(prompt), Some(DEFAULT_COMPLETION_MAX_TOKENS)),
        None => return Err(GatewayError::invalid("input", "set either chat or prompt")),
    };
    let max_tokens = common.max_tokens.map(|value| ("max_tokens", value));
    let validated = common.validate_shared(max_tokens, (output, "output_format"))?;
    Ok(TextRequest {
        model: validated.model,
        prompt,
        max_tokens: validated.max_tokens.or(default_max_tokens),
        sampling: validated.sampling,
        stop: validated.stop,
        ignore_eos: validated.ignore_eos,
        cache_salt: validated.cache_salt,
        namespace: crate::pipeline::Namespace::Open,
        caller: None,
    })
}

/// The output format `output_format` and `output_schema` ask for.
fn output(output_format: i32, output_schema: &str) -> Result<OutputFormat, GatewayError> {
    match (pb::OutputFormat::try_from(output_format), output_schema.is_empty()) {
        (Ok(pb::OutputFormat::Unspecified), true) => Ok(OutputFormat::Text),
        (Ok(pb::OutputFormat::JsonObject), true) => Ok(OutputFormat::JsonObject { continued: 0 }),
        (Ok(pb::OutputFormat::JsonSchema), true) => Err(GatewayError::invalid("output_schema", "output_schema is required with OUTPUT_FORMAT_JSON_SCHEMA")),
        (Ok(pb::OutputFormat::JsonSchema), false) => {
            let schema: serde_json::Value =
                serde_json::from_str(output_schema).map_err(|error| GatewayError::invalid("output_schema", format!("output_schema is not JSON: {error}")))?;
            OutputFormat::json_schema(&schema).map_err(|error| GatewayError::invalid("output_schema", format!("output_schema {}", error.message)))
        }
        (Ok(_), false) => Err(GatewayError::invalid("output_schema", "output_schema is only for OUTPUT_FORMAT_JSON_SCHEMA")),
        (Err(_), _) => Err(GatewayError::invalid("output_format", format!("output_format {output_format} is no known format"))),
    }
}

fn finish_reason(reason: FinishReason) -> pb::FinishReason {
    match reason {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
    }
}

type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

/// Messages of a stream queued for its client beyond what its window
/// holds.
const STREAM_QUEUE: usize = 64;

#[tonic::async_trait]
impl pb::inference_server::Inference for InferenceService {
    type GenerateStream = GenerateStream;

    #[tracing::instrument(skip_all, name = "gateway.grpc.generate")]
    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<GenerateStream>, Status> {
        let caller = self.caller(&request)?;
        let key_permit = match &caller {
            Some(key) => Some(key.admit().await?),
            None => None,
        };
        let forwarded_for = request.metadata().get_all(turbine_runtime::proxies::FORWARDED_FOR).iter().map(|value| value.to_str().unwrap_or(""));
        let address = self.state.client_address(turbine_runtime::strikes::peer_address(&request), forwarded_for);
        let permit = (self.state.admit(caller.as_deref(), address)?, key_permit);
        let in_flight = InFlight::start();
        let mut request = text_request(request.into_inner())?;
        request.namespace = Access::namespace(caller.as_deref());
        request.caller = caller;
        let request_id = format!("gen-{}", uuid::Uuid::new_v4().simple());
        let text = self.state.pipeline.start(request, request_id.clone()).await?;
        // Messages go through a short queue its client drains; a client
        // that takes none of them for the stall timeout (its stream's
        // window full, the queue too) has its request ended, as on a
        // disconnect: else it would hold its place for good.
        let (messages, queue) = tokio::sync::mpsc::channel(STREAM_QUEUE);
        let stall = self.state.stream_stall_timeout;
        tokio::spawn(async move {
            let _held = (permit, in_flight);
            let mut text = text;
            while let Some(event) = text.next().await {
                let (message, last) = match event {
                    Ok(TextEvent::Delta { text: delta, .. }) => {
                        (Ok(pb::GenerateResponse { text: delta, finish_reason: 0, usage: None, request_id: request_id.clone() }), false)
                    }
                    Ok(TextEvent::Finished { reason, usage }) => {
                        let usage = pb::Usage {
                            prompt_tokens: usage.prompt_tokens,
                            completion_tokens: usage.completion_tokens,
                            cached_prompt_tokens: usage.cached_prompt_tokens,
                        };
                        (
                            Ok(pb::GenerateResponse {
                                text: String::new(),
                                finish_reason: finish_reason(reason) as i32,
                                usage: Some(usage),
                                request_id: request_id.clone(),
                            }),
                            true,
                        )
                    }
                    Err(error) => (Err(Status::from(error)), true),
                };
                match messages.send_timeout(message, stall).await {
                    Ok(()) if !last => {}
                    Ok(()) => return,
                    // The client left.
                    Err(tokio::sync::mpsc::error::SendTimeoutError::Closed(_)) => return,
                    Err(tokio::sync::mpsc::error::SendTimeoutError::Timeout(_)) => {
                        crate::metrics::stream_stalled();
                        tracing::info!(request_id, stall_secs = stall.as_secs_f64(), "a gRPC client read nothing of its stream: the request is ended");
                        return;
                    }
                }
            }
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(queue);
        Ok(Response::new(Box::pin(stream)))
    }

    async fn list_models(&self, request: Request<pb::ListModelsRequest>) -> Result<Response<pb::ListModelsResponse>, Status> {
        self.caller(&request)?;
        let models = self
            .state
            .pipeline
            .catalog()
            .listed()
            .into_iter()
            .map(|model| pb::Model { name: model.name, context_length: model.context_length, workers: model.workers })
            .collect();
        Ok(Response::new(pb::ListModelsResponse { models }))
    }
}

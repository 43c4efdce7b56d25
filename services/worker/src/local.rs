//! The worker's own [`WorkerApi`]: what a local client calls directly and
//! what the gRPC service serves, so both take the same path (validation,
//! metrics, disaggregation).

use std::time::Duration;

use tokio::sync::mpsc::UnboundedReceiver;
use turbine_api::worker::{Prefilled, RemotePrefill, TokenChunk, TokenStream, WorkerApi, WorkerError};
use turbine_engine::{EngineError, EngineOutput, GenerateRequest, Handoff, Load, OutputFormat};
use turbine_kv::WorkerDump;
use turbine_tokens::ModelCard;

use crate::metrics;
use crate::worker::Worker;

#[tonic::async_trait]
impl WorkerApi for Worker {
    async fn generate(&self, request: GenerateRequest, remote: Option<RemotePrefill>) -> Result<TokenStream, WorkerError> {
        self.check_vocabulary(&request.prompt, "prompt")?;
        self.check_output(&request)?;
        let submitted = match remote {
            Some(remote) => self.decode_after_prefill(request, remote).await,
            None => self.engine().generate(request),
        };
        let outputs = submitted.inspect_err(|error| metrics::request_refused(self.id(), error)).map_err(worker_error)?;
        Ok(metrics::observe_stream(self.id().clone(), engine_chunks(outputs)))
    }

    async fn prefill(&self, request: GenerateRequest, lease: Option<Duration>) -> Result<Prefilled, WorkerError> {
        self.prefill_for(IN_PROCESS, request, lease).await
    }

    async fn model_card(&self) -> Result<ModelCard, WorkerError> {
        Ok(self.card().clone())
    }

    async fn load(&self) -> Result<Load, WorkerError> {
        Ok(Worker::load(self))
    }

    async fn dump_kv_cache(&self) -> Result<WorkerDump, WorkerError> {
        let dump = self.engine().dump().await.map_err(|_| WorkerError::Unavailable("the engine is shutting down".into()))?;
        Ok(WorkerDump { worker_id: self.id().clone(), instance: self.instance(), dump })
    }
}

/// The requester of prefills called in this process (the embedded
/// cluster's gateway).
const IN_PROCESS: &str = "in-process";

/// The requester of prefills over gRPC without a certificate (plaintext
/// callers share one budget).
pub(crate) const ANONYMOUS: &str = "anonymous";

impl Worker {
    /// [`WorkerApi::prefill`] for `requester`, whose handles may pin only
    /// its share of the pool.
    pub async fn prefill_for(&self, requester: &str, request: GenerateRequest, lease: Option<Duration>) -> Result<Prefilled, WorkerError> {
        self.check_vocabulary(&request.prompt, "prompt")?;
        self.check_output(&request)?;
        self.disagg().prefill(requester, request, lease).await
    }

    /// Refuses an output format this worker's engine cannot keep to (the
    /// mocker constrains nothing).
    fn check_output(&self, request: &GenerateRequest) -> Result<(), WorkerError> {
        let output = &request.sampling.output;
        if !self.output_formats().holds(output.kind(), output.continued() > 0) {
            return Err(WorkerError::InvalidArgument("this worker's engine does not constrain its output: JSON output is not served here".into()));
        }
        match output {
            // The native engine holds output to a schema of the core subset.
            // Compiled here, and kept, so that the engine's thread finds it compiled.
            OutputFormat::JsonSchema { schema, .. } => turbine_native::schema::Schema::cached(schema).map(drop).map_err(|refused| {
                WorkerError::InvalidArgument(format!(
                    "json_schema: {refused}; this worker's engine holds output to a schema of a core subset of JSON Schema (docs/operations.md; vLLM and llama.cpp behind an adapter take any)"
                ))
            }),
            _ => Ok(()),
        }
    }

    /// Refuses token ids outside the model's vocabulary.
    fn check_vocabulary(&self, tokens: &[u32], what: &str) -> Result<(), WorkerError> {
        let vocab = self.card().tokenizer.tokens.len();
        match tokens.iter().find(|&&token| token as usize >= vocab) {
            Some(bad) => Err(WorkerError::InvalidArgument(format!("{what} token id {bad} is outside the vocabulary of {vocab} tokens"))),
            None => Ok(()),
        }
    }

    /// Submits a decode after a remote prefill: installs whatever blocks
    /// could be read, then continues after the prefill's tokens.
    async fn decode_after_prefill(&self, request: GenerateRequest, remote: RemotePrefill) -> Result<UnboundedReceiver<EngineOutput>, EngineError> {
        self.engine().config().validate(&request)?;
        self.check_vocabulary(&remote.generated_token_ids, "generated").map_err(|error| EngineError::InvalidRequest(error.to_string()))?;
        let import = self.disagg().import(&request, remote.handle.as_ref()).await;
        let handoff = Handoff::Decode { generated: remote.generated_token_ids, import };
        self.engine().submit(request, handoff)
    }
}

/// Turns an engine output channel into token chunks, coalescing whatever
/// tokens are already queued into one chunk.
pub fn engine_chunks(receiver: UnboundedReceiver<EngineOutput>) -> TokenStream {
    Box::pin(futures::stream::unfold(Some(receiver), |state| async move {
        let mut receiver = state?;
        let mut chunk = TokenChunk::default();
        let mut next = receiver.recv().await;
        loop {
            match next {
                Some(EngineOutput::Token(token, logprobs)) => {
                    chunk.tokens.push(token);
                    chunk.logprobs.extend(logprobs);
                }
                Some(EngineOutput::Finished { reason, usage }) => {
                    chunk.finished = Some((reason, usage));
                    return Some((Ok(chunk), None));
                }
                Some(EngineOutput::Failed(error)) => {
                    return Some((Err(worker_error(error)), None));
                }
                // Only prefills pin, and they do not stream through here.
                Some(EngineOutput::Pinned(_)) => {}
                None => {
                    return Some((Err(WorkerError::Unavailable("the engine stopped".into())), None));
                }
            }
            match receiver.try_recv() {
                Ok(output) => next = Some(output),
                Err(_) => return Some((Ok(chunk), Some(receiver))),
            }
        }
    }))
}

/// An engine's refusal or failure as the worker's callers see it.
pub(crate) fn worker_error(error: EngineError) -> WorkerError {
    match error {
        EngineError::InvalidRequest(message) => WorkerError::InvalidArgument(message),
        EngineError::Overloaded(_) => WorkerError::Overloaded(error.to_string()),
        EngineError::ShuttingDown => WorkerError::Unavailable(error.to_string()),
        EngineError::Executor(_) => WorkerError::Internal(error.to_string()),
    }
}

//! The `turbine.worker.v1.Worker` gRPC service: a thin shell over the
//! engine.

use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use futures::{Stream, StreamExt};
use tonic::{Request, Response, Status};
use turbine_proto::worker::v1 as pb;

use crate::client::engine_chunks;
use crate::convert::{finish_reason_to_proto, generate_request_from_proto, load_to_proto, logprobs_to_proto, usage_to_proto};
use crate::metrics;
use crate::worker::Worker;

/// The gRPC service. The worker is set once its model has loaded; until
/// then calls fail with UNAVAILABLE.
#[derive(Debug, Clone, Default)]
pub struct WorkerService {
    worker: Arc<OnceLock<Arc<Worker>>>,
}

impl WorkerService {
    /// A service whose worker is still loading.
    pub fn new() -> Self {
        Self::default()
    }

    /// Hands the loaded worker to the service.
    pub fn set_worker(&self, worker: Arc<Worker>) {
        let _ = self.worker.set(worker);
    }

    fn worker(&self) -> Result<&Arc<Worker>, Status> {
        self.worker.get().ok_or_else(|| Status::unavailable("the worker is still loading its model"))
    }
}

type GenerateStream = Pin<Box<dyn Stream<Item = Result<pb::GenerateResponse, Status>> + Send>>;

#[tonic::async_trait]
impl pb::worker_server::Worker for WorkerService {
    type GenerateStream = GenerateStream;

    #[tracing::instrument(skip_all, name = "worker.generate", fields(request_id))]
    async fn generate(&self, request: Request<pb::GenerateRequest>) -> Result<Response<GenerateStream>, Status> {
        let worker = self.worker()?.clone();
        let mut message = request.into_inner();
        let remote = message.remote_prefill.take();
        let request = generate_request_from_proto(message, worker.card().tokenizer.tokens.len()).map_err(Status::invalid_argument)?;
        tracing::Span::current().record("request_id", request.request_id.as_str());
        let submitted = match remote {
            Some(remote) => crate::client::decode_after_prefill(&worker, request, &remote).await,
            None => worker.engine().generate(request),
        };
        let outputs = match submitted {
            Ok(outputs) => outputs,
            Err(error) => {
                metrics::request_refused(worker.id(), &error);
                return Err(crate::client::WorkerError::from(error).into());
            }
        };
        let started = Instant::now();
        let mut first = true;
        let worker_id = worker.id().to_owned();
        let stream = engine_chunks(outputs).map(move |chunk| {
            let chunk = chunk.map_err(Status::from)?;
            if std::mem::take(&mut first) {
                metrics::first_token(&worker_id, started.elapsed());
            }
            let (finish_reason, usage) = match chunk.finished {
                Some((reason, usage)) => {
                    metrics::request_finished(&worker_id, started.elapsed());
                    (finish_reason_to_proto(reason) as i32, Some(usage_to_proto(usage)))
                }
                None => (pb::FinishReason::Unspecified as i32, None),
            };
            let logprobs = chunk.logprobs.into_iter().map(logprobs_to_proto).collect();
            Ok(pb::GenerateResponse { token_ids: chunk.tokens, finish_reason, usage, logprobs })
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn load(&self, _request: Request<pb::LoadRequest>) -> Result<Response<pb::LoadResponse>, Status> {
        let load = self.worker()?.load();
        Ok(Response::new(pb::LoadResponse { load: Some(load_to_proto(load)) }))
    }

    async fn get_model_card(&self, _request: Request<pb::GetModelCardRequest>) -> Result<Response<pb::GetModelCardResponse>, Status> {
        let card = self.worker()?.card_proto().clone();
        Ok(Response::new(pb::GetModelCardResponse { card: Some(card) }))
    }

    #[tracing::instrument(skip_all, name = "worker.prefill", fields(request_id))]
    async fn prefill(&self, request: Request<pb::PrefillRequest>) -> Result<Response<pb::PrefillResponse>, Status> {
        let worker = self.worker()?.clone();
        let message = request.into_inner();
        let lease = (message.lease_ms > 0).then(|| std::time::Duration::from_millis(u64::from(message.lease_ms)));
        let as_generate = pb::GenerateRequest {
            request_id: message.request_id,
            prompt_token_ids: message.prompt_token_ids,
            sampling: message.sampling,
            stop: message.stop,
            remote_prefill: None,
        };
        let request = generate_request_from_proto(as_generate, worker.card().tokenizer.tokens.len()).map_err(Status::invalid_argument)?;
        tracing::Span::current().record("request_id", request.request_id.as_str());
        let prefilled = worker.disagg().prefill(request, lease).await?;
        let (finish_reason, usage) = match prefilled.first.finished {
            Some((reason, usage)) => (finish_reason_to_proto(reason) as i32, Some(usage_to_proto(usage))),
            None => (pb::FinishReason::Unspecified as i32, None),
        };
        let first = pb::GenerateResponse {
            token_ids: prefilled.first.tokens,
            finish_reason,
            usage,
            logprobs: prefilled.first.logprobs.into_iter().map(logprobs_to_proto).collect(),
        };
        Ok(Response::new(pb::PrefillResponse { first: Some(first), handle: prefilled.handle, cached_prompt_tokens: prefilled.cached_prompt_tokens }))
    }

    async fn dump_kv_cache(&self, _request: Request<pb::DumpKvCacheRequest>) -> Result<Response<pb::DumpKvCacheResponse>, Status> {
        let worker = self.worker()?;
        let dump = worker.engine().dump().await.map_err(|_| Status::unavailable("the engine is shutting down"))?;
        Ok(Response::new(pb::DumpKvCacheResponse { dump: Some(turbine_kv_log::convert::dump_to_proto(worker.id(), worker.instance(), &dump)) }))
    }
}

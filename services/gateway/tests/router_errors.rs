//! Each way the gateway's router or a worker can fail, as a client of the
//! REST API sees it: a status and OpenAI error JSON, never a 200, and none
//! of the router's internal words. The router and the worker are
//! `turbine_api`'s mocks of their clients' traits; the gateway, its HTTP
//! listener and the client's request are real.

use std::sync::Arc;

use turbine_api::router::{MockRouterApi, RoutedWorker, RouterCallError, RouterClient};
use turbine_api::worker::{MockWorkerApi, WorkerClient, WorkerClients, WorkerError};
use turbine_api::{ErrorCode, Load, WorkerRole};
use turbine_gateway::config::GatewayConfig;
use turbine_gateway::serve::{GatewayDeps, serve};
use turbine_runtime::CancellationToken;
use turbine_runtime::host::{Listeners, bind};

/// A gateway in this process over `router` and `workers`: its REST base URL
/// and the switch that stops it.
async fn gateway(router: MockRouterApi, workers: WorkerClients) -> (String, CancellationToken) {
    let listeners = Listeners::loopback().await.unwrap().with_http(bind("127.0.0.1:0".parse().unwrap(), "HTTP").await.unwrap());
    let base = format!("http://{}", listeners.http.as_ref().unwrap().local_addr().unwrap());
    let deps = GatewayDeps { router: RouterClient::new(Arc::new(router)), workers, own_key: None };
    let shutdown = CancellationToken::new();
    tokio::spawn(serve(GatewayConfig::default(), deps, listeners, shutdown.clone()));
    (base, shutdown)
}

/// A chat completion for model `m`: the status, the `Retry-After` header and
/// the body.
async fn chat(base: &str) -> (u16, Option<String>, serde_json::Value) {
    let response = reqwest::Client::new()
        .post(format!("{base}/v1/chat/completions"))
        .json(&serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let retry_after = response.headers().get("retry-after").map(|value| value.to_str().unwrap().to_owned());
    (status, retry_after, response.json().await.unwrap())
}

fn failing_router(error: RouterCallError) -> MockRouterApi {
    let mut router = MockRouterApi::new();
    router.expect_workers().returning(move |_| Err(error.clone()));
    router
}

#[tokio::test]
async fn every_router_failure_is_a_status_with_openai_error_json() {
    let cases = [
        (RouterCallError::NoWorkers("no live worker serves model \"m\"".into()), 503, Some("1"), "server_error", "no live worker serves model \"m\""),
        (RouterCallError::InvalidRequest("model is required".into()), 400, None, "invalid_request_error", "model is required"),
        (RouterCallError::Unavailable("tcp connect error 10.0.0.7:50051".into()), 503, Some("1"), "server_error", "the router is unavailable; retry shortly"),
        (
            RouterCallError::Denied { code: ErrorCode::PermissionDenied, message: "role gateway may not call ListWorkers".into() },
            500,
            None,
            "server_error",
            "the gateway cannot reach its router",
        ),
    ];
    for (error, status, retry_after, kind, message) in cases {
        let (base, shutdown) = gateway(failing_router(error.clone()), WorkerClients::default()).await;
        let (got_status, got_retry_after, body) = chat(&base).await;
        assert_eq!((got_status, got_retry_after.as_deref()), (status, retry_after), "{error:?}: {body}");
        assert_eq!((body["error"]["type"].as_str(), body["error"]["message"].as_str()), (Some(kind), Some(message)), "{error:?}");
        shutdown.cancel();
    }
}

#[tokio::test]
async fn a_model_whose_only_worker_gives_no_card_is_not_found() {
    let mut router = MockRouterApi::new();
    router.expect_workers().returning(|_| {
        Ok(vec![RoutedWorker {
            worker_id: "w-1".into(),
            endpoint: "http://127.0.0.1:9".into(),
            model: "m".into(),
            load: Load::default(),
            in_flight: 0,
            role: WorkerRole::Aggregated,
            kv_tenants: Vec::new(),
            output_formats: Default::default(),
        }])
    });
    let mut worker = MockWorkerApi::new();
    worker.expect_model_card().times(1..).returning(|| Err(WorkerError::Unavailable("starting".into())));
    let workers = WorkerClients::default();
    workers.add_local("w-1".into(), WorkerClient::new(Arc::new(worker)));
    let (base, shutdown) = gateway(router, workers).await;
    let (status, _, body) = chat(&base).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!((body["error"]["code"].as_str(), body["error"]["param"].as_str()), (Some("model_not_found"), Some("model")));
    shutdown.cancel();
}

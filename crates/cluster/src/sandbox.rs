//! An in-process cluster for tests (quickwit's `cluster_sandbox` is the
//! model): the embedded cluster on free loopback ports, ready when its
//! services say so, with typed clients and a REST client for its gateway.
//! Real sockets carry every byte between the test and the gateway, as they
//! would from a remote client.
//!
//! ```text
//! let sandbox = Sandbox::start(Sandbox::mock(1000.0)).await;
//! let (status, body) = sandbox.post("/v1/completions", &json!({...})).await;
//! sandbox.stop().await;
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures::StreamExt;
use turbine_runtime::CancellationToken;
use turbine_worker::EngineKind;

use crate::{Cluster, ClusterOptions, RunConfig};

/// Sandboxes started by this process (their worker ids stay apart).
static STARTED: AtomicUsize = AtomicUsize::new(0);

/// A started in-process cluster; stops (drained) when [`stop`](Self::stop)
/// is awaited, or abruptly when dropped.
#[derive(Debug)]
pub struct Sandbox {
    cluster: Option<Cluster>,
    shutdown: CancellationToken,
    http: reqwest::Client,
    base: String,
}

impl Sandbox {
    /// A configuration of `turbine run` on the mocker at `speedup`, on free
    /// loopback ports.
    pub fn mock(speedup: f64) -> RunConfig {
        let mut config = Self::native();
        config.worker.engine.engine = EngineKind::Mock;
        config.worker.engine.speedup = speedup;
        config
    }

    /// A configuration of `turbine run` on the native engine (the default
    /// model), on free loopback ports.
    pub fn native() -> RunConfig {
        RunConfig { host: [127, 0, 0, 1].into(), http_port: 0, grpc_port: 0, shutdown_grace_secs: 5.0, ..RunConfig::default() }
    }

    /// Starts the cluster; returns once every worker is SERVING and the
    /// gateway lists the model. Panics with the reason if it cannot start.
    pub async fn start(config: RunConfig) -> Self {
        Self::start_with(config, ClusterOptions::default()).await
    }

    /// [`start`](Self::start) with cluster options (router replicas, an
    /// event log in Redis).
    pub async fn start_with(config: RunConfig, options: ClusterOptions) -> Self {
        let shutdown = CancellationToken::new();
        let sandbox = STARTED.fetch_add(1, Ordering::Relaxed);
        let options = ClusterOptions { worker_id_prefix: format!("s{sandbox}-{}", options.worker_id_prefix), ..options };
        let cluster = Cluster::start(config, options, shutdown.clone()).await.unwrap_or_else(|error| panic!("the sandbox cluster did not start: {error:#}"));
        let base = cluster.http_url();
        // Every request is bounded: a hang fails the test with the call
        // that hung instead of stalling the suite.
        let http = reqwest::Client::builder().timeout(REQUEST_TIMEOUT).build().expect("an HTTP client");
        Self { cluster: Some(cluster), shutdown, http, base }
    }

    /// The cluster: its clients and addresses.
    pub fn cluster(&self) -> &Cluster {
        self.cluster.as_ref().expect("running")
    }

    /// The gateway's REST base URL (`http://127.0.0.1:PORT`).
    pub fn base(&self) -> &str {
        &self.base
    }

    /// POSTs JSON to the gateway; (status, body as JSON).
    pub async fn post(&self, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
        let response = self.http.post(format!("{}{path}", self.base)).json(body).send().await.expect("the gateway answers");
        let status = response.status().as_u16();
        (status, response.json().await.expect("a JSON body"))
    }

    /// GETs a gateway path as JSON; (status, body).
    pub async fn get(&self, path: &str) -> (u16, serde_json::Value) {
        let response = self.http.get(format!("{}{path}", self.base)).send().await.expect("the gateway answers");
        let status = response.status().as_u16();
        (status, response.json().await.unwrap_or(serde_json::Value::Null))
    }

    /// The `data:` payloads of a streamed (SSE) answer, until `[DONE]`.
    pub async fn sse(&self, path: &str, body: &serde_json::Value) -> Vec<String> {
        let response = self.http.post(format!("{}{path}", self.base)).json(body).send().await.expect("the gateway answers");
        assert_eq!(response.status(), 200, "{:?}", response.text().await);
        assert!(response.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
        read_events(response).await
    }

    /// One metric's value (summed over its series) on the gateway's
    /// `/metrics`, restricted to series carrying every `label="value"`.
    /// The registry is the process's: label by worker to tell clusters
    /// apart.
    pub async fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let admin = self.cluster().gateways()[0].admin_url().expect("gateways serve HTTP");
        let text = self.http.get(format!("{admin}/metrics")).send().await.expect("metrics").text().await.expect("metrics text");
        text.lines()
            .filter(|line| line.starts_with(name) && line[name.len()..].starts_with([' ', '{']))
            .filter(|line| labels.iter().all(|(label, value)| line.contains(&format!("{label}=\"{value}\""))))
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    /// Stops the cluster and waits until every service has drained.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(cluster) = self.cluster.take() {
            tokio::time::timeout(STOP_TIMEOUT, cluster.finished())
                .await
                .unwrap_or_else(|_| panic!("the sandbox cluster did not drain within {STOP_TIMEOUT:?}"))
                .expect("the sandbox cluster stopped cleanly");
        }
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Longest a sandbox request may take, response body included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);

/// Longest the sandbox cluster may take to drain.
const STOP_TIMEOUT: Duration = Duration::from_secs(60);

/// Reads SSE `data:` payloads from a response until `[DONE]`.
pub async fn read_events(response: reqwest::Response) -> Vec<String> {
    let mut stream = response.bytes_stream();
    let mut buffer = String::new();
    let mut events = Vec::new();
    while let Some(bytes) = stream.next().await {
        let bytes = bytes.unwrap_or_else(|error| panic!("the stream broke off ({error}); got {events:?}"));
        buffer.push_str(std::str::from_utf8(&bytes).expect("UTF-8 events"));
        while let Some(end) = buffer.find("\n\n") {
            let event: String = buffer.drain(..end + 2).collect();
            for line in event.lines() {
                if let Some(data) = line.strip_prefix("data: ") {
                    events.push(data.to_owned());
                    if data == "[DONE]" {
                        return events;
                    }
                }
            }
        }
    }
    panic!("the stream ended without [DONE]; got {events:?}");
}

/// The text of streamed chat or completion chunks, concatenated.
pub fn streamed_text(events: &[String]) -> String {
    events
        .iter()
        .filter(|event| *event != "[DONE]")
        .map(|event| serde_json::from_str::<serde_json::Value>(event).expect("JSON chunks"))
        .filter_map(|chunk| {
            let choice = chunk["choices"].get(0)?.clone();
            choice["delta"]["content"].as_str().or(choice["text"].as_str()).map(str::to_owned)
        })
        .collect()
}

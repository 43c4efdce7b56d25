//! Helpers shared by the CLI's process tests: starting `turbine run`,
//! talking OpenAI REST with a real HTTP client, reading SSE.

#![allow(dead_code)]

use std::process::Command;
use std::time::Duration;

use futures::StreamExt;
pub use turbine_testkit::metric;
use turbine_testkit::{ChildProcess, STARTUP_TIMEOUT};

/// A `turbine run` process.
pub struct Turbine {
    pub process: ChildProcess,
    pub base: String,
    pub grpc: String,
}

/// Starts `turbine run` on free ports with extra flags; returns once the
/// model is listed.
pub async fn start_turbine(extra: &[&str]) -> Turbine {
    let mut command = Command::new(env!("CARGO_BIN_EXE_turbine"));
    command.args(["run", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0"]).args(extra);
    let mut process = ChildProcess::spawn("turbine run", command);
    let api = process.wait_for_line("OpenAI API", STARTUP_TIMEOUT);
    let base = api.split_whitespace().last().unwrap().trim_end_matches("/v1").to_owned();
    let grpc_line = process.wait_for_line("gRPC", STARTUP_TIMEOUT);
    let grpc_addr = grpc_line.split_whitespace().nth(1).unwrap().to_owned();
    let turbine = Turbine { process, base, grpc: format!("http://{grpc_addr}") };
    wait_for_model(&turbine.base).await;
    turbine
}

/// Waits until `GET /v1/models` lists a model.
pub async fn wait_for_model(base: &str) {
    let client = reqwest::Client::new();
    let deadline = tokio::time::Instant::now() + STARTUP_TIMEOUT;
    loop {
        if let Ok(response) = client.get(format!("{base}/v1/models")).send().await
            && let Ok(body) = response.json::<serde_json::Value>().await
            && body["data"].as_array().is_some_and(|data| !data.is_empty())
        {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "no model listed at {base}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// POSTs JSON, returns (status, body as JSON).
pub async fn post(base: &str, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let response = reqwest::Client::new().post(format!("{base}{path}")).json(body).send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.json().await.unwrap())
}

/// The `data:` payloads of an SSE response, in order, until `[DONE]`.
pub async fn sse(base: &str, path: &str, body: &serde_json::Value) -> Vec<String> {
    let response = reqwest::Client::new().post(format!("{base}{path}")).json(body).send().await.unwrap();
    assert_eq!(response.status(), 200, "{:?}", response.text().await);
    assert!(response.headers()["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    read_events(response).await
}

/// Reads SSE `data:` payloads from a response until `[DONE]`.
pub async fn read_events(response: reqwest::Response) -> Vec<String> {
    let mut stream = response.bytes_stream();
    let mut buffer = String::new();
    let mut events = Vec::new();
    while let Some(bytes) = stream.next().await {
        buffer.push_str(std::str::from_utf8(&bytes.unwrap()).unwrap());
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
    panic!("stream ended without [DONE]; got {events:?}");
}

/// Concatenated text of streamed chat or completion chunks.
pub fn streamed_text(events: &[String]) -> String {
    events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str::<serde_json::Value>(e).unwrap())
        .filter_map(|chunk| {
            let choice = chunk["choices"].get(0)?.clone();
            choice["delta"]["content"].as_str().or(choice["text"].as_str()).map(str::to_owned)
        })
        .collect()
}


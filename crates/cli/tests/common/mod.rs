//! Helpers shared by the CLI's process tests: Turbine binaries started on
//! port 0 (readiness from their addresses file and gRPC health), and
//! OpenAI REST with a real HTTP client.

#![allow(dead_code, unused_imports)]

use std::process::Command;
use std::time::Duration;

use turbine_api::router::RouterClient;
pub use turbine_cluster::sandbox::{read_events, streamed_text};
use turbine_testkit::{STARTUP_TIMEOUT, ServiceProcess, workspace_binary};
pub use turbine_testkit::{metric, wait_until};

pub const MODEL: &str = "smollm2-135m";

/// Starts the workspace binary `binary` with `args` (and environment
/// `env`) on free loopback ports; returns once it is SERVING.
pub async fn service(binary: &str, args: &[&str], env: &[(&str, String)], http: bool) -> ServiceProcess {
    let mut command = Command::new(workspace_binary(binary));
    command.args(args);
    for (key, value) in env {
        command.env(key, value);
    }
    let mut service = ServiceProcess::spawn(binary, command, http).await.unwrap();
    service.until_serving(role_of(binary), "", STARTUP_TIMEOUT).await.unwrap();
    service
}

/// The role of the service `binary` (`turbine-router`) runs.
pub fn role_of(binary: &str) -> turbine_runtime::host::Role {
    use turbine_runtime::host::Role;
    match binary.trim_start_matches("turbine-") {
        "worker" => Role::Worker,
        "router" => Role::Router,
        "gateway" => Role::Gateway,
        "kv-index" => Role::Index,
        "kv-store" => Role::KvStore,
        "planner" => Role::Planner,
        other => panic!("no service {other}"),
    }
}

/// Waits until the router at `router` lists `workers` workers.
pub async fn until_registered(router: &ServiceProcess, workers: usize) {
    let client = RouterClient::connect(&router.grpc_endpoint()).unwrap();
    wait_until("the workers are registered", STARTUP_TIMEOUT, async || client.workers(None).await.is_ok_and(|listed| listed.len() == workers)).await;
}

/// Waits until the gateway at `base` lists a model.
pub async fn until_listed(base: &str) {
    let client = reqwest::Client::new();
    wait_until("the gateway lists the model", STARTUP_TIMEOUT, async || {
        let Ok(response) = client.get(format!("{base}/v1/models")).send().await else {
            return false;
        };
        response.json::<serde_json::Value>().await.is_ok_and(|body| body["data"].as_array().is_some_and(|data| !data.is_empty()))
    })
    .await;
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

/// How long a drained process may take to exit.
pub const EXIT_TIMEOUT: Duration = Duration::from_secs(30);

/// POSTs `body` to `path` over HTTPS at `address` (HTTP/1.1, `localhost`
/// as the server's name), trusting only the CA `ca_pem`, with the API
/// key `key` if any; the whole answer (status line, headers, body) as
/// text.
pub async fn https_post(address: std::net::SocketAddr, ca_pem: &str, path: &str, key: Option<&str>, body: &serde_json::Value) -> String {
    https_request(address, ca_pem, "POST", path, key, Some(body)).await
}

/// [`https_request`]'s answer's status and JSON body (an answer with a
/// length: no streamed one).
pub async fn https_json(
    address: std::net::SocketAddr,
    ca_pem: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&serde_json::Value>,
) -> (u16, serde_json::Value) {
    let answer = https_request(address, ca_pem, method, path, key, body).await;
    let status = answer.split(' ').nth(1).and_then(|code| code.parse().ok()).unwrap_or_else(|| panic!("no status line: {answer}"));
    let (_, body) = answer.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no body: {answer}"));
    (status, serde_json::from_str(body).unwrap_or_else(|error| panic!("{error}: {answer}")))
}

/// One kept-alive HTTPS connection (HTTP/1.1, `localhost` as the server's
/// name), for requests one after another on it.
pub struct KeptHttps {
    tls: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
}

impl KeptHttps {
    /// Connects to `address`, trusting only the CA `ca_pem`.
    pub async fn connect(address: std::net::SocketAddr, ca_pem: &str) -> Self {
        let stream = tokio::net::TcpStream::connect(address).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let tls = tokio_rustls::TlsConnector::from(client_config(ca_pem)).connect(name, stream).await.expect("the server's certificate verifies");
        Self { tls }
    }

    /// GET `path` with the API key `key` on this connection: the answer's
    /// status, its body read; None if the connection ended instead.
    pub async fn get(&mut self, path: &str, key: &str) -> Option<u16> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let request = format!("GET {path} HTTP/1.1\r\nhost: localhost\r\nauthorization: Bearer {key}\r\n\r\n");
        self.tls.write_all(request.as_bytes()).await.ok()?;
        let mut head = Vec::new();
        let mut byte = [0_u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            let read = tokio::time::timeout(std::time::Duration::from_secs(10), self.tls.read(&mut byte)).await.expect("an answer or the end").ok()?;
            if read == 0 {
                return None;
            }
            head.push(byte[0]);
        }
        let head = String::from_utf8(head).unwrap();
        let status = head.split(' ').nth(1)?.parse().ok()?;
        let length: usize = head
            .lines()
            .find_map(|line| line.to_ascii_lowercase().strip_prefix("content-length:").map(|value| value.trim().parse().unwrap()))
            .expect("an answer with a length");
        let mut body = vec![0_u8; length];
        self.tls.read_exact(&mut body).await.ok()?;
        Some(status)
    }
}

/// A TLS client trusting only the CA `ca_pem`.
fn client_config(ca_pem: &str) -> std::sync::Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(<rustls::pki_types::CertificateDer as rustls::pki_types::pem::PemObject>::from_pem_slice(ca_pem.as_bytes()).unwrap()).unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let client = rustls::ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions().unwrap();
    std::sync::Arc::new(client.with_root_certificates(roots).with_no_client_auth())
}

/// `method` `path` over HTTPS at `address` (HTTP/1.1, `localhost` as the
/// server's name), trusting only the CA `ca_pem`, with the API key `key`
/// and the JSON `body` if any; the whole answer (status line, headers,
/// body) as text.
pub async fn https_request(
    address: std::net::SocketAddr,
    ca_pem: &str,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<&serde_json::Value>,
) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let client = client_config(ca_pem);
    let stream = tokio::net::TcpStream::connect(address).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = tokio_rustls::TlsConnector::from(client).connect(name, stream).await.expect("the server's certificate verifies");
    let body = body.map(ToString::to_string).unwrap_or_default();
    let authorization = key.map(|key| format!("authorization: Bearer {key}\r\n")).unwrap_or_default();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n{authorization}content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    tls.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    tls.read_to_string(&mut answer).await.unwrap();
    answer
}

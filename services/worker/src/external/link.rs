//! The worker's link to its engine server: HTTP over TCP for an
//! `http://` `--upstream`, over TLS for an `https://` one.
//!
//! Over TLS the engine's certificate must chain to `--upstream-ca` (the
//! system's roots without it) and name the URL's host; the worker
//! presents its own certificate (`--tls-cert`) when it has one, so an
//! engine started with the deployment's CA as its client CA (vLLM:
//! `--ssl-ca-certs CA --ssl-cert-reqs 2`) serves Turbine's processes
//! alone. An `--upstream-api-key-file` key goes with every call as
//! `Authorization: Bearer` (vLLM's and llama-server's `--api-key`).
//!
//! Built on hyper's pooled client with rustls over ring (the TLS stack
//! every other link in Turbine uses) rather than an HTTP client library
//! bringing a crypto provider of its own.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use bytes::Bytes;
use futures::Stream;
use http_body_util::{BodyDataStream, BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Method, Request, StatusCode, Uri, header};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::{Connected, Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// How long connecting to the engine may take (TCP, then TLS).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long an idle connection to the engine is kept for the next
/// request: less than servers keep one open (llama.cpp's closes after 5 s
/// idle), so a request is not sent down a connection being closed.
const IDLE_CONNECTION: Duration = Duration::from_secs(3);
/// Idle connections kept per engine.
const IDLE_PER_HOST: usize = 64;
/// The most bytes a body read whole may take (vLLM's /metrics is tens of
/// KiB; an error a few hundred bytes): an engine answering more is not
/// buffered past it.
pub const MAX_BODY_BYTES: usize = 8 << 20;

/// What the link needs beyond the URL: whom to trust, who to be, and the
/// engine's API key.
#[derive(Debug, Clone, Default)]
pub struct LinkSettings {
    /// PEM file of the CA certificates an `https://` engine's certificate
    /// must chain to [default: the system's roots].
    pub ca: Option<PathBuf>,
    /// PEM certificate and key presented to an `https://` engine.
    pub identity: Option<(PathBuf, PathBuf)>,
    /// A file whose first line is the key the engine requires.
    pub api_key: Option<PathBuf>,
}

/// Why a call to the engine failed before its answer began, with every
/// cause (a refused certificate says so).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct LinkError(String);

impl LinkError {
    fn of(error: &(dyn std::error::Error + 'static)) -> Self {
        let mut text = error.to_string();
        let mut source = error.source();
        while let Some(cause) = source {
            let line = cause.to_string();
            if !text.contains(&line) {
                text = format!("{text}: {line}");
            }
            source = cause.source();
        }
        Self(text)
    }
}

/// The HTTP client a worker calls its engine with (cheap to clone; public:
/// a benchmark calls the engine as the adapter does).
#[derive(Clone)]
pub struct EngineLink {
    client: Client<Connector, Full<Bytes>>,
    /// `Authorization: Bearer KEY`, when the engine wants a key.
    authorization: Option<header::HeaderValue>,
}

impl std::fmt::Debug for EngineLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineLink").field("api_key", &self.authorization.is_some()).finish_non_exhaustive()
    }
}

/// One call to the engine, kept whole so it can be sent again.
#[derive(Debug, Clone)]
pub struct EngineRequest {
    method: Method,
    uri: Uri,
    body: Bytes,
}

/// The engine's answer: its status, and its body as it arrives.
#[derive(Debug)]
pub struct EngineResponse {
    status: StatusCode,
    body: Incoming,
}

impl EngineLink {
    /// A link with no settings: plain HTTP, or TLS trusting the system's
    /// roots.
    pub fn plain() -> anyhow::Result<Self> {
        Self::new(&LinkSettings::default())
    }

    /// A link as `settings` say; fails on an unreadable or malformed file.
    pub fn new(settings: &LinkSettings) -> anyhow::Result<Self> {
        let tls = tls_config(settings)?;
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(CONNECT_TIMEOUT));
        http.set_nodelay(true);
        let connector = Connector { http, tls: TlsConnector::from(Arc::new(tls)) };
        let client = Client::builder(TokioExecutor::new())
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .pool_idle_timeout(IDLE_CONNECTION)
            .pool_max_idle_per_host(IDLE_PER_HOST)
            .build(connector);
        let authorization = match &settings.api_key {
            None => None,
            Some(path) => {
                let text = std::fs::read_to_string(path).with_context(|| format!("cannot read the engine's API key {}", path.display()))?;
                let key = text.lines().next().unwrap_or_default().trim();
                anyhow::ensure!(!key.is_empty(), "the engine's API key file {} is empty", path.display());
                let mut value = header::HeaderValue::from_str(&format!("Bearer {key}"))
                    .map_err(|_| anyhow::anyhow!("the engine's API key in {} holds characters a header cannot carry", path.display()))?;
                value.set_sensitive(true);
                Some(value)
            }
        };
        Ok(Self { client, authorization })
    }

    /// `GET url`.
    pub fn get(&self, url: &str) -> Result<EngineRequest, LinkError> {
        Ok(EngineRequest { method: Method::GET, uri: parse(url)?, body: Bytes::new() })
    }

    /// `POST url` with `body` as JSON.
    pub fn post_json(&self, url: &str, body: &impl serde::Serialize) -> Result<EngineRequest, LinkError> {
        let body = serde_json::to_vec(body).map_err(|error| LinkError(format!("cannot encode the request: {error}")))?;
        Ok(EngineRequest { method: Method::POST, uri: parse(url)?, body: body.into() })
    }

    /// Sends `request` once; the answer once its headers arrived.
    pub async fn send_once(&self, request: &EngineRequest) -> Result<EngineResponse, LinkError> {
        let mut builder = Request::builder().method(request.method.clone()).uri(request.uri.clone()).header(header::ACCEPT, "*/*");
        if request.method == Method::POST {
            builder = builder.header(header::CONTENT_TYPE, "application/json");
        }
        if let Some(authorization) = &self.authorization {
            builder = builder.header(header::AUTHORIZATION, authorization.clone());
        }
        let call = builder.body(Full::new(request.body.clone())).map_err(|error| LinkError::of(&error))?;
        let response = self.client.request(call).await.map_err(|error| LinkError::of(&error))?;
        let (parts, body) = response.into_parts();
        Ok(EngineResponse { status: parts.status, body })
    }

    /// Sends `request`; once more, on a new connection, when the first try
    /// failed before any answer (the server closed the kept-alive
    /// connection it went down): nothing was streamed yet, and the engine
    /// cancels whatever it began when that connection closed.
    pub async fn send(&self, request: &EngineRequest) -> Result<EngineResponse, LinkError> {
        match self.send_once(request).await {
            Err(error) => {
                tracing::debug!(%error, "the engine's connection closed before it answered: sending again");
                self.send_once(request).await
            }
            answered => answered,
        }
    }
}

impl EngineResponse {
    /// The answer's status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The whole body as text (lossy UTF-8), up to [`MAX_BODY_BYTES`].
    pub async fn text(self) -> Result<String, LinkError> {
        let body = http_body_util::Limited::new(self.body, MAX_BODY_BYTES).collect().await;
        let body = body.map_err(|error| LinkError::of(&*error))?.to_bytes();
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    /// The body's bytes as they arrive.
    pub fn bytes_stream(self) -> impl Stream<Item = Result<Bytes, hyper::Error>> + Send + 'static {
        BodyDataStream::new(self.body)
    }
}

fn parse(url: &str) -> Result<Uri, LinkError> {
    let uri: Uri = url.parse().map_err(|error| LinkError(format!("{url:?} is not a URL: {error}")))?;
    match uri.scheme_str() {
        Some("http" | "https") if uri.host().is_some() => Ok(uri),
        _ => Err(LinkError(format!("{url:?} is not an http:// or https:// URL"))),
    }
}

/// The TLS client settings: roots, and the worker's certificate if it
/// has one; HTTP/2 or HTTP/1.1 as the server prefers.
fn tls_config(settings: &LinkSettings) -> anyhow::Result<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    match &settings.ca {
        Some(path) => {
            let pem = std::fs::read(path).with_context(|| format!("cannot read the engine's CA certificates {}", path.display()))?;
            for certificate in CertificateDer::pem_slice_iter(&pem) {
                let certificate = certificate.with_context(|| format!("{} is not PEM certificates", path.display()))?;
                roots.add(certificate).with_context(|| format!("a certificate in {} is not a CA's", path.display()))?;
            }
            anyhow::ensure!(!roots.is_empty(), "{} holds no certificate", path.display());
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(found.certs);
            if added == 0 {
                // An http:// engine needs none; an https:// one is refused
                // at its handshake, saying its issuer is unknown.
                tracing::debug!(errors = ?found.errors, "no system root certificates: an https:// engine needs --upstream-ca");
            }
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("the TLS provider's protocol versions")?
        .with_root_certificates(roots);
    let mut config = match &settings.identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain: Vec<_> = CertificateDer::pem_file_iter(cert)
                .with_context(|| format!("cannot read the certificate {}", cert.display()))?
                .collect::<Result<_, _>>()
                .with_context(|| format!("{} is not PEM certificates", cert.display()))?;
            let key = PrivateKeyDer::from_pem_file(key).with_context(|| format!("cannot read the private key {}", key.display()))?;
            builder.with_client_auth_cert(chain, key).context("the worker's certificate and key do not match")?
        }
    };
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// Connects to the engine: TCP, and TLS for `https://`.
#[derive(Clone)]
struct Connector {
    http: HttpConnector,
    tls: TlsConnector,
}

impl tower::Service<Uri> for Connector {
    type Response = EngineStream;
    type Error = Box<dyn std::error::Error + Send + Sync>;
    type Future = Pin<Box<dyn Future<Output = Result<EngineStream, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.http.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (mut http, tls) = (self.http.clone(), self.tls.clone());
        Box::pin(async move {
            let secure = uri.scheme_str() == Some("https");
            let host = uri.host().unwrap_or_default().trim_start_matches('[').trim_end_matches(']').to_owned();
            let tcp = http.call(uri).await?;
            if !secure {
                return Ok(EngineStream::Plain(tcp));
            }
            let name = ServerName::try_from(host.clone()).map_err(|_| format!("{host:?} is not a host name a certificate can name"))?;
            let handshake = tls.connect(name, tcp.into_inner());
            let stream = tokio::time::timeout(CONNECT_TIMEOUT, handshake)
                .await
                .map_err(|_| format!("the TLS handshake with {host} took over {CONNECT_TIMEOUT:?}"))??;
            Ok(EngineStream::Tls(Box::new(TokioIo::new(stream))))
        })
    }
}

/// A connection to the engine.
enum EngineStream {
    Plain(TokioIo<TcpStream>),
    Tls(Box<TokioIo<TlsStream<TcpStream>>>),
}

impl Connection for EngineStream {
    fn connected(&self) -> Connected {
        match self {
            Self::Plain(tcp) => tcp.connected(),
            Self::Tls(tls) => {
                let (tcp, session) = tls.inner().get_ref();
                let connected = tcp.connected();
                match session.alpn_protocol() {
                    Some(b"h2") => connected.negotiated_h2(),
                    _ => connected,
                }
            }
        }
    }
}

impl hyper::rt::Read for EngineStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: hyper::rt::ReadBufCursor<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Plain(tcp) => Pin::new(tcp).poll_read(cx, buf),
            Self::Tls(tls) => Pin::new(tls.as_mut()).poll_read(cx, buf),
        }
    }
}

impl hyper::rt::Write for EngineStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(tcp) => Pin::new(tcp).poll_write(cx, buf),
            Self::Tls(tls) => Pin::new(tls.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Plain(tcp) => Pin::new(tcp).poll_flush(cx),
            Self::Tls(tls) => Pin::new(tls.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Self::Plain(tcp) => Pin::new(tcp).poll_shutdown(cx),
            Self::Tls(tls) => Pin::new(tls.as_mut()).poll_shutdown(cx),
        }
    }
}

//! TLS for a service's public ports (the gateway's REST API and gRPC
//! `Inference`): the service presents a server certificate its clients
//! verify (from a public CA, or one the operator's clients trust) and asks
//! them for none; they authenticate with API keys, which then never cross
//! the network in the clear.
//!
//! Distinct from [`crate::trust`], whose certificates name roles inside one
//! deployment and are checked both ways: a public port serves SDKs and
//! `curl`, which hold no service certificate.
//!
//! [`TlsListener`] hands the HTTP server connections whose handshakes are
//! done: each handshake runs in its own task, bounded in time
//! ([`HANDSHAKE_TIMEOUT`]) and in number ([`MAX_HANDSHAKES`]), so a client
//! that opens a connection and sends nothing holds up no other.

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use anyhow::Context;
use prometheus::IntCounterVec;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tonic::transport::{Identity, ServerTlsConfig};

/// Longest a client may take to finish its handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Handshakes in progress at most; a connection beyond them is closed.
pub const MAX_HANDSHAKES: usize = 1024;

static FAILED_HANDSHAKES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    crate::metrics::counter(
        "turbine_public_tls_handshakes_failed_total",
        "Connections to a public TLS port (the gateway's REST API) closed before their handshake finished, by reason: refused (not TLS, or TLS this server does not speak), timeout (not done within 10 s), busy (1,024 handshakes already in progress)",
        &["reason"],
    )
});

/// A server certificate and its key, for public ports.
#[derive(Clone)]
pub struct PublicTls {
    rustls: Arc<rustls::ServerConfig>,
    identity: Identity,
    /// The server's own certificate (DER): what [`PublicTls::pinned_channel`]
    /// accepts.
    leaf: CertificateDer<'static>,
}

impl std::fmt::Debug for PublicTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublicTls").finish_non_exhaustive()
    }
}

impl PublicTls {
    /// The certificate chain in `cert` (PEM, the server's first) and its
    /// key in `key` (PEM). Fails on files that cannot be read or parsed,
    /// or a key that is not the certificate's.
    pub fn from_files(cert: &Path, key: &Path) -> anyhow::Result<Self> {
        let read = |path: &Path| std::fs::read(path).with_context(|| format!("cannot read {}", path.display()));
        let (cert_pem, key_pem) = (read(cert)?, read(key)?);
        Self::from_pem(&cert_pem, &key_pem).with_context(|| format!("the public TLS certificate {} and key {}", cert.display(), key.display()))
    }

    /// As [`from_files`](Self::from_files), from PEM in memory.
    pub fn from_pem(cert_pem: &[u8], key_pem: &[u8]) -> anyhow::Result<Self> {
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(cert_pem).collect::<Result<_, _>>().map_err(|error| anyhow::anyhow!("not PEM certificates: {error}"))?;
        anyhow::ensure!(!chain.is_empty(), "no certificate in it");
        let leaf = chain[0].clone();
        let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|error| anyhow::anyhow!("not a PEM private key: {error}"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .context("the key does not suit the certificate")?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Self { rustls: Arc::new(config), identity: Identity::from_pem(cert_pem, key_pem), leaf })
    }

    /// The gRPC server's TLS: this certificate, no client certificate asked.
    pub fn grpc_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(self.identity.clone()).timeout(HANDSHAKE_TIMEOUT)
    }

    /// A channel to the gRPC server at `endpoint` (`http://127.0.0.1:50050`)
    /// that presents exactly this certificate: for the process's own
    /// checks of its public port (`turbine run` waiting for its gateway),
    /// which needs no CA to trust it. Any other certificate is refused.
    pub fn pinned_channel(&self, endpoint: &str) -> anyhow::Result<crate::grpc::TracedChannel> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let pinned = Arc::new(Pinned { leaf: self.leaf.clone(), algorithms: provider.signature_verification_algorithms });
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .context("TLS protocol versions")?
            .dangerous()
            .with_custom_certificate_verifier(pinned)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"h2".to_vec()];
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let connect = tower::service_fn(move |uri: http::Uri| {
            let connector = connector.clone();
            async move {
                let authority = uri.authority().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, format!("{uri} names no host")))?.clone();
                let stream = TcpStream::connect(authority.as_str()).await?;
                // The name is not checked (the certificate is pinned).
                let name = rustls::pki_types::ServerName::try_from("turbine.invalid").expect("a DNS name");
                let tls = connector.connect(name, stream).await?;
                Ok::<_, io::Error>(hyper_util::rt::TokioIo::new(tls))
            }
        });
        let endpoint = tonic::transport::Endpoint::from_shared(endpoint.to_owned())?;
        let channel = endpoint.connect_timeout(Duration::from_secs(5)).connect_with_connector_lazy(connect);
        Ok(tonic::service::interceptor::InterceptedService::new(channel, crate::propagation::TraceContextInterceptor))
    }

    /// Connections accepted on `listener`, handed out once their TLS
    /// handshake is done; an address `struck_off` gates (its connections
    /// lately closed for their 401s) has those over its rate closed as
    /// accepted, before the handshake.
    pub fn listener(&self, listener: TcpListener, struck_off: Option<Arc<crate::gate::StruckOff>>) -> io::Result<TlsListener> {
        let local_addr = listener.local_addr()?;
        let gate = struck_off;
        let acceptor = TlsAcceptor::from(self.rustls.clone());
        let (done, incoming) = mpsc::channel(64);
        let accepting = tokio::spawn(async move {
            let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
            loop {
                let (stream, peer) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of descriptors, say: wait rather than spin.
                        tracing::warn!(%error, "accepting a connection failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                // An address struck off, over its rate: closed before any TLS work.
                if gate.as_ref().is_some_and(|gate| !gate.admit(peer.ip())) {
                    continue;
                }
                let Ok(permit) = handshakes.clone().try_acquire_owned() else {
                    FAILED_HANDSHAKES.with_label_values(&["busy"]).inc();
                    continue;
                };
                let (acceptor, done) = (acceptor.clone(), done.clone());
                tokio::spawn(async move {
                    let _permit = permit;
                    handshake(acceptor, stream, peer, done).await;
                });
            }
        });
        Ok(TlsListener { incoming, local_addr, accepting })
    }
}

/// Finishes one handshake and hands the connection on.
async fn handshake(acceptor: TlsAcceptor, stream: TcpStream, peer: SocketAddr, done: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>) {
    if let Err(error) = stream.set_nodelay(true) {
        tracing::debug!(%error, "cannot set TCP_NODELAY");
    }
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(tls)) => {
            // The server stopped accepting: the connection is dropped.
            let _ = done.send((tls, peer)).await;
        }
        Ok(Err(error)) => {
            FAILED_HANDSHAKES.with_label_values(&["refused"]).inc();
            tracing::debug!(%peer, %error, "a TLS handshake failed");
        }
        Err(_) => FAILED_HANDSHAKES.with_label_values(&["timeout"]).inc(),
    }
}

/// Accepts one certificate, by its bytes, whatever signed it; signatures
/// in the handshake are still checked against its key.
#[derive(Debug)]
struct Pinned {
    leaf: CertificateDer<'static>,
    algorithms: rustls::crypto::WebPkiSupportedAlgorithms,
}

impl rustls::client::danger::ServerCertVerifier for Pinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &rustls::pki_types::ServerName<'_>,
        _ocsp_response: &[u8],
        _now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        if end_entity.as_ref() == self.leaf.as_ref() {
            Ok(rustls::client::danger::ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::ApplicationVerificationFailure))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        signature: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, signature, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        signature: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, signature, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

/// A listener of TLS connections (for `axum::serve`); dropping it stops
/// accepting.
#[derive(Debug)]
pub struct TlsListener {
    incoming: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local_addr: SocketAddr,
    accepting: tokio::task::JoinHandle<()>,
}

impl Drop for TlsListener {
    fn drop(&mut self) {
        self.accepting.abort();
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.incoming.recv().await {
            Some(connection) => connection,
            // The accepting task ended (it never does but by abort).
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        Ok(self.local_addr)
    }
}

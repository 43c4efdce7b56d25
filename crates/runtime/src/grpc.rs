//! gRPC plumbing shared by every service: one way to serve (tracing layer,
//! handler timeout, per-connection concurrency, health, reflection,
//! keep-alives, graceful drain under a grace period; see [`crate::host`])
//! and one way to connect (lazy channels with trace propagation, one per
//! endpoint per live runtime, see [`channel`]).

use std::collections::HashMap;
use std::sync::{Arc, LazyLock, Weak};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tower_http::trace::TraceLayer;

use crate::host::{Role, RpcRoles};
use crate::propagation::{TraceContextInterceptor, server_span};
use crate::trust::{Authorize, Trust};

/// A channel whose calls carry the caller's trace context.
pub type TracedChannel = InterceptedService<Channel, TraceContextInterceptor>;

/// Health and reflection (v1 and v1alpha, for older grpcurl) for a server
/// whose public packages are described by `descriptor_sets` (encoded
/// `FileDescriptorSet`s with source info, so `describe` shows comments).
pub fn base_routes<H>(health: H, descriptor_sets: &[&'static [u8]]) -> Routes
where
    H: tower::Service<http::Request<tonic::body::Body>, Response = http::Response<tonic::body::Body>, Error = std::convert::Infallible>
        + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static,
    H::Future: Send + 'static,
{
    let mut v1 = tonic_reflection::server::Builder::configure().register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
    let mut v1alpha = tonic_reflection::server::Builder::configure().register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
    for set in descriptor_sets {
        v1 = v1.register_encoded_file_descriptor_set(set);
        v1alpha = v1alpha.register_encoded_file_descriptor_set(set);
    }
    let v1 = v1.build_v1().expect("descriptor sets compiled from proto/ are valid");
    let v1alpha = v1alpha.build_v1alpha().expect("descriptor sets compiled from proto/ are valid");
    Routes::new(health).add_service(v1).add_service(v1alpha)
}

/// How a gRPC server meets its callers.
#[derive(Debug, Clone)]
pub enum ServerSecurity {
    /// Plaintext, every caller may call every rpc (development).
    Plaintext,
    /// TLS only, callers with a certificate from the CA, each call
    /// authorized against the role table ([`crate::trust`]).
    Mutual(Trust),
    /// TLS with a public certificate, no client certificate asked: the
    /// services authenticate callers themselves (the gateway by API key).
    Public(crate::public_tls::PublicTls),
}

/// Which connections a gRPC listener takes: new ones per address at a
/// rate ([`crate::gate`], `None`: any rate), and open ones bounded in all
/// and per client ([`crate::connections`]). Both close a connection as it
/// is accepted, before any TLS work.
#[derive(Debug, Default)]
pub struct Accepting {
    /// New connections per address a second.
    pub gate: Option<crate::gate::ConnectionGate>,
    /// Connections open at once.
    pub limits: crate::connections::ConnectionLimits,
    /// Proxies whose connections carry many clients' calls: never closed
    /// for their refusals ([`crate::strikes`]).
    pub proxies: crate::proxies::TrustedProxies,
}

/// Serves `routes` on `listener` until `shutdown` fires, then stops
/// accepting and lets in-flight calls (streams included) finish for up to
/// `grace`; calls still open after that are dropped. A handler running
/// longer than `handler_timeout` fails its call; a connection runs at most
/// `calls_per_connection` handlers at once.
///
/// How it is secured: see [`ServerSecurity`].
#[allow(clippy::too_many_arguments)]
pub async fn serve(
    listener: TcpListener,
    routes: Routes,
    shutdown: CancellationToken,
    grace: Duration,
    handler_timeout: Duration,
    calls_per_connection: usize,
    security: ServerSecurity,
    roles: &'static [RpcRoles],
    accepting: Accepting,
) -> Result<(), tonic::transport::Error> {
    use tokio_stream::StreamExt;
    let Accepting { gate, limits, proxies } = accepting;
    let open = crate::connections::OpenConnections::new("grpc", limits);
    // A connection from an address over its rate, or over the open
    // limits, is dropped as accepted: closed before any TLS work. Each
    // one admitted holds its place while open, and carries its refusals
    // ([`crate::strikes`]).
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true)).filter_map(move |connection| match connection {
        Ok(stream) => {
            let peer = stream.peer_addr().ok()?.ip();
            if gate.as_ref().is_some_and(|gate| !gate.admit(peer)) {
                return None;
            }
            let slot = open.admit(peer)?;
            Some(Ok(crate::strikes::Struck::new(stream, slot, proxies.trusts(peer))))
        }
        Err(error) => Some(Err(error)),
    });
    let (builder, authorize) = match security {
        ServerSecurity::Mutual(trust) => (Server::builder().tls_config(trust.server_config())?, Authorize::new(roles)),
        ServerSecurity::Public(tls) => (Server::builder().tls_config(tls.grpc_config())?, Authorize::open()),
        ServerSecurity::Plaintext => (Server::builder(), Authorize::open()),
    };
    let server = builder
        .layer(TraceLayer::new_for_grpc().make_span_with(server_span))
        .layer(authorize)
        .timeout(handler_timeout)
        .concurrency_limit_per_connection(calls_per_connection)
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .add_routes(routes)
        .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned());
    crate::shutdown::drain_within(server, &shutdown, grace, "gRPC calls").await
}

/// A cached channel: its last use, and whether the runtime that made it
/// still runs.
///
/// A channel's connection is driven by a task on the runtime that made it;
/// once that runtime is dropped the channel fails every call. A process can
/// run several runtimes, at once or one after another (a test harness runs
/// one per test), so channels are cached per runtime, and an entry whose
/// runtime has stopped is dropped: `alive` upgrades only while a task
/// spawned beside the channel holds its `Arc`. Dropping the entry drops
/// `_release`, which ends that task.
struct Cached {
    channel: TracedChannel,
    used: Instant,
    alive: Weak<()>,
    _release: oneshot::Sender<()>,
}

impl Cached {
    /// Makes a channel to `endpoint` on the current runtime: mutual TLS
    /// as `trust` to a server of role `server`, or plaintext.
    fn new(endpoint: &str, tls: Option<(&Trust, Role)>, now: Instant) -> Result<Self, tonic::transport::Error> {
        let channel = match tls {
            Some((trust, server)) => tls_channel(endpoint, trust, server)?,
            None => traced_channel(endpoint)?,
        };
        let runtime_alive = Arc::new(());
        let alive = Arc::downgrade(&runtime_alive);
        let (release, released) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _runtime_alive = runtime_alive;
            let _ = released.await;
        });
        Ok(Self { channel, used: now, alive, _release: release })
    }

    fn is_usable(&self) -> bool {
        self.alive.strong_count() > 0
    }
}

/// A cached channel's key: the runtime that drives it, the endpoint and,
/// over TLS, the role the server's certificate must name.
type ChannelKey = (tokio::runtime::Id, String, Option<Role>);

/// The process's channels.
static CHANNELS: LazyLock<Mutex<HashMap<ChannelKey, Cached>>> = LazyLock::new(Mutex::default);

/// Endpoints kept at most; beyond it the least recently used is dropped.
const MAX_CHANNELS: usize = 1024;

/// The process's channel to the service of role `server` at `endpoint`
/// (`http://10.0.0.7:50061`, or `host:port`): every client of one
/// endpoint shares one lazily connected HTTP/2 connection, multiplexed,
/// instead of opening its own (one per runtime, where a process runs
/// several). Once the process has an identity
/// ([`TlsConfig::establish`](crate::trust::TlsConfig::establish)) the
/// channel is mutual TLS: this process presents its certificate and
/// accepts only a server certificate from its CA naming `server`;
/// without one, plaintext. Fails only on a malformed endpoint. Must be
/// called on a Tokio runtime: the channel's connection is driven there.
pub fn channel(endpoint: &str, server: Role) -> Result<TracedChannel, tonic::transport::Error> {
    let trust = crate::trust::dialing_as();
    let key = (tokio::runtime::Handle::current().id(), endpoint_uri(endpoint), trust.as_ref().map(|_| server));
    let mut channels = CHANNELS.lock();
    let now = Instant::now();
    if let Some(cached) = channels.get_mut(&key)
        && cached.is_usable()
    {
        cached.used = now;
        return Ok(cached.channel.clone());
    }
    let cached = Cached::new(&key.1, trust.as_ref().map(|trust| (trust, server)), now)?;
    let channel = cached.channel.clone();
    channels.retain(|_, cached| cached.is_usable());
    if channels.len() >= MAX_CHANNELS
        && let Some(oldest) = channels.iter().min_by_key(|(_, cached)| cached.used).map(|(key, _)| key.clone())
    {
        channels.remove(&oldest);
    }
    channels.insert(key, cached);
    Ok(channel)
}

/// A new lazily connecting channel to `endpoint` (e.g.
/// `http://10.0.0.7:50061`) that propagates trace context; most callers
/// want the shared one, [`channel`]. Fails only on a malformed endpoint.
pub fn traced_channel(endpoint: &str) -> Result<TracedChannel, tonic::transport::Error> {
    Ok(InterceptedService::new(endpoint_settings(Endpoint::from_shared(endpoint.to_owned())?).connect_lazy(), TraceContextInterceptor))
}

/// A new lazily connecting channel to the service of role `server` at
/// `endpoint` over mutual TLS: this process presents `trust`'s
/// certificate and accepts only a server certificate from its CA naming
/// `server` (an `http://` endpoint is dialed as `https://`). Fails only on
/// a malformed endpoint.
pub fn tls_channel(endpoint: &str, trust: &Trust, server: Role) -> Result<TracedChannel, tonic::transport::Error> {
    let uri = endpoint_uri(endpoint);
    let uri = match uri.strip_prefix("http://") {
        Some(rest) => format!("https://{rest}"),
        None => uri,
    };
    let endpoint = endpoint_settings(Endpoint::from_shared(uri)?).tls_config(trust.client_config(server))?;
    Ok(InterceptedService::new(endpoint.connect_lazy(), TraceContextInterceptor))
}

/// The connection settings of every channel.
fn endpoint_settings(endpoint: Endpoint) -> Endpoint {
    endpoint
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(2))
        .http2_keep_alive_interval(Duration::from_secs(20))
        .keep_alive_timeout(Duration::from_secs(10))
        .keep_alive_while_idle(true)
}

/// Normalizes an address to a gRPC endpoint URI (`host:port` gets `http://`).
pub fn endpoint_uri(address: &str) -> String {
    if address.contains("://") { address.to_owned() } else { format!("http://{address}") }
}

//! The service host: how every Turbine service is served.
//!
//! A service is `serve(config, deps, listeners, shutdown)`: its caller binds
//! the listeners (the configured addresses in a process, port 0 in tests and
//! in the embedded cluster) and owns the shutdown token. Inside, the service
//! builds its state and hands the host its gRPC services; the host does the
//! rest the same way for all of them:
//!
//! - gRPC health (NOT_SERVING until the service says its dependencies
//!   answer) and reflection for the service's packages;
//! - message-size limits on every service ([`MessageLimits`]);
//! - one tower stack: a span per call (trace context from the caller), a
//!   timeout on each handler, a bound on concurrent calls per connection,
//!   HTTP/2 keep-alives;
//! - the admin HTTP server (`/metrics`, `/livez`, `/readyz`), and an extra
//!   HTTP server when the service has one (the gateway's REST API);
//! - the bound addresses: logged, returned, and written to
//!   `--addresses-file` for supervisors;
//! - the drain: on shutdown NOT_SERVING, the service's own last words
//!   (a worker deregisters), serving on as before for the drain delay
//!   (`--drain-delay-secs`, while the balancers in front see it leave; a
//!   second signal ends it; none for a process never SERVING), then stop accepting (the listeners closed,
//!   so a new connection is refused, not left waiting), in-flight calls
//!   and streams finish within the grace period, then the service's
//!   background tasks (which watch the same token) are awaited.
//!
//! ```text
//! let mut host = Host::new(spec, &config.server, listeners).await;
//! host.add_service(RouterServer::new(service));
//! let mut serving = host.start(shutdown.clone())?;
//! serving.spawn(watch_registry(..));
//! serving.ready_when(Duration::from_secs(1), probe).await;
//! serving.until_shutdown(async {}).await
//! ```

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::service::Routes;
use turbine_proto::MessageLimits;

use crate::config::{ServerConfig, ServiceDefaults};
use crate::grpc::ServerSecurity;
use crate::health::Readiness;
use crate::public_tls::PublicTls;
use crate::trust::Trust;

/// What a service tells the host about itself.
#[derive(Debug, Clone, Copy)]
pub struct HostSpec {
    /// Short name, for logs (`router`).
    pub name: &'static str,
    /// Fully qualified gRPC services reported by health checks.
    pub health: &'static [&'static str],
    /// Encoded descriptor sets of the packages it serves (reflection).
    pub descriptors: &'static [&'static [u8]],
    /// Longest a call's handler may run before the call fails with
    /// CANCELLED (a streaming call's handler ends when its stream starts).
    pub handler_timeout: Duration,
    /// Who may call each rpc, for the authorization layer the host will
    /// apply once callers have a transport identity (mTLS); empty: not
    /// declared yet (every caller).
    pub roles: &'static [RpcRoles],
}

/// A kind of caller, as its certificate will name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// A worker (offloads and onboards KV, publishes events).
    Worker,
    /// A router.
    Router,
    /// A gateway.
    Gateway,
    /// The kv-index service (follows the KV event log, asks for dumps).
    Index,
    /// The kv-store service.
    KvStore,
    /// The planner.
    Planner,
    /// A person or tool operating the cluster (grpcurl, `turbine` admin
    /// commands).
    Operator,
    /// Metrics and health scrapers.
    Monitoring,
}

/// One rpc's callers: its path (`/package.Service/Method`) and the roles
/// allowed to call it.
#[derive(Debug, Clone, Copy)]
pub struct RpcRoles {
    /// `/package.Service/Method`.
    pub method: &'static str,
    /// Roles allowed.
    pub roles: &'static [Role],
}

impl HostSpec {
    /// Checks the role table against the rpcs of the gRPC services
    /// `served` (fully qualified names, as the descriptor sets declare
    /// them): a declared table names every rpc once, each with a role, and
    /// no rpc the host does not serve (an rpc without a row would be
    /// refused to every caller). An empty table (not declared yet) passes.
    pub fn check_roles(&self, served: &[&str]) -> Result<(), RoleTableError> {
        use prost::Message;
        if self.roles.is_empty() {
            return Ok(());
        }
        let service = self.name;
        let mut methods = Vec::new();
        for set in self.descriptors {
            let set = prost_types::FileDescriptorSet::decode(*set).map_err(|error| RoleTableError::Descriptor { service, problem: error.to_string() })?;
            for file in &set.file {
                for served_service in file.service.iter().filter(|candidate| served.contains(&format!("{}.{}", file.package(), candidate.name()).as_str())) {
                    methods.extend(served_service.method.iter().map(|method| format!("/{}.{}/{}", file.package(), served_service.name(), method.name())));
                }
            }
        }
        for method in &methods {
            match self.roles.iter().filter(|row| row.method == method).count() {
                1 => {}
                0 => return Err(RoleTableError::NoRow { service, method: method.clone() }),
                _ => return Err(RoleTableError::ManyRows { service, method: method.clone() }),
            }
        }
        for row in self.roles {
            if !methods.iter().any(|method| method == row.method) {
                return Err(RoleTableError::NotServed { service, method: row.method });
            }
            if row.roles.is_empty() {
                return Err(RoleTableError::NoRole { service, method: row.method });
            }
        }
        Ok(())
    }
}

/// Why a service's role table does not fit the rpcs it serves.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RoleTableError {
    /// One of its descriptor sets does not decode.
    #[error("{service}: a descriptor set does not decode: {problem}")]
    Descriptor {
        /// The service.
        service: &'static str,
        /// The decoder's words.
        problem: String,
    },
    /// An rpc it serves has no row (every caller would be refused).
    #[error("{service}: {method} has no row in the role table")]
    NoRow {
        /// The service.
        service: &'static str,
        /// The rpc.
        method: String,
    },
    /// An rpc has more than one row.
    #[error("{service}: {method} has more than one row in the role table")]
    ManyRows {
        /// The service.
        service: &'static str,
        /// The rpc.
        method: String,
    },
    /// A row names an rpc the service does not serve.
    #[error("{service}: the role table names {method}, which the service does not serve")]
    NotServed {
        /// The service.
        service: &'static str,
        /// The rpc.
        method: &'static str,
    },
    /// A row names no role (no caller could call the rpc).
    #[error("{service}: {method} names no role (no caller could call it)")]
    NoRole {
        /// The service.
        service: &'static str,
        /// The rpc.
        method: &'static str,
    },
}

/// Concurrent calls per client connection at most; more wait their turn.
const CALLS_PER_CONNECTION: usize = 1024;

/// The listeners of a service, bound by the caller.
#[derive(Debug)]
pub struct Listeners {
    /// gRPC.
    pub grpc: TcpListener,
    /// Admin HTTP, when served on its own port.
    pub admin: Option<TcpListener>,
    /// A service's own HTTP API (the gateway's REST port).
    pub http: Option<TcpListener>,
}

impl Listeners {
    /// Binds the configured gRPC and admin addresses.
    pub async fn bind<S: ServiceDefaults>(server: &ServerConfig<S>) -> anyhow::Result<Self> {
        let grpc = bind(server.grpc_addr, "gRPC").await?;
        let admin = match server.admin_addr {
            Some(addr) => Some(bind(addr, "admin").await?),
            None => None,
        };
        Ok(Self { grpc, admin, http: None })
    }

    /// gRPC and admin on free loopback ports (the embedded cluster, tests).
    pub async fn loopback() -> anyhow::Result<Self> {
        let any = SocketAddr::from(([127, 0, 0, 1], 0));
        Ok(Self { grpc: bind(any, "gRPC").await?, admin: Some(bind(any, "admin").await?), http: None })
    }

    /// Adds the service's own HTTP listener.
    pub fn with_http(mut self, http: TcpListener) -> Self {
        self.http = Some(http);
        self
    }
}

/// Binds `addr`, naming what it is for in the error.
pub async fn bind(addr: SocketAddr, what: &str) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr).await.with_context(|| format!("cannot bind the {what} listener on {addr}"))
}

/// Where a service listens, as bound (port 0 resolved).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct BoundAddrs {
    /// gRPC.
    pub grpc: SocketAddr,
    /// Admin HTTP (on the HTTP port when the service has no admin port).
    pub admin: Option<SocketAddr>,
    /// The service's own HTTP API.
    pub http: Option<SocketAddr>,
}

impl BoundAddrs {
    /// The gRPC endpoint, as clients dial it (`http://127.0.0.1:50051`).
    pub fn grpc_endpoint(&self) -> String {
        format!("http://{}", self.grpc)
    }

    /// The admin base URL (`http://127.0.0.1:9092`), if any.
    pub fn admin_url(&self) -> Option<String> {
        self.admin.or(self.http).map(|addr| format!("http://{addr}"))
    }
}

/// A service being assembled.
pub struct Host {
    spec: HostSpec,
    readiness: Readiness,
    routes: Routes,
    listeners: Listeners,
    http_router: Option<axum::Router>,
    /// Whether the admin routes are merged into the HTTP API.
    admin_on_http: bool,
    grace: Duration,
    /// How long it serves on after shutdown, NOT_SERVING.
    drain_delay: Duration,
    addresses_file: Option<PathBuf>,
    addresses: BoundAddrs,
    trust: Option<Trust>,
    /// A public certificate for the gRPC and HTTP listeners instead
    /// ([`Host::set_public_tls`]).
    public_tls: Option<PublicTls>,
    /// Whether plaintext beyond loopback was asked for (`--insecure`).
    insecure: bool,
    /// The gRPC services mounted (fully qualified names).
    served: Vec<&'static str>,
    /// New gRPC connections one address may open a second (0: any).
    connection_rate_per_ip: u32,
    /// How many connections each listener keeps open.
    connections: crate::connections::ConnectionLimits,
    /// How long an HTTP connection may take over headers, or stay idle.
    http_idle_timeout: Duration,
    /// Proxies carrying many clients' calls on one connection.
    proxies: crate::proxies::TrustedProxies,
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host").field("name", &self.spec.name).field("addresses", &self.addresses).finish_non_exhaustive()
    }
}

/// A plaintext gRPC listener other hosts reach: refused unless `insecure`
/// (an operator's explicit choice), then logged once per process.
fn refuse_plaintext(service: &str, address: SocketAddr, insecure: bool) -> anyhow::Result<()> {
    static WARNED: std::sync::Once = std::sync::Once::new();
    anyhow::ensure!(
        insecure,
        "{service}: refusing to serve gRPC in plaintext on {address}, where any host that reaches it may call every rpc: give \
         --tls-cert, --tls-key and --tls-ca (turbine certs makes them), listen on loopback (--grpc-addr 127.0.0.1:PORT), or pass \
         --insecure (TURBINE_INSECURE=true) on a network you trust entirely"
    );
    WARNED.call_once(|| tracing::warn!(%address, "--insecure: gRPC in plaintext on a non-loopback address; any caller that reaches it may call every rpc"));
    Ok(())
}

impl Host {
    /// A host for `spec` on `listeners`, NOT_SERVING, with health and
    /// reflection mounted; over mutual TLS when `server` names the
    /// process's certificate ([`crate::trust`]). Fails on TLS files that
    /// cannot be read or a certificate that names no role; [`start`]
    /// fails on plaintext on a gRPC address other hosts reach without
    /// `--insecure`.
    ///
    /// [`start`]: Self::start
    pub async fn new<S: ServiceDefaults>(spec: HostSpec, server: &ServerConfig<S>, listeners: Listeners) -> anyhow::Result<Self> {
        let trust = server.tls.establish()?;
        let (readiness, health) = Readiness::new(spec.health).await;
        let routes = crate::grpc::base_routes(health, spec.descriptors);
        let addresses = BoundAddrs {
            grpc: listeners.grpc.local_addr()?,
            admin: listeners.admin.as_ref().map(TcpListener::local_addr).transpose()?,
            http: listeners.http.as_ref().map(TcpListener::local_addr).transpose()?,
        };
        Ok(Self {
            spec,
            readiness,
            routes,
            listeners,
            http_router: None,
            admin_on_http: true,
            grace: server.grace(),
            drain_delay: server.drain_delay(),
            addresses_file: server.addresses_file.clone(),
            addresses,
            trust,
            public_tls: None,
            insecure: server.insecure,
            served: Vec::new(),
            connection_rate_per_ip: server.clients.connection_rate_per_ip,
            connections: server.clients.connection_limits().within_descriptors(),
            http_idle_timeout: server.clients.http_limits().idle_timeout,
            proxies: server.clients.trusted_proxies(),
        })
    }

    /// Serves the gRPC and HTTP listeners over TLS with `tls`, a public
    /// certificate, asking callers for none: for a service whose callers
    /// authenticate otherwise (the gateway's, by API key). Its gRPC is then
    /// not authorized by role (the role table must be empty).
    pub fn set_public_tls(&mut self, tls: PublicTls) -> anyhow::Result<()> {
        anyhow::ensure!(self.spec.roles.is_empty(), "{}: a public port cannot authorize by role", self.spec.name);
        self.public_tls = Some(tls);
        Ok(())
    }

    /// The switch behind health and `/readyz`.
    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    /// Where the service listens.
    pub fn addresses(&self) -> BoundAddrs {
        self.addresses
    }

    /// Mounts a gRPC service, its message sizes bounded.
    pub fn add_service<T>(&mut self, service: T)
    where
        T: MessageLimits
            + tower::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        T::Future: Send + 'static,
    {
        self.served.push(T::NAME);
        let routes = std::mem::take(&mut self.routes);
        self.routes = routes.add_service(service.with_message_limits());
    }

    /// Serves `router` on the HTTP listener, with the admin routes merged in.
    pub fn set_http(&mut self, router: axum::Router) {
        self.http_router = Some(router);
    }

    /// Serves `router` on the HTTP listener alone: the admin routes
    /// (`/metrics`, `/livez`, `/readyz`) only on the admin listener, which
    /// the service must have (an API whose callers must not read them).
    pub fn set_http_without_admin(&mut self, router: axum::Router) -> anyhow::Result<()> {
        anyhow::ensure!(self.listeners.admin.is_some(), "{}: the admin routes need a port of their own (--admin-addr)", self.spec.name);
        self.http_router = Some(router);
        self.admin_on_http = false;
        Ok(())
    }

    /// Starts serving (still NOT_SERVING); writes the addresses file.
    /// Fails on a role table that does not fit the services mounted
    /// ([`HostSpec::check_roles`]).
    pub fn start(self, shutdown: CancellationToken) -> anyhow::Result<Serving> {
        let Host {
            spec,
            readiness,
            routes,
            listeners,
            http_router,
            admin_on_http,
            grace,
            drain_delay,
            addresses_file,
            addresses,
            trust,
            public_tls,
            insecure,
            served,
            connection_rate_per_ip,
            connections,
            http_idle_timeout,
            proxies,
        } = self;
        // The admin port answers no 401s: none of its clients is struck off.
        let http_limits = crate::http_server::HttpLimits {
            idle_timeout: http_idle_timeout,
            connections,
            struck_off: None,
            gated_by_listener: false,
            proxies: proxies.clone(),
        };
        spec.check_roles(&served)?;
        let security = match (&public_tls, trust) {
            (Some(public), _) => {
                tracing::info!(service = spec.name, "gRPC and HTTP over TLS with the public certificate, callers authenticated by the service");
                ServerSecurity::Public(public.clone())
            }
            (None, Some(trust)) => {
                tracing::info!(service = spec.name, peer = %trust.peer(), "gRPC over mutual TLS, each rpc authorized by the caller's role");
                ServerSecurity::Mutual(trust)
            }
            (None, None) => {
                if !addresses.grpc.ip().is_loopback() {
                    refuse_plaintext(spec.name, addresses.grpc, insecure)?;
                }
                tracing::warn!(
                    service = spec.name,
                    "gRPC in plaintext, every caller may call every rpc (development mode: set --tls-cert, --tls-key and --tls-ca)"
                );
                ServerSecurity::Plaintext
            }
        };
        // The listeners stop at `stop`: the shutdown token, or the end of
        // the drain delay after it ([`Serving::until_shutdown`]).
        let stop = CancellationToken::new();
        let accepting = crate::grpc::Accepting { gate: crate::gate::ConnectionGate::new(connection_rate_per_ip), limits: connections, proxies };
        let serve =
            crate::grpc::serve(listeners.grpc, routes, stop.clone(), grace, spec.handler_timeout, CALLS_PER_CONNECTION, security, spec.roles, accepting);
        let grpc = tokio::spawn(serve);
        let admin_stop = CancellationToken::new();
        let admin = listeners.admin.map(|listener| tokio::spawn(crate::admin::serve(listener, readiness.clone(), http_limits.clone(), admin_stop.clone())));
        let http = match (listeners.http, http_router) {
            (Some(listener), Some(router)) => {
                let router = if admin_on_http { router.merge(crate::admin::router(readiness.clone())) } else { router };
                let struck_off = crate::gate::StruckOff::new(connection_rate_per_ip, "api");
                let limits = crate::http_server::HttpLimits { struck_off: struck_off.clone(), ..http_limits };
                Some(match &public_tls {
                    Some(public) => {
                        // Its listener gates new connections before their handshakes.
                        let listener = public.listener(listener, struck_off)?;
                        let limits = crate::http_server::HttpLimits { gated_by_listener: true, ..limits };
                        tokio::spawn(crate::admin::serve_tls_with_grace(listener, router, limits, stop.clone(), grace))
                    }
                    None => tokio::spawn(crate::admin::serve_with_grace(listener, router, limits, stop.clone(), grace)),
                })
            }
            (Some(_), None) => anyhow::bail!("{}: an HTTP listener without an HTTP API", spec.name),
            (None, _) => None,
        };
        if let Some(path) = &addresses_file {
            write_addresses(path, &addresses).with_context(|| format!("cannot write the addresses file {}", path.display()))?;
        }
        tracing::info!(service = spec.name, grpc = %addresses.grpc, admin = ?addresses.admin, http = ?addresses.http, "serving");
        Ok(Serving { name: spec.name, readiness, shutdown, stop, drain_delay, grpc, http, admin, admin_stop, tasks: Vec::new(), addresses })
    }
}

/// Writes `addresses` to `path` atomically (a reader never sees half).
fn write_addresses(path: &std::path::Path, addresses: &BoundAddrs) -> std::io::Result<()> {
    let partial = path.with_extension("partial");
    std::fs::write(&partial, serde_json::to_vec(addresses).expect("addresses serialize"))?;
    std::fs::rename(partial, path)
}

/// A service that serves.
pub struct Serving {
    name: &'static str,
    readiness: Readiness,
    shutdown: CancellationToken,
    /// Stops the gRPC and HTTP listeners.
    stop: CancellationToken,
    drain_delay: Duration,
    grpc: JoinHandle<Result<(), tonic::transport::Error>>,
    http: Option<JoinHandle<std::io::Result<()>>>,
    admin: Option<JoinHandle<std::io::Result<()>>>,
    admin_stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    addresses: BoundAddrs,
}

impl std::fmt::Debug for Serving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Serving").field("name", &self.name).field("addresses", &self.addresses).finish_non_exhaustive()
    }
}

impl Serving {
    /// The switch behind health and `/readyz`.
    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    /// Where the service listens.
    pub fn addresses(&self) -> BoundAddrs {
        self.addresses
    }

    /// A background task of the service: it ends when the shutdown token
    /// fires, and is awaited after the drain.
    pub fn spawn(&mut self, task: JoinHandle<()>) {
        self.tasks.push(task);
    }

    /// Turns SERVING once `probe` answers true and follows it every
    /// `interval` (see [`Readiness::watch_dependencies`]).
    pub async fn ready_when<P, F>(&mut self, interval: Duration, probe: P)
    where
        P: Fn() -> F + Send + 'static,
        F: Future<Output = bool> + Send,
    {
        let task = self.readiness.watch_dependencies(interval, self.shutdown.clone(), probe).await;
        self.tasks.push(task);
    }

    /// Serves until the shutdown token fires, then drains: NOT_SERVING,
    /// `before_drain` (e.g. leaving the registry), everything served as
    /// before for the drain delay (cut short by a second signal,
    /// [`crate::shutdown::second_signal`]; skipped by a process never
    /// SERVING, which no balancer sent traffic: one stopped while loading
    /// its model, say), then no new connection or
    /// request is taken and in-flight calls finish within the grace
    /// period; background tasks end.
    pub async fn until_shutdown(self, before_drain: impl Future<Output = ()>) -> anyhow::Result<()> {
        let Serving { name, readiness, shutdown, stop, drain_delay, grpc, http, admin, admin_stop, tasks, addresses: _ } = self;
        shutdown.cancelled().await;
        readiness.drain().await;
        before_drain.await;
        if !drain_delay.is_zero() && !readiness.has_served() {
            // Never SERVING, so in no balancer's rotation: nobody to wait for.
            tracing::info!(service = name, "never SERVING: stopping without the drain delay");
        } else if !drain_delay.is_zero() {
            tracing::info!(service = name, delay_secs = drain_delay.as_secs_f64(), "NOT_SERVING: serving on for the drain delay");
            tokio::select! {
                () = tokio::time::sleep(drain_delay) => {}
                () = crate::shutdown::second_signal().cancelled() => {}
            }
        }
        stop.cancel();
        let grpc = grpc.await.context("the gRPC server panicked")?;
        let http = match http {
            Some(http) => http.await.context("the HTTP server panicked")?,
            None => Ok(()),
        };
        for task in tasks {
            let _ = task.await;
        }
        admin_stop.cancel();
        if let Some(admin) = admin {
            let _ = admin.await;
        }
        grpc.context("the gRPC server failed")?;
        http.context("the HTTP server failed")?;
        tracing::info!(service = name, "stopped");
        Ok(())
    }
}

/// A service started in the background (the embedded cluster runs every
/// service this way): what it hands callers in this process, and its end.
#[derive(Debug)]
pub struct Running<T> {
    /// The service's in-process handle (its router, its index...).
    pub local: T,
    task: JoinHandle<anyhow::Result<()>>,
}

impl<T> Running<T> {
    /// Runs `serving` (the drain included) in the background.
    pub fn spawn(local: T, serving: impl Future<Output = anyhow::Result<()>> + Send + 'static) -> Self {
        Self { local, task: tokio::spawn(serving) }
    }

    /// Resolves when the service has drained after its shutdown token
    /// fired, with how it ended.
    pub async fn finished(self) -> anyhow::Result<()> {
        self.task.await.context("the service panicked")?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(roles: &'static [RpcRoles]) -> HostSpec {
        HostSpec { name: "health", health: &[], descriptors: &[tonic_health::pb::FILE_DESCRIPTOR_SET], handler_timeout: Duration::from_secs(1), roles }
    }

    #[test]
    fn a_declared_role_table_names_every_rpc_once_and_nothing_else() {
        const CHECK: RpcRoles = RpcRoles { method: "/grpc.health.v1.Health/Check", roles: &[Role::Monitoring] };
        const WATCH: RpcRoles = RpcRoles { method: "/grpc.health.v1.Health/Watch", roles: &[Role::Monitoring, Role::Operator] };
        const HEALTH: &[&str] = &["grpc.health.v1.Health"];
        assert_eq!(spec(&[]).check_roles(HEALTH), Ok(()), "not declared yet");
        assert_eq!(spec(&[CHECK, WATCH]).check_roles(HEALTH), Ok(()));
        let watch = "/grpc.health.v1.Health/Watch";
        assert_eq!(spec(&[CHECK]).check_roles(HEALTH), Err(RoleTableError::NoRow { service: "health", method: watch.into() }));
        assert_eq!(spec(&[CHECK]).check_roles(HEALTH).unwrap_err().to_string(), "health: /grpc.health.v1.Health/Watch has no row in the role table");
        assert!(matches!(spec(&[CHECK, WATCH, CHECK]).check_roles(HEALTH), Err(RoleTableError::ManyRows { .. })));
        const UNKNOWN: RpcRoles = RpcRoles { method: "/grpc.health.v1.Health/Poke", roles: &[Role::Operator] };
        assert!(matches!(spec(&[CHECK, WATCH, UNKNOWN]).check_roles(HEALTH), Err(RoleTableError::NotServed { .. })));
        const NOBODY: RpcRoles = RpcRoles { method: "/grpc.health.v1.Health/Watch", roles: &[] };
        assert!(matches!(spec(&[CHECK, NOBODY]).check_roles(HEALTH), Err(RoleTableError::NoRole { .. })));
        // A service in the descriptors but not served: its rpcs need no row,
        // and a row for one is refused.
        assert!(matches!(spec(&[CHECK, WATCH]).check_roles(&[]), Err(RoleTableError::NotServed { .. })));
    }
}

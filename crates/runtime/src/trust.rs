//! Who a caller is (DESIGN §8): services talk over mutual TLS, each
//! certificate names its holder's role, and each rpc is authorized
//! against the role table its service declares ([`crate::host::HostSpec`]).
//!
//! A Turbine certificate is signed by the deployment's CA and carries one
//! DNS subject alternative name `<role>.turbine` (`router.turbine`,
//! `operator.turbine`; the roles are [`Role`]'s names) and its holder's
//! name as the subject's common name (`router-0`). Both ends check it:
//!
//! - a server accepts only callers with a certificate from the CA (no
//!   certificate, another CA's, an expired one: the handshake fails) and
//!   lets each call through only when the caller's role is in the rpc's
//!   row ([`Authorize`]: PERMISSION_DENIED naming the role and the rpc
//!   otherwise); the caller's [`Peer`] rides in the request's extensions
//!   for handlers that check identities, not only roles;
//! - a client verifies the server's certificate for the role it means to
//!   reach: a gateway dialing a router accepts only `router.turbine`, so
//!   a worker's certificate cannot pose as a router.
//!
//! Without the TLS settings a service serves plaintext: a development
//! mode, logged at start, in which every caller may call every rpc.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::Context as _;
use serde::{Deserialize, Serialize};
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::host::{Role, RpcRoles};
use crate::signed::{Signer, Verifier};

/// The suffix of a role's DNS name (`router.turbine`).
pub const ROLE_DOMAIN: &str = "turbine";

/// The start of a URI name in a worker's certificate that limits the KV
/// tenants whose blocks it may write and read in the kv-store: the rest is
/// the tenant's 16 hex digits (`turbine certs --worker-tenant`).
pub const KV_TENANT_URI: &str = "turbine:kv-tenant:";

/// The URI name that allows a worker the KV tenant whose wire value is
/// `tenant` ([`KV_TENANT_URI`]).
pub fn kv_tenant_uri(tenant: u64) -> String {
    format!("{KV_TENANT_URI}{tenant:016x}")
}

/// Longest a TLS handshake may take before the connection is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

impl Role {
    /// Every role.
    pub const ALL: [Role; 8] = [Role::Worker, Role::Router, Role::Gateway, Role::Index, Role::KvStore, Role::Planner, Role::Operator, Role::Monitoring];

    /// The role's name, as certificates and role tables write it.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Worker => "worker",
            Role::Router => "router",
            Role::Gateway => "gateway",
            Role::Index => "kv-index",
            Role::KvStore => "kv-store",
            Role::Planner => "planner",
            Role::Operator => "operator",
            Role::Monitoring => "monitoring",
        }
    }

    /// The DNS name a certificate of this role carries (`router.turbine`).
    pub fn dns_name(self) -> String {
        format!("{}.{ROLE_DOMAIN}", self.as_str())
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for Role {
    type Err = NoSuchRole;

    fn from_str(name: &str) -> Result<Self, NoSuchRole> {
        Role::ALL.into_iter().find(|role| role.as_str() == name).ok_or_else(|| NoSuchRole(name.to_owned()))
    }
}

/// A role name Turbine does not know.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown role {0:?} (one of {known})", known = Role::ALL.map(Role::as_str).join(", "))]
pub struct NoSuchRole(pub String);

/// Why a certificate names no peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CertificateError {
    /// It is not an X.509 certificate.
    #[error("the certificate does not parse: {0}")]
    Unparsable(String),
    /// Its subject alternative names do not parse.
    #[error("the certificate's alternative names do not parse: {0}")]
    BadNames(String),
    /// A `<role>.turbine` name whose role Turbine does not know.
    #[error("the certificate's DNS name {name}: {role}")]
    UnknownRole {
        /// The DNS name.
        name: String,
        /// The role it names.
        role: NoSuchRole,
    },
    /// No `<role>.turbine` name.
    #[error("the certificate names no role (a DNS name <role>.{})", ROLE_DOMAIN)]
    NoRole,
    /// More than one.
    #[error("the certificate names {0} roles; a certificate holds one")]
    ManyRoles(usize),
}

/// The holder of a certificate, as its certificate names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Peer {
    /// Its role.
    pub role: Role,
    /// Its name (the subject's common name; empty when it has none).
    pub name: String,
    /// The KV tenants (wire values) its certificate limits it to, by
    /// [`KV_TENANT_URI`] names; None: it names none, so any tenant.
    pub kv_tenants: Option<Arc<[u64]>>,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:?}", self.role, self.name)
    }
}

/// The end of a worker pool's name in its certificate: `NAME-*` may be
/// any worker whose id is `NAME-` and more.
pub const POOL_SUFFIX: &str = "-*";

impl Peer {
    /// Whether this peer is the worker `id`: a worker's certificate naming
    /// that id, or a worker pool's naming `NAME-*` (`turbine certs
    /// --worker-pool NAME`) where `id` is `NAME-` and more (the pods of a
    /// pool share one certificate; each still writes only under ids of its
    /// pool).
    pub fn is_worker(&self, id: &str) -> bool {
        if self.role != Role::Worker || id.is_empty() {
            return false;
        }
        match self.name.strip_suffix('*') {
            Some(prefix) if self.name.ends_with(POOL_SUFFIX) => id.len() > prefix.len() && id.starts_with(prefix) && !id.contains('*'),
            _ => self.name == id,
        }
    }

    /// The holder of the DER certificate `der`: its one `<role>.turbine`
    /// DNS name and its common name. Fails on a certificate that does not
    /// parse, names no role, or names more than one.
    pub fn of_certificate(der: &[u8]) -> Result<Peer, CertificateError> {
        let (_, certificate) = x509_parser::parse_x509_certificate(der).map_err(|error| CertificateError::Unparsable(error.to_string()))?;
        let names = certificate.subject_alternative_name().map_err(|error| CertificateError::BadNames(error.to_string()))?;
        let suffix = format!(".{ROLE_DOMAIN}");
        let (mut roles, mut kv_tenants) = (Vec::new(), Vec::new());
        for name in names.iter().flat_map(|names| names.value.general_names.iter()) {
            match name {
                x509_parser::extensions::GeneralName::DNSName(dns) => {
                    if let Some(role) = dns.strip_suffix(&suffix) {
                        roles.push(role.parse::<Role>().map_err(|role| CertificateError::UnknownRole { name: (*dns).to_owned(), role })?);
                    }
                }
                x509_parser::extensions::GeneralName::URI(uri) => {
                    if let Some(hex) = uri.strip_prefix(KV_TENANT_URI) {
                        let tenant = u64::from_str_radix(hex, 16).ok().filter(|_| hex.len() == 16);
                        kv_tenants.push(tenant.ok_or_else(|| CertificateError::BadNames(format!("{uri:?}: a KV tenant is 16 hex digits")))?);
                    }
                }
                _ => {}
            }
        }
        let role = match roles.as_slice() {
            [role] => *role,
            [] => return Err(CertificateError::NoRole),
            _ => return Err(CertificateError::ManyRoles(roles.len())),
        };
        let name = certificate.subject().iter_common_name().next().and_then(|cn| cn.as_str().ok()).unwrap_or_default().to_owned();
        let kv_tenants = (!kv_tenants.is_empty()).then(|| kv_tenants.into());
        Ok(Peer { role, name, kv_tenants })
    }
}

/// Where a service's certificate, key and CA are: all three or none
/// (plaintext, for development).
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args, Serialize, Deserialize)]
pub struct TlsConfig {
    /// PEM certificate this process presents to its callers and to the
    /// services it calls (signed by --tls-ca, naming the process's role as
    /// the DNS name `<role>.turbine`; `turbine certs` writes them). Without
    /// the three --tls-* settings the service serves plaintext and lets
    /// every caller call every rpc: for development only.
    #[arg(long, env = "TURBINE_TLS_CERT", value_name = "FILE", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "TURBINE_TLS_KEY", value_name = "FILE", requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<PathBuf>,
    /// PEM certificate of the deployment's CA: callers and servers must
    /// present a certificate it signed.
    #[arg(long, env = "TURBINE_TLS_CA", value_name = "FILE", requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
}

impl TlsConfig {
    /// Checks that the three settings come together.
    pub fn validate(&self) -> Result<(), crate::config::InvalidSetting> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (None, None, None) | (Some(_), Some(_), Some(_)) => Ok(()),
            _ => Err(crate::config::InvalidSetting::new("tls_cert, tls_key, tls_ca", "go together: set all three, or none for plaintext")),
        }
    }

    /// The process's credentials, or `None` for plaintext, loaded once
    /// per process: the first call with certificates makes them the
    /// identity every client of this process dials with ([`dialing_as`],
    /// [`crate::grpc::channel`]); a later call naming the same files
    /// returns them, one naming others is refused (a process has one
    /// identity: a certificate may name several roles for a process that
    /// hosts several services). Fails on an unreadable file or a
    /// certificate that names no role.
    pub fn establish(&self) -> anyhow::Result<Option<Trust>> {
        self.validate()?;
        if self.tls_cert.is_none() {
            return Ok(None);
        }
        let mut process = PROCESS_IDENTITY.lock();
        if let Some((config, trust)) = &*process {
            anyhow::ensure!(
                config == self,
                "this process already has the identity {} ({}): a process dials with one certificate",
                trust.peer(),
                config.tls_cert.as_deref().unwrap_or(Path::new("")).display()
            );
            return Ok(Some(trust.clone()));
        }
        let trust = self.load()?.expect("certificates given");
        *process = Some((self.clone(), trust.clone()));
        Ok(Some(trust))
    }

    /// The credentials these settings name, or `None` for plaintext,
    /// without making them the process's ([`establish`](Self::establish)
    /// does). Fails on an unreadable file or a certificate that names no
    /// role.
    pub fn load(&self) -> anyhow::Result<Option<Trust>> {
        self.validate()?;
        let (Some(cert), Some(key), Some(ca)) = (&self.tls_cert, &self.tls_key, &self.tls_ca) else { return Ok(None) };
        let read = |path: &Path, what: &str| std::fs::read(path).with_context(|| format!("cannot read the TLS {what} {}", path.display()));
        Trust::from_pem(&read(cert, "certificate")?, &read(key, "key")?, &read(ca, "CA certificate")?)
            .with_context(|| format!("the TLS certificate {}", cert.display()))
            .map(Some)
    }
}

/// The identity this process dials with, and the settings it came from.
static PROCESS_IDENTITY: parking_lot::Mutex<Option<(TlsConfig, Trust)>> = parking_lot::Mutex::new(None);

/// The identity this process's clients dial with: `None` until
/// [`TlsConfig::establish`] loaded certificates (clients dial plaintext).
pub fn dialing_as() -> Option<Trust> {
    PROCESS_IDENTITY.lock().as_ref().map(|(_, trust)| trust.clone())
}

/// A process's credentials: its certificate and key, and the CA it trusts.
#[derive(Clone)]
pub struct Trust {
    inner: Arc<TrustInner>,
}

struct TrustInner {
    identity: Identity,
    ca: Certificate,
    own: Peer,
    signer: Signer,
    verifier: Verifier,
    /// The PEM texts, for clients that take them (Redis over TLS).
    pem: PemFiles,
}

/// A process's certificate, key and CA as PEM text.
#[derive(Clone)]
pub struct PemFiles {
    /// The certificate.
    pub cert: Vec<u8>,
    /// Its key.
    pub key: Vec<u8>,
    /// The CA's certificate.
    pub ca: Vec<u8>,
}

impl std::fmt::Debug for Trust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trust").field("peer", &self.inner.own).finish_non_exhaustive()
    }
}

impl Trust {
    /// Credentials from PEM text: the certificate (the first in `cert` is
    /// the holder's), its key, and the CA certificate.
    pub fn from_pem(cert: &[u8], key: &[u8], ca: &[u8]) -> anyhow::Result<Self> {
        let (_, pem) = x509_parser::pem::parse_x509_pem(cert).map_err(|error| anyhow::anyhow!("not a PEM certificate: {error}"))?;
        let own = Peer::of_certificate(&pem.contents)?;
        x509_parser::pem::parse_x509_pem(ca).map_err(|error| anyhow::anyhow!("the CA is not a PEM certificate: {error}"))?;
        let (signer, verifier) = (Signer::from_pem(cert, key)?, Verifier::from_pem(ca)?);
        let inner = TrustInner {
            identity: Identity::from_pem(cert, key),
            ca: Certificate::from_pem(ca),
            own,
            signer,
            verifier,
            pem: PemFiles { cert: cert.to_vec(), key: key.to_vec(), ca: ca.to_vec() },
        };
        Ok(Self { inner: Arc::new(inner) })
    }

    /// Who this process is.
    pub fn peer(&self) -> &Peer {
        &self.inner.own
    }

    /// The certificate, key and CA as PEM text.
    pub fn pem(&self) -> &PemFiles {
        &self.inner.pem
    }

    /// Signs what this process writes to shared stores.
    pub fn signer(&self) -> &Signer {
        &self.inner.signer
    }

    /// Checks what others wrote against this process's CA.
    pub fn verifier(&self) -> &Verifier {
        &self.inner.verifier
    }

    /// The server side: this certificate, and callers must present one the
    /// CA signed.
    pub fn server_config(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(self.inner.identity.clone()).client_ca_root(self.inner.ca.clone()).timeout(HANDSHAKE_TIMEOUT)
    }

    /// The client side, dialing a service of role `server`: this
    /// certificate, and the server's must name `server`.
    pub fn client_config(&self, server: Role) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .identity(self.inner.identity.clone())
            .ca_certificate(self.inner.ca.clone())
            .domain_name(server.dns_name())
            .timeout(HANDSHAKE_TIMEOUT)
    }
}

/// The rpcs every authenticated caller may call on every service: health
/// and reflection.
const OPEN_PREFIXES: &[&str] = &["/grpc.health.v1.Health/", "/grpc.reflection.v1.ServerReflection/", "/grpc.reflection.v1alpha.ServerReflection/"];

/// Whether a caller presenting `certificates` (the TLS session's, the
/// holder's first) may call `path` under `table`: the caller's [`Peer`],
/// or the status to answer.
pub fn authorize(table: &[RpcRoles], path: &str, certificates: Option<&[impl AsRef<[u8]>]>) -> Result<Peer, tonic::Status> {
    let Some(first) = certificates.and_then(|certificates| certificates.first()) else {
        return Err(tonic::Status::unauthenticated("no client certificate: this service takes callers with a certificate from its CA"));
    };
    let peer = peer_of(first.as_ref()).map_err(|problem| tonic::Status::unauthenticated(format!("client certificate: {problem}")))?;
    if table.is_empty() || OPEN_PREFIXES.iter().any(|prefix| path.starts_with(prefix)) {
        return Ok(peer);
    }
    match table.iter().find(|row| row.method == path) {
        Some(row) if row.roles.contains(&peer.role) => Ok(peer),
        Some(row) => {
            let allowed: Vec<_> = row.roles.iter().map(|role| role.as_str()).collect();
            Err(tonic::Status::permission_denied(format!("{peer} may not call {path} (callers: {})", allowed.join(", "))))
        }
        None => Err(tonic::Status::permission_denied(format!("{path} is not in this service's role table: no caller may call it"))),
    }
}

static REFUSED_CALLS: std::sync::LazyLock<prometheus::IntCounterVec> = std::sync::LazyLock::new(|| {
    crate::metrics::counter(
        "turbine_rpc_refused_total",
        "Calls refused for who the caller is, by rpc (unknown: not in the service's role table) and reason: unauthenticated (no or unreadable certificate), wrong_role (the caller's role may not call the rpc), wrong_writer (the caller wrote data in another's name), bad_capability (the call named a resource with a token that is not its own)",
        &["method", "reason"],
    )
});

/// Why a call was refused for who made it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No certificate, or one that names no role.
    Unauthenticated,
    /// The caller's role may not call the rpc.
    WrongRole,
    /// The caller wrote data in another's name (a handler's check).
    WrongWriter,
    /// The call named a resource (a KV handle) with a token that is not
    /// the resource's (a handler's check).
    BadCapability,
}

/// Counts a refused call of `method` (a path in the service's role table;
/// others are counted as `unknown`, so callers cannot grow the series).
pub fn count_refusal(table: &[RpcRoles], method: &str, refusal: Refusal) {
    let method = table.iter().find(|row| row.method == method).map_or("unknown", |row| row.method);
    let reason = match refusal {
        Refusal::Unauthenticated => "unauthenticated",
        Refusal::WrongRole => "wrong_role",
        Refusal::WrongWriter => "wrong_writer",
        Refusal::BadCapability => "bad_capability",
    };
    REFUSED_CALLS.with_label_values(&[method, reason]).inc();
}

/// A handler refuses the call it handles (of `method`, in `table`):
/// counted as [`count_refusal`] does, and a strike against the caller's
/// connection ([`crate::strikes::strike_caller`]), so that a caller
/// refused call after call on one connection loses it, as one the role
/// check refuses does.
pub fn refuse(table: &[RpcRoles], method: &str, refusal: Refusal) {
    count_refusal(table, method, refusal);
    crate::strikes::strike_caller();
}

/// Certificates already read, and whom they name: every call of a
/// connection presents the same certificate, so each is parsed once (the
/// TLS handshake verified it; the bytes are the key).
static PEERS: std::sync::LazyLock<parking_lot::Mutex<ReadCertificates>> = std::sync::LazyLock::new(Default::default);

/// Certificates (DER) and what reading each gave.
type ReadCertificates = std::collections::HashMap<Vec<u8>, Result<Peer, CertificateError>>;

/// Certificates remembered at most; past it the memory starts over.
const PEERS_REMEMBERED: usize = 4096;

/// [`Peer::of_certificate`], parsed once per certificate.
fn peer_of(der: &[u8]) -> Result<Peer, CertificateError> {
    if let Some(known) = PEERS.lock().get(der) {
        return known.clone();
    }
    let read = Peer::of_certificate(der);
    let mut peers = PEERS.lock();
    if peers.len() >= PEERS_REMEMBERED {
        peers.clear();
    }
    peers.insert(der.to_vec(), read.clone());
    read
}

/// The tower layer that authorizes every call against a role table,
/// answering PERMISSION_DENIED or UNAUTHENTICATED itself and passing the
/// caller's [`Peer`] on in the request's extensions.
#[derive(Debug, Clone, Copy)]
pub struct Authorize {
    /// `None`: plaintext, every call passes.
    table: Option<&'static [RpcRoles]>,
}

impl Authorize {
    /// Authorizes against `table` (empty: any caller with a certificate).
    pub fn new(table: &'static [RpcRoles]) -> Self {
        Self { table: Some(table) }
    }

    /// Lets every call through (plaintext development mode: callers have
    /// no identity to check).
    pub fn open() -> Self {
        Self { table: None }
    }
}

impl<S> tower::Layer<S> for Authorize {
    type Service = Authorized<S>;

    fn layer(&self, inner: S) -> Authorized<S> {
        Authorized { inner, table: self.table }
    }
}

/// A service behind [`Authorize`].
#[derive(Debug, Clone)]
pub struct Authorized<S> {
    inner: S,
    table: Option<&'static [RpcRoles]>,
}

type TlsInfo = tonic::transport::server::TlsConnectInfo<crate::strikes::StruckInfo>;

impl<S, B> tower::Service<http::Request<B>> for Authorized<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = futures::future::Either<
        std::future::Ready<Result<Self::Response, S::Error>>,
        futures::future::Either<tokio::task::futures::TaskLocalFuture<Arc<crate::strikes::Strikes>, S::Future>, S::Future>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        use futures::future::Either;
        // The handler's own refusals strike the call's connection.
        let strikes = crate::strikes::connection_info(request.extensions()).map(|info| info.strikes.clone());
        let handle = |inner: &mut S, request| {
            let call = inner.call(request);
            Either::Right(match strikes {
                Some(strikes) => Either::Left(crate::strikes::within(strikes, call)),
                None => Either::Right(call),
            })
        };
        let Some(table) = self.table else { return handle(&mut self.inner, request) };
        let connection = request.extensions().get::<TlsInfo>();
        let certificates = connection.and_then(TlsInfo::peer_certs);
        match authorize(table, request.uri().path(), certificates.as_deref().map(Vec::as_slice)) {
            Ok(peer) => {
                request.extensions_mut().insert(peer);
                handle(&mut self.inner, request)
            }
            Err(status) => {
                let refusal = if status.code() == tonic::Code::Unauthenticated { Refusal::Unauthenticated } else { Refusal::WrongRole };
                count_refusal(table, request.uri().path(), refusal);
                tracing::warn!(path = request.uri().path(), status = %status.message(), "call refused");
                // Refused again and again on one connection: it is closed.
                if let Some(connection) = connection {
                    connection.get_ref().strikes.strike();
                }
                Either::Left(std::future::ready(Ok(status.into_http())))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_read_back_from_their_names() {
        for role in Role::ALL {
            assert_eq!(role.as_str().parse::<Role>(), Ok(role));
        }
        let unknown = "admin".parse::<Role>().unwrap_err();
        assert_eq!(unknown, NoSuchRole("admin".into()));
        assert!(unknown.to_string().contains("operator"), "{unknown}");
    }

    #[test]
    fn a_worker_is_its_own_id_and_a_pool_its_members() {
        let worker = |name: &str| Peer { role: Role::Worker, name: name.into(), kv_tenants: None };
        assert!(worker("worker-0").is_worker("worker-0"));
        assert!(!worker("worker-0").is_worker("worker-01") && !worker("worker-0").is_worker("worker-1"));
        let pool = worker("turbine-worker-prefill-*");
        assert!(pool.is_worker("turbine-worker-prefill-5d8f-x2k"));
        for other in ["turbine-worker-prefill-", "turbine-worker-decode-5d8f", "turbine-worker-prefill", "", "turbine-worker-prefill-*"] {
            assert!(!pool.is_worker(other), "{other:?}");
        }
        assert!(!worker("*").is_worker("anything"), "a bare star names no pool");
        assert!(!Peer { role: Role::Router, name: "worker-0".into(), kv_tenants: None }.is_worker("worker-0"), "only a worker's certificate");
    }

    #[test]
    fn a_missing_certificate_is_unauthenticated() {
        let status = authorize(&[], "/turbine.router.v1.Router/Route", None::<&[Vec<u8>]>).unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
        let status = authorize(&[], "/x/y", Some(&[b"not a certificate".to_vec()][..])).unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unauthenticated, "{status:?}");
        assert!(status.message().contains("the certificate does not parse"), "{status:?}");
        assert!(matches!(Peer::of_certificate(b"not a certificate"), Err(CertificateError::Unparsable(_))));
    }
}

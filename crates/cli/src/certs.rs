//! `turbine certs`: a certificate authority for one deployment and a
//! certificate per role (and per worker id), the files every service's
//! `--tls-cert`, `--tls-key` and `--tls-ca` read.
//!
//! Each certificate names its role as the DNS name `<role>.turbine` (what
//! a caller checks the server's against, and what the server's role table
//! authorizes the caller by) and its holder as the subject's common name
//! (a worker's id). Keys are written readable by their owner only. Nothing
//! is overwritten: a directory that already holds a CA is refused.

use std::path::{Path, PathBuf};

use anyhow::Context;
use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use turbine_runtime::host::Role;

/// `turbine certs`.
#[derive(Debug, clap::Args)]
pub struct CertsArgs {
    /// Folder to write into (made if missing): ca.crt and ca.key, then
    /// <role>.crt and <role>.key for every role, and workers/<ID>.crt and
    /// workers/<ID>.key for each --worker.
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Also a worker certificate naming this worker id (its
    /// --worker-id) as its common name, repeatable.
    #[arg(long = "worker", value_name = "ID")]
    pub workers: Vec<String>,
    /// Also a certificate shared by a pool of workers whose ids are
    /// NAME-<anything> (the pods of a Kubernetes Deployment NAME, each
    /// started with --worker-id set to its pod name), written as
    /// workers/NAME.crt and .key; repeatable. Each pod may write only under
    /// its pool's ids, and every pod of the pool holds the same key.
    #[arg(long = "worker-pool", value_name = "NAME")]
    pub pools: Vec<String>,
    /// Limits the certificate of a --worker ID or --worker-pool NAME to
    /// one KV tenant more, as HOLDER=TENANT, repeatable. TENANT is
    /// tenant:NAME (an API key's tenant), shared:NAME (a shared prefix
    /// namespace keys opt into) or open (a deployment without keys). The
    /// kv-store then takes from that worker only those tenants' blocks and
    /// shows it only theirs (a pool serving one tenant can neither poison
    /// nor read another's), and routers send that worker only those
    /// tenants' requests, keeping each on the workers limited to it while
    /// any is live; a worker certificate with none may write every
    /// tenant's and serve every tenant without a pool.
    #[arg(long = "worker-tenant", value_name = "HOLDER=TENANT")]
    pub worker_tenants: Vec<String>,
    /// Days the certificates are valid, from now.
    #[arg(long, default_value_t = 365, value_parser = clap::value_parser!(u32).range(1..=3650))]
    pub days: u32,
    /// The CA's common name.
    #[arg(long, default_value = "turbine deployment CA")]
    pub ca_name: String,
    /// Also a server certificate for Redis (redis.crt and redis.key, for
    /// its tls-cert-file and tls-key-file; ca.crt is its tls-ca-cert-file)
    /// naming each --redis host name, repeatable: services then reach it as
    /// rediss://HOST:PORT with their own certificates.
    #[arg(long = "redis", value_name = "HOST")]
    pub redis_hosts: Vec<String>,
    /// Also a server certificate for the gateway's API (public.crt and
    /// public.key, for its --public-tls-cert and --public-tls-key) naming
    /// each --public-host host name or address, repeatable, signed by this
    /// CA: for clients given ca.crt to trust (a private deployment; with a
    /// public CA's certificate instead, clients need nothing).
    #[arg(long = "public-host", value_name = "HOST")]
    pub public_hosts: Vec<String>,
    /// Also a server certificate for external engines (engine.crt and
    /// engine.key, for vLLM's --ssl-certfile and --ssl-keyfile; ca.crt is
    /// its --ssl-ca-certs, with --ssl-cert-reqs 2 it serves only callers
    /// holding this CA's certificates) naming each --engine-host host name
    /// or address, repeatable: workers reach it as --upstream
    /// https://HOST:PORT with --upstream-ca ca.crt.
    #[arg(long = "engine-host", value_name = "HOST")]
    pub engine_hosts: Vec<String>,
}

/// What was written.
#[derive(Debug)]
pub struct Written {
    /// The CA's certificate (every service's --tls-ca).
    pub ca: PathBuf,
    /// Each holder's certificate and key: the roles', then the workers'.
    pub holders: Vec<(String, PathBuf, PathBuf)>,
    /// The KV tenants each limited worker certificate names, as given.
    pub kv_tenants: Vec<(String, Vec<String>)>,
}

/// Makes the CA and the certificates under `args.out`.
pub fn make(args: &CertsArgs) -> anyhow::Result<Written> {
    for (flag, id) in args.workers.iter().map(|id| ("--worker", id)).chain(args.pools.iter().map(|pool| ("--worker-pool", pool))) {
        let valid = !id.is_empty() && id.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        anyhow::ensure!(valid, "{flag} {id:?}: a worker id or pool is letters, digits, '.', '_' or '-'");
    }
    let mut kv_tenants: std::collections::BTreeMap<&str, Vec<(String, String)>> = std::collections::BTreeMap::new();
    for spec in &args.worker_tenants {
        let (holder, tenant) = spec.split_once('=').with_context(|| format!("--worker-tenant {spec:?}: HOLDER=TENANT"))?;
        anyhow::ensure!(
            args.workers.iter().chain(&args.pools).any(|named| named == holder),
            "--worker-tenant {spec:?}: {holder:?} is neither a --worker nor a --worker-pool"
        );
        let tenant: turbine_api::KvTenant = tenant.parse().map_err(|error: String| anyhow::anyhow!("--worker-tenant {spec:?}: {error}"))?;
        kv_tenants.entry(holder).or_default().push((spec[holder.len() + 1..].to_owned(), turbine_runtime::trust::kv_tenant_uri(tenant.get())));
    }
    let out = &args.out;
    std::fs::create_dir_all(out.join("workers")).with_context(|| format!("cannot make {}", out.display()))?;
    let ca_cert = out.join("ca.crt");
    anyhow::ensure!(!ca_cert.exists(), "{} exists: turbine certs makes a new CA and overwrites nothing; choose an empty --out", ca_cert.display());

    let now = time::OffsetDateTime::now_utc();
    let until = now + time::Duration::days(i64::from(args.days));
    let ca_key = KeyPair::generate().context("a CA key")?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).context("CA parameters")?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.distinguished_name.push(DnType::CommonName, args.ca_name.as_str());
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    (ca.not_before, ca.not_after) = (now, until);
    let ca_pem = ca.self_signed(&ca_key).context("the CA certificate")?.pem();
    write(&ca_cert, &ca_pem, false)?;
    write(&out.join("ca.key"), &ca_key.serialize_pem(), true)?;
    let issuer = Issuer::from_params(&ca, &ca_key);

    let mut holders = Vec::new();
    let tenants_of = |holder: &str| kv_tenants.get(holder).map(|named| named.iter().map(|(_, uri)| uri.clone()).collect()).unwrap_or_default();
    let roles = Role::ALL.into_iter().map(|role| (role, role.as_str().to_owned(), out.join(role.as_str()), Vec::new()));
    let workers = args.workers.iter().map(|id| (Role::Worker, id.clone(), out.join("workers").join(id), tenants_of(id)));
    let pools = args
        .pools
        .iter()
        .map(|pool| (Role::Worker, format!("{pool}{}", turbine_runtime::trust::POOL_SUFFIX), out.join("workers").join(pool), tenants_of(pool)));
    for (role, name, stem, uris) in roles.chain(workers).chain(pools) {
        let key = KeyPair::generate().context("a key")?;
        let mut params = CertificateParams::new(vec![role.dns_name()]).context("certificate parameters")?;
        for uri in uris {
            params.subject_alt_names.push(rcgen::SanType::URI(uri.as_str().try_into().context("a KV tenant's name")?));
        }
        params.distinguished_name.push(DnType::CommonName, name.as_str());
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        (params.not_before, params.not_after) = (now, until);
        let cert = params.signed_by(&key, &issuer).with_context(|| format!("the certificate of {name}"))?;
        let (cert_path, key_path) = (stem.with_extension("crt"), stem.with_extension("key"));
        write(&cert_path, &cert.pem(), false)?;
        write(&key_path, &key.serialize_pem(), true)?;
        holders.push((name, cert_path, key_path));
    }
    // Server certificates for what services dial (Redis, engines) and what
    // clients dial (the gateway's API), by host name.
    for (name, hosts) in [("redis", &args.redis_hosts), ("public", &args.public_hosts), ("engine", &args.engine_hosts)] {
        if hosts.is_empty() {
            continue;
        }
        let key = KeyPair::generate().context("a key")?;
        let mut params = CertificateParams::new(hosts.clone()).with_context(|| format!("the {name} certificate's names"))?;
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        (params.not_before, params.not_after) = (now, until);
        let cert = params.signed_by(&key, &issuer).with_context(|| format!("the {name} certificate"))?;
        let (cert_path, key_path) = (out.join(format!("{name}.crt")), out.join(format!("{name}.key")));
        write(&cert_path, &cert.pem(), false)?;
        write(&key_path, &key.serialize_pem(), true)?;
        holders.push((name.to_owned(), cert_path, key_path));
    }
    let kv_tenants = kv_tenants.into_iter().map(|(holder, named)| (holder.to_owned(), named.into_iter().map(|(spec, _)| spec).collect())).collect();
    Ok(Written { ca: ca_cert, holders, kv_tenants })
}

/// Writes `text` to a new file at `path`; `secret`: readable by its owner only.
fn write(path: &Path, text: &str, secret: bool) -> anyhow::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;

    let mode = if secret { 0o600 } else { 0o644 };
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("cannot create {} (turbine certs overwrites nothing)", path.display()))?;
    file.write_all(text.as_bytes()).with_context(|| format!("cannot write {}", path.display()))
}

/// `turbine certs`: makes them and says how each service takes its own.
pub fn run(args: &CertsArgs) -> anyhow::Result<()> {
    let written = make(args)?;
    println!("CA: {} (every service's --tls-ca); its key ca.key signs new certificates: keep it off the machines", written.ca.display());
    for (name, cert, key) in &written.holders {
        if name == "redis" {
            println!(
                "redis: --tls-cert-file {} --tls-key-file {} --tls-ca-cert-file {} --tls-auth-clients yes",
                cert.display(),
                key.display(),
                written.ca.display()
            );
        } else if name == "engine" {
            println!(
                "engines: vLLM --ssl-certfile {} --ssl-keyfile {} --ssl-ca-certs {} --ssl-cert-reqs 2; workers --upstream https://HOST:PORT --upstream-ca {}",
                cert.display(),
                key.display(),
                written.ca.display(),
                written.ca.display()
            );
        } else if name == "public" {
            println!("the gateway's API: --public-tls-cert {} --public-tls-key {} (its clients trust {})", cert.display(), key.display(), written.ca.display());
        } else {
            println!("{name}: --tls-cert {} --tls-key {} --tls-ca {}", cert.display(), key.display(), written.ca.display());
        }
    }
    for (holder, tenants) in &written.kv_tenants {
        println!("{holder}: may write and read only the KV tenants {} in the kv-store", tenants.join(", "));
    }
    Ok(())
}

//! A certificate authority for tests: a fresh CA per test, and
//! certificates it signs for any role, written as PEM files a service's
//! `--tls-*` settings (or [`Trust::from_pem`]) read.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use turbine_runtime::host::Role;
use turbine_runtime::trust::{TlsConfig, Trust};

/// A CA whose key lives only in this test.
pub struct TestCa {
    params: CertificateParams,
    key: KeyPair,
    pem: String,
}

/// A certificate the CA signed, with its key.
#[derive(Debug, Clone)]
pub struct Issued {
    /// PEM certificate.
    pub cert: String,
    /// PEM private key.
    pub key: String,
    /// PEM certificate of the CA that signed it.
    pub ca: String,
}

impl TestCa {
    /// A new CA named `name`.
    pub fn new(name: &str) -> Self {
        let key = KeyPair::generate().expect("a CA key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let pem = params.self_signed(&key).expect("a self-signed CA").pem();
        Self { params, key, pem }
    }

    /// The CA's certificate, PEM.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A certificate naming `dns_names` (as given: a role's is
    /// `<role>.turbine`) for the holder `name`.
    pub fn issue_names(&self, dns_names: &[String], name: &str) -> Issued {
        self.issue_alt_names(dns_names, &[], name)
    }

    /// A certificate of `role` for the holder `name` that also carries the
    /// URI names `uris` (a worker's KV tenants: `turbine:kv-tenant:...`).
    pub fn issue_with_uris(&self, role: Role, name: &str, uris: &[&str]) -> Issued {
        self.issue_alt_names(&[role.dns_name()], uris, name)
    }

    fn issue_alt_names(&self, dns_names: &[String], uris: &[&str], name: &str) -> Issued {
        let key = KeyPair::generate().expect("a key");
        let mut params = CertificateParams::new(dns_names.to_vec()).expect("certificate parameters");
        for uri in uris {
            params.subject_alt_names.push(rcgen::SanType::URI((*uri).try_into().expect("an ASCII URI")));
        }
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let issuer = Issuer::from_params(&self.params, &self.key);
        let cert = params.signed_by(&key, &issuer).expect("a signed certificate").pem();
        Issued { cert, key: key.serialize_pem(), ca: self.pem.clone() }
    }

    /// A certificate of `role` for the holder `name`.
    pub fn issue(&self, role: Role, name: &str) -> Issued {
        self.issue_names(&[role.dns_name()], name)
    }

    /// The credentials of a process of `role` named `name`.
    pub fn trust(&self, role: Role, name: &str) -> Trust {
        self.issue(role, name).trust()
    }

    /// Files under `dir` for a PostgreSQL server this CA vouches for (its
    /// certificate names `127.0.0.1`).
    pub fn postgres_tls(&self, dir: &Path) -> turbine_harness::PostgresTls {
        let server = self.issue_names(&["127.0.0.1".to_owned()], "postgres").write(dir, "postgres");
        let path = |path: Option<PathBuf>| path.expect("written");
        turbine_harness::PostgresTls { cert: path(server.tls_cert), key: path(server.tls_key), ca: path(server.tls_ca) }
    }

    /// Files under `dir` for a Redis server this CA vouches for: a server
    /// certificate for `localhost`, and an operator's certificate the
    /// harness checks readiness with.
    pub fn redis_tls(&self, dir: &Path) -> turbine_harness::RedisTls {
        let server = self.issue_names(&["localhost".to_owned()], "redis").write(dir, "redis");
        let client = self.issue(Role::Operator, "redis-check").write(dir, "redis-check");
        let path = |path: Option<PathBuf>| path.expect("written");
        turbine_harness::RedisTls {
            cert: path(server.tls_cert),
            key: path(server.tls_key),
            ca: path(server.tls_ca),
            client_cert: path(client.tls_cert),
            client_key: path(client.tls_key),
        }
    }
}

impl Issued {
    /// These credentials in memory.
    pub fn trust(&self) -> Trust {
        Trust::from_pem(self.cert.as_bytes(), self.key.as_bytes(), self.ca.as_bytes()).expect("issued credentials load")
    }

    /// Writes `<stem>.crt`, `<stem>.key` and `<stem>-ca.crt` under `dir`:
    /// the settings that name them.
    pub fn write(&self, dir: &Path, stem: &str) -> TlsConfig {
        let path = |suffix: &str| -> PathBuf { dir.join(format!("{stem}{suffix}")) };
        let (cert, key, ca) = (path(".crt"), path(".key"), path("-ca.crt"));
        for (file, text) in [(&cert, &self.cert), (&key, &self.key), (&ca, &self.ca)] {
            std::fs::write(file, text).unwrap_or_else(|error| panic!("cannot write {}: {error}", file.display()));
        }
        TlsConfig { tls_cert: Some(cert), tls_key: Some(key), tls_ca: Some(ca) }
    }
}

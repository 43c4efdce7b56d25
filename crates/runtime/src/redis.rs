//! Redis clients: every service opens them here, so a `rediss://` URL
//! speaks TLS with the process's identity.
//!
//! - `redis://[user:password@]host:port/db`: plaintext; an ACL user and
//!   password in the URL authenticate the connection.
//! - `rediss://[user:password@]host:port/db`: TLS. With certificates
//!   ([`crate::trust::TlsConfig::establish`]) the client presents the
//!   process's certificate (for Redis's `tls-auth-clients`) and accepts only
//!   a server certificate the deployment's CA signed for the URL's host;
//!   without, the system's roots verify the server.

use ::redis::{Client, ClientTlsConfig, IntoConnectionInfo, RedisResult, TlsCertificates};

use crate::trust::dialing_as;

/// A client of the Redis at `url` (connecting lazily, when used).
pub fn client(url: &str) -> RedisResult<Client> {
    let info = url.into_connection_info()?;
    match dialing_as() {
        Some(trust) if url.starts_with("rediss://") => {
            let pem = trust.pem();
            let certificates = TlsCertificates {
                client_tls: Some(ClientTlsConfig { client_cert: pem.cert.clone(), client_key: pem.key.clone() }),
                root_cert: Some(pem.ca.clone()),
            };
            Client::build_with_tls(info, certificates)
        }
        _ => Client::open(info),
    }
}

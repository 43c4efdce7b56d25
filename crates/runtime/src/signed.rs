//! What a process writes to a store others act on (the registry and the KV
//! event log in Redis) carries a signature by the writer's certificate key,
//! and readers check it against the deployment's CA (DESIGN §8): write
//! access to the store alone forges nothing, and a reader learns who wrote
//! each record ([`Peer`]) to check that the writer may write it.
//!
//! A [`Seal`] is the writer's certificate (DER), the TLS signature scheme
//! and the signature over the record's bytes. Readers verify the
//! certificate chains to the CA and is valid now (as a mutual-TLS server
//! would verify a caller's), then the signature with the certificate's key.
//! Certificates already verified are remembered (by their bytes, up to
//! [`CERTIFICATES_REMEMBERED`]); each signature is checked every time.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use rustls::SignatureScheme;
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, TrustAnchor, UnixTime};
use rustls::sign::SigningKey;
use serde::{Deserialize, Serialize};

use crate::trust::{CertificateError, Peer};

/// Certificates a verifier remembers at most; past it the memory starts
/// over.
pub const CERTIFICATES_REMEMBERED: usize = 1024;

/// Schemes a writer signs with, in order of preference (the first its key
/// supports).
const SCHEMES: &[SignatureScheme] = &[
    SignatureScheme::ED25519,
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::ECDSA_NISTP521_SHA512,
    SignatureScheme::RSA_PSS_SHA256,
    SignatureScheme::RSA_PKCS1_SHA256,
];

/// A signature over a record, and who made it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Seal {
    /// The writer's certificate, DER, hex.
    #[serde(with = "hex_bytes")]
    pub certificate: Vec<u8>,
    /// The TLS signature scheme (`0x0403`: ECDSA P-256 SHA-256).
    pub scheme: u16,
    /// The signature, hex.
    #[serde(with = "hex_bytes")]
    pub signature: Vec<u8>,
}

/// Why a seal was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// The certificate is not one the CA signed, or not valid now.
    #[error("the writer's certificate is not trusted: {0}")]
    Untrusted(String),
    /// It names no role (or more than one).
    #[error("the writer's certificate: {0}")]
    Certificate(#[from] CertificateError),
    /// The signature does not match the record (altered, or another's).
    #[error("the signature does not match the record")]
    BadSignature,
    /// The scheme is not one this process verifies.
    #[error("signature scheme {0:#06x} is not supported")]
    UnsupportedScheme(u16),
}

/// Signs records as this process.
#[derive(Clone)]
pub struct Signer {
    key: Arc<dyn SigningKey>,
    certificate: Vec<u8>,
    fingerprint: [u8; 32],
}

impl std::fmt::Debug for Signer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signer").field("algorithm", &self.key.algorithm()).finish_non_exhaustive()
    }
}

impl Signer {
    /// A signer from PEM: the certificate (the first in `cert`) and its key.
    pub fn from_pem(cert: &[u8], key: &[u8]) -> anyhow::Result<Self> {
        let certificate = CertificateDer::from_pem_slice(cert).map_err(|error| anyhow::anyhow!("not a PEM certificate: {error}"))?;
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|error| anyhow::anyhow!("not a PEM private key: {error}"))?;
        let key = rustls::crypto::ring::sign::any_supported_type(&key).map_err(|error| anyhow::anyhow!("the private key cannot sign: {error}"))?;
        let fingerprint = fingerprint(certificate.as_ref());
        let signer = Self { key, certificate: certificate.as_ref().to_vec(), fingerprint };
        signer.seal(b"probe")?;
        Ok(signer)
    }

    /// The certificate seals carry (DER).
    pub fn certificate(&self) -> &[u8] {
        &self.certificate
    }

    /// The SHA-256 of [`certificate`](Self::certificate): what a record
    /// names its writer by where certificates are stored apart from it.
    pub fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }

    /// Signs `record`.
    pub fn seal(&self, record: &[u8]) -> anyhow::Result<Seal> {
        let signer = self.key.choose_scheme(SCHEMES).ok_or_else(|| anyhow::anyhow!("the key supports none of the signature schemes readers verify"))?;
        let scheme = u16::from(signer.scheme());
        let signature = signer.sign(record).map_err(|error| anyhow::anyhow!("signing failed: {error}"))?;
        Ok(Seal { certificate: self.certificate.clone(), scheme, signature })
    }
}

/// Checks seals against one CA.
#[derive(Clone)]
pub struct Verifier {
    inner: Arc<VerifierInner>,
}

struct VerifierInner {
    anchors: Vec<TrustAnchor<'static>>,
    algorithms: WebPkiSupportedAlgorithms,
    /// Certificates checked (by their bytes), and whom they name.
    known: Mutex<HashMap<Vec<u8>, Verdict>>,
}

/// What checking a certificate gave, and until when it stands.
type Verdict = (Result<Peer, SealError>, UnixTime);

impl std::fmt::Debug for Verifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verifier").finish_non_exhaustive()
    }
}

/// How long a certificate's verdict is remembered before it is checked
/// again (its validity period moves on).
const VERDICT_SECS: u64 = 60;

impl Verifier {
    /// A verifier trusting the CA in `ca` (PEM).
    pub fn from_pem(ca: &[u8]) -> anyhow::Result<Self> {
        let ca = CertificateDer::from_pem_slice(ca).map_err(|error| anyhow::anyhow!("the CA is not a PEM certificate: {error}"))?;
        let anchor = webpki::anchor_from_trusted_cert(&ca).map_err(|error| anyhow::anyhow!("the CA certificate: {error}"))?.to_owned();
        let algorithms = rustls::crypto::ring::default_provider().signature_verification_algorithms;
        Ok(Self { inner: Arc::new(VerifierInner { anchors: vec![anchor], algorithms, known: Mutex::new(HashMap::new()) }) })
    }

    /// Who sealed `record` with `seal`: the certificate's holder, if the CA
    /// signed the certificate, it is valid now, and the signature matches.
    pub fn verify(&self, record: &[u8], seal: &Seal) -> Result<Peer, SealError> {
        let peer = self.certificate(&seal.certificate)?;
        let certificate = CertificateDer::from(seal.certificate.as_slice());
        let end_entity = webpki::EndEntityCert::try_from(&certificate).map_err(|error| SealError::Untrusted(error.to_string()))?;
        let scheme = SignatureScheme::from(seal.scheme);
        let algorithms = self.inner.algorithms.mapping.iter().find(|(known, _)| *known == scheme).map(|(_, algorithms)| *algorithms);
        let algorithms = algorithms.ok_or(SealError::UnsupportedScheme(seal.scheme))?;
        // A scheme may map to several algorithms (curves); one must verify.
        if algorithms.iter().any(|algorithm| end_entity.verify_signature(*algorithm, record, &seal.signature).is_ok()) {
            Ok(peer)
        } else {
            Err(SealError::BadSignature)
        }
    }

    /// The holder of a certificate the CA signed, valid now.
    fn certificate(&self, der: &[u8]) -> Result<Peer, SealError> {
        let now = UnixTime::now();
        if let Some((verdict, until)) = self.inner.known.lock().get(der)
            && now.as_secs() < until.as_secs()
        {
            return verdict.clone();
        }
        let verdict = self.check_certificate(der, now);
        let mut known = self.inner.known.lock();
        if known.len() >= CERTIFICATES_REMEMBERED {
            known.clear();
        }
        known.insert(der.to_vec(), (verdict.clone(), UnixTime::since_unix_epoch(std::time::Duration::from_secs(now.as_secs() + VERDICT_SECS))));
        verdict
    }

    fn check_certificate(&self, der: &[u8], now: UnixTime) -> Result<Peer, SealError> {
        let certificate = CertificateDer::from(der);
        let end_entity = webpki::EndEntityCert::try_from(&certificate).map_err(|error| SealError::Untrusted(error.to_string()))?;
        end_entity
            .verify_for_usage(self.inner.algorithms.all, &self.inner.anchors, &[], now, webpki::KeyUsage::client_auth(), None, None)
            .map_err(|error| SealError::Untrusted(error.to_string()))?;
        Ok(Peer::of_certificate(der)?)
    }
}

/// The SHA-256 of a certificate's DER bytes.
pub fn fingerprint(certificate: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(certificate).into()
}

mod hex_bytes {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(bytes: &[u8], serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&hex::encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<u8>, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(deserializer)?;
        hex::decode(text.as_bytes()).map_err(serde::de::Error::custom)
    }
}

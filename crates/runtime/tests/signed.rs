//! Seals: a record signed by its writer's certificate key verifies against
//! the writer's CA and names the writer; an altered record, another
//! writer's certificate, or another CA's does not.

use turbine_runtime::host::Role;
use turbine_runtime::signed::{Seal, SealError};
use turbine_runtime::trust::Peer;
use turbine_testkit::tls::TestCa;

#[test]
fn a_sealed_record_names_its_writer() {
    let ca = TestCa::new("deployment");
    let worker = ca.trust(Role::Worker, "worker-0");
    let router = ca.trust(Role::Router, "router-0");
    let record = br#"{"worker_id":"worker-0","endpoint":"https://10.0.0.5:50052"}"#;
    let seal = worker.signer().seal(record).unwrap();
    assert_eq!(seal.scheme, 0x0403, "ECDSA P-256 SHA-256, the key turbine certs makes");
    let writer = router.verifier().verify(record, &seal).unwrap();
    assert_eq!(writer, Peer { role: Role::Worker, name: "worker-0".into(), kv_tenants: None });
    // Again, from the remembered certificate.
    assert_eq!(router.verifier().verify(record, &seal).unwrap(), writer);
    // A seal survives JSON.
    let json = serde_json::to_string(&seal).unwrap();
    assert_eq!(serde_json::from_str::<Seal>(&json).unwrap(), seal);
}

#[test]
fn an_altered_record_or_a_borrowed_certificate_is_refused() {
    let ca = TestCa::new("deployment");
    let worker = ca.trust(Role::Worker, "worker-0");
    let other = ca.trust(Role::Worker, "worker-1");
    let reader = ca.trust(Role::Router, "router-0");
    let record = br#"{"worker_id":"worker-0","endpoint":"https://10.0.0.5:50052"}"#;
    let seal = worker.signer().seal(record).unwrap();

    let altered = br#"{"worker_id":"worker-0","endpoint":"https://10.6.6.6:50052"}"#;
    assert_eq!(reader.verifier().verify(altered, &seal), Err(SealError::BadSignature));
    // worker-1 signs, and claims worker-0's certificate.
    let mut borrowed = other.signer().seal(record).unwrap();
    borrowed.certificate = seal.certificate.clone();
    assert_eq!(reader.verifier().verify(record, &borrowed), Err(SealError::BadSignature));
    let mut flipped = seal.clone();
    flipped.signature[10] ^= 1;
    assert_eq!(reader.verifier().verify(record, &flipped), Err(SealError::BadSignature));
    flipped.scheme = 0x9999;
    assert_eq!(reader.verifier().verify(record, &flipped), Err(SealError::UnsupportedScheme(0x9999)));
}

#[test]
fn another_cas_certificate_is_untrusted() {
    let ours = TestCa::new("deployment");
    let theirs = TestCa::new("attacker");
    let forger = theirs.trust(Role::Worker, "worker-0");
    let record = b"worker-0 lives at 10.6.6.6";
    let seal = forger.signer().seal(record).unwrap();
    let refused = ours.trust(Role::Router, "router-0").verifier().verify(record, &seal).unwrap_err();
    assert!(matches!(refused, SealError::Untrusted(_)), "{refused:?}");
    let mut garbage = seal;
    garbage.certificate = b"not a certificate".to_vec();
    assert!(matches!(ours.trust(Role::Router, "router-0").verifier().verify(record, &garbage), Err(SealError::Untrusted(_))));
}

/// A worker certificate's KV tenants are read from its URI names (16 hex
/// digits each, after `turbine:kv-tenant:`); a certificate naming none
/// limits nothing, other URIs are not tenants, and a malformed tenant
/// name makes the certificate unreadable rather than unlimited.
#[test]
fn a_workers_kv_tenants_come_from_its_certificate() {
    use turbine_runtime::trust::{CertificateError, kv_tenant_uri};

    let ca = TestCa::new("deployment");
    let der = |issued: &turbine_testkit::tls::Issued| {
        let (_, pem) = x509_parser::pem::parse_x509_pem(issued.cert.as_bytes()).unwrap();
        pem.contents
    };
    let limited = ca.issue_with_uris(Role::Worker, "acme-0", &[&kv_tenant_uri(7), &kv_tenant_uri(u64::MAX), "https://example.invalid/other"]);
    let peer = Peer::of_certificate(&der(&limited)).unwrap();
    assert_eq!(peer.kv_tenants.as_deref(), Some(&[7, u64::MAX][..]), "its tenants, and no other URI");
    assert_eq!(Peer::of_certificate(&der(&ca.issue(Role::Worker, "any-0"))).unwrap().kv_tenants, None, "none named: unlimited");
    for bad in ["turbine:kv-tenant:7", "turbine:kv-tenant:xyz0000000000000", "turbine:kv-tenant:"] {
        let refused = Peer::of_certificate(&der(&ca.issue_with_uris(Role::Worker, "w", &[bad]))).unwrap_err();
        assert!(matches!(refused, CertificateError::BadNames(_)), "{bad}: {refused:?}");
    }
}

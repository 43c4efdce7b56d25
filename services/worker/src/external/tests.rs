use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

/// A server that reads each request whole and then, for the first
/// `drop_first` connections, closes without answering (as a server closing
/// a kept-alive connection the request went down); later ones answer 200.
async fn server(drop_first: usize) -> (String, tokio::task::JoinHandle<usize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let serving = tokio::spawn(async move {
        let mut connections = 0;
        loop {
            let (mut socket, _) = listener.accept().await.unwrap();
            connections += 1;
            let mut request = Vec::new();
            let mut buffer = [0u8; 1024];
            while !request.windows(4).any(|window| window == b"\r\n\r\n") || !request.ends_with(b"{}") {
                let read = socket.read(&mut buffer).await.unwrap();
                assert!(read > 0, "the client closed first");
                request.extend_from_slice(&buffer[..read]);
            }
            if connections <= drop_first {
                drop(socket);
                continue;
            }
            socket.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok").await.unwrap();
            return connections;
        }
    });
    (url, serving)
}

#[tokio::test]
async fn a_request_whose_connection_closed_before_any_answer_is_sent_once_more() {
    let http = EngineLink::plain().unwrap();
    let (url, serving) = server(1).await;
    let response = http.send(&http.post_json(&url, &serde_json::json!({})).unwrap()).await.unwrap();
    assert_eq!(response.text().await.unwrap(), "ok");
    assert_eq!(serving.await.unwrap(), 2, "answered on the second connection");

    // Only once: an engine that keeps closing is an error for the caller.
    let (url, serving) = server(2).await;
    assert!(http.send(&http.post_json(&url, &serde_json::json!({})).unwrap()).await.is_err());
    serving.abort();
}

/// An HTTPS server on loopback with the certificate `server` (for
/// `127.0.0.1`); it asks for a client certificate signed by `client_ca`
/// (and serves callers without one), and answers each request with what
/// it saw: `client=<yes|no> authorization=<header>`.
async fn tls_server(server: &turbine_testkit::tls::Issued, client_ca: &str) -> String {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(client_ca.as_bytes()).unwrap()).unwrap();
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone()).allow_unauthenticated().build().unwrap();
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(vec![CertificateDer::from_pem_slice(server.cert.as_bytes()).unwrap()], PrivateKeyDer::from_pem_slice(server.key.as_bytes()).unwrap())
        .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("https://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (socket, _) = listener.accept().await.unwrap();
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut stream) = acceptor.accept(socket).await else { return };
                let client = stream.get_ref().1.peer_certificates().is_some_and(|certificates| !certificates.is_empty());
                let mut request = Vec::new();
                let mut buffer = [0u8; 1024];
                while !request.windows(4).any(|window| window == b"\r\n\r\n") {
                    match stream.read(&mut buffer).await {
                        Ok(0) | Err(_) => return,
                        Ok(read) => request.extend_from_slice(&buffer[..read]),
                    }
                }
                let text = String::from_utf8_lossy(&request).to_lowercase();
                let authorization = text.lines().find_map(|line| line.strip_prefix("authorization: ")).unwrap_or("none").trim().to_owned();
                let body = format!("client={} authorization={authorization}", if client { "yes" } else { "no" });
                let answer = format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}", body.len());
                let _ = stream.write_all(answer.as_bytes()).await;
                let _ = stream.shutdown().await;
            });
        }
    });
    url
}

#[tokio::test]
async fn an_https_engine_is_reached_with_its_ca_the_workers_certificate_and_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let engine_ca = turbine_testkit::tls::TestCa::new("engine-ca");
    let deployment = turbine_testkit::tls::TestCa::new("turbine-ca");
    let url = tls_server(&engine_ca.issue_names(&["127.0.0.1".to_owned()], "engine"), deployment.pem()).await;
    let ca = dir.path().join("engine-ca.crt");
    std::fs::write(&ca, engine_ca.pem()).unwrap();
    let worker = deployment.issue(turbine_runtime::host::Role::Worker, "worker-a").write(dir.path(), "worker");
    let key = dir.path().join("engine.key");
    std::fs::write(&key, "sk-engine-123\n").unwrap();

    let answer = |link: EngineLink| {
        let url = url.clone();
        async move {
            let response = link.send_once(&link.get(&format!("{url}/v1/models")).unwrap()).await?;
            assert_eq!(response.status(), 200);
            response.text().await
        }
    };
    // Its CA, the worker's certificate, the key.
    let settings = LinkSettings { ca: Some(ca.clone()), identity: worker.tls_cert.zip(worker.tls_key), api_key: Some(key) };
    assert_eq!(answer(EngineLink::new(&settings).unwrap()).await.unwrap(), "client=yes authorization=bearer sk-engine-123");
    // No certificate, no key: the engine sees neither.
    let bare = LinkSettings { ca: Some(ca), ..LinkSettings::default() };
    assert_eq!(answer(EngineLink::new(&bare).unwrap()).await.unwrap(), "client=no authorization=none");
    // The system's roots do not vouch for the engine: refused, and said why.
    let refused = answer(EngineLink::plain().unwrap()).await.unwrap_err().to_string();
    assert!(refused.contains("certificate"), "{refused}");
    // A certificate for another host is refused too.
    let elsewhere = tls_server(&engine_ca.issue_names(&["engine.example".to_owned()], "engine"), deployment.pem()).await;
    let link = EngineLink::new(&settings).unwrap();
    let refused = link.send_once(&link.get(&elsewhere).unwrap()).await.unwrap_err().to_string();
    assert!(refused.contains("certificate"), "{refused}");
}

#[test]
fn the_links_settings_are_checked_as_it_is_built() {
    let dir = tempfile::tempdir().unwrap();
    let empty = dir.path().join("empty");
    std::fs::write(&empty, "\n").unwrap();
    let missing = dir.path().join("missing");
    let error = |settings: LinkSettings| format!("{:#}", EngineLink::new(&settings).unwrap_err());
    assert!(error(LinkSettings { api_key: Some(empty.clone()), ..LinkSettings::default() }).contains("empty"));
    assert!(error(LinkSettings { api_key: Some(missing.clone()), ..LinkSettings::default() }).contains("cannot read"));
    assert!(error(LinkSettings { ca: Some(empty), ..LinkSettings::default() }).contains("no certificate"));
    assert!(error(LinkSettings { ca: Some(missing), ..LinkSettings::default() }).contains("cannot read"));
    let link = EngineLink::plain().unwrap();
    assert!(link.get("127.0.0.1:8000").unwrap_err().to_string().contains("http://"));
    assert!(link.get("ftp://127.0.0.1/").unwrap_err().to_string().contains("http://"));
}

#[tokio::test]
async fn a_body_read_whole_is_cut_off_past_its_limit() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/metrics", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buffer = [0u8; 1024];
                let _ = socket.read(&mut buffer).await;
                // An answer that never ends: chunks of 64 KiB, forever.
                let _ = socket.write_all(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n").await;
                let chunk = format!("10000\r\n{}\r\n", "#".repeat(0x10000));
                while socket.write_all(chunk.as_bytes()).await.is_ok() {}
            });
        }
    });
    let link = EngineLink::plain().unwrap();
    let response = link.send_once(&link.get(&url).unwrap()).await.unwrap();
    let refused = tokio::time::timeout(Duration::from_secs(30), response.text()).await.expect("cut off, not read forever").unwrap_err();
    assert!(refused.to_string().contains("length limit"), "{refused}");
}

#[test]
fn a_json_object_is_refused_where_the_engine_cannot_be_held_to_it() {
    let dialect = |kind| Dialect { kind, model: "m".into(), stop_ids: Vec::new(), tokenizer: None };
    let fresh = OutputFormat::JsonObject { continued: 0 };
    let continued = OutputFormat::JsonObject { continued: 5 };
    let schema = OutputFormat::json_schema(&serde_json::json!({"type": "array"})).unwrap();
    for kind in [UpstreamKind::Vllm, UpstreamKind::LlamaCpp] {
        assert_eq!(dialect(kind).check_output(&OutputFormat::Text), Ok(()));
        assert_eq!(dialect(kind).check_output(&fresh), Ok(()), "{kind:?} holds its output to an object");
        assert_eq!(dialect(kind).check_output(&schema), Ok(()), "{kind:?} holds its output to a schema");
        let refused = dialect(kind).check_output(&continued).unwrap_err().to_string();
        assert!(refused.contains("cannot go on from the 5 tokens"), "{refused}");
        let refused = dialect(kind).check_output(&schema.continued_by(5)).unwrap_err().to_string();
        assert!(refused.contains("cannot go on from the 5 tokens"), "{refused}");
    }
    assert_eq!(dialect(UpstreamKind::Openai).check_output(&OutputFormat::Text), Ok(()));
    for output in [fresh, schema] {
        let refused = dialect(UpstreamKind::Openai).check_output(&output).unwrap_err().to_string();
        assert!(refused.contains("JSON output is not served here"), "{refused}");
    }
}

//! Refusals and reconnects on HTTP, over real sockets: a client answered
//! 401 request after request on one kept connection (keys guessed, a
//! revoked key in a loop) loses it once its burst is spent, over HTTP/1.1
//! and HTTP/2 (a stream in flight on it ending with it), and is answered
//! again on a new connection; another client's connection serves
//! throughout; a trusted proxy's connection is never dropped for its
//! clients' 401s. And an address struck off may connect again only at
//! its rate for a while (over HTTPS, refused before the handshake), while
//! addresses never struck off open what they like. A listener that drains
//! refuses new connections at once while the streams on it go on.

use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::StatusCode;
use axum::routing::get;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use turbine_runtime::CancellationToken;
use turbine_runtime::gate::StruckOff;
use turbine_runtime::http_server::{HttpLimits, serve};
use turbine_runtime::proxies::TrustedProxies;
use turbine_runtime::public_tls::PublicTls;
use turbine_runtime::strikes::STRIKES_BURST;
use turbine_testkit::tls::TestCa;
use turbine_testkit::wait_until;

/// Bounds every wait on the server.
const BOUND: Duration = Duration::from_secs(10);

/// `/` answers; `/locked` refuses as a wrong key is; `/stream` sends a
/// chunk every 100 ms for a minute.
fn app() -> Router {
    Router::new().route("/", get(|| async { "ok" })).route("/locked", get(|| async { (StatusCode::UNAUTHORIZED, "no key") })).route(
        "/stream",
        get(|| async {
            let chunks = futures::stream::unfold(0_u32, |sent| async move {
                (sent < 600).then_some(())?;
                tokio::time::sleep(Duration::from_millis(100)).await;
                Some((Ok::<_, std::convert::Infallible>(Bytes::from_static(b".")), sent + 1))
            });
            Body::from_stream(chunks)
        }),
    )
}

async fn start(limits: HttpLimits) -> (SocketAddr, CancellationToken) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    tokio::spawn(serve(listener, app(), limits, stop.clone(), Duration::from_secs(1), "api"));
    (address, stop)
}

fn request(path: &str) -> hyper::Request<Empty<Bytes>> {
    hyper::Request::get(path).header("host", "test").body(Empty::new()).unwrap()
}

/// A counter of the runtime's metrics (0 if it has no sample yet).
fn counter(series: &str) -> f64 {
    let text = turbine_runtime::metrics::render();
    text.lines().find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok()).unwrap_or(0.0)
}

/// An HTTP/1.1 connection from `source` (Linux answers all of 127/8).
async fn http1_from(source: &str, address: SocketAddr) -> Option<http1::SendRequest<Empty<Bytes>>> {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
    let stream = socket.connect(address).await.unwrap();
    let (sender, connection) = http1::handshake(TokioIo::new(stream)).await.ok()?;
    tokio::spawn(connection);
    Some(sender)
}

/// The status of `path` on `sender`'s connection, its body read; None:
/// the connection failed under it.
async fn status(sender: &mut http1::SendRequest<Empty<Bytes>>, path: &str) -> Option<StatusCode> {
    tokio::time::timeout(BOUND, sender.ready()).await.expect("ready or closed").ok()?;
    let response = tokio::time::timeout(BOUND, sender.send_request(request(path))).await.expect("answered or closed").ok()?;
    let status = response.status();
    response.into_body().collect().await.ok()?;
    Some(status)
}

#[tokio::test]
async fn a_client_answered_401_again_and_again_on_one_connection_loses_it() {
    let (address, stop) = start(HttpLimits::default()).await;
    let before = counter("turbine_http_connections_struck_off_total");
    let mut bystander = http1_from("127.0.0.2", address).await.unwrap();
    assert_eq!(status(&mut bystander, "/").await, Some(StatusCode::OK));

    // HTTP/1.1: the burst answered, then the connection is gone; the
    // request that struck it off gets no answer.
    let mut guesser = http1_from("127.0.0.1", address).await.unwrap();
    for call in 0..STRIKES_BURST as usize {
        assert_eq!(status(&mut guesser, "/locked").await, Some(StatusCode::UNAUTHORIZED), "call {call}");
    }
    assert_eq!(status(&mut guesser, "/locked").await, None, "the 401 past the burst loses the connection, unanswered");
    assert_eq!(status(&mut guesser, "/").await, None, "nothing more on it");
    wait_until("counted as struck off", BOUND, async || counter("turbine_http_connections_struck_off_total") - before == 1.0).await;
    let mut again = http1_from("127.0.0.1", address).await.unwrap();
    assert_eq!(status(&mut again, "/").await, Some(StatusCode::OK), "a new connection is answered");
    assert_eq!(status(&mut bystander, "/").await, Some(StatusCode::OK), "another client's connection serves throughout");

    // HTTP/2: the refusals on one connection end the stream in flight on
    // it; the stream of another connection goes on.
    let h2 = async || {
        let stream = TcpStream::connect(address).await.unwrap();
        let (sender, connection) = http2::handshake(TokioExecutor::new(), TokioIo::new(stream)).await.unwrap();
        tokio::spawn(connection);
        sender
    };
    let (mut guesser, mut other) = (h2().await, h2().await);
    let mut streaming = guesser.send_request(request("http://test/stream")).await.unwrap().into_body();
    let mut watched = other.send_request(request("http://test/stream")).await.unwrap().into_body();
    let first = tokio::time::timeout(BOUND, streaming.frame()).await.unwrap().unwrap().unwrap();
    assert!(first.is_data(), "the stream is under way");
    for call in 0..STRIKES_BURST as usize {
        let refused = guesser.send_request(request("http://test/locked")).await.unwrap();
        assert_eq!(refused.status(), StatusCode::UNAUTHORIZED, "call {call}");
    }
    assert!(guesser.send_request(request("http://test/locked")).await.is_err(), "the 401 past the burst loses the connection");
    let ended = tokio::time::timeout(BOUND, async {
        loop {
            match streaming.frame().await {
                Some(Ok(_)) => continue,
                outcome => return outcome.is_some(),
            }
        }
    })
    .await
    .expect("the stream ends with its connection");
    assert!(ended, "the stream in flight fails with its connection, it does not end as if whole");
    let frame = tokio::time::timeout(BOUND, watched.frame()).await.unwrap().unwrap().unwrap();
    assert!(frame.is_data(), "another connection's stream goes on");
    wait_until("both counted", BOUND, async || counter("turbine_http_connections_struck_off_total") - before == 2.0).await;
    stop.cancel();
}

#[tokio::test]
async fn a_trusted_proxys_connection_is_never_dropped_for_its_clients_401s() {
    let limits = HttpLimits { proxies: TrustedProxies::new(&["127.0.0.1".parse().unwrap()]), ..HttpLimits::default() };
    let (address, stop) = start(limits).await;
    let mut proxy = http1_from("127.0.0.1", address).await.unwrap();
    for call in 0..4 * STRIKES_BURST as usize {
        assert_eq!(status(&mut proxy, "/locked").await, Some(StatusCode::UNAUTHORIZED), "call {call}");
    }
    assert_eq!(status(&mut proxy, "/").await, Some(StatusCode::OK), "its connection serves on");
    // Another address, untrusted, is struck off as any client.
    let mut client = http1_from("127.0.0.3", address).await.unwrap();
    for _ in 0..STRIKES_BURST as usize {
        assert_eq!(status(&mut client, "/locked").await, Some(StatusCode::UNAUTHORIZED));
    }
    assert_eq!(status(&mut client, "/locked").await, None);
    stop.cancel();
}

/// A connection from `source` (over TLS trusting the CA `ca_pem` for
/// `localhost`, if given); None if the server closed it before the TLS
/// handshake finished.
async fn connect_from(source: &str, address: SocketAddr, tls: Option<&str>) -> Option<http1::SendRequest<Empty<Bytes>>> {
    let Some(ca_pem) = tls else { return http1_from(source, address).await };
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
    let stream = socket.connect(address).await.unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(<rustls::pki_types::CertificateDer as rustls::pki_types::pem::PemObject>::from_pem_slice(ca_pem.as_bytes()).unwrap()).unwrap();
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let client = rustls::ClientConfig::builder_with_provider(provider).with_safe_default_protocol_versions().unwrap();
    let client = std::sync::Arc::new(client.with_root_certificates(roots).with_no_client_auth());
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let stream = tokio::time::timeout(BOUND, tokio_rustls::TlsConnector::from(client).connect(name, stream)).await.expect("handshaken or closed").ok()?;
    let (sender, connection) = http1::handshake(TokioIo::new(stream)).await.ok()?;
    tokio::spawn(connection);
    Some(sender)
}

/// Whether a connection from `source` is served `/`.
async fn served(source: &str, address: SocketAddr, tls: Option<&str>) -> bool {
    match connect_from(source, address, tls).await {
        Some(mut sender) => status(&mut sender, "/").await == Some(StatusCode::OK),
        None => false,
    }
}

/// 20 connections from `source`, one after another: how many were served.
async fn served_of_20(source: &str, address: SocketAddr, tls: Option<&str>) -> u32 {
    let mut count = 0;
    for _ in 0..20 {
        count += u32::from(served(source, address, tls).await);
    }
    count
}

/// An address opens as many connections as it likes until one of them is
/// struck off; then, for a while, only its rate of them a second (over
/// HTTPS, refused before the handshake), each refused one counted; other
/// addresses are not held back.
async fn only_an_address_struck_off_is_gated(tls: Option<PublicTls>, ca_pem: Option<&str>) {
    const RATE: u32 = 5;
    let struck_off = StruckOff::new(RATE, "api");
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = tcp.local_addr().unwrap();
    let stop = CancellationToken::new();
    let limits = HttpLimits { struck_off: struck_off.clone(), gated_by_listener: tls.is_some(), ..HttpLimits::default() };
    match tls {
        Some(tls) => {
            let listener = tls.listener(tcp, struck_off).unwrap();
            tokio::spawn(serve(listener, app(), limits, stop.clone(), Duration::from_secs(1), "api"));
        }
        None => drop(tokio::spawn(serve(tcp, app(), limits, stop.clone(), Duration::from_secs(1), "api"))),
    }
    let series = "turbine_http_connections_refused_total{listener=\"api\"}";
    assert_eq!(served_of_20("127.0.0.4", address, ca_pem).await, 20, "an address never struck off opens what it likes");

    let mut guesser = connect_from("127.0.0.4", address, ca_pem).await.unwrap();
    for _ in 0..STRIKES_BURST as usize {
        assert_eq!(status(&mut guesser, "/locked").await, Some(StatusCode::UNAUTHORIZED));
    }
    assert_eq!(status(&mut guesser, "/locked").await, None, "struck off");

    let before = counter(series);
    let began = std::time::Instant::now();
    let again = served_of_20("127.0.0.4", address, ca_pem).await;
    // A second's worth at once, and what refilled while they connected.
    let refilled = (began.elapsed().as_secs_f64() * f64::from(RATE)).ceil() as u32;
    assert!((RATE..=RATE + refilled).contains(&again), "struck off, {again} of 20 served, {refilled} refilled");
    assert_eq!(counter(series) - before, f64::from(20 - again), "each closed one counted");
    assert_eq!(served_of_20("127.0.0.5", address, ca_pem).await, 20, "another address is not held back");
    stop.cancel();
}

#[tokio::test]
async fn an_address_struck_off_reconnects_at_its_rate_others_freely() {
    only_an_address_struck_off_is_gated(None, None).await;
}

#[tokio::test]
async fn over_https_an_address_struck_off_is_refused_before_the_handshake() {
    let ca = TestCa::new("public");
    let issued = ca.issue_names(&["localhost".to_owned()], "api");
    let tls = PublicTls::from_pem(issued.cert.as_bytes(), issued.key.as_bytes()).unwrap();
    only_an_address_struck_off_is_gated(Some(tls), Some(ca.pem())).await;
}

#[tokio::test]
async fn a_draining_listener_refuses_new_connections_while_its_streams_go_on() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let served = tokio::spawn(serve(listener, app(), HttpLimits::default(), stop.clone(), Duration::from_secs(60), "api"));
    let mut client = http1_from("127.0.0.1", address).await.expect("a connection");
    let mut streaming = client.send_request(request("http://test/stream")).await.unwrap().into_body();
    tokio::time::timeout(BOUND, streaming.frame()).await.unwrap().unwrap().unwrap();
    stop.cancel();
    // Refused, not queued on a listener nobody accepts from until the
    // drain ends: a proxy tries its next host at once.
    wait_until("the draining listener refuses a new connection", BOUND, async || TcpStream::connect(address).await.is_err()).await;
    let frame = tokio::time::timeout(BOUND, streaming.frame()).await.unwrap().unwrap().unwrap();
    assert!(frame.is_data(), "the stream in flight goes on through the drain");
    assert!(!served.is_finished());
}

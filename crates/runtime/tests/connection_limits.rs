//! Connections that hold a port without using it, over real sockets. On
//! HTTP: headers that never finish and kept-alive connections left idle
//! are closed (HTTP/1.1 and HTTP/2), while a response streamed for longer
//! than the idle timeout keeps its connection. On HTTP and gRPC:
//! connections over the open limits, in all and per address, are closed
//! as accepted, and each closed one gives its place back.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::routing::get;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use turbine_runtime::CancellationToken;
use turbine_runtime::connections::ConnectionLimits;
use turbine_runtime::http_server::{HttpLimits, serve};
use turbine_testkit::wait_until;

/// Bounds every wait on the server.
const BOUND: Duration = Duration::from_secs(10);

/// A stream of ten chunks a quarter of a second apart, and an answer
/// that takes one and a half: both longer than the idle timeout of the
/// test below.
fn app() -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route(
            "/flood",
            get(|| async {
                let guard = Flooding;
                let chunk = Bytes::from(vec![b'x'; 64 << 10]);
                Body::from_stream(futures::stream::repeat_with(move || {
                    let _held = &guard;
                    Ok::<_, std::convert::Infallible>(chunk.clone())
                }))
            }),
        )
        .route(
            "/stream",
            get(|| async {
                let chunks = futures::stream::unfold(0_u8, |sent| async move {
                    (sent < 10).then_some(())?;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    Some((Ok::<_, std::convert::Infallible>(Bytes::from(sent.to_string())), sent + 1))
                });
                Body::from_stream(chunks)
            }),
        )
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(1500)).await;
                "late"
            }),
        )
}

/// Answers of `/flood` ended (dropped: the server gave up on them).
static FLOODS_ENDED: AtomicUsize = AtomicUsize::new(0);

/// Held by an answer of `/flood` while it is sent.
struct Flooding;

impl Drop for Flooding {
    fn drop(&mut self) {
        FLOODS_ENDED.fetch_add(1, Ordering::Relaxed);
    }
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

/// The counter of connections closed on the HTTP API for `reason`.
fn closed(reason: &str) -> f64 {
    closed_on("api", reason)
}

/// The counter of connections closed on `listener` for `reason`.
fn closed_on(listener: &str, reason: &str) -> f64 {
    let series = format!("turbine_connections_closed_total{{listener=\"{listener}\",reason=\"{reason}\"}} ");
    let text = turbine_runtime::metrics::render();
    text.lines().find_map(|line| line.strip_prefix(&series)?.parse().ok()).unwrap_or(0.0)
}

/// Reads until the server closes the connection; what it sent.
async fn until_closed(mut stream: TcpStream) -> Vec<u8> {
    let mut received = Vec::new();
    tokio::time::timeout(BOUND, stream.read_to_end(&mut received)).await.expect("the server closes the connection").expect("read");
    received
}

#[tokio::test]
async fn headers_that_never_finish_and_idle_connections_are_closed_but_long_answers_keep_theirs() {
    let limits = HttpLimits { idle_timeout: Duration::from_secs(1), ..HttpLimits::default() };
    let (address, stop) = start(limits).await;
    let idle_before = closed("idle");

    // Headers begun and never finished: closed, with no answer.
    let mut slow = TcpStream::connect(address).await.unwrap();
    slow.write_all(b"GET / HTTP/1.1\r\nhost: test\r\nx-more: ").await.unwrap();
    // A connection that sends nothing at all.
    let silent = TcpStream::connect(address).await.unwrap();
    assert_eq!(until_closed(slow).await, b"", "unfinished headers get no answer");
    assert_eq!(until_closed(silent).await, b"");
    wait_until("both counted as idle, once each", BOUND, async || closed("idle") - idle_before == 2.0).await;

    // HTTP/1.1: a streamed answer and a slow one, each longer than the
    // idle timeout, on one kept-alive connection; then, idle, it closes.
    let (mut sender, connection) = http1::handshake(TokioIo::new(TcpStream::connect(address).await.unwrap())).await.unwrap();
    let connection = tokio::spawn(connection);
    let streamed = sender.send_request(request("/stream")).await.unwrap().into_body().collect().await.unwrap().to_bytes();
    assert_eq!(streamed, "0123456789");
    sender.ready().await.expect("the connection is kept after a long stream");
    let late = sender.send_request(request("/slow")).await.unwrap().into_body().collect().await.unwrap().to_bytes();
    assert_eq!(late, "late");
    let _ = tokio::time::timeout(BOUND, connection).await.expect("an idle connection is closed").unwrap();

    // HTTP/2 (prior knowledge, as gRPC clients and proxies speak it): the
    // same, the close a GOAWAY once nothing is in flight.
    let (mut sender, connection) = http2::handshake(TokioExecutor::new(), TokioIo::new(TcpStream::connect(address).await.unwrap())).await.unwrap();
    let connection = tokio::spawn(connection);
    let streamed = sender.send_request(request("http://test/stream")).await.unwrap().into_body().collect().await.unwrap().to_bytes();
    assert_eq!(streamed, "0123456789");
    let late = sender.send_request(request("http://test/slow")).await.expect("the connection is kept after a long stream");
    assert_eq!(late.into_body().collect().await.unwrap().to_bytes(), "late");
    let _ = tokio::time::timeout(BOUND, connection).await.expect("an idle HTTP/2 connection is closed").unwrap();
    wait_until("the kept-alive connections counted as idle", BOUND, async || closed("idle") - idle_before == 4.0).await;
    stop.cancel();
}

/// A client that asks for an endless answer and reads none of it: the
/// server's writes wait on it, and after the idle timeout the connection
/// is closed and the answer dropped (its request's place with it).
#[tokio::test]
async fn a_client_that_reads_nothing_of_its_answer_loses_the_connection() {
    let limits = HttpLimits { idle_timeout: Duration::from_secs(1), ..HttpLimits::default() };
    let (address, stop) = start(limits).await;
    let unread_before = closed("unread");
    let mut client = TcpStream::connect(address).await.unwrap();
    client.write_all(b"GET /flood HTTP/1.1\r\nhost: test\r\n\r\n").await.unwrap();
    wait_until("the unread answer is dropped", BOUND, async || FLOODS_ENDED.load(Ordering::Relaxed) == 1).await;
    wait_until("counted as unread", BOUND, async || closed("unread") - unread_before == 1.0).await;
    drop(client);
    stop.cancel();
}

/// A connection from `source` (a loopback address: Linux answers all of
/// 127/8) that has been served one request, or None if the server closed
/// it unserved.
async fn served_from(source: &str, address: SocketAddr) -> Option<http1::SendRequest<Empty<Bytes>>> {
    let socket = TcpSocket::new_v4().unwrap();
    socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
    let stream = socket.connect(address).await.unwrap();
    let (mut sender, connection) = http1::handshake(TokioIo::new(stream)).await.ok()?;
    tokio::spawn(connection);
    let response = tokio::time::timeout(BOUND, sender.send_request(request("/"))).await.expect("answered or closed").ok()?;
    response.into_body().collect().await.ok()?;
    Some(sender)
}

#[tokio::test]
async fn connections_over_the_open_limits_are_closed_as_accepted() {
    let limits = HttpLimits { connections: ConnectionLimits { max_connections: 3, connections_per_ip: 2 }, ..HttpLimits::default() };
    let (address, stop) = start(limits).await;
    let (address_before, full_before) = (closed("address"), closed("full"));
    let first = served_from("127.0.0.1", address).await.expect("first from its address");
    let _second = served_from("127.0.0.1", address).await.expect("second from its address");
    assert!(served_from("127.0.0.1", address).await.is_none(), "a third from one address is closed");
    wait_until("counted as over its address's limit", BOUND, async || closed("address") - address_before == 1.0).await;
    let _third = served_from("127.0.0.2", address).await.expect("another address is served");
    assert!(served_from("127.0.0.3", address).await.is_none(), "a fourth in all is closed");
    wait_until("counted as over the limit in all", BOUND, async || closed("full") - full_before == 1.0).await;
    // A connection closed gives its place back.
    drop(first);
    wait_until("the first address's place is given back", BOUND, async || served_from("127.0.0.1", address).await.is_some()).await;
    stop.cancel();
}

/// A gRPC health call over a connection of its own from `source`:
/// whether it was answered.
async fn grpc_served_from(source: &str, endpoint: &str) -> Option<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_owned())
        .unwrap()
        .local_address(Some(source.parse().unwrap()))
        .connect_timeout(BOUND)
        .connect()
        .await
        .ok()?;
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let call = health.check(tonic_health::pb::HealthCheckRequest { service: String::new() });
    tokio::time::timeout(BOUND, call).await.expect("answered or closed").ok()?;
    Some(channel)
}

#[tokio::test]
async fn grpc_connections_over_the_open_limits_are_closed_as_accepted() {
    use turbine_runtime::grpc::{Accepting, ServerSecurity, base_routes};
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let (readiness, health) = turbine_runtime::health::Readiness::new(&["svc"]).await;
    readiness.set_ready(true).await;
    let stop = CancellationToken::new();
    let accepting = Accepting { gate: None, limits: ConnectionLimits { max_connections: 3, connections_per_ip: 2 }, ..Default::default() };
    let routes = base_routes(health, &[]);
    let security = ServerSecurity::Plaintext;
    tokio::spawn(turbine_runtime::grpc::serve(listener, routes, stop.clone(), Duration::from_secs(1), BOUND, 16, security, &[], accepting));
    // A channel connects again when its connection is closed: each
    // attempt is counted.
    let (address_before, full_before) = (closed_on("grpc", "address"), closed_on("grpc", "full"));
    let first = grpc_served_from("127.0.0.1", &endpoint).await.expect("first from its address");
    let _second = grpc_served_from("127.0.0.1", &endpoint).await.expect("second from its address");
    assert!(grpc_served_from("127.0.0.1", &endpoint).await.is_none(), "a third from one address is closed");
    wait_until("counted as over its address's limit", BOUND, async || closed_on("grpc", "address") - address_before >= 1.0).await;
    let _third = grpc_served_from("127.0.0.2", &endpoint).await.expect("another address is served");
    assert!(grpc_served_from("127.0.0.3", &endpoint).await.is_none(), "a fourth in all is closed");
    wait_until("counted as over the limit in all", BOUND, async || closed_on("grpc", "full") - full_before >= 1.0).await;
    drop(first);
    wait_until("the first address's place is given back", BOUND, async || grpc_served_from("127.0.0.1", &endpoint).await.is_some()).await;
    stop.cancel();
}

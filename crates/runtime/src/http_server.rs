//! Serving HTTP (the gateway's REST API, every admin port) so that no
//! client holds a port it does not use: a connection whose request
//! headers take longer than the idle timeout, that has no request in
//! flight for that long, or whose client reads nothing of its answer for
//! that long, is closed; open connections are bounded, in all and per
//! client ([`crate::connections`]). A stream being answered (SSE tokens)
//! to a client reading it is a request in flight however long it lasts.
//!
//! A client's answers 401 (no API key, a wrong one) are refusals of its
//! connection ([`crate::strikes`]): past 16 at once, then one a second,
//! the connection is dropped and the client must connect again, which
//! for the next minute its address may do only at
//! `--connection-rate-per-ip` ([`crate::gate::StruckOff`]; over HTTPS the
//! TLS listener holds that gate, before the handshake). A trusted proxy's
//! connections carry many clients: never dropped for their 401s.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::serve::Listener;
use bytes::Bytes;
use http_body::{Frame, SizeHint};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

use crate::connections::{CLOSED, ConnectionLimits, OpenConnections};
use crate::gate::StruckOff;
use crate::proxies::TrustedProxies;
use crate::strikes::Strikes;

/// What an HTTP listener allows each client.
#[derive(Debug, Clone)]
pub struct HttpLimits {
    /// A request's headers must arrive within this, and a connection with
    /// no request in flight is closed after it.
    pub idle_timeout: Duration,
    /// Connections open at once.
    pub connections: ConnectionLimits,
    /// The addresses whose connections were struck off lately, and the
    /// rate they may connect at (None: not gated).
    pub struck_off: Option<Arc<StruckOff>>,
    /// The listener gates its connections itself, as it accepts them
    /// (over HTTPS, before the handshake:
    /// [`crate::public_tls::PublicTls::listener`]).
    pub gated_by_listener: bool,
    /// Proxies whose connections carry many clients' requests: never
    /// closed for their 401s.
    pub proxies: TrustedProxies,
}

impl Default for HttpLimits {
    /// The limits of a listener whose service set none: no rate.
    fn default() -> Self {
        Self {
            idle_timeout: Duration::from_secs(30),
            connections: ConnectionLimits::default(),
            struck_off: None,
            gated_by_listener: false,
            proxies: TrustedProxies::default(),
        }
    }
}

/// Serves `router` on `listener` under `limits` until `shutdown` fires;
/// then closes the listener, asks every connection to close once its requests
/// are answered and waits for them up to `grace`. `name` labels its
/// metrics (`api`, `admin`).
pub async fn serve<L>(
    mut listener: L,
    router: Router,
    limits: HttpLimits,
    shutdown: CancellationToken,
    grace: Duration,
    name: &'static str,
) -> std::io::Result<()>
where
    L: Listener<Addr = SocketAddr>,
{
    let mut builder = Builder::new(TokioExecutor::new());
    // The timer is what makes hyper keep its header timeout (which it
    // restarts for each request of a kept-alive connection).
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.idle_timeout);
    builder.http2().timer(TokioTimer::new()).enable_connect_protocol().keep_alive_interval(Duration::from_secs(20)).keep_alive_timeout(Duration::from_secs(10));
    let open = OpenConnections::new(name, limits.connections);
    let gate = limits.struck_off.clone().filter(|_| !limits.gated_by_listener);
    let connections = TaskTracker::new();
    loop {
        let (io, peer) = tokio::select! {
            accepted = listener.accept() => accepted,
            () = shutdown.cancelled() => break,
        };
        // Over the rate or the limits: dropped, closing it.
        if gate.as_ref().is_some_and(|gate| !gate.admit(peer.ip())) {
            continue;
        }
        let Some(slot) = open.admit(peer.ip()) else { continue };
        let (builder, router, shutdown) = (builder.clone(), router.clone(), shutdown.clone());
        let (idle_timeout, strikes) = (limits.idle_timeout, Arc::new(Strikes::http(limits.proxies.trusts(peer.ip()))));
        let struck_off = limits.struck_off.clone();
        connections.spawn(async move {
            let _slot = slot;
            let unread = Arc::new(AtomicBool::new(false));
            let io = TokioIo::new(WriteDeadline { inner: io, limit: idle_timeout, stalled: None, fired: unread.clone(), strikes: strikes.clone() });
            let connection = Connection { peer, idle_timeout, name, strikes, struck_off };
            serve_connection(builder, io, router, connection, shutdown, &unread).await;
        });
    }
    // Closed at once: a client connecting from now on is refused (and a
    // proxy tries another host), not left waiting on a listener nobody
    // accepts from until the drain ends.
    drop(listener);
    connections.close();
    // Connections were told to close as the token fired; the drain's
    // grace bounds how long their requests get.
    let drained = async {
        connections.wait().await;
        Ok::<(), std::io::Error>(())
    };
    crate::shutdown::drain_within(drained, &shutdown, grace, "HTTP requests").await
}

/// One accepted connection: from `peer`, closed after `idle_timeout` with
/// no request in flight, its 401s counted in `strikes` (struck off, its
/// address is marked in `struck_off`); `name` labels its metrics.
struct Connection {
    peer: SocketAddr,
    idle_timeout: Duration,
    name: &'static str,
    strikes: Arc<Strikes>,
    struck_off: Option<Arc<StruckOff>>,
}

/// Runs one connection to its end: closed gracefully (its requests
/// answered first) on shutdown or when idle; dropped, its requests with
/// it, once its 401s have used its strikes; `unread` says whether its
/// write deadline closed it.
async fn serve_connection<I>(builder: Builder<TokioExecutor>, io: I, router: Router, accepted: Connection, shutdown: CancellationToken, unread: &AtomicBool)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
{
    let Connection { peer, idle_timeout, name, strikes, struck_off } = accepted;
    let (in_flight, mut watch_in_flight) = watch::channel(0_usize);
    let in_flight = Arc::new(in_flight);
    let refusals = strikes.clone();
    let service = hyper::service::service_fn(move |mut request: hyper::Request<Incoming>| {
        let (router, in_flight, refusals) = (router.clone(), InFlight::start(&in_flight), refusals.clone());
        // Handlers learn who is calling as with `axum::serve`.
        request.extensions_mut().insert(axum::extract::ConnectInfo(peer));
        async move {
            let response = router.oneshot(request.map(Body::new)).await.unwrap_or_else(|never: Infallible| match never {});
            if response.status() == http::StatusCode::UNAUTHORIZED {
                refusals.strike();
            }
            Ok::<_, Infallible>(response.map(|body| Body::new(Held { body, _in_flight: in_flight })))
        }
    });
    let mut connection = pin!(builder.serve_connection_with_upgrades(io, service));
    let (mut closing, mut idle_closed) = (false, false);
    let result = loop {
        tokio::select! {
            // Struck off: dropped at once (its writes were refused from
            // the strike on, so not even the answer that struck it went).
            biased;
            () = strikes.closed() => break Ok(()),
            result = connection.as_mut() => break result,
            () = shutdown.cancelled(), if !closing => {
                connection.as_mut().graceful_shutdown();
                closing = true;
            }
            () = idle(&mut watch_in_flight, idle_timeout), if !closing => {
                connection.as_mut().graceful_shutdown();
                (closing, idle_closed) = (true, true);
            }
        }
    };
    // Struck off (seen here, or as the refused write that ended the
    // connection): its address is marked before the socket closes, so
    // the client's next connection meets the gate.
    if strikes.is_closed() {
        if let Some(struck_off) = &struck_off {
            struck_off.mark(peer.ip());
        }
        return;
    }
    // hyper's own header timeout closes an HTTP/1 connection whose
    // headers (a first request's or the next one's) are late; the watch
    // above closes the rest; the write deadline, one whose client stopped
    // reading. Each connection counted once.
    let timed_out = result.as_ref().err().and_then(|error| error.downcast_ref::<hyper::Error>()).is_some_and(hyper::Error::is_timeout);
    if unread.load(Ordering::Relaxed) {
        CLOSED.with_label_values(&[name, "unread"]).inc();
    } else if idle_closed || timed_out {
        CLOSED.with_label_values(&[name, "idle"]).inc();
    } else if let Err(error) = result {
        tracing::debug!(%error, "HTTP connection ended with an error");
    }
}

/// Resolves once no request has been in flight for `timeout`.
async fn idle(in_flight: &mut watch::Receiver<usize>, timeout: Duration) {
    loop {
        if *in_flight.borrow_and_update() == 0 {
            tokio::select! {
                () = tokio::time::sleep(timeout) => return,
                changed = in_flight.changed() => if changed.is_err() { return },
            }
        } else if in_flight.changed().await.is_err() {
            return;
        }
    }
}

/// One request in flight on a connection, until its response body ends
/// or is dropped.
struct InFlight(Arc<watch::Sender<usize>>);

impl InFlight {
    fn start(counter: &Arc<watch::Sender<usize>>) -> Self {
        counter.send_modify(|count| *count += 1);
        Self(counter.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.send_modify(|count| *count -= 1);
    }
}

/// A response body that keeps its request counted while it is sent.
struct Held {
    body: Body,
    _in_flight: InFlight,
}

impl http_body::Body for Held {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A connection whose writes fail once one has waited `limit` for the
/// client to read: a client that stops reading its answer would otherwise
/// hold the connection, and its request's place, for good (the answer's
/// writes wait on it forever).
struct WriteDeadline<I> {
    inner: I,
    limit: Duration,
    /// Since the first write that could not go, if the one now waiting is.
    stalled: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Set once the deadline passed.
    fired: Arc<AtomicBool>,
    /// The connection's refusals: once it is struck off, nothing more is
    /// written.
    strikes: Arc<Strikes>,
}

impl<I> WriteDeadline<I> {
    /// Follows a write's poll: waiting, the deadline runs (and, passed,
    /// fails the write); done, it is forgotten.
    fn watch<T>(&mut self, cx: &mut Context<'_>, polled: Poll<std::io::Result<T>>) -> Poll<std::io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let limit = self.limit;
        let stalled = self.stalled.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => {
                self.fired.store(true, Ordering::Relaxed);
                Poll::Ready(Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the client read nothing of its answer for the idle timeout")))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

/// The error of a write to a connection struck off for its refusals.
fn struck_off() -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "closed for its refusals")
}

impl<I: AsyncRead + Unpin> AsyncRead for WriteDeadline<I> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for WriteDeadline<I> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        if self.strikes.is_closed() {
            return Poll::Ready(Err(struck_off()));
        }
        let polled = Pin::new(&mut self.inner).poll_write(cx, data);
        self.watch(cx, polled)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[std::io::IoSlice<'_>]) -> Poll<std::io::Result<usize>> {
        if self.strikes.is_closed() {
            return Poll::Ready(Err(struck_off()));
        }
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, data);
        self.watch(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        if self.strikes.is_closed() {
            return Poll::Ready(Err(struck_off()));
        }
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.watch(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.watch(cx, polled)
    }
}

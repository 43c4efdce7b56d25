//! Refusals per connection: a caller refused again and again on one kept
//! gRPC connection (a certificate whose role may not call the rpc, call
//! after call) loses the connection. Each connection holds a bucket of
//! [`STRIKES_BURST`] refusals, refilled at [`STRIKES_PER_SEC`] a second;
//! the refusal that finds it empty closes the connection (its calls in
//! flight end with it). The caller must connect again, and so meets the
//! handshake and the connection gate ([`crate::gate`]): refusals cost it
//! what they cost the service. A service never refuses its own
//! deployment's callers by role, so a well-configured peer never comes
//! near the bucket's bottom.
//!
//! A connection is wrapped as it is accepted ([`Struck`]); its
//! [`Strikes`] ride each call's connection info, where the authorization
//! layer finds them. The refusals a handler makes of a call the role
//! check let through (events in another worker's name, a KV handle with
//! another's token: [`crate::trust::refuse`]) strike the same bucket: the
//! layer runs each call within its connection's strikes ([`within`]).
//!
//! A trusted proxy's connection ([`crate::proxies`]) carries many clients'
//! calls: its refusals are counted but never close it.
//!
//! HTTP connections ([`crate::http_server`]) hold the same bucket: each
//! answer 401 (a missing or wrong API key) is a refusal, and the one that
//! finds the bucket empty drops the connection, its requests in flight
//! with it ([`Strikes::http`], [`Strikes::closed`]).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::Instant;

use futures::task::AtomicWaker;
use parking_lot::Mutex;
use prometheus::IntCounter;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::server::{Connected, TcpConnectInfo};

/// Refusals a connection may take at once.
pub const STRIKES_BURST: f64 = 16.0;

/// Refusals a connection may take each second beyond the burst.
pub const STRIKES_PER_SEC: f64 = 1.0;

static STRUCK_OFF: LazyLock<IntCounter> = LazyLock::new(|| {
    crate::metrics::counter(
        "turbine_grpc_connections_struck_off_total",
        "gRPC connections closed because their caller was refused (wrong role, no role) more than 16 calls at once, then more than one a second: it must connect again",
        &[],
    )
    .with_label_values(&[] as &[&str])
});

static HTTP_STRUCK_OFF: LazyLock<IntCounter> = LazyLock::new(|| {
    crate::metrics::counter(
        "turbine_http_connections_struck_off_total",
        "HTTP connections closed because their client was answered 401 (no API key, a wrong one) more than 16 times at once, then more than once a second: it must connect again",
        &[],
    )
    .with_label_values(&[] as &[&str])
});

/// One connection's refusals.
#[derive(Debug)]
pub struct Strikes {
    /// Refusals left, and when last refilled.
    bucket: Mutex<(f64, Instant)>,
    closed: AtomicBool,
    /// The connection is a trusted proxy's, carrying many clients' calls:
    /// never closed for its refusals.
    shared: bool,
    /// An HTTP connection's (counted apart from gRPC's).
    http: bool,
    /// The connection's reader, woken to see it closed.
    reader: AtomicWaker,
}

impl Default for Strikes {
    fn default() -> Self {
        Self::new(false)
    }
}

impl Strikes {
    /// A full bucket; a `shared` connection (a trusted proxy's) is never
    /// closed for its refusals.
    pub fn new(shared: bool) -> Self {
        Self { bucket: Mutex::new((STRIKES_BURST, Instant::now())), closed: AtomicBool::new(false), shared, http: false, reader: AtomicWaker::new() }
    }

    /// An HTTP connection's: as [`Strikes::new`], counted in
    /// `turbine_http_connections_struck_off_total`.
    pub fn http(shared: bool) -> Self {
        Self { http: true, ..Self::new(shared) }
    }

    /// Counts a refusal; the one past the bucket's bottom closes the
    /// connection, unless it is shared. Whether it is closed now.
    pub fn strike(&self) -> bool {
        if self.shared {
            return false;
        }
        let now = Instant::now();
        let mut bucket = self.bucket.lock();
        let (left, at) = &mut *bucket;
        *left = (*left + now.saturating_duration_since(*at).as_secs_f64() * STRIKES_PER_SEC).min(STRIKES_BURST);
        *at = now;
        if *left >= 1.0 {
            *left -= 1.0;
            return false;
        }
        drop(bucket);
        if !self.closed.swap(true, Ordering::AcqRel) {
            if self.http {
                HTTP_STRUCK_OFF.inc();
                tracing::warn!("a client answered 401 request after request on one HTTP connection: the connection is closed");
            } else {
                STRUCK_OFF.inc();
                tracing::warn!("a caller refused call after call on one connection: the connection is closed");
            }
            self.reader.wake();
        }
        true
    }

    /// Whether the connection was closed for its refusals.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// Resolves once the connection is closed for its refusals. One task
    /// waits on it (the connection's reader: [`Struck`] or the HTTP
    /// server's connection), never both.
    pub async fn closed(&self) {
        std::future::poll_fn(|cx| {
            self.reader.register(cx.waker());
            if self.is_closed() { Poll::Ready(()) } else { Poll::Pending }
        })
        .await;
    }
}

/// An accepted connection that ends (reads as closed, refuses writes) once
/// its [`Strikes`] say so.
#[derive(Debug)]
pub struct Struck {
    inner: TcpStream,
    strikes: Arc<Strikes>,
    /// Its place among the listener's open connections.
    _slot: crate::connections::Slot,
}

impl Struck {
    /// `stream`, holding `slot`, with a full bucket of refusals; `shared`:
    /// a trusted proxy's, never closed for them.
    pub fn new(stream: TcpStream, slot: crate::connections::Slot, shared: bool) -> Self {
        Self { inner: stream, strikes: Arc::new(Strikes::new(shared)), _slot: slot }
    }
}

/// A connection's info as calls see it: its addresses and its strikes.
#[derive(Debug, Clone)]
pub struct StruckInfo {
    /// The connection's addresses.
    pub tcp: TcpConnectInfo,
    /// Its refusals.
    pub strikes: Arc<Strikes>,
}

/// The connection info of a call to a server of [`crate::grpc::serve`]
/// (over TLS or not).
pub fn connection_info(extensions: &http::Extensions) -> Option<&StruckInfo> {
    match extensions.get::<StruckInfo>() {
        Some(info) => Some(info),
        None => Some(extensions.get::<tonic::transport::server::TlsConnectInfo<StruckInfo>>()?.get_ref()),
    }
}

/// The address a call to a server of [`crate::grpc::serve`] came from
/// (over TLS or not).
pub fn peer_address<T>(request: &tonic::Request<T>) -> Option<std::net::IpAddr> {
    connection_info(request.extensions())?.tcp.remote_addr().map(|address| address.ip())
}

tokio::task_local! {
    /// The strikes of the connection whose call is being handled.
    static CALLER: Arc<Strikes>;
}

/// `call` (a call's handling), with `strikes` as those its handler's
/// refusals count against ([`strike_caller`]).
pub fn within<F: std::future::Future>(strikes: Arc<Strikes>, call: F) -> tokio::task::futures::TaskLocalFuture<Arc<Strikes>, F> {
    CALLER.scope(strikes, call)
}

/// The call being handled is refused: a strike against its connection, as
/// the role check's refusals are. Nothing outside a call's handling (an
/// in-process client, a stream's body sent after the handler returned).
pub fn strike_caller() {
    let _ = CALLER.try_with(|strikes| strikes.strike());
}

impl Connected for Struck {
    type ConnectInfo = StruckInfo;

    fn connect_info(&self) -> StruckInfo {
        StruckInfo { tcp: self.inner.connect_info(), strikes: self.strikes.clone() }
    }
}

impl AsyncRead for Struck {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.strikes.reader.register(cx.waker());
        if this.strikes.is_closed() {
            // End of stream: the server drops the connection.
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for Struck {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.strikes.is_closed() {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::ConnectionAborted, "closed for its refusals")));
        }
        Pin::new(&mut this.inner).poll_write(cx, data)
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.strikes.is_closed() {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::ConnectionAborted, "closed for its refusals")));
        }
        Pin::new(&mut this.inner).poll_write_vectored(cx, data)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_handlers_refusals_strike_the_connection_of_the_call_only() {
        let strikes = Arc::new(Strikes::default());
        within(strikes.clone(), async {
            for _ in 0..=STRIKES_BURST as usize {
                strike_caller();
            }
        })
        .await;
        assert!(strikes.is_closed(), "one past the burst within the call");
        // Outside any call's handling there is nothing to strike.
        strike_caller();
        let other = Arc::new(Strikes::default());
        within(other.clone(), async { strike_caller() }).await;
        assert!(!other.is_closed());
    }

    #[test]
    fn the_refusal_past_the_burst_closes_the_connection() {
        let strikes = Strikes::default();
        for _ in 0..STRIKES_BURST as usize {
            assert!(!strikes.strike());
        }
        assert!(strikes.strike(), "one past the burst");
        assert!(strikes.is_closed() && strikes.strike(), "closed stays closed");
    }

    #[test]
    fn a_shared_connection_is_never_closed_for_its_refusals() {
        let strikes = Strikes::new(true);
        for _ in 0..10 * STRIKES_BURST as usize {
            assert!(!strikes.strike());
        }
        assert!(!strikes.is_closed());
    }
}

//! How fast one address may open gRPC connections: a [`ConnectionGate`]
//! closes a connection from an address over its rate as soon as it is
//! accepted, before any TLS work. Services keep their connections open
//! (clients pool them), so only a caller that connects again and again is
//! held back; under mutual TLS each connection costs both sides a
//! handshake, and a flood of them (an attacker, a client in a reconnect
//! loop) would otherwise take the cores from the calls being served.
//!
//! An HTTP client needs a connection per request it has in flight
//! (HTTP/1.1), so its connections are not gated so: only an address
//! whose HTTP connection was struck off for its 401s ([`crate::strikes`])
//! is, for the minute after ([`StruckOff`]), over HTTPS before the
//! handshake. A client guessing keys then pays a connection, and at most
//! the rate of them a second, for every 16 guesses.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

use parking_lot::Mutex;
use prometheus::IntCounter;

static REFUSED: LazyLock<IntCounter> = LazyLock::new(|| {
    crate::metrics::counter(
        "turbine_grpc_connections_refused_total",
        "gRPC connections closed as accepted, before TLS, because their address opened more than --connection-rate-per-ip a second",
        &[],
    )
    .with_label_values(&[] as &[&str])
});

static HTTP_REFUSED: LazyLock<prometheus::IntCounterVec> = LazyLock::new(|| {
    crate::metrics::counter(
        "turbine_http_connections_refused_total",
        "HTTP connections closed as accepted, before TLS, because their address opened more than --connection-rate-per-ip a second, by listener (api, admin)",
        &["listener"],
    )
});

/// Addresses remembered at most; past it, those with full buckets are
/// forgotten (a full bucket is what a new address starts with), and if
/// that is not enough (a caller cycling through many addresses, as an
/// IPv6 prefix allows), all of them: the memory stays bounded, and the
/// addresses start again from full buckets.
const ADDRESSES_REMEMBERED: usize = 4096;

/// Seconds between two log lines about refused connections.
const LOG_EVERY_SECS: u64 = 10;

/// Per address, a bucket of `rate` connections a second holding a
/// second's worth.
#[derive(Debug)]
pub struct ConnectionGate {
    rate: f64,
    buckets: Mutex<HashMap<IpAddr, (f64, Instant)>>,
    started: Instant,
    logged_at: AtomicU64,
    refused_since_log: AtomicU64,
    /// Where its refusals are counted, and what its log calls them.
    refused: IntCounter,
    what: &'static str,
}

impl ConnectionGate {
    /// A gate letting each address open `rate` connections a second (a
    /// second's worth at once); `None` for 0 (no limit).
    pub fn new(rate: u32) -> Option<Self> {
        Self::counted(rate, REFUSED.clone(), "gRPC connections")
    }

    /// The same for an HTTP listener (`listener`: `api`, `admin`),
    /// counted in `turbine_http_connections_refused_total`.
    pub fn http(rate: u32, listener: &str) -> Option<Self> {
        Self::counted(rate, HTTP_REFUSED.with_label_values(&[listener]), "HTTP connections")
    }

    fn counted(rate: u32, refused: IntCounter, what: &'static str) -> Option<Self> {
        (rate > 0).then(|| Self {
            rate: f64::from(rate),
            buckets: Mutex::new(HashMap::new()),
            started: Instant::now(),
            logged_at: AtomicU64::new(0),
            refused_since_log: AtomicU64::new(0),
            refused,
            what,
        })
    }

    /// Whether a connection from `address` may be served now (counted and
    /// logged, now and then, when not).
    pub fn admit(&self, address: IpAddr) -> bool {
        let now = Instant::now();
        let admitted = {
            let mut buckets = self.buckets.lock();
            if buckets.len() >= ADDRESSES_REMEMBERED && !buckets.contains_key(&address) {
                let rate = self.rate;
                buckets.retain(|_, (level, at)| *level + now.saturating_duration_since(*at).as_secs_f64() * rate < rate);
                if buckets.len() >= ADDRESSES_REMEMBERED {
                    buckets.clear();
                }
            }
            let (level, at) = buckets.entry(address).or_insert((self.rate, now));
            *level = (*level + now.saturating_duration_since(*at).as_secs_f64() * self.rate).min(self.rate);
            *at = now;
            if *level >= 1.0 {
                *level -= 1.0;
                true
            } else {
                false
            }
        };
        if !admitted {
            self.refused.inc();
            let refused = self.refused_since_log.fetch_add(1, Relaxed) + 1;
            let second = now.duration_since(self.started).as_secs() + LOG_EVERY_SECS;
            let last = self.logged_at.load(Relaxed);
            if second >= last + LOG_EVERY_SECS && self.logged_at.compare_exchange(last, second, Relaxed, Relaxed).is_ok() {
                self.refused_since_log.store(0, Relaxed);
                tracing::warn!(%address, refused, rate = self.rate, "{} closed as accepted: an address opening more than its rate (logged at most every 10 s)", self.what);
            }
        }
        admitted
    }
}

/// How long an address whose HTTP connection was struck off stays gated.
pub const STRUCK_OFF_FOR: std::time::Duration = std::time::Duration::from_secs(60);

/// Addresses whose HTTP connections were struck off lately (IPv6 by /64),
/// each gated at the listener's rate until [`STRUCK_OFF_FOR`] has passed
/// since its last; the others pass freely.
#[derive(Debug)]
pub struct StruckOff {
    gate: ConnectionGate,
    marked: Mutex<HashMap<IpAddr, Instant>>,
}

impl StruckOff {
    /// `listener`'s (`api`, `admin`), gating at `rate` connections a
    /// second; `None` for 0 (no gate).
    pub fn new(rate: u32, listener: &str) -> Option<std::sync::Arc<Self>> {
        Some(std::sync::Arc::new(Self { gate: ConnectionGate::http(rate, listener)?, marked: Mutex::new(HashMap::new()) }))
    }

    /// A connection from `address` was struck off.
    pub fn mark(&self, address: IpAddr) {
        let now = Instant::now();
        let mut marked = self.marked.lock();
        if marked.len() >= ADDRESSES_REMEMBERED {
            marked.retain(|_, at| now.saturating_duration_since(*at) < STRUCK_OFF_FOR);
            if marked.len() >= ADDRESSES_REMEMBERED {
                // Bounded memory: forgotten, they start again unmarked.
                marked.clear();
            }
        }
        marked.insert(crate::connections::client(address), now);
    }

    /// Whether a connection from `address` may be served now.
    pub fn admit(&self, address: IpAddr) -> bool {
        let client = crate::connections::client(address);
        let struck = self.marked.lock().get(&client).is_some_and(|at| at.elapsed() < STRUCK_OFF_FOR);
        !struck || self.gate.admit(client)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_address_opens_its_rate_and_no_more() {
        let gate = ConnectionGate::new(5).unwrap();
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let admitted = (0..20).filter(|_| gate.admit(a)).count();
        assert!((5..=6).contains(&admitted), "a second's worth at once: {admitted}");
        assert!(gate.admit(b), "another address has its own");
        assert!(ConnectionGate::new(0).is_none(), "0: no limit");
    }

    #[test]
    fn only_addresses_struck_off_are_gated() {
        let struck = StruckOff::new(5, "api").unwrap();
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "2001:db8::1".parse().unwrap());
        assert_eq!((0..50).filter(|_| struck.admit(a)).count(), 50, "unmarked: no gate");
        struck.mark(a);
        let admitted = (0..20).filter(|_| struck.admit(a)).count();
        assert!((5..=6).contains(&admitted), "marked: its rate: {admitted}");
        struck.mark(b);
        let neighbour: IpAddr = "2001:db8::2".parse().unwrap();
        assert!((5..=6).contains(&(0..20).filter(|_| struck.admit(neighbour)).count()), "an IPv6 /64 is one client");
        assert_eq!((0..50).filter(|_| struck.admit("10.0.0.2".parse().unwrap())).count(), 50, "another address passes");
        assert!(StruckOff::new(0, "api").is_none(), "0: no gate");
    }

    #[test]
    fn the_addresses_struck_off_cannot_grow_the_memory() {
        let struck = StruckOff::new(1, "api").unwrap();
        for n in 0..3 * ADDRESSES_REMEMBERED as u32 {
            struck.mark(IpAddr::from(std::net::Ipv4Addr::from(n)));
            assert!(struck.marked.lock().len() <= ADDRESSES_REMEMBERED);
        }
    }

    #[test]
    fn a_caller_cycling_through_addresses_cannot_grow_the_memory() {
        let gate = ConnectionGate::new(1).unwrap();
        for n in 0..3 * ADDRESSES_REMEMBERED as u32 {
            let address = IpAddr::from(std::net::Ipv6Addr::from(u128::from(n) | (0x2001_0db8 << 96)));
            gate.admit(address);
            gate.admit(address);
            assert!(gate.buckets.lock().len() <= ADDRESSES_REMEMBERED);
        }
    }
}

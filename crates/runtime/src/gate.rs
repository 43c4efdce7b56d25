//! How fast one address may open gRPC connections: a [`ConnectionGate`]
//! closes a connection from an address over its rate as soon as it is
//! accepted, before any TLS work. Services keep their connections open
//! (clients pool them), so only a caller that connects again and again is
//! held back; under mutual TLS each connection costs both sides a
//! handshake, and a flood of them (an attacker, a client in a reconnect
//! loop) would otherwise take the cores from the calls being served.

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
}

impl ConnectionGate {
    /// A gate letting each address open `rate` connections a second (a
    /// second's worth at once); `None` for 0 (no limit).
    pub fn new(rate: u32) -> Option<Self> {
        (rate > 0).then(|| Self {
            rate: f64::from(rate),
            buckets: Mutex::new(HashMap::new()),
            started: Instant::now(),
            logged_at: AtomicU64::new(0),
            refused_since_log: AtomicU64::new(0),
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
            REFUSED.inc();
            let refused = self.refused_since_log.fetch_add(1, Relaxed) + 1;
            let second = now.duration_since(self.started).as_secs() + LOG_EVERY_SECS;
            let last = self.logged_at.load(Relaxed);
            if second >= last + LOG_EVERY_SECS && self.logged_at.compare_exchange(last, second, Relaxed, Relaxed).is_ok() {
                self.refused_since_log.store(0, Relaxed);
                tracing::warn!(%address, refused, rate = self.rate, "gRPC connections closed as accepted: an address opening more than its rate (logged at most every 10 s)");
            }
        }
        admitted
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

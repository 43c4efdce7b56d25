//! Connections open on a listener, bounded in all and per client: a
//! connection over either bound is closed as it is accepted (and counted,
//! and logged now and then), so no client holds more than its share of a
//! port, and a flood of them never takes the file descriptors the service
//! needs for its own work. Every listener of a service (gRPC, the HTTP
//! API, admin) keeps its own count.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, LazyLock};
use std::time::Instant;

use parking_lot::Mutex;
use prometheus::{IntCounterVec, IntGaugeVec};

pub(crate) static CLOSED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    crate::metrics::counter(
        "turbine_connections_closed_total",
        "Connections a service closed to keep its limits, by listener (grpc, api, admin) and reason: full (--max-connections open already) and address (--connections-per-ip open from its address), both closed as accepted; idle (HTTP: a request's headers not received, or no request in flight, within --http-idle-timeout-secs); unread (HTTP: the client read nothing of its answer for --http-idle-timeout-secs)",
        &["listener", "reason"],
    )
});

static OPEN: LazyLock<IntGaugeVec> =
    LazyLock::new(|| crate::metrics::gauge("turbine_connections_open", "Connections open, by listener (grpc, api, admin)", &["listener"]));

/// Seconds between two log lines about connections closed as accepted.
const LOG_EVERY_SECS: u64 = 10;

/// How many connections a listener keeps open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Connections open at once.
    pub max_connections: usize,
    /// Connections open at once from one client: an IPv4 address, or an
    /// IPv6 /64 (what one host is given). 0: no limit.
    pub connections_per_ip: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self { max_connections: 10_000, connections_per_ip: 1_000 }
    }
}

impl ConnectionLimits {
    /// These limits with `max_connections` lowered to a quarter of the
    /// process's open-files limit where that is less: a service has
    /// several listeners, and needs descriptors for its own connections
    /// and files besides.
    pub fn within_descriptors(self) -> Self {
        match open_files_limit() {
            Some(descriptors) => self.within(descriptors),
            None => self,
        }
    }

    fn within(mut self, descriptors: u64) -> Self {
        let quarter = usize::try_from(descriptors / 4).unwrap_or(usize::MAX).max(1);
        if self.max_connections > quarter {
            tracing::warn!(
                max_connections = self.max_connections,
                descriptors,
                lowered_to = quarter,
                "--max-connections lowered to a quarter of the open-files limit (raise `ulimit -n` for more)"
            );
            self.max_connections = quarter;
        }
        self
    }
}

/// The soft limit on this process's open files, where the platform says.
fn open_files_limit() -> Option<u64> {
    rustix::process::getrlimit(rustix::process::Resource::Nofile).current
}

/// The most open files a process asks for when its hard limit is
/// unlimited: what a service's connections could use many times over.
const OPEN_FILES_CEILING: u64 = 1 << 20;

/// Raises this process's soft limit on open files to its hard limit (at
/// most [`OPEN_FILES_CEILING`]), as a server should: many systems start
/// services with a soft limit of 1,024, which would hold each port to 256
/// connections, while the hard limit allows far more. Returns the soft
/// limit before and after, when it was raised.
pub fn raise_open_files_limit() -> Option<(u64, u64)> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let before = limit.current?;
    let wanted = limit.maximum.unwrap_or(OPEN_FILES_CEILING).min(OPEN_FILES_CEILING);
    if wanted <= before {
        return None;
    }
    setrlimit(Resource::Nofile, Rlimit { current: Some(wanted), maximum: limit.maximum }).ok()?;
    Some((before, wanted))
}

/// Who a connection counts against: its IPv4 address, or its IPv6
/// address's /64 (an IPv4 address mapped into IPv6 is that address).
pub fn client(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V4(_) => address,
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !((1_u128 << 64) - 1))),
        },
    }
}

/// A listener's open connections, in all and per client.
#[derive(Debug)]
pub struct OpenConnections {
    listener: &'static str,
    limits: ConnectionLimits,
    counts: Mutex<(usize, HashMap<IpAddr, usize>)>,
    started: Instant,
    logged_at: AtomicU64,
    closed_since_log: AtomicU64,
}

impl OpenConnections {
    /// No connection open yet on `listener` (a metrics label: grpc, api,
    /// admin).
    pub fn new(listener: &'static str, limits: ConnectionLimits) -> Arc<Self> {
        Arc::new(Self {
            listener,
            limits,
            counts: Mutex::new((0, HashMap::new())),
            started: Instant::now(),
            logged_at: AtomicU64::new(0),
            closed_since_log: AtomicU64::new(0),
        })
    }

    /// A place for a connection from `address`, held until the returned
    /// slot drops; None when there is none (the connection is to be closed:
    /// counted, and logged at most every 10 s).
    pub fn admit(self: &Arc<Self>, address: IpAddr) -> Option<Slot> {
        match self.take(client(address)) {
            Ok(slot) => Some(slot),
            Err(reason) => {
                CLOSED.with_label_values(&[self.listener, reason]).inc();
                self.log(reason, address);
                None
            }
        }
    }

    fn take(self: &Arc<Self>, client: IpAddr) -> Result<Slot, &'static str> {
        let mut counts = self.counts.lock();
        let (total, per_client) = &mut *counts;
        if *total >= self.limits.max_connections {
            return Err("full");
        }
        let from_client = per_client.entry(client).or_insert(0);
        if self.limits.connections_per_ip > 0 && *from_client >= self.limits.connections_per_ip {
            return Err("address");
        }
        *from_client += 1;
        *total += 1;
        OPEN.with_label_values(&[self.listener]).inc();
        Ok(Slot { open: self.clone(), client })
    }

    fn log(&self, reason: &str, address: IpAddr) {
        let closed = self.closed_since_log.fetch_add(1, Relaxed) + 1;
        let (second, last) = (self.started.elapsed().as_secs() + LOG_EVERY_SECS, self.logged_at.load(Relaxed));
        if second >= last + LOG_EVERY_SECS && self.logged_at.compare_exchange(last, second, Relaxed, Relaxed).is_ok() {
            self.closed_since_log.store(0, Relaxed);
            let limits = self.limits;
            tracing::warn!(
                listener = self.listener,
                reason,
                %address,
                closed,
                max_connections = limits.max_connections,
                connections_per_ip = limits.connections_per_ip,
                "connections closed as accepted: over the open-connections limits (logged at most every 10 s)"
            );
        }
    }
}

/// A connection's place among the open ones, given back as it drops.
#[derive(Debug)]
pub struct Slot {
    open: Arc<OpenConnections>,
    client: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        OPEN.with_label_values(&[self.open.listener]).dec();
        let mut counts = self.open.counts.lock();
        let (total, per_client) = &mut *counts;
        *total -= 1;
        if let Some(count) = per_client.get_mut(&self.client) {
            *count -= 1;
            if *count == 0 {
                per_client.remove(&self.client);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn open_connections_are_bounded_in_all_and_per_client() {
        let open = OpenConnections::new("test", ConnectionLimits { max_connections: 3, connections_per_ip: 2 });
        let first = open.take(ip("10.0.0.1")).unwrap();
        let _second = open.take(ip("10.0.0.1")).unwrap();
        assert_eq!(open.take(ip("10.0.0.1")).err(), Some("address"));
        let _third = open.take(ip("10.0.0.2")).unwrap();
        assert_eq!(open.take(ip("10.0.0.3")).err(), Some("full"));
        drop(first);
        assert!(open.take(ip("10.0.0.1")).is_ok(), "a closed connection gives its place back");
        assert_eq!(open.counts.lock().1.len(), 2, "only clients with connections open are remembered");
    }

    #[test]
    fn zero_per_client_is_no_limit_but_the_total_holds() {
        let open = OpenConnections::new("test", ConnectionLimits { max_connections: 3, connections_per_ip: 0 });
        let _held: Vec<Slot> = (0..3).map(|_| open.take(ip("10.0.0.1")).unwrap()).collect();
        assert_eq!(open.take(ip("10.0.0.1")).err(), Some("full"));
    }

    #[test]
    fn an_ipv6_client_is_its_slash_64_and_a_mapped_ipv4_its_address() {
        assert_eq!(client(ip("2001:db8:1:2:aaaa::1")), client(ip("2001:db8:1:2:bbbb::2")));
        assert_ne!(client(ip("2001:db8:1:2::1")), client(ip("2001:db8:1:3::1")));
        assert_eq!(client(ip("::ffff:10.0.0.1")), ip("10.0.0.1"));
    }

    #[test]
    fn the_soft_open_files_limit_is_raised_to_the_hard_one() {
        super::raise_open_files_limit();
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        let wanted = limit.maximum.unwrap_or(super::OPEN_FILES_CEILING).min(super::OPEN_FILES_CEILING);
        let soft = limit.current.expect("a finite soft limit");
        assert!(soft >= wanted, "soft limit {soft}, hard {:?}", limit.maximum);
        assert_eq!(super::open_files_limit(), Some(soft));
    }

    #[test]
    fn the_total_is_lowered_to_a_quarter_of_the_descriptors() {
        let limits = ConnectionLimits::default();
        assert_eq!(limits.within(1024).max_connections, 256);
        assert_eq!(limits.within(1 << 20).max_connections, 10_000);
    }
}

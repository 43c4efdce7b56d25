//! Proxies a service trusts to say who their clients are.
//!
//! A proxy in front of a service (Envoy at the edge, `infra/envoy`) holds
//! a few connections to it and carries every client's requests over them.
//! Seen from the service, every request then comes from the proxy's
//! address, one client: the gateway's fair shares would count all end
//! clients as one, and a refusal striking its connection
//! ([`crate::strikes`]) would end every client's calls in flight on it.
//!
//! For a connection from a trusted proxy (`--trusted-proxies`, address
//! ranges), so:
//! - its refusals never close it (the proxy bounds each client's rate);
//! - the client of each request on it is the address the proxy appended
//!   to `X-Forwarded-For`: the entries are read from the right, past
//!   those of trusted proxies, and the first other one is the client (a
//!   client can put anything it likes to the left of what its proxy
//!   appends, nothing to the right). A request with no such entry is the
//!   proxy's own.
//!
//! For any other connection the header is ignored: whoever sends it.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// The header a proxy appends its client's address to.
pub const FORWARDED_FOR: &str = "x-forwarded-for";

/// Entries of a forwarded-for header read at most: a longer chain is
/// read from the right this far only.
const MAX_HOPS: usize = 16;

/// An address range: an address and how many of its leading bits a
/// member shares (`10.0.0.0/8`, `fd00::/8`; a bare address is the range
/// of itself alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddressRange {
    network: IpAddr,
    prefix: u8,
}

impl AddressRange {
    /// Whether `address` is in the range (an IPv4 address mapped into
    /// IPv6 is that IPv4 address).
    pub fn contains(&self, address: IpAddr) -> bool {
        match (self.network, canonical(address)) {
            (IpAddr::V4(network), IpAddr::V4(address)) => {
                let mask = u32::MAX.checked_shl(32 - u32::from(self.prefix)).unwrap_or(0);
                u32::from(network) & mask == u32::from(address) & mask
            }
            (IpAddr::V6(network), IpAddr::V6(address)) => {
                let mask = u128::MAX.checked_shl(128 - u32::from(self.prefix)).unwrap_or(0);
                u128::from(network) & mask == u128::from(address) & mask
            }
            _ => false,
        }
    }
}

fn canonical(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(address, IpAddr::V4),
        IpAddr::V4(_) => address,
    }
}

/// A range that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("'{0}' is not an address range: write an address (10.1.2.3, fd00::1) or one with a prefix length (10.0.0.0/8, fd00::/8)")]
pub struct BadRange(String);

impl FromStr for AddressRange {
    type Err = BadRange;

    fn from_str(text: &str) -> Result<Self, BadRange> {
        let bad = || BadRange(text.to_owned());
        let (address, prefix) = match text.trim().split_once('/') {
            Some((address, prefix)) => (address, Some(prefix)),
            None => (text.trim(), None),
        };
        let network = canonical(address.parse::<IpAddr>().map_err(|_| bad())?);
        let bits = if network.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(prefix) if prefix.bytes().all(|b| b.is_ascii_digit()) => prefix.parse::<u8>().map_err(|_| bad())?,
            Some(_) => return Err(bad()),
            None => bits,
        };
        if prefix > bits {
            return Err(bad());
        }
        Ok(Self { network, prefix })
    }
}

impl fmt::Display for AddressRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl Serialize for AddressRange {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for AddressRange {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer)?.parse().map_err(serde::de::Error::custom)
    }
}

/// The proxies a service trusts (none by default).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies {
    ranges: Vec<AddressRange>,
}

impl TrustedProxies {
    /// Proxies at addresses in `ranges`.
    pub fn new(ranges: &[AddressRange]) -> Self {
        Self { ranges: ranges.to_vec() }
    }

    /// Whether a connection from `address` is a trusted proxy's.
    pub fn trusts(&self, address: IpAddr) -> bool {
        self.ranges.iter().any(|range| range.contains(address))
    }

    /// The client of a request that came over a connection from `peer`
    /// with these `X-Forwarded-For` header values (in the order received):
    /// `peer` itself unless it is a trusted proxy that named a client.
    pub fn client<'a>(&self, peer: IpAddr, forwarded_for: impl IntoIterator<Item = &'a str>) -> IpAddr {
        if !self.trusts(peer) {
            return peer;
        }
        // Each header line's entries in order, the lines in order: the
        // rightmost entry is the last proxy's.
        let lines: Vec<&str> = forwarded_for.into_iter().collect();
        let mut client = peer;
        for entry in lines.iter().rev().flat_map(|line| line.rsplit(',')).take(MAX_HOPS) {
            let Some(address) = entry_address(entry) else {
                // Not an address: nothing left of it is believed.
                break;
            };
            client = address;
            if !self.trusts(address) {
                break;
            }
        }
        client
    }
}

/// The address of one forwarded-for entry (`10.1.2.3`, `10.1.2.3:4567`,
/// `fd00::1`, `[fd00::1]:4567`).
fn entry_address(entry: &str) -> Option<IpAddr> {
    let entry = entry.trim();
    entry.parse::<IpAddr>().ok().or_else(|| entry.parse::<SocketAddr>().ok().map(|address| address.ip())).map(canonical)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proxies(ranges: &[&str]) -> TrustedProxies {
        TrustedProxies::new(&ranges.iter().map(|range| range.parse().unwrap()).collect::<Vec<_>>())
    }

    fn ip(text: &str) -> IpAddr {
        text.parse().unwrap()
    }

    #[test]
    fn ranges_parse_and_hold_their_members() {
        let range: AddressRange = "10.0.0.0/8".parse().unwrap();
        assert!(range.contains(ip("10.255.1.2")) && !range.contains(ip("11.0.0.1")));
        assert!(range.contains(ip("::ffff:10.1.2.3")), "an IPv4 address mapped into IPv6");
        let one: AddressRange = "192.0.2.7".parse().unwrap();
        assert!(one.contains(ip("192.0.2.7")) && !one.contains(ip("192.0.2.8")));
        let v6: AddressRange = "fd00::/8".parse().unwrap();
        assert!(v6.contains(ip("fd12::1")) && !v6.contains(ip("fe80::1")) && !v6.contains(ip("10.0.0.1")));
        let all: AddressRange = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("203.0.113.9")));
        assert_eq!(range.to_string(), "10.0.0.0/8");
        for bad in ["", "10.0.0.0/33", "fd00::/129", "10.0.0/8", "10.0.0.0/-1", "10.0.0.0/+8", "example.com", "10.0.0.0/8/8"] {
            assert!(bad.parse::<AddressRange>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn only_a_trusted_proxy_names_its_client() {
        let trusted = proxies(&["10.0.0.0/8"]);
        // A client that is no proxy names itself, whatever it sends.
        assert_eq!(trusted.client(ip("203.0.113.9"), ["198.51.100.1"]), ip("203.0.113.9"));
        assert_eq!(TrustedProxies::default().client(ip("10.0.0.5"), ["198.51.100.1"]), ip("10.0.0.5"));
        // The proxy appended its client's address.
        assert_eq!(trusted.client(ip("10.0.0.5"), ["198.51.100.1"]), ip("198.51.100.1"));
        // Nothing appended: the proxy's own request.
        assert_eq!(trusted.client(ip("10.0.0.5"), []), ip("10.0.0.5"));
    }

    #[test]
    fn what_a_client_writes_left_of_its_proxys_entry_is_not_believed() {
        let trusted = proxies(&["10.0.0.0/8"]);
        // The client sent "10.9.9.9, 1.2.3.4" itself, hoping to be another
        // client, or a proxy; the proxy appended its real address.
        assert_eq!(trusted.client(ip("10.0.0.5"), ["10.9.9.9, 1.2.3.4, 198.51.100.1"]), ip("198.51.100.1"));
        assert_eq!(trusted.client(ip("10.0.0.5"), ["10.9.9.9, 1.2.3.4", "198.51.100.1"]), ip("198.51.100.1"), "over two header lines");
        // Two trusted proxies in a row: the first one's client.
        assert_eq!(trusted.client(ip("10.0.0.5"), ["1.2.3.4, 198.51.100.1, 10.0.0.7"]), ip("198.51.100.1"));
        // Garbage right of the client's entry ends the chain at the last
        // proxy that parsed.
        assert_eq!(trusted.client(ip("10.0.0.5"), ["198.51.100.1, junk, 10.0.0.7"]), ip("10.0.0.7"));
        assert_eq!(trusted.client(ip("10.0.0.5"), ["junk"]), ip("10.0.0.5"));
        // Ports and IPv6, mapped IPv4.
        assert_eq!(trusted.client(ip("10.0.0.5"), ["198.51.100.1:4711"]), ip("198.51.100.1"));
        assert_eq!(trusted.client(ip("10.0.0.5"), ["[2001:db8::1]:4711"]), ip("2001:db8::1"));
        assert_eq!(trusted.client(ip("::ffff:10.0.0.5"), ["::ffff:198.51.100.1"]), ip("198.51.100.1"));
    }

    #[test]
    fn a_long_chain_is_read_only_so_far() {
        let trusted = proxies(&["10.0.0.0/8"]);
        let chain = std::iter::repeat_n("10.1.1.1", 1_000).collect::<Vec<_>>().join(", ");
        let line = format!("198.51.100.1, {chain}");
        assert_eq!(trusted.client(ip("10.0.0.5"), [line.as_str()]), ip("10.1.1.1"), "every hop a proxy as far as read");
    }
}

//! What a process listens on, read from `/proc` (Linux).

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// The TCP addresses process `pid` listens on (IPv4 and IPv6), from its
/// open sockets and the kernel's socket tables.
pub fn listening_sockets(pid: u32) -> std::io::Result<Vec<SocketAddr>> {
    let mut inodes = HashSet::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        // A descriptor closed meanwhile is not an error.
        let Ok(target) = std::fs::read_link(entry?.path()) else { continue };
        if let Some(inode) = target.to_str().and_then(|target| target.strip_prefix("socket:[")).and_then(|rest| rest.strip_suffix(']')) {
            inodes.insert(inode.to_owned());
        }
    }
    let mut listening = Vec::new();
    for table in ["tcp", "tcp6"] {
        let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/net/{table}")) else { continue };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            const LISTEN: &str = "0A";
            if fields.len() > 9 && fields[3] == LISTEN && inodes.contains(fields[9]) {
                listening.extend(parse_address(fields[1]));
            }
        }
    }
    Ok(listening)
}

/// `0100007F:1F90` (IPv4) or 32 hex digits and a port (IPv6), each 32-bit
/// word in the host's byte order.
fn parse_address(text: &str) -> Option<SocketAddr> {
    let (ip, port) = text.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let words: Vec<u32> = (0..ip.len() / 8).map(|i| u32::from_str_radix(&ip[i * 8..i * 8 + 8], 16)).collect::<Result<_, _>>().ok()?;
    let bytes: Vec<u8> = words.iter().flat_map(|word| word.to_ne_bytes()).collect();
    let ip = match bytes.len() {
        4 => IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3])),
        16 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(bytes.as_slice()).ok()?)),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_listening_is_seen() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        assert!(listening_sockets(std::process::id()).unwrap().contains(&address));
        drop(listener);
        assert!(!listening_sockets(std::process::id()).unwrap().contains(&address));
    }
}

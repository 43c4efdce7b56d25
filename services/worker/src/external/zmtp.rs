//! The subscriber's and the dealer's sides of ZMTP 3.0 (ZeroMQ's wire
//! protocol, RFC 23) over TCP with the NULL mechanism: enough to receive
//! an engine's published KV events (the worker binds; the engine's PUB
//! socket connects to it) and to ask its replay socket (a ROUTER the
//! engine binds) for the ones missed. Every length a peer sends is bounded
//! before anything is allocated.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The most bytes one frame may carry (a batch of KV events with its
/// token ids is far smaller).
pub const MAX_FRAME_BYTES: u64 = 16 << 20;
/// The most frames one message may have (the engine's have three).
pub const MAX_PARTS: usize = 16;

/// Why a peer's bytes are not ZMTP this subscriber speaks.
#[derive(Debug, thiserror::Error)]
pub enum ZmtpError {
    /// The connection failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The peer broke the protocol.
    #[error("{0}")]
    Protocol(String),
}

fn protocol(message: impl Into<String>) -> ZmtpError {
    ZmtpError::Protocol(message.into())
}

/// Our greeting: signature, version 3.0, the NULL mechanism, as client.
pub(crate) fn greeting() -> [u8; 64] {
    let mut greeting = [0u8; 64];
    greeting[0] = 0xFF;
    greeting[9] = 0x7F;
    greeting[10] = 3;
    greeting[11] = 0;
    greeting[12..16].copy_from_slice(b"NULL");
    greeting
}

/// A frame's flags.
const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// One frame as read.
struct Frame {
    flags: u8,
    body: Vec<u8>,
}

async fn read_frame(stream: &mut (impl AsyncRead + Unpin)) -> Result<Frame, ZmtpError> {
    let flags = stream.read_u8().await?;
    if flags & !(MORE | LONG | COMMAND) != 0 {
        return Err(protocol(format!("a frame with reserved flags set ({flags:#04x})")));
    }
    let size = if flags & LONG != 0 { stream.read_u64().await? } else { u64::from(stream.read_u8().await?) };
    if size > MAX_FRAME_BYTES {
        return Err(protocol(format!("a frame of {size} bytes (at most {MAX_FRAME_BYTES})")));
    }
    let mut body = vec![0u8; size as usize];
    stream.read_exact(&mut body).await?;
    Ok(Frame { flags, body })
}

async fn write_frame(stream: &mut (impl AsyncWrite + Unpin), flags: u8, body: &[u8]) -> Result<(), ZmtpError> {
    let mut bytes = Vec::with_capacity(body.len() + 9);
    if body.len() > 255 {
        bytes.push(flags | LONG);
        bytes.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        bytes.push(flags);
        bytes.push(body.len() as u8);
    }
    bytes.extend_from_slice(body);
    stream.write_all(&bytes).await?;
    Ok(())
}

/// The metadata of a READY command: `Socket-Type` and the rest.
fn ready(socket_type: &str) -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(b"Socket-Type".len() as u8);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
    body.extend_from_slice(socket_type.as_bytes());
    body
}

/// The `Socket-Type` a READY command announces.
fn ready_socket_type(body: &[u8]) -> Result<String, ZmtpError> {
    let rest = body.strip_prefix(b"\x05READY").ok_or_else(|| protocol("the peer's first command is not READY"))?;
    let mut at = 0;
    while at < rest.len() {
        let name_len = rest[at] as usize;
        let name = rest.get(at + 1..at + 1 + name_len).ok_or_else(|| protocol("a truncated READY property"))?;
        at += 1 + name_len;
        let value_len = rest.get(at..at + 4).ok_or_else(|| protocol("a truncated READY property"))?;
        let value_len = u32::from_be_bytes(value_len.try_into().expect("four bytes")) as usize;
        let value = rest.get(at + 4..at + 4 + value_len).ok_or_else(|| protocol("a truncated READY property"))?;
        at += 4 + value_len;
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            return Ok(String::from_utf8_lossy(value).into_owned());
        }
    }
    Err(protocol("the peer's READY names no Socket-Type"))
}

/// Greets the peer as a `ours` socket and checks it speaks ZMTP 3 with the
/// NULL mechanism as one of the socket types in `theirs`.
async fn greet(stream: &mut (impl AsyncRead + AsyncWrite + Unpin), ours: &str, theirs: &[&str]) -> Result<(), ZmtpError> {
    stream.write_all(&greeting()).await?;
    let mut greeted = [0u8; 64];
    stream.read_exact(&mut greeted).await?;
    if greeted[0] != 0xFF || greeted[9] != 0x7F {
        return Err(protocol("not a ZMTP peer (no signature)"));
    }
    if greeted[10] < 3 {
        return Err(protocol(format!("ZMTP {}.{}: 3.0 or later is needed", greeted[10], greeted[11])));
    }
    let mechanism = &greeted[12..32];
    if mechanism.iter().take_while(|&&b| b != 0).copied().collect::<Vec<u8>>() != b"NULL" {
        return Err(protocol(format!("the security mechanism {:?} (only NULL is spoken)", String::from_utf8_lossy(mechanism).trim_end_matches('\0'))));
    }
    write_frame(stream, COMMAND, &ready(ours)).await?;
    stream.flush().await?;
    let frame = read_frame(stream).await?;
    if frame.flags & COMMAND == 0 {
        return Err(protocol("the peer sent a message before READY"));
    }
    let socket_type = ready_socket_type(&frame.body)?;
    if !theirs.contains(&socket_type.as_str()) {
        return Err(protocol(format!("the peer is a {socket_type} socket, not a {}", theirs.join(" or "))));
    }
    Ok(())
}

/// The next message's frames (commands, such as heartbeats, skipped);
/// `None` when the peer closed the connection between messages.
async fn recv_message(stream: &mut (impl AsyncRead + Unpin)) -> Result<Option<Vec<Vec<u8>>>, ZmtpError> {
    let mut parts = Vec::new();
    loop {
        let frame = match read_frame(stream).await {
            Ok(frame) => frame,
            Err(ZmtpError::Io(error)) if parts.is_empty() && error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(error) => return Err(error),
        };
        if frame.flags & COMMAND != 0 {
            if !parts.is_empty() {
                return Err(protocol("a command inside a message"));
            }
            continue;
        }
        parts.push(frame.body);
        if frame.flags & MORE == 0 {
            return Ok(Some(parts));
        }
        if parts.len() >= MAX_PARTS {
            return Err(protocol(format!("a message of over {MAX_PARTS} frames")));
        }
    }
}

/// A subscriber's end of one accepted connection, past the handshake.
#[derive(Debug)]
pub struct Subscriber<S> {
    stream: S,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Subscriber<S> {
    /// Greets the peer, checks it is a publisher speaking ZMTP 3 with the
    /// NULL mechanism, and subscribes to messages whose first frame starts
    /// with `topic` (empty: all).
    pub async fn handshake(mut stream: S, topic: &[u8]) -> Result<Self, ZmtpError> {
        greet(&mut stream, "SUB", &["PUB", "XPUB"]).await?;
        // ZMTP 3.0's subscription: a message of 0x01 and the prefix.
        let mut subscribe = vec![1u8];
        subscribe.extend_from_slice(topic);
        write_frame(&mut stream, 0, &subscribe).await?;
        stream.flush().await?;
        Ok(Self { stream })
    }

    /// The next message's frames; `None` when the peer closed the
    /// connection between messages.
    pub async fn recv(&mut self) -> Result<Option<Vec<Vec<u8>>>, ZmtpError> {
        recv_message(&mut self.stream).await
    }
}

/// A DEALER's end of a connection to a ROUTER socket (the engine's replay
/// socket), past the handshake: messages out, messages back.
#[derive(Debug)]
pub struct Dealer<S> {
    stream: S,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Dealer<S> {
    /// Greets the peer and checks it is a ROUTER speaking ZMTP 3 with the
    /// NULL mechanism.
    pub async fn handshake(mut stream: S) -> Result<Self, ZmtpError> {
        greet(&mut stream, "DEALER", &["ROUTER"]).await?;
        Ok(Self { stream })
    }

    /// Sends one message of `parts`.
    pub async fn send(&mut self, parts: &[&[u8]]) -> Result<(), ZmtpError> {
        for (at, part) in parts.iter().enumerate() {
            write_frame(&mut self.stream, if at + 1 < parts.len() { MORE } else { 0 }, part).await?;
        }
        self.stream.flush().await?;
        Ok(())
    }

    /// The next message's frames; `None` when the peer closed the
    /// connection between messages.
    pub async fn recv(&mut self) -> Result<Option<Vec<Vec<u8>>>, ZmtpError> {
        recv_message(&mut self.stream).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A publisher's side, as libzmq speaks it, for the subscriber to meet.
    async fn publisher(mut stream: tokio::io::DuplexStream) -> Vec<u8> {
        let mut greeting = greeting();
        greeting[11] = 1;
        stream.write_all(&greeting).await.unwrap();
        let mut theirs = [0u8; 64];
        stream.read_exact(&mut theirs).await.unwrap();
        let ready_frame = read_frame(&mut stream).await.unwrap();
        assert_eq!(ready_socket_type(&ready_frame.body).unwrap(), "SUB");
        write_frame(&mut stream, COMMAND, &ready("PUB")).await.unwrap();
        let subscription = read_frame(&mut stream).await.unwrap().body;
        // A heartbeat, then a three-part message with a long last frame.
        write_frame(&mut stream, COMMAND, b"\x04PING\x00\x10").await.unwrap();
        write_frame(&mut stream, MORE, b"kv-events").await.unwrap();
        write_frame(&mut stream, MORE, &7u64.to_be_bytes()).await.unwrap();
        write_frame(&mut stream, 0, &vec![9u8; 300]).await.unwrap();
        // Then a frame over the limit.
        stream.write_all(&[LONG]).await.unwrap();
        stream.write_all(&(MAX_FRAME_BYTES + 1).to_be_bytes()).await.unwrap();
        subscription
    }

    #[tokio::test]
    async fn a_publisher_is_met_subscribed_to_and_read_within_bounds() {
        let (ours, theirs) = tokio::io::duplex(1 << 16);
        let publishing = tokio::spawn(publisher(theirs));
        let mut subscriber = Subscriber::handshake(ours, b"kv-events").await.unwrap();
        let message = subscriber.recv().await.unwrap().unwrap();
        assert_eq!(message.len(), 3);
        assert_eq!((message[0].as_slice(), message[1].as_slice()), (&b"kv-events"[..], &7u64.to_be_bytes()[..]));
        assert_eq!(message[2], vec![9u8; 300]);
        assert!(matches!(subscriber.recv().await, Err(ZmtpError::Protocol(message)) if message.contains("bytes")));
        assert_eq!(publishing.await.unwrap(), b"\x01kv-events", "subscribed to the topic, ZMTP 3.0 style");
    }

    #[tokio::test]
    async fn a_dealer_meets_a_router_sends_and_reads_back() {
        let (ours, mut theirs) = tokio::io::duplex(1 << 16);
        let router = tokio::spawn(async move {
            theirs.write_all(&greeting()).await.unwrap();
            let mut greeting = [0u8; 64];
            theirs.read_exact(&mut greeting).await.unwrap();
            assert_eq!(ready_socket_type(&read_frame(&mut theirs).await.unwrap().body).unwrap(), "DEALER");
            write_frame(&mut theirs, COMMAND, &ready("ROUTER")).await.unwrap();
            let request = recv_message(&mut theirs).await.unwrap().unwrap();
            write_frame(&mut theirs, MORE, b"").await.unwrap();
            write_frame(&mut theirs, 0, b"answer").await.unwrap();
            request
        });
        let mut dealer = Dealer::handshake(ours).await.unwrap();
        dealer.send(&[b"", &5u64.to_be_bytes()]).await.unwrap();
        assert_eq!(dealer.recv().await.unwrap().unwrap(), vec![b"".to_vec(), b"answer".to_vec()]);
        assert_eq!(router.await.unwrap(), vec![b"".to_vec(), 5u64.to_be_bytes().to_vec()], "two frames, as sent");
        assert!(dealer.recv().await.unwrap().is_none(), "the peer closed between messages");
    }

    #[tokio::test]
    async fn a_peer_that_is_not_a_publisher_is_refused() {
        let (ours, mut theirs) = tokio::io::duplex(1 << 16);
        let peer = tokio::spawn(async move {
            theirs.write_all(&greeting()).await.unwrap();
            let mut greeting = [0u8; 64];
            theirs.read_exact(&mut greeting).await.unwrap();
            let _ = read_frame(&mut theirs).await.unwrap();
            write_frame(&mut theirs, COMMAND, &ready("REQ")).await.unwrap();
            theirs
        });
        let refused = Subscriber::handshake(ours, b"").await.unwrap_err();
        assert!(refused.to_string().contains("not a PUB or XPUB"), "{refused}");
        drop(peer.await.unwrap());
        let (ours, mut theirs) = tokio::io::duplex(1 << 16);
        theirs.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
        drop(theirs);
        assert!(Subscriber::handshake(ours, b"").await.is_err());
    }
}

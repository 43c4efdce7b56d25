//! A TCP relay in front of a server, for tests that must act at an exact
//! moment of a transfer rather than poll for it.
//!
//! Clients dial the relay (a worker advertises the relay's address); each
//! connection is relayed both ways to the upstream server. Once armed with
//! [`TcpRelay::freeze_after`], the first connection that carries that many
//! more bytes toward its client stops relaying toward it: the client's
//! reads stay in flight, mid-stream, until the test acts (kills the server)
//! and [`TcpRelay::sever`]s every connection, as the death of the host
//! would.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// See the module docs.
#[derive(Debug)]
pub struct TcpRelay {
    addr: SocketAddr,
    shared: Arc<Shared>,
    severed: watch::Sender<bool>,
    frozen: watch::Receiver<bool>,
}

#[derive(Debug)]
struct Shared {
    upstream: Mutex<Option<SocketAddr>>,
    /// Bytes toward a client after which its connection freezes; taken by
    /// the connection that freezes (one per arming).
    armed: Mutex<Option<u64>>,
    /// A counter per arming: a connection counts its bytes from the arming
    /// it last saw.
    arming: watch::Sender<u64>,
    frozen: watch::Sender<bool>,
}

impl TcpRelay {
    /// A relay listening on a free port of 127.0.0.1; connections made
    /// before [`set_upstream`](Self::set_upstream) are closed at once.
    pub async fn start() -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (frozen_tx, frozen) = watch::channel(false);
        let shared = Arc::new(Shared { upstream: Mutex::new(None), armed: Mutex::new(None), arming: watch::channel(0).0, frozen: frozen_tx });
        let (severed, mut severed_rx) = watch::channel(false);
        let accepting = shared.clone();
        tokio::spawn(async move {
            loop {
                let client = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok((client, _)) => client,
                        Err(_) => continue,
                    },
                    _ = severed_rx.wait_for(|severed| *severed) => return,
                };
                tokio::spawn(relay(client, accepting.clone(), severed_rx.clone()));
            }
        });
        Ok(Self { addr, shared, severed, frozen })
    }

    /// Where clients dial.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server connections are relayed to.
    pub fn set_upstream(&self, upstream: SocketAddr) {
        *self.shared.upstream.lock().unwrap() = Some(upstream);
    }

    /// Arms the freeze: the first connection to carry `bytes` more toward
    /// its client from now on stops relaying toward it.
    pub fn freeze_after(&self, bytes: u64) {
        *self.shared.armed.lock().unwrap() = Some(bytes);
        self.shared.arming.send_modify(|arming| *arming += 1);
    }

    /// Waits until a connection has frozen; an error after `deadline`.
    pub async fn frozen(&self, deadline: Duration) -> anyhow::Result<()> {
        let mut frozen = self.frozen.clone();
        tokio::time::timeout(deadline, frozen.wait_for(|frozen| *frozen))
            .await
            .map_err(|_| anyhow::anyhow!("no connection carried the armed bytes within {deadline:?}"))??;
        Ok(())
    }

    /// Closes every relayed connection and stops listening: to its clients
    /// the server is gone.
    pub fn sever(&self) {
        let _ = self.severed.send(true);
    }
}

impl Drop for TcpRelay {
    fn drop(&mut self) {
        self.sever();
    }
}

async fn relay(client: TcpStream, shared: Arc<Shared>, mut severed: watch::Receiver<bool>) {
    let upstream = *shared.upstream.lock().unwrap();
    let Some(upstream) = upstream else { return };
    let Ok(server) = TcpStream::connect(upstream).await else { return };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let toward_server = tokio::io::copy(&mut client_read, &mut server_write);
    let toward_client = async {
        let mut arming = shared.arming.subscribe();
        let mut seen_arming = *arming.borrow_and_update();
        let mut carried = 0u64;
        let mut buffer = vec![0u8; 64 * 1024];
        loop {
            let read = server_read.read(&mut buffer).await?;
            if read == 0 {
                return Ok::<_, std::io::Error>(());
            }
            client_write.write_all(&buffer[..read]).await?;
            if *arming.borrow_and_update() != seen_arming {
                seen_arming = *arming.borrow();
                carried = 0;
            }
            carried += read as u64;
            let freeze = {
                let mut armed = shared.armed.lock().unwrap();
                match *armed {
                    Some(bytes) if carried >= bytes => armed.take().is_some(),
                    _ => false,
                }
            };
            if freeze {
                shared.frozen.send_replace(true);
                // Toward the client nothing more, until severed.
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = toward_server => {}
        _ = toward_client => {}
        _ = severed.wait_for(|severed| *severed) => {}
    }
}

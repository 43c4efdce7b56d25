//! Process signals as cancellation tokens: the first SIGTERM or SIGINT
//! starts the drain ([`cancel_on_signal`]); a second one ends its delay
//! at once ([`second_signal`]), for an operator who would not wait.

use std::sync::OnceLock;

use tokio_util::sync::CancellationToken;

/// Spawns a task that cancels `token` on the first SIGTERM or SIGINT, and
/// [`second_signal`] on the next one.
pub fn cancel_on_signal(token: CancellationToken) {
    tokio::spawn(async move {
        let mut signals = Signals::install();
        let signal = signals.next().await;
        tracing::info!(signal, "shutdown requested: draining");
        token.cancel();
        let signal = signals.next().await;
        tracing::info!(signal, "second signal: no more drain delay");
        second_signal().cancel();
    });
}

/// Cancelled on the process's second SIGTERM or SIGINT (see
/// [`cancel_on_signal`]): the drain delay ends there
/// ([`crate::host::Serving::until_shutdown`]). A test may cancel it
/// itself.
pub fn second_signal() -> &'static CancellationToken {
    static SECOND: OnceLock<CancellationToken> = OnceLock::new();
    SECOND.get_or_init(CancellationToken::new)
}

/// SIGTERM and SIGINT, their handlers installed once, so that none
/// arriving between two waits is missed.
struct Signals {
    #[cfg(unix)]
    terminate: tokio::signal::unix::Signal,
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Self {
                terminate: signal(SignalKind::terminate()).expect("install SIGTERM handler"),
                interrupt: signal(SignalKind::interrupt()).expect("install SIGINT handler"),
            }
        }
        #[cfg(not(unix))]
        Self {}
    }

    /// The next signal, named.
    async fn next(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            tokio::select! {
                _ = self.terminate.recv() => "SIGTERM",
                _ = self.interrupt.recv() => "SIGINT",
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
            "ctrl-c"
        }
    }
}

/// Runs a server future that starts draining when `shutdown` fires, and
/// gives the drain at most `grace`: requests still in flight after that
/// are dropped (with a warning naming `what`).
pub async fn drain_within<F, E>(server: F, shutdown: &CancellationToken, grace: std::time::Duration, what: &str) -> Result<(), E>
where
    F: std::future::Future<Output = Result<(), E>>,
{
    tokio::pin!(server);
    tokio::select! {
        result = &mut server => return result,
        () = shutdown.cancelled() => {}
    }
    match tokio::time::timeout(grace, server).await {
        Ok(result) => result,
        Err(_) => {
            tracing::warn!(grace_secs = grace.as_secs_f64(), "grace period over: dropping {what} still in flight");
            Ok(())
        }
    }
}

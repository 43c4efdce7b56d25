//! Process signals as a cancellation token.

use tokio_util::sync::CancellationToken;

/// Spawns a task that cancels `token` on the first SIGTERM or SIGINT.
pub fn cancel_on_signal(token: CancellationToken) {
    tokio::spawn(async move {
        let signal = wait_for_signal().await;
        tracing::info!(signal, "shutdown requested: draining");
        token.cancel();
    });
}

/// Resolves on the first SIGTERM or SIGINT, naming it.
pub async fn wait_for_signal() -> &'static str {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut terminate = signal(SignalKind::terminate()).expect("install SIGTERM handler");
        let mut interrupt = signal(SignalKind::interrupt()).expect("install SIGINT handler");
        tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt.recv() => "SIGINT",
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
        "ctrl-c"
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

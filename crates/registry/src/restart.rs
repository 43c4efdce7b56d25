//! Telling a registry that restarted empty from workers that left.

use std::time::{Duration, Instant};

use crate::Registry;

/// After the registry's Redis restarts without its data, every worker is
/// missing from the listings until its next lease renewal. Whoever drops
/// workers (or their cached blocks) for being unlisted asks this first.
#[derive(Debug)]
pub struct RestartGrace {
    grace: Duration,
    generation: Option<String>,
    until: Option<Instant>,
}

impl RestartGrace {
    /// How long unlisted workers are kept after a restart, by default.
    pub const DEFAULT: Duration = Duration::from_secs(10);

    /// Keeps unlisted workers for `grace` after each restart.
    pub fn new(grace: Duration) -> Self {
        Self { grace, generation: None, until: None }
    }

    /// Call after each successful listing: whether workers missing from it
    /// may only be about to re-register (the backend restarted within the
    /// grace period). Asked after the listing, a restart between the two
    /// still counts for it.
    pub async fn lenient(&mut self, registry: &Registry) -> bool {
        if let Ok(Some(current)) = registry.generation().await {
            if self.generation.as_ref().is_some_and(|known| *known != current) {
                tracing::warn!(registry = %registry.describe(), grace = ?self.grace, "the registry's Redis restarted; workers missing from it are kept until they re-register");
                self.until = Some(Instant::now() + self.grace);
            }
            self.generation = Some(current);
        }
        self.until.is_some_and(|until| Instant::now() < until)
    }
}

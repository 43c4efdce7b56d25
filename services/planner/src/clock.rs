//! Where the planner reads the time: the system's clock, or a clock a
//! test sets and moves. Cool-downs, action outcomes and pause switches are
//! stamped with it; the ledger holds it, so every part that records
//! anything reads the same one.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

/// The planner's clock, in milliseconds since the Unix epoch.
#[derive(Debug, Clone, Default)]
pub enum Clock {
    /// The system's wall clock.
    #[default]
    System,
    /// A clock that stands still until moved (tests).
    Manual(Arc<AtomicI64>),
}

impl Clock {
    /// A clock standing at `unix_ms` until [`advance`](Self::advance)d.
    pub fn manual(unix_ms: i64) -> Self {
        Self::Manual(Arc::new(AtomicI64::new(unix_ms)))
    }

    /// Now, milliseconds since the Unix epoch.
    pub fn now_unix_ms(&self) -> i64 {
        match self {
            Self::System => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |since| since.as_millis() as i64),
            Self::Manual(now) => now.load(Ordering::Relaxed),
        }
    }

    /// Moves a manual clock `ms` on (the system's is not moved).
    pub fn advance(&self, ms: i64) {
        if let Self::Manual(now) = self {
            now.fetch_add(ms, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Clock;

    #[test]
    fn a_manual_clock_moves_only_when_told_and_the_system_one_reads_the_time() {
        let clock = Clock::manual(1_000);
        assert_eq!(clock.now_unix_ms(), 1_000);
        clock.clone().advance(500);
        assert_eq!(clock.now_unix_ms(), 1_500, "clones share the time");
        // 2026-01-01 and later.
        assert!(Clock::System.now_unix_ms() > 1_767_225_600_000);
    }
}

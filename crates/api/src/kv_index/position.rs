//! [`LogPosition`]: where in the event log a reader is.

use std::fmt;
use std::str::FromStr;

/// The id of an entry of the event log's Redis stream (`<ms>-<seq>`):
/// entries are ordered by it, and "everything up to this position" is how
/// followers, snapshots and `Stats` say how far they got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct LogPosition {
    millis: u64,
    sequence: u64,
}

impl LogPosition {
    /// Before the first entry: reading after it reads the whole log.
    pub const START: LogPosition = LogPosition { millis: 0, sequence: 0 };

    /// Whether this is [`LogPosition::START`].
    pub fn is_start(self) -> bool {
        self == Self::START
    }
}

impl fmt::Display for LogPosition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.millis, self.sequence)
    }
}

/// A text that is not a stream entry id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a stream position (<milliseconds>-<sequence>)")]
pub struct BadPosition(pub String);

impl FromStr for LogPosition {
    type Err = BadPosition;

    fn from_str(text: &str) -> Result<Self, BadPosition> {
        let bad = || BadPosition(text.to_owned());
        let (millis, sequence) = text.split_once('-').ok_or_else(bad)?;
        Ok(Self { millis: millis.parse().map_err(|_| bad())?, sequence: sequence.parse().map_err(|_| bad())? })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_parse_print_and_order_numerically() {
        let early: LogPosition = "999-7".parse().unwrap();
        let late: LogPosition = "1000-0".parse().unwrap();
        assert!(early < late, "ordered by number, not text");
        assert_eq!(late.to_string(), "1000-0");
        assert!("0-0".parse::<LogPosition>().unwrap().is_start());
        assert!("12".parse::<LogPosition>().is_err());
        assert!("a-1".parse::<LogPosition>().is_err());
    }
}

//! Stop strings honoured across token boundaries.
//!
//! Text arrives in pieces; a stop string may straddle pieces. The matcher
//! holds back the shortest tail that could still begin a stop string and
//! releases everything before it, so no text after a stop is ever emitted
//! and nothing else is delayed.

/// Matches stop strings over a stream of text.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

/// What to do with a piece of text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopScan {
    /// Text safe to emit now.
    pub emit: String,
    /// A stop string matched; generation must end (the stop is not emitted).
    pub stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: Vec<String>) -> Self {
        Self { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new() }
    }

    /// Whether any stop string is configured.
    pub fn is_active(&self) -> bool {
        !self.stops.is_empty()
    }

    /// Feeds the next piece of text.
    pub fn push(&mut self, text: &str) -> StopScan {
        if self.stops.is_empty() {
            return StopScan { emit: text.to_owned(), stopped: false };
        }
        self.held.push_str(text);
        let earliest = self.stops.iter().filter_map(|stop| self.held.find(stop.as_str())).min();
        if let Some(position) = earliest {
            let emit = self.held[..position].to_owned();
            self.held.clear();
            return StopScan { emit, stopped: true };
        }
        let keep = self.longest_partial_suffix();
        let split = self.held.len() - keep;
        let emit = self.held[..split].to_owned();
        self.held.replace_range(..split, "");
        StopScan { emit, stopped: false }
    }

    /// Releases whatever is held at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length in bytes of the longest suffix of `held` that is a proper
    /// prefix of some stop string (on a character boundary).
    fn longest_partial_suffix(&self) -> usize {
        let mut best = 0;
        for stop in &self.stops {
            let max = (stop.len() - 1).min(self.held.len());
            for len in (best + 1..=max).rev() {
                let start = self.held.len() - len;
                if self.held.is_char_boundary(start) && stop.starts_with(&self.held[start..]) {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut matcher = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for piece in pieces {
            let scan = matcher.push(piece);
            out.push_str(&scan.emit);
            if scan.stopped {
                return (out, true);
            }
        }
        out.push_str(&matcher.finish());
        (out, false)
    }

    #[test]
    fn a_stop_split_across_pieces_is_caught() {
        assert_eq!(run(&["END"], &["hello E", "N", "D world"]), ("hello ".into(), true));
    }

    #[test]
    fn a_false_start_is_released() {
        assert_eq!(run(&["END"], &["hello EN", "X", " world"]), ("hello ENX world".into(), false));
    }

    #[test]
    fn the_earliest_of_several_stops_wins() {
        assert_eq!(run(&["world", "lo"], &["hello world"]), ("hel".into(), true));
    }

    #[test]
    fn multibyte_text_is_never_cut_inside_a_character() {
        assert_eq!(run(&["é!"], &["caf", "é", " ok"]), ("café ok".into(), false));
        assert_eq!(run(&["日本"], &["これは日", "本です"]), ("これは".into(), true));
    }

    #[test]
    fn text_that_cannot_start_a_stop_is_emitted_at_once() {
        let mut matcher = StopMatcher::new(vec!["###".into()]);
        assert_eq!(matcher.push("abc").emit, "abc");
        assert_eq!(matcher.push("d#").emit, "d");
        assert_eq!(matcher.push("x").emit, "#x");
    }

    #[test]
    fn no_stops_passes_everything_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&[""], &["a", "b"]), ("ab".into(), false));
    }
}

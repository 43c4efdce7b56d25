//! Stop strings honoured across token boundaries.
//!
//! Text arrives in pieces; a stop string may straddle pieces. The matcher
//! holds back the shortest tail that could still begin a stop string and
//! releases everything before it, so no text after a stop is ever emitted
//! and nothing else is delayed.

/// Matches stop strings over a stream of text.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<Stop>,
    held: String,
}

/// One stop string and its KMP failure table: `borders[i]` is the length
/// of the longest proper prefix of `text[..=i]` that is also its suffix.
/// What to hold back is found in time linear in the stop's length for
/// each piece of text (the stop strings a client sends are bounded in
/// length by the API: MAX_STOP_BYTES).
#[derive(Debug, Clone)]
struct Stop {
    text: String,
    borders: Vec<usize>,
}

impl Stop {
    fn new(text: String) -> Self {
        let pattern = text.as_bytes();
        let mut borders = vec![0; pattern.len()];
        let mut matched = 0;
        for i in 1..pattern.len() {
            while matched > 0 && pattern[i] != pattern[matched] {
                matched = borders[matched - 1];
            }
            if pattern[i] == pattern[matched] {
                matched += 1;
            }
            borders[i] = matched;
        }
        Self { text, borders }
    }

    /// The length of the longest suffix of `held` that is a proper prefix
    /// of this stop. It starts on a character boundary: it begins with the
    /// stop's first byte, which starts a character.
    fn partial_suffix(&self, held: &str) -> usize {
        let pattern = self.text.as_bytes();
        let tail = &held.as_bytes()[held.len().saturating_sub(pattern.len() - 1)..];
        let mut matched = 0;
        for &byte in tail {
            while matched > 0 && byte != pattern[matched] {
                matched = self.borders[matched - 1];
            }
            if byte == pattern[matched] {
                matched += 1;
            }
            if matched == pattern.len() {
                matched = self.borders[matched - 1];
            }
        }
        matched
    }
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
        Self { stops: stops.into_iter().filter(|s| !s.is_empty()).map(Stop::new).collect(), held: String::new() }
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
        let earliest = self.stops.iter().filter_map(|stop| self.held.find(stop.text.as_str())).min();
        if let Some(position) = earliest {
            let emit = self.held[..position].to_owned();
            self.held.clear();
            return StopScan { emit, stopped: true };
        }
        let keep = self.stops.iter().map(|stop| stop.partial_suffix(&self.held)).max().unwrap_or(0);
        let split = self.held.len() - keep;
        debug_assert!(self.held.is_char_boundary(split));
        let emit = self.held[..split].to_owned();
        self.held.replace_range(..split, "");
        StopScan { emit, stopped: false }
    }

    /// Releases whatever is held at the end of generation.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
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
    fn overlapping_starts_keep_the_longest_partial_match() {
        // "abab" may still become "ababc": all of it is held.
        assert_eq!(run(&["ababc"], &["xab", "ab", "c!"]), ("x".into(), true));
        assert_eq!(run(&["ababc"], &["xab", "ab", "ab", "d"]), ("xabababd".into(), false));
        let mut matcher = StopMatcher::new(vec!["aab".into()]);
        assert_eq!(matcher.push("aaaa").emit, "aa", "only the longest prefix of the stop is held");
    }

    /// Against the definition, over random text and stops of two
    /// letters (where prefixes overlap most).
    #[test]
    fn the_tail_held_is_the_longest_suffix_that_begins_a_stop() {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move |below: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state % below
        };
        for _ in 0..2_000 {
            let (stop_length, held_length) = (1 + next(8), next(12));
            let stop: String = (0..stop_length).map(|_| if next(2) == 0 { 'a' } else { 'b' }).collect();
            let held: String = (0..held_length).map(|_| if next(2) == 0 { 'a' } else { 'b' }).collect();
            let expected = (0..stop.len()).rev().find(|&length| length <= held.len() && stop.starts_with(&held[held.len() - length..])).unwrap_or(0);
            assert_eq!(Stop::new(stop.clone()).partial_suffix(&held), expected, "stop {stop:?}, held {held:?}");
        }
    }

    #[test]
    fn no_stops_passes_everything_through() {
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        assert_eq!(run(&[""], &["a", "b"]), ("ab".into(), false));
    }
}

//! JSON Schema `pattern` on a string ([`crate::schema`]): the regular
//! expression compiled to a byte-level DFA that the recognizer steps one
//! byte of the string's content at a time.
//!
//! A pattern matches anywhere in the string (JSON Schema does not anchor
//! it; `^` and `$` do). The strings produced under it are of printable
//! ASCII, their only escapes `\"`, `\\` and `\/`: on those, the
//! expression read byte by byte (`\d`, `\w` as ASCII) means what it means
//! to the ECMAScript regex JSON Schema names, so every string produced is
//! valid, though not every valid string can be produced. A byte is taken
//! only into a state from which some such string still matches, so the
//! output never reaches a string it cannot finish.

use std::collections::{HashMap, HashSet, VecDeque};

use regex_automata::dfa::{Automaton, dense};
use regex_automata::util::primitives::StateID;
use regex_automata::util::start;
use regex_automata::util::syntax;
use regex_automata::{Anchored, MatchKind};

use crate::schema::SchemaError;

/// Most bytes of DFA one pattern may compile to: a hostile pattern
/// (`(a|b)*a(a|b){20}`) grows exponentially.
pub const MAX_PATTERN_DFA_BYTES: usize = 1 << 20;

/// A compiled pattern: its DFA, the state before any byte, and the states
/// from which a string of the bytes produced can still match.
#[derive(Debug, Clone)]
pub struct Pattern {
    source: String,
    dfa: dense::DFA<Vec<u32>>,
    start: StateID,
    live: HashSet<StateID>,
}

impl PartialEq for Pattern {
    fn eq(&self, other: &Self) -> bool {
        self.source == other.source
    }
}

/// Where in a string's content a pattern is: its DFA state, and whether it
/// matched already (then anything may follow).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PatternState {
    state: StateID,
    matched: bool,
}

/// Whether a byte may be in a string produced under a pattern.
fn produced(byte: u8) -> bool {
    (0x20..=0x7e).contains(&byte)
}

impl Pattern {
    /// Compiles `source`, or says why it cannot be held to.
    pub fn compile(source: &str) -> Result<Self, SchemaError> {
        let refused = |why: String| SchemaError(format!("the pattern {source:?} {why}"));
        let dfa = dense::Builder::new()
            .syntax(syntax::Config::new().unicode(false).utf8(false))
            .configure(
                dense::Config::new()
                    .match_kind(MatchKind::All)
                    .start_kind(regex_automata::dfa::StartKind::Unanchored)
                    .dfa_size_limit(Some(MAX_PATTERN_DFA_BYTES))
                    .determinize_size_limit(Some(MAX_PATTERN_DFA_BYTES)),
            )
            .thompson(regex_automata::nfa::thompson::Config::new().nfa_size_limit(Some(MAX_PATTERN_DFA_BYTES)))
            .build(source)
            .map_err(|error| refused(format!("is not held to by the native engine: {error}")))?;
        let start = dfa.start_state(&start::Config::new().anchored(Anchored::No)).map_err(|error| refused(format!("has no start: {error}")))?;
        // The states reached by produced bytes, and from which a match is.
        let mut reached = vec![start];
        let mut seen: HashSet<StateID> = [start].into();
        let mut into: HashMap<StateID, Vec<StateID>> = HashMap::new();
        let mut index = 0;
        while index < reached.len() {
            let state = reached[index];
            index += 1;
            for byte in (0..=u8::MAX).filter(|&byte| produced(byte)) {
                let next = dfa.next_state(state, byte);
                if dfa.is_dead_state(next) || dfa.is_quit_state(next) {
                    continue;
                }
                into.entry(next).or_default().push(state);
                if seen.insert(next) {
                    reached.push(next);
                }
            }
        }
        let matches = |state: StateID| dfa.is_match_state(state) || dfa.is_match_state(dfa.next_eoi_state(state));
        let mut live: HashSet<StateID> = reached.iter().copied().filter(|&state| matches(state)).collect();
        let mut queue: VecDeque<StateID> = live.iter().copied().collect();
        while let Some(state) = queue.pop_front() {
            for &from in into.get(&state).into_iter().flatten() {
                if live.insert(from) {
                    queue.push_back(from);
                }
            }
        }
        if !live.contains(&start) {
            return Err(refused("matches no string of printable ASCII (what the native engine produces under a pattern)".into()));
        }
        Ok(Self { source: source.to_owned(), dfa, start, live })
    }

    /// Bytes of its DFA.
    pub fn memory_usage(&self) -> usize {
        self.dfa.memory_usage()
    }

    /// Before the string's first byte.
    pub fn begin(&self) -> PatternState {
        PatternState { state: self.start, matched: self.dfa.is_match_state(self.start) }
    }

    /// The state after the content byte `byte`, if a string produced
    /// under the pattern still matches from it.
    pub fn step(&self, at: PatternState, byte: u8) -> Option<PatternState> {
        if !produced(byte) {
            return None;
        }
        if at.matched {
            return Some(at);
        }
        let next = self.dfa.next_state(at.state, byte);
        if !self.live.contains(&next) {
            return None;
        }
        Some(PatternState { state: next, matched: self.dfa.is_match_state(next) })
    }

    /// Whether the string may end here.
    pub fn may_end(&self, at: PatternState) -> bool {
        at.matched || self.dfa.is_match_state(self.dfa.next_eoi_state(at.state))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(pattern: &Pattern, text: &str) -> bool {
        let mut at = pattern.begin();
        for &byte in text.as_bytes() {
            match pattern.step(at, byte) {
                Some(next) => at = next,
                None => return false,
            }
        }
        pattern.may_end(at)
    }

    #[test]
    fn strings_match_as_json_schema_reads_a_pattern() {
        let code = Pattern::compile("^[A-Z]{3}-\\d{2}$").unwrap();
        assert!(matches(&code, "ABC-12"));
        for text in ["ABC-1", "ABC-123", "abc-12", "xABC-12", "ABC-12 "] {
            assert!(!matches(&code, text), "{text}");
        }
        // Unanchored: anywhere in the string.
        let word = Pattern::compile("cat").unwrap();
        assert!(matches(&word, "a cat sat") && matches(&word, "cat") && !matches(&word, "ca t"));
        let date = Pattern::compile("^\\d{4}-(0[1-9]|1[0-2])-\\d{2}$").unwrap();
        assert!(matches(&date, "2026-12-07") && !matches(&date, "2026-13-07"));
    }

    #[test]
    fn a_byte_is_taken_only_where_the_string_can_still_match() {
        let code = Pattern::compile("^[A-Z]{3}$").unwrap();
        let mut at = code.begin();
        for &byte in b"ABC" {
            at = code.step(at, byte).unwrap();
        }
        assert!(code.step(at, b'D').is_none(), "a fourth letter leaves no match");
        // A branch only non-ASCII could finish is not taken.
        let mixed = Pattern::compile("^(a\\xff|b)$").unwrap();
        assert!(mixed.step(mixed.begin(), b'a').is_none() && mixed.step(mixed.begin(), b'b').is_some());
        assert!(!matches(&code, "AB\u{e9}"), "non-ASCII is not produced");
    }

    #[test]
    fn patterns_the_engine_cannot_hold_to_are_refused_with_why() {
        for (pattern, says) in [
            ("(a", "not held to"),
            ("(?=a)b", "not held to"),
            ("^\\xff+$", "no string of printable ASCII"),
            ("(a|b)*a(a|b){24}", "not held to"),
            ("((a{1000}){1000}){1000}", "not held to"),
            ("[a-z]{1000}[0-9]{1000}x{5000}", "not held to"),
        ] {
            let refused = Pattern::compile(pattern).unwrap_err().0;
            assert!(refused.contains(says), "{pattern}: {refused}");
        }
    }
}

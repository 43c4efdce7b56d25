//! JSON output: a byte-level recognizer of one JSON object (RFC 8259) that
//! tells, for each candidate token, whether its bytes keep the output a
//! prefix of some valid object, and whether the object is complete.
//!
//! The sampler masks the tokens it refuses ([`crate::sampling`]), so every
//! output of a request in JSON mode is a prefix of a valid object, and once
//! the object closes only an end-of-sequence token may follow. Strings take
//! any byte but control characters, `"` and `\` unescaped (UTF-8 passes
//! through byte by byte: a token may end mid-character). Whitespace between
//! tokens of the grammar runs at most [`MAX_WHITESPACE`] bytes, and
//! containers nest at most [`MAX_DEPTH`] deep, so a model cannot stall in
//! blanks or brackets until `max_tokens`.

/// Most whitespace bytes in a row outside strings: enough for a
/// pretty-printed object nested a dozen deep, not for a model that would
/// rather emit blanks than a value.
pub const MAX_WHITESPACE: u16 = 48;

/// Deepest nesting of objects and arrays.
pub const MAX_DEPTH: usize = 64;

/// Where in a JSON text the recognizer is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonState {
    /// Open containers, innermost last (`true`: an object).
    stack: Vec<bool>,
    mode: Mode,
    whitespace: u16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Before the top-level object: only whitespace or `{`.
    Start,
    /// A value is expected (after `:` or `,` in an array).
    Value,
    /// After `[`: a value or `]`.
    FirstElement,
    /// After `{`: a key or `}`.
    FirstKey,
    /// After `,` in an object: a key.
    Key,
    /// After a key: `:`.
    Colon,
    /// After a value in a container: `,` or the container's end.
    Next,
    /// Inside a string (a key's or a value's).
    String { key: bool, escape: Escape },
    /// Inside a number.
    Number(Number),
    /// Inside `true`, `false` or `null`: the bytes still to come.
    Literal(&'static [u8]),
    /// The top-level object closed.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Escape {
    None,
    /// After `\`.
    Backslash,
    /// After `\u`: hex digits still to come.
    Hex(u8),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Number {
    /// After `-`: a digit must follow.
    Minus,
    /// A leading `0`: no more integer digits.
    Zero,
    /// Integer digits.
    Integer,
    /// After `.`: a digit must follow.
    Point,
    /// Fraction digits.
    Fraction,
    /// After `e`: a sign or a digit.
    Exponent,
    /// After the exponent's sign: a digit.
    ExponentSign,
    /// Exponent digits.
    ExponentDigits,
}

impl Number {
    /// Whether the number may end here.
    fn complete(self) -> bool {
        matches!(self, Number::Zero | Number::Integer | Number::Fraction | Number::ExponentDigits)
    }

    /// The state after `byte`, if it continues the number.
    fn next(self, byte: u8) -> Option<Number> {
        let digit = byte.is_ascii_digit();
        Some(match (self, byte) {
            (Number::Minus, b'0') => Number::Zero,
            (Number::Minus, _) if digit => Number::Integer,
            (Number::Integer, _) if digit => Number::Integer,
            (Number::Zero | Number::Integer, b'.') => Number::Point,
            (Number::Zero | Number::Integer | Number::Fraction, b'e' | b'E') => Number::Exponent,
            (Number::Point | Number::Fraction, _) if digit => Number::Fraction,
            (Number::Exponent, b'+' | b'-') => Number::ExponentSign,
            (Number::Exponent | Number::ExponentSign | Number::ExponentDigits, _) if digit => Number::ExponentDigits,
            _ => return None,
        })
    }
}

impl Default for JsonState {
    fn default() -> Self {
        Self::object()
    }
}

/// Whether `bytes` (non-empty) are text a string takes as it is: no
/// quote, backslash or control byte.
pub fn plain(bytes: &[u8]) -> bool {
    !bytes.is_empty() && !bytes.iter().any(|&byte| byte == b'"' || byte == b'\\' || byte < 0x20)
}

impl JsonState {
    /// Nothing read yet; the text must be one object.
    pub fn object() -> Self {
        Self { stack: Vec::new(), mode: Mode::Start, whitespace: 0 }
    }

    /// Nothing read yet; the text must be one value of any kind (a
    /// schema's part that says nothing of its value, [`crate::schema`]).
    pub fn any_value() -> Self {
        Self { stack: Vec::new(), mode: Mode::Value, whitespace: 0 }
    }

    /// Whether the text read so far is a whole value: complete, or a
    /// number that may end here (it ends at the byte after it).
    pub fn may_end(&self) -> bool {
        match self.mode {
            Mode::Done => true,
            Mode::Number(number) => self.stack.is_empty() && number.complete(),
            _ => false,
        }
    }

    /// Whether it is inside a number (where `.`, `e` and `E` continue it).
    pub fn in_number(&self) -> bool {
        matches!(self.mode, Mode::Number(_))
    }

    /// Whether the object is complete: nothing may follow it.
    pub fn is_complete(&self) -> bool {
        self.mode == Mode::Done
    }

    /// Reads `bytes`; `false` (and the state is left partly advanced) if
    /// they cannot continue a valid object.
    pub fn feed(&mut self, bytes: &[u8]) -> bool {
        bytes.iter().all(|&byte| self.push(byte))
    }

    /// Whether `bytes` (one token's, non-empty) would continue the text:
    /// the state is left as it was.
    pub fn accepts(&self, bytes: &[u8]) -> bool {
        if self.in_plain_string() && plain(bytes) {
            // Text inside a string: taken whole, the state unchanged (the
            // common case of checking every token, with no copy).
            return true;
        }
        !bytes.is_empty() && self.clone().feed(bytes)
    }

    /// Whether it is inside a string, no escape begun.
    pub fn in_plain_string(&self) -> bool {
        matches!(self.mode, Mode::String { escape: Escape::None, .. })
    }

    /// Reads one byte; `false` if it cannot continue the text.
    pub fn push(&mut self, byte: u8) -> bool {
        match self.mode {
            Mode::String { key, escape } => return self.string(key, escape, byte),
            Mode::Literal(rest) => {
                if rest.first() != Some(&byte) {
                    return false;
                }
                self.mode = if rest.len() == 1 { self.after_value() } else { Mode::Literal(&rest[1..]) };
                return true;
            }
            Mode::Number(number) => match number.next(byte) {
                Some(next) => {
                    self.mode = Mode::Number(next);
                    return true;
                }
                // The number ends: the byte is read after it.
                None if number.complete() => self.mode = self.after_value(),
                None => return false,
            },
            _ => {}
        }
        if matches!(byte, b' ' | b'\t' | b'\n' | b'\r') {
            if self.mode == Mode::Done || self.whitespace >= MAX_WHITESPACE {
                return false;
            }
            self.whitespace += 1;
            return true;
        }
        self.whitespace = 0;
        match (self.mode, byte) {
            (Mode::Start, b'{') => self.open(true),
            (Mode::Value | Mode::FirstElement, _) => self.value(byte),
            (Mode::FirstKey | Mode::Key, b'"') => {
                self.mode = Mode::String { key: true, escape: Escape::None };
                true
            }
            (Mode::FirstKey, b'}') => self.close(),
            (Mode::Colon, b':') => {
                self.mode = Mode::Value;
                true
            }
            (Mode::Next, b',') => {
                self.mode = if self.stack.last() == Some(&true) { Mode::Key } else { Mode::Value };
                true
            }
            (Mode::Next, b'}') if self.stack.last() == Some(&true) => self.close(),
            (Mode::Next, b']') if self.stack.last() == Some(&false) => self.close(),
            _ => false,
        }
    }

    /// The first byte of a value.
    fn value(&mut self, byte: u8) -> bool {
        self.mode = match byte {
            b'{' => return self.open(true),
            b'[' => return self.open(false),
            b']' if self.mode == Mode::FirstElement => return self.close(),
            b'"' => Mode::String { key: false, escape: Escape::None },
            b'-' => Mode::Number(Number::Minus),
            b'0' => Mode::Number(Number::Zero),
            b'1'..=b'9' => Mode::Number(Number::Integer),
            b't' => Mode::Literal(b"rue"),
            b'f' => Mode::Literal(b"alse"),
            b'n' => Mode::Literal(b"ull"),
            _ => return false,
        };
        true
    }

    fn string(&mut self, key: bool, escape: Escape, byte: u8) -> bool {
        let escape = match (escape, byte) {
            (Escape::None, b'"') => {
                self.mode = if key { Mode::Colon } else { self.after_value() };
                return true;
            }
            (Escape::None, b'\\') => Escape::Backslash,
            (Escape::None, 0x00..=0x1f) => return false,
            (Escape::None, _) => Escape::None,
            (Escape::Backslash, b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => Escape::None,
            (Escape::Backslash, b'u') => Escape::Hex(4),
            (Escape::Hex(left), _) if byte.is_ascii_hexdigit() => {
                if left == 1 {
                    Escape::None
                } else {
                    Escape::Hex(left - 1)
                }
            }
            _ => return false,
        };
        self.mode = Mode::String { key, escape };
        true
    }

    fn open(&mut self, object: bool) -> bool {
        if self.stack.len() >= MAX_DEPTH {
            return false;
        }
        self.stack.push(object);
        self.mode = if object { Mode::FirstKey } else { Mode::FirstElement };
        true
    }

    fn close(&mut self) -> bool {
        self.stack.pop();
        self.mode = self.after_value();
        true
    }

    /// Where a value that just ended leaves the text.
    fn after_value(&self) -> Mode {
        if self.stack.is_empty() { Mode::Done } else { Mode::Next }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn valid_prefix(text: &str) -> bool {
        JsonState::object().feed(text.as_bytes())
    }

    fn complete(text: &str) -> bool {
        let mut state = JsonState::object();
        state.feed(text.as_bytes()) && state.is_complete()
    }

    #[test]
    fn objects_are_recognized_whole_and_by_prefix() {
        for text in [
            r#"{}"#,
            r#"{"a": 1}"#,
            r#" {"name": "Ada", "age": 36, "langs": ["en", "fr"], "ok": true, "x": null, "y": false}"#,
            r#"{"n": [-0, 0.5, 1e3, -12.25E-2, 7, {"deep": []}]}"#,
            r#"{"s": "quote \" backslash \\ slash \/ \b\f\n\r\t \u00e9 é 🙂"}"#,
            "{\n  \"pretty\": {\n    \"yes\": 1\n  }\n}",
        ] {
            assert!(complete(text), "{text}");
            assert!(serde_json::from_str::<serde_json::Value>(text).unwrap().is_object());
            for end in 0..text.len() {
                assert!(JsonState::object().feed(&text.as_bytes()[..end]), "prefix {:?}", &text.as_bytes()[..end]);
            }
        }
        assert!(valid_prefix(r#"{"a": [1, 2"#) && !complete(r#"{"a": [1, 2"#));
        assert!(!complete(r#"{"a": 1"#));
    }

    #[test]
    fn what_no_object_can_continue_is_refused() {
        for text in [
            "[1]",
            "\"s\"",
            "1",
            "x",
            "{a: 1}",
            r#"{"a" 1}"#,
            r#"{"a": 1,}"#,
            r#"{"a": [1,]}"#,
            r#"{"a": 01}"#,
            r#"{"a": 1.}"#,
            r#"{"a": -}"#,
            r#"{"a": 1e}"#,
            r#"{"a": tru}"#,
            r#"{"a": nul1}"#,
            r#"{"a": "\x"}"#,
            r#"{"a": "\u12g4"}"#,
            "{\"a\": \"line\nbreak\"}",
            r#"{"a": 1]"#,
            r#"{"a": [1}"#,
            r#"{} {}"#,
            "{} ",
            r#"{"a": 1}}"#,
        ] {
            assert!(!valid_prefix(text), "{text:?} begins no object");
            // (A parser takes whitespace after the object; the sampler
            // ends the output there instead.)
            if !text.ends_with(' ') {
                assert!(serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(text).is_err(), "{text:?} parses as an object");
            }
        }
    }

    #[test]
    fn blanks_and_brackets_are_bounded() {
        let blanks = format!("{{{}", " ".repeat(MAX_WHITESPACE as usize));
        assert!(valid_prefix(&blanks));
        assert!(!valid_prefix(&format!("{blanks} ")));
        assert!(valid_prefix(&format!("{blanks}\"a\":{}1}}", " ".repeat(MAX_WHITESPACE as usize))), "each run counts on its own");
        let deep = format!("{{\"a\":{}", "[".repeat(MAX_DEPTH - 1));
        assert!(valid_prefix(&deep));
        assert!(!valid_prefix(&format!("{deep}[")));
    }

    #[test]
    fn accepting_leaves_the_state_as_it_was() {
        let mut state = JsonState::object();
        assert!(state.feed(b"{\"k\": "));
        let before = state.clone();
        assert!(state.accepts(b"\"v\"}") && !state.accepts(b"}") && !state.accepts(b""));
        assert_eq!(state, before);
        // A number ends at the byte after it, which the same token may carry.
        assert!(state.accepts(b"12}"));
        assert!(state.feed(b"12}") && state.is_complete());
        assert!(!state.accepts(b" "));
    }
}

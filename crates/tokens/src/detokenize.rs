//! Token ids back to text, one token at a time, never splitting a UTF-8
//! character.
//!
//! Every token maps to a fixed byte string (byte-level BPE characters undone,
//! SentencePiece `▁` turned into spaces, `<0xXX>` pieces into raw bytes), so
//! detokenizing is appending bytes and emitting the longest complete UTF-8
//! prefix: O(1) per token, no re-decoding of a window.

use std::sync::Arc;

use crate::tokenizer::{TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL, TokenizerSpec};

/// The raw bytes of every token of a vocabulary, in one run (a token's
/// are `data[ends[id - 1]..ends[id]]`): constrained sampling may read every
/// token's bytes a step, which scattered allocations would make a walk of
/// cache misses.
#[derive(Debug, Clone)]
pub struct TokenBytes {
    data: Vec<u8>,
    ends: Vec<u32>,
    special: Vec<bool>,
}

impl TokenBytes {
    /// Computes the byte string of every token in `spec`.
    pub fn new(spec: &TokenizerSpec) -> Self {
        let byte_level = spec.model == "gpt2";
        let unicode_to_byte = gpt2_unicode_to_byte();
        let mut data = Vec::new();
        let mut ends = Vec::with_capacity(spec.tokens.len());
        let mut special = Vec::with_capacity(spec.tokens.len());
        for (id, token) in spec.tokens.iter().enumerate() {
            let token_type = spec.token_type(id as u32);
            special.push(token_type == TOKEN_TYPE_CONTROL);
            let raw = if token_type == TOKEN_TYPE_CONTROL {
                token.as_bytes().to_vec()
            } else if byte_level {
                token
                    .chars()
                    .map(|c| unicode_to_byte.get(c as usize).copied().flatten())
                    .collect::<Option<Vec<u8>>>()
                    // Not a byte-level string (e.g. a user-defined token): keep its text.
                    .unwrap_or_else(|| token.as_bytes().to_vec())
            } else if token_type == TOKEN_TYPE_BYTE {
                parse_byte_token(token).map(|b| vec![b]).unwrap_or_else(|| token.as_bytes().to_vec())
            } else {
                token.replace('▁', " ").into_bytes()
            };
            data.extend_from_slice(&raw);
            ends.push(u32::try_from(data.len()).expect("a vocabulary's bytes fit in 4 GiB"));
        }
        Self { data, ends, special }
    }

    /// The bytes of a token; empty for ids outside the vocabulary.
    #[inline]
    pub fn get(&self, token_id: u32) -> &[u8] {
        let id = token_id as usize;
        let Some(&end) = self.ends.get(id) else { return &[] };
        let start = if id == 0 { 0 } else { self.ends[id - 1] };
        &self.data[start as usize..end as usize]
    }

    /// Whether the token is a control token (skipped in output text).
    #[inline]
    pub fn is_special(&self, token_id: u32) -> bool {
        self.special.get(token_id as usize).copied().unwrap_or(false)
    }
}

impl IncrementalDecoder {
    /// A fresh decoder over `vocabulary`.
    pub fn new(vocabulary: Arc<TokenBytes>) -> Self {
        Self { vocabulary, pending: Vec::with_capacity(8) }
    }
}

/// Turns a stream of token ids into a stream of complete UTF-8 text.
#[derive(Debug)]
pub struct IncrementalDecoder {
    vocabulary: Arc<TokenBytes>,
    /// Bytes of an incomplete UTF-8 character carried to the next token.
    pending: Vec<u8>,
}

impl IncrementalDecoder {
    /// Appends the text completed by `token_id` to `out`. Control tokens add
    /// nothing; bytes of a character split across tokens wait for the rest.
    pub fn push(&mut self, token_id: u32, out: &mut String) {
        if self.vocabulary.is_special(token_id) {
            return;
        }
        let bytes = self.vocabulary.get(token_id);
        if self.pending.is_empty() {
            // Fast path: most tokens are complete UTF-8 on their own.
            match std::str::from_utf8(bytes) {
                Ok(text) => out.push_str(text),
                Err(_) => {
                    self.pending.extend_from_slice(bytes);
                    self.drain(out, false);
                }
            }
        } else {
            self.pending.extend_from_slice(bytes);
            self.drain(out, false);
        }
    }

    /// Flushes whatever is still pending at the end of the stream; an
    /// incomplete character becomes U+FFFD.
    pub fn finish(&mut self, out: &mut String) {
        self.drain(out, true);
    }

    /// Whether bytes of an incomplete character are waiting.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn drain(&mut self, out: &mut String, at_end: bool) {
        let mut consumed = 0;
        loop {
            let rest = &self.pending[consumed..];
            match std::str::from_utf8(rest) {
                Ok(text) => {
                    out.push_str(text);
                    consumed = self.pending.len();
                    break;
                }
                Err(error) => {
                    let valid = error.valid_up_to();
                    // Safe by construction: from_utf8 validated this prefix.
                    out.push_str(std::str::from_utf8(&rest[..valid]).unwrap_or_default());
                    consumed += valid;
                    match error.error_len() {
                        // Invalid bytes: they can never become a character.
                        Some(invalid) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            consumed += invalid;
                        }
                        // An incomplete character at the end: wait for more.
                        None if !at_end => break,
                        None => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            consumed = self.pending.len();
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..consumed);
    }
}

/// Parses a SentencePiece byte token such as `<0x0A>`.
fn parse_byte_token(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}

/// Inverse of GPT-2's `bytes_to_unicode`: printable bytes stand for
/// themselves, the others were shifted to code points 256 and up.
fn gpt2_unicode_to_byte() -> Vec<Option<u8>> {
    let mut table = vec![None; 512];
    let mut shifted = 0usize;
    for byte in 0u16..=255 {
        let printable = (33..=126).contains(&byte) || (161..=172).contains(&byte) || (174..=255).contains(&byte);
        let code_point = if printable {
            byte as usize
        } else {
            shifted += 1;
            255 + shifted
        };
        table[code_point] = Some(byte as u8);
    }
    table
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(model: &str, tokens: &[&str], types: &[i32]) -> TokenizerSpec {
        TokenizerSpec { model: model.into(), tokens: tokens.iter().map(|t| t.to_string()).collect(), token_types: types.to_vec(), ..Default::default() }
    }

    #[test]
    fn byte_level_tokens_map_back_to_bytes() {
        // "Ġ" is a space, "Ċ" a newline; "ðŁ" + "ĺ" + "Ģ" spell the bytes of 😀.
        let vocabulary = Arc::new(TokenBytes::new(&spec("gpt2", &["Ġhi", "Ċ", "ðŁ", "ĺ", "Ģ", "<|im_end|>"], &[1, 1, 1, 1, 1, 3])));
        assert_eq!(vocabulary.get(0), b" hi");
        assert_eq!(vocabulary.get(1), b"\n");
        let mut decoder = IncrementalDecoder::new(vocabulary);
        let mut out = String::new();
        decoder.push(0, &mut out);
        decoder.push(2, &mut out);
        assert_eq!(out, " hi", "half an emoji must wait");
        decoder.push(3, &mut out);
        assert_eq!(out, " hi");
        decoder.push(4, &mut out);
        assert_eq!(out, " hi😀");
        decoder.push(5, &mut out);
        assert_eq!(out, " hi😀", "control tokens are not text");
        assert!(!decoder.has_pending());
    }

    #[test]
    fn sentencepiece_pieces_and_byte_tokens() {
        let vocabulary = Arc::new(TokenBytes::new(&spec("llama", &["▁Hello", "<0xE2>", "<0x82>", "<0xAC>", "</s>"], &[1, 6, 6, 6, 3])));
        let mut decoder = IncrementalDecoder::new(vocabulary);
        let mut out = String::new();
        for id in [0, 1, 2] {
            decoder.push(id, &mut out);
        }
        assert_eq!(out, " Hello");
        decoder.push(3, &mut out);
        assert_eq!(out, " Hello€");
    }

    #[test]
    fn invalid_and_truncated_bytes_become_replacement_characters() {
        let vocabulary = Arc::new(TokenBytes::new(&spec("llama", &["<0xFF>", "<0xE2>", "a"], &[6, 6, 1])));
        let mut decoder = IncrementalDecoder::new(vocabulary);
        let mut out = String::new();
        decoder.push(0, &mut out);
        decoder.push(2, &mut out);
        assert_eq!(out, "\u{FFFD}a");
        decoder.push(1, &mut out);
        decoder.finish(&mut out);
        assert_eq!(out, "\u{FFFD}a\u{FFFD}");
    }

    #[test]
    fn gpt2_table_is_a_bijection() {
        let table = gpt2_unicode_to_byte();
        let mut seen = [false; 256];
        for byte in table.iter().flatten() {
            assert!(!seen[*byte as usize]);
            seen[*byte as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }
}

//! A fast encoder for byte-level BPE vocabularies (`tokenizer.ggml.model =
//! gpt2`), producing exactly the ids of the HF `tokenizers` pipeline it
//! shadows (tested for equality), at a fraction of the cost: it works on
//! token ids and raw bytes instead of re-encoded strings with alignment
//! tracking, and caches the ids of every piece it has seen.
//!
//! The pipeline, as HF runs it for these models:
//! 1. split out control and user-defined tokens (leftmost-longest match);
//! 2. pre-tokenize: optionally isolate every numeric character, then split
//!    with the pre-tokenizer regex (matches and the gaps between them);
//! 3. BPE over the bytes of each piece: repeatedly merge the adjacent pair
//!    with the lowest merge rank (leftmost on ties).

use std::collections::HashMap;
use std::sync::OnceLock;

use aho_corasick::{AhoCorasick, MatchKind};
use parking_lot::RwLock;
use rustc_hash::FxHashMap;

use crate::tokenizer::{TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TokenizerSpec};

/// GPT-2's pre-tokenizer regex (what HF's ByteLevel uses with `use_regex`).
pub(crate) const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// Ids of pieces already encoded, by the piece's bytes.
type PieceCache = FxHashMap<Box<[u8]>, Box<[u32]>>;

/// Marks a byte without a token.
const NO_TOKEN: u32 = u32::MAX;

/// Pieces cached at most; the cache is cleared when it grows past this.
const CACHE_CAPACITY: usize = 65_536;

/// How the text is cut into pieces before BPE.
#[derive(Debug)]
pub(crate) struct PreTokenizer {
    splitter: Splitter,
    isolate_numeric: bool,
}

/// The regex split itself.
#[derive(Debug)]
enum Splitter {
    /// GPT-2's pattern, hand-coded (the common case, and the hot path).
    Gpt2(CharClasses),
    /// Any other pattern, through the regex engine.
    Regex(onig::Regex),
}

impl PreTokenizer {
    /// A pre-tokenizer splitting with `regex`, after isolating each numeric
    /// character if `isolate_numeric`.
    pub(crate) fn new(regex: &str, isolate_numeric: bool) -> Option<Self> {
        let splitter = if regex == GPT2_REGEX { Splitter::Gpt2(CharClasses::new()?) } else { Splitter::Regex(onig::Regex::new(regex).ok()?) };
        Some(Self { splitter, isolate_numeric })
    }

    fn pieces<'t>(&self, text: &'t str, out: &mut Vec<&'t str>) {
        if !self.isolate_numeric {
            self.regex_pieces(text, out);
            return;
        }
        let mut run_start = 0;
        for (index, c) in text.char_indices() {
            if c.is_numeric() {
                if run_start < index {
                    self.regex_pieces(&text[run_start..index], out);
                }
                out.push(&text[index..index + c.len_utf8()]);
                run_start = index + c.len_utf8();
            }
        }
        if run_start < text.len() {
            self.regex_pieces(&text[run_start..], out);
        }
    }

    fn regex_pieces<'t>(&self, text: &'t str, out: &mut Vec<&'t str>) {
        let regex = match &self.splitter {
            Splitter::Gpt2(classes) => return gpt2_pieces(classes, text, out),
            Splitter::Regex(regex) => regex,
        };
        let mut previous = 0;
        for (start, end) in regex.find_iter(text) {
            if previous != start {
                out.push(&text[previous..start]);
            }
            out.push(&text[start..end]);
            previous = end;
        }
        if previous != text.len() {
            out.push(&text[previous..]);
        }
    }
}

/// Character classes of the GPT-2 pattern (`\p{L}`, `\p{N}`, `\s`) as the
/// regex engine defines them: each 64-character block is classified by
/// asking the engine once, then looked up, so the hand-coded splitter can
/// never disagree with the regex (whatever Unicode version it follows).
struct CharClasses {
    letter: onig::Regex,
    number: onig::Regex,
    space: onig::Regex,
    /// Per block of 64 code points: bit masks of letters, numbers, spaces.
    blocks: Box<[OnceLock<[u64; 3]>]>,
}

impl std::fmt::Debug for CharClasses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CharClasses")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

impl CharClasses {
    fn new() -> Option<Self> {
        Some(Self {
            letter: onig::Regex::new(r"\p{L}").ok()?,
            number: onig::Regex::new(r"\p{N}").ok()?,
            space: onig::Regex::new(r"\s").ok()?,
            blocks: (0..=(char::MAX as usize >> 6)).map(|_| OnceLock::new()).collect(),
        })
    }

    fn class(&self, c: char) -> Class {
        let code = c as usize;
        let masks = self.blocks[code >> 6].get_or_init(|| self.classify_block(code >> 6));
        let bit = 1u64 << (code & 63);
        if masks[0] & bit != 0 {
            Class::Letter
        } else if masks[1] & bit != 0 {
            Class::Number
        } else if masks[2] & bit != 0 {
            Class::Space
        } else {
            Class::Other
        }
    }

    fn classify_block(&self, block: usize) -> [u64; 3] {
        let mut masks = [0u64; 3];
        let mut buffer = [0u8; 4];
        for offset in 0..64 {
            let Some(c) = char::from_u32((block * 64 + offset) as u32) else { continue };
            let text = c.encode_utf8(&mut buffer);
            for (mask, regex) in masks.iter_mut().zip([&self.letter, &self.number, &self.space]) {
                if regex.is_match(text) {
                    *mask |= 1 << offset;
                }
            }
        }
        masks
    }
}

/// GPT-2's pattern, `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
/// ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`, as a leftmost-first scanner. Every
/// position matches some alternative, so the pieces tile the text.
fn gpt2_pieces<'t>(classes: &CharClasses, text: &'t str, out: &mut Vec<&'t str>) {
    let bytes = text.as_bytes();
    let char_at = |i: usize| text[i..].chars().next();
    // End of the run of characters of `class` starting at `i`.
    let run_end = |mut i: usize, class: Class| {
        while let Some(c) = char_at(i) {
            if classes.class(c) != class {
                break;
            }
            i += c.len_utf8();
        }
        i
    };
    let mut i = 0;
    while i < text.len() {
        let c = char_at(i).expect("i is on a character boundary");
        // 's 't 're 've 'm 'll 'd
        if c == '\'' {
            let rest = &bytes[i + 1..];
            let contraction = [&b"re"[..], b"ve", b"ll", b"s", b"t", b"m", b"d"].into_iter().find(|suffix| rest.starts_with(suffix));
            if let Some(suffix) = contraction {
                out.push(&text[i..i + 1 + suffix.len()]);
                i += 1 + suffix.len();
                continue;
            }
        }
        // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`
        let (body_start, body_class) = match (c, char_at(i + c.len_utf8())) {
            (' ', Some(next)) if classes.class(next) != Class::Space => (i + 1, classes.class(next)),
            _ => (i, classes.class(c)),
        };
        if body_class != Class::Space {
            let end = run_end(body_start, body_class);
            out.push(&text[i..end]);
            i = end;
            continue;
        }
        // `\s+(?!\S)` leaves the last space of a run for the next piece when
        // something follows; `\s+` takes a single space.
        let end = run_end(i, Class::Space);
        let piece_end = if end == text.len() {
            end
        } else {
            let last = text[i..end].chars().next_back().expect("run is not empty");
            if end - last.len_utf8() > i { end - last.len_utf8() } else { end }
        };
        out.push(&text[i..piece_end]);
        i = piece_end;
    }
}

/// The fast encoder of one byte-level BPE vocabulary.
#[derive(Debug)]
pub(crate) struct ByteLevelBpe {
    /// Token of each single byte ([`NO_TOKEN`] for bytes the vocabulary
    /// lacks, such as some control characters: those are dropped, as HF's
    /// BPE drops characters it has no token for).
    byte_tokens: [u32; 256],
    /// (left, right) → (rank, merged token).
    merges: FxHashMap<(u32, u32), (u32, u32)>,
    pre_tokenizer: PreTokenizer,
    /// Control and user-defined tokens, matched before anything else.
    added: Option<(AhoCorasick, Vec<u32>)>,
    /// User-defined tokens alone (for text whose control-token texts stay
    /// text).
    user_defined: Option<(AhoCorasick, Vec<u32>)>,
    cache: RwLock<PieceCache>,
}

impl ByteLevelBpe {
    /// Builds the encoder; `None` if the vocabulary is not a byte-level BPE
    /// this encoder reproduces (a merge is malformed).
    pub(crate) fn new(spec: &TokenizerSpec, token_bytes: &crate::TokenBytes, pre_tokenizer: PreTokenizer) -> Option<Self> {
        // Raw bytes of every ordinary token → id (first id wins, as in HF).
        let mut by_bytes: HashMap<&[u8], u32> = HashMap::with_capacity(spec.tokens.len());
        for id in 0..spec.tokens.len() as u32 {
            let token_type = spec.token_type(id);
            if token_type == TOKEN_TYPE_CONTROL || token_type == TOKEN_TYPE_USER_DEFINED {
                continue;
            }
            by_bytes.entry(token_bytes.get(id)).or_insert(id);
        }
        let mut byte_tokens = [NO_TOKEN; 256];
        for byte in 0..=255u8 {
            if let Some(&id) = by_bytes.get(&[byte][..]) {
                byte_tokens[byte as usize] = id;
            }
        }
        let by_text: HashMap<&str, u32> = spec.tokens.iter().enumerate().rev().map(|(id, t)| (t.as_str(), id as u32)).collect();
        let mut merges = FxHashMap::default();
        for (rank, merge) in spec.merges.iter().enumerate() {
            let (left, right) = merge.split_once(' ')?;
            let (&left_id, &right_id) = (by_text.get(left)?, by_text.get(right)?);
            let Some(&merged) = by_text.get(format!("{left}{right}").as_str()) else { continue };
            // A repeated merge keeps its last rank, as HF's merge map does.
            merges.insert((left_id, right_id), (rank as u32, merged));
        }
        let added_ids: Vec<u32> = (0..spec.tokens.len() as u32)
            .filter(|&id| matches!(spec.token_type(id), TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
            .filter(|&id| !spec.tokens[id as usize].is_empty())
            .collect();
        let user_defined_ids: Vec<u32> = added_ids.iter().copied().filter(|&id| spec.token_type(id) == TOKEN_TYPE_USER_DEFINED).collect();
        let matcher = |ids: Vec<u32>| -> Option<Option<(AhoCorasick, Vec<u32>)>> {
            if ids.is_empty() {
                return Some(None);
            }
            let patterns: Vec<&str> = ids.iter().map(|&id| spec.tokens[id as usize].as_str()).collect();
            let automaton = AhoCorasick::builder().match_kind(MatchKind::LeftmostLongest).build(&patterns).ok()?;
            Some(Some((automaton, ids)))
        };
        let added = matcher(added_ids)?;
        let user_defined = matcher(user_defined_ids)?;
        Some(Self { byte_tokens, merges, pre_tokenizer, added, user_defined, cache: RwLock::new(FxHashMap::default()) })
    }

    /// Encodes text to token ids.
    pub(crate) fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_with(text, self.added.as_ref())
    }

    /// Encodes text to token ids with control-token texts as ordinary text
    /// (user-defined tokens are still matched).
    pub(crate) fn encode_plain(&self, text: &str) -> Vec<u32> {
        self.encode_with(text, self.user_defined.as_ref())
    }

    fn encode_with(&self, text: &str, added: Option<&(AhoCorasick, Vec<u32>)>) -> Vec<u32> {
        let mut ids = Vec::with_capacity(text.len() / 3 + 4);
        let mut pieces = Vec::with_capacity(text.len() / 3 + 4);
        match added {
            None => self.pre_tokenizer.pieces(text, &mut pieces),
            Some((automaton, added_ids)) => {
                let mut previous = 0;
                for found in automaton.find_iter(text) {
                    if previous < found.start() {
                        self.pre_tokenizer.pieces(&text[previous..found.start()], &mut pieces);
                    }
                    // An added token is a piece of its own, encoded as its id.
                    self.encode_pieces(&mut pieces, &mut ids);
                    ids.push(added_ids[found.pattern().as_usize()]);
                    previous = found.end();
                }
                if previous < text.len() {
                    self.pre_tokenizer.pieces(&text[previous..], &mut pieces);
                }
            }
        }
        self.encode_pieces(&mut pieces, &mut ids);
        ids
    }

    fn encode_pieces(&self, pieces: &mut Vec<&str>, ids: &mut Vec<u32>) {
        for piece in pieces.drain(..) {
            self.encode_piece(piece.as_bytes(), ids);
        }
    }

    fn encode_piece(&self, piece: &[u8], out: &mut Vec<u32>) {
        if let [byte] = piece {
            let id = self.byte_tokens[*byte as usize];
            if id != NO_TOKEN {
                out.push(id);
            }
            return;
        }
        if let Some(ids) = self.cache.read().get(piece) {
            out.extend_from_slice(ids);
            return;
        }
        let ids = self.merge(piece);
        out.extend_from_slice(&ids);
        let mut cache = self.cache.write();
        if cache.len() >= CACHE_CAPACITY {
            cache.clear();
        }
        cache.insert(piece.into(), ids.into_boxed_slice());
    }

    /// BPE over one piece: merge the lowest-ranked adjacent pair (leftmost
    /// on ties) until no pair has a merge.
    fn merge(&self, piece: &[u8]) -> Vec<u32> {
        let mut symbols: Vec<u32> = piece.iter().map(|&b| self.byte_tokens[b as usize]).filter(|&id| id != NO_TOKEN).collect();
        if symbols.len() < 2 {
            return symbols;
        }
        // ranks[i]: merge of (symbols[i], symbols[i + 1]).
        let mut ranks: Vec<Option<(u32, u32)>> = symbols.windows(2).map(|pair| self.merges.get(&(pair[0], pair[1])).copied()).collect();
        loop {
            let mut best: Option<(usize, u32, u32)> = None;
            for (index, merge) in ranks.iter().enumerate() {
                if let Some((rank, merged)) = *merge
                    && best.is_none_or(|(_, best_rank, _)| rank < best_rank)
                {
                    best = Some((index, rank, merged));
                }
            }
            let Some((index, _, merged)) = best else { break };
            symbols[index] = merged;
            symbols.remove(index + 1);
            ranks.remove(index);
            if index > 0 {
                ranks[index - 1] = self.merges.get(&(symbols[index - 1], merged)).copied();
            }
            if index < ranks.len() {
                ranks[index] = self.merges.get(&(merged, symbols[index + 1])).copied();
            }
        }
        symbols
    }
}

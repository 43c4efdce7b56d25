//! Tokenizers built from GGUF metadata (`tokenizer.ggml.*`) with the HF
//! `tokenizers` crate, configured to reproduce llama.cpp's token ids.
//!
//! Two families are supported: `gpt2` (byte-level BPE with merges; the
//! pre-tokenizer regex depends on `tokenizer.ggml.pre`) and `llama`
//! (SentencePiece BPE with scores and byte fallback). Anything else is
//! refused with an error naming the family.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::control::{ControlTexts, Piece};
use crate::detokenize::{IncrementalDecoder, TokenBytes};
use crate::fast_bpe::{ByteLevelBpe, GPT2_REGEX, PreTokenizer};
use crate::gguf::{Gguf, Value};
use crate::{Error, Result};

/// GGUF token type of control tokens (`<|im_start|>`, `</s>`, ...).
pub const TOKEN_TYPE_CONTROL: i32 = 3;
/// GGUF token type of user-defined tokens (treated as atomic, not special).
pub const TOKEN_TYPE_USER_DEFINED: i32 = 4;
/// GGUF token type of byte-fallback tokens (`<0x0A>`).
pub const TOKEN_TYPE_BYTE: i32 = 6;

/// Control-token texts that end generation, as llama.cpp recognises them.
pub(crate) const END_OF_GENERATION_TEXTS: &[&str] =
    &["<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>", "<｜end▁of▁sentence｜>"];

/// Llama 3 style pre-tokenizer regex (also used by `llama-bpe` GGUFs).
pub(crate) const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2 style pre-tokenizer regex (single digits).
pub(crate) const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer's definition as stored in GGUF metadata: everything needed to
/// rebuild it elsewhere (the model card carries it to gateways).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TokenizerSpec {
    /// Family: `gpt2` or `llama`.
    pub model: String,
    /// Pre-tokenizer name (`tokenizer.ggml.pre`), empty when absent.
    pub pre: String,
    /// Token strings by id.
    pub tokens: Vec<String>,
    /// GGUF token types by id (empty when absent: all normal).
    pub token_types: Vec<i32>,
    /// BPE merges `"left right"` by priority (gpt2 family).
    pub merges: Vec<String>,
    /// Token scores by id (llama family).
    pub scores: Vec<f32>,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence token.
    pub eos_token_id: Option<u32>,
    /// Prepend BOS to every prompt.
    pub add_bos_token: bool,
    /// Prepend a space to the text before tokenizing (SentencePiece style).
    pub add_space_prefix: bool,
    /// Padding token.
    pub padding_token_id: Option<u32>,
    /// Unknown token.
    pub unknown_token_id: Option<u32>,
    /// Every token that ends generation (EOS, end-of-turn, ...).
    pub eog_token_ids: Vec<u32>,
}

impl TokenizerSpec {
    /// Reads the tokenizer definition from GGUF metadata.
    pub fn from_gguf(gguf: &Gguf) -> Result<Self> {
        let model = gguf.get_str("tokenizer.ggml.model").ok_or_else(|| Error::UnsupportedTokenizer("the file has no tokenizer.ggml.model".into()))?.to_owned();
        let strings = |key: &str| -> Vec<String> {
            gguf.get(key).and_then(Value::as_array).map(|values| values.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect()).unwrap_or_default()
        };
        let tokens = strings("tokenizer.ggml.tokens");
        if tokens.is_empty() {
            return Err(Error::UnsupportedTokenizer("the file has no tokenizer.ggml.tokens".into()));
        }
        let token_types: Vec<i32> = gguf
            .get("tokenizer.ggml.token_type")
            .and_then(Value::as_array)
            .map(|values| values.iter().map(|v| v.as_f64().unwrap_or(1.0) as i32).collect())
            .unwrap_or_default();
        let scores: Vec<f32> = gguf
            .get("tokenizer.ggml.scores")
            .and_then(Value::as_array)
            .map(|values| values.iter().map(|v| v.as_f64().unwrap_or(0.0) as f32).collect())
            .unwrap_or_default();
        let id = |key: &str| gguf.get_u64(key).and_then(|v| u32::try_from(v).ok()).filter(|&v| (v as usize) < tokens.len());
        let flag = |key: &str| gguf.get(key).and_then(Value::as_bool);
        let bos_token_id = id("tokenizer.ggml.bos_token_id");
        let eos_token_id = id("tokenizer.ggml.eos_token_id");
        let is_llama = model == "llama";

        let mut eog_token_ids: Vec<u32> = [eos_token_id, id("tokenizer.ggml.eot_token_id"), id("tokenizer.ggml.eom_token_id")].into_iter().flatten().collect();
        for (token_id, text) in tokens.iter().enumerate() {
            let control = token_types.get(token_id).is_none_or(|&t| t == TOKEN_TYPE_CONTROL || t == TOKEN_TYPE_USER_DEFINED);
            if control && END_OF_GENERATION_TEXTS.contains(&text.as_str()) {
                eog_token_ids.push(token_id as u32);
            }
        }
        eog_token_ids.sort_unstable();
        eog_token_ids.dedup();

        Ok(Self {
            pre: gguf.get_str("tokenizer.ggml.pre").unwrap_or_default().to_owned(),
            merges: strings("tokenizer.ggml.merges"),
            bos_token_id,
            eos_token_id,
            add_bos_token: flag("tokenizer.ggml.add_bos_token").unwrap_or(is_llama),
            add_space_prefix: flag("tokenizer.ggml.add_space_prefix").unwrap_or(is_llama),
            padding_token_id: id("tokenizer.ggml.padding_token_id"),
            unknown_token_id: id("tokenizer.ggml.unknown_token_id"),
            eog_token_ids,
            tokens,
            token_types,
            scores,
            model,
        })
    }

    /// The GGUF type of a token (1, normal, when the file has no types).
    pub fn token_type(&self, token_id: u32) -> i32 {
        self.token_types.get(token_id as usize).copied().unwrap_or(1)
    }
}

/// A ready-to-use tokenizer: text to ids, ids to bytes.
///
/// Built with HF `tokenizers`; byte-level BPE vocabularies also get a fast
/// encoder that produces the same ids (see [`crate::fast_bpe`]), used for
/// [`encode`](Self::encode).
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// `inner` with control-token texts split as ordinary text (built when
    /// first needed).
    inner_plain: OnceLock<tokenizers::Tokenizer>,
    fast: Option<ByteLevelBpe>,
    spec: TokenizerSpec,
    token_bytes: Arc<TokenBytes>,
    controls: ControlTexts,
}

impl Tokenizer {
    /// Builds the tokenizer described by `spec`.
    pub fn from_spec(spec: TokenizerSpec) -> Result<Self> {
        let mut inner = match spec.model.as_str() {
            "gpt2" => build_byte_level(&spec)?,
            "llama" => build_sentencepiece(&spec)?,
            other => {
                return Err(Error::UnsupportedTokenizer(format!("tokenizer family {other:?} is not supported (supported: gpt2, llama)")));
            }
        };
        let special: Vec<AddedToken> = spec
            .tokens
            .iter()
            .enumerate()
            .filter(|(id, _)| spec.token_type(*id as u32) == TOKEN_TYPE_CONTROL)
            .map(|(_, text)| AddedToken::from(text.clone(), true))
            .collect();
        inner.add_special_tokens(special).map_err(tokenizer_error)?;
        let user_defined: Vec<AddedToken> = spec
            .tokens
            .iter()
            .enumerate()
            .filter(|(id, _)| spec.token_type(*id as u32) == TOKEN_TYPE_USER_DEFINED)
            .map(|(_, text)| AddedToken::from(text.clone(), false))
            .collect();
        inner.add_tokens(user_defined).map_err(tokenizer_error)?;
        let token_bytes = Arc::new(TokenBytes::new(&spec));
        let fast = if spec.model == "gpt2" {
            let (regex, isolate_numeric) = pre_tokenizer_rule(&spec.pre);
            PreTokenizer::new(regex, isolate_numeric).and_then(|pre| ByteLevelBpe::new(&spec, &token_bytes, pre))
        } else {
            None
        };
        let controls = ControlTexts::new(&spec);
        Ok(Self { inner, inner_plain: OnceLock::new(), fast, spec, token_bytes, controls })
    }

    /// Builds the tokenizer stored in a GGUF file's metadata.
    pub fn from_gguf(gguf: &Gguf) -> Result<Self> {
        Self::from_spec(TokenizerSpec::from_gguf(gguf)?)
    }

    /// Encodes text to token ids. Control tokens written as text (e.g.
    /// `<|im_start|>` in a rendered chat template) become their ids; BOS is
    /// prepended when the model asks for it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match &self.fast {
            Some(fast) => Ok(self.with_bos(fast.encode(text))),
            None => self.encode_reference(text),
        }
    }

    /// Encodes with the HF pipeline alone (the reference the fast encoder
    /// is tested against).
    pub fn encode_reference(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self.inner.encode_fast(text, false).map_err(tokenizer_error)?;
        Ok(self.with_bos(encoding.get_ids().to_vec()))
    }

    /// Encodes a prompt rendered from marked messages
    /// ([`ControlTexts::mark`]): control tokens written in it become their
    /// ids; each mark becomes the text it stands for, tokenized as ordinary
    /// text (so a user's `<|im_start|>` is a few tokens of text, never the
    /// control token). Text without marks encodes as [`encode`](Self::encode)
    /// does.
    pub fn encode_marked(&self, text: &str) -> Result<Vec<u32>> {
        if !text.contains(crate::control::MARK) {
            return self.encode(text);
        }
        let mut ids = Vec::with_capacity(text.len() / 3 + 4);
        for piece in self.controls.pieces(text) {
            match piece {
                Piece::Control(id) => ids.push(id),
                Piece::Text(text) => ids.extend(self.encode_plain(&self.controls.unmark(text))?),
            }
        }
        Ok(self.with_bos(ids))
    }

    /// Encodes text with control-token texts as ordinary text, no BOS.
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        match &self.fast {
            Some(fast) => Ok(fast.encode_plain(text)),
            None => self.encode_plain_reference(text),
        }
    }

    /// [`encode_plain`](Self::encode_plain) with the HF pipeline alone.
    pub fn encode_plain_reference(&self, text: &str) -> Result<Vec<u32>> {
        let plain = self.inner_plain.get_or_init(|| {
            let mut plain = self.inner.clone();
            plain.set_encode_special_tokens(true);
            plain
        });
        Ok(plain.encode_fast(text, false).map_err(tokenizer_error)?.get_ids().to_vec())
    }

    /// The control tokens of this vocabulary, as text.
    pub fn control_texts(&self) -> &ControlTexts {
        &self.controls
    }

    /// Whether the fast encoder is in use.
    pub fn has_fast_encoder(&self) -> bool {
        self.fast.is_some()
    }

    fn with_bos(&self, mut ids: Vec<u32>) -> Vec<u32> {
        if let Some(bos) = self.spec.bos_token_id
            && self.spec.add_bos_token
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        ids
    }

    /// Decodes token ids to text in one go (special tokens skipped).
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut decoder = self.decoder();
        let mut text = String::new();
        for &id in ids {
            decoder.push(id, &mut text);
        }
        decoder.finish(&mut text);
        text
    }

    /// The raw bytes of every token.
    pub fn token_bytes(&self) -> &Arc<TokenBytes> {
        &self.token_bytes
    }

    /// A fresh incremental decoder for this vocabulary.
    pub fn decoder(&self) -> IncrementalDecoder {
        IncrementalDecoder::new(self.token_bytes.clone())
    }

    /// The definition this tokenizer was built from.
    pub fn spec(&self) -> &TokenizerSpec {
        &self.spec
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.spec.tokens.len()
    }

    /// The token's text, if the id is in the vocabulary.
    pub fn token_text(&self, token_id: u32) -> Option<&str> {
        self.spec.tokens.get(token_id as usize).map(String::as_str)
    }

    /// Whether the token is a control (special) token.
    pub fn is_special(&self, token_id: u32) -> bool {
        self.spec.token_type(token_id) == TOKEN_TYPE_CONTROL
    }
}

fn tokenizer_error(error: tokenizers::Error) -> Error {
    Error::Tokenizer(error.to_string())
}

/// Token text to id; the first id wins when a text repeats.
fn vocabulary(spec: &TokenizerSpec) -> Vocab {
    let mut vocab = HashMap::with_capacity(spec.tokens.len());
    for (id, token) in spec.tokens.iter().enumerate() {
        vocab.entry(token.clone()).or_insert(id as u32);
    }
    vocab.into_iter().collect()
}

/// How a GGUF `tokenizer.ggml.pre` name pre-tokenizes: the split regex,
/// and whether every numeric character is isolated first. Both the HF
/// pipeline and the fast encoder are built from this one rule.
fn pre_tokenizer_rule(pre: &str) -> (&'static str, bool) {
    match pre {
        // GPT-2's regex after splitting every digit on its own.
        "smollm" | "starcoder" | "refact" | "codeshell" => (GPT2_REGEX, true),
        "llama-bpe" | "llama3" | "dbrx" | "smaug-bpe" => (LLAMA3_REGEX, false),
        "qwen2" | "deepseek-r1-qwen" => (QWEN2_REGEX, false),
        "" | "default" | "gpt2" | "gpt-2" => (GPT2_REGEX, false),
        other => {
            tracing::warn!(pre = other, "unknown pre-tokenizer, using GPT-2's; token ids may differ from llama.cpp");
            (GPT2_REGEX, false)
        }
    }
}

/// The HF pre-tokenizer for a rule: the regex split (matches and gaps), then
/// byte-level mapping.
fn pre_tokenizer(pre: &str) -> Result<PreTokenizerWrapper> {
    let (regex, isolate_numeric) = pre_tokenizer_rule(pre);
    let split = Split::new(SplitPattern::Regex(regex.to_owned()), SplitDelimiterBehavior::Isolated, false).map_err(tokenizer_error)?;
    let mut steps: Vec<PreTokenizerWrapper> = Vec::new();
    if isolate_numeric {
        steps.push(Digits::new(true).into());
    }
    steps.push(split.into());
    steps.push(ByteLevel::new(false, true, false).into());
    Ok(PreTokenizerSequence::new(steps).into())
}

fn build_byte_level(spec: &TokenizerSpec) -> Result<tokenizers::Tokenizer> {
    let merges = spec
        .merges
        .iter()
        .map(|merge| {
            merge.split_once(' ').map(|(left, right)| (left.to_owned(), right.to_owned())).ok_or_else(|| Error::Tokenizer(format!("malformed merge {merge:?}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder().vocab_and_merges(vocabulary(spec), merges).build().map_err(tokenizer_error)?;
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer(&spec.pre)?));
    tokenizer.with_decoder(Some(ByteLevelDecoder::default()));
    Ok(tokenizer)
}

/// SentencePiece BPE: merges are recovered from the scores (a pair merges
/// with the priority of the piece it forms), text gets `▁` for spaces, and
/// unknown bytes fall back to `<0xXX>` tokens.
fn build_sentencepiece(spec: &TokenizerSpec) -> Result<tokenizers::Tokenizer> {
    let vocab = vocabulary(spec);
    let mut merges: Vec<(f32, u32, String, String)> = Vec::new();
    for (id, piece) in spec.tokens.iter().enumerate() {
        let token_type = spec.token_type(id as u32);
        if token_type == TOKEN_TYPE_CONTROL || token_type == TOKEN_TYPE_BYTE {
            continue;
        }
        let score = spec.scores.get(id).copied().unwrap_or(0.0);
        for (split, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(split);
            if vocab.contains_key(left) && vocab.contains_key(right) {
                merges.push((score, id as u32, left.to_owned(), right.to_owned()));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let merges = merges.into_iter().map(|(_, _, left, right)| (left, right)).collect();
    let mut builder = BPE::builder().vocab_and_merges(vocab, merges).byte_fallback(true).fuse_unk(true);
    if let Some(unknown) = spec.unknown_token_id {
        builder = builder.unk_token(spec.tokens[unknown as usize].clone());
    }
    let bpe = builder.build().map_err(tokenizer_error)?;
    let mut tokenizer = tokenizers::Tokenizer::new(bpe);
    let replace = Replace::new(" ", "▁").map_err(tokenizer_error)?;
    let normalizer = if spec.add_space_prefix {
        NormalizerSequence::new(vec![Prepend::new("▁".into()).into(), replace.into()])
    } else {
        NormalizerSequence::new(vec![replace.into()])
    };
    tokenizer.with_normalizer(Some(normalizer)).map_err(tokenizer_error)?;
    Ok(tokenizer)
}

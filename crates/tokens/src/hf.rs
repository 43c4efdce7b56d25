//! Model cards from Hugging Face model directories (`tokenizer.json`,
//! `tokenizer_config.json`, `config.json`, `generation_config.json`,
//! `chat_template.jinja`): what an external engine such as vLLM serves.
//!
//! The card carries a GGUF-shaped [`TokenizerSpec`], so only tokenizers it
//! reproduces exactly are read: byte-level BPE (GPT-2, SmolLM, Llama 3,
//! Qwen2 style) whose pre-tokenizer is one of the splits Turbine knows.
//! Anything else (SentencePiece-style BPE with byte fallback, WordPiece,
//! Unigram, `ignore_merges`, a normalizer, an unknown split) is refused
//! with an error naming what differs, never tokenized approximately: the
//! gateway's ids must be the engine's.

use std::collections::HashMap;
use std::fs;
use std::path::Path;

use serde_json::Value;

use crate::fast_bpe::GPT2_REGEX;
use crate::tokenizer::{END_OF_GENERATION_TEXTS, LLAMA3_REGEX, QWEN2_REGEX, TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED, TokenizerSpec};
use crate::{Error, Result};

/// Context length assumed when `config.json` does not state one.
const FALLBACK_CONTEXT_LENGTH: u32 = 2048;

/// Largest `tokenizer.json` read (the biggest vocabularies are ~20 MB).
const MAX_TOKENIZER_JSON: u64 = 256 << 20;

/// Largest other JSON or template file read.
const MAX_SMALL_FILE: u64 = 16 << 20;

/// Whether `path` is a model directory with a `tokenizer.json`.
pub fn is_model_dir(path: &Path) -> bool {
    path.is_dir() && path.join("tokenizer.json").is_file()
}

/// What a model directory says: tokenizer, chat template, context length.
#[derive(Debug)]
pub(crate) struct ModelDir {
    pub(crate) tokenizer: TokenizerSpec,
    pub(crate) chat_template: Option<String>,
    pub(crate) context_length: u32,
}

impl ModelDir {
    pub(crate) fn read(dir: &Path) -> Result<Self> {
        let tokenizer_json =
            read_json(&dir.join("tokenizer.json"), MAX_TOKENIZER_JSON)?.ok_or_else(|| Error::ModelDir(format!("{}: no tokenizer.json", dir.display())))?;
        let config = read_json(&dir.join("tokenizer_config.json"), MAX_SMALL_FILE)?.unwrap_or(Value::Null);
        let generation = read_json(&dir.join("generation_config.json"), MAX_SMALL_FILE)?.unwrap_or(Value::Null);
        let model_config = read_json(&dir.join("config.json"), MAX_SMALL_FILE)?.unwrap_or(Value::Null);
        let tokenizer = tokenizer_spec(&tokenizer_json, &config, &generation)?;
        let chat_template = match chat_template(&config) {
            Some(template) => Some(template),
            None => read_text(&dir.join("chat_template.jinja"), MAX_SMALL_FILE)?,
        };
        let context_length = ["max_position_embeddings", "n_positions", "max_seq_len", "seq_length"]
            .iter()
            .find_map(|key| model_config.get(key).and_then(Value::as_u64))
            .and_then(|v| u32::try_from(v).ok())
            .unwrap_or(FALLBACK_CONTEXT_LENGTH);
        Ok(Self { tokenizer, chat_template, context_length })
    }
}

fn read_text(path: &Path, limit: u64) -> Result<Option<String>> {
    let metadata = match fs::metadata(path) {
        Ok(metadata) => metadata,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(Error::Io { path: path.to_owned(), source }),
    };
    if metadata.len() > limit {
        return Err(Error::ModelDir(format!("{}: {} bytes, more than the {limit} read", path.display(), metadata.len())));
    }
    fs::read_to_string(path).map(Some).map_err(|source| Error::Io { path: path.to_owned(), source })
}

fn read_json(path: &Path, limit: u64) -> Result<Option<Value>> {
    let Some(text) = read_text(path, limit)? else { return Ok(None) };
    serde_json::from_str(&text).map(Some).map_err(|error| Error::ModelDir(format!("{}: {error}", path.display())))
}

fn unsupported(what: impl std::fmt::Display) -> Error {
    Error::UnsupportedTokenizer(format!("{what}; Turbine reads byte-level BPE tokenizer.json files it reproduces exactly (serve the model's GGUF instead)"))
}

/// A token named in `tokenizer_config.json`: a string or `{"content": ...}`.
fn named_token(config: &Value, key: &str) -> Option<String> {
    match config.get(key)? {
        Value::String(text) => Some(text.clone()),
        Value::Object(object) => object.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

/// `chat_template` from `tokenizer_config.json`: a string, or a list of
/// named templates (the one named "default").
fn chat_template(config: &Value) -> Option<String> {
    match config.get("chat_template")? {
        Value::String(template) => Some(template.clone()),
        Value::Array(templates) => templates
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_owned),
        _ => None,
    }
}

fn tokenizer_spec(json: &Value, config: &Value, generation: &Value) -> Result<TokenizerSpec> {
    let model = json.get("model").ok_or_else(|| unsupported("tokenizer.json has no model"))?;
    let kind = model.get("type").and_then(Value::as_str).unwrap_or("");
    if kind != "BPE" {
        return Err(unsupported(format!("the tokenizer model is {kind:?}, not BPE")));
    }
    if model.get("byte_fallback").and_then(Value::as_bool).unwrap_or(false) {
        return Err(unsupported("the BPE falls back to byte tokens (SentencePiece style)"));
    }
    if model.get("ignore_merges").and_then(Value::as_bool).unwrap_or(false) {
        return Err(unsupported("the BPE ignores merges for whole-word vocabulary entries (ignore_merges)"));
    }
    for key in ["continuing_subword_prefix", "end_of_word_suffix"] {
        if model.get(key).and_then(Value::as_str).is_some_and(|affix| !affix.is_empty()) {
            return Err(unsupported(format!("the BPE has a {key}")));
        }
    }
    if model.get("dropout").is_some_and(|dropout| !dropout.is_null()) {
        return Err(unsupported("the BPE has dropout"));
    }
    if let Some(normalizer) = json.get("normalizer").filter(|n| !n.is_null()) {
        return Err(unsupported(format!("the tokenizer normalizes text first ({})", short(normalizer))));
    }
    let pre = pre_tokenizer_name(json.get("pre_tokenizer").unwrap_or(&Value::Null))?;
    let decoder = json.get("decoder").unwrap_or(&Value::Null);
    if decoder.get("type").and_then(Value::as_str) != Some("ByteLevel") {
        return Err(unsupported(format!("the decoder is not byte-level ({})", short(decoder))));
    }

    // Tokens by id: the vocabulary, then the added tokens over it.
    let vocab = model.get("vocab").and_then(Value::as_object).ok_or_else(|| unsupported("the BPE has no vocab"))?;
    let mut by_id: HashMap<u32, String> = HashMap::with_capacity(vocab.len());
    for (text, id) in vocab {
        let id = id.as_u64().and_then(|id| u32::try_from(id).ok()).ok_or_else(|| Error::ModelDir(format!("token {text:?} has id {id}")))?;
        by_id.insert(id, text.clone());
    }
    let mut kinds: HashMap<u32, i32> = HashMap::new();
    for added in json.get("added_tokens").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default() {
        let id = added.get("id").and_then(Value::as_u64).and_then(|id| u32::try_from(id).ok());
        let content = added.get("content").and_then(Value::as_str);
        let (Some(id), Some(content)) = (id, content) else {
            return Err(Error::ModelDir(format!("malformed added token {}", short(added))));
        };
        for flag in ["lstrip", "rstrip", "single_word"] {
            if added.get(flag).and_then(Value::as_bool).unwrap_or(false) {
                return Err(unsupported(format!("added token {content:?} sets {flag}")));
            }
        }
        let special = added.get("special").and_then(Value::as_bool).unwrap_or(false);
        by_id.insert(id, content.to_owned());
        kinds.insert(id, if special { TOKEN_TYPE_CONTROL } else { TOKEN_TYPE_USER_DEFINED });
    }
    let count = by_id.keys().max().map_or(0, |&max| max as usize + 1);
    if count == 0 {
        return Err(unsupported("the vocabulary is empty"));
    }
    let mut tokens = Vec::with_capacity(count);
    for id in 0..count as u32 {
        tokens.push(by_id.remove(&id).ok_or_else(|| Error::ModelDir(format!("the vocabulary has no token {id} (ids must run 0..{count})")))?);
    }
    let token_types: Vec<i32> = (0..count as u32).map(|id| kinds.get(&id).copied().unwrap_or(1)).collect();

    let merges = model
        .get("merges")
        .and_then(Value::as_array)
        .ok_or_else(|| unsupported("the BPE has no merges"))?
        .iter()
        .map(|merge| match merge {
            Value::String(pair) if pair.split(' ').count() == 2 => Ok(pair.clone()),
            Value::Array(pair) if pair.len() == 2 => match (pair[0].as_str(), pair[1].as_str()) {
                (Some(left), Some(right)) if !left.contains(' ') && !right.contains(' ') => Ok(format!("{left} {right}")),
                _ => Err(Error::ModelDir(format!("malformed merge {merge}"))),
            },
            _ => Err(Error::ModelDir(format!("malformed merge {merge}"))),
        })
        .collect::<Result<Vec<_>>>()?;

    let index: HashMap<&str, u32> = tokens.iter().enumerate().map(|(id, text)| (text.as_str(), id as u32)).collect();
    let lookup = |key: &str| named_token(config, key).and_then(|text| index.get(text.as_str()).copied());
    let prepended = prepended_token(json.get("post_processor").unwrap_or(&Value::Null), &index);
    let bos_token_id = lookup("bos_token").or(prepended);
    let eos_token_id = lookup("eos_token");
    let add_bos_token = match config.get("add_bos_token").and_then(Value::as_bool) {
        Some(flag) => flag,
        None => prepended.is_some(),
    };
    if add_bos_token && bos_token_id.is_none() {
        return Err(Error::ModelDir("add_bos_token is set but no bos_token is named".into()));
    }

    let generation_eos: Vec<u32> = match generation.get("eos_token_id") {
        Some(Value::Array(ids)) => ids.iter().filter_map(Value::as_u64).filter_map(|id| u32::try_from(id).ok()).collect(),
        Some(id) => id.as_u64().and_then(|id| u32::try_from(id).ok()).into_iter().collect(),
        None => Vec::new(),
    };
    let mut eog_token_ids: Vec<u32> = eos_token_id.into_iter().chain(generation_eos).filter(|&id| (id as usize) < count).collect();
    for (id, text) in tokens.iter().enumerate() {
        if token_types[id] != 1 && END_OF_GENERATION_TEXTS.contains(&text.as_str()) {
            eog_token_ids.push(id as u32);
        }
    }
    eog_token_ids.sort_unstable();
    eog_token_ids.dedup();

    Ok(TokenizerSpec {
        model: "gpt2".to_owned(),
        pre: pre.to_owned(),
        padding_token_id: lookup("pad_token"),
        unknown_token_id: lookup("unk_token"),
        bos_token_id,
        eos_token_id,
        add_bos_token,
        add_space_prefix: false,
        eog_token_ids,
        tokens,
        token_types,
        merges,
        scores: Vec::new(),
    })
}

/// The special token a `TemplateProcessing` post-processor puts before a
/// single sequence (the BOS it adds), if any.
fn prepended_token(post: &Value, index: &HashMap<&str, u32>) -> Option<u32> {
    match post.get("type").and_then(Value::as_str)? {
        "TemplateProcessing" => {
            let first = post.get("single")?.as_array()?.first()?;
            let name = first.get("SpecialToken")?.get("id")?.as_str()?;
            index.get(name).copied()
        }
        "Sequence" => post.get("processors")?.as_array()?.iter().find_map(|step| prepended_token(step, index)),
        _ => None,
    }
}

/// The GGUF pre-tokenizer name whose split equals this `pre_tokenizer`.
fn pre_tokenizer_name(pre: &Value) -> Result<&'static str> {
    let steps: Vec<&Value> = match pre.get("type").and_then(Value::as_str) {
        Some("Sequence") => pre.get("pretokenizers").and_then(Value::as_array).map(|steps| steps.iter().collect()).unwrap_or_default(),
        Some(_) => vec![pre],
        None => Vec::new(),
    };
    let kind = |step: &Value| step.get("type").and_then(Value::as_str).unwrap_or("").to_owned();
    let byte_level = |step: &Value, regex: bool| {
        kind(step) == "ByteLevel"
            && !step.get("add_prefix_space").and_then(Value::as_bool).unwrap_or(true)
            && step.get("use_regex").and_then(Value::as_bool).unwrap_or(true) == regex
    };
    let split = |step: &Value| -> Option<&'static str> {
        if kind(step) != "Split"
            || step.get("behavior").and_then(Value::as_str) != Some("Isolated")
            || step.get("invert").and_then(Value::as_bool).unwrap_or(false)
        {
            return None;
        }
        let regex = step.get("pattern")?.get("Regex")?.as_str()?;
        [(LLAMA3_REGEX, "llama3"), (QWEN2_REGEX, "qwen2"), (GPT2_REGEX, "gpt2")].into_iter().find(|(known, _)| *known == regex).map(|(_, name)| name)
    };
    let digits = |step: &Value| kind(step) == "Digits" && step.get("individual_digits").and_then(Value::as_bool).unwrap_or(false);
    let name = match steps.as_slice() {
        [only] if byte_level(only, true) => Some("gpt2"),
        [first, second] if digits(first) && byte_level(second, true) => Some("smollm"),
        [first, second] if byte_level(second, false) => split(first),
        [first, second, third] if digits(first) && byte_level(third, false) && split(second) == Some("gpt2") => Some("smollm"),
        _ => None,
    };
    name.ok_or_else(|| unsupported(format!("the pre-tokenizer is not a split Turbine knows ({})", short(pre))))
}

/// A JSON value for an error message, cut short.
fn short(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(200) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text,
    }
}

#[cfg(test)]
mod tests;

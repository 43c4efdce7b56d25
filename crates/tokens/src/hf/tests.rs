use std::path::Path;

use serde_json::{Value, json};

use crate::{ChatMessage, Error, ModelCard, Preprocessor, Tokenizer};

/// A small byte-level BPE in `tokenizer.json` form: bytes as GPT-2 maps
/// them (`Ġ` is the space), a few merges, three special tokens.
fn tokenizer_json() -> Value {
    let mut vocab = serde_json::Map::new();
    let pieces =
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "a", "b", "c", "Ġ", "h", "i", "1", "2", "ab", "Ġa", "Ġab", "hi", "Ġhi", "x", "Ċ", "u", "s", "e", "r"];
    for (id, piece) in pieces.iter().enumerate() {
        vocab.insert((*piece).to_owned(), json!(id));
    }
    json!({
        "version": "1.0",
        "added_tokens": [
            {"id": 0, "content": "<|endoftext|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 1, "content": "<|im_start|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
            {"id": 2, "content": "<|im_end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
        ],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "", "end_of_word_suffix": "",
            "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab,
            "merges": [["a", "b"], ["Ġ", "ab"], ["Ġ", "a"], ["h", "i"], ["Ġ", "hi"]],
        },
    })
}

fn tokenizer_config() -> Value {
    json!({
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>", "special": true},
        "unk_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
    })
}

fn write_dir(tokenizer: &Value, config: Option<&Value>, extra: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
    if let Some(config) = config {
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    }
    for (name, text) in extra {
        std::fs::write(dir.path().join(name), text).unwrap();
    }
    dir
}

fn read(dir: &Path) -> crate::Result<ModelCard> {
    ModelCard::from_model_dir("tiny", dir, 16)
}

#[test]
fn a_byte_level_tokenizer_json_becomes_a_card_whose_ids_are_the_merges() {
    let dir = write_dir(&tokenizer_json(), Some(&tokenizer_config()), &[("config.json", r#"{"max_position_embeddings": 8192}"#)]);
    let card = read(dir.path()).unwrap();
    assert_eq!(card.context_length, 8192);
    assert_eq!(card.tokenizer.model, "gpt2");
    assert_eq!(card.tokenizer.pre, "gpt2");
    assert_eq!(card.tokenizer.bos_token_id, Some(1));
    assert_eq!(card.tokenizer.eos_token_id, Some(2));
    assert_eq!(card.tokenizer.unknown_token_id, Some(0));
    // No post-processor prepends a BOS and the config does not ask for one.
    assert!(!card.tokenizer.add_bos_token);
    // EOS, and the end-of-text control token by its text.
    assert_eq!(card.tokenizer.eog_token_ids, vec![0, 2]);
    assert_eq!(card.tokenizer.token_type(1), crate::tokenizer::TOKEN_TYPE_CONTROL);
    assert_eq!(card.tokenizer.token_type(3), 1);

    let tokenizer = Tokenizer::from_spec(card.tokenizer.clone()).unwrap();
    // "ab ab hi": ab | Ġab | Ġhi.
    assert_eq!(tokenizer.encode("ab ab hi").unwrap(), vec![11, 13, 15]);
    assert_eq!(tokenizer.encode("<|im_start|>abc<|im_end|>").unwrap(), vec![1, 11, 5, 2]);
    assert_eq!(tokenizer.decode(&[11, 13, 15]), "ab ab hi");

    let preprocessor = Preprocessor::new(card).unwrap();
    let chat = preprocessor.encode_chat(&[ChatMessage::new("user", "hi")]).unwrap();
    assert_eq!(chat, vec![1, 18, 19, 20, 21, 17, 14, 2, 17]);
}

#[test]
fn a_template_file_bos_from_the_post_processor_and_generation_eos_ids_are_read() {
    let mut tokenizer = tokenizer_json();
    tokenizer["post_processor"] = json!({"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [], "special_tokens": {}},
    ]});
    let config = json!({"eos_token": "<|im_end|>"});
    let dir = write_dir(
        &tokenizer,
        Some(&config),
        &[("chat_template.jinja", "{{ messages[0].content }}"), ("generation_config.json", r#"{"eos_token_id": [2, 0]}"#)],
    );
    let card = read(dir.path()).unwrap();
    assert_eq!(card.chat_template.as_deref(), Some("{{ messages[0].content }}"));
    assert_eq!(card.tokenizer.bos_token_id, Some(1));
    assert!(card.tokenizer.add_bos_token);
    assert_eq!(card.tokenizer.eog_token_ids, vec![0, 2]);
    assert_eq!(card.context_length, 2048, "no config.json: the fallback");
    let tokenizer = Tokenizer::from_spec(card.tokenizer).unwrap();
    assert_eq!(tokenizer.encode("ab").unwrap(), vec![1, 11]);

    // The config's own flag wins over the post-processor; a named template list.
    let config = json!({"add_bos_token": false, "chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "y"}]});
    let dir = write_dir(&tokenizer_json(), Some(&config), &[]);
    let card = read(dir.path()).unwrap();
    assert!(!card.tokenizer.add_bos_token);
    assert_eq!(card.chat_template.as_deref(), Some("y"));
}

#[test]
fn known_splits_map_to_their_pre_tokenizers() {
    let byte_level = |regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": regex});
    let split = |regex: &str| json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false});
    let digits = json!({"type": "Digits", "individual_digits": true});
    let cases = [
        (json!({"type": "Sequence", "pretokenizers": [digits.clone(), byte_level(true)]}), "smollm"),
        (json!({"type": "Sequence", "pretokenizers": [split(crate::tokenizer::LLAMA3_REGEX), byte_level(false)]}), "llama3"),
        (json!({"type": "Sequence", "pretokenizers": [split(crate::tokenizer::QWEN2_REGEX), byte_level(false)]}), "qwen2"),
        (json!({"type": "Sequence", "pretokenizers": [digits, split(crate::fast_bpe::GPT2_REGEX), byte_level(false)]}), "smollm"),
    ];
    for (pre, name) in cases {
        let mut tokenizer = tokenizer_json();
        tokenizer["pre_tokenizer"] = pre;
        let dir = write_dir(&tokenizer, None, &[]);
        assert_eq!(read(dir.path()).unwrap().tokenizer.pre, name);
    }
    // The digits' tokens.
    let mut tokenizer = tokenizer_json();
    tokenizer["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level(true)]});
    let dir = write_dir(&tokenizer, None, &[]);
    let tokenizer = Tokenizer::from_spec(read(dir.path()).unwrap().tokenizer).unwrap();
    assert_eq!(tokenizer.encode("12").unwrap(), vec![9, 10]);
}

/// An edit of a `tokenizer.json`.
type Change = Box<dyn Fn(&mut Value)>;

#[test]
fn what_the_card_cannot_reproduce_is_refused_by_name() {
    let cases: Vec<(&str, Change)> = vec![
        ("byte tokens", Box::new(|t| t["model"]["byte_fallback"] = json!(true))),
        ("ignore_merges", Box::new(|t| t["model"]["ignore_merges"] = json!(true))),
        ("not BPE", Box::new(|t| t["model"]["type"] = json!("WordPiece"))),
        ("normalizes", Box::new(|t| t["normalizer"] = json!({"type": "NFC"}))),
        ("continuing_subword_prefix", Box::new(|t| t["model"]["continuing_subword_prefix"] = json!("##"))),
        ("not a split Turbine knows", Box::new(|t| t["pre_tokenizer"] = json!({"type": "Whitespace"}))),
        ("not a split Turbine knows", Box::new(|t| t["pre_tokenizer"]["add_prefix_space"] = json!(true))),
        (
            "not a split Turbine knows",
            Box::new(|t| {
                t["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Isolated", "invert": false},
                    {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]})
            }),
        ),
        ("not byte-level", Box::new(|t| t["decoder"] = json!({"type": "Metaspace"}))),
        ("sets lstrip", Box::new(|t| t["added_tokens"][1]["lstrip"] = json!(true))),
    ];
    for (expected, change) in cases {
        let mut tokenizer = tokenizer_json();
        change(&mut tokenizer);
        let dir = write_dir(&tokenizer, None, &[]);
        match read(dir.path()) {
            Err(Error::UnsupportedTokenizer(message)) => {
                assert!(message.contains(expected), "{expected:?} not in {message:?}");
                assert!(message.contains("GGUF"), "the error says what to do instead: {message}");
            }
            other => panic!("{expected}: {other:?}"),
        }
    }
}

#[test]
fn malformed_directories_are_errors_not_cards() {
    // A hole in the ids.
    let mut tokenizer = tokenizer_json();
    tokenizer["model"]["vocab"].as_object_mut().unwrap().remove("c");
    let dir = write_dir(&tokenizer, None, &[]);
    assert!(matches!(read(dir.path()), Err(Error::ModelDir(message)) if message.contains("no token 5")));
    // Broken JSON names its file.
    let dir = write_dir(&tokenizer_json(), None, &[("tokenizer_config.json", "{not json")]);
    assert!(matches!(read(dir.path()), Err(Error::ModelDir(message)) if message.contains("tokenizer_config.json")));
    // A merge that is not a pair.
    let mut tokenizer = tokenizer_json();
    tokenizer["model"]["merges"] = json!(["a b c"]);
    let dir = write_dir(&tokenizer, None, &[]);
    assert!(matches!(read(dir.path()), Err(Error::ModelDir(message)) if message.contains("malformed merge")));
    // A BOS asked for but not named.
    let mut tokenizer = tokenizer_json();
    tokenizer["added_tokens"][1]["content"] = json!("<|other|>");
    tokenizer["model"]["vocab"].as_object_mut().unwrap().remove("<|im_start|>");
    tokenizer["model"]["vocab"]["<|other|>"] = json!(1);
    let dir = write_dir(&tokenizer, Some(&json!({"add_bos_token": true})), &[]);
    assert!(matches!(read(dir.path()), Err(Error::ModelDir(message)) if message.contains("bos_token")));
    // Not a model directory at all.
    let empty = tempfile::tempdir().unwrap();
    assert!(!crate::hf::is_model_dir(empty.path()));
    assert!(matches!(read(empty.path()), Err(Error::ModelDir(message)) if message.contains("no tokenizer.json")));
}

#[test]
fn resolve_model_takes_a_model_directory_under_its_name() {
    let dir = write_dir(&tokenizer_json(), None, &[]);
    let cache = tempfile::tempdir().unwrap();
    let spec = dir.path().to_str().unwrap();
    let resolved = crate::pull::resolve_model(spec, None, cache.path(), crate::pull::Progress::Quiet).unwrap();
    assert_eq!(resolved.path, dir.path());
    assert_eq!(resolved.name, dir.path().file_name().unwrap().to_str().unwrap());
    let card = ModelCard::from_path(&resolved.name, &resolved.path, 16).unwrap();
    assert_eq!(card.tokenizer.tokens.len(), 22);
    let empty = tempfile::tempdir().unwrap();
    let error = crate::pull::resolve_model(empty.path().to_str().unwrap(), None, cache.path(), crate::pull::Progress::Quiet).unwrap_err();
    assert!(error.to_string().contains("tokenizer.json"), "{error}");
}

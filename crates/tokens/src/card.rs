//! The model card: what a client needs to talk to a served model, and the
//! compiled preprocessor built from it.

use std::path::Path;

use sha2::{Digest, Sha256};

use crate::Result;
use crate::chat::{CHATML_TEMPLATE, ChatMessage, ChatTemplate};
use crate::gguf::Gguf;
use crate::hf::ModelDir;
use crate::tokenizer::{Tokenizer, TokenizerSpec};

/// Context length assumed when a GGUF file does not state one.
const FALLBACK_CONTEXT_LENGTH: u32 = 2048;

/// Everything a client needs to tokenize and template prompts for a model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCard {
    /// Name clients use in requests.
    pub name: String,
    /// Maximum prompt plus generated tokens per sequence.
    pub context_length: u32,
    /// Tokens per KV block in the serving engine's cache.
    pub kv_block_size: u32,
    /// The tokenizer definition.
    pub tokenizer: TokenizerSpec,
    /// The Jinja chat template, if the model ships one.
    pub chat_template: Option<String>,
    /// The serving engine streams text, not token ids: its worker
    /// re-tokenizes the text with this tokenizer, so the text is the
    /// engine's but the ids (and their count) may differ from those it
    /// generated.
    pub retokenized: bool,
}

impl ModelCard {
    /// Builds the card of a GGUF model served under `name`.
    pub fn from_gguf(name: &str, gguf: &Gguf, kv_block_size: u32) -> Result<Self> {
        let context_length = gguf.arch_u64("context_length").and_then(|v| u32::try_from(v).ok()).unwrap_or(FALLBACK_CONTEXT_LENGTH);
        Ok(Self {
            name: name.to_owned(),
            context_length,
            kv_block_size,
            tokenizer: TokenizerSpec::from_gguf(gguf)?,
            chat_template: gguf.get_str("tokenizer.chat_template").map(str::to_owned),
            retokenized: false,
        })
    }

    /// Reads a GGUF file and builds its card.
    pub fn from_gguf_path(name: &str, path: &Path, kv_block_size: u32) -> Result<Self> {
        Self::from_gguf(name, &Gguf::open(path)?, kv_block_size)
    }

    /// Builds the card of a Hugging Face model directory (`tokenizer.json`
    /// and its neighbours, [`crate::hf`]) served under `name`.
    pub fn from_model_dir(name: &str, dir: &Path, kv_block_size: u32) -> Result<Self> {
        let model = ModelDir::read(dir)?;
        Ok(Self {
            name: name.to_owned(),
            context_length: model.context_length,
            kv_block_size,
            tokenizer: model.tokenizer,
            chat_template: model.chat_template,
            retokenized: false,
        })
    }

    /// The card of whatever `path` holds: a model directory
    /// ([`from_model_dir`](Self::from_model_dir)) or a GGUF file.
    pub fn from_path(name: &str, path: &Path, kv_block_size: u32) -> Result<Self> {
        if crate::hf::is_model_dir(path) { Self::from_model_dir(name, path, kv_block_size) } else { Self::from_gguf_path(name, path, kv_block_size) }
    }

    /// Hex SHA-256 over the card's contents: equal digests mean equal cards.
    pub fn digest(&self) -> String {
        let mut hasher = Sha256::new();
        let mut field = |bytes: &[u8]| {
            hasher.update((bytes.len() as u64).to_le_bytes());
            hasher.update(bytes);
        };
        let spec = &self.tokenizer;
        field(self.name.as_bytes());
        field(&self.context_length.to_le_bytes());
        field(&self.kv_block_size.to_le_bytes());
        field(self.chat_template.as_deref().unwrap_or("\u{0}none").as_bytes());
        field(spec.model.as_bytes());
        field(spec.pre.as_bytes());
        for token in &spec.tokens {
            field(token.as_bytes());
        }
        for merge in &spec.merges {
            field(merge.as_bytes());
        }
        let numbers: Vec<u8> = spec
            .token_types
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .chain(spec.scores.iter().flat_map(|s| s.to_le_bytes()))
            .chain(spec.eog_token_ids.iter().flat_map(|t| t.to_le_bytes()))
            .collect();
        field(&numbers);
        let optional = |id: Option<u32>| id.map_or(u64::MAX, u64::from).to_le_bytes();
        for id in [spec.bos_token_id, spec.eos_token_id, spec.padding_token_id, spec.unknown_token_id] {
            field(&optional(id));
        }
        field(&[spec.add_bos_token as u8, spec.add_space_prefix as u8]);
        // Only when set: the digests of cards from before the field stay.
        if self.retokenized {
            field(b"retokenized");
        }
        hex::encode(hasher.finalize())
    }
}

/// What control-token texts (`<|im_start|>`) in a chat message become.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ContentControlTokens {
    /// Ordinary text: only the chat template writes control tokens, so a
    /// user cannot end their turn or open a system one.
    #[default]
    Text,
    /// Control tokens, as llama.cpp and vLLM do (they tokenize the rendered
    /// prompt whole): for deployments whose clients write them on purpose.
    Parse,
}

/// A tokenized conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTokens {
    /// The prompt's tokens.
    pub ids: Vec<u32>,
    /// Control-token texts found in the messages' roles and content (kept
    /// as text or parsed, as asked).
    pub control_texts: usize,
}

/// A model card compiled for use: tokenizer and chat template ready.
#[derive(Debug)]
pub struct Preprocessor {
    card: ModelCard,
    digest: String,
    tokenizer: Tokenizer,
    template: ChatTemplate,
}

impl Preprocessor {
    /// Compiles the card's tokenizer and chat template (ChatML when the model
    /// has none).
    pub fn new(card: ModelCard) -> Result<Self> {
        let tokenizer = Tokenizer::from_spec(card.tokenizer.clone())?;
        let token_text = |id: Option<u32>| id.and_then(|id| tokenizer.token_text(id)).unwrap_or_default().to_owned();
        let source = card.chat_template.as_deref().unwrap_or(CHATML_TEMPLATE);
        let template = ChatTemplate::new(source, &token_text(card.tokenizer.bos_token_id), &token_text(card.tokenizer.eos_token_id))?;
        let digest = card.digest();
        Ok(Self { card, digest, tokenizer, template })
    }

    /// The card this preprocessor was compiled from.
    pub fn card(&self) -> &ModelCard {
        &self.card
    }

    /// The card's digest (computed once).
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Renders a conversation with the chat template and tokenizes it,
    /// control-token texts in the messages kept as text.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        Ok(self.encode_chat_with(messages, ContentControlTokens::Text)?.ids)
    }

    /// Renders a conversation with the chat template and tokenizes it, the
    /// control-token texts in its messages (roles and content) treated as
    /// `content` says.
    pub fn encode_chat_with(&self, messages: &[ChatMessage], content: ContentControlTokens) -> Result<ChatTokens> {
        let controls = self.tokenizer.control_texts();
        match content {
            ContentControlTokens::Parse => {
                let control_texts = messages.iter().map(|message| controls.count(&message.role) + controls.count(&message.content)).sum();
                let ids = self.tokenizer.encode(&self.template.render(messages, true)?)?;
                Ok(ChatTokens { ids, control_texts })
            }
            ContentControlTokens::Text => {
                let mut control_texts = 0;
                let marked: Vec<ChatMessage> = messages
                    .iter()
                    .map(|message| {
                        let (role, in_role) = controls.mark(&message.role);
                        let (text, in_content) = controls.mark(&message.content);
                        control_texts += in_role + in_content;
                        ChatMessage::new(role, text)
                    })
                    .collect();
                let ids = self.tokenizer.encode_marked(&self.template.render(&marked, true)?)?;
                Ok(ChatTokens { ids, control_texts })
            }
        }
    }

    /// Renders a conversation with the chat template (generation prompt added).
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        self.template.render(messages, true)
    }

    /// Tokenizes raw prompt text.
    pub fn encode_text(&self, text: &str) -> Result<Vec<u32>> {
        self.tokenizer.encode(text)
    }

    /// Whether `token_id` is a valid id of this vocabulary.
    pub fn is_valid_token(&self, token_id: u32) -> bool {
        (token_id as usize) < self.tokenizer.vocab_size()
    }
}

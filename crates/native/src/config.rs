//! The architecture of a Llama-family model, read from GGUF metadata.

use turbine_tokens::Gguf;

use crate::{Error, Result};

/// Architectures that share the Llama layer structure (pre-norm RMSNorm,
/// rotary attention with grouped KV heads, SwiGLU feed-forward, no biases).
const LLAMA_FAMILY: &[&str] = &["llama", "mistral"];

/// Hyper-parameters of the model.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// GGUF architecture name.
    pub architecture: String,
    /// Transformer blocks.
    pub layers: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Feed-forward inner size.
    pub ffn: usize,
    /// Attention heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention).
    pub kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// Dimensions rotated by RoPE (usually `head_dim`).
    pub rope_dims: usize,
    /// Linear RoPE scaling factor (positions are divided by it).
    pub rope_linear_scale: f32,
    /// Training context length.
    pub context_length: usize,
}

impl LlamaConfig {
    /// Reads and checks the hyper-parameters; other architectures are
    /// refused with an error naming them.
    pub fn from_gguf(gguf: &Gguf) -> Result<Self> {
        let architecture = gguf.architecture().ok_or_else(|| Error::Model("the file has no general.architecture".into()))?.to_owned();
        if !LLAMA_FAMILY.contains(&architecture.as_str()) {
            return Err(Error::Unsupported(format!(
                "architecture {architecture:?} is not supported by the native engine (supported: {})",
                LLAMA_FAMILY.join(", ")
            )));
        }
        let required = |suffix: &str| -> Result<usize> {
            gguf.arch_u64(suffix).map(|v| v as usize).ok_or_else(|| Error::Model(format!("missing {architecture}.{suffix}")))
        };
        let float = |suffix: &str, default: f32| gguf.get(&format!("{architecture}.{suffix}")).and_then(|v| v.as_f64()).map(|v| v as f32).unwrap_or(default);
        let hidden = required("embedding_length")?;
        let heads = required("attention.head_count")?;
        let kv_heads = gguf.arch_u64("attention.head_count_kv").map(|v| v as usize).unwrap_or(heads);
        if heads == 0 || kv_heads == 0 || !hidden.is_multiple_of(heads) || !heads.is_multiple_of(kv_heads) {
            return Err(Error::Model(format!("inconsistent heads: hidden {hidden}, heads {heads}, kv heads {kv_heads}")));
        }
        let head_dim = gguf.arch_u64("attention.key_length").map(|v| v as usize).unwrap_or(hidden / heads);
        let vocab = gguf
            .arch_u64("vocab_size")
            .map(|v| v as usize)
            .or_else(|| gguf.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).map(<[_]>::len))
            .ok_or_else(|| Error::Model("cannot tell the vocabulary size".into()))?;
        let rope_linear_scale = match gguf.get_str(&format!("{architecture}.rope.scaling.type")) {
            None | Some("none") => 1.0,
            Some("linear") => float("rope.scaling.factor", 1.0),
            Some(other) => return Err(Error::Unsupported(format!("RoPE scaling {other:?} is not supported (none, linear)"))),
        };
        Ok(Self {
            layers: required("block_count")?,
            ffn: required("feed_forward_length")?,
            rms_eps: float("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta: float("rope.freq_base", 10_000.0),
            rope_dims: gguf.arch_u64("rope.dimension_count").map(|v| v as usize).unwrap_or(head_dim),
            context_length: gguf.arch_u64("context_length").map(|v| v as usize).unwrap_or(2048),
            hidden,
            heads,
            kv_heads,
            head_dim,
            vocab,
            rope_linear_scale,
            architecture,
        })
    }

    /// Bytes of KV cache per token (K and V, every layer, f16).
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.layers * self.kv_heads * self.head_dim * 2
    }
}

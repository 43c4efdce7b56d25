//! `turbine.worker.v1` ⇄ `turbine-tokens`: model cards (the request
//! vocabulary converts in `turbine-api`, beside its types).

use turbine_tokens::{ModelCard, TokenizerSpec};

use super::{ConversionError, ConversionResult};
use crate::worker::v1 as pb;

impl From<&ModelCard> for pb::ModelCard {
    fn from(card: &ModelCard) -> Self {
        let ModelCard { name, context_length, kv_block_size, tokenizer, chat_template } = card;
        let TokenizerSpec {
            model,
            pre,
            tokens,
            token_types,
            merges,
            scores,
            bos_token_id,
            eos_token_id,
            add_bos_token,
            add_space_prefix,
            padding_token_id,
            unknown_token_id,
            eog_token_ids,
        } = tokenizer.clone();
        pb::ModelCard {
            name: name.clone(),
            context_length: *context_length,
            kv_block_size: *kv_block_size,
            tokenizer: Some(pb::Tokenizer {
                model,
                pre,
                tokens,
                token_types,
                merges,
                scores,
                bos_token_id,
                eos_token_id,
                add_bos_token,
                add_space_prefix,
                padding_token_id,
                unknown_token_id,
                eog_token_ids,
            }),
            chat_template: chat_template.clone().unwrap_or_default(),
            digest: card.digest(),
        }
    }
}

impl TryFrom<pb::ModelCard> for ModelCard {
    type Error = ConversionError;

    /// The card, provided its digest (when sent) matches its contents.
    fn try_from(card: pb::ModelCard) -> ConversionResult<Self> {
        let pb::ModelCard { name, context_length, kv_block_size, tokenizer, chat_template, digest } = card;
        let pb::Tokenizer {
            model,
            pre,
            tokens,
            token_types,
            merges,
            scores,
            bos_token_id,
            eos_token_id,
            add_bos_token,
            add_space_prefix,
            padding_token_id,
            unknown_token_id,
            eog_token_ids,
        } = tokenizer.ok_or(ConversionError::Missing("card.tokenizer"))?;
        let card = ModelCard {
            name,
            context_length,
            kv_block_size,
            tokenizer: TokenizerSpec {
                model,
                pre,
                tokens,
                token_types,
                merges,
                scores,
                bos_token_id,
                eos_token_id,
                add_bos_token,
                add_space_prefix,
                padding_token_id,
                unknown_token_id,
                eog_token_ids,
            },
            chat_template: (!chat_template.is_empty()).then_some(chat_template),
        };
        if !digest.is_empty() && card.digest() != digest {
            return Err(ConversionError::invalid("card.digest", format!("does not match the contents of model card {}", card.name)));
        }
        Ok(card)
    }
}

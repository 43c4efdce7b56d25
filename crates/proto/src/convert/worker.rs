//! `turbine.worker.v1` ⇄ `turbine-tokens`: model cards (the request
//! vocabulary converts in `turbine-api`, beside its types).

use turbine_tokens::{ModelCard, TokenizerSpec};

use super::{ConversionError, ConversionResult};
use crate::worker::v1 as pb;

impl From<&ModelCard> for pb::ModelCard {
    fn from(card: &ModelCard) -> Self {
        let ModelCard { name, context_length, kv_block_size, tokenizer, chat_template, retokenized } = card;
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
            retokenized: *retokenized,
        }
    }
}

impl TryFrom<pb::ModelCard> for ModelCard {
    type Error = ConversionError;

    /// The card, provided its digest (when sent) matches its contents.
    fn try_from(card: pb::ModelCard) -> ConversionResult<Self> {
        let pb::ModelCard { name, context_length, kv_block_size, tokenizer, chat_template, digest, retokenized } = card;
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
            retokenized,
        };
        if !digest.is_empty() && card.digest() != digest {
            return Err(ConversionError::invalid("card.digest", format!("does not match the contents of model card {}", card.name)));
        }
        Ok(card)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn card(retokenized: bool) -> ModelCard {
        let tokenizer = TokenizerSpec { model: "gpt2".into(), tokens: vec!["a".into(), "b".into()], token_types: vec![1, 1], ..TokenizerSpec::default() };
        ModelCard { name: "m".into(), context_length: 2048, kv_block_size: 16, tokenizer, chat_template: None, retokenized }
    }

    #[test]
    fn a_card_comes_back_as_sent_and_its_digest_binds_what_it_says_of_its_ids() {
        for retokenized in [false, true] {
            assert_eq!(ModelCard::try_from(pb::ModelCard::from(&card(retokenized))).unwrap(), card(retokenized));
        }
        assert_ne!(card(true).digest(), card(false).digest());
        // A card whose flag was changed on the way no longer matches its
        // digest: a worker cannot be made to look exact by a relay.
        let mut sent = pb::ModelCard::from(&card(true));
        sent.retokenized = false;
        assert!(ModelCard::try_from(sent).is_err());
    }
}

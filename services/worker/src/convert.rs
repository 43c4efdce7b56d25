//! Conversions between `turbine.worker.v1` messages and domain types, with
//! validation at the edge.

use turbine_engine::{FinishReason, GenerateRequest, Load, SamplingParams, StopConditions, TokenLogprobs, Usage};
use turbine_proto::worker::v1 as pb;
use turbine_tokens::{ModelCard, TokenizerSpec};

/// Most alternatives a request may ask log-probabilities for.
pub const MAX_LOGPROBS: u32 = 20;

/// Validates a Generate request for a model with `vocab_size` tokens.
pub fn generate_request_from_proto(request: pb::GenerateRequest, vocab_size: usize) -> Result<GenerateRequest, String> {
    // A remote prefill is taken out (and checked) by the caller.
    let pb::GenerateRequest { request_id, prompt_token_ids, sampling, stop, remote_prefill: _ } = request;
    if prompt_token_ids.is_empty() {
        return Err("prompt_token_ids must not be empty".into());
    }
    if let Some(bad) = prompt_token_ids.iter().find(|&&id| id as usize >= vocab_size) {
        return Err(format!("prompt token id {bad} is outside the vocabulary of {vocab_size} tokens"));
    }
    let pb::StopConditions { max_tokens, stop_token_ids, ignore_eos } = stop.ok_or("stop.max_tokens is required")?;
    if max_tokens == 0 {
        return Err("stop.max_tokens must be at least 1".into());
    }
    let sampling = sampling.map(sampling_from_proto).transpose()?.unwrap_or_default();
    Ok(GenerateRequest {
        request_id,
        prompt: prompt_token_ids,
        sampling,
        stop: StopConditions { max_tokens, stop_token_ids, ignore_eos },
    })
}

fn sampling_from_proto(sampling: pb::SamplingParams) -> Result<SamplingParams, String> {
    let pb::SamplingParams { temperature, top_p, top_k, seed, presence_penalty, frequency_penalty, min_p, repetition_penalty, logprobs } = sampling;
    if let Some(t) = temperature
        && !(t.is_finite() && (0.0..=2.0).contains(&t))
    {
        return Err(format!("temperature must be between 0 and 2, got {t}"));
    }
    if let Some(p) = top_p
        && !(p.is_finite() && p > 0.0 && p <= 1.0)
    {
        return Err(format!("top_p must be in (0, 1], got {p}"));
    }
    for (name, value) in [("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)] {
        if let Some(v) = value
            && !(v.is_finite() && (-2.0..=2.0).contains(&v))
        {
            return Err(format!("{name} must be between -2 and 2, got {v}"));
        }
    }
    if let Some(p) = min_p
        && !(p.is_finite() && (0.0..=1.0).contains(&p))
    {
        return Err(format!("min_p must be between 0 and 1, got {p}"));
    }
    if let Some(p) = repetition_penalty
        && !(p.is_finite() && p > 0.0)
    {
        return Err(format!("repetition_penalty must be positive, got {p}"));
    }
    if let Some(n) = logprobs
        && n > MAX_LOGPROBS
    {
        return Err(format!("logprobs must be at most {MAX_LOGPROBS}, got {n}"));
    }
    Ok(SamplingParams { temperature, top_p, top_k, seed, presence_penalty, frequency_penalty, min_p, repetition_penalty, logprobs })
}

/// The domain request as a Generate message (client side).
pub fn generate_request_to_proto(request: &GenerateRequest) -> pb::GenerateRequest {
    let SamplingParams { temperature, top_p, top_k, seed, presence_penalty, frequency_penalty, min_p, repetition_penalty, logprobs } =
        request.sampling.clone();
    pb::GenerateRequest {
        request_id: request.request_id.clone(),
        prompt_token_ids: request.prompt.clone(),
        sampling: Some(pb::SamplingParams { temperature, top_p, top_k, seed, presence_penalty, frequency_penalty, min_p, repetition_penalty, logprobs }),
        stop: Some(pb::StopConditions {
            max_tokens: request.stop.max_tokens,
            stop_token_ids: request.stop.stop_token_ids.clone(),
            ignore_eos: request.stop.ignore_eos,
        }),
        remote_prefill: None,
    }
}

/// Token log-probabilities to the wire.
pub fn logprobs_to_proto(logprobs: TokenLogprobs) -> pb::TokenLogprobs {
    let TokenLogprobs { logprob, top } = logprobs;
    pb::TokenLogprobs { logprob, top: top.into_iter().map(|(token_id, logprob)| pb::TopLogprob { token_id, logprob }).collect() }
}

/// Token log-probabilities from the wire.
pub fn logprobs_from_proto(logprobs: pb::TokenLogprobs) -> TokenLogprobs {
    let pb::TokenLogprobs { logprob, top } = logprobs;
    TokenLogprobs { logprob, top: top.into_iter().map(|t| (t.token_id, t.logprob)).collect() }
}

/// Finish reason to the wire.
pub fn finish_reason_to_proto(reason: FinishReason) -> pb::FinishReason {
    match reason {
        FinishReason::Stop => pb::FinishReason::Stop,
        FinishReason::Length => pb::FinishReason::Length,
    }
}

/// Finish reason from the wire (`None` while not finished).
pub fn finish_reason_from_proto(reason: pb::FinishReason) -> Option<FinishReason> {
    match reason {
        pb::FinishReason::Unspecified => None,
        pb::FinishReason::Stop => Some(FinishReason::Stop),
        pb::FinishReason::Length => Some(FinishReason::Length),
    }
}

/// Usage to the wire.
pub fn usage_to_proto(usage: Usage) -> pb::Usage {
    let Usage { prompt_tokens, completion_tokens, cached_prompt_tokens } = usage;
    pb::Usage { prompt_tokens, completion_tokens, cached_prompt_tokens }
}

/// Usage from the wire.
pub fn usage_from_proto(usage: pb::Usage) -> Usage {
    let pb::Usage { prompt_tokens, completion_tokens, cached_prompt_tokens } = usage;
    Usage { prompt_tokens, completion_tokens, cached_prompt_tokens }
}

/// Load to the wire.
pub fn load_to_proto(load: Load) -> pb::WorkerLoad {
    let Load { running, waiting, blocks_used, blocks_total } = load;
    pb::WorkerLoad { running, waiting, blocks_used, blocks_total }
}

/// Load from the wire.
pub fn load_from_proto(load: pb::WorkerLoad) -> Load {
    let pb::WorkerLoad { running, waiting, blocks_used, blocks_total } = load;
    Load { running, waiting, blocks_used, blocks_total }
}

/// Model card to the wire.
pub fn card_to_proto(card: &ModelCard) -> pb::ModelCard {
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

/// Model card from the wire; the digest must match the contents.
pub fn card_from_proto(card: pb::ModelCard) -> Result<ModelCard, String> {
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
    } = tokenizer.ok_or("model card without tokenizer")?;
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
        return Err(format!("model card {} failed its digest check", card.name));
    }
    Ok(card)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request() -> pb::GenerateRequest {
        pb::GenerateRequest {
            request_id: "r".into(),
            prompt_token_ids: vec![1, 2, 3],
            sampling: Some(pb::SamplingParams { temperature: Some(0.5), ..Default::default() }),
            stop: Some(pb::StopConditions { max_tokens: 4, stop_token_ids: vec![9], ignore_eos: true }),
            remote_prefill: None,
        }
    }

    #[test]
    fn a_valid_request_round_trips() {
        let domain = generate_request_from_proto(request(), 10).unwrap();
        assert_eq!(generate_request_to_proto(&domain), pb::GenerateRequest {
            sampling: Some(pb::SamplingParams { temperature: Some(0.5), ..Default::default() }),
            ..request()
        });
    }

    #[test]
    fn invalid_requests_name_the_problem() {
        let cases: Vec<(pb::GenerateRequest, &str)> = vec![
            (pb::GenerateRequest { prompt_token_ids: vec![], ..request() }, "empty"),
            (pb::GenerateRequest { prompt_token_ids: vec![10], ..request() }, "vocabulary"),
            (pb::GenerateRequest { stop: None, ..request() }, "max_tokens"),
            (pb::GenerateRequest { stop: Some(pb::StopConditions { max_tokens: 0, ..Default::default() }), ..request() }, "max_tokens"),
            (pb::GenerateRequest { sampling: Some(pb::SamplingParams { temperature: Some(-1.0), ..Default::default() }), ..request() }, "temperature"),
            (pb::GenerateRequest { sampling: Some(pb::SamplingParams { top_p: Some(0.0), ..Default::default() }), ..request() }, "top_p"),
            (pb::GenerateRequest { sampling: Some(pb::SamplingParams { presence_penalty: Some(f32::NAN), ..Default::default() }), ..request() }, "presence_penalty"),
            (pb::GenerateRequest { sampling: Some(pb::SamplingParams { min_p: Some(1.5), ..Default::default() }), ..request() }, "min_p"),
            (pb::GenerateRequest { sampling: Some(pb::SamplingParams { repetition_penalty: Some(0.0), ..Default::default() }), ..request() }, "repetition_penalty"),
            (pb::GenerateRequest { sampling: Some(pb::SamplingParams { logprobs: Some(21), ..Default::default() }), ..request() }, "logprobs"),
        ];
        for (request, needle) in cases {
            let error = generate_request_from_proto(request, 10).unwrap_err();
            assert!(error.contains(needle), "{error} should mention {needle}");
        }
    }
}

//! The request vocabulary to and from `turbine.worker.v1`, beside the types
//! (the KV layout and `UcxRegion`, which live in `turbine-kv`, convert in
//! `turbine-proto`):
//! `TryFrom<pb::X>` checks what the wire cannot (missing messages, unknown
//! enum values, ranges) and reports a [`ConversionError`]; `From<&X>` builds
//! the message. Every conversion destructures its input exhaustively, so a
//! field added to either side is a compile error here until it is handled.

use turbine_proto::worker::v1 as pb;
use turbine_proto::{ConversionError, ConversionResult};

use crate::{CacheSalt, FinishReason, GenerateRequest, KvTenant, Load, OutputFormat, SamplingParams, StopConditions, TokenLogprobs, Usage};

impl TryFrom<pb::SamplingParams> for SamplingParams {
    type Error = ConversionError;

    /// Checked against [`SamplingParams::validate`], the ranges the gateway
    /// applies too.
    fn try_from(sampling: pb::SamplingParams) -> ConversionResult<Self> {
        let pb::SamplingParams {
            temperature,
            top_p,
            top_k,
            seed,
            presence_penalty,
            frequency_penalty,
            min_p,
            repetition_penalty,
            logprobs,
            output_format,
            output_continued,
            output_schema,
        } = sampling;
        let format = pb::OutputFormat::try_from(output_format);
        if !output_schema.is_empty() && format != Ok(pb::OutputFormat::JsonSchema) {
            return Err(ConversionError::Invalid { field: "output_schema", message: "is only for OUTPUT_FORMAT_JSON_SCHEMA".into() });
        }
        let output = match format {
            Ok(pb::OutputFormat::Unspecified) if output_continued == 0 => OutputFormat::Text,
            Ok(pb::OutputFormat::Unspecified) => {
                return Err(ConversionError::Invalid { field: "output_continued", message: "is only for a JSON object's output".into() });
            }
            Ok(pb::OutputFormat::JsonObject) => OutputFormat::JsonObject { continued: output_continued },
            Ok(pb::OutputFormat::JsonSchema) if output_schema.is_empty() => {
                return Err(ConversionError::Invalid { field: "output_schema", message: "is required with OUTPUT_FORMAT_JSON_SCHEMA".into() });
            }
            Ok(pb::OutputFormat::JsonSchema) => OutputFormat::JsonSchema { schema: output_schema.into(), continued: output_continued },
            Err(_) => return Err(ConversionError::Invalid { field: "output_format", message: format!("{output_format} is no known format") }),
        };
        let sampling = SamplingParams { temperature, top_p, top_k, seed, presence_penalty, frequency_penalty, min_p, repetition_penalty, logprobs, output };
        sampling.validate().map_err(|error| ConversionError::Invalid { field: error.param, message: error.message })?;
        Ok(sampling)
    }
}

impl From<&SamplingParams> for pb::SamplingParams {
    fn from(sampling: &SamplingParams) -> Self {
        let SamplingParams { temperature, top_p, top_k, seed, presence_penalty, frequency_penalty, min_p, repetition_penalty, logprobs, ref output } =
            *sampling;
        let (output_format, output_continued, output_schema) = match output {
            OutputFormat::Text => (pb::OutputFormat::Unspecified, 0, String::new()),
            OutputFormat::JsonObject { continued } => (pb::OutputFormat::JsonObject, *continued, String::new()),
            OutputFormat::JsonSchema { schema, continued } => (pb::OutputFormat::JsonSchema, *continued, schema.to_string()),
        };
        pb::SamplingParams {
            temperature,
            top_p,
            top_k,
            seed,
            presence_penalty,
            frequency_penalty,
            min_p,
            repetition_penalty,
            logprobs,
            output_format: output_format as i32,
            output_continued,
            output_schema,
        }
    }
}

impl TryFrom<pb::StopConditions> for StopConditions {
    type Error = ConversionError;

    fn try_from(stop: pb::StopConditions) -> ConversionResult<Self> {
        let pb::StopConditions { max_tokens, stop_token_ids, ignore_eos } = stop;
        if max_tokens == 0 {
            return Err(ConversionError::invalid("stop.max_tokens", "must be at least 1"));
        }
        Ok(StopConditions { max_tokens, stop_token_ids, ignore_eos })
    }
}

impl From<&StopConditions> for pb::StopConditions {
    fn from(stop: &StopConditions) -> Self {
        let StopConditions { max_tokens, stop_token_ids, ignore_eos } = stop;
        pb::StopConditions { max_tokens: *max_tokens, stop_token_ids: stop_token_ids.clone(), ignore_eos: *ignore_eos }
    }
}

/// The parts of a `Generate` or `Prefill` call that make an engine request,
/// checked (the prompt's ids against a vocabulary are the worker's to check).
pub fn generate_request(
    request_id: String,
    prompt_token_ids: Vec<u32>,
    sampling: Option<pb::SamplingParams>,
    stop: Option<pb::StopConditions>,
    cache_salt: u64,
    kv_tenant: u64,
) -> ConversionResult<GenerateRequest> {
    if prompt_token_ids.is_empty() {
        return Err(ConversionError::invalid("prompt_token_ids", "must not be empty"));
    }
    let stop = StopConditions::try_from(stop.ok_or(ConversionError::Missing("stop.max_tokens"))?)?;
    let sampling = sampling.map(SamplingParams::try_from).transpose()?.unwrap_or_default();
    Ok(GenerateRequest { request_id, prompt: prompt_token_ids, sampling, stop, cache_salt: CacheSalt::new(cache_salt), kv_tenant: KvTenant::new(kv_tenant) })
}

impl From<&GenerateRequest> for pb::GenerateRequest {
    /// The call without a remote prefill (the caller adds one).
    fn from(request: &GenerateRequest) -> Self {
        let GenerateRequest { request_id, prompt, sampling, stop, cache_salt, kv_tenant } = request;
        pb::GenerateRequest {
            request_id: request_id.clone(),
            prompt_token_ids: prompt.clone(),
            sampling: Some(pb::SamplingParams::from(sampling)),
            stop: Some(pb::StopConditions::from(stop)),
            remote_prefill: None,
            cache_salt: cache_salt.get(),
            kv_tenant: kv_tenant.get(),
        }
    }
}

impl From<FinishReason> for pb::FinishReason {
    fn from(reason: FinishReason) -> Self {
        match reason {
            FinishReason::Stop => pb::FinishReason::Stop,
            FinishReason::Length => pb::FinishReason::Length,
        }
    }
}

/// A response's finish reason: `None` while the stream goes on.
pub fn finish_reason(value: i32) -> ConversionResult<Option<FinishReason>> {
    match pb::FinishReason::try_from(value) {
        Ok(pb::FinishReason::Unspecified) => Ok(None),
        Ok(pb::FinishReason::Stop) => Ok(Some(FinishReason::Stop)),
        Ok(pb::FinishReason::Length) => Ok(Some(FinishReason::Length)),
        Err(_) => Err(ConversionError::UnknownEnum { field: "finish_reason", value }),
    }
}

impl From<Usage> for pb::Usage {
    fn from(usage: Usage) -> Self {
        let Usage { prompt_tokens, completion_tokens, cached_prompt_tokens } = usage;
        pb::Usage { prompt_tokens, completion_tokens, cached_prompt_tokens }
    }
}

impl From<pb::Usage> for Usage {
    fn from(usage: pb::Usage) -> Self {
        let pb::Usage { prompt_tokens, completion_tokens, cached_prompt_tokens } = usage;
        Usage { prompt_tokens, completion_tokens, cached_prompt_tokens }
    }
}

impl From<TokenLogprobs> for pb::TokenLogprobs {
    fn from(logprobs: TokenLogprobs) -> Self {
        let TokenLogprobs { logprob, top } = logprobs;
        pb::TokenLogprobs { logprob, top: top.into_iter().map(|(token_id, logprob)| pb::TopLogprob { token_id, logprob }).collect() }
    }
}

impl From<pb::TokenLogprobs> for TokenLogprobs {
    fn from(logprobs: pb::TokenLogprobs) -> Self {
        let pb::TokenLogprobs { logprob, top } = logprobs;
        TokenLogprobs { logprob, top: top.into_iter().map(|pb::TopLogprob { token_id, logprob }| (token_id, logprob)).collect() }
    }
}

impl From<Load> for pb::WorkerLoad {
    fn from(load: Load) -> Self {
        let Load { running, waiting, blocks_used, blocks_total } = load;
        pb::WorkerLoad { running, waiting, blocks_used, blocks_total }
    }
}

impl From<pb::WorkerLoad> for Load {
    fn from(load: pb::WorkerLoad) -> Self {
        let pb::WorkerLoad { running, waiting, blocks_used, blocks_total } = load;
        Load { running, waiting, blocks_used, blocks_total }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stop() -> Option<pb::StopConditions> {
        Some(pb::StopConditions { max_tokens: 4, stop_token_ids: vec![9], ignore_eos: true })
    }

    #[test]
    fn a_valid_request_round_trips() {
        let sampling = pb::SamplingParams { temperature: Some(0.5), ..Default::default() };
        let request = generate_request("r".into(), vec![1, 2, 3], Some(sampling.clone()), stop(), 0, 7).unwrap();
        let wire = pb::GenerateRequest::from(&request);
        assert_eq!(
            wire,
            pb::GenerateRequest {
                request_id: "r".into(),
                prompt_token_ids: vec![1, 2, 3],
                sampling: Some(sampling),
                stop: stop(),
                remote_prefill: None,
                cache_salt: Default::default(),
                kv_tenant: 7,
            }
        );
    }

    #[test]
    fn invalid_requests_name_the_field() {
        let sampling = |sampling: pb::SamplingParams| generate_request("r".into(), vec![1], Some(sampling), stop(), 0, 0).unwrap_err().to_string();
        assert!(generate_request("r".into(), vec![], None, stop(), 0, 0).unwrap_err().to_string().contains("prompt_token_ids"));
        assert!(generate_request("r".into(), vec![1], None, None, 0, 0).unwrap_err().to_string().contains("max_tokens"));
        let zero = Some(pb::StopConditions { max_tokens: 0, ..Default::default() });
        assert!(generate_request("r".into(), vec![1], None, zero, 0, 0).unwrap_err().to_string().contains("max_tokens"));
        assert!(sampling(pb::SamplingParams { temperature: Some(-1.0), ..Default::default() }).starts_with("temperature"));
        assert!(sampling(pb::SamplingParams { top_p: Some(0.0), ..Default::default() }).starts_with("top_p"));
        assert!(sampling(pb::SamplingParams { presence_penalty: Some(f32::NAN), ..Default::default() }).starts_with("presence_penalty"));
        assert!(sampling(pb::SamplingParams { min_p: Some(1.5), ..Default::default() }).starts_with("min_p"));
        assert!(sampling(pb::SamplingParams { repetition_penalty: Some(0.0), ..Default::default() }).starts_with("repetition_penalty"));
        assert!(sampling(pb::SamplingParams { logprobs: Some(21), ..Default::default() }).starts_with("logprobs"));
        assert!(sampling(pb::SamplingParams { output_format: 9, ..Default::default() }).contains("output_format"));
        assert!(sampling(pb::SamplingParams { output_continued: 3, ..Default::default() }).contains("output_continued"));
    }

    #[test]
    fn json_output_and_its_continuation_cross_the_wire() {
        let schema = OutputFormat::json_schema(&serde_json::json!({"type": "object", "required": ["a"]})).unwrap();
        for output in [OutputFormat::Text, OutputFormat::JsonObject { continued: 0 }, OutputFormat::JsonObject { continued: 12 }, schema.continued_by(3)] {
            let params = SamplingParams { output, ..SamplingParams::default() };
            assert_eq!(SamplingParams::try_from(pb::SamplingParams::from(&params)).unwrap(), params);
        }
        // A schema only with its format, and the format only with a
        // schema: one JSON object, bounded.
        let json_schema = pb::OutputFormat::JsonSchema as i32;
        let refused = |params: pb::SamplingParams| SamplingParams::try_from(params).unwrap_err().to_string();
        assert!(refused(pb::SamplingParams { output_schema: "{}".into(), ..Default::default() }).contains("output_schema"));
        assert!(refused(pb::SamplingParams { output_format: json_schema, ..Default::default() }).contains("output_schema"));
        assert!(refused(pb::SamplingParams { output_format: json_schema, output_schema: "[1]".into(), ..Default::default() }).contains("JSON object"));
        assert!(refused(pb::SamplingParams { output_format: json_schema, output_schema: "{".into(), ..Default::default() }).contains("not JSON"));
        let long = format!(r#"{{"description":"{}"}}"#, "x".repeat(crate::MAX_SCHEMA_BYTES));
        assert!(refused(pb::SamplingParams { output_format: json_schema, output_schema: long, ..Default::default() }).contains("at most"));
    }

    #[test]
    fn finish_reasons_convert() {
        assert_eq!(finish_reason(pb::FinishReason::Unspecified as i32), Ok(None));
        assert_eq!(finish_reason(pb::FinishReason::from(FinishReason::Length) as i32), Ok(Some(FinishReason::Length)));
        assert!(finish_reason(7).is_err());
    }
}

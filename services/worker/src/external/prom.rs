//! The few lines of an engine's Prometheus text exposition the adapter
//! reads: a sample's name, labels and value.

use std::collections::HashMap;

/// One sample: `name{label="value",...} 1.5`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: HashMap<String, String>,
    pub value: f64,
}

/// Every sample in `text` (comments and lines that do not parse are
/// skipped: an engine's exposition is not Turbine's to validate).
pub fn samples(text: &str) -> impl Iterator<Item = Sample> + '_ {
    text.lines().filter(|line| !line.starts_with('#')).filter_map(sample)
}

/// The value of the first sample named `name`.
pub fn value(text: &str, name: &str) -> Option<f64> {
    samples(text).find(|sample| sample.name == name).map(|sample| sample.value)
}

/// The sum over every sample named `name` (an engine with several
/// data-parallel ranks reports one per rank).
pub fn sum(text: &str, name: &str) -> Option<f64> {
    samples(text).filter(|sample| sample.name == name).map(|sample| sample.value).reduce(|a, b| a + b)
}

fn sample(line: &str) -> Option<Sample> {
    let line = line.trim();
    let name_end = line.find(|c: char| c == '{' || c.is_whitespace())?;
    let name = line[..name_end].to_owned();
    let mut rest = &line[name_end..];
    let mut labels = HashMap::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, after) = parse_labels(after)?;
        labels = parsed;
        rest = after;
    }
    // The value, then an optional timestamp.
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        value => value.parse().ok()?,
    };
    Some(Sample { name, labels, value })
}

/// `a="x",b="y\"z"}` → the labels and what follows the brace.
fn parse_labels(mut text: &str) -> Option<(HashMap<String, String>, &str)> {
    let mut labels = HashMap::new();
    loop {
        text = text.trim_start_matches([',', ' ']);
        if let Some(after) = text.strip_prefix('}') {
            return Some((labels, after));
        }
        let eq = text.find('=')?;
        let key = text[..eq].trim().to_owned();
        let mut chars = text[eq + 1..].char_indices();
        if chars.next()?.1 != '"' {
            return None;
        }
        let mut value = String::new();
        let mut escaped = false;
        let end = loop {
            let (index, c) = chars.next()?;
            match (escaped, c) {
                (true, 'n') => (value.push('\n'), escaped = false).1,
                (true, c) => (value.push(c), escaped = false).1,
                (false, '\\') => escaped = true,
                (false, '"') => break eq + 1 + index + 1,
                (false, c) => value.push(c),
            }
        };
        labels.insert(key, value);
        text = &text[end..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:cache_config_info{block_size="32",kv_cache_dtype_skip_layers="[]",odd="a,b=\"c\"",num_gpu_blocks="728"} 1.0
plain_metric 7 1700000000
broken{a=1} 3
"#;

    #[test]
    fn samples_are_read_with_their_labels() {
        assert_eq!(sum(TEXT, "vllm:num_requests_running"), Some(3.0));
        assert_eq!(value(TEXT, "vllm:kv_cache_usage_perc"), Some(0.25));
        assert_eq!(value(TEXT, "plain_metric"), Some(7.0));
        assert_eq!(value(TEXT, "broken"), None, "an unquoted label value is skipped");
        let info = samples(TEXT).find(|sample| sample.name == "vllm:cache_config_info").unwrap();
        assert_eq!(info.labels["block_size"], "32");
        assert_eq!(info.labels["num_gpu_blocks"], "728");
        assert_eq!(info.labels["odd"], "a,b=\"c\"");
        assert_eq!(sum(TEXT, "absent"), None);
    }
}

//! Reading the Prometheus text format the services expose on `/metrics`:
//! samples, and histograms summed over their series with percentiles read
//! from them the way Prometheus' `histogram_quantile` does.

/// One sample line: `name{label="value",...} value`.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// The metric (with its `_bucket`/`_count`/`_sum` suffix).
    pub name: String,
    /// Its labels, in order.
    pub labels: Vec<(String, String)>,
    /// Its value.
    pub value: f64,
}

impl Sample {
    /// The value of label `name`, if it has one.
    pub fn label(&self, name: &str) -> Option<&str> {
        self.labels.iter().find(|(label, _)| label == name).map(|(_, value)| value.as_str())
    }
}

/// The samples of a `/metrics` page; comments and blank lines are skipped.
/// A line that does not parse is an error naming its number.
pub fn parse(text: &str) -> Result<Vec<Sample>, Unreadable> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty() && !line.starts_with('#'))
        .map(|(index, line)| sample(line).ok_or_else(|| Unreadable { line: index + 1, text: line.chars().take(120).collect() }))
        .collect()
}

/// A `/metrics` line that is not a sample.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}: cannot read {text:?}")]
pub struct Unreadable {
    /// Its number, from 1.
    pub line: usize,
    /// Its first 120 characters.
    pub text: String,
}

fn sample(line: &str) -> Option<Sample> {
    let name_end = line.find(['{', ' '])?;
    let name = line[..name_end].to_owned();
    let mut rest = &line[name_end..];
    let mut labels = Vec::new();
    if let Some(inner) = rest.strip_prefix('{') {
        let mut chars = inner.char_indices().peekable();
        let mut key = String::new();
        let end = loop {
            let (at, c) = chars.next()?;
            match c {
                '}' => break at,
                ',' | ' ' => {}
                '=' => {
                    if chars.next()?.1 != '"' {
                        return None;
                    }
                    let mut value = String::new();
                    loop {
                        match chars.next()?.1 {
                            '"' => break,
                            '\\' => match chars.next()?.1 {
                                'n' => value.push('\n'),
                                other => value.push(other),
                            },
                            other => value.push(other),
                        }
                    }
                    labels.push((std::mem::take(&mut key), value));
                }
                other => key.push(other),
            }
        };
        rest = &inner[end + 1..];
    }
    // A timestamp may follow the value.
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        other => other.parse().ok()?,
    };
    Some(Sample { name, labels, value })
}

/// A histogram summed over its series: cumulative counts per upper bound,
/// ascending, the last `+Inf`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// (upper bound, observations at or below it).
    pub buckets: Vec<(f64, f64)>,
}

impl Histogram {
    /// The histogram `name` (without `_bucket`) in `samples`, summed over
    /// every series (models, and whatever else it is labelled by).
    pub fn sum_of(samples: &[Sample], name: &str) -> Self {
        let bucket = format!("{name}_bucket");
        let mut buckets: Vec<(f64, f64)> = Vec::new();
        for sample in samples.iter().filter(|sample| sample.name == bucket) {
            let Some(bound) = sample.label("le").and_then(|le| if le == "+Inf" { Some(f64::INFINITY) } else { le.parse().ok() }) else { continue };
            match buckets.iter_mut().find(|(le, _)| *le == bound) {
                Some((_, count)) => *count += sample.value,
                None => buckets.push((bound, sample.value)),
            }
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Self { buckets }
    }

    /// Observations in all.
    pub fn count(&self) -> f64 {
        self.buckets.last().map_or(0.0, |(_, count)| *count)
    }

    /// The observations since `earlier` (an earlier reading of the same
    /// histogram); `None` when a count went down (the service restarted:
    /// its counts started over).
    pub fn since(&self, earlier: &Histogram) -> Option<Histogram> {
        let buckets = self
            .buckets
            .iter()
            .map(|(bound, count)| {
                let before = earlier.buckets.iter().find(|(le, _)| le == bound).map_or(0.0, |(_, count)| *count);
                (*count >= before).then_some((*bound, count - before))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Histogram { buckets })
    }

    /// The `q`-quantile (0 to 1), interpolated linearly within its bucket
    /// (the first bucket from 0); `None` without observations. A quantile
    /// in the `+Inf` bucket answers the largest finite bound.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total <= 0.0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total;
        let mut lower = (0.0, 0.0);
        for &(bound, count) in &self.buckets {
            if count >= rank {
                if bound.is_infinite() {
                    return Some(lower.0);
                }
                let within = count - lower.1;
                let fraction = if within > 0.0 { (rank - lower.1) / within } else { 1.0 };
                return Some(lower.0 + (bound - lower.0) * fraction);
            }
            lower = (bound, count);
        }
        Some(lower.0)
    }
}

/// The sum of every series of `name` whose labels include all of `labels`.
pub fn sum(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> f64 {
    samples
        .iter()
        .filter(|sample| sample.name == name && labels.iter().all(|(label, value)| sample.label(label) == Some(value)))
        .map(|sample| sample.value)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = r#"# HELP t Time
# TYPE t histogram
t_bucket{model="a",le="0.1"} 2
t_bucket{model="a",le="0.2"} 6
t_bucket{model="a",le="+Inf"} 10
t_bucket{model="b \"x\"",le="0.1"} 0
t_bucket{model="b \"x\"",le="0.2"} 4
t_bucket{model="b \"x\"",le="+Inf"} 10
t_count{model="a"} 10
tokens_total{kind="prompt",model="a"} 1500
tokens_total{kind="completion",model="a"} 300 1764000000000
"#;

    #[test]
    fn samples_and_labels_parse_with_escapes_and_timestamps() {
        let samples = parse(PAGE).unwrap();
        assert_eq!(samples.len(), 9);
        assert_eq!(samples[3].label("model"), Some("b \"x\""));
        assert_eq!(sum(&samples, "tokens_total", &[("kind", "completion")]), 300.0);
        assert_eq!(parse("t_bucket{le=\"0.1} 2").unwrap_err().line, 1);
    }

    #[test]
    fn percentiles_interpolate_within_the_summed_buckets() {
        let samples = parse(PAGE).unwrap();
        let histogram = Histogram::sum_of(&samples, "t");
        assert_eq!(histogram.buckets, [(0.1, 2.0), (0.2, 10.0), (f64::INFINITY, 20.0)]);
        // Rank 2 of 20 is the first bucket's top; rank 6 lies halfway in the second.
        assert!((histogram.quantile(0.1).unwrap() - 0.1).abs() < 1e-12);
        assert!((histogram.quantile(0.3).unwrap() - 0.15).abs() < 1e-12);
        assert_eq!(histogram.quantile(0.9), Some(0.2), "in +Inf: the largest finite bound");
        assert_eq!(Histogram::default().quantile(0.5), None);
    }

    #[test]
    fn a_reading_since_an_earlier_one_subtracts_and_a_restart_is_seen() {
        let later = Histogram { buckets: vec![(0.1, 5.0), (f64::INFINITY, 9.0)] };
        let earlier = Histogram { buckets: vec![(0.1, 2.0), (f64::INFINITY, 3.0)] };
        assert_eq!(later.since(&earlier).unwrap().buckets, [(0.1, 3.0), (f64::INFINITY, 6.0)]);
        assert_eq!(earlier.since(&later), None);
    }
}

//! `turbine planner history`: past decisions, newest first, with the
//! numbers and the reasons behind each, as an operator audits them.

use std::fmt::Write as _;

use crate::plan::Decision;
use turbine_api::planner::PlannerClient;

/// `turbine planner history`.
#[derive(Debug, Clone, clap::Args)]
pub struct HistoryArgs {
    /// The planner's gRPC endpoint.
    #[arg(long, env = "TURBINE_PLANNER_ENDPOINT", default_value = "http://127.0.0.1:50054")]
    pub planner: String,
    /// Decisions to show, newest first (1 to 10,000).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub limit: u32,
    /// Print the decisions as JSON (one array) instead of text.
    #[arg(long)]
    pub json: bool,
    /// An operator's (or monitoring) certificate, key and CA, for a
    /// planner that serves mutual TLS.
    #[command(flatten)]
    pub tls: turbine_runtime::trust::TlsConfig,
}

/// Prints the history `args` ask for to stdout.
pub fn run(args: &HistoryArgs) -> anyhow::Result<()> {
    args.tls.establish()?;
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let decisions = runtime.block_on(fetch(args)).map_err(|error| match error {
        crate::PlannerClientError::Call { code: turbine_api::ErrorCode::Unavailable, message } => {
            anyhow::anyhow!("cannot reach the planner at {} (--planner): {message}", args.planner)
        }
        other => other.into(),
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&decisions)?);
    } else if decisions.is_empty() {
        println!("no decisions yet");
    } else {
        for decision in &decisions {
            print!("{}", describe(decision));
        }
    }
    Ok(())
}

async fn fetch(args: &HistoryArgs) -> Result<Vec<Decision>, crate::PlannerClientError> {
    let client = PlannerClient::connect(&args.planner)?;
    let mut decisions = Vec::new();
    let mut token: Option<String> = None;
    while decisions.len() < args.limit as usize {
        let page_size = (args.limit as usize - decisions.len()).min(crate::ledger::MAX_PAGE as usize) as u32;
        let page = client.history(page_size, token.as_deref()).await?;
        decisions.extend(page.decisions);
        match page.next_page_token {
            Some(next) => token = Some(next),
            None => break,
        }
    }
    Ok(decisions)
}

/// A decision in words: its id, time and reason, then a line per pool.
pub fn describe(decision: &Decision) -> String {
    let mut text = format!("#{} {}{}  {}\n", decision.id, utc(decision.at_unix_ms), if decision.paused { " (paused)" } else { "" }, decision.reason);
    for pool in &decision.pools {
        let seen = decision.observed.iter().find(|seen| seen.pool == pool.pool);
        let _ = write!(text, "  {}: {} -> {} (proposed {})", pool.pool, pool.current_replicas, pool.desired_replicas, pool.proposed_replicas);
        if let Some(seen) = seen {
            let latency = |value: Option<f64>| value.map_or_else(|| "-".to_owned(), |ms| format!("{ms:.1} ms"));
            let _ = write!(
                text,
                "; seen {:.2} req/s arriving ({:.2} served, {:.0} awaiting a first token), TTFT {}, ITL {}, {} serving",
                seen.load.request_rate,
                seen.served_rate,
                seen.awaiting_first_token,
                latency(seen.ttft_ms),
                latency(seen.itl_ms),
                seen.replicas
            );
            let _ = writeln!(text);
            let _ = write!(
                text,
                "    load: ISL {:.0}, OSL {:.0} (started ISL {:.0}); {} running, {:.0} queued, KV {:.0}% ({:.0} tokens a sequence); {:.2} finished/s; mean ITL {}, token gap {}",
                seen.load.isl_mean,
                seen.load.osl_mean,
                seen.started_isl_mean,
                seen.running,
                seen.queue_depth,
                seen.kv_usage * 100.0,
                seen.context_tokens,
                seen.finish_rate,
                latency(seen.itl_mean_ms),
                latency(seen.token_gap_ms),
            );
        }
        let _ = writeln!(text);
        let _ = writeln!(text, "    why: {}", pool.reason);
        if let Some(action) = &pool.action {
            let _ = writeln!(
                text,
                "    action {}: {}{}",
                action.id,
                action.state.name(),
                if action.message.is_empty() { String::new() } else { format!(": {}", action.message) }
            );
        }
    }
    text
}

/// `unix_ms` as UTC, `2026-11-26T11:30:05Z`.
pub fn utc(unix_ms: i64) -> String {
    let seconds = unix_ms.div_euclid(1000);
    let (days, of_day) = (seconds.div_euclid(86_400), seconds.rem_euclid(86_400));
    // Days since 1970-01-01 to a civil date (proleptic Gregorian).
    let shifted = days + 719_468;
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_index + 2) / 5 + 1;
    let month = if month_index < 10 { month_index + 3 } else { month_index - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", of_day / 3600, of_day % 3600 / 60, of_day % 60)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::predict::Load;
    use crate::plan::{Action, ActionState, Observation, PoolDecision};

    #[test]
    fn times_read_as_utc() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_795_692_605_999), "2026-11-26T11:30:05Z");
    }

    #[test]
    fn a_decision_reads_with_its_reasons_and_action() {
        let decision = Decision {
            id: 42,
            at_unix_ms: 0,
            observed: vec![Observation {
                pool: "decode".into(),
                load: Load { request_rate: 6.25, isl_mean: 1_100.0, osl_mean: 110.0 },
                ttft_ms: Some(250.0),
                itl_ms: None,
                queue_depth: 2.0,
                kv_usage: 0.4,
                replicas: 3,
                running: 24,
                context_tokens: 1_210.0,
                finish_rate: 5.5,
                itl_mean_ms: None,
                token_gap_ms: Some(31.3),
                started_isl_mean: 1_050.0,
                served_rate: 5.75,
                awaiting_first_token: 3.0,
            }],
            predicted: None,
            pools: vec![PoolDecision {
                pool: "decode".into(),
                current_replicas: 3,
                proposed_replicas: 6,
                desired_replicas: 5,
                reason: "cut to 5 by the budget of 8 workers".into(),
                action: Some(Action {
                    id: "ns/42/decode".into(),
                    pool: "decode".into(),
                    replicas: 5,
                    state: ActionState::Done,
                    message: "started ns-decode-7, ns-decode-8".into(),
                }),
            }],
            reason: "forecast 3.00 req/s".into(),
            paused: false,
        };
        let text = describe(&decision);
        assert!(
            text.starts_with(
                "#42 1970-01-01T00:00:00Z  forecast 3.00 req/s\n  decode: 3 -> 5 (proposed 6); seen 6.25 req/s arriving (5.75 served, 3 awaiting a first token), TTFT 250.0 ms, ITL -, 3 serving\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("\n    load: ISL 1100, OSL 110 (started ISL 1050); 24 running, 2 queued, KV 40% (1210 tokens a sequence); 5.50 finished/s; mean ITL -, token gap 31.3 ms\n"),
            "{text}"
        );
        assert!(text.contains("why: cut to 5 by the budget") && text.contains("action ns/42/decode: done: started ns-decode-7"), "{text}");
    }
}

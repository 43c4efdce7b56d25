//! What a replay reports: summaries per policy, the table, the timeline,
//! and the sweep's plot.

use anyhow::Context;
use serde::Serialize;

/// Latency summary in milliseconds.
#[derive(Debug, Clone, Copy, Serialize, Default)]
pub struct Summary {
    /// Median.
    pub p50_ms: f64,
    /// 90th percentile.
    pub p90_ms: f64,
    /// 99th percentile.
    pub p99_ms: f64,
    /// Mean.
    pub mean_ms: f64,
}

pub(crate) fn summarize(mut samples: Vec<f64>) -> Summary {
    if samples.is_empty() {
        return Summary::default();
    }
    samples.sort_by(f64::total_cmp);
    let pick = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    Summary { p50_ms: pick(0.5), p90_ms: pick(0.9), p99_ms: pick(0.99), mean_ms: samples.iter().sum::<f64>() / samples.len() as f64 }
}

/// One policy's replay.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyReport {
    /// Routing policy.
    pub router: String,
    /// Router replicas (each behind its own gateway).
    pub routers: usize,
    /// Workers behind the routers, all roles; 0 for a deployment (--gateway).
    pub workers: usize,
    /// Of those, prefill workers (0 when aggregated).
    pub prefill_workers: usize,
    /// Of those, decode workers (0 when aggregated).
    pub decode_workers: usize,
    /// Host-memory KV tier per worker, MiB of modelled bytes (0: none).
    pub host_cache_mib: u64,
    /// Disk KV tier per worker, GiB of modelled bytes (0: none).
    pub disk_cache_gib: f64,
    /// The workers' fetch-or-recompute policy (runs with a host tier).
    pub kv_fetch: Option<String>,
    /// Whether the workers shared a kv-store.
    pub kv_store: bool,
    /// Prompt tokens the engines computed (prompt tokens less cached ones).
    pub computed_prompt_tokens: u64,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed (non-200 or a broken stream).
    pub failed: usize,
    /// Time to first token.
    pub ttft: Summary,
    /// Mean time between tokens, per request.
    pub itl: Summary,
    /// End-to-end latency.
    pub end_to_end: Summary,
    /// Output tokens per second of wall time.
    pub output_tokens_per_sec: f64,
    /// Cached prompt tokens / prompt tokens, as the engines reported.
    pub prefix_hit_rate: f64,
    /// The same for an ideal cache (see the module docs).
    pub oracle_hit_rate: f64,
    /// prefix_hit_rate / oracle_hit_rate.
    pub share_of_oracle: f64,
    /// Wall time of the replay in seconds.
    pub wall_secs: f64,
    /// Hit rates by arrival window (with --window-secs).
    pub timeline: Vec<Window>,
    /// Where the hits fell short of the oracle's.
    pub shortfall: Shortfall,
    /// The workers' KV tier counters at the end of the replay, summed
    /// over workers: `<tier> <counter>` (e.g. `host offloads_skipped`).
    pub tier_counters: std::collections::BTreeMap<String, f64>,
}

/// Sums the workers' `turbine_worker_kv_tier_*_total` counters in a
/// Prometheus text exposition by tier: `<tier> <counter>`; and the
/// routers' prompt blocks by whether the chosen worker cached them:
/// `router cached` and `router uncached`.
pub fn tier_counters(exposition: &str) -> std::collections::BTreeMap<String, f64> {
    let mut sums = std::collections::BTreeMap::new();
    let label = |labels: &str, name: &str| -> Option<String> {
        labels.split(',').find_map(|label| label.strip_prefix(name)?.strip_prefix("=\"")?.strip_suffix('"').map(str::to_owned))
    };
    for line in exposition.lines() {
        let Some((name, rest)) = line.split_once('{') else { continue };
        let Some((labels, value)) = rest.rsplit_once('}') else { continue };
        let Ok(value) = value.trim().parse::<f64>() else { continue };
        let key = if let Some(counter) = name.strip_prefix("turbine_worker_kv_tier_").and_then(|n| n.strip_suffix("_total")) {
            let Some(tier) = label(labels, "tier") else { continue };
            format!("{tier} {counter}")
        } else if name == "turbine_router_kv_prompt_blocks_total" {
            match label(labels, "cached").as_deref() {
                Some("true") => "router cached".to_owned(),
                Some(_) => "router uncached".to_owned(),
                None => continue,
            }
        } else {
            continue;
        };
        *sums.entry(key).or_insert(0.0) += value;
    }
    sums
}

/// The requests whose cached tokens fell short of what the oracle would
/// have hit (successful requests): those that hit nothing of it (the
/// prefix was not where the request ran, or was lost) and those that hit
/// part of it.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq, Eq)]
pub struct Shortfall {
    /// Requests that hit none of the oracle's tokens.
    pub whole_requests: usize,
    /// The oracle's tokens they missed.
    pub whole_tokens: u64,
    /// Requests that hit some of them, not all.
    pub partial_requests: usize,
    /// The oracle's tokens those missed.
    pub partial_tokens: u64,
}

impl Shortfall {
    /// Counts one request that hit `cached` tokens of an oracle's `oracle`.
    pub fn add(&mut self, cached: u64, oracle: u64) {
        let missed = oracle.saturating_sub(cached);
        if missed == 0 {
            return;
        }
        if cached == 0 {
            self.whole_requests += 1;
            self.whole_tokens += missed;
        } else {
            self.partial_requests += 1;
            self.partial_tokens += missed;
        }
    }
}

/// The requests that arrived in one window of the replay.
#[derive(Debug, Clone, Serialize)]
pub struct Window {
    /// Window start, seconds after the first arrival.
    pub start_secs: f64,
    /// Requests that arrived in it.
    pub requests: usize,
    /// Of those, requests that failed.
    pub failed: usize,
    /// Cached prompt tokens over prompt tokens (successful requests).
    pub hit_rate: f64,
    /// Cached tokens the oracle could serve, over what it could serve:
    /// how much of the reuse available in this window was captured.
    pub oracle_share: Option<f64>,
}

/// Everything `turbine bench replay` measures.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    /// The trace file.
    pub trace: String,
    /// The deployment replayed against (--gateway); the stack fields
    /// below then describe nothing.
    pub gateway: Option<String>,
    /// Mocker workers of the router policies (--workers); a disaggregated
    /// sweep's own counts are in each of `policies`.
    pub workers: usize,
    /// Time compression of arrivals.
    pub speedup: f64,
    /// The mocker's speedup.
    pub engine_speedup: f64,
    /// Mocker block size and pool.
    pub block_size: usize,
    /// KV blocks per worker.
    pub num_blocks: usize,
    /// One entry per policy, in the order run.
    pub policies: Vec<PolicyReport>,
}

/// Prints a report's timeline, if it has one.
pub(super) fn print_timeline(report: &PolicyReport) {
    if report.timeline.is_empty() {
        return;
    }
    eprintln!("  {:>8} {:>8} {:>6} {:>8} {:>13}", "from", "requests", "failed", "hit", "oracle share");
    for window in &report.timeline {
        let share = window.oracle_share.map_or("-".to_owned(), |share| format!("{:.1}%", share * 100.0));
        eprintln!("  {:>7.0}s {:>8} {:>6} {:>8.3} {:>13}", window.start_secs, window.requests, window.failed, window.hit_rate, share);
    }
}

/// Prints the side-by-side table.
pub fn print(report: &ReplayReport) {
    match &report.gateway {
        Some(gateway) => println!("replay of {} against {gateway}, arrivals {}x", report.trace, report.speedup),
        None => println!(
            "replay of {} on mocker workers ({} blocks of {} tokens each), arrivals {}x, engines {}x",
            report.trace, report.num_blocks, report.block_size, report.speedup, report.engine_speedup
        ),
    }
    println!(
        "{:<14} {:>7} {:>8} {:>6} {:>10} {:>10} {:>10} {:>9} {:>9} {:>10} {:>9} {:>8} {:>8}",
        "router", "workers", "requests", "failed", "ttft mean", "ttft p50", "ttft p90", "itl mean", "itl p90", "e2e mean", "out tok/s", "hit", "oracle"
    );
    for p in &report.policies {
        let label = label(p);
        println!(
            "{:<14} {:>7} {:>8} {:>6} {:>8.0}ms {:>8.0}ms {:>8.0}ms {:>7.1}ms {:>7.1}ms {:>8.0}ms {:>9.0} {:>8.3} {:>8.3}",
            label,
            if p.workers == 0 { "-".to_owned() } else { p.workers.to_string() },
            p.requests,
            p.failed,
            p.ttft.mean_ms,
            p.ttft.p50_ms,
            p.ttft.p90_ms,
            p.itl.mean_ms,
            p.itl.p90_ms,
            p.end_to_end.mean_ms,
            p.output_tokens_per_sec,
            p.prefix_hit_rate,
            p.oracle_hit_rate
        );
    }
    let one = |name: &str| report.policies.iter().find(|p| p.router == name && p.routers == 1 && p.host_cache_mib == 0);
    if let (Some(kv), Some(rr)) = (one("kv"), one("round-robin")) {
        println!(
            "kv vs round-robin: mean TTFT {:.2}x lower, p90 TTFT {:.2}x lower; kv captures {:.1}% of the oracle hit rate",
            rr.ttft.mean_ms / kv.ttft.mean_ms,
            rr.ttft.p90_ms / kv.ttft.p90_ms,
            kv.share_of_oracle * 100.0
        );
    }
    // The disaggregated sweep: each split against aggregated workers of the same count.
    for p in report.policies.iter().filter(|p| p.prefill_workers > 0) {
        let workers = p.workers;
        if let Some(aggregated) = report.policies.iter().find(|a| a.router == format!("aggregated x{workers}")) {
            println!(
                "{} vs aggregated x{workers}: TTFT mean {:.2}x, p90 {:.2}x; ITL mean {:.2}x, p90 {:.2}x (below 1: disaggregated is faster)",
                p.router,
                p.ttft.mean_ms / aggregated.ttft.mean_ms,
                p.ttft.p90_ms / aggregated.ttft.p90_ms,
                p.itl.mean_ms / aggregated.itl.mean_ms,
                p.itl.p90_ms / aggregated.itl.p90_ms
            );
        }
    }
    // The kv-store against the same configuration without it.
    for p in report.policies.iter().filter(|p| p.kv_store) {
        let without = report.policies.iter().find(|o| {
            !o.kv_store
                && o.router == p.router
                && o.routers == p.routers
                && o.host_cache_mib == p.host_cache_mib
                && o.disk_cache_gib == p.disk_cache_gib
                && o.kv_fetch == p.kv_fetch
        });
        if let Some(without) = without {
            println!(
                "{} vs without the kv-store: prompt tokens computed {} vs {} ({:.1}%); TTFT mean {:.2}x, p90 {:.2}x; hit rate {:.3} vs {:.3}",
                label(p),
                p.computed_prompt_tokens,
                without.computed_prompt_tokens,
                100.0 * p.computed_prompt_tokens as f64 / without.computed_prompt_tokens.max(1) as f64,
                p.ttft.mean_ms / without.ttft.mean_ms,
                p.ttft.p90_ms / without.ttft.p90_ms,
                p.prefix_hit_rate,
                without.prefix_hit_rate
            );
        }
    }
    // Fetch or recompute: auto against always and never on the same tiers.
    for auto in report.policies.iter().filter(|p| p.kv_fetch.as_deref() == Some("auto")) {
        let same_tiers = |other: &&PolicyReport| {
            other.router == auto.router
                && other.routers == auto.routers
                && other.host_cache_mib == auto.host_cache_mib
                && other.disk_cache_gib == auto.disk_cache_gib
                && other.kv_store == auto.kv_store
        };
        for fixed in ["always", "never"] {
            if let Some(other) = report.policies.iter().filter(same_tiers).find(|p| p.kv_fetch.as_deref() == Some(fixed)) {
                println!(
                    "{} vs {fixed}: TTFT mean {:.2}x, p90 {:.2}x; ITL mean {:.3}x; hit rate {:.3} vs {:.3} (below 1: auto is faster)",
                    label(auto),
                    auto.ttft.mean_ms / other.ttft.mean_ms,
                    auto.ttft.p90_ms / other.ttft.p90_ms,
                    auto.itl.mean_ms / other.itl.mean_ms,
                    auto.prefix_hit_rate,
                    other.prefix_hit_rate
                );
            }
        }
    }
    // Host tier against the same policy without one.
    for p in report.policies.iter().filter(|p| p.host_cache_mib > 0) {
        if let Some(g1) = report.policies.iter().find(|g1| g1.router == p.router && g1.routers == p.routers && g1.host_cache_mib == 0) {
            println!(
                "{} vs G1 only: TTFT mean {:.2}x lower, p90 {:.2}x lower; ITL mean {:.3}x; hit rate {:.3} vs {:.3} ({:.1}% of the oracle's)",
                label(p),
                g1.ttft.mean_ms / p.ttft.mean_ms,
                g1.ttft.p90_ms / p.ttft.p90_ms,
                p.itl.mean_ms / g1.itl.mean_ms,
                p.prefix_hit_rate,
                g1.prefix_hit_rate,
                p.share_of_oracle * 100.0
            );
        }
    }
    // What the hits missed of the oracle's, where they did.
    for p in report.policies.iter().filter(|p| p.shortfall != Shortfall::default()) {
        let s = p.shortfall;
        println!(
            "{} short of the oracle: {} requests hit none of it ({} tokens), {} hit part ({} tokens)",
            label(p),
            s.whole_requests,
            s.whole_tokens,
            s.partial_requests,
            s.partial_tokens
        );
    }
    for p in report.policies.iter().filter(|p| !p.tier_counters.is_empty()) {
        let counters: Vec<String> = p.tier_counters.iter().filter(|(_, v)| **v > 0.0).map(|(k, v)| format!("{k} {v}")).collect();
        println!("{} tier counters: {}", label(p), counters.join(", "));
    }
    for p in report.policies.iter().filter(|p| p.routers > 1) {
        if let Some(single) = one(&p.router) {
            println!(
                "{} x{} vs one router: hit rate {:+.1} points, mean TTFT {:.2}x",
                p.router,
                p.routers,
                (p.prefix_hit_rate - single.prefix_hit_rate) * 100.0,
                p.ttft.mean_ms / single.ttft.mean_ms
            );
        }
    }
}

/// A configuration's name in the table.
fn label(p: &PolicyReport) -> String {
    let mut label = if p.routers > 1 { format!("{} x{}", p.router, p.routers) } else { p.router.clone() };
    if p.host_cache_mib > 0 {
        label += &format!(" +G2 {}G", p.host_cache_mib as f64 / 1024.0);
    }
    if p.disk_cache_gib > 0.0 {
        label += &format!(" +G3 {}G", p.disk_cache_gib);
    }
    if p.kv_store {
        label += " +G4";
    }
    if let Some(fetch) = &p.kv_fetch {
        label += &format!(" {fetch}");
    }
    label
}

/// A plot panel: its title and the (mean, p90) it draws per configuration.
type Panel = (&'static str, fn(&PolicyReport) -> (f64, f64));

/// Writes grouped bars of TTFT and ITL (mean and p90) per configuration as
/// an SVG file.
pub fn write_plot(report: &ReplayReport, path: &std::path::Path) -> anyhow::Result<()> {
    let panels: [Panel; 2] =
        [("time to first token (ms)", |p| (p.ttft.mean_ms, p.ttft.p90_ms)), ("inter-token latency (ms)", |p| (p.itl.mean_ms, p.itl.p90_ms))];
    let (width, panel_height, left, top) = (120.0 + 110.0 * report.policies.len() as f64, 300.0, 70.0, 50.0);
    let mut svg = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{left}\" y=\"22\" font-size=\"15\">{}</text>\n",
        top + 2.0 * (panel_height + 60.0),
        escape(&format!(
            "{} (arrivals {}x, engines {}x): mean (dark) and p90 (light)",
            report.trace.rsplit('/').next().unwrap_or(&report.trace),
            report.speedup,
            report.engine_speedup
        )),
    );
    for (index, (title, values)) in panels.iter().enumerate() {
        let y0 = top + index as f64 * (panel_height + 60.0);
        let max = report.policies.iter().map(|p| values(p).1.max(values(p).0)).fold(1e-9, f64::max) * 1.1;
        let plot_height = panel_height - 40.0;
        svg += &format!("<text x=\"{left}\" y=\"{}\" font-size=\"13\">{}</text>\n", y0 + 12.0, escape(title));
        let base = y0 + 20.0 + plot_height;
        svg += &format!("<line x1=\"{left}\" y1=\"{base}\" x2=\"{}\" y2=\"{base}\" stroke=\"black\"/>\n", width - 20.0);
        for tick in 0..=4 {
            let value = max * tick as f64 / 4.0;
            let y = base - plot_height * tick as f64 / 4.0;
            svg += &format!("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{value:.0}</text>\n", left - 6.0, y + 4.0);
            svg += &format!("<line x1=\"{left}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"#ddd\"/>\n", width - 20.0);
        }
        for (slot, policy) in report.policies.iter().enumerate() {
            let (mean, p90) = values(policy);
            let x = left + 20.0 + slot as f64 * 110.0;
            let color = if policy.prefill_workers > 0 { ("#1f5fa8", "#8fb4e0") } else { ("#555555", "#b0b0b0") };
            for (offset, value, fill) in [(0.0, mean, color.0), (40.0, p90, color.1)] {
                let height = plot_height * value / max;
                svg += &format!("<rect x=\"{}\" y=\"{}\" width=\"38\" height=\"{height}\" fill=\"{fill}\"/>\n", x + offset, base - height);
                svg += &format!("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"10\">{value:.0}</text>\n", x + offset + 19.0, base - height - 3.0);
            }
            svg += &format!("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", x + 39.0, base + 16.0, escape(&policy.router));
        }
    }
    svg += "</svg>\n";
    std::fs::write(path, svg).with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

/// `text` made safe inside SVG (XML) text and attribute values.
pub(crate) fn escape(text: &str) -> String {
    text.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::{Shortfall, tier_counters};

    #[test]
    fn tier_counters_sum_over_workers_by_tier() {
        let text = "# HELP x\n\
            turbine_worker_kv_tier_offloads_skipped_total{tier=\"host\",worker=\"a\"} 3\n\
            turbine_worker_kv_tier_offloads_skipped_total{tier=\"host\",worker=\"b\"} 4\n\
            turbine_worker_kv_tier_onboarded_blocks_total{tier=\"disk\",worker=\"a\"} 7\n\
            turbine_worker_kv_tier_blocks{tier=\"host\",worker=\"a\"} 9\n\
            turbine_worker_steps_total{worker=\"a\"} 1\n\
            turbine_router_kv_prompt_blocks_total{cached=\"false\"} 5\n\
            turbine_router_kv_prompt_blocks_total{cached=\"true\"} 6\n";
        let sums = tier_counters(text);
        assert_eq!(sums.len(), 4, "{sums:?}");
        assert_eq!((sums["router cached"], sums["router uncached"]), (6.0, 5.0));
        assert_eq!((sums["host offloads_skipped"], sums["disk onboarded_blocks"]), (7.0, 7.0));
    }

    #[test]
    fn shortfall_splits_whole_misses_from_partial_ones() {
        let mut shortfall = Shortfall::default();
        shortfall.add(0, 0); // nothing to hit
        shortfall.add(640, 640); // all of it
        shortfall.add(900, 640); // more than the oracle (a block rounding): all of it
        shortfall.add(0, 6_000);
        shortfall.add(4_000, 6_000);
        shortfall.add(0, 128);
        assert_eq!(shortfall, Shortfall { whole_requests: 2, whole_tokens: 6_128, partial_requests: 1, partial_tokens: 2_000 });
    }
}

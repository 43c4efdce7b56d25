//! The SVG plot of a `turbine bench planner` run (`--svg`): four panels
//! over the run's time, one interval per step: the load (requests per
//! second), workers per fleet (and per pool, dashed and dotted, when the
//! run has several), and TTFT and ITL at the targets' percentile
//! per fleet against their targets, with a strip per fleet showing each
//! interval met (green), missed (red) or idle (grey), and a dotted line
//! where the planner was killed and started again (a band where its
//! database was down, another over a --burst). Plain SVG, no
//! scripts or external references: it opens in any browser.

use std::fmt::Write as _;

use crate::planner::{FleetReport, IntervalReport, PlannerBenchReport};
use crate::replay::report::escape;

const WIDTH: f64 = 960.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 130.0;
const PANEL: f64 = 150.0;
const GAP: f64 = 48.0;
const TOP: f64 = 50.0;
const STRIP: f64 = 12.0;

/// Each fleet's colour, in report order (static, planner).
const COLOURS: [&str; 3] = ["#1f77b4", "#d62728", "#2ca02c"];

/// The dash patterns of a fleet's pools in the workers panel (the fleet's
/// total is solid), in the order of the report's pools.
const POOL_DASHES: [(&str, &str); 3] = [("5 3", "- -"), ("1 3", "···"), ("8 3 1 3", "-·-")];

/// One panel's series: a name, a colour, a dash pattern (None: solid)
/// and a value per interval.
struct Series<'a> {
    name: String,
    colour: &'a str,
    dash: Option<(&'a str, &'a str)>,
    values: Vec<Option<f64>>,
}

/// The plot of `report`.
pub fn svg(report: &PlannerBenchReport) -> String {
    let interval = report.interval_secs.max(f64::MIN_POSITIVE);
    let intervals = report.fleets.iter().map(|fleet| fleet.timeline.len()).max().unwrap_or(0).max(1);
    let span = intervals as f64 * interval;
    let colour = |index: usize| COLOURS[index % COLOURS.len()];
    let per_fleet = |value: fn(&IntervalReport) -> Option<f64>| -> Vec<Series<'_>> {
        report
            .fleets
            .iter()
            .enumerate()
            .map(|(index, fleet)| Series { name: fleet.fleet.clone(), colour: colour(index), dash: None, values: fleet.timeline.iter().map(value).collect() })
            .collect()
    };
    // Each fleet's total, then, with several pools, each pool's.
    let mut workers = per_fleet(|at| Some(f64::from(at.workers)));
    if report.pools.len() > 1 {
        for (index, fleet) in report.fleets.iter().enumerate() {
            for (slot, pool) in report.pools.iter().enumerate() {
                workers.push(Series {
                    name: format!("{} {pool}", fleet.fleet),
                    colour: colour(index),
                    dash: Some(POOL_DASHES[slot % POOL_DASHES.len()]),
                    values: fleet.timeline.iter().map(|at| at.pool_workers.get(slot).map(|&workers| f64::from(workers))).collect(),
                });
            }
        }
    }
    // The trace is the same for every fleet: its load from the first.
    let load = report.fleets.first().map(|fleet| fleet.timeline.iter().map(|at| Some(at.requests as f64 / interval)).collect()).unwrap_or_default();
    let panels: Vec<(String, Vec<Series<'_>>, Option<f64>)> = vec![
        ("load, requests/s".to_owned(), vec![Series { name: "trace".to_owned(), colour: "#555555", dash: None, values: load }], None),
        ("workers (serving and draining)".to_owned(), workers, None),
        (format!("TTFT p{}, ms", report.percentile), per_fleet(|at| at.ttft_ms), Some(report.ttft_ms)),
        (format!("ITL p{}, ms", report.percentile), per_fleet(|at| at.itl_ms), Some(report.itl_ms)),
    ];
    let strips_top = TOP + panels.len() as f64 * (PANEL + GAP);
    let height = strips_top + report.fleets.len() as f64 * (STRIP + 6.0) + 40.0;
    let plot_width = WIDTH - LEFT - RIGHT;
    let x = |secs: f64| LEFT + secs / span * plot_width;

    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0}" viewBox="0 0 {WIDTH} {height:.0}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let ratio = report.worker_seconds_ratio;
    // The trace's file name: its folders would run the title off the plot.
    let trace = std::path::Path::new(&report.trace).file_name().map_or_else(|| report.trace.clone(), |name| name.to_string_lossy().into_owned());
    let title = format!("turbine bench planner: {trace} at {}x; planner worker-seconds / static: {ratio:.2}", report.speedup);
    let _ = writeln!(out, r#"<text x="{LEFT}" y="22" font-size="14">{}</text>"#, escape(&title));
    for (index, (title, series, target)) in panels.iter().enumerate() {
        let top = TOP + index as f64 * (PANEL + GAP);
        panel(&mut out, top, title, series, *target, interval, &x);
    }
    // The SLA strips.
    for (index, fleet) in report.fleets.iter().enumerate() {
        let top = strips_top + index as f64 * (STRIP + 6.0);
        strip(&mut out, top, fleet, interval, &x);
    }
    // Where the planner was killed and started again: a dotted line down
    // every panel, labelled once.
    for &at in &report.planner_restarts_at_secs {
        let _ = writeln!(
            out,
            r##"<line x1="{0:.1}" x2="{0:.1}" y1="{TOP:.1}" y2="{1:.1}" stroke="#d62728" stroke-dasharray="2 3"/>"##,
            x(at),
            strips_top - GAP + 6.0
        );
        let _ = writeln!(out, r##"<text x="{:.1}" y="{:.1}" fill="#d62728">planner killed</text>"##, x(at) + 3.0, TOP + 10.0);
    }
    // Where the planner's database was down: a band across every panel.
    for &at in &report.database_restarts_at_secs {
        let (from, to) = (x(at), x(at + report.database_outage_secs));
        let _ = writeln!(
            out,
            r##"<rect x="{from:.1}" y="{TOP:.1}" width="{:.1}" height="{:.1}" fill="#9467bd" fill-opacity="0.15"/>"##,
            (to - from).max(1.0),
            strips_top - GAP + 6.0 - TOP
        );
        let _ = writeln!(out, r##"<text x="{:.1}" y="{:.1}" fill="#9467bd">database down</text>"##, from + 3.0, TOP + 22.0);
    }
    // The burst: a band across every panel.
    if let Some(burst) = report.burst {
        let (from, to) = (x(burst.at_secs), x(burst.at_secs + burst.secs));
        let _ = writeln!(
            out,
            r##"<rect x="{from:.1}" y="{TOP:.1}" width="{:.1}" height="{:.1}" fill="#ff7f0e" fill-opacity="0.12"/>"##,
            (to - from).max(1.0),
            strips_top - GAP + 6.0 - TOP
        );
        let _ = writeln!(out, r##"<text x="{:.1}" y="{:.1}" fill="#ff7f0e">burst x{}</text>"##, from + 3.0, TOP + 34.0, burst.factor);
    }
    // The time axis under the strips.
    let axis = strips_top + report.fleets.len() as f64 * (STRIP + 6.0) + 14.0;
    for tick in ticks(span) {
        let _ = writeln!(out, r#"<text x="{:.1}" y="{axis:.1}" text-anchor="middle">{}</text>"#, x(tick), number(tick));
    }
    let _ = writeln!(out, r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">run time, s</text>"#, LEFT + plot_width / 2.0, axis + 14.0);
    out.push_str("</svg>\n");
    out
}

/// One panel: frame, y ticks, the target (dashed), each series as steps,
/// and the legend at its right.
fn panel(out: &mut String, top: f64, title: &str, series: &[Series<'_>], target: Option<f64>, interval: f64, x: &dyn Fn(f64) -> f64) {
    let highest = series.iter().flat_map(|series| series.values.iter().flatten()).copied().chain(target).fold(0.0_f64, f64::max);
    let ceiling = if highest > 0.0 { highest * 1.1 } else { 1.0 };
    let y = |value: f64| top + PANEL - value / ceiling * PANEL;
    let (left, right) = (LEFT, WIDTH - RIGHT);
    let _ = writeln!(out, r#"<text x="{left}" y="{:.1}" font-weight="bold">{}</text>"#, top - 6.0, escape(title));
    let _ = writeln!(out, r##"<rect x="{left}" y="{top:.1}" width="{:.1}" height="{PANEL}" fill="none" stroke="#999999"/>"##, right - left);
    for tick in ticks(ceiling) {
        let _ = writeln!(out, r##"<line x1="{left}" x2="{right}" y1="{0:.1}" y2="{0:.1}" stroke="#eeeeee"/>"##, y(tick));
        let _ = writeln!(out, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#, left - 4.0, y(tick) + 4.0, number(tick));
    }
    let mut legend = top + 12.0;
    if let Some(target) = target {
        let _ = writeln!(out, r##"<line x1="{left}" x2="{right}" y1="{0:.1}" y2="{0:.1}" stroke="#000000" stroke-dasharray="6 4"/>"##, y(target));
        let _ = writeln!(out, r#"<text x="{:.1}" y="{legend:.1}">- - target {}</text>"#, right + 8.0, number(target));
        legend += 14.0;
    }
    for series in series {
        // Steps, broken where an interval has no value.
        let mut run: Vec<String> = Vec::new();
        let flush = |run: &mut Vec<String>, out: &mut String| {
            if !run.is_empty() {
                let dash = series.dash.map_or_else(String::new, |(pattern, _)| format!(r#" stroke-dasharray="{pattern}""#));
                let _ = writeln!(out, r#"<polyline fill="none" stroke="{}" stroke-width="1.5"{dash} points="{}"/>"#, series.colour, run.join(" "));
                run.clear();
            }
        };
        for (index, value) in series.values.iter().enumerate() {
            match value {
                Some(value) => {
                    let start = index as f64 * interval;
                    run.push(format!("{:.1},{:.1}", x(start), y(*value)));
                    run.push(format!("{:.1},{:.1}", x(start + interval), y(*value)));
                }
                None => flush(&mut run, out),
            }
        }
        flush(&mut run, out);
        let mark = series.dash.map_or("—", |(_, mark)| mark);
        let _ = writeln!(out, r#"<text x="{:.1}" y="{legend:.1}" fill="{}">{mark} {}</text>"#, right + 8.0, series.colour, escape(&series.name));
        legend += 14.0;
    }
}

/// A fleet's row of intervals: met, missed, idle.
fn strip(out: &mut String, top: f64, fleet: &FleetReport, interval: f64, x: &dyn Fn(f64) -> f64) {
    for (index, at) in fleet.timeline.iter().enumerate() {
        let fill = match (at.requests, at.met) {
            (0, _) => "#dddddd",
            (_, true) => "#2ca02c",
            (_, false) => "#d62728",
        };
        let start = index as f64 * interval;
        let _ = writeln!(
            out,
            r#"<rect x="{:.1}" y="{top:.1}" width="{:.2}" height="{STRIP}" fill="{fill}"/>"#,
            x(start),
            (x(start + interval) - x(start)).max(0.5)
        );
    }
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}">{} SLA: {}/{}</text>"#,
        WIDTH - RIGHT + 8.0,
        top + STRIP - 2.0,
        escape(&fleet.fleet),
        fleet.intervals_met,
        fleet.intervals
    );
}

/// About five round ticks from 0 to `upto`.
fn ticks(upto: f64) -> Vec<f64> {
    if !(upto.is_finite() && upto > 0.0) {
        return vec![0.0];
    }
    let raw = upto / 5.0;
    let magnitude = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].into_iter().map(|factor| factor * magnitude).find(|step| *step >= raw).unwrap_or(10.0 * magnitude);
    (0..).map(|index| f64::from(index) * step).take_while(|tick| *tick <= upto + step * 1e-9).collect()
}

fn number(value: f64) -> String {
    if value == value.trunc() && value.abs() < 1e9 { format!("{value:.0}") } else { format!("{value:.1}") }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replay::report::Summary;

    fn fleet(name: &str, workers: &[u32], itl: &[Option<f64>]) -> FleetReport {
        let pools: Vec<Vec<u32>> = workers.iter().map(|&workers| vec![workers]).collect();
        fleet_of_pools(name, &pools, itl)
    }

    fn fleet_of_pools(name: &str, pools: &[Vec<u32>], itl: &[Option<f64>]) -> FleetReport {
        let timeline: Vec<IntervalReport> = pools
            .iter()
            .zip(itl)
            .enumerate()
            .map(|(index, (pool_workers, itl_ms))| IntervalReport {
                start_secs: index as f64 * 5.0,
                requests: if itl_ms.is_some() { 10 } else { 0 },
                ttft_ms: itl_ms.map(|itl| itl * 10.0),
                itl_ms: *itl_ms,
                met: itl_ms.is_none_or(|itl| itl <= 20.0),
                workers: pool_workers.iter().sum(),
                pool_workers: pool_workers.clone(),
            })
            .collect();
        FleetReport {
            fleet: name.into(),
            requests: 30,
            failed: 0,
            intervals: 3,
            intervals_met: 2,
            sla_attainment: 2.0 / 3.0,
            worker_seconds: 1.0,
            peak_workers: 4,
            ttft: Summary::default(),
            itl: Summary::default(),
            wall_secs: 20.0,
            first_missed_secs: None,
            peak_at_secs: None,
            after_load: None,
            burst: None,
            timeline,
        }
    }

    #[test]
    fn every_fleet_and_target_is_drawn_and_gaps_break_the_lines() {
        let report = report(
            vec![
                fleet("static", &[4, 4, 4, 4], &[Some(10.0), Some(12.0), None, Some(15.0)]),
                fleet("planner", &[1, 2, 3, 2], &[Some(30.0), Some(18.0), None, Some(19.0)]),
            ],
            &["workers"],
        );
        let plot = svg(&report);
        assert_eq!(plot.matches("planner killed").count(), 1, "the restart is marked");
        assert_eq!(plot.matches("database down").count(), 1, "the outage is marked");
        assert!(plot.starts_with("<svg ") && plot.trim_end().ends_with("</svg>"));
        assert!(plot.contains("a &lt;trace&gt; &amp; more") && !plot.contains("<trace>"), "text is escaped");
        // Load and workers unbroken (1 + 2 lines); TTFT and ITL broken by the idle interval (2 × 2 × 2).
        assert_eq!(plot.matches("<polyline").count(), 1 + 2 + 8);
        // The targets, dashed, with their values.
        assert_eq!(plot.matches("stroke-dasharray=\"6 4\"").count(), 2);
        assert!(plot.contains("target 300") && plot.contains("target 20"));
        // A strip per fleet: its first interval missed (red) for the planner only, the idle one grey.
        assert_eq!(plot.matches(r##"fill="#d62728"/>"##).count(), 1);
        assert_eq!(plot.matches(r##"fill="#dddddd"/>"##).count(), 2);
        assert!(plot.contains("planner SLA: 2/3"));
    }

    #[test]
    fn with_several_pools_each_fleets_pools_are_drawn_beside_its_total() {
        let itl = [Some(10.0), Some(12.0), Some(11.0), Some(15.0)];
        let static_fleet = fleet_of_pools("static", &vec![vec![4, 6]; 4], &itl);
        let planner = fleet_of_pools("planner", &[vec![2, 2], vec![2, 3], vec![3, 5], vec![2, 4]], &itl);
        let plot = svg(&report(vec![static_fleet, planner], &["prefill", "decode"]));
        // Load 1; workers: 2 totals and 2 × 2 pools; TTFT and ITL 2 each.
        assert_eq!(plot.matches("<polyline").count(), 1 + 2 + 4 + 2 + 2);
        assert_eq!(plot.matches(r#"stroke-dasharray="5 3" points"#).count(), 2, "prefill dashed, once per fleet");
        assert_eq!(plot.matches(r#"stroke-dasharray="1 3" points"#).count(), 2, "decode dotted, once per fleet");
        assert!(plot.contains("- - planner prefill") && plot.contains("··· static decode"));
    }

    fn report(fleets: Vec<FleetReport>, pools: &[&str]) -> PlannerBenchReport {
        PlannerBenchReport {
            trace: "a <trace> & more".into(),
            speedup: 5.0,
            ttft_ms: 300.0,
            itl_ms: 20.0,
            percentile: 90.0,
            interval_secs: 5.0,
            fleets,
            pools: pools.iter().map(|&pool| pool.to_owned()).collect(),
            static_workers: vec![4],
            planner_start_workers: vec![1],
            worker_seconds_ratio: 0.5,
            prompts_cut: 0,
            planner_restarts_at_secs: vec![7.5],
            database_restarts_at_secs: vec![10.0],
            database_outage_secs: 4.0,
            planner_actions: Default::default(),
            closed_loop_clients: None,
            burst: None,
        }
    }

    #[test]
    fn ticks_are_round() {
        assert_eq!(ticks(100.0), [0.0, 20.0, 40.0, 60.0, 80.0, 100.0]);
        assert_eq!(ticks(33.0), [0.0, 10.0, 20.0, 30.0]);
        assert_eq!(ticks(0.0), [0.0]);
    }
}

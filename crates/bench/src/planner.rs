//! `turbine bench planner`: an Azure 2023 trace, time-compressed, replayed
//! through a real gateway and router (in this process, following a Redis
//! registry) onto mocker worker processes, twice in one run:
//!
//! 1. a static fleet sized for the trace's peak interval (the profile's
//!    proposal for the busiest interval, or `--static-workers`);
//! 2. a fleet the planner sizes, from the profile's proposal for the
//!    trace's first interval (or `--planner-start`): its cycle observes the
//!    gateway's metrics and the registry every `--interval-secs`,
//!    forecasts, proposes from the `--profile`, constrains, and the `local`
//!    connector starts and drains `turbine worker` processes.
//!
//! Reported per fleet: requests and failures (client-side; a drain must
//! lose none), the share of intervals (of arrival time, with requests)
//! whose TTFT and ITL at the targets' percentile are within the targets,
//! and worker-seconds (serving and draining workers, sampled four times a
//! second from the first arrival to the last completion); then the
//! planner's worker-seconds over the static fleet's.
//!
//! Latencies are the run's own (wall clock): with `--speedup` S the trace
//! arrives S times faster and the mocker workers run S times faster than
//! their model of a GPU, so the profile (measured with the same mocker
//! speedup) and the targets are in the run's time too.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use turbine_planner::act::connector::{Connector, Outcome};
use turbine_planner::act::local::{LocalConnector, LocalSettings};
use turbine_planner::cycle::Sizing;
use turbine_planner::observe::Observer;
use turbine_planner::plan::predict::Load;
use turbine_planner::plan::profile::Profile;
use turbine_planner::plan::propose::{Corrections, propose};
use turbine_planner::{Action, ActionState, Ledger, PlannerState, PoolKind, PoolLimits, Predictor, Targets};
use turbine_registry::{RedisRegistry, Registry};
use turbine_runtime::CancellationToken;
use turbine_runtime::host::Listeners;

use crate::replay::drive::stream_completion;
use crate::replay::report::{Summary, summarize};

/// The pool the bench sizes (without --disaggregated).
const POOL: &str = "workers";

/// How often the fleet's size is sampled.
const SAMPLE: Duration = Duration::from_millis(250);

/// Flags of `turbine bench planner`.
#[derive(Debug, Clone, clap::Args)]
pub struct PlannerBenchArgs {
    /// Azure 2023 trace (CSV TIMESTAMP,ContextTokens,GeneratedTokens), e.g.
    /// services/planner/tests/fixtures/azure_llm_inference_2023_conv.csv.
    #[arg(long)]
    pub trace: PathBuf,
    /// The workers' profile (`turbine profile --engine mock --speedup S`,
    /// S the engine speedup here).
    #[arg(long)]
    pub profile: PathBuf,
    /// Redis URL: the workers register there and the router follows them.
    #[arg(long)]
    pub redis: String,
    /// Time compression: arrivals come this many times faster than in the
    /// trace, and the mocker workers run this many times faster than their
    /// model of a GPU.
    #[arg(long, default_value_t = 20.0)]
    pub speedup: f64,
    /// The mocker's speedup over its model of a GPU [default: --speedup,
    /// so the replay is the trace with time compressed]. Lower it to load
    /// the workers more (slower engines for the same traffic); the profile
    /// must be measured at this speedup.
    #[arg(long)]
    pub engine_speedup: Option<f64>,
    /// Replay only the first N requests [default: all].
    #[arg(long)]
    pub limit: Option<usize>,
    /// Replay one request in N, evenly: the trace's shape over time at a
    /// Nth of its rate (with a higher --speedup: the whole trace in less
    /// time without more load on this machine's cores).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub every: u32,
    /// Cap on each request's output tokens [default: the trace's].
    #[arg(long)]
    pub max_output_tokens: Option<u32>,
    /// More flags for every worker (after `--engine mock --speedup S`,
    /// S the engine speedup).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub worker_args: String,
    /// The worker executable [default: `turbine worker`, this binary].
    #[arg(long)]
    pub worker_binary: Option<PathBuf>,
    /// TTFT target at --percentile, milliseconds of the run's time.
    #[arg(long)]
    pub ttft_ms: f64,
    /// ITL target at --percentile, milliseconds of the run's time.
    #[arg(long)]
    pub itl_ms: f64,
    /// The percentile both targets are read at.
    #[arg(long, default_value_t = 90.0)]
    pub percentile: f64,
    /// Seconds between the planner's decisions (the run's time); also the
    /// length of the intervals the SLA is judged on.
    #[arg(long, default_value_t = 3)]
    pub interval_secs: u32,
    /// Seconds after a pool was scaled during which it is not scaled down
    /// (a scale-up is not held).
    #[arg(long, default_value_t = 6)]
    pub cooldown_secs: u32,
    /// Fewest and most workers the planner keeps.
    #[arg(long, default_value_t = 1)]
    pub min_workers: u32,
    /// Most workers the planner asks for (also its budget).
    #[arg(long, default_value_t = 8)]
    pub max_workers: u32,
    /// The planner's predictor: constant, moving-average or seasonal.
    #[arg(long, default_value = "moving-average")]
    pub predictor: String,
    /// Prefill and decode workers in pools of their own (`prefill` and
    /// `decode`, each within --min-workers and --max-workers; the router
    /// sends each prompt to a prefill worker and its decoding to a decode
    /// worker) instead of one pool of aggregated workers.
    #[arg(long)]
    pub disaggregated: bool,
    /// The static fleet's size, one number per pool (with
    /// --disaggregated: PREFILL,DECODE) [default: the profile's proposal
    /// for the trace's busiest interval, within --max-workers].
    #[arg(long, value_delimiter = ',')]
    pub static_workers: Vec<u32>,
    /// The planner's fleet when the replay starts, one number per pool
    /// [default: the profile's proposal for the trace's first interval,
    /// within --min-workers and --max-workers: a planner already running
    /// when the trace begins]. At --min-workers it measures a cold start.
    #[arg(long, value_delimiter = ',')]
    pub planner_start: Vec<u32>,
    /// The planner's database [default: SQLite in a temporary folder].
    #[arg(long, conflicts_with = "postgres")]
    pub database: Option<String>,
    /// Keep the planner's state in a private PostgreSQL server the bench
    /// starts for the run (`initdb` and `postgres` from
    /// $TURBINE_POSTGRES_BIN, PATH or /usr/lib/postgresql; as root the
    /// server runs as the user `postgres`).
    #[arg(long)]
    pub postgres: bool,
    /// Kill that server (SIGKILL, as a crash) this many seconds into the
    /// planner's replay, keep it down for --database-outage-secs, then
    /// start it again on its data (comma separated for several; needs
    /// --postgres). The planner meanwhile decides from memory (scale-ups
    /// only) and records those decisions once the database is back.
    #[arg(long, value_delimiter = ',', requires = "postgres")]
    pub restart_database_at: Vec<f64>,
    /// How long the database stays down at each --restart-database-at.
    #[arg(long, default_value_t = 10.0)]
    pub database_outage_secs: f64,
    /// Kill the planner (SIGKILL) this many seconds into its replay and
    /// start it again on the same database and worker folder (comma
    /// separated for several). The planner then runs as a process of its
    /// own (`turbine planner serve --connector local`) instead of inside
    /// the bench.
    #[arg(long, value_delimiter = ',')]
    pub kill_planner_at: Vec<f64>,
    /// A closed loop instead of the trace's arrival times: this many
    /// clients, each sending its next request (the trace's lengths, in
    /// turn) as soon as its last one finished, for --duration-secs: the
    /// demand is the clients', whatever the fleet serves. Run with
    /// --planner-start at the pool's minimum to see the planner grow a
    /// saturated fleet.
    #[arg(long, requires = "duration_secs")]
    pub closed_loop: Option<u32>,
    /// How long the closed loop runs, seconds of the run's time (then the
    /// clients stop: the planner's fleet shrinks during the idle tail).
    #[arg(long, requires = "closed_loop")]
    pub duration_secs: Option<f64>,
    /// Seconds the fleets stay measured after a closed loop ends (its
    /// scale-down is part of the planner's worker-seconds).
    #[arg(long, default_value_t = 0.0)]
    pub idle_secs: f64,
    /// A burst: AT,SECS,FACTOR: the requests arriving from AT for SECS
    /// seconds (the run's time) come FACTOR times as often (each with
    /// FACTOR-1 copies of its lengths, spread evenly until the next
    /// request's arrival, each with a prompt of its own). The static fleet
    /// is sized for the peak, burst included; start the planner's at the
    /// trace's first interval (the default) or at --min-workers to see it
    /// answer demand above its capacity.
    #[arg(long, value_delimiter = ',', num_args = 1, value_name = "AT,SECS,FACTOR")]
    pub burst: Vec<f64>,
    /// Write the report as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write a plot here (SVG): load, workers per fleet, TTFT and ITL
    /// against the targets per interval, and which intervals met them.
    #[arg(long)]
    pub svg: Option<PathBuf>,
}

/// One fleet's replay.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FleetReport {
    /// `static` or `planner`.
    pub fleet: String,
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed (client-side count).
    pub failed: usize,
    /// Intervals with requests.
    pub intervals: usize,
    /// Of those, intervals whose TTFT and ITL at the percentile met the
    /// targets.
    pub intervals_met: usize,
    /// `intervals_met / intervals`.
    pub sla_attainment: f64,
    /// Workers (serving and draining) integrated over the replay, seconds.
    pub worker_seconds: f64,
    /// Most workers at once.
    pub peak_workers: u32,
    /// TTFT over all requests, ms.
    pub ttft: Summary,
    /// ITL over all requests, ms.
    pub itl: Summary,
    /// The replay's length, seconds.
    pub wall_secs: f64,
    /// When the first interval with requests missed a target (its start,
    /// seconds).
    pub first_missed_secs: Option<f64>,
    /// When the fleet first reached its peak, seconds.
    pub peak_at_secs: Option<f64>,
    /// After the last request was sent: the fewest workers the fleet came
    /// down to, and how many seconds after that last request it got there.
    pub after_load: Option<(u32, f64)>,
    /// How the fleet took the burst (with --burst).
    pub burst: Option<BurstReport>,
    /// Per interval: start (s), requests, TTFT and ITL at the percentile
    /// (ms), workers at its end (in all and per pool).
    pub timeline: Vec<IntervalReport>,
}

/// A fleet through the burst: the intervals that start within it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BurstReport {
    /// Intervals with requests that start within the burst.
    pub intervals: usize,
    /// Of those, intervals that met both targets.
    pub intervals_met: usize,
    /// Workers when the burst began.
    pub workers_at_start: u32,
    /// Seconds from the burst's start until a worker more than at its
    /// start was serving (`None`: the fleet did not grow).
    pub grown_after_secs: Option<f64>,
    /// Intervals of the burst that missed a target and started before
    /// the fleet grew (all it missed, if it never grew).
    pub missed_before_grown: usize,
    /// Most workers from the burst's start to its end.
    pub peak_workers: u32,
}

/// A burst of --burst: from `at_secs`, for `secs`, requests `factor`
/// times as often.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Burst {
    /// Start, seconds of the run's time.
    pub at_secs: f64,
    /// Length, seconds.
    pub secs: f64,
    /// Requests this many times as often.
    pub factor: u32,
}

impl Burst {
    fn parse(given: &[f64]) -> anyhow::Result<Option<Self>> {
        let [at_secs, secs, factor] = match given {
            [] => return Ok(None),
            [at, secs, factor] => [*at, *secs, *factor],
            _ => anyhow::bail!("--burst: three numbers, AT,SECS,FACTOR (got {})", given.len()),
        };
        anyhow::ensure!(at_secs >= 0.0 && at_secs.is_finite(), "--burst: AT must be 0 or more seconds");
        anyhow::ensure!(secs > 0.0 && secs.is_finite(), "--burst: SECS must be positive");
        anyhow::ensure!((2.0..=1000.0).contains(&factor) && factor.fract() == 0.0, "--burst: FACTOR must be a whole number from 2 to 1000");
        Ok(Some(Self { at_secs, secs, factor: factor as u32 }))
    }

    /// `trace` with the requests arriving within the burst (at `speedup`,
    /// the run's time) `factor` times over: each request's copies spread
    /// evenly until the next arrival (the burst's end, for its last).
    fn apply(&self, trace: &[turbine_planner::plan::backtest::TraceRequest], speedup: f64) -> Vec<turbine_planner::plan::backtest::TraceRequest> {
        let Some(first) = trace.first().map(|request| request.at_secs) else { return Vec::new() };
        let run_secs = |request: &turbine_planner::plan::backtest::TraceRequest| (request.at_secs - first) / speedup;
        let end = self.at_secs + self.secs;
        let mut out = Vec::with_capacity(trace.len());
        for (index, request) in trace.iter().enumerate() {
            out.push(*request);
            let at = run_secs(request);
            if !(self.at_secs..end).contains(&at) {
                continue;
            }
            let next = trace.get(index + 1).map_or(end, run_secs).min(end);
            let gap = (next - at).max(0.0) / f64::from(self.factor);
            for copy in 1..self.factor {
                out.push(turbine_planner::plan::backtest::TraceRequest { at_secs: request.at_secs + gap * f64::from(copy) * speedup, ..*request });
            }
        }
        out
    }
}

/// One interval of a fleet's replay.
#[derive(Debug, Clone, serde::Serialize)]
pub struct IntervalReport {
    /// Start, seconds from the first arrival.
    pub start_secs: f64,
    /// Requests arriving in it.
    pub requests: usize,
    /// TTFT at the percentile, ms.
    pub ttft_ms: Option<f64>,
    /// ITL at the percentile, ms.
    pub itl_ms: Option<f64>,
    /// Whether both were within target.
    pub met: bool,
    /// Workers (serving and draining) at the interval's end.
    pub workers: u32,
    /// Of those, per pool, in the order of the report's `pools`.
    pub pool_workers: Vec<u32>,
}

/// The bench's report.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PlannerBenchReport {
    /// The trace.
    pub trace: String,
    /// The time compression.
    pub speedup: f64,
    /// TTFT and ITL targets, ms, at `percentile`.
    pub ttft_ms: f64,
    /// See `ttft_ms`.
    pub itl_ms: f64,
    /// The targets' percentile.
    pub percentile: f64,
    /// The planner's interval (each timeline step), seconds.
    pub interval_secs: f64,
    /// The static fleet, then the planner's.
    pub fleets: Vec<FleetReport>,
    /// The pools, in the order of the sizes below.
    pub pools: Vec<String>,
    /// Workers per pool of the static fleet.
    pub static_workers: Vec<u32>,
    /// Workers per pool the planner's fleet started the replay with.
    pub planner_start_workers: Vec<u32>,
    /// The planner's worker-seconds over the static fleet's.
    pub worker_seconds_ratio: f64,
    /// Prompts of the trace longer than the model's context (with their
    /// output), cut to fit.
    pub prompts_cut: usize,
    /// When the planner was killed and started again, seconds into its
    /// replay.
    pub planner_restarts_at_secs: Vec<f64>,
    /// When the planner's database was killed (seconds into its replay),
    /// each down for `database_outage_secs`.
    pub database_restarts_at_secs: Vec<f64>,
    /// How long each of those outages lasted.
    pub database_outage_secs: f64,
    /// The planner's actions by how they ended (done, failed, pending).
    pub planner_actions: ActionCounts,
    /// The closed loop's clients (none: the trace's arrival times).
    pub closed_loop_clients: Option<u32>,
    /// The burst (--burst).
    pub burst: Option<Burst>,
}

/// The planner's actions by how they ended.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ActionCounts {
    /// Carried out.
    pub done: usize,
    /// Not carried out (superseded, or the connector could not).
    pub failed: usize,
    /// Still pending when the replay ended.
    pub pending: usize,
}

/// One request of the compressed trace.
#[derive(Debug, Clone)]
struct Request {
    at: Duration,
    prompt: Vec<u32>,
    max_tokens: u32,
}

/// What came back for one request: arrival, TTFT and ITL (ms), or failure.
type Measured = (Duration, Option<(f64, Option<f64>)>);

/// The fleet's size over a replay: when, and workers per pool (in the
/// order of the bench's pools).
type Samples = Vec<(Duration, Vec<u32>)>;

/// How requests are sent: at the trace's times, or by a closed loop of
/// clients.
#[derive(Debug, Clone, Copy)]
enum Sending {
    Trace,
    ClosedLoop { clients: u32, duration: Duration, idle: Duration },
}

/// Runs the bench.
pub async fn run(args: &PlannerBenchArgs) -> anyhow::Result<PlannerBenchReport> {
    anyhow::ensure!(args.speedup > 0.0, "--speedup: must be positive");
    let sending = match (args.closed_loop, args.duration_secs) {
        (Some(clients), Some(secs)) => {
            anyhow::ensure!(clients > 0, "--closed-loop: at least one client");
            let duration = Duration::try_from_secs_f64(secs).map_err(|error| anyhow::anyhow!("--duration-secs: {error}"))?;
            let idle = Duration::try_from_secs_f64(args.idle_secs).map_err(|error| anyhow::anyhow!("--idle-secs: {error}"))?;
            Sending::ClosedLoop { clients, duration, idle }
        }
        _ => Sending::Trace,
    };
    let outage = Duration::try_from_secs_f64(args.database_outage_secs)
        .map_err(|error| anyhow::anyhow!("--database-outage-secs: {error} (a number of seconds, 0 or more)"))?;
    let profile = Profile::read(&args.profile)?;
    let mut trace = turbine_planner::plan::backtest::read_azure_csv(&args.trace)?;
    if args.every > 1 {
        trace = trace.into_iter().step_by(args.every as usize).collect();
    }
    if let Some(limit) = args.limit {
        trace.truncate(limit);
    }
    anyhow::ensure!(!trace.is_empty(), "{}: no requests", args.trace.display());
    let burst = Burst::parse(&args.burst)?;
    anyhow::ensure!(burst.is_none() || matches!(sending, Sending::Trace), "--burst: a trace's arrivals, not --closed-loop");
    if let Some(burst) = burst {
        trace = burst.apply(&trace, args.speedup);
    }
    let first = trace[0].at_secs;
    let mut requests: Vec<Request> = trace
        .iter()
        .enumerate()
        .map(|(index, request)| Request {
            at: Duration::from_secs_f64((request.at_secs - first).max(0.0) / args.speedup),
            // Distinct prompts: the trace carries no prefix sharing.
            prompt: (0..request.input_tokens.max(1)).map(|position| 100 + ((index as u32).wrapping_mul(7919).wrapping_add(position) % 30_000)).collect(),
            max_tokens: args.max_output_tokens.map_or(request.output_tokens, |cap| request.output_tokens.min(cap)).max(1),
        })
        .collect();
    let kinds: &[(&str, PoolKind)] =
        if args.disaggregated { &[("prefill", PoolKind::Prefill), ("decode", PoolKind::Decode)] } else { &[(POOL, PoolKind::Aggregated)] };
    let pools: Vec<PoolLimits> = kinds
        .iter()
        .map(|(pool, kind)| PoolLimits { pool: (*pool).into(), kind: *kind, min_replicas: args.min_workers, max_replicas: args.max_workers })
        .collect();
    let pool_names: Vec<String> = pools.iter().map(|limits| limits.pool.clone()).collect();
    let predictor: Predictor = args.predictor.parse().map_err(|unknown| anyhow::anyhow!("--predictor: {unknown}"))?;
    let targets = Targets::new(
        args.ttft_ms,
        args.itl_ms,
        args.percentile,
        pools.clone(),
        args.max_workers * pools.len() as u32,
        Duration::from_secs(u64::from(args.interval_secs)),
        Duration::from_secs(u64::from(args.cooldown_secs)),
        predictor,
    )?;
    let (first_size, peak_size) = profile_sizes(&trace, args, &profile, &targets)?;
    let sizes = |flag: &str, given: &[u32], default: Vec<u32>| -> anyhow::Result<Vec<u32>> {
        if given.is_empty() {
            return Ok(default);
        }
        anyhow::ensure!(
            given.len() == pools.len(),
            "--{flag}: {} numbers for {} pools ({})",
            given.len(),
            pools.len(),
            kinds.iter().map(|(pool, _)| *pool).collect::<Vec<_>>().join(", ")
        );
        Ok(given.to_vec())
    };
    let static_workers = sizes("static-workers", &args.static_workers, peak_size)?;
    let planner_start = sizes("planner-start", &args.planner_start, first_size)?;
    if let Some(outside) = planner_start.iter().find(|size| !(args.min_workers..=args.max_workers).contains(size)) {
        anyhow::bail!("--planner-start: {outside} is outside --min-workers {} and --max-workers {}", args.min_workers, args.max_workers);
    }
    let words = |sizes: &[u32]| pools.iter().zip(sizes).map(|(limits, size)| format!("{} {size}", limits.pool)).collect::<Vec<_>>().join(", ");
    let load = match sending {
        Sending::Trace => format!("{} requests over {:.0} s of run time", requests.len(), requests.last().map_or(0.0, |r| r.at.as_secs_f64())),
        Sending::ClosedLoop { clients, duration, idle } => format!(
            "{clients} clients back to back for {:.0} s of run time (the trace's {} requests in turn), then {:.0} s idle",
            duration.as_secs_f64(),
            requests.len(),
            idle.as_secs_f64()
        ),
    };
    eprintln!("{load}; static fleet: {}; the planner's starts at {}", words(&static_workers), words(&planner_start));

    // The stack: a router following the Redis registry and event log, a
    // gateway in front of it.
    let namespace = format!("bench-planner-{}", std::process::id());
    let shutdown = CancellationToken::new();
    let (gateway_url, stack) = start_stack(&args.redis, &namespace, shutdown.clone()).await?;
    let state_dir = tempfile::tempdir()?;
    let (worker_binary, worker_subcommand) = match &args.worker_binary {
        Some(binary) => (binary.clone(), None),
        None => (std::env::current_exe()?, Some("worker".to_owned())),
    };
    let engine_speedup = args.engine_speedup.unwrap_or(args.speedup);
    anyhow::ensure!(engine_speedup > 0.0, "--engine-speedup: must be positive");
    let mut worker_args = vec!["--engine".to_owned(), "mock".to_owned(), "--speedup".to_owned(), engine_speedup.to_string()];
    worker_args.extend(args.worker_args.split_whitespace().map(str::to_owned));
    let settings = LocalSettings {
        worker_binary,
        worker_subcommand,
        worker_args,
        state_dir: state_dir.path().to_owned(),
        redis: args.redis.clone(),
        namespace: namespace.clone(),
        ready_timeout: Duration::from_secs(300),
        drain_timeout: Duration::from_secs(300),
    };
    let mut connector = LocalConnector::open(settings.clone())?;
    let registry = Registry::Redis(RedisRegistry::new(&args.redis, &namespace)?);
    let mut next_action = 0u64;
    let mut resize = async |connector: &LocalConnector, sizes: &[u32]| -> anyhow::Result<()> {
        next_action += 1;
        for (limits, &replicas) in pools.iter().zip(sizes) {
            let id = format!("bench/{next_action}/{}", limits.pool);
            let action = Action { id, pool: limits.pool.clone(), replicas, state: ActionState::Pending, message: String::new() };
            match connector.execute(&action, limits.kind).await {
                Outcome::Done(_) | Outcome::Awaiting(_) => {}
                Outcome::Failed(problem) => anyhow::bail!("sizing pool {} to {replicas}: {problem}", limits.pool),
            }
        }
        Ok(())
    };
    let none = vec![0; pools.len()];
    let http = reqwest::Client::builder().pool_max_idle_per_host(1024).build()?;
    let completions = format!("{gateway_url}/v1/completions");

    // 1. The static fleet.
    resize(&connector, &static_workers).await?;
    until_serving(&registry, static_workers.iter().sum(), &http, &gateway_url).await?;
    let (model, context) = model_name(&http, &gateway_url).await?;
    // The trace has prompts longer than the model takes: cut to fit (the
    // gateway would refuse them, in both fleets alike).
    let prompts_cut = fit(&mut requests, context);
    if prompts_cut > 0 {
        println!("{prompts_cut} prompts cut to fit the model's context of {context} tokens with their output");
    }
    let measured = send(sending, &http, &completions, &model, &requests, &connector, &pool_names).await;
    let static_report = fleet_report("static", &targets, burst, measured);
    resize(&connector, &none).await?;
    until_drained(&connector, &registry).await?;

    // 2. The planner's fleet.
    let database_dir = tempfile::tempdir()?;
    let postgres = if args.postgres {
        let server = tokio::task::spawn_blocking(|| {
            let server = turbine_harness::PostgresServer::start();
            server.create_database("planner");
            server
        })
        .await?;
        println!("the planner's database: {}", server.url("planner"));
        Some(server)
    } else {
        None
    };
    let database = match &postgres {
        Some(server) => server.url("planner"),
        None => args.database.clone().unwrap_or_else(|| format!("sqlite:{}", database_dir.path().join("planner.sqlite").display())),
    };
    let ledger = Ledger::open(&database, &namespace).await?;
    ledger.set_targets(&targets, 0).await?;
    resize(&connector, &planner_start).await?;
    until_serving(&registry, planner_start.iter().sum(), &http, &gateway_url).await?;
    let metrics = format!("{gateway_url}/metrics");
    let mut restarts = Vec::new();
    let replay_done = CancellationToken::new();
    let database_restarts = restart_database(postgres, args.restart_database_at.clone(), outage, replay_done.clone());
    let measured = if args.kill_planner_at.is_empty() {
        let planner = PlannerState::with_connector(ledger.clone(), Connector::Local(connector.clone()));
        let cycle_stop = CancellationToken::new();
        let cycle = tokio::spawn(turbine_planner::cycle::run(
            planner,
            Observer::new(vec![metrics], registry.clone()),
            Sizing { profile, season_intervals: SEASON_INTERVALS },
            cycle_stop.clone(),
        ));
        let measured = send(sending, &http, &completions, &model, &requests, &connector, &pool_names).await;
        cycle_stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(60), cycle).await;
        measured
    } else {
        // The planner in a process of its own, adopting the workers above.
        let command = PlannerCommand::new(args, &settings, &database, &metrics, state_dir.path())?;
        let mut planner = command.start().await?;
        let kills = {
            let mut kills = args.kill_planner_at.clone();
            kills.sort_by(f64::total_cmp);
            kills
        };
        let started = Instant::now();
        let killer = tokio::spawn(async move {
            let mut restarts = Vec::new();
            for at in kills {
                tokio::time::sleep_until((started + Duration::from_secs_f64(at.max(0.0))).into()).await;
                planner.kill().await;
                restarts.push(started.elapsed().as_secs_f64());
                eprintln!("  planner killed (SIGKILL) at {:.1} s; starting it again", started.elapsed().as_secs_f64());
                planner = command.start().await?;
            }
            anyhow::Ok((planner, restarts))
        });
        let measured = send(sending, &http, &completions, &model, &requests, &connector, &pool_names).await;
        let (mut planner, killed_at) = killer.await??;
        restarts = killed_at;
        planner.kill().await;
        // This connector only knows the workers it started: take over the
        // planner's as a restarted planner would.
        connector = LocalConnector::open(settings.clone())?;
        measured
    };
    // Restarts planned past the replay's end are not made. The server is
    // kept running until the bench ends: the ledger reads it below.
    replay_done.cancel();
    let (_database_server, database_restarts_at_secs) = database_restarts.await??;
    let planner_report = fleet_report("planner", &targets, burst, measured);
    let planner_actions = action_counts(&ledger).await?;
    resize(&connector, &none).await?;
    until_drained(&connector, &registry).await?;

    shutdown.cancel();
    for task in stack {
        let _ = tokio::time::timeout(Duration::from_secs(30), task).await;
    }
    let ratio = if static_report.worker_seconds > 0.0 { planner_report.worker_seconds / static_report.worker_seconds } else { 0.0 };
    Ok(PlannerBenchReport {
        trace: args.trace.display().to_string(),
        speedup: args.speedup,
        ttft_ms: args.ttft_ms,
        itl_ms: args.itl_ms,
        percentile: args.percentile,
        interval_secs: targets.interval().as_secs_f64(),
        fleets: vec![static_report, planner_report],
        pools: targets.pools().iter().map(|limits| limits.pool.clone()).collect(),
        static_workers,
        planner_start_workers: planner_start,
        worker_seconds_ratio: ratio,
        prompts_cut,
        planner_restarts_at_secs: restarts,
        database_restarts_at_secs,
        database_outage_secs: args.database_outage_secs,
        planner_actions,
        closed_loop_clients: args.closed_loop,
        burst,
    })
}

/// Kills `server` at each of `at` (seconds from now) until `done`, keeps
/// it down for `outage`, and starts it again; ends with the server (still
/// running) and when each kill came.
fn restart_database(
    server: Option<turbine_harness::PostgresServer>,
    mut at: Vec<f64>,
    outage: Duration,
    done: CancellationToken,
) -> tokio::task::JoinHandle<anyhow::Result<(Option<turbine_harness::PostgresServer>, Vec<f64>)>> {
    at.sort_by(f64::total_cmp);
    let started = Instant::now();
    tokio::spawn(async move {
        let Some(mut server) = server else { return Ok((None, Vec::new())) };
        let mut killed = Vec::new();
        for at in at {
            // Too far off to be reached (infinite): the replay ends first.
            let Some(when) = Duration::try_from_secs_f64(at.max(0.0)).ok().and_then(|offset| started.checked_add(offset)) else { break };
            tokio::select! {
                () = tokio::time::sleep_until(when.into()) => {}
                () = done.cancelled() => break,
            }
            server.kill();
            killed.push(started.elapsed().as_secs_f64());
            eprintln!("  the planner's database killed (SIGKILL) at {:.1} s; down for {:.0} s", started.elapsed().as_secs_f64(), outage.as_secs_f64());
            tokio::time::sleep(outage).await;
            server = tokio::task::spawn_blocking(move || {
                server.restart();
                server
            })
            .await?;
            eprintln!("  the planner's database is back at {:.1} s", started.elapsed().as_secs_f64());
        }
        Ok((Some(server), killed))
    })
}

/// Intervals per season of the planner's seasonal predictor here.
const SEASON_INTERVALS: usize = 20;

/// The planner's actions by how they ended, from its database.
async fn action_counts(ledger: &Ledger) -> anyhow::Result<ActionCounts> {
    let mut counts = ActionCounts::default();
    let mut before = None;
    loop {
        let page = ledger.history(before, 500).await?;
        let Some(last) = page.last() else { break };
        before = Some(last.id);
        for action in page.iter().flat_map(|decision| &decision.pools).filter_map(|pool| pool.action.as_ref()) {
            match action.state {
                ActionState::Done => counts.done += 1,
                ActionState::Failed => counts.failed += 1,
                _ => counts.pending += 1,
            }
        }
    }
    Ok(counts)
}

/// `turbine planner serve` for this bench: the same database, targets,
/// registry, gateway, profile and worker folder as the planner inside it.
struct PlannerCommand {
    program: PathBuf,
    args: Vec<String>,
    addresses: PathBuf,
    log: PathBuf,
}

/// A planner process.
struct PlannerProcess {
    child: tokio::process::Child,
}

impl PlannerCommand {
    fn new(args: &PlannerBenchArgs, settings: &LocalSettings, database: &str, metrics: &str, folder: &std::path::Path) -> anyhow::Result<Self> {
        let mut planner_args: Vec<String> =
            ["planner", "serve", "--connector", "local", "--grpc-addr", "127.0.0.1:0", "--admin-addr", "127.0.0.1:0"].map(str::to_owned).to_vec();
        let addresses = folder.join("planner.addresses.json");
        for (flag, value) in [
            ("--database", database.to_owned()),
            ("--namespace", settings.namespace.clone()),
            ("--redis", settings.redis.clone()),
            ("--gateway-metrics", metrics.to_owned()),
            ("--profile", args.profile.display().to_string()),
            ("--season-intervals", SEASON_INTERVALS.to_string()),
            ("--local-state-dir", settings.state_dir.display().to_string()),
            ("--local-ready-timeout-secs", settings.ready_timeout.as_secs().to_string()),
            ("--local-drain-timeout-secs", settings.drain_timeout.as_secs().to_string()),
            ("--addresses-file", addresses.display().to_string()),
        ] {
            planner_args.push(flag.to_owned());
            planner_args.push(value);
        }
        planner_args.push(format!("--local-worker-args={}", settings.worker_args.join(" ")));
        // Without one, `turbine planner serve` starts `turbine worker`, as
        // the bench does.
        if settings.worker_subcommand.is_none() {
            planner_args.extend(["--local-worker-binary".to_owned(), settings.worker_binary.display().to_string()]);
        }
        Ok(Self { program: std::env::current_exe()?, args: planner_args, addresses, log: folder.join("planner.log") })
    }

    /// Starts the planner and waits until it serves (60 s at most).
    async fn start(&self) -> anyhow::Result<PlannerProcess> {
        let _ = std::fs::remove_file(&self.addresses);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let child = tokio::process::Command::new(&self.program)
            .args(&self.args)
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()?;
        let mut process = PlannerProcess { child };
        let deadline = Instant::now() + Duration::from_secs(60);
        let addresses = loop {
            if let Some(status) = process.child.try_wait()? {
                anyhow::bail!("the planner exited ({status}) before listening; its log: {}", self.log.display());
            }
            if let Some(addresses) =
                std::fs::read(&self.addresses).ok().and_then(|bytes| serde_json::from_slice::<turbine_runtime::host::BoundAddrs>(&bytes).ok())
            {
                break addresses;
            }
            anyhow::ensure!(Instant::now() < deadline, "the planner did not listen within 60 s; its log: {}", self.log.display());
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let endpoint = addresses.grpc_endpoint();
        let serving = turbine_runtime::health::until_serving(&endpoint, turbine_runtime::host::Role::Planner, turbine_proto::service_names::PLANNER);
        tokio::time::timeout_at(deadline.into(), serving)
            .await
            .map_err(|_| anyhow::anyhow!("the planner did not serve within 60 s; its log: {}", self.log.display()))?;
        Ok(process)
    }
}

impl PlannerProcess {
    /// SIGKILL, and wait for the exit.
    async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}

/// The profile's proposals (uncorrected) per pool for the trace's first
/// interval and for its busiest, each within --min-workers (at least 1)
/// and --max-workers.
fn profile_sizes(
    trace: &[turbine_planner::plan::backtest::TraceRequest],
    args: &PlannerBenchArgs,
    profile: &Profile,
    targets: &Targets,
) -> anyhow::Result<(Vec<u32>, Vec<u32>)> {
    // The load as replayed: compressed, outputs capped.
    let compressed: Vec<_> = trace
        .iter()
        .map(|request| turbine_planner::plan::backtest::TraceRequest {
            at_secs: request.at_secs / args.speedup,
            output_tokens: args.max_output_tokens.map_or(request.output_tokens, |cap| request.output_tokens.min(cap)),
            ..*request
        })
        .collect();
    let loads = turbine_planner::plan::backtest::intervals(&compressed, Duration::from_secs(u64::from(args.interval_secs)))?;
    let idle = Load { request_rate: 0.0, isl_mean: 0.0, osl_mean: 0.0 };
    let first = loads.first().copied().unwrap_or(idle);
    let peak = loads.iter().copied().max_by(|a, b| a.request_rate.total_cmp(&b.request_rate)).unwrap_or(idle);
    let size = |load: &Load| {
        propose(profile, targets, load, Corrections::default())
            .iter()
            .map(|proposal| proposal.replicas.clamp(args.min_workers.max(1), args.max_workers))
            .collect()
    };
    Ok((size(&first), size(&peak)))
}

/// A router (Redis registry and event log) and a gateway in this process;
/// the gateway's base URL and the tasks to await after `shutdown`.
async fn start_stack(redis: &str, namespace: &str, shutdown: CancellationToken) -> anyhow::Result<(String, Vec<tokio::task::JoinHandle<anyhow::Result<()>>>)> {
    let mut router_config = turbine_router::RouterConfig::default();
    router_config.cluster.redis = Some(redis.to_owned());
    router_config.cluster.namespace = namespace.to_owned();
    router_config.poll_interval_ms = 100;
    let deps = turbine_router::RouterDeps::from_config(&router_config)?;
    let router = turbine_router::start(router_config, deps, Listeners::loopback().await?, shutdown.clone()).await?;
    let router_client = turbine_api::router::RouterClient::new(router.local.clone());
    let gateway_listeners =
        Listeners { grpc: tokio::net::TcpListener::bind("127.0.0.1:0").await?, admin: None, http: Some(tokio::net::TcpListener::bind("127.0.0.1:0").await?) };
    let http = gateway_listeners.http.as_ref().expect("bound above").local_addr()?;
    let deps = turbine_gateway::GatewayDeps { router: router_client, workers: turbine_api::worker::WorkerClients::default(), own_key: None };
    let gateway = tokio::spawn(turbine_gateway::serve(turbine_gateway::GatewayConfig::default(), deps, gateway_listeners, shutdown));
    Ok((format!("http://{http}"), vec![tokio::spawn(router.finished()), gateway]))
}

/// Cuts each prompt of `requests` to fit a context of `context` tokens
/// with its output; how many were cut.
fn fit(requests: &mut [Request], context: u32) -> usize {
    let mut cut = 0;
    for request in requests {
        let room = context.saturating_sub(request.max_tokens).max(1) as usize;
        if request.prompt.len() > room {
            request.prompt.truncate(room);
            cut += 1;
        }
    }
    cut
}

/// The model the gateway lists (once a worker has joined) and its context
/// length in tokens.
async fn model_name(http: &reqwest::Client, gateway: &str) -> anyhow::Result<(String, u32)> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let listed: serde_json::Value = http.get(format!("{gateway}/v1/models")).send().await?.json().await?;
        if let Some(id) = listed["data"][0]["id"].as_str() {
            let context = listed["data"][0]["context_length"].as_u64().and_then(|tokens| u32::try_from(tokens).ok()).unwrap_or(u32::MAX);
            return Ok((id.to_owned(), context));
        }
        anyhow::ensure!(Instant::now() < deadline, "the gateway listed no model within 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `workers` workers are registered and a request goes
/// through the gateway (the router has seen them).
async fn until_serving(registry: &Registry, workers: u32, http: &reqwest::Client, gateway: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while registry.list().await?.len() != workers as usize {
        anyhow::ensure!(Instant::now() < deadline, "{workers} workers did not register within 60 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (model, _) = model_name(http, gateway).await?;
    let probe = serde_json::json!({"model": model, "prompt": [100, 101, 102], "max_tokens": 1});
    while !http.post(format!("{gateway}/v1/completions")).json(&probe).send().await?.status().is_success() {
        anyhow::ensure!(Instant::now() < deadline, "the gateway did not serve within 60 s of the workers registering");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

async fn until_drained(connector: &LocalConnector, registry: &Registry) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(300);
    while connector.draining() > 0 || !registry.list().await?.is_empty() {
        anyhow::ensure!(Instant::now() < deadline, "the fleet did not drain within 300 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Sends `requests` at their arrival times; each request's measurement,
/// and the fleet's size sampled over the replay.
/// Sends the requests as `sending` says, sampling the fleet's size
/// meanwhile.
async fn send(
    sending: Sending,
    http: &reqwest::Client,
    url: &str,
    model: &str,
    requests: &[Request],
    connector: &LocalConnector,
    pools: &[String],
) -> (Vec<Measured>, Samples, Duration) {
    let started = Instant::now();
    let samples = Arc::new(Mutex::new(Vec::new()));
    let sampling = CancellationToken::new();
    let sampler = tokio::spawn({
        let (samples, sampling, connector, pools) = (samples.clone(), sampling.clone(), connector.clone(), pools.to_vec());
        async move {
            while !sampling.is_cancelled() {
                // Every worker process of the fleet, whoever started it.
                let running = connector.running_by_pool();
                let workers: Vec<u32> = pools.iter().map(|pool| running.get(pool).copied().unwrap_or(0)).collect();
                samples.lock().expect("samples").push((started.elapsed(), workers));
                tokio::time::sleep(SAMPLE).await;
            }
        }
    });
    let measured = match sending {
        Sending::Trace => replay(started, http, url, model, requests).await,
        Sending::ClosedLoop { clients, duration, idle } => {
            let measured = closed_loop(started, clients, duration, http, url, model, requests).await;
            tokio::time::sleep_until((started + duration + idle).into()).await;
            measured
        }
    };
    let wall = started.elapsed();
    sampling.cancel();
    let _ = sampler.await;
    let samples = std::mem::take(&mut *samples.lock().expect("samples"));
    (measured, samples, wall)
}

/// One streamed request sent `at` into the run: its TTFT and ITL (ms), or
/// `None` when it failed (said on stderr).
async fn measure(http: &reqwest::Client, url: &str, model: &str, request: &Request, at: Duration) -> Measured {
    let body = serde_json::json!({
        "model": model,
        "prompt": request.prompt,
        "max_tokens": request.max_tokens,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let outcome = stream_completion(http, url, &body).await;
    if let Err(error) = &outcome {
        eprintln!("  request at {:.2} s failed: {error:#}", at.as_secs_f64());
    }
    let measured = outcome.ok().map(|outcome| {
        let ttft = outcome.ttft.as_secs_f64() * 1e3;
        let itl = (outcome.text_events > 1).then(|| (outcome.end_to_end - outcome.ttft).as_secs_f64() * 1e3 / (outcome.text_events - 1) as f64);
        (ttft, itl)
    });
    (at, measured)
}

/// Each request at its time in the trace.
async fn replay(started: Instant, http: &reqwest::Client, url: &str, model: &str, requests: &[Request]) -> Vec<Measured> {
    let mut tasks = Vec::with_capacity(requests.len());
    for request in requests {
        tokio::time::sleep_until((started + request.at).into()).await;
        let (http, url, model, request) = (http.clone(), url.to_owned(), model.to_owned(), request.clone());
        tasks.push(tokio::spawn(async move { measure(&http, &url, &model, &request, request.at).await }));
    }
    let mut measured = Vec::with_capacity(tasks.len());
    for task in tasks {
        measured.push(task.await.unwrap_or((Duration::ZERO, None)));
    }
    measured
}

/// `clients` clients sending back to back until `duration` has passed,
/// taking the trace's requests in turn (from the start again at its end);
/// a request counts at the moment it was sent.
async fn closed_loop(
    started: Instant,
    clients: u32,
    duration: Duration,
    http: &reqwest::Client,
    url: &str,
    model: &str,
    requests: &[Request],
) -> Vec<Measured> {
    let requests: Arc<Vec<Request>> = Arc::new(requests.to_vec());
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (http, url, model, requests, next) = (http.clone(), url.to_owned(), model.to_owned(), requests.clone(), next.clone());
            tokio::spawn(async move {
                let mut measured = Vec::new();
                while started.elapsed() < duration {
                    let index = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % requests.len();
                    measured.push(measure(&http, &url, &model, &requests[index], started.elapsed()).await);
                }
                measured
            })
        })
        .collect();
    let mut measured = Vec::new();
    for task in tasks {
        measured.extend(task.await.unwrap_or_default());
    }
    measured.sort_by_key(|(at, _)| *at);
    measured
}

/// The value at `percentile` (0-100) of `values`, nearest rank.
fn percentile_of(values: &mut [f64], percentile: f64) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    let rank = ((percentile / 100.0) * values.len() as f64).ceil().max(1.0) as usize;
    Some(values[rank.min(values.len()) - 1])
}

fn fleet_report(fleet: &str, targets: &Targets, burst: Option<Burst>, (measured, samples, wall): (Vec<Measured>, Samples, Duration)) -> FleetReport {
    let interval = targets.interval().as_secs_f64();
    let count = measured.iter().map(|(at, _)| (at.as_secs_f64() / interval) as usize + 1).max().unwrap_or(0);
    let total = |workers: &[u32]| workers.iter().sum::<u32>();
    let pools_at = |secs: f64| samples.iter().take_while(|(at, _)| at.as_secs_f64() <= secs).last().map(|(_, workers)| workers.clone()).unwrap_or_default();
    let mut timeline = Vec::with_capacity(count);
    for index in 0..count {
        let in_interval: Vec<&Measured> = measured.iter().filter(|(at, _)| (at.as_secs_f64() / interval) as usize == index).collect();
        let mut ttfts: Vec<f64> = in_interval.iter().filter_map(|(_, result)| result.map(|(ttft, _)| ttft)).collect();
        let mut itls: Vec<f64> = in_interval.iter().filter_map(|(_, result)| result.and_then(|(_, itl)| itl)).collect();
        let failed = in_interval.iter().any(|(_, result)| result.is_none());
        let (ttft_ms, itl_ms) = (percentile_of(&mut ttfts, targets.percentile()), percentile_of(&mut itls, targets.percentile()));
        let met = !failed && ttft_ms.is_none_or(|ttft| ttft <= targets.ttft_ms()) && itl_ms.is_none_or(|itl| itl <= targets.itl_ms());
        let start_secs = index as f64 * interval;
        let pool_workers = pools_at(start_secs + interval);
        timeline.push(IntervalReport { start_secs, requests: in_interval.len(), ttft_ms, itl_ms, met, workers: total(&pool_workers), pool_workers });
    }
    let busy: Vec<&IntervalReport> = timeline.iter().filter(|interval| interval.requests > 0).collect();
    let intervals_met = busy.iter().filter(|interval| interval.met).count();
    let worker_seconds = samples.windows(2).map(|pair| f64::from(total(&pair[0].1)) * (pair[1].0 - pair[0].0).as_secs_f64()).sum::<f64>();
    let ok: Vec<(f64, Option<f64>)> = measured.iter().filter_map(|(_, result)| *result).collect();
    let peak_workers = samples.iter().map(|(_, workers)| total(workers)).max().unwrap_or(0);
    let last_sent = measured.iter().map(|(at, _)| *at).max().unwrap_or_default();
    let after: Vec<&(Duration, Vec<u32>)> = samples.iter().filter(|(at, _)| *at >= last_sent).collect();
    let after_load = after
        .iter()
        .map(|(_, workers)| total(workers))
        .min()
        .and_then(|fewest| after.iter().find(|(_, workers)| total(workers) == fewest).map(|(at, _)| (fewest, (*at - last_sent).as_secs_f64())));
    FleetReport {
        fleet: fleet.to_owned(),
        requests: measured.len(),
        failed: measured.iter().filter(|(_, result)| result.is_none()).count(),
        intervals: busy.len(),
        intervals_met,
        sla_attainment: if busy.is_empty() { 0.0 } else { intervals_met as f64 / busy.len() as f64 },
        worker_seconds,
        peak_workers,
        first_missed_secs: busy.iter().find(|interval| !interval.met).map(|interval| interval.start_secs),
        peak_at_secs: samples.iter().find(|(_, workers)| total(workers) == peak_workers).map(|(at, _)| at.as_secs_f64()),
        after_load,
        burst: burst.map(|burst| burst_report(burst, &timeline, &samples)),
        ttft: summarize(ok.iter().map(|(ttft, _)| *ttft).collect()),
        itl: summarize(ok.iter().filter_map(|(_, itl)| *itl).collect()),
        wall_secs: wall.as_secs_f64(),
        timeline,
    }
}

/// How a fleet took `burst`, from its intervals and its size sampled.
fn burst_report(burst: Burst, timeline: &[IntervalReport], samples: &Samples) -> BurstReport {
    let (start, end) = (burst.at_secs, burst.at_secs + burst.secs);
    let total = |workers: &[u32]| workers.iter().sum::<u32>();
    let workers_at_start = samples.iter().take_while(|(at, _)| at.as_secs_f64() <= start).last().map_or(0, |(_, workers)| total(workers));
    let grown_after_secs =
        samples.iter().find(|(at, workers)| at.as_secs_f64() >= start && total(workers) > workers_at_start).map(|(at, _)| at.as_secs_f64() - start);
    let during: Vec<&IntervalReport> = timeline.iter().filter(|interval| interval.requests > 0 && (start..end).contains(&interval.start_secs)).collect();
    let grown_at = grown_after_secs.map_or(f64::INFINITY, |secs| start + secs);
    BurstReport {
        intervals: during.len(),
        intervals_met: during.iter().filter(|interval| interval.met).count(),
        workers_at_start,
        grown_after_secs,
        missed_before_grown: during.iter().filter(|interval| !interval.met && interval.start_secs < grown_at).count(),
        peak_workers: samples.iter().filter(|(at, _)| (start..=end).contains(&at.as_secs_f64())).map(|(_, workers)| total(workers)).max().unwrap_or(0),
    }
}

/// Prints the report as a table.
pub fn print(report: &PlannerBenchReport) {
    println!(
        "{} at {}x; targets: TTFT p{:.0} <= {:.0} ms, ITL p{:.0} <= {:.1} ms",
        report.trace, report.speedup, report.percentile, report.ttft_ms, report.percentile, report.itl_ms
    );
    println!(
        "{:<8} {:>8} {:>6} {:>17} {:>14} {:>6} {:>10} {:>10}",
        "fleet", "requests", "failed", "SLA intervals", "worker-seconds", "peak", "TTFT p90", "ITL p90"
    );
    for fleet in &report.fleets {
        println!(
            // One decimal: 56 of 59 intervals is 94.9%, not the 95% a
            // whole percent would print.
            "{:<8} {:>8} {:>6} {:>7}/{:<3} {:>5.1}% {:>14.1} {:>6} {:>10.1} {:>10.2}",
            fleet.fleet,
            fleet.requests,
            fleet.failed,
            fleet.intervals_met,
            fleet.intervals,
            fleet.sla_attainment * 100.0,
            fleet.worker_seconds,
            fleet.peak_workers,
            fleet.ttft.p90_ms,
            fleet.itl.p90_ms
        );
    }
    for fleet in &report.fleets {
        let secs = |at: Option<f64>| at.map_or_else(|| "-".to_owned(), |at| format!("{at:.1} s"));
        let after = fleet.after_load.map_or_else(|| "-".to_owned(), |(workers, secs)| format!("{workers} workers {secs:.1} s after the last request"));
        println!(
            "{:<8} first interval missed at {}, peak of {} workers reached at {}; after the load: {after}",
            fleet.fleet,
            secs(fleet.first_missed_secs),
            fleet.peak_workers,
            secs(fleet.peak_at_secs)
        );
    }
    if let Some(burst) = report.burst {
        for fleet in &report.fleets {
            let Some(taken) = &fleet.burst else { continue };
            let grown = taken.grown_after_secs.map_or_else(
                || "the fleet did not grow".to_owned(),
                |secs| format!("a worker more serving {secs:.1} s in, {} intervals missed before it", taken.missed_before_grown),
            );
            println!(
                "{:<8} burst of x{} from {:.1} s for {:.1} s: {}/{} intervals met; workers: {} at its start, {} at most; {grown}",
                fleet.fleet, burst.factor, burst.at_secs, burst.secs, taken.intervals_met, taken.intervals, taken.workers_at_start, taken.peak_workers
            );
        }
    }
    println!("planner worker-seconds / static: {:.3}", report.worker_seconds_ratio);
    let actions = &report.planner_actions;
    println!("planner actions: {} done, {} failed, {} pending", actions.done, actions.failed, actions.pending);
    if !report.planner_restarts_at_secs.is_empty() {
        let at: Vec<String> = report.planner_restarts_at_secs.iter().map(|secs| format!("{secs:.1} s")).collect();
        println!("planner killed (SIGKILL) and started again at {}", at.join(", "));
    }
    if !report.database_restarts_at_secs.is_empty() {
        let at: Vec<String> = report.database_restarts_at_secs.iter().map(|secs| format!("{secs:.1} s")).collect();
        println!("the planner's database killed (SIGKILL) at {}, each down for {:.0} s", at.join(", "), report.database_outage_secs);
    }
}

#[cfg(test)]
mod tests {
    use super::Burst;
    use turbine_planner::plan::backtest::TraceRequest;

    #[test]
    fn a_burst_multiplies_the_requests_within_it_and_leaves_the_rest() {
        // A request a second of trace time, replayed at 2x: one every 0.5 s of the run.
        let trace: Vec<TraceRequest> =
            (0..10).map(|second| TraceRequest { at_secs: 100.0 + f64::from(second), input_tokens: second, output_tokens: 7 }).collect();
        let burst = Burst::parse(&[1.0, 1.0, 4.0]).unwrap().unwrap();
        let out = burst.apply(&trace, 2.0);
        // The requests at 1.0 and 1.5 s of the run, four times each.
        assert_eq!(out.len(), 10 + 2 * 3);
        let run_secs: Vec<f64> = out.iter().map(|request| (request.at_secs - 100.0) / 2.0).collect();
        assert!(run_secs.windows(2).all(|pair| pair[0] <= pair[1]), "in order: {run_secs:?}");
        let within: Vec<f64> = run_secs.iter().copied().filter(|at| (1.0..2.0).contains(at)).collect();
        assert_eq!(within, [1.0, 1.125, 1.25, 1.375, 1.5, 1.625, 1.75, 1.875]);
        assert!(out.iter().filter(|request| request.input_tokens == 2).count() == 4, "copies keep their request's lengths");
        for bad in [&[1.0, 1.0][..], &[1.0, 0.0, 4.0], &[1.0, 1.0, 1.0], &[1.0, 1.0, 2.5], &[-1.0, 1.0, 2.0]] {
            assert!(Burst::parse(bad).is_err(), "{bad:?}");
        }
        assert!(Burst::parse(&[]).unwrap().is_none());
    }
}

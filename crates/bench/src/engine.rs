//! `turbine bench engine`: the native engine's speed, side by side with
//! llama.cpp (through llama-cpp-python) on the same GGUF, the same prompt
//! and the same thread count, in one run.
//!
//! Measured through the real engine (scheduler, paged cache, sampling), in
//! `rounds` rounds that alternate with llama.cpp so both see the same
//! machine conditions (this machine is shared and noisy); the report gives
//! the median of each number and of each round's ratio:
//! - prompt processing: a fresh `prompt_tokens` prompt; tokens per second
//!   of the time to first token;
//! - single-stream decode after that prompt (the same context llama.cpp
//!   decodes at): tokens per second after the first token;
//! - aggregate decode of `streams` concurrent streams (64-token prompts)
//!   against one such stream alone;
//! - time to first token of a repeated 1,000-token prompt (prefix-cache
//!   hit) against the same prompt cold.
//!
//! llama.cpp runs `scripts/llama_cpp_bench.py` on the same token ids.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Serialize;
use turbine_engine::{EngineHandle, EngineOutput, GenerateRequest, SchedulerConfig, StopConditions};
use turbine_native::{NativeExecutor, NativeOptions};
use turbine_tokens::pull::{Progress, default_cache_dir, resolve_model};
use turbine_tokens::{ModelCard, Preprocessor};

/// Flags of `turbine bench engine`.
#[derive(Debug, Clone, clap::Args)]
pub struct EngineBenchArgs {
    /// Model: catalog name or GGUF path.
    #[arg(long, default_value = turbine_tokens::pull::DEFAULT_MODEL)]
    pub model: String,
    /// Threads for both engines.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Prompt length for prompt processing.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens decoded per stream.
    #[arg(long, default_value_t = 128)]
    pub decode_tokens: u32,
    /// Concurrent streams for aggregate decode.
    #[arg(long, default_value_t = 16)]
    pub streams: usize,
    /// Also run llama.cpp (needs `python3 -c 'import llama_cpp'`).
    #[arg(long)]
    pub llama_cpp: bool,
    /// Measurement rounds (medians are reported).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Write the results as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Numbers of one engine.
#[derive(Debug, Clone, Serialize)]
pub struct EngineNumbers {
    /// Prompt tokens per second.
    pub prefill_tokens_per_s: f64,
    /// Single-stream decode tokens per second.
    pub decode_tokens_per_s: f64,
}

/// One round's measurements.
#[derive(Debug, Clone, Serialize)]
pub struct Round {
    /// Turbine's native engine.
    pub turbine: EngineNumbers,
    /// llama.cpp, when run.
    pub llama_cpp: Option<EngineNumbers>,
    /// One 64-token-prompt stream alone, decode tokens per second.
    pub single_stream_decode_tokens_per_s: f64,
    /// `streams` such streams at once, total decode tokens per second.
    pub aggregate_decode_tokens_per_s: f64,
    /// Cold 1,000-token prompt, time to first token (ms).
    pub cold_ttft_ms: f64,
    /// The same prompt again (prefix-cache hit), time to first token (ms).
    pub warm_ttft_ms: f64,
}

/// Everything `turbine bench engine` measures.
#[derive(Debug, Clone, Serialize)]
pub struct EngineBenchReport {
    /// Threads of both engines.
    pub threads: usize,
    /// Prompt length for prompt processing.
    pub prompt_tokens: usize,
    /// Tokens decoded per stream.
    pub decode_tokens: u32,
    /// Concurrent streams of the aggregate.
    pub streams: usize,
    /// Every round.
    pub rounds: Vec<Round>,
    /// Medians over rounds.
    pub median: Medians,
}

/// Medians over rounds (ratios are medians of per-round ratios).
#[derive(Debug, Clone, Serialize)]
pub struct Medians {
    /// Turbine prompt tokens per second.
    pub turbine_prefill_tokens_per_s: f64,
    /// Turbine decode tokens per second.
    pub turbine_decode_tokens_per_s: f64,
    /// llama.cpp prompt tokens per second.
    pub llama_cpp_prefill_tokens_per_s: Option<f64>,
    /// llama.cpp decode tokens per second.
    pub llama_cpp_decode_tokens_per_s: Option<f64>,
    /// Turbine / llama.cpp prompt processing.
    pub prefill_ratio: Option<f64>,
    /// Turbine / llama.cpp decode.
    pub decode_ratio: Option<f64>,
    /// Aggregate over single-stream decode.
    pub aggregate_over_single: f64,
    /// Prefix-hit TTFT over cold TTFT.
    pub warm_over_cold_ttft: f64,
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

struct Timing {
    first_token: Duration,
    total: Duration,
    tokens: usize,
}

fn request(prompt: &[u32], max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: String::new(),
        prompt: prompt.to_vec(),
        sampling: Default::default(),
        stop: StopConditions { max_tokens, stop_token_ids: vec![], ignore_eos: true },
        cache_salt: Default::default(),
        kv_tenant: Default::default(),
    }
}

/// Runs requests concurrently (one reader thread per stream, so arrival
/// times are real); returns each one's timing.
fn run(engine: &EngineHandle, requests: Vec<GenerateRequest>) -> anyhow::Result<Vec<Timing>> {
    let started = Instant::now();
    let streams = requests.into_iter().map(|r| engine.generate(r)).collect::<Result<Vec<_>, _>>()?;
    let readers: Vec<_> = streams
        .into_iter()
        .map(|mut stream| {
            std::thread::spawn(move || -> anyhow::Result<Timing> {
                let mut first = None;
                let mut tokens = 0;
                loop {
                    match stream.blocking_recv() {
                        Some(EngineOutput::Token(..)) => {
                            tokens += 1;
                            first.get_or_insert_with(|| started.elapsed());
                        }
                        Some(EngineOutput::Finished { .. }) => break,
                        Some(EngineOutput::Failed(error)) => {
                            anyhow::bail!("engine failed: {error}")
                        }
                        Some(EngineOutput::Pinned(_)) => {}
                        None => anyhow::bail!("engine stream ended early"),
                    }
                }
                Ok(Timing { first_token: first.unwrap_or_default(), total: started.elapsed(), tokens })
            })
        })
        .collect();
    readers.into_iter().map(|reader| reader.join().map_err(|_| anyhow::anyhow!("reader panicked"))?).collect()
}

fn llama_cpp(model: &Path, threads: usize, prompt: &[u32], decode_tokens: u32) -> anyhow::Result<EngineNumbers> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/llama_cpp_bench.py");
    let ids: Vec<String> = prompt.iter().map(u32::to_string).collect();
    let output = Command::new("python3")
        .arg(&script)
        .arg("--model")
        .arg(model)
        .args(["--threads", &threads.to_string(), "--decode-tokens", &decode_tokens.to_string(), "--prompt-ids", &ids.join(",")])
        .output()
        .context("running python3 scripts/llama_cpp_bench.py")?;
    anyhow::ensure!(output.status.success(), "llama.cpp benchmark failed: {}", String::from_utf8_lossy(&output.stderr));
    let json: serde_json::Value = serde_json::from_slice(output.stdout.rsplit(|&b| b == b'\n').find(|l| !l.is_empty()).unwrap_or(&[]))?;
    Ok(EngineNumbers {
        prefill_tokens_per_s: json["prefill_tokens_per_s"].as_f64().context("prefill")?,
        decode_tokens_per_s: json["decode_tokens_per_s"].as_f64().context("decode")?,
    })
}

/// Runs the benchmark.
pub fn run_bench(args: &EngineBenchArgs) -> anyhow::Result<EngineBenchReport> {
    anyhow::ensure!(args.rounds >= 1 && args.decode_tokens >= 2, "need at least one round and two decoded tokens");
    let model = resolve_model(&args.model, None, &default_cache_dir(), Progress::Bars)?;
    let preprocessor = Preprocessor::new(ModelCard::from_gguf_path(&model.name, &model.path, 16)?)?;
    let passage = "The quick brown fox jumps over the lazy dog while the engineers measure everything twice. ";
    let corpus = preprocessor.encode_text(&passage.repeat(1200))?;
    // Every measurement uses a slice of the corpus no other used, so nothing
    // comes from the prefix cache unless meant to.
    let mut cursor = 0usize;
    let mut fresh = |len: usize| -> anyhow::Result<&[u32]> {
        let start = cursor + 1;
        cursor = start + len;
        corpus.get(start..start + len).context("benchmark text exhausted")
    };

    let options = NativeOptions { threads: args.threads, kv_cache_mib: 1024, ..NativeOptions::default() };
    let executor = NativeExecutor::load(&model.path, &options)?;
    let scheduler = SchedulerConfig {
        block_size: options.block_size,
        num_blocks: executor.num_blocks(),
        max_batched_tokens: 2048,
        max_model_len: 8192,
        ..SchedulerConfig::default()
    };
    let engine = EngineHandle::spawn(scheduler, vec![], Box::new(executor));
    eprintln!("warming up...");
    run(&engine, vec![request(fresh(64)?, 8)])?;

    let mut rounds = Vec::with_capacity(args.rounds);
    for round in 1..=args.rounds {
        eprintln!("round {round}/{}: prompt {} tokens then {} decoded...", args.rounds, args.prompt_tokens, args.decode_tokens);
        let prompt = fresh(args.prompt_tokens)?.to_vec();
        let timing = run(&engine, vec![request(&prompt, args.decode_tokens)])?.remove(0);
        let turbine = EngineNumbers {
            prefill_tokens_per_s: args.prompt_tokens as f64 / timing.first_token.as_secs_f64(),
            decode_tokens_per_s: (timing.tokens - 1) as f64 / (timing.total - timing.first_token).as_secs_f64(),
        };
        let llama = if args.llama_cpp {
            eprintln!("round {round}: llama.cpp on the same prompt and threads...");
            Some(llama_cpp(&model.path, args.threads, &prompt, args.decode_tokens)?)
        } else {
            None
        };
        eprintln!("round {round}: one stream, then {} streams...", args.streams);
        let single = run(&engine, vec![request(fresh(64)?, args.decode_tokens)])?.remove(0);
        let single_decode = (single.tokens - 1) as f64 / (single.total - single.first_token).as_secs_f64();
        let requests = (0..args.streams).map(|_| fresh(64).map(|p| request(p, args.decode_tokens))).collect::<anyhow::Result<Vec<_>>>()?;
        let timings = run(&engine, requests)?;
        // Decode phase: from the last stream's first token to the last token.
        let last_first_token = timings.iter().map(|t| t.first_token).max().unwrap_or_default();
        let end = timings.iter().map(|t| t.total).max().unwrap_or_default();
        let decoded: usize = timings.iter().map(|t| t.tokens - 1).sum();
        let aggregate = decoded as f64 / (end - last_first_token).as_secs_f64();
        eprintln!("round {round}: 1,000-token prompt cold, then again...");
        let long = fresh(1000)?.to_vec();
        let cold = run(&engine, vec![request(&long, 1)])?.remove(0).first_token;
        let warm = run(&engine, vec![request(&long, 1)])?.remove(0).first_token;
        rounds.push(Round {
            turbine,
            llama_cpp: llama,
            single_stream_decode_tokens_per_s: single_decode,
            aggregate_decode_tokens_per_s: aggregate,
            cold_ttft_ms: cold.as_secs_f64() * 1e3,
            warm_ttft_ms: warm.as_secs_f64() * 1e3,
        });
    }
    engine.shutdown();

    let of = |f: &dyn Fn(&Round) -> f64| median(rounds.iter().map(f).collect());
    let of_llama = |f: &dyn Fn(&Round, &EngineNumbers) -> f64| {
        args.llama_cpp.then(|| median(rounds.iter().map(|r| f(r, r.llama_cpp.as_ref().expect("llama.cpp ran"))).collect()))
    };
    let median = Medians {
        turbine_prefill_tokens_per_s: of(&|r| r.turbine.prefill_tokens_per_s),
        turbine_decode_tokens_per_s: of(&|r| r.turbine.decode_tokens_per_s),
        llama_cpp_prefill_tokens_per_s: of_llama(&|_, l| l.prefill_tokens_per_s),
        llama_cpp_decode_tokens_per_s: of_llama(&|_, l| l.decode_tokens_per_s),
        prefill_ratio: of_llama(&|r, l| r.turbine.prefill_tokens_per_s / l.prefill_tokens_per_s),
        decode_ratio: of_llama(&|r, l| r.turbine.decode_tokens_per_s / l.decode_tokens_per_s),
        aggregate_over_single: of(&|r| r.aggregate_decode_tokens_per_s / r.single_stream_decode_tokens_per_s),
        warm_over_cold_ttft: of(&|r| r.warm_ttft_ms / r.cold_ttft_ms),
    };
    Ok(EngineBenchReport { threads: args.threads, prompt_tokens: args.prompt_tokens, decode_tokens: args.decode_tokens, streams: args.streams, rounds, median })
}

/// Prints the report with ratios.
pub fn print(report: &EngineBenchReport) {
    println!(
        "{} threads, {}-token prompt then {} decoded tokens; medians of {} rounds",
        report.threads,
        report.prompt_tokens,
        report.decode_tokens,
        report.rounds.len()
    );
    let m = &report.median;
    println!("{:<34} {:>14} {:>14}", "", "prefill tok/s", "decode tok/s");
    println!("{:<34} {:>14.1} {:>14.1}", "turbine native", m.turbine_prefill_tokens_per_s, m.turbine_decode_tokens_per_s);
    if let (Some(prefill), Some(decode), Some(prefill_ratio), Some(decode_ratio)) =
        (m.llama_cpp_prefill_tokens_per_s, m.llama_cpp_decode_tokens_per_s, m.prefill_ratio, m.decode_ratio)
    {
        println!("{:<34} {:>14.1} {:>14.1}", "llama.cpp", prefill, decode);
        println!("{:<34} {:>14.2} {:>14.2}", "ratio (turbine / llama.cpp)", prefill_ratio, decode_ratio);
    }
    for (i, round) in report.rounds.iter().enumerate() {
        println!(
            "round {}: aggregate {} streams {:.1} tok/s vs one stream {:.1} tok/s ({:.2}x); TTFT cold {:.1} ms, prefix hit {:.1} ms",
            i + 1,
            report.streams,
            round.aggregate_decode_tokens_per_s,
            round.single_stream_decode_tokens_per_s,
            round.aggregate_decode_tokens_per_s / round.single_stream_decode_tokens_per_s,
            round.cold_ttft_ms,
            round.warm_ttft_ms
        );
    }
    println!("aggregate / single stream (median): {:.2}x", m.aggregate_over_single);
    println!("prefix-hit TTFT / cold TTFT (median): {:.1}%", 100.0 * m.warm_over_cold_ttft);
}

//! Sending a trace to gateways at its arrival times, and what came back.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use super::ReplayArgs;
use super::report::{PolicyReport, Shortfall, Window, summarize};
use super::trace::TraceRequest;

/// What came back for one streamed completion.
#[derive(Debug)]
pub(crate) struct Outcome {
    pub(crate) ttft: Duration,
    pub(crate) end_to_end: Duration,
    pub(crate) text_events: usize,
    pub(crate) completion_tokens: u64,
    pub(crate) prompt_tokens: u64,
    pub(crate) cached_tokens: u64,
}

/// Sends the trace to the gateways at `urls` (in turn) at its arrival times
/// and summarizes what came back.
pub(super) async fn drive(
    args: &ReplayArgs,
    urls: &[String],
    model: &str,
    requests: &[TraceRequest],
    prompts: &Arc<Vec<Arc<Vec<u32>>>>,
    oracle: &[usize],
    oracle_rate: f64,
) -> anyhow::Result<PolicyReport> {
    let http = reqwest::Client::builder().pool_max_idle_per_host(1024).build()?;
    let arrival = |request: &TraceRequest| request.timestamp.saturating_sub(requests[0].timestamp) as f64 / 1000.0 / args.speedup;
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(requests.len());
    for (index, request) in requests.iter().enumerate() {
        tokio::time::sleep_until((started + Duration::from_secs_f64(arrival(request))).into()).await;
        let max_tokens = args.max_output_tokens.map_or(request.output_length, |cap| request.output_length.min(cap)).max(1);
        let body = serde_json::json!({
            "model": model,
            "prompt": &*prompts[index],
            "max_tokens": max_tokens,
            "ignore_eos": true,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        // Gateways in turn, as a load balancer in front of them would.
        let (http, url) = (http.clone(), urls[index % urls.len()].clone());
        tasks.push(tokio::spawn(async move { stream_completion(&http, &url, &body).await }));
    }
    let mut results = Vec::with_capacity(tasks.len());
    let mut failed = 0;
    for task in tasks {
        let result = task.await?;
        if let Err(error) = &result {
            failed += 1;
            if failed <= 5 {
                eprintln!("  request failed: {error:#}");
            }
        }
        results.push(result);
    }
    let wall = started.elapsed();
    let timeline = if args.window_secs > 0.0 { timeline(args.window_secs, requests.iter().map(arrival).collect(), &results, oracle) } else { Vec::new() };
    let outcomes: Vec<&Outcome> = results.iter().filter_map(|r| r.as_ref().ok()).collect();

    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let ttft = summarize(outcomes.iter().map(|o| ms(o.ttft)).collect());
    let itl = summarize(outcomes.iter().filter(|o| o.text_events > 1).map(|o| ms(o.end_to_end - o.ttft) / (o.text_events - 1) as f64).collect());
    let end_to_end = summarize(outcomes.iter().map(|o| ms(o.end_to_end)).collect());
    let completion: u64 = outcomes.iter().map(|o| o.completion_tokens).sum();
    let prompt: u64 = outcomes.iter().map(|o| o.prompt_tokens).sum();
    let cached: u64 = outcomes.iter().map(|o| o.cached_tokens).sum();
    let prefix_hit_rate = if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 };
    let mut shortfall = Shortfall::default();
    for (outcome, &oracle) in results.iter().zip(oracle) {
        if let Ok(outcome) = outcome {
            shortfall.add(outcome.cached_tokens, oracle as u64);
        }
    }
    Ok(PolicyReport {
        router: String::new(),
        routers: urls.len(),
        workers: 0,
        prefill_workers: 0,
        decode_workers: 0,
        host_cache_mib: 0,
        disk_cache_gib: 0.0,
        kv_fetch: None,
        kv_store: false,
        computed_prompt_tokens: prompt.saturating_sub(cached),
        requests: requests.len(),
        failed,
        ttft,
        itl,
        end_to_end,
        output_tokens_per_sec: completion as f64 / wall.as_secs_f64(),
        prefix_hit_rate,
        oracle_hit_rate: oracle_rate,
        share_of_oracle: if oracle_rate > 0.0 { prefix_hit_rate / oracle_rate } else { 0.0 },
        wall_secs: wall.as_secs_f64(),
        timeline,
        shortfall,
        tier_counters: Default::default(),
    })
}

/// Hit rates per window of `window` seconds of arrival time.
fn timeline(window: f64, arrivals: Vec<f64>, results: &[anyhow::Result<Outcome>], oracle: &[usize]) -> Vec<Window> {
    let count = arrivals.iter().map(|&a| (a / window) as usize + 1).max().unwrap_or(0);
    let mut windows: Vec<(Window, u64, u64, u64, u64)> =
        (0..count).map(|i| (Window { start_secs: i as f64 * window, requests: 0, failed: 0, hit_rate: 0.0, oracle_share: None }, 0, 0, 0, 0)).collect();
    for ((arrival, result), &oracle) in arrivals.iter().zip(results).zip(oracle) {
        let (window, prompt, cached, captured, available) = &mut windows[(arrival / window) as usize];
        window.requests += 1;
        match result {
            Ok(outcome) => {
                *prompt += outcome.prompt_tokens;
                *cached += outcome.cached_tokens;
                *captured += outcome.cached_tokens.min(oracle as u64);
                *available += oracle as u64;
            }
            Err(_) => window.failed += 1,
        }
    }
    windows
        .into_iter()
        .map(|(mut window, prompt, cached, captured, available)| {
            window.hit_rate = if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 };
            window.oracle_share = (available > 0).then(|| captured as f64 / available as f64);
            window
        })
        .collect()
}

/// One streamed completion: first text, end, text events and usage.
pub(crate) async fn stream_completion(http: &reqwest::Client, url: &str, body: &serde_json::Value) -> anyhow::Result<Outcome> {
    let started = Instant::now();
    let response = http.post(url).json(body).send().await?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        bail!("gateway answered {status}: {text}");
    }
    let mut first = None;
    let mut text_events = 0;
    let mut usage = None;
    let done = crate::for_each_sse_data(response, |data| {
        if data == b"[DONE]" {
            return Ok(false);
        }
        if crate::carries_text(data) {
            text_events += 1;
            first.get_or_insert_with(|| started.elapsed());
        }
        if data.starts_with(b"{\"error\"") {
            // The gateway's error event: the stream failed after it started.
            let event: serde_json::Value = serde_json::from_slice(data)?;
            bail!("the stream failed after it started: {}", event["error"]["message"].as_str().unwrap_or("(no message)"));
        }
        if data.windows(8).any(|w| w == b"\"usage\":") {
            let chunk: serde_json::Value = serde_json::from_slice(data)?;
            let usage_json = &chunk["usage"];
            if usage_json.is_object() {
                usage = Some((
                    usage_json["prompt_tokens"].as_u64().unwrap_or(0),
                    usage_json["completion_tokens"].as_u64().unwrap_or(0),
                    usage_json["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0),
                ));
            }
        }
        Ok(true)
    })
    .await?;
    if !done {
        bail!("the stream ended without [DONE]");
    }
    let (prompt_tokens, completion_tokens, cached_tokens) = usage.context("the stream carried no usage")?;
    Ok(Outcome {
        ttft: first.unwrap_or_else(|| started.elapsed()),
        end_to_end: started.elapsed(),
        text_events,
        completion_tokens,
        prompt_tokens,
        cached_tokens,
    })
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A stream that fails after it started reports the gateway's error,
    /// not a missing usage chunk.
    #[tokio::test]
    async fn an_error_event_mid_stream_is_reported_with_its_message() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/v1/completions", listener.local_addr().unwrap());
        let server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = vec![0; 4096];
            let _ = socket.read(&mut request).await.unwrap();
            let body = "data: {\"choices\":[{\"text\":\"Hi\",\"index\":0}]}\n\n\
                        data: {\"error\":{\"message\":\"the worker serving this request failed\",\"type\":\"server_error\",\"param\":null,\"code\":null}}\n\n\
                        data: [DONE]\n\n";
            let head = format!("HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n", body.len());
            socket.write_all(head.as_bytes()).await.unwrap();
            socket.write_all(body.as_bytes()).await.unwrap();
        });
        let failed = stream_completion(&reqwest::Client::new(), &url, &serde_json::json!({"prompt": "x", "stream": true})).await.unwrap_err();
        assert_eq!(failed.to_string(), "the stream failed after it started: the worker serving this request failed");
        server.await.unwrap();
    }
}

//! The engine thread with the mocker: streaming, cancellation, overload and
//! shutdown, through the public handle; and an executor that fails.

use std::time::Duration;

use turbine_engine::mocker::{MockExecutor, MockTiming};
use turbine_engine::{
    Batch, EngineError, EngineHandle, EngineOutput, Executor, ExecutorError, FinishReason, GenerateRequest, Sampled, SchedulerConfig, StopConditions,
};

fn engine(speedup: f64, config: SchedulerConfig) -> EngineHandle {
    let executor = MockExecutor::new(MockTiming { speedup }, (100..200).collect(), Some(2));
    EngineHandle::spawn(config, vec![2], Box::new(executor))
}

fn request(prompt_len: usize, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        request_id: "test".into(),
        prompt: (0..prompt_len as u32).map(|t| t % 50 + 10).collect(),
        stop: StopConditions { max_tokens, ignore_eos: true, ..Default::default() },
        ..Default::default()
    }
}

async fn collect(mut outputs: tokio::sync::mpsc::UnboundedReceiver<EngineOutput>) -> (Vec<u32>, EngineOutput) {
    let mut tokens = Vec::new();
    while let Some(output) = outputs.recv().await {
        match output {
            EngineOutput::Token(token, _) => tokens.push(token),
            last => return (tokens, last),
        }
    }
    panic!("stream ended without a final message");
}

#[tokio::test]
async fn concurrent_requests_stream_exact_token_counts() {
    let engine = engine(1e6, SchedulerConfig::default());
    let streams: Vec<_> = (0..16).map(|i| engine.generate(request(100 + i * 37, 20 + i as u32)).unwrap()).collect();
    for (i, stream) in streams.into_iter().enumerate() {
        let (tokens, last) = collect(stream).await;
        assert_eq!(tokens.len(), 20 + i);
        let EngineOutput::Finished { reason, usage } = last else { panic!("{last:?}") };
        assert_eq!(reason, FinishReason::Length);
        assert_eq!(usage.prompt_tokens as usize, 100 + i * 37);
        assert_eq!(usage.completion_tokens as usize, 20 + i);
    }
    assert_eq!(engine.load().blocks_used, 0);
    engine.shutdown();
}

#[tokio::test]
async fn a_mock_answer_is_one_pass_over_the_text_then_eos() {
    let engine = engine(1e6, SchedulerConfig::default());
    let mut answer = request(40, 1000);
    answer.stop.ignore_eos = false;
    let (tokens, last) = collect(engine.generate(answer).unwrap()).await;
    assert_eq!(tokens.len(), 100, "the corpus has 100 tokens");
    let EngineOutput::Finished { reason, usage } = last else { panic!("{last:?}") };
    assert_eq!(reason, FinishReason::Stop);
    assert_eq!(usage.completion_tokens, 100, "the EOS token is not counted");
    engine.shutdown();
}

#[tokio::test]
async fn the_same_seed_gives_the_same_tokens() {
    let engine = engine(1e6, SchedulerConfig::default());
    let mut seeded = request(40, 10);
    seeded.sampling.seed = Some(42);
    let (a, _) = collect(engine.generate(seeded.clone()).unwrap()).await;
    let (b, _) = collect(engine.generate(seeded).unwrap()).await;
    assert_eq!(a, b);
    engine.shutdown();
}

#[tokio::test]
async fn dropping_the_stream_frees_the_sequence() {
    // Real-time mocker: a 10,000-token request takes far longer than this test.
    let engine = engine(1.0, SchedulerConfig::default());
    let mut stream = engine.generate(request(64, 5_000)).unwrap();
    assert!(matches!(stream.recv().await, Some(EngineOutput::Token(..))));
    assert!(engine.load().blocks_used > 0);
    drop(stream);
    turbine_testkit::wait_until("the cancelled sequence frees its blocks", Duration::from_secs(5), async || {
        engine.load().blocks_used == 0 && engine.load().running == 0
    })
    .await;
    engine.shutdown();
}

#[tokio::test]
async fn invalid_and_overflowing_requests_are_refused_at_submission() {
    let config = SchedulerConfig { max_model_len: 128, max_waiting: 2, max_num_seqs: 1, ..Default::default() };
    let engine = engine(1.0, config);
    assert!(matches!(engine.generate(request(0, 1)), Err(EngineError::InvalidRequest(_))));
    assert!(matches!(engine.generate(request(120, 10)), Err(EngineError::InvalidRequest(_))));
    engine.shutdown();
}

#[tokio::test]
async fn shutdown_fails_sequences_still_running() {
    let engine = engine(1.0, SchedulerConfig::default());
    let stream = engine.generate(request(16, 5_000)).unwrap();
    engine.shutdown();
    let (_, last) = collect(stream).await;
    assert_eq!(last, EngineOutput::Failed(EngineError::ShuttingDown));
    assert!(matches!(engine.generate(request(16, 1)), Err(EngineError::ShuttingDown)));
}

/// Fails every step whose batch holds a prompt of `poison` tokens, with
/// an error of its own kind; answers the others with token 7.
struct Failing {
    poison: usize,
}

impl Executor for Failing {
    fn execute(&mut self, batch: &Batch<'_>) -> Result<Vec<Option<Sampled>>, ExecutorError> {
        if batch.items.iter().any(|item| item.tokens.len() == self.poison) {
            return Err(ExecutorError::Compute("out of device memory".into()));
        }
        Ok(batch.items.iter().map(|item| item.sample.then(|| Sampled::token(7))).collect())
    }
}

#[tokio::test]
async fn an_executor_failure_fails_its_step_typed_and_the_engine_serves_on() {
    let engine = EngineHandle::spawn(SchedulerConfig::default(), vec![], Box::new(Failing { poison: 13 }));
    let (_, last) = collect(engine.generate(request(13, 4)).unwrap()).await;
    assert_eq!(last, EngineOutput::Failed(EngineError::Executor(ExecutorError::Compute("out of device memory".into()))));
    if let EngineOutput::Failed(error) = &last {
        assert_eq!(error.to_string(), "the model failed: out of device memory");
    }
    let (tokens, last) = collect(engine.generate(request(16, 3)).unwrap()).await;
    assert_eq!(tokens, [7, 7, 7]);
    assert!(matches!(last, EngineOutput::Finished { reason: FinishReason::Length, .. }), "{last:?}");
    engine.shutdown();
}

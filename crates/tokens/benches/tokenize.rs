//! Tokenizer cost on the default model: encoding a ~1,000-token prompt with
//! the fast byte-level encoder and with the HF pipeline it reproduces (side
//! by side), and incremental detokenization per token.
//!
//! Run: `cargo bench -p turbine-tokens --bench tokenize`
//! (fetches the default model into the cache if missing).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use turbine_tokens::pull::{Progress, default_cache_dir, resolve_model};
use turbine_tokens::{ModelCard, Preprocessor};

fn bench(c: &mut Criterion) {
    let model = resolve_model("smollm2-135m", None, &default_cache_dir(), Progress::Quiet).unwrap();
    let preprocessor = Preprocessor::new(ModelCard::from_gguf_path(&model.name, &model.path, 16).unwrap()).unwrap();
    let sentence = "The quick brown fox jumps over the lazy dog while 42 engineers measure latency in microseconds. ";
    let text = sentence.repeat(50);
    let ids = preprocessor.encode_text(&text).unwrap();

    let mut group = c.benchmark_group("tokenize");
    group.throughput(Throughput::Elements(ids.len() as u64));
    let tokenizer = preprocessor.tokenizer();
    group.bench_function(format!("encode_fast_{}_tokens", ids.len()), |b| b.iter(|| tokenizer.encode(&text).unwrap()));
    group.bench_function(format!("encode_hf_{}_tokens", ids.len()), |b| b.iter(|| tokenizer.encode_reference(&text).unwrap()));
    // Fresh text every time: no piece is in the cache.
    let mut counter = 0u64;
    group.bench_function(format!("encode_fast_uncached_{}_tokens", ids.len()), |b| {
        b.iter(|| {
            counter += 1;
            let unique: String = text.split(' ').map(|word| format!("{word}{counter} ")).collect();
            tokenizer.encode(&unique).unwrap()
        })
    });
    group.bench_function(format!("detokenize_{}_tokens", ids.len()), |b| {
        b.iter(|| {
            let mut decoder = preprocessor.tokenizer().decoder();
            let mut out = String::new();
            for &id in &ids {
                decoder.push(id, &mut out);
            }
            out
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

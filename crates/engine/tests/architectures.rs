//! The other architectures through the engine (llama 3.x rope factors, tied Q8_0 llama, qwen3, qwen3moe,
//! phi3, the lfm2 hybrid; the synthetic files of scripts/make-test-models), in both numerics: at
//! temperature 0 a prompt gives the same tokens cold and alone, after a prefix-cache hit (not lfm2 yet),
//! concurrently in small prefill chunks beside other prompts, and under KV exhaustion that preempts and
//! recomputes. llama.cpp parity on the
//! same files is parity_real.rs. A file that was not generated is skipped with a note, unless
//! RECKON_REQUIRE_MODELS=1 (CI runs scripts/make-test-models).

mod common;

use common::{open_test_model, parity_fixture};
use reckon_engine::engine::{spawn, Completion, EngineConfig, EngineHandle, GenerateParams};
use reckon_engine::model::{Model, Numerics};
use reckon_engine::tokenizer::Tokenizer;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

const NEW_TOKENS: usize = 12;

/// (ids, cached prompt tokens) of one greedy request.
fn run(engine: &EngineHandle, prompt: &[u32]) -> (Vec<u32>, usize) {
    let req = GenerateParams { ignore_eos: true, ..GenerateParams::greedy(prompt.to_vec(), NEW_TOKENS) };
    let c = Completion::wait(engine.submit(req).unwrap().1).unwrap();
    (c.ids, c.usage.cached_tokens)
}

/// Each prompt through an engine with the prefix cache, checked against `reference`: the cached tokens.
fn warm_run(model: &Arc<Model>, tokenizer: &Arc<Tokenizer>, config: EngineConfig, prompts: &[Vec<u32>], reference: &[Vec<u32>], label: &str) -> Vec<usize> {
    let warm = spawn(model.clone(), tokenizer.clone(), EngineConfig { prefix_caching: true, ..config });
    prompts
        .iter()
        .zip(reference)
        .enumerate()
        .map(|(i, (q, want))| {
            let (ids, c) = run(&warm, q);
            assert_eq!(&ids, want, "{label}: prompt {i} after a cache hit of {c} tokens differs from a cold prefill");
            c
        })
        .collect()
}

fn check(name: &str, numerics: Numerics) {
    let Some(file) = open_test_model(name) else { return };
    if numerics == Numerics::Packed && !common::simd_or_skip(reckon_engine::kernels::cpu::SimdLevel::Avx2, "packed engine checks") {
        return;
    }
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let model = Arc::new(Model::load_with(file, numerics).unwrap());
    // real text in the model's own tokenization: the fixture's teacher-forced 512 tokens
    let text: Vec<u32> = parity_fixture(name)["teacher_forced"]["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    let p = 131; // shared prefix: 8 blocks and 3 tokens
    let prompts: Vec<Vec<u32>> = vec![
        [&text[..p], &text[p + 40..p + 77]].concat(),
        [&text[..p], &text[p + 100..p + 111]].concat(),
        text[..(p + 13) / 16 * 16].to_vec(), // whole blocks: the last block is recomputed
        [&text[..p], &text[p + 40..p + 77]].concat(),
        text[200..420].to_vec(),
    ];
    let config = EngineConfig { num_blocks: 256, max_model_len: 1024, max_running: 8, max_waiting: 16, prefix_caching: false, ..EngineConfig::default() };
    let cold = spawn(model.clone(), tokenizer.clone(), config);
    let reference: Vec<Vec<u32>> = prompts.iter().map(|q| run(&cold, q).0).collect();
    let label = format!("{name} ({})", numerics.name());

    // a hybrid model (recurrent conv state, not snapshotted yet) runs without the prefix cache
    let hybrid = model.config.short_conv.is_some();
    let cached: Vec<usize> = if hybrid { vec![] } else { warm_run(&model, &tokenizer, config, &prompts, &reference, &label) };
    if !hybrid {
        assert_eq!(cached, [0, 128, 128, 160, 0], "{label}: cached tokens per request");
    }

    // concurrently, in prefill chunks of 40 tokens, with shared blocks
    let busy = spawn(model.clone(), tokenizer.clone(), EngineConfig { prefix_caching: !hybrid, max_batch_tokens: 40, ..config });

    let got: Vec<Vec<u32>> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts.iter().map(|q| s.spawn(|| run(&busy, q).0)).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, reference, "{label}: concurrent requests in small chunks");

    // a pool of 20 blocks (320 positions) for prompts needing ~900 together: preemption and recompute
    let tight = spawn(model, tokenizer, EngineConfig { num_blocks: 20, max_model_len: 320, ..config });
    let rxs: Vec<_> = prompts.iter().map(|q| tight.submit(GenerateParams { ignore_eos: true, ..GenerateParams::greedy(q.clone(), NEW_TOKENS) }).unwrap().1).collect();
    let together: Vec<Vec<u32>> = rxs.into_iter().map(|rx| Completion::wait(rx).unwrap().ids).collect();
    assert!(tight.stats().preemptions.load(Relaxed) > 0, "{label}: the pool should have forced preemptions");
    assert_eq!(together, reference, "{label}: under KV exhaustion");
    eprintln!("{label}: {} prompts identical cold, cached {cached:?}, concurrent and preempted", prompts.len());
}

#[test]
fn llama3_rope_freqs_cached_concurrent_and_preempted_equal_cold() {
    check("llama3-tiny", Numerics::Ggml);
    check("llama3-tiny", Numerics::Packed);
}

#[test]
fn llama_tied_q8_0_cached_concurrent_and_preempted_equal_cold() {
    check("llama-tied-tiny", Numerics::Ggml);
    check("llama-tied-tiny", Numerics::Packed);
}

#[test]
fn qwen3_cached_concurrent_and_preempted_equal_cold() {
    check("qwen3-tiny", Numerics::Ggml);
    check("qwen3-tiny", Numerics::Packed);
}

#[test]
fn qwen3moe_cached_concurrent_and_preempted_equal_cold() {
    check("qwen3moe-tiny", Numerics::Ggml);
    check("qwen3moe-tiny", Numerics::Packed);
}

#[test]
fn phi3_cached_concurrent_and_preempted_equal_cold() {
    check("phi3-tiny", Numerics::Ggml);
    check("phi3-tiny", Numerics::Packed);
}

/// The hybrid: conv state per request slot, carried across prefill chunks, zeroed at position 0 when a
/// preempted request is recomputed (no prefix cache: its state is not snapshotted yet).
#[test]
fn lfm2_hybrid_concurrent_and_preempted_equal_cold() {
    check("lfm2-tiny", Numerics::Ggml);
    check("lfm2-tiny", Numerics::Packed);
}

/// What the conv state would need is refused with a clear error, not run wrong.
#[test]
fn lfm2_refuses_what_its_state_cannot_do_yet() {
    let Some(file) = open_test_model("lfm2-tiny") else { return };
    let tokenizer: Arc<dyn reckon_engine::engine::Detokenizer> = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let model = Arc::new(Model::load_with(file, Numerics::Ggml).unwrap());
    let err = reckon_engine::engine::spawn_with(model, tokenizer, EngineConfig::default(), None).err().expect("prefix caching refused");
    assert!(err.to_string().contains("prefix caching"), "{err}");
}

//! The other architectures through the engine (llama 3.x rope factors, tied Q8_0 llama, qwen3, qwen3moe,
//! phi3, the lfm2 hybrid; the synthetic files of scripts/make-test-models), in both numerics: at
//! temperature 0 a prompt gives the same tokens cold and alone, after a prefix-cache hit,
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

/// The fixture's teacher-forced 512 tokens: real text in the model's own tokenization.
fn fixture_text(name: &str) -> Vec<u32> {
    parity_fixture(name)["teacher_forced"]["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

/// Five prompts, three of them sharing a prefix of 8 blocks and 3 tokens.
fn prompts(name: &str) -> Vec<Vec<u32>> {
    let text = fixture_text(name);
    let p = 131;
    vec![
        [&text[..p], &text[p + 40..p + 77]].concat(),
        [&text[..p], &text[p + 100..p + 111]].concat(),
        text[..(p + 13) / 16 * 16].to_vec(), // whole blocks: the last block is recomputed
        [&text[..p], &text[p + 40..p + 77]].concat(),
        text[200..420].to_vec(),
    ]
}

fn cold_config() -> EngineConfig {
    EngineConfig { num_blocks: 256, max_model_len: 1024, max_running: 8, max_waiting: 16, prefix_caching: false, ..EngineConfig::default() }
}

fn check(name: &str, numerics: Numerics) {
    let Some(file) = open_test_model(name) else { return };
    if numerics == Numerics::Packed && !common::simd_or_skip(reckon_engine::kernels::cpu::SimdLevel::Avx2, "packed engine checks") {
        return;
    }
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let model = Arc::new(Model::load_with(file, numerics).unwrap());
    let prompts = prompts(name);
    let config = cold_config();
    let cold = spawn(model.clone(), tokenizer.clone(), config);
    let reference: Vec<Vec<u32>> = prompts.iter().map(|q| run(&cold, q).0).collect();
    let label = format!("{name} ({})", numerics.name());

    // (lfm2: each hit resumes its conv state from the snapshot at its last block's end)
    let cached = warm_run(&model, &tokenizer, config, &prompts, &reference, &label);
    assert_eq!(cached, [0, 128, 128, 160, 0], "{label}: cached tokens per request");

    // concurrently, in prefill chunks of 40 tokens, with shared blocks
    let busy = spawn(model.clone(), tokenizer.clone(), EngineConfig { prefix_caching: true, max_batch_tokens: 40, ..config });

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
/// preempted request is recomputed, taken from the snapshot at the last block's end after a cache hit.
#[test]
fn lfm2_hybrid_cached_concurrent_and_preempted_equal_cold() {
    check("lfm2-tiny", Numerics::Ggml);
    check("lfm2-tiny", Numerics::Packed);
}

/// What the conv state would need is refused with a clear error, not run wrong.
#[test]
fn lfm2_refuses_what_its_state_cannot_do_yet() {
    let Some(file) = open_test_model("lfm2-tiny") else { return };
    let tokenizer: Arc<dyn reckon_engine::engine::Detokenizer> = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let model = Arc::new(Model::load_with(file, Numerics::Ggml).unwrap());
    let spec = reckon_engine::engine::spec::SpecConfig { k: 4, min_n: 1, max_n: 3, auto: false, draft: false };
    let err = reckon_engine::engine::spawn_with(model, tokenizer, EngineConfig { spec: Some(spec), ..EngineConfig::default() }, None).err().expect("speculation refused");
    assert!(err.to_string().contains("speculative decoding"), "{err}");
}

/// The conv state a cache hit resumes from, at the logits: a sequence that starts at a block boundary on
/// another sequence's blocks (the prefix cache's hit) gets bit for bit the logits of a cold run of its
/// whole prompt. Only the two positions after the hit read the restored state, so greedy tokens alone
/// could miss a wrong one.
#[test]
fn lfm2_a_hit_resumes_the_conv_state_of_its_last_block_bit_for_bit() {
    use reckon_engine::model::{LogitsWanted, Scratch, SeqInput};
    let Some(file) = open_test_model("lfm2-tiny") else { return };
    let model = Model::load_with(file, Numerics::Ggml).unwrap();
    let text = fixture_text("lfm2-tiny");
    let (prompt, hit) = (&text[..50], 32);
    let v = model.config.vocab_size;
    let cold = model.logits_of(prompt, 512);
    let mut kv = model.new_kv(16, 16);
    // block 1 keeps the state after it, in snapshot slot 0 (the pool's `give_state`)
    let mut snapshot_of = vec![reckon_engine::kv::NO_STATE; 16];
    snapshot_of[1] = 0;
    kv.conv_states.map_snapshots(&snapshot_of);
    let mut s = Scratch::default();
    let a_table = vec![(0..4u32).collect::<Vec<u32>>()];
    // sequence A (slot 0) computes the shared prefix; B (slot 1) has A's first two blocks and goes on
    model.forward(&[SeqInput { tokens: &prompt[..hit], start_pos: 0, block_tables: &a_table, logits: LogitsWanted::None, state: Some(0) }], &mut kv, &mut s);
    let b_table = vec![vec![0, 1, 7, 8]];
    let got = model.forward(&[SeqInput { tokens: &prompt[hit..], start_pos: hit, block_tables: &b_table, logits: LogitsWanted::All, state: Some(1) }], &mut kv, &mut s).to_vec();
    assert_eq!(got, cold[hit * v..], "logits after a hit differ from a cold run");
}

/// Snapshots every third block: hits come in steps of 3 blocks (48 tokens), the tokens stay a cold run's.
#[test]
fn lfm2_snapshots_every_third_block_cut_hits_to_them() {
    let Some(file) = open_test_model("lfm2-tiny") else { return };
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let model = Arc::new(Model::load_with(file, Numerics::Ggml).unwrap());
    let prompts = prompts("lfm2-tiny");
    let cold = spawn(model.clone(), tokenizer.clone(), cold_config());
    let reference: Vec<Vec<u32>> = prompts.iter().map(|q| run(&cold, q).0).collect();
    let config = EngineConfig { state_snapshot_every: 3, ..cold_config() };
    // 8 full blocks shared: a hit of 6; prompt 0 again (10 of its blocks cached): a hit of 9
    let cached = warm_run(&model, &tokenizer, config, &prompts, &reference, "lfm2-tiny, every 3 blocks");
    assert_eq!(cached, [0, 96, 96, 144, 0]);
}

/// The disk tier keeps a block's state snapshot beside its keys and values: blocks evicted from memory,
/// and every cached block at shutdown, come back with the state at the hit's end, and the tokens are a
/// cold run's. The prompts end one token after a block, so the token that reads the restored state first
/// gives the first generated token.
#[test]
fn lfm2_the_disk_tier_restores_the_state_with_the_blocks() {
    use reckon_engine::engine::spawn_with;
    use reckon_engine::kv::DiskTierConfig;
    let Some(file) = open_test_model("lfm2-tiny") else { return };
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let model = Arc::new(Model::load_with(file, Numerics::Ggml).unwrap());
    let text = fixture_text("lfm2-tiny");
    let (a, fillers) = (text[..129].to_vec(), [text[129..290].to_vec(), text[290..451].to_vec()]);
    let cold = spawn(model.clone(), tokenizer.clone(), cold_config());
    let reference = run(&cold, &a).0;
    let dir = std::env::temp_dir().join(format!("reckon-lfm2-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let disk = Some(DiskTierConfig { dir: dir.clone(), max_bytes: 64 << 20 });
    let spawn_disk = |num_blocks| spawn_with(model.clone(), tokenizer.clone(), EngineConfig { num_blocks, prefix_caching: true, ..cold_config() }, disk.clone()).unwrap();
    // evicted: a pool of 24 blocks, two other prompts push 5 of a's 8 cached blocks out
    let engine = spawn_disk(24);
    assert_eq!(run(&engine, &a), (reference.clone(), 0));
    for f in &fillers {
        run(&engine, f);
    }
    // (the writer is in the background: poke the engine, whose stats come after each step, until the
    // evicted blocks are indexed)
    let stats = engine.stats();
    for i in 0..1000 {
        if stats.prefix_cache_disk_blocks.load(Relaxed) >= 5 {
            break;
        }
        assert!(i < 999, "the evicted blocks never reached the disk tier");
        run(&engine, &[1]);
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let again = run(&engine, &a);
    let disk_hit = stats.prefix_cache_disk_hit_tokens.load(Relaxed);
    assert_eq!(again, (reference, 128), "a's 8 blocks from memory and disk ({disk_hit} tokens from disk)");
    assert!(disk_hit > 0);
    engine.shutdown(std::time::Duration::ZERO);
    // a restart: every cached block was written at shutdown
    let engine = spawn_disk(256);
    let b = [&fillers[0][..], &text[..1]].concat(); // 10 blocks and a token
    let (ids, cached) = run(&engine, &b);
    assert_eq!((ids, cached), (run(&cold, &b).0, 160), "a restart reads the blocks and the state back");
    assert_eq!(engine.stats().prefix_cache_disk_hit_tokens.load(Relaxed), 160);
    engine.shutdown(std::time::Duration::ZERO);
    let _ = std::fs::remove_dir_all(&dir);
}

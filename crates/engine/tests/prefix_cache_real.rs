//! Determinism across prefix cache states on the three real models: at temperature 0, a request whose
//! prompt starts with cached blocks gives exactly the tokens of a cold prefill of the same prompt (the
//! greedy flips vLLM and SGLang users report must not happen here). A model that has not been fetched is
//! skipped with a note, unless RECKON_REQUIRE_MODELS=1 (CI). The same holds with quantized KV cells
//! (`--kv-dtype q8_0`), under a KV window (`--kv-window`), where a hit takes the sink blocks and the
//! window before it, with Gemma-3's sliding layers keeping their window only (`kv::layout`), and under
//! sparse attention (`--sparse-attention`).

mod common;

use common::{open_real_model as open, parity_fixture};
use reckon_engine::engine::{spawn, Completion, EngineConfig, GenerateParams};
use reckon_engine::kv::{KvDtypes, KvWindow, SparseAttention};
use reckon_engine::model::Model;
use reckon_engine::tokenizer::Tokenizer;
use std::sync::Arc;

const NEW_TOKENS: usize = 16;

/// The parity fixture's ~2,000-token text (real prose, the model's own tokenization).
fn text_tokens(name: &str) -> Vec<u32> {
    let fx = parity_fixture(name);
    fx["teacher_forced"]["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect()
}

/// Token ids and cached prompt tokens of one greedy request.
fn run(engine: &reckon_engine::engine::EngineHandle, prompt: &[u32]) -> (Vec<u32>, usize) {
    let mut req = GenerateParams::greedy(prompt.to_vec(), NEW_TOKENS);
    req.ignore_eos = true;
    let c = Completion::wait(engine.submit(req).unwrap().1).unwrap();
    (c.ids, c.usage.cached_tokens)
}

fn check_model(name: &str, kv: &str) {
    check_model_with(name, kv, None, &[0, 400, 400, 432, 400]);
}

fn check_model_with(name: &str, kv: &str, kv_window: Option<KvWindow>, want_cached: &[usize]) {
    check_prompts(name, kv, kv_window, None, false, 403, want_cached);
}

/// `prefix_len` tokens shared (403: 25 blocks and 3 tokens), three continuations, and exact repeats; the
/// reference is a cold prefill with one KV group.
fn check_prompts(name: &str, kv: &str, kv_window: Option<KvWindow>, sparse_attention: Option<SparseAttention>, hybrid_kv: bool, prefix_len: usize, want_cached: &[usize]) {
    let Some(file) = open(name) else { return };
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let model = Arc::new(Model::load(file).unwrap());
    let text = text_tokens(name);
    let (prefix, p) = (&text[..prefix_len], prefix_len);
    let prompts: Vec<Vec<u32>> = vec![
        [prefix, &text[p + 97..p + 134]].concat(),
        [prefix, &text[p + 197..p + 208]].concat(),
        text[..(p + 13) / 16 * 16].to_vec(), // whole blocks: the last block is recomputed
        [prefix, &text[p + 97..p + 134]].concat(),
        [prefix, &text[p + 297..p + 298]].concat(),
    ];
    // (a hybrid layout's blocks are pages of fewer layers: more of them)
    let num_blocks = if hybrid_kv { 1024 } else { 128 };
    let config = EngineConfig { block_size: 16, num_blocks, max_batch_tokens: 512, max_running: 8, max_waiting: 16, max_model_len: 2048, prefix_caching: true, max_prefill_tokens_while_decoding: usize::MAX, rest_pool_between_steps: true, kv_dtypes: KvDtypes::parse(kv).unwrap(), kv_window, sparse_attention, hybrid_kv, spec: None, spec_prefill: None, slow_state: Default::default(), state_snapshot_every: 1 };
    let cold = spawn(model.clone(), tokenizer.clone(), EngineConfig { prefix_caching: false, hybrid_kv: false, num_blocks: 128, ..config });
    let reference: Vec<Vec<u32>> = prompts.iter().map(|p| run(&cold, p).0).collect();
    let warm = spawn(model.clone(), tokenizer.clone(), config);
    let mut cached = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let (ids, c) = run(&warm, p);
        assert_eq!(ids, reference[i], "{name} {kv}: prompt {i} after a cache hit of {c} tokens differs from a cold prefill");
        cached.push(c);
    }
    assert_eq!(cached, want_cached, "{name}: cached tokens per request");
    // concurrently, with small prefill chunks (hits land in the middle of other sequences' steps)
    let busy = spawn(model, tokenizer, EngineConfig { max_batch_tokens: 48, ..config });
    let got: Vec<Vec<u32>> = std::thread::scope(|s| {
        let handles: Vec<_> = prompts.iter().map(|p| s.spawn(|| run(&busy, p).0)).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(got, reference, "{name} {kv}: concurrent requests with shared blocks");
    eprintln!("{name} ({kv} KV, window {kv_window:?}, sparse {sparse_attention:?}): {} prompts identical cold and cached; cached tokens {cached:?}", prompts.len());
}

/// Under a 128-token window with 4 sinks the blocks behind the window are released as the first prompt
/// runs, but stay cached: a later prompt's hit needs its sink block and the 128+ positions before the
/// hit's end only, so the hits are those without a window, and the tokens are still those of a cold
/// prefill under the same window, alone or concurrent.
#[test]
fn windowed_cache_hits_match_cold_prefill_smollm2() {
    check_model_with("smollm2-135m", "f16", Some(KvWindow { window: 128, sinks: 4 }), &[0, 400, 400, 432, 400]);
}

#[test]
fn windowed_cache_hits_match_cold_prefill_qwen2_q8_0() {
    check_model_with("qwen2.5-coder-0.5b", "q8_0", Some(KvWindow { window: 128, sinks: 4 }), &[0, 400, 400, 432, 400]);
}

/// Gemma-3's sliding layers in block tables of their own that release what leaves their 512 tokens
/// (`kv::layout`): prompts of ~1,000 tokens, so the sliding groups release blocks during prefill, and a
/// hit needs their last 512 positions only. Same tokens as a cold prefill with every block kept.
#[test]
fn hybrid_kv_cache_hits_match_cold_prefill_gemma3() {
    check_prompts("gemma3-270m", "f16", None, None, true, 1003, &[0, 992, 992, 1024, 992]);
}

#[test]
fn hybrid_kv_cache_hits_match_cold_prefill_gemma3_q8_0() {
    check_prompts("gemma3-270m", "q8_0", None, None, true, 1003, &[0, 992, 992, 1024, 992]);
}

/// Sparse attention over the history (`kv::sparse`), with a budget of 4 blocks, so most of each prompt
/// reads a picked part of its history: a hit, a cold prefill and chunks of 48 tokens beside other
/// requests give the same tokens.
#[test]
fn sparse_attention_cache_hits_match_cold_prefill_smollm2() {
    let sparse = SparseAttention { budget: 64, local: 64, sinks: 16 };
    check_prompts("smollm2-135m", "f16", None, Some(sparse), false, 403, &[0, 400, 400, 432, 400]);
}

#[test]
fn sparse_attention_cache_hits_match_cold_prefill_qwen2() {
    let sparse = SparseAttention { budget: 64, local: 64, sinks: 16 };
    check_prompts("qwen2.5-coder-0.5b", "f16", None, Some(sparse), false, 403, &[0, 400, 400, 432, 400]);
}

/// The same over q8_0 keys and q4_0 values: the bounds come from the quantized keys.
#[test]
fn sparse_attention_cache_hits_match_cold_prefill_qwen2_quantized() {
    let sparse = SparseAttention { budget: 64, local: 64, sinks: 16 };
    check_prompts("qwen2.5-coder-0.5b", "q8_0,q4_0", None, Some(sparse), false, 403, &[0, 400, 400, 432, 400]);
}

#[test]
fn cache_hits_match_cold_prefill_smollm2() {
    check_model("smollm2-135m", "f16");
}

#[test]
fn cache_hits_match_cold_prefill_smollm2_q8_0() {
    check_model("smollm2-135m", "q8_0");
}

#[test]
fn cache_hits_match_cold_prefill_gemma3() {
    check_model("gemma3-270m", "f16");
}

#[test]
fn cache_hits_match_cold_prefill_gemma3_q8_0() {
    check_model("gemma3-270m", "q8_0");
}

#[test]
fn cache_hits_match_cold_prefill_qwen2() {
    check_model("qwen2.5-coder-0.5b", "f16");
}

#[test]
fn cache_hits_match_cold_prefill_qwen2_q8_0() {
    check_model("qwen2.5-coder-0.5b", "q8_0");
}

/// Sparse prefill on SmolLM2 scored by its own first 4 layers (`engine::sparse`): a 1,500-token prompt
/// thinned to 0.3 is answered; the same prompt again finds in the prefix cache exactly the whole blocks
/// of the kept positions' genuine prefix (what `sparse::plan` keeps from position 0 on), never a thinned
/// block; with idle recovery, once the debt is paid the same prompt finds every whole block and gets the
/// tokens of a full prefill.
#[test]
fn sparse_prefill_caches_only_a_true_prefix_and_recovery_restores_it_smollm2() {
    use reckon_engine::engine::sparse::{plan, SparsePrefillConfig, SparsePrompt};
    use std::sync::atomic::Ordering::Relaxed;
    let name = "smollm2-135m";
    let Some(file) = open(name) else { return };
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let model = Arc::new(Model::load(file).unwrap());
    let prompt = text_tokens(name)[..1500].to_vec();
    let sparse = SparsePrefillConfig { keep: 0.3, min_tokens: 512, layers: 4, ..SparsePrefillConfig::default() };
    let config = EngineConfig { block_size: 16, num_blocks: 512, max_batch_tokens: 512, max_running: 4, max_waiting: 16, max_model_len: 2048, prefix_caching: true, max_prefill_tokens_while_decoding: usize::MAX, rest_pool_between_steps: true, kv_dtypes: KvDtypes::parse("f16").unwrap(), kv_window: None, sparse_attention: None, hybrid_kv: false, spec: None, spec_prefill: None, slow_state: Default::default(), state_snapshot_every: 1 };
    let full = run(&spawn(model.clone(), tokenizer.clone(), config), &prompt).0;
    let kept = plan(&model, &prompt, 0, &sparse).expect("thinned");
    let genuine = SparsePrompt::new(kept.clone(), prompt.len()).unwrap().genuine_prefix();
    assert!(kept.len() < 450 + 32 && genuine < 1500, "kept {} of 1500, genuine prefix {genuine}", kept.len());
    let thinned = spawn(model.clone(), tokenizer.clone(), EngineConfig { spec_prefill: Some(sparse), ..config });
    let (ids, cached) = run(&thinned, &prompt);
    assert_eq!((ids.len(), cached), (NEW_TOKENS, 0));
    assert_eq!(thinned.stats().spec_prefill_dropped_tokens.load(Relaxed), (1500 - kept.len()) as u64);
    let (_, cached) = run(&thinned, &prompt);
    assert_eq!(cached, genuine / 16 * 16, "only whole blocks of the genuine prefix are cached");
    let recovering = spawn(model.clone(), tokenizer.clone(), EngineConfig { spec_prefill: Some(SparsePrefillConfig { recover: true, recover_slice: 64, ..sparse }), ..config });
    run(&recovering, &prompt);
    let st = recovering.stats();
    for _ in 0..3000 {
        if st.spec_prefill_recovery_debt.load(Relaxed) == 0 && st.running.load(Relaxed) == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    assert_eq!(st.spec_prefill_recovery_debt.load(Relaxed), 0, "recovery finished");
    let (steps, recovered) = (st.spec_prefill_recovery_steps.load(Relaxed), st.spec_prefill_recovered_tokens.load(Relaxed));
    assert!(recovered >= 1000 && recovered <= 64 * steps, "slices of at most 64 tokens: {recovered} tokens in {steps} steps");
    std::thread::sleep(std::time::Duration::from_millis(50));
    let (ids, cached) = run(&recovering, &prompt);
    assert_eq!(cached, 1500 / 16 * 16, "every whole block of the prompt");
    assert_eq!(ids, full, "the tokens of a full prefill");
}

/// KV exhaustion on a real model (issue 22): eight prompts of 300-440 tokens asking 48 tokens each need
/// ~3,300 positions together, four times the pool of 52 blocks (832 positions). Submitted at once, they
/// preempt one another and are recomputed, and every one ends with the greedy tokens it gets alone.
#[test]
fn kv_exhaustion_four_times_the_pool_gives_the_tokens_of_each_alone_smollm2() {
    use std::sync::atomic::Ordering::Relaxed;
    let name = "smollm2-135m";
    let Some(file) = open(name) else { return };
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let model = Arc::new(Model::load(file).unwrap());
    let text = text_tokens(name);
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| text[i * 150..i * 150 + 300 + 20 * i].to_vec()).collect();
    let config = |num_blocks| EngineConfig { block_size: 16, num_blocks, max_batch_tokens: 256, max_running: 8, max_waiting: 16, max_model_len: 1024, prefix_caching: false, ..EngineConfig::default() };
    let request = |p: &Vec<u32>| GenerateParams { ignore_eos: true, ..GenerateParams::greedy(p.clone(), 48) };
    let alone: Vec<Vec<u32>> = prompts.iter().map(|p| Completion::wait(spawn(model.clone(), tokenizer.clone(), config(64)).submit(request(p)).unwrap().1).unwrap().ids).collect();
    let needed: usize = prompts.iter().map(|p| p.len() + 48).sum();
    assert!(needed >= 4 * 52 * 16, "{needed} positions");
    let engine = spawn(model.clone(), tokenizer.clone(), config(52));
    let rxs: Vec<_> = prompts.iter().map(|p| engine.submit(request(p)).unwrap().1).collect();
    let together: Vec<Vec<u32>> = rxs.into_iter().map(|rx| Completion::wait(rx).unwrap().ids).collect();
    assert!(engine.stats().preemptions.load(Relaxed) > 0, "the pool should have forced preemptions");
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, b, "prompt {i}: tokens under KV exhaustion differ from alone");
    }
}

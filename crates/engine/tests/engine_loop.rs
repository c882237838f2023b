//! The engine loop on a tiny random model: tokens at temperature 0 (and seeded sampling) do not depend
//! on what else is in the batch, on the step's token budget, or on preemptions; aborts and dropped
//! clients return every block; bad requests are refused with a reason.

mod common;

use common::{tiny_model, TestRng, TinySpec};
use reckon_engine::engine::{spawn, spawn_with, spawn_with_draft, Completion, Detokenizer, EngineConfig, EngineHandle, Event, Field, FinishReason, GenerateParams, RequestError, Usage};
use reckon_engine::kv::{DiskTierConfig, KvWindow};
use reckon_engine::gguf::GgufFile;
use reckon_engine::model::Model;
use reckon_engine::kernels::ggml::GgmlType;
use reckon_engine::sampler::SamplingParams;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Token `i` reads as `<i>`; no token ends a generation.
struct Names;

impl Detokenizer for Names {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        format!("<{id}>").into_bytes()
    }
    fn is_end_of_generation(&self, _: u32) -> bool {
        false
    }
}

fn model() -> Arc<Model> {
    Arc::new(Model::load(GgufFile::from_vec(tiny_model(&TinySpec::llama(GgmlType::Q4_1), 11)).unwrap()).unwrap())
}

fn config(num_blocks: usize, max_batch_tokens: usize) -> EngineConfig {
    EngineConfig { block_size: 4, num_blocks, max_batch_tokens, max_running: 32, max_waiting: 64, max_model_len: 256, prefix_caching: true, max_prefill_tokens_while_decoding: usize::MAX, rest_pool_between_steps: true, kv_dtypes: Default::default(), kv_window: None, sparse_attention: None, hybrid_kv: false, spec: None, spec_prefill: None, slow_state: Default::default(), state_snapshot_every: 1 }
}

fn prompt(seed: u64, n: usize) -> Vec<u32> {
    let mut rng = TestRng(seed);
    (0..n).map(|_| (rng.next() % 96) as u32).collect()
}

/// Collects a request's tokens and how it ended.
fn drain(rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> (Vec<u32>, String, FinishReason) {
    let (ids, text, reason, _) = drain_usage(rx);
    (ids, text, reason)
}

fn drain_usage(rx: tokio::sync::mpsc::UnboundedReceiver<Event>) -> (Vec<u32>, String, FinishReason, Usage) {
    let c = Completion::wait(rx).unwrap_or_else(|e| panic!("request failed: {e}"));
    assert_eq!(c.usage.completion_tokens, c.ids.len());
    (c.ids, c.text, c.reason, c.usage)
}

fn requests() -> Vec<GenerateParams> {
    (0..16u64)
        .map(|i| {
            let mut r = GenerateParams::greedy(prompt(i, 3 + (i as usize * 7) % 40), 12 + i as usize % 5);
            if i % 4 == 3 {
                r.sampling = SamplingParams { temperature: 0.9, seed: 100 + i, ..SamplingParams::default() };
            }
            r
        })
        .collect()
}

/// Each request alone on a fresh engine: the reference.
fn alone(model: &Arc<Model>) -> Vec<Vec<u32>> {
    requests()
        .into_iter()
        .map(|r| {
            let engine = spawn(model.clone(), Arc::new(Names), config(64, 64));
            drain(engine.submit(r).unwrap().1).0
        })
        .collect()
}

fn all_at_once(engine: &EngineHandle) -> Vec<Vec<u32>> {
    let rxs: Vec<_> = requests().into_iter().map(|r| engine.submit(r).unwrap().1).collect();
    rxs.into_iter().map(|rx| drain(rx).0).collect()
}

fn wait_idle(engine: &EngineHandle) {
    let s = engine.stats();
    for _ in 0..1000 {
        if s.running.load(Ordering::Relaxed) == 0 && s.waiting.load(Ordering::Relaxed) == 0 && s.blocks_used.load(Ordering::Relaxed) == 0 {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    panic!("engine did not go idle: {s:?}");
}

#[test]
fn tokens_do_not_depend_on_batch_budget_or_preemption() {
    let model = model();
    let reference = alone(&model);
    // 16 concurrent requests, with a large and a small step budget (different prefill chunks)
    for budget in [256, 7] {
        let engine = spawn(model.clone(), Arc::new(Names), config(64, budget));
        assert_eq!(all_at_once(&engine), reference, "step budget {budget}");
        wait_idle(&engine);
    }
    // too few blocks for all of them: the newest are preempted and recomputed
    let engine = spawn(model.clone(), Arc::new(Names), config(24, 64));
    assert_eq!(all_at_once(&engine), reference, "under memory pressure");
    wait_idle(&engine);
    assert!(engine.stats().preemptions.load(Ordering::Relaxed) > 0, "the small pool should have forced preemptions");
}

/// Under a KV window, sequences several times longer than the pool run to their end, and their greedy
/// tokens do not depend on the batch, the step budget (prefill chunks), preemption or the prefix cache.
#[test]
fn a_kv_window_runs_sequences_longer_than_the_pool_with_the_same_tokens() {
    let model = model();
    let cfg = |blocks, budget| EngineConfig { kv_window: Some(KvWindow { window: 12, sinks: 4 }), ..config(blocks, budget) };
    let reqs = || (0..4).map(|i| GenerateParams { ignore_eos: true, ..GenerateParams::greedy(prompt(40 + i, 30 + 9 * i as usize), 160) }).collect::<Vec<_>>();
    // each alone in a pool of 16 blocks (64 positions), though each runs to 190..217 positions
    let alone: Vec<Vec<u32>> = reqs()
        .into_iter()
        .map(|r| {
            let engine = spawn(model.clone(), Arc::new(Names), cfg(16, 64));
            drain(engine.submit(r).unwrap().1).0
        })
        .collect();
    assert!(alone.iter().all(|t| t.len() == 160));
    for (blocks, budget) in [(64, 64), (64, 7), (24, 64)] {
        let engine = spawn(model.clone(), Arc::new(Names), cfg(blocks, budget));
        for round in ["cold", "with the sink blocks cached"] {
            let rxs: Vec<_> = reqs().into_iter().map(|r| engine.submit(r).unwrap().1).collect();
            let got: Vec<Vec<u32>> = rxs.into_iter().map(|rx| drain(rx).0).collect();
            assert_eq!(got, alone, "{blocks} blocks, step budget {budget}, {round}");
            wait_idle(&engine);
        }
    }
}

/// Gemma-3's sliding layers in block tables of their own (`kv::layout`; the tiny model: window 8, five
/// sliding layers and a global one, a group each) give the tokens of one group holding every block:
/// alone, batched, in small chunks, preempted, and with their prefixes cached.
#[test]
fn sliding_layer_groups_give_the_tokens_of_one_group() {
    let model = Arc::new(Model::load(GgufFile::from_vec(tiny_model(&TinySpec::gemma3(), 11)).unwrap()).unwrap());
    let reqs = || (0..4).map(|i| GenerateParams { ignore_eos: true, ..GenerateParams::greedy(prompt(70 + i, 20 + 7 * i as usize), 40) }).collect::<Vec<_>>();
    let one_group: Vec<Vec<u32>> = reqs()
        .into_iter()
        .map(|r| {
            let engine = spawn(model.clone(), Arc::new(Names), config(64, 64));
            drain(engine.submit(r).unwrap().1).0
        })
        .collect();
    assert!(one_group.iter().all(|t| t.len() == 40));
    // 100 blocks: all four at once do not fit (each holds 6 groups' blocks while it prefills)
    for (blocks, budget) in [(512, 64), (512, 5), (100, 64)] {
        let engine = spawn(model.clone(), Arc::new(Names), EngineConfig { hybrid_kv: true, ..config(blocks, budget) });
        for round in ["cold", "with prefixes cached"] {
            let rxs: Vec<_> = reqs().into_iter().map(|r| engine.submit(r).unwrap().1).collect();
            let got: Vec<Vec<u32>> = rxs.into_iter().map(|rx| drain(rx).0).collect();
            assert_eq!(got, one_group, "{blocks} blocks, step budget {budget}, {round}");
            wait_idle(&engine);
        }
    }
}

/// Speculative decoding with the n-gram proposer (`engine::spec`) gives the tokens of decoding one at a
/// time: alone, batched, in small chunks and preempted; and guesses were kept (the tiny model repeats
/// itself, which is what prompt lookup feeds on).
#[test]
fn ngram_speculation_gives_the_tokens_of_decoding_one_at_a_time() {
    use reckon_engine::engine::spec::SpecConfig;
    let model = model();
    // prompts that repeat a phrase, as code edits and quotes do
    let reqs = || (0..4).map(|i| {
        let phrase = prompt(90 + i, 6 + i as usize);
        let p: Vec<u32> = (0..5).flat_map(|_| phrase.iter().copied()).collect();
        GenerateParams { ignore_eos: true, ..GenerateParams::greedy(p, 48) }
    }).collect::<Vec<_>>();
    let plain: Vec<Vec<u32>> = reqs().into_iter().map(|r| {
        let engine = spawn(model.clone(), Arc::new(Names), config(64, 64));
        drain(engine.submit(r).unwrap().1).0
    }).collect();
    let mut accepted = 0;
    for (blocks, budget, auto) in [(128, 64, false), (128, 3, false), (40, 64, false), (128, 64, true), (40, 3, true)] {
        let spec = Some(SpecConfig { k: 5, min_n: 1, max_n: 4, auto, draft: false });
        let engine = spawn(model.clone(), Arc::new(Names), EngineConfig { spec, ..config(blocks, budget) });
        let alone: Vec<Vec<u32>> = reqs().into_iter().map(|r| drain(engine.submit(r).unwrap().1).0).collect();
        assert_eq!(alone, plain, "{blocks} blocks, step budget {budget}, auto {auto}: one at a time");
        let rxs: Vec<_> = reqs().into_iter().map(|r| engine.submit(r).unwrap().1).collect();
        let batched: Vec<Vec<u32>> = rxs.into_iter().map(|rx| drain(rx).0).collect();
        assert_eq!(batched, plain, "{blocks} blocks, step budget {budget}, auto {auto}: batched");
        wait_idle(&engine);
        let st = engine.stats();
        accepted += st.spec_accepted_tokens.load(Ordering::Relaxed);
        assert!(st.spec_draft_tokens.load(Ordering::Relaxed) >= st.spec_accepted_tokens.load(Ordering::Relaxed));
    }
    assert!(accepted > 0, "no guess was ever kept: the test did not speculate");
}

/// A draft model (the target itself, whose guesses are all kept, and another model of the same
/// vocabulary, whose guesses are mostly rejected) gives the tokens of decoding one at a time: alone,
/// batched, in 3-token steps, preempted, with the controller, and again from the prefix cache (where
/// the draft model's cells come with the blocks).
#[test]
fn a_draft_model_gives_the_tokens_of_decoding_one_at_a_time() {
    use reckon_engine::engine::spec::SpecConfig;
    let model = model();
    let other = Arc::new(Model::load(GgufFile::from_vec(tiny_model(&TinySpec { layers: 1, n_kv_heads: 1, ..TinySpec::llama(GgmlType::Q4_1) }, 12)).unwrap()).unwrap());
    let reqs = || (0..4).map(|i| GenerateParams { ignore_eos: true, ..GenerateParams::greedy(prompt(50 + i, 5 + 9 * i as usize), 40) }).collect::<Vec<_>>();
    let plain: Vec<Vec<u32>> = reqs().into_iter().map(|r| drain(spawn(model.clone(), Arc::new(Names), config(64, 64)).submit(r).unwrap().1).0).collect();
    for (name, draft) in [("itself", model.clone()), ("another model", other)] {
        let (mut drafted, mut accepted) = (0, 0);
        for (blocks, budget, auto) in [(128, 64, false), (128, 3, false), (40, 64, false), (128, 64, true), (40, 3, true)] {
            let spec = Some(SpecConfig { k: 4, min_n: 1, max_n: 4, auto, draft: true });
            let engine = spawn_with_draft(model.clone(), Some(draft.clone()), Arc::new(Names), EngineConfig { spec, ..config(blocks, budget) }, None).unwrap();
            let what = format!("draft: {name}, {blocks} blocks, step budget {budget}, auto {auto}");
            let alone: Vec<Vec<u32>> = reqs().into_iter().map(|r| drain(engine.submit(r).unwrap().1).0).collect();
            assert_eq!(alone, plain, "{what}: one at a time");
            // the same requests again, batched: their prompts hit the prefix cache
            let rxs: Vec<_> = reqs().into_iter().map(|r| engine.submit(r).unwrap().1).collect();
            let batched: Vec<Vec<u32>> = rxs.into_iter().map(|rx| drain(rx).0).collect();
            assert_eq!(batched, plain, "{what}: batched");
            wait_idle(&engine);
            let st = engine.stats();
            drafted += st.spec_draft_tokens.load(Ordering::Relaxed);
            accepted += st.spec_accepted_tokens.load(Ordering::Relaxed);
            if blocks == 40 && !auto {
                assert!(st.preemptions.load(Ordering::Relaxed) > 0, "{what}: the small pool should preempt");
            }
        }
        assert!(drafted > 0, "draft {name}: nothing was guessed");
        if name == "itself" {
            assert_eq!(accepted, drafted, "a model drafting for itself is always right");
        } else {
            assert!(accepted < drafted, "another model's guesses were all kept: the rejections went untested");
        }
    }
    // a draft of another vocabulary is refused
    let mut spec = TinySpec::llama(GgmlType::Q4_1);
    spec.vocab += 1;
    let wrong = Arc::new(Model::load(GgufFile::from_vec(tiny_model(&spec, 3)).unwrap()).unwrap());
    let cfg = EngineConfig { spec: Some(SpecConfig { draft: true, ..SpecConfig::default() }), ..config(64, 64) };
    assert!(spawn_with_draft(model.clone(), Some(wrong), Arc::new(Names), cfg, None).is_err());
    assert!(spawn_with_draft(model, None, Arc::new(Names), cfg, None).is_err(), "SpecConfig::draft without a draft model");
}

/// With temperature, verification draws each position's token with the random number decoding without
/// guesses would use there, and keeps a guess iff it is that token: a seeded request gives the same
/// tokens with the n-gram proposer, a draft model and the controller as without speculation.
#[test]
fn seeded_sampling_gives_the_same_tokens_with_and_without_speculation() {
    use reckon_engine::engine::spec::SpecConfig;
    let model = model();
    let reqs = || {
        (0..4u64)
            .map(|i| {
                let phrase = prompt(70 + i, 5);
                let p: Vec<u32> = (0..4).flat_map(|_| phrase.iter().copied()).collect();
                let sampling = SamplingParams { temperature: 0.3 + 0.3 * i as f32, seed: 40 + i, repetition_penalty: if i == 3 { 1.2 } else { 1.0 }, ..SamplingParams::default() };
                GenerateParams { ignore_eos: true, sampling, ..GenerateParams::greedy(p, 32) }
            })
            .collect::<Vec<_>>()
    };
    let plain: Vec<Vec<u32>> = reqs().into_iter().map(|r| drain(spawn(model.clone(), Arc::new(Names), config(64, 64)).submit(r).unwrap().1).0).collect();
    let mut kept = 0;
    for (draft, auto) in [(false, false), (true, false), (true, true)] {
        let spec = Some(SpecConfig { k: 4, min_n: 1, max_n: 4, auto, draft });
        let engine = spawn_with_draft(model.clone(), draft.then(|| model.clone()), Arc::new(Names), EngineConfig { spec, ..config(128, 64) }, None).unwrap();
        let rxs: Vec<_> = reqs().into_iter().map(|r| engine.submit(r).unwrap().1).collect();
        let got: Vec<Vec<u32>> = rxs.into_iter().map(|rx| drain(rx).0).collect();
        assert_eq!(got, plain, "draft model {draft}, auto {auto}");
        wait_idle(&engine);
        kept += engine.stats().spec_accepted_tokens.load(Ordering::Relaxed);
    }
    assert!(kept > 0, "no guess was kept: the test did not speculate");
}

/// A request's usage reports the guesses kept and rejected; a prediction alone turns speculation on.
#[test]
fn usage_counts_kept_and_rejected_guesses() {
    let model = model();
    let engine = spawn(model.clone(), Arc::new(Names), config(64, 64));
    let p = prompt(7, 12);
    let plain = drain(engine.submit(GenerateParams { ignore_eos: true, ..GenerateParams::greedy(p.clone(), 24) }).unwrap().1).0;
    // the client predicts the answer exactly: every guess is kept
    let req = GenerateParams { ignore_eos: true, prediction: plain.clone(), ..GenerateParams::greedy(p.clone(), 24) };
    let (ids, _, _, usage) = drain_usage(engine.submit(req).unwrap().1);
    assert_eq!(ids, plain);
    assert!(usage.accepted_prediction_tokens >= 12, "{usage:?}");
    assert_eq!(usage.rejected_prediction_tokens, 0, "{usage:?}");
    assert_eq!(usage.completion_tokens, 24);
    // a wrong prediction (right about the first token, then off by one): guesses rejected, the same
    // answer
    let wrong: Vec<u32> = [*p.last().unwrap(), plain[0]].into_iter().chain(plain[1..].iter().map(|t| (t + 1) % 96)).collect();
    let req = GenerateParams { ignore_eos: true, prediction: wrong, ..GenerateParams::greedy(p, 24) };
    let (ids, _, _, usage) = drain_usage(engine.submit(req).unwrap().1);
    assert_eq!(ids, plain);
    assert!(usage.rejected_prediction_tokens > 0, "{usage:?}");
}

#[test]
fn aborted_and_abandoned_requests_free_their_blocks() {
    let model = model();
    let engine = spawn(model, Arc::new(Names), config(64, 64));
    let (id, mut rx) = engine.submit(GenerateParams::greedy(prompt(1, 20), 200)).unwrap();
    assert!(matches!(rx.blocking_recv(), Some(Event::Token { .. })));
    engine.abort(id);
    let mut reason = None;
    while let Some(ev) = rx.blocking_recv() {
        if let Event::Finished { reason: r, .. } = ev {
            reason = Some(r);
        }
    }
    assert_eq!(reason, Some(FinishReason::Abort));
    // a client that goes away without a word
    let (_, rx) = engine.submit(GenerateParams::greedy(prompt(2, 30), 200)).unwrap();
    drop(rx);
    let (ids, text, reason) = drain(engine.submit(GenerateParams::greedy(prompt(3, 5), 4)).unwrap().1);
    assert_eq!((ids.len(), reason), (4, FinishReason::Length));
    assert_eq!(text, ids.iter().map(|i| format!("<{i}>")).collect::<String>());
    wait_idle(&engine);
    assert_eq!(engine.stats().aborted_requests.load(Ordering::Relaxed), 2);
}

#[test]
fn bad_requests_are_refused_with_a_reason() {
    let engine = spawn(model(), Arc::new(Names), EngineConfig { max_waiting: 2, ..config(64, 64) });
    let err = engine.submit(GenerateParams::greedy(prompt(1, 300), 4)).unwrap_err();
    let invalid = |field, message: &str| RequestError::Invalid { field, message: message.into() };
    assert_eq!(err, invalid(Field::Prompt, "this model's maximum context length is 256 tokens; the prompt has 300 tokens"));
    assert!(matches!(engine.submit(GenerateParams::greedy(vec![500], 4)), Err(RequestError::Invalid { field: Field::Prompt, message }) if message.contains("outside the vocabulary")));
    assert!(matches!(engine.submit(GenerateParams::greedy(vec![], 4)), Err(RequestError::Invalid { field: Field::Prompt, .. })));
    let bad = GenerateParams { sampling: SamplingParams { top_p: 0.0, ..SamplingParams::default() }, ..GenerateParams::greedy(vec![1], 4) };
    assert!(matches!(engine.submit(bad), Err(RequestError::Invalid { field: Field::TopP, message }) if message.contains("top_p")));
    assert_eq!(engine.submit(GenerateParams::greedy(vec![1], 0)).unwrap_err(), invalid(Field::MaxTokens, "max_tokens must be at least 1. Given: 0"));
    // a prompt that fits the context (256) but not the whole KV pool (8 blocks of 4 tokens) is refused
    // up front, not failed after the stream has begun
    let small = spawn(model(), Arc::new(Names), config(8, 64));
    let err = small.submit(GenerateParams::greedy(prompt(2, 40), 4)).unwrap_err();
    assert_eq!(err, invalid(Field::Prompt, "the prompt has 40 tokens; the KV cache holds 32 tokens in all (raise --kv-memory)"));
    // the waiting limit: the engine may take some off the queue quickly, so submit until refused
    let mut held = Vec::new();
    let refused = (0..200).find_map(|i| match engine.submit(GenerateParams::greedy(prompt(i, 40), 100)) {
        Ok(ok) => {
            held.push(ok);
            None
        }
        Err(e) => Some(e),
    });
    assert!(matches!(refused, Some(RequestError::QueueFull { .. })), "{refused:?}");
}

/// Requests sharing a 37-token system prefix (9 blocks of 4 and one token), some repeated exactly, one
/// seeded sample.
fn shared_prefix_requests() -> Vec<GenerateParams> {
    let system = prompt(77, 37);
    (0..10u64)
        .map(|i| {
            let tail = prompt(200 + i % 6, 1 + (i as usize * 5) % 13);
            let mut r = GenerateParams::greedy([system.clone(), tail].concat(), 10);
            if i == 4 || i == 9 {
                r.sampling = SamplingParams { temperature: 0.9, seed: 5, ..SamplingParams::default() };
            }
            r
        })
        .collect()
}

#[test]
fn a_prefix_cache_hit_gives_the_tokens_of_a_cold_prefill() {
    let model = model();
    let cold = EngineConfig { prefix_caching: false, ..config(64, 64) };
    let reference: Vec<Vec<u32>> = shared_prefix_requests()
        .into_iter()
        .map(|r| drain(spawn(model.clone(), Arc::new(Names), cold).submit(r).unwrap().1).0)
        .collect();
    // one after another (each later request hits the blocks of the earlier ones), with two step budgets
    for budget in [64, 7] {
        let engine = spawn(model.clone(), Arc::new(Names), config(64, budget));
        let mut cached = Vec::new();
        for (i, r) in shared_prefix_requests().into_iter().enumerate() {
            let (ids, _, _, usage) = drain_usage(engine.submit(r).unwrap().1);
            assert_eq!(ids, reference[i], "request {i}, step budget {budget}");
            cached.push(usage.cached_tokens);
        }
        assert_eq!(cached[0], 0);
        assert!(cached[1..].iter().all(|&c| c >= 36), "the system prompt's 9 blocks are reused: {cached:?}");
        wait_idle(&engine);
        let hits = engine.stats().prefix_cache_hit_tokens.load(Ordering::Relaxed);
        assert_eq!(hits, cached.iter().sum::<usize>() as u64);
    }
    // all at once, under memory pressure (evictions and preemptions), after a warm-up
    let engine = spawn(model.clone(), Arc::new(Names), config(30, 64));
    drain(engine.submit(shared_prefix_requests().remove(0)).unwrap().1);
    let rxs: Vec<_> = shared_prefix_requests().into_iter().map(|r| engine.submit(r).unwrap().1).collect();
    let got: Vec<Vec<u32>> = rxs.into_iter().map(|rx| drain(rx).0).collect();
    assert_eq!(got, reference, "concurrent, with a small pool");
    wait_idle(&engine);
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("reckon-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn block_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "kvb")).collect();
    files.sort();
    files
}

#[test]
fn the_disk_tier_survives_a_restart_and_ignores_bad_files() {
    let model = model();
    let dir = temp_dir("disk-restart");
    let disk = Some(DiskTierConfig { dir: dir.clone(), max_bytes: 64 << 20 });
    let first = shared_prefix_requests().remove(1);
    let cold = EngineConfig { prefix_caching: false, ..config(64, 64) };
    let reference = drain(spawn(model.clone(), Arc::new(Names), cold).submit(first.clone()).unwrap().1).0;
    // first life: compute it, shut down (every cached block is written)
    let engine = spawn_with(model.clone(), Arc::new(Names), config(64, 64), disk.clone()).unwrap();
    assert_eq!(drain_usage(engine.submit(first.clone()).unwrap().1).3.cached_tokens, 0);
    engine.shutdown(std::time::Duration::ZERO);
    assert!(matches!(engine.submit(first.clone()), Err(RequestError::ShuttingDown)));
    let files = block_files(&dir);
    assert!(files.len() >= 9, "the prompt's full blocks are on disk: {files:?}");
    // second life: the same prompt is read back, not computed, and gives the same tokens
    let engine = spawn_with(model.clone(), Arc::new(Names), config(64, 64), disk.clone()).unwrap();
    let (ids, _, _, usage) = drain_usage(engine.submit(first.clone()).unwrap().1);
    assert_eq!(ids, reference);
    assert!(usage.cached_tokens >= 36, "cached {}", usage.cached_tokens);
    assert_eq!(engine.stats().prefix_cache_disk_hit_tokens.load(Ordering::Relaxed), usage.cached_tokens as u64);
    engine.shutdown(std::time::Duration::ZERO);
    // a client that drops its engine handle at once still gets the disk read and every token
    let rx = spawn_with(model.clone(), Arc::new(Names), config(64, 64), disk.clone()).unwrap().submit(first.clone()).unwrap().1;
    let (ids, _, reason, usage) = drain_usage(rx);
    assert_eq!((ids, reason), (reference.clone(), FinishReason::Length));
    assert!(usage.cached_tokens >= 36, "cached {}", usage.cached_tokens);
    // another model with the same directory finds nothing
    let other = Arc::new(Model::load(GgufFile::from_vec(tiny_model(&TinySpec::llama(GgmlType::Q4_1), 12)).unwrap()).unwrap());
    let engine = spawn_with(other, Arc::new(Names), config(64, 64), disk.clone()).unwrap();
    assert_eq!(drain_usage(engine.submit(first.clone()).unwrap().1).3.cached_tokens, 0);
    engine.shutdown(std::time::Duration::ZERO);
    // damaged files, every other one with a flipped data byte, the rest truncated: none is served and the
    // tokens stay right
    for f in block_files(&dir) {
        std::fs::remove_file(f).unwrap();
    }
    let engine = spawn_with(model.clone(), Arc::new(Names), config(64, 64), disk.clone()).unwrap();
    drain(engine.submit(first.clone()).unwrap().1);
    engine.shutdown(std::time::Duration::ZERO);
    for (i, f) in block_files(&dir).into_iter().enumerate() {
        let mut bytes = std::fs::read(&f).unwrap();
        let last = bytes.len() - 1;
        if i % 2 == 0 {
            bytes[last] ^= 0x40;
        } else {
            bytes.truncate(last - 100);
        }
        std::fs::write(&f, &bytes).unwrap();
    }
    let engine = spawn_with(model.clone(), Arc::new(Names), config(64, 64), disk).unwrap();
    let (ids, _, _, usage) = drain_usage(engine.submit(first).unwrap().1);
    assert_eq!((ids, usage.cached_tokens), (reference, 0));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Runs `shared_prefix_requests()[0]` on an engine of 16 blocks of 4 tokens with a disk tier (and
/// `window`), pushes its blocks out of memory with other prompts, waits until they are on disk, and
/// runs it again: asserts the tokens are a cold engine's, and returns (cached tokens of the second run,
/// the engine's disk-hit tokens).
fn evict_to_disk_and_run_again(name: &str, window: Option<KvWindow>) -> (usize, u64) {
    let model = model();
    let dir = temp_dir(name);
    let disk = Some(DiskTierConfig { dir: dir.clone(), max_bytes: 64 << 20 });
    let requests = shared_prefix_requests();
    let cold = EngineConfig { prefix_caching: false, kv_window: window, ..config(64, 64) };
    let reference = drain(spawn(model.clone(), Arc::new(Names), cold).submit(requests[0].clone()).unwrap().1).0;
    let engine = spawn_with(model.clone(), Arc::new(Names), EngineConfig { kv_window: window, ..config(16, 64) }, disk).unwrap();
    drain(engine.submit(requests[0].clone()).unwrap().1);
    for seed in 0..4 {
        drain(engine.submit(GenerateParams::greedy(prompt(900 + seed, 40), 4)).unwrap().1);
    }
    // the writer runs in the background: poke the engine (stats are published after each step) until it
    // has indexed the evicted blocks
    let stats = engine.stats();
    for i in 0..1000 {
        if stats.prefix_cache_disk_blocks.load(Ordering::Relaxed) >= 11 {
            break;
        }
        assert!(i < 999, "the evicted blocks never reached the disk tier");
        drain(engine.submit(GenerateParams::greedy(vec![1], 1)).unwrap().1);
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let (ids, _, _, usage) = drain_usage(engine.submit(requests[0].clone()).unwrap().1);
    assert_eq!(ids, reference);
    let disk_hit = stats.prefix_cache_disk_hit_tokens.load(Ordering::Relaxed);
    engine.shutdown(std::time::Duration::ZERO);
    std::fs::remove_dir_all(&dir).unwrap();
    (usage.cached_tokens, disk_hit)
}

#[test]
fn blocks_evicted_from_memory_are_read_back_from_disk() {
    // 9 full blocks are on disk; a request restores at most half the pool (8 blocks)
    assert_eq!(evict_to_disk_and_run_again("disk-evict", None), (32, 32));
}

/// The same under a KV window: the blocks a windowed request released stay cached, reach the disk tier
/// when evicted, and a later request's hit (its sink block and its window, read back from disk) gives
/// the tokens of a cold windowed prefill.
#[test]
fn windowed_blocks_evicted_from_memory_are_read_back_from_disk() {
    // the read starts where memory's hit ends (here at block 0) and loads at most half the pool, 8
    // blocks, but only those the query after it attends to (the sink block and the window's): so it
    // reaches the prompt's last full block (9 blocks of 4), and skips the gap between
    assert_eq!(evict_to_disk_and_run_again("disk-evict-window", Some(KvWindow { window: 12, sinks: 4 })), (36, 36));
}

/// Sparse prefill in the engine (`EngineConfig::spec_prefill`, scored by the model's own first layer):
/// a long prompt is thinned to about the kept share and answered; usage counts the whole prompt; the
/// same prompt again finds in the prefix cache only what the first request computed of the prompt's
/// own beginning (its first chunk), never a thinned block; a short prompt is prefilled whole, with the
/// tokens of an engine without sparse prefill.
#[test]
fn a_sparse_prefill_answers_from_the_kept_tokens_and_caches_only_a_true_prefix() {
    use reckon_engine::engine::sparse::SparsePrefillConfig;
    let model = model();
    let sparse = SparsePrefillConfig { keep: 0.5, min_tokens: 64, layers: 1, lookahead: 4, chunk: 8, recover: false, ..SparsePrefillConfig::default() };
    let engine = spawn(model.clone(), Arc::new(Names), EngineConfig { spec_prefill: Some(sparse), ..config(128, 64) });
    let long = prompt(31, 120);
    let (ids, _, reason, usage) = drain_usage(engine.submit(GenerateParams { ignore_eos: true, ..GenerateParams::greedy(long.clone(), 8) }).unwrap().1);
    assert_eq!((ids.len(), reason, usage.prompt_tokens), (8, FinishReason::Length, 120));
    let st = engine.stats();
    let dropped = st.spec_prefill_dropped_tokens.load(Ordering::Relaxed);
    assert_eq!(st.spec_prefill_requests.load(Ordering::Relaxed), 1);
    assert!((48..=64).contains(&dropped), "about half of 120 dropped: {dropped}");
    // again: the first chunk (8 tokens, two 4-token blocks) is the only true prefix it computed
    let (_, _, _, usage) = drain_usage(engine.submit(GenerateParams { ignore_eos: true, ..GenerateParams::greedy(long.clone(), 8) }).unwrap().1);
    assert_eq!(usage.cached_tokens, 8);
    wait_idle(&engine);
    // a prompt below the threshold: prefilled whole, the plain engine's tokens
    let short = prompt(32, 40);
    let plain = drain(spawn(model.clone(), Arc::new(Names), config(64, 64)).submit(GenerateParams::greedy(short.clone(), 12)).unwrap().1).0;
    assert_eq!(drain(engine.submit(GenerateParams::greedy(short, 12)).unwrap().1).0, plain);
    assert_eq!(st.spec_prefill_requests.load(Ordering::Relaxed), 2);
    // a request's own word: off on this engine, or a keep ratio on an engine without sparse prefill
    use reckon_engine::engine::sparse::SpecPrefillChoice;
    drain(engine.submit(GenerateParams { spec_prefill: Some(SpecPrefillChoice::Off), ..GenerateParams::greedy(long.clone(), 4) }).unwrap().1);
    assert_eq!(st.spec_prefill_requests.load(Ordering::Relaxed), 2, "not thinned");
    let plain = spawn(model.clone(), Arc::new(Names), config(128, 64));
    drain(plain.submit(GenerateParams { spec_prefill: Some(SpecPrefillChoice::Keep(0.5)), ..GenerateParams::greedy(prompt(34, 200), 4) }).unwrap().1);
    assert_eq!(plain.stats().spec_prefill_requests.load(Ordering::Relaxed), 0, "below the default minimum of 4096 tokens");
    assert!(matches!(plain.submit(GenerateParams { spec_prefill: Some(SpecPrefillChoice::Keep(0.0)), ..GenerateParams::greedy(prompt(34, 20), 4) }), Err(RequestError::Invalid { field: Field::SpecPrefill, .. })));
}

/// Idle recovery of a sparse prefill (`SparsePrefillConfig::recover`): once the engine is idle it
/// recomputes the full prompt in the background; the same prompt then finds every full block in the
/// prefix cache and gets exactly the tokens of a full prefill. A request arriving meanwhile is served,
/// and the recovery still completes.
#[test]
fn idle_recovery_gives_a_later_turn_the_full_prefix() {
    use reckon_engine::engine::sparse::SparsePrefillConfig;
    let model = model();
    let sparse = SparsePrefillConfig { keep: 0.5, min_tokens: 64, layers: 1, lookahead: 4, chunk: 8, recover: true, recover_slice: 8, ..SparsePrefillConfig::default() };
    let engine = spawn(model.clone(), Arc::new(Names), EngineConfig { spec_prefill: Some(sparse), ..config(128, 16) });
    let long = prompt(41, 120);
    let full = drain(spawn(model.clone(), Arc::new(Names), config(128, 64)).submit(GenerateParams::greedy(long.clone(), 10)).unwrap().1).0;
    drain(engine.submit(GenerateParams::greedy(long.clone(), 10)).unwrap().1);
    // another request right away: it stops the recovery (or comes before it), and is served
    let other = prompt(42, 20);
    let other_plain = drain(spawn(model.clone(), Arc::new(Names), config(64, 64)).submit(GenerateParams::greedy(other.clone(), 6)).unwrap().1).0;
    assert_eq!(drain(engine.submit(GenerateParams::greedy(other, 6)).unwrap().1).0, other_plain);
    let st = engine.stats();
    for _ in 0..2000 {
        if st.spec_prefill_recovery_debt.load(Ordering::Relaxed) == 0 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    assert_eq!(st.spec_prefill_recovery_debt.load(Ordering::Relaxed), 0, "recovery finished");
    let (steps, recovered) = (st.spec_prefill_recovery_steps.load(Ordering::Relaxed), st.spec_prefill_recovered_tokens.load(Ordering::Relaxed));
    assert!(recovered >= 64 && recovered <= 8 * steps, "slices of at most 8 tokens (the step's budget is 16): {recovered} tokens in {steps} steps");
    wait_idle(&engine);
    let (ids, _, _, usage) = drain_usage(engine.submit(GenerateParams::greedy(long.clone(), 10)).unwrap().1);
    assert_eq!(usage.cached_tokens, 116, "every full block of the prompt");
    assert_eq!(ids, full, "the tokens of a full prefill");
    assert_eq!(st.spec_prefill_requests.load(Ordering::Relaxed), 1, "the second turn was not thinned");
    // (the counter follows the last event by a moment)
    for _ in 0..500 {
        if st.finished_requests.load(Ordering::Relaxed) >= 3 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(st.finished_requests.load(Ordering::Relaxed), 3, "the recovery is not counted");
}

/// Scoring a long prompt for a sparse prefill does not hold up the others: the engine holds the scored
/// request and runs its scoring pass a slice (the step's budget) per step, beside the other requests'
/// steps. Driven step by step: a request that arrives after a long prompt still finishes before the
/// long prompt's first token, and the long prompt's tokens are those of the same engine scoring it in
/// one go (`sparse::plan`) and thinning it the same way.
#[test]
fn scoring_runs_a_slice_a_step_beside_other_requests() {
    use reckon_engine::engine::sparse::SparsePrefillConfig;
    use reckon_engine::engine::{validate, Engine};
    use std::time::Instant;
    let model = model();
    let sparse = SparsePrefillConfig { keep: 0.5, min_tokens: 64, layers: 1, lookahead: 4, chunk: 8, ..SparsePrefillConfig::default() };
    let cfg = EngineConfig { spec_prefill: Some(sparse), ..config(256, 16) };
    let mut engine = Engine::new(model.clone(), None, Arc::new(Names), cfg, None).unwrap();
    let limits = engine.limits();
    let (long, short) = (prompt(51, 200), prompt(52, 10));
    let (tx_long, mut rx_long) = tokio::sync::mpsc::unbounded_channel();
    let (tx_short, mut rx_short) = tokio::sync::mpsc::unbounded_channel();
    engine.add_request(1, validate(GenerateParams { ignore_eos: true, ..GenerateParams::greedy(long.clone(), 4) }, &limits).unwrap(), tx_long, Instant::now(), None);
    engine.add_request(2, validate(GenerateParams { ignore_eos: true, ..GenerateParams::greedy(short.clone(), 5) }, &limits).unwrap(), tx_short, Instant::now(), None);
    let (mut short_done, mut long_first, mut long_ids) = (None, None, Vec::new());
    for step in 0..200 {
        if !engine.has_work() {
            break;
        }
        engine.step();
        while let Ok(e) = rx_short.try_recv() {
            if matches!(e, Event::Finished { .. }) {
                short_done = Some(step);
            }
        }
        while let Ok(e) = rx_long.try_recv() {
            if let Event::Token { id, .. } = e {
                long_first.get_or_insert(step);
                long_ids.push(id);
            }
        }
    }
    let (short_done, long_first) = (short_done.expect("short finished"), long_first.expect("long answered"));
    // 200 tokens less 4 look-ahead in 16-token slices: 13 slices, the look-ahead step, then the prefill
    assert!(short_done < long_first && long_first >= 13, "short done at step {short_done}, long's first token at {long_first}");
    let st = engine.stats();
    assert_eq!(st.spec_prefill_requests.load(Ordering::Relaxed), 1);
    // the same thinning as scoring in one go on an engine without it
    let kept = reckon_engine::engine::sparse::plan(&model, &long, 0, &sparse).unwrap();
    assert_eq!(st.spec_prefill_dropped_tokens.load(Ordering::Relaxed), (200 - kept.len()) as u64);
    let again = spawn(model.clone(), Arc::new(Names), EngineConfig { spec_prefill: Some(sparse), ..config(256, 512) });
    assert_eq!(drain(again.submit(GenerateParams { ignore_eos: true, ..GenerateParams::greedy(long, 4) }).unwrap().1).0, long_ids);
}

/// A grammar that fails mid-answer ends its request with an error event (the servers send it in each
/// API's error shape), never unconstrained text presented as constrained; other requests go on, and the
/// failed one's blocks return to the pool.
#[test]
fn a_grammar_that_fails_mid_answer_ends_its_request_with_an_error() {
    use reckon_engine::grammar::{Grammar, GrammarCompiler};
    use reckon_engine::tokenizer::Tokenizer;
    let file = GgufFile::from_vec(common::tiny_chat_model(&TinySpec::llama(GgmlType::Q8_0), 3, 512)).unwrap();
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let model = Arc::new(Model::load(file).unwrap());
    let compiler = GrammarCompiler::new(tokenizer.clone(), model.config.vocab_size).unwrap();
    let grammar = Grammar::Lark("start: /[a-z]+/\n".into());
    let engine = spawn(model, tokenizer.clone(), config(64, 64));
    let prompt: Vec<u32> = tokenizer.encode("hello there", false, false).unwrap();
    let constrained = |c| GenerateParams { constraint: Some(c), ignore_eos: true, ..GenerateParams::greedy(prompt.clone(), 12) };
    // the same grammar whole: letters only, 12 tokens
    let whole = Completion::wait(engine.submit(constrained(compiler.compile(&grammar).unwrap())).unwrap().1).unwrap();
    assert!(whole.text.chars().all(|c| c.is_ascii_lowercase()) && whole.usage.completion_tokens > 3, "{whole:?}");
    // failing after 3 tokens, beside an unconstrained request: 3 tokens, then the error
    let (_, mut failing) = engine.submit(constrained(compiler.compile(&grammar).unwrap().failing_after(3))).unwrap();
    let other = engine.submit(GenerateParams { ignore_eos: true, ..GenerateParams::greedy(prompt.clone(), 12) }).unwrap().1;
    let mut tokens = Vec::new();
    let error = loop {
        match failing.blocking_recv() {
            Some(Event::Token { id, .. }) => tokens.push(id),
            Some(Event::Error(e)) => break e,
            other => panic!("expected tokens then an error, got {other:?}"),
        }
    };
    assert_eq!(tokens, whole.ids[..3], "the tokens before the failure are the grammar's");
    assert!(error.contains("constrained decoding failed after 3 tokens"), "{error}");
    assert!(failing.blocking_recv().is_none(), "nothing follows the error");
    assert_eq!(Completion::wait(other).unwrap().usage.completion_tokens, 12, "the other request is not affected");
    wait_idle(&engine);
    assert_eq!(engine.stats().failed_requests.load(Ordering::Relaxed), 1);
}

/// KV-cache events through the engine (`Engine::with_kv_events`): a prompt's full blocks are stored in
/// memory, chained, with their token ids; blocks evicted from memory are removed there and stored on the
/// disk tier under the same keys, parents and tokens.
#[test]
fn kv_events_follow_blocks_from_memory_to_the_disk_tier() {
    use reckon_engine::engine::{spawn_engine, Engine};
    use reckon_engine::kv::{KvEvent, Medium};
    use std::sync::Mutex;
    let model = model();
    let dir = temp_dir("kv-events");
    let disk = Some(DiskTierConfig { dir: dir.clone(), max_bytes: 64 << 20 });
    let seen: Arc<Mutex<Vec<KvEvent>>> = Default::default();
    let sink = seen.clone();
    let engine = Engine::new(model, None, Arc::new(Names), config(16, 64), disk).unwrap().with_kv_events(Arc::new(move |e| sink.lock().unwrap().extend(e)));
    let engine = spawn_engine(engine).unwrap();
    let a = prompt(31, 33); // 8 full blocks of 4 and a token
    drain(engine.submit(GenerateParams::greedy(a.clone(), 2)).unwrap().1);
    let stored: Vec<(u128, Option<u128>, Vec<u32>)> = seen.lock().unwrap().iter().filter_map(|e| match e {
        KvEvent::BlockStored { hash, parent, tokens, medium: Medium::Memory } => Some((*hash, *parent, tokens.to_vec())),
        _ => None,
    }).collect();
    assert_eq!(stored.len(), 8);
    for (j, (_, parent, tokens)) in stored.iter().enumerate() {
        assert_eq!(tokens[..], a[j * 4..(j + 1) * 4]);
        assert_eq!(*parent, j.checked_sub(1).map(|p| stored[p].0), "block {j}'s parent");
    }
    // another prompt takes the 16-block pool: a's blocks go to disk
    drain(engine.submit(GenerateParams::greedy(prompt(32, 50), 2)).unwrap().1);
    for i in 0..1000 {
        let on_disk = seen.lock().unwrap().iter().filter(|e| matches!(e, KvEvent::BlockStored { medium: Medium::Disk, .. })).count();
        if on_disk >= 4 {
            break;
        }
        assert!(i < 999, "no disk events");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let events = seen.lock().unwrap().clone();
    let removed: Vec<u128> = events.iter().filter_map(|e| match e { KvEvent::BlockRemoved { hash, medium: Medium::Memory } => Some(*hash), _ => None }).collect();
    let on_disk: Vec<(u128, Option<u128>, Vec<u32>)> = events.iter().filter_map(|e| match e {
        KvEvent::BlockStored { hash, parent, tokens, medium: Medium::Disk } => Some((*hash, *parent, tokens.to_vec())),
        _ => None,
    }).collect();
    assert!(removed.len() >= 4, "a's blocks left memory: {removed:?}");
    for d in &on_disk {
        assert!(stored.contains(d), "a block on disk is one stored in memory, same key, parent and tokens");
        assert!(removed.contains(&d.0), "and removed from memory");
    }
    engine.shutdown(std::time::Duration::ZERO);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `Names`, until the test arms it: then the next token's text panics on the engine thread (the test's
/// own fault hook; nothing in the engine carries one).
struct Faulty(std::sync::atomic::AtomicBool);

impl Detokenizer for Faulty {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        assert!(!self.0.load(Ordering::Relaxed), "injected fault");
        Names.token_bytes(id)
    }
    fn is_end_of_generation(&self, _: u32) -> bool {
        false
    }
}

/// A panic on the engine thread fails every request in flight and every later submit with the reason,
/// answers a shutdown at once, and writes nothing to the disk tier, not even the blocks a clean
/// shutdown would have saved.
#[test]
fn a_panicked_engine_fails_every_request_and_writes_no_more_to_disk() {
    let model = model();
    let dir = temp_dir("disk-panic");
    let disk = Some(DiskTierConfig { dir: dir.clone(), max_bytes: 64 << 20 });
    let fault = Arc::new(Faulty(Default::default()));
    let engine = spawn_with(model, fault.clone(), config(64, 64), disk).unwrap();
    // a finished request leaves cached blocks a clean shutdown would write
    drain(engine.submit(shared_prefix_requests().remove(1)).unwrap().1);
    assert!(engine.failure().is_none());
    let mut running = engine.submit(GenerateParams { ignore_eos: true, ..GenerateParams::greedy(prompt(3, 10), 200) }).unwrap().1;
    assert!(matches!(running.blocking_recv(), Some(Event::Token { .. })));
    fault.0.store(true, Ordering::Relaxed);
    let last = std::iter::from_fn(|| running.blocking_recv()).last();
    match last {
        Some(Event::Error(m)) => assert!(m.contains("the engine failed") && m.contains("injected fault"), "{m}"),
        other => panic!("the running request ended with {other:?}"),
    }
    assert!(engine.failure().is_some_and(|w| w.contains("injected fault")));
    assert!(matches!(engine.submit(GenerateParams::greedy(prompt(4, 10), 4)), Err(RequestError::Failed(_))));
    engine.shutdown(std::time::Duration::from_secs(5));
    assert_eq!(block_files(&dir), Vec::<std::path::PathBuf>::new(), "a failed engine saved its cache");
    assert_eq!(engine.stats().failed_requests.load(Ordering::Relaxed), 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A reasoning budget (`engine::reasoning`): after that many tokens inside the block the closing tokens
/// are forced and generation goes on; the tokens before are the unbudgeted greedy ones.
#[test]
fn a_spent_reasoning_budget_forces_the_closing_tokens() {
    let engine = spawn(model(), Arc::new(Names), config(64, 64));
    let plain = drain(engine.submit(GenerateParams { ignore_eos: true, ..GenerateParams::greedy(prompt(9, 12), 10) }).unwrap().1).0;
    let budget = reckon_engine::engine::ReasoningBudget { tokens: 3, open: vec![90], close: vec![91, 92], starts_inside: true };
    let capped = drain(engine.submit(GenerateParams { ignore_eos: true, reasoning_budget: Some(budget), ..GenerateParams::greedy(prompt(9, 12), 10) }).unwrap().1).0;
    assert_eq!(capped[..3], plain[..3]);
    assert_eq!(capped[3..5], [91, 92], "{capped:?}");
    assert_eq!(capped.len(), 10);
}

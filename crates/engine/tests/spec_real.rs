//! Speculative decoding on the real models (`engine::spec`): greedy output with the n-gram proposer is
//! token for token the output without it, in both numerics, on a code-edit prompt whose answer repeats the prompt (where
//! prompt lookup pays), and guesses were kept. A model that has not been fetched is skipped with a note,
//! unless RECKON_REQUIRE_MODELS=1 (CI).

mod common;

use common::open_real_model as open;
use reckon_engine::engine::spec::SpecConfig;
use reckon_engine::engine::{spawn, Completion, EngineConfig, GenerateParams};
use reckon_engine::model::{Model, Numerics};
use reckon_engine::tokenizer::Tokenizer;
use std::sync::atomic::Ordering;
use std::sync::Arc;

const CODE: &str = "def moving_average(values, window):\n    if window <= 0:\n        raise ValueError(\"window must be positive\")\n    out = []\n    total = 0.0\n    for i, v in enumerate(values):\n        total += v\n        if i >= window:\n            total -= values[i - window]\n        if i + 1 >= window:\n            out.append(total / window)\n    return out\n";

fn check(name: &str) {
    for numerics in [Numerics::Packed, Numerics::Ggml] {
        check_with(name, numerics);
    }
}

fn check_with(name: &str, numerics: Numerics) {
    let Some(file) = open(name) else { return };
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let model = Arc::new(Model::load_with(file, numerics).unwrap());
    // the file, then the same file again with one name changed, started: the rest is a copy
    let text = format!("# moving.py\n{CODE}\n# moving.py, with `total` renamed to `acc`\n{}", &CODE.replace("total", "acc")[..40]);
    let prompt = tokenizer.encode(&text, true, false).unwrap();
    let run = |spec: Option<SpecConfig>, budget: usize| {
        let engine = spawn(model.clone(), tokenizer.clone(), EngineConfig { block_size: 16, num_blocks: 256, max_batch_tokens: budget, max_model_len: 2048, spec, ..EngineConfig::default() });
        let req = GenerateParams { ignore_eos: true, ..GenerateParams::greedy(prompt.clone(), 96) };
        let c = Completion::wait(engine.submit(req).unwrap().1).unwrap();
        let st = engine.stats();
        (c.ids, st.spec_draft_tokens.load(Ordering::Relaxed), st.spec_accepted_tokens.load(Ordering::Relaxed))
    };
    let (plain, _, _) = run(None, 512);
    let auto = SpecConfig { k: 8, auto: true, ..SpecConfig::default() };
    for (spec, budget) in [(SpecConfig::default(), 512), (SpecConfig { k: 8, min_n: 1, max_n: 5, auto: false, draft: false }, 512), (SpecConfig::default(), 3), (auto, 512)] {
        let (ids, drafted, accepted) = run(Some(spec.clone()), budget);
        assert_eq!(ids, plain, "{name} {numerics:?}: speculation {spec:?}, step budget {budget} changed the greedy output");
        assert!(accepted > 0, "{name}: no guess kept ({drafted} drafted)");
        eprintln!("{name} {numerics:?} {spec:?} budget {budget}: {accepted} of {drafted} guesses kept, output identical");
    }
}

#[test]
fn ngram_speculation_is_exact_smollm2() {
    check("smollm2-135m");
}

#[test]
fn ngram_speculation_is_exact_qwen2() {
    check("qwen2.5-coder-0.5b");
}

#[test]
fn ngram_speculation_is_exact_gemma3() {
    check("gemma3-270m");
}

/// A draft model on a real model: Qwen2.5-Coder-0.5B drafts for itself in the other numerics (ggml
/// for packed and back: logits that differ in the last bits, so near-ties are guessed wrong), fixed k
/// and the controller, alone and with a 3-token step budget; greedy output token for token the output
/// without it. Then the real pair: the 0.5B drafting for Qwen2.5-Coder-1.5B (`scripts/fetch-models
/// qwen2.5-coder-1.5b`, which CI runs), whose guesses the 1.5B rejects where the two models differ.
#[test]
fn draft_model_speculation_is_exact_qwen2() {
    let Some(file) = open("qwen2.5-coder-0.5b") else { return };
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let path = common::real_model_path("qwen2.5-coder-0.5b");
    let load = |p: &std::path::Path, n: Numerics| Arc::new(Model::load_with(reckon_engine::gguf::GgufFile::open(p).unwrap(), n).unwrap());
    let text = "Write a Python function that returns the n-th Fibonacci number, with a docstring and a loop.";
    let prompt = tokenizer.encode(text, true, false).unwrap();
    let mut pairs = vec![("0.5B packed, draft 0.5B ggml", load(&path, Numerics::Packed), load(&path, Numerics::Ggml)), ("0.5B ggml, draft 0.5B packed", load(&path, Numerics::Ggml), load(&path, Numerics::Packed))];
    if common::open_real_model("qwen2.5-coder-1.5b").is_some() {
        let big = common::real_model_path("qwen2.5-coder-1.5b");
        pairs.push(("1.5B packed, draft 0.5B packed", load(&big, Numerics::Packed), load(&path, Numerics::Packed)));
    }
    for (what, model, draft) in pairs {
        let run = |spec: Option<SpecConfig>, budget: usize| {
            let config = EngineConfig { block_size: 16, num_blocks: 64, max_batch_tokens: budget, max_model_len: 1024, spec, ..EngineConfig::default() };
            let d = spec.filter(|s| s.draft).map(|_| draft.clone());
            let engine = reckon_engine::engine::spawn_with_draft(model.clone(), d, tokenizer.clone(), config, None).unwrap();
            let req = GenerateParams { ignore_eos: true, ..GenerateParams::greedy(prompt.clone(), 48) };
            let c = Completion::wait(engine.submit(req).unwrap().1).unwrap();
            let st = engine.stats();
            (c.ids, st.spec_draft_tokens.load(Ordering::Relaxed), st.spec_accepted_tokens.load(Ordering::Relaxed))
        };
        let (plain, _, _) = run(None, 512);
        for (spec, budget) in [(SpecConfig { k: 4, draft: true, ..SpecConfig::default() }, 512), (SpecConfig { k: 4, draft: true, ..SpecConfig::default() }, 3), (SpecConfig { k: 6, draft: true, auto: true, ..SpecConfig::default() }, 512)] {
            let (ids, drafted, accepted) = run(Some(spec), budget);
            assert_eq!(ids, plain, "{what}: {spec:?}, step budget {budget} changed the greedy output");
            assert!(accepted > 0, "{what}: no guess kept ({drafted} drafted)");
            if what.starts_with("1.5B") {
                // two different models: some guesses are rejected, and the output is still the 1.5B's own
                assert!(accepted < drafted, "{what}: every one of {drafted} guesses kept: no rejection was exercised");
            }
            eprintln!("{what} {spec:?} budget {budget}: {accepted} of {drafted} guesses kept, output identical");
        }
    }
}

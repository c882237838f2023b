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
    for (spec, budget) in [(SpecConfig::default(), 512), (SpecConfig { k: 8, min_n: 1, max_n: 5, auto: false }, 512), (SpecConfig::default(), 3), (auto, 512)] {
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

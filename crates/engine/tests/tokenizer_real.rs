//! Checks the tokenizers of the real models against llama.cpp fixtures (tests/fixtures/tokenizer/*.json,
//! recorded by bench/record_tokenizer_fixtures.py). A model that has not been fetched is skipped with a
//! note; the models directory is $RECKON_HOME, default ~/.cache/reckon/models.

use reckon_engine::gguf::GgufFile;
use reckon_engine::tokenizer::{IncrementalDecoder, Tokenizer};
use serde_json::Value;
use std::path::PathBuf;
use std::time::Instant;

fn models_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("RECKON_HOME").filter(|h| !h.is_empty()) {
        return PathBuf::from(home);
    }
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("reckon").join("models")
}

/// The committed fixtures, or another directory of the same format (e.g. a large random set made with
/// `record_tokenizer_fixtures.py --fuzz N --out DIR`) named by $RECKON_TOKENIZER_FIXTURES.
fn fixture(name: &str) -> Value {
    let dir = match std::env::var_os("RECKON_TOKENIZER_FIXTURES").filter(|d| !d.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer"),
    };
    let path = dir.join(format!("{name}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("fixture is JSON")
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array().expect("id list").iter().map(|x| x.as_u64().expect("id") as u32).collect()
}

/// Loads the model's tokenizer, or None (with a note) when the model file is absent.
fn load(file: &str) -> Option<Tokenizer> {
    let path = models_dir().join(file);
    if !path.exists() {
        eprintln!("note: {} not found; skipping (fetch it with scripts/fetch-models)", path.display());
        return None;
    }
    let gguf = GgufFile::open(&path).expect("open model");
    let start = Instant::now();
    let tok = Tokenizer::from_gguf(&gguf).expect("tokenizer");
    let ms = start.elapsed().as_secs_f64() * 1e3;
    eprintln!("{file}: tokenizer built in {ms:.1} ms ({} tokens)", tok.vocab_size());
    Some(tok)
}

fn check_against_fixture(name: &str, file: &str) {
    let Some(tok) = load(file) else { return };
    let fx = fixture(name);
    assert_eq!(tok.vocab_size() as u64, fx["n_vocab"].as_u64().unwrap());
    assert_eq!(tok.bos_id().map(u64::from), fx["bos"].as_u64(), "bos");
    assert_eq!(tok.eos_id().map(u64::from), fx["eos"].as_u64(), "eos");
    assert_eq!(tok.eog_ids(), ids_of(&fx["eog"]), "end-of-generation ids");

    let mut failures = Vec::new();
    let mut longest = (0usize, 0.0f64);
    for case in fx["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let add_special = case["add_special"].as_bool().unwrap();
        let parse_special = case["parse_special"].as_bool().unwrap();
        let want = ids_of(&case["ids"]);
        let start = Instant::now();
        let got = tok.encode(text, add_special, parse_special).expect("encode");
        let ms = start.elapsed().as_secs_f64() * 1e3;
        if want.len() > longest.0 {
            longest = (want.len(), ms);
        }
        let label = format!("{text:?} add_special={add_special} parse_special={parse_special}");
        if got != want {
            failures.push(format!("ids differ for {label}\n  llama.cpp: {want:?}\n  reckon:    {got:?}"));
            continue;
        }
        for (render, key) in [(false, "detok"), (true, "detok_special")] {
            let expected = case[key].as_str().unwrap();
            let decoded = tok.decode(&want, render);
            if decoded != expected {
                failures
                    .push(format!("{key} differs for {label}\n  llama.cpp: {expected:?}\n  reckon:    {decoded:?}"));
            }
            let mut dec = IncrementalDecoder::new(&tok, render);
            let mut streamed: String = want.iter().map(|&id| dec.push(id)).collect();
            streamed += &dec.finish();
            if streamed != decoded {
                failures.push(format!("incremental decode differs for {label}: {streamed:?} vs {decoded:?}"));
            }
        }
    }
    eprintln!("{file}: longest case ({} tokens) encoded in {:.2} ms", longest.0, longest.1);
    assert!(longest.1 < 500.0, "encoding {} tokens took {:.0} ms", longest.0, longest.1);
    let shown: Vec<&str> = failures.iter().take(20).map(String::as_str).collect();
    assert!(failures.is_empty(), "{} mismatches with llama.cpp:\n{}", failures.len(), shown.join("\n"));
}

#[test]
fn tokenizer_smollm2_matches_llama_cpp() {
    check_against_fixture("smollm2-135m", "SmolLM2-135M-Instruct.Q4_1.gguf");
}

#[test]
fn tokenizer_qwen25_coder_matches_llama_cpp() {
    check_against_fixture("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
}

#[test]
fn tokenizer_gemma3_matches_llama_cpp() {
    check_against_fixture("gemma3-270m", "gemma-3-270m-q4_k_m.gguf");
}

#[test]
fn tokenizer_smollm2_known_sentence() {
    let Some(tok) = load("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let start = Instant::now();
    let ids = tok.encode("Hello, world! The quick brown fox.", true, true).unwrap();
    eprintln!("first encode {:?}", start.elapsed());
    let start = Instant::now();
    tok.encode("café", true, true).unwrap();
    eprintln!("first non-ascii encode {:?}", start.elapsed());
    assert_eq!(ids, [19556, 28, 905, 17, 378, 2365, 6354, 16438, 30]);
    assert_eq!(tok.decode(&ids, false), "Hello, world! The quick brown fox.");
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    assert!(tok.is_eog(2));
}

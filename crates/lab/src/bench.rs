//! `reckon bench`: llama-bench-style prefill (pp) and decode (tg) throughput, optionally at a context depth.
//!
//! A pp test times the prefill of `n_prompt` tokens after `n_depth` tokens already in the KV cache; a tg
//! test times `n_gen` single-token decode steps after the depth. Tokens are seeded pseudo-random ids (as
//! llama-bench's), so runs are comparable. One untimed warm-up precedes the timed repetitions.

use crate::stats::{summarize, Summary};
use reckon_engine::model::Model;
use reckon_engine::sampler::Rng;
use reckon_engine::session::Session;
use reckon_engine::Result;
use serde::Serialize;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct BenchSpec {
    pub n_prompt: usize,
    pub n_gen: usize,
    pub n_depth: usize,
    pub reps: usize,
    pub threads: usize,
    /// Tokens per prefill step (llama-bench's n_ubatch).
    pub chunk: usize,
}

/// One test's result; field names follow llama-bench's JSON where they overlap.
#[derive(Clone, Debug, Serialize)]
pub struct BenchResult {
    pub model: String,
    /// The matmul arithmetic ("packed" or "ggml").
    pub numerics: &'static str,
    pub n_prompt: usize,
    pub n_gen: usize,
    pub n_depth: usize,
    pub threads: usize,
    pub tokens_per_s: Vec<f64>,
    pub tokens_per_s_median: f64,
    pub tokens_per_s_min: f64,
    pub tokens_per_s_max: f64,
}

impl BenchResult {
    fn new(model: &str, numerics: &'static str, spec: &BenchSpec, n_prompt: usize, n_gen: usize, samples: Vec<f64>) -> Self {
        let Summary { median, min, max, .. } = summarize(&samples).unwrap_or(Summary { median: 0.0, min: 0.0, max: 0.0, n: 0 });
        BenchResult {
            model: model.to_string(),
            numerics,
            n_prompt,
            n_gen,
            n_depth: spec.n_depth,
            threads: spec.threads,
            tokens_per_s: samples,
            tokens_per_s_median: median,
            tokens_per_s_min: min,
            tokens_per_s_max: max,
        }
    }

    /// "pp512", "tg128", with "@ d4096" when there is a depth (llama-bench's test names).
    pub fn test_name(&self) -> String {
        let base = if self.n_gen == 0 { format!("pp{}", self.n_prompt) } else { format!("tg{}", self.n_gen) };
        if self.n_depth > 0 { format!("{base} @ d{}", self.n_depth) } else { base }
    }
}

fn random_tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()
}

/// Runs the pp test (if n_prompt > 0) and the tg test (if n_gen > 0).
pub fn run(model: &Model, model_name: &str, spec: &BenchSpec) -> Result<Vec<BenchResult>> {
    let vocab = model.config.vocab_size;
    let mut rng = Rng::new(1234);
    let depth = random_tokens(&mut rng, spec.n_depth, vocab);
    let mut session = Session::new(model, spec.n_depth + spec.n_prompt.max(spec.n_gen) + 1);
    let mut results = Vec::new();
    if spec.n_prompt > 0 {
        let mut prompt = depth.clone();
        prompt.extend(random_tokens(&mut rng, spec.n_prompt, vocab));
        let samples = timed_reps(spec.reps, || {
            // Back to the depth tokens: computed once, then reused (prefill recomputes only the last one).
            if depth.is_empty() {
                session.truncate(0);
            } else {
                session.prefill(&depth, spec.chunk)?;
            }
            let t = Instant::now();
            session.prefill(&prompt, spec.chunk)?;
            Ok(spec.n_prompt as f64 / t.elapsed().as_secs_f64())
        })?;
        results.push(BenchResult::new(model_name, model.numerics().name(), spec, spec.n_prompt, 0, samples));
    }
    if spec.n_gen > 0 {
        let gen = random_tokens(&mut rng, spec.n_gen, vocab);
        let samples = timed_reps(spec.reps, || {
            // Depth 0 still needs one token in the cache to decode after.
            let start: &[u32] = if depth.is_empty() { &gen[..1] } else { &depth };
            session.prefill(start, spec.chunk)?;
            let t = Instant::now();
            for &tok in &gen {
                session.decode(tok)?;
            }
            Ok(spec.n_gen as f64 / t.elapsed().as_secs_f64())
        })?;
        results.push(BenchResult::new(model_name, model.numerics().name(), spec, 0, spec.n_gen, samples));
    }
    Ok(results)
}

/// One warm-up run, then `reps` timed ones.
fn timed_reps(reps: usize, mut f: impl FnMut() -> Result<f64>) -> Result<Vec<f64>> {
    f()?;
    (0..reps.max(1)).map(|_| f()).collect()
}

//! `reckon bench`: llama-bench-style prefill (pp) and decode (tg) throughput, optionally at a context depth,
//! measured through the same engine that serves (scheduler, paged KV, prefix cache, sampler).
//!
//! A pp test times the prefill of `n_prompt` tokens after `n_depth` tokens already in the KV cache: the
//! depth is one request's prompt, cached, and each repetition's prompt is the depth plus `n_prompt` fresh
//! tokens, so the prefix cache supplies the depth and the time to first token is the prefill of the rest
//! (plus the depth's partial last block, none when the depth is a multiple of the block size); under a
//! `--kv-window` the hit is the depth's sink blocks and window, all its queries attend to. A tg test
//! times `n_gen` decode steps (from the first generated token to the last) after the depth. Prompt tokens
//! are seeded pseudo-random ids (as llama-bench's), so runs are comparable; decoding is greedy and ignores
//! end-of-generation tokens. One untimed warm-up precedes the timed repetitions.

use crate::stats::{summarize, Summary};
use crate::LabError;
use reckon_engine::engine::{Completion, Detokenizer, EngineConfig, EngineHandle, GenerateParams};
use reckon_engine::kv::{KvDtypes, KvWindow};
use reckon_engine::model::Model;
use reckon_engine::sampler::Rng;
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

/// Tokens per KV block of the benchmark's engine.
pub const BLOCK_SIZE: usize = 16;

#[derive(Clone, Debug)]
pub struct BenchSpec {
    pub n_prompt: usize,
    pub n_gen: usize,
    pub n_depth: usize,
    pub reps: usize,
    pub threads: usize,
    /// Tokens per prefill step (llama-bench's n_ubatch).
    pub chunk: usize,
    /// How the KV cache stores keys and values.
    pub kv_dtypes: KvDtypes,
    /// Measure the read bandwidth after the tests and report each decode's fraction of its bound.
    pub bandwidth: bool,
    /// A StreamingLLM window over the cache (`--kv-window`).
    pub kv_window: Option<KvWindow>,
    /// Block-sparse attention over the history (`--sparse-attention`).
    pub sparse_attention: Option<reckon_engine::kv::SparseAttention>,
    /// Speculative decoding (`--spec`): on random tokens the n-gram proposer rarely finds anything, so
    /// this measures its overhead; `reckon lab spec` measures what it buys.
    pub speculation: Option<reckon_engine::engine::spec::SpecConfig>,
}

/// One test's result; field names follow llama-bench's JSON where they overlap.
#[derive(Clone, Debug, Serialize)]
pub struct BenchResult {
    pub model: String,
    /// The matmul arithmetic ("packed" or "ggml").
    pub numerics: &'static str,
    /// The KV cache's storage (`f16`, `q8_0`, `q8_0,q4_0`): llama-bench's type_k/type_v in one.
    pub kv_dtype: String,
    pub n_prompt: usize,
    pub n_gen: usize,
    pub n_depth: usize,
    pub threads: usize,
    pub tokens_per_s: Vec<f64>,
    pub tokens_per_s_median: f64,
    pub tokens_per_s_min: f64,
    pub tokens_per_s_max: f64,
    /// Decode tests: bytes a token reads (weights and attended KV, `Model::decode_bytes_per_token`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_per_token: Option<u64>,
    /// Decode tests with `--bandwidth`: the read bandwidth measured after the tests, the ceiling it puts
    /// on decode (`read_gb_s / bytes_per_token`) and the median's fraction of it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub read_gb_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bound_tokens_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fraction_of_bound: Option<f64>,
    /// Decode tests with `--bandwidth`: the same three over a working set of `bytes_per_token`
    /// (`bandwidth::footprint`), which on a host whose cache holds a token's bytes is the cache's
    /// bandwidth rather than DRAM's; elsewhere about equal to the above.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub footprint_read_gb_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub footprint_bound_tokens_per_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fraction_of_footprint_bound: Option<f64>,
}

impl BenchResult {
    fn new(model: &str, numerics: &'static str, spec: &BenchSpec, n_prompt: usize, n_gen: usize, samples: Vec<f64>) -> Self {
        let Summary { median, min, max, .. } = summarize(&samples).unwrap_or(Summary { median: 0.0, min: 0.0, max: 0.0, n: 0 });
        BenchResult {
            model: model.to_string(),
            numerics,
            kv_dtype: spec.kv_dtypes.name(),
            n_prompt,
            n_gen,
            n_depth: spec.n_depth,
            threads: spec.threads,
            tokens_per_s: samples,
            tokens_per_s_median: median,
            tokens_per_s_min: min,
            tokens_per_s_max: max,
            bytes_per_token: None,
            read_gb_s: None,
            bound_tokens_per_s: None,
            fraction_of_bound: None,
            footprint_read_gb_s: None,
            footprint_bound_tokens_per_s: None,
            fraction_of_footprint_bound: None,
        }
    }

    /// "pp512", "tg128", with "@ d4096" when there is a depth (llama-bench's test names).
    pub fn test_name(&self) -> String {
        let base = if self.n_gen == 0 { format!("pp{}", self.n_prompt) } else { format!("tg{}", self.n_gen) };
        if self.n_depth > 0 { format!("{base} @ d{}", self.n_depth) } else { base }
    }
}

pub(crate) fn random_tokens(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()
}

/// Benchmarks never read the text.
pub(crate) struct NoText;

impl Detokenizer for NoText {
    fn token_bytes(&self, _: u32) -> Vec<u8> {
        Vec::new()
    }
    fn is_end_of_generation(&self, _: u32) -> bool {
        false
    }
}

/// Runs the pp test (if n_prompt > 0) and the tg test (if n_gen > 0).
pub fn run(model: Arc<Model>, model_name: &str, spec: &BenchSpec) -> Result<Vec<BenchResult>, LabError> {
    let (vocab, numerics) = (model.config.vocab_size, model.numerics().name());
    let mut rng = Rng::new(1234);
    let depth = random_tokens(&mut rng, spec.n_depth, vocab);
    // Room for the cached depth and a few repetitions' own tokens besides.
    let per_rep = spec.n_prompt.max(spec.n_gen + 2) + BLOCK_SIZE;
    let config = EngineConfig {
        block_size: BLOCK_SIZE,
        num_blocks: (spec.n_depth + 4 * per_rep).div_ceil(BLOCK_SIZE) + 2,
        max_batch_tokens: spec.chunk.max(1),
        max_running: 1,
        max_waiting: 1,
        max_model_len: spec.n_depth + per_rep + 1,
        prefix_caching: true,
        kv_dtypes: spec.kv_dtypes,
        kv_window: spec.kv_window,
        sparse_attention: spec.sparse_attention,
        spec: spec.speculation.clone(),
        ..EngineConfig::default()
    };
    let engine = reckon_engine::engine::spawn_with(model.clone(), Arc::new(NoText), config, None)?;
    let generate = |prompt: Vec<u32>, n: usize| -> Result<(Completion, Vec<Instant>), LabError> {
        let params = GenerateParams { ignore_eos: true, ..GenerateParams::greedy(prompt, n) };
        let (_, events) = engine.submit(params).map_err(|e| LabError::Request(e.to_string()))?;
        let mut arrivals = Vec::with_capacity(n);
        let done = Completion::wait_with(events, |_, _| arrivals.push(Instant::now())).map_err(LabError::Request)?;
        Ok((done, arrivals))
    };
    if !depth.is_empty() {
        generate(depth.clone(), 1)?; // the depth, cached from now on
    }
    let mut results = Vec::new();
    if spec.n_prompt > 0 {
        let samples = timed_reps(spec.reps, || {
            let prompt = [depth.as_slice(), &random_tokens(&mut rng, spec.n_prompt, vocab)].concat();
            let (done, _) = generate(prompt, 1)?;
            Ok(spec.n_prompt as f64 / done.timings.time_to_first_token.as_secs_f64())
        })?;
        results.push(BenchResult::new(model_name, numerics, spec, spec.n_prompt, 0, samples));
    }
    if spec.n_gen > 0 {
        // Depth 0 still needs one token in the cache to decode after.
        let start = if depth.is_empty() { vec![1] } else { depth.clone() };
        let samples = timed_reps(spec.reps, || {
            let (_, arrivals) = generate(start.clone(), spec.n_gen + 1)?;
            let decode = arrivals[spec.n_gen].duration_since(arrivals[0]);
            Ok(spec.n_gen as f64 / decode.as_secs_f64())
        })?;
        let mut r = BenchResult::new(model_name, numerics, spec, 0, spec.n_gen, samples);
        // the depth, and on average half the generated tokens besides (under a window, what it keeps)
        let attended = spec.n_depth + spec.n_gen / 2;
        let attended = spec.kv_window.map_or(attended, |w| attended.min(w.held_blocks(attended, BLOCK_SIZE) * BLOCK_SIZE));
        r.bytes_per_token = Some(model.decode_bytes_per_token(attended, spec.kv_dtypes));
        results.push(r);
    }
    drop::<EngineHandle>(engine);
    if spec.bandwidth {
        let bw = crate::bandwidth::measure(spec.threads);
        for r in results.iter_mut() {
            if let Some(bytes) = r.bytes_per_token {
                let bound = bw.read_gb_s * 1e9 / bytes as f64;
                (r.read_gb_s, r.bound_tokens_per_s, r.fraction_of_bound) = (Some(bw.read_gb_s), Some(bound), Some(r.tokens_per_s_median / bound));
                let gb_s = crate::bandwidth::footprint(spec.threads, bytes as usize);
                let bound = gb_s * 1e9 / bytes as f64;
                (r.footprint_read_gb_s, r.footprint_bound_tokens_per_s, r.fraction_of_footprint_bound) = (Some(gb_s), Some(bound), Some(r.tokens_per_s_median / bound));
            }
        }
    }
    Ok(results)
}

/// One warm-up run, then `reps` timed ones.
fn timed_reps(reps: usize, mut f: impl FnMut() -> Result<f64, LabError>) -> Result<Vec<f64>, LabError> {
    f()?;
    (0..reps.max(1)).map(|_| f()).collect()
}

//! Choosing the next token from logits: penalties, then greedy or temperature sampling with top-k,
//! top-p and min-p, driven by a seeded generator so the same seed gives the same tokens.
//!
//! Order as in llama.cpp's default chain: penalties -> top-k -> top-p -> min-p -> temperature -> draw.

use std::collections::HashMap;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 disables.
    pub top_k: usize,
    /// 1.0 disables.
    pub top_p: f32,
    /// 0 disables.
    pub min_p: f32,
    /// 1.0 disables; >1 discourages tokens already present (llama.cpp's repeat_penalty).
    pub repetition_penalty: f32,
    /// OpenAI-style additive penalties.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// How many recent tokens the penalties look at (llama.cpp's penalty_last_n); 0 = all.
    pub penalty_last_n: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            penalty_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams { temperature: 0.0, ..Self::default() }
    }

    /// llama.cpp's defaults overlaid with what the model file recommends: the `general.sampling.*` keys
    /// llama.cpp's converters write from a model's `generation_config.json` (temp, top_k, top_p, min_p,
    /// penalty_repeat, penalty_last_n). A key that holds no usable value is skipped and named in
    /// `ModelSampling::skipped`, as are the samplers reckon does not have (mirostat, XTC) when set.
    pub fn from_gguf(file: &crate::gguf::GgufFile) -> ModelSampling {
        let mut out = ModelSampling { params: SamplingParams::default(), declared: Vec::new(), skipped: Vec::new() };
        let p = &mut out.params;
        for key in ["temp", "top_k", "top_p", "min_p", "penalty_repeat", "penalty_last_n", "mirostat", "xtc_probability"] {
            let full = format!("general.sampling.{key}");
            let Some(value) = file.get(&full) else { continue };
            let taken = match (key, value.as_f32()) {
                ("temp", Some(v)) if v.is_finite() && v >= 0.0 => Some(p.temperature = v),
                ("top_k", Some(v)) if v.is_finite() => Some(p.top_k = v.max(0.0) as usize),
                ("top_p", Some(v)) if v > 0.0 && v <= 1.0 => Some(p.top_p = v),
                ("min_p", Some(v)) if (0.0..=1.0).contains(&v) => Some(p.min_p = v),
                ("penalty_repeat", Some(v)) if v.is_finite() && v > 0.0 => Some(p.repetition_penalty = v),
                // llama.cpp's -1 is the whole context (reckon's 0); its 0 (penalties off) is not taken
                ("penalty_last_n", Some(v)) if v == -1.0 || v >= 1.0 => Some(p.penalty_last_n = v.max(0.0) as usize),
                // samplers reckon does not have: fine while they are off
                ("mirostat" | "xtc_probability", Some(v)) if v == 0.0 => continue,
                ("mirostat" | "xtc_probability", _) => {
                    out.skipped.push(format!("{full} = {} (reckon has no such sampler)", value.summary()));
                    continue;
                }
                _ => None,
            };
            match taken {
                Some(()) => out.declared.push(full),
                None => out.skipped.push(format!("{full} = {} (not a usable value)", value.summary())),
            }
        }
        out
    }
}

/// The sampling a model file recommends (`SamplingParams::from_gguf`).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSampling {
    /// llama.cpp's defaults with the file's values where it has usable ones (seed 0: requests bring theirs).
    pub params: SamplingParams,
    /// The `general.sampling.*` keys taken.
    pub declared: Vec<String>,
    /// Keys present but not taken, with why.
    pub skipped: Vec<String>,
}

/// splitmix64: tiny, fast, and identical on every platform.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Per-sequence sampler state (the generator advances with every draw).
pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// The vocabulary's probabilities, reused from token to token (a fresh 200 KB-1 MB buffer per token
    /// was a map and unmap of its own).
    probs: Vec<f32>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let rng = Rng::new(params.seed);
        Sampler { params, rng, probs: Vec::new() }
    }

    /// Picks the next token. `history` holds the tokens so far (prompt and output), for penalties.
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let p = &self.params;
        let penalized;
        let logits = if has_penalties(p) {
            let mut l = logits.to_vec();
            apply_penalties(&mut l, history, p);
            penalized = l;
            &penalized[..]
        } else {
            logits
        };
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        let Some(cands) = candidates(logits, p) else {
            // No cut (OpenAI's default): every token, in id order, probabilities by ggml's vectorized
            // softmax rather than a double-precision `exp` per vocabulary entry.
            // (l - max) / T: never above 0, so a tiny temperature underflows to 0 rather than overflowing.
            let max = max_logit(logits);
            self.probs.clear();
            self.probs.extend(logits.iter().map(|&l| (l - max) / p.temperature));
            crate::kernels::ggml::math::soft_max(&mut self.probs, 0);
            return draw(self.rng.next_f64(), self.probs.iter().enumerate().map(|(id, &q)| (id as u32, q as f64)));
        };
        let probs = softmax(&cands, p.temperature);
        draw(self.rng.next_f64(), cands.iter().zip(probs).map(|(&(id, _), q)| (id, q)))
    }
}

impl Sampler {
    /// Speculative verification of `guess` (a proposer's point-mass guess) against this row: `None` keeps
    /// it, `Some(token)` rejects it for `token`. The row's token is drawn exactly as `sample` draws it
    /// (one random number, the one decoding without guesses would use at this position), and the guess
    /// is kept iff it is that token. For a point-mass proposal this is Leviathan et al.'s rule: the guess
    /// is kept with probability p(guess), and a rejection yields a token from p without the guess,
    /// renormalized. And since every position consumes what it would without speculation, a seeded
    /// request gives the same tokens with and without it.
    pub fn accept_or_resample(&mut self, logits: &[f32], history: &[u32], guess: u32) -> Option<u32> {
        let token = self.sample(logits, history);
        (token != guess).then_some(token)
    }
}

/// The token where the cumulative probability passes `r` (in [0, 1)); if rounding leaves the total below
/// `r`, the last token with a probability above 0 (never a token that could not be drawn).
fn draw(mut r: f64, probs: impl Iterator<Item = (u32, f64)>) -> u32 {
    let mut last = 0;
    for (id, q) in probs {
        if r < q {
            return id;
        }
        r -= q;
        if q > 0.0 {
            last = id;
        }
    }
    last
}

/// The tokens top-k, top-p and min-p keep, as (id, logit) in descending logit order (ties by id); `None`
/// when no cut applies (plain temperature sampling, OpenAI's default), so that case never sorts. The cuts need only the head of the sorted order: it is selected
/// (`select_nth_unstable_by`) and sorted 256, 1,024, ... tokens at a time until the cuts are decided, not
/// the whole vocabulary per token (a sort of 262,144 entries per token for Gemma-3).
fn candidates(logits: &[f32], p: &SamplingParams) -> Option<Vec<(u32, f32)>> {
    let n = logits.len();
    let top_k = if p.top_k > 0 { p.top_k.min(n) } else { n };
    if top_k == n && p.top_p >= 1.0 && p.min_p <= 0.0 {
        return None;
    }
    // Descending by logit, ties by id: a total order, so the result never depends on sort internals.
    let order = |a: &(u32, f32, f32), b: &(u32, f32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let mut all: Vec<(u32, f32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l, 0.0)).collect();
    if top_k < n {
        all.select_nth_unstable_by(top_k, order);
        all.truncate(top_k);
    }
    // Probabilities (temperature 1) over the pool top-k left, for the top-p and min-p cuts.
    let mut probs: Vec<f32> = all.iter().map(|c| c.1).collect();
    crate::kernels::ggml::math::soft_max(&mut probs, 0);
    all.iter_mut().zip(probs).for_each(|(c, q)| c.2 = q);
    let mut head = 256.min(all.len());
    loop {
        if head < all.len() {
            all.select_nth_unstable_by(head, order);
        }
        all[..head].sort_unstable_by(order);
        let q = |i: usize| all[i].2 as f64;
        let mut keep = head;
        let mut decided = head == all.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            if let Some(i) = (0..head).position(|i| { cum += q(i); cum >= p.top_p as f64 }) {
                keep = i + 1;
                decided = true;
            }
        }
        if p.min_p > 0.0 {
            let floor = q(0) * p.min_p as f64;
            let above = (0..head).take_while(|&i| q(i) >= floor).count().max(1);
            if above < head {
                decided = true;
            }
            keep = keep.min(above);
        }
        if decided {
            return Some(all[..keep].iter().map(|c| (c.0, c.1)).collect());
        }
        head = (head * 4).min(all.len());
    }
}

fn has_penalties(p: &SamplingParams) -> bool {
    p.repetition_penalty != 1.0 || p.presence_penalty != 0.0 || p.frequency_penalty != 0.0
}

/// Index of the largest logit; the lowest index wins ties (as llama.cpp's greedy sampler). The result
/// of the plain loop `if l > logits[best] { best = i }` from best = 0 (a NaN never wins, but one at index
/// 0 stays). It runs once per sequence and step on the engine thread, over the whole vocabulary, so
/// `largest` vectorizes it.
pub fn argmax(logits: &[f32]) -> u32 {
    match logits.first() {
        Some(first) if !first.is_nan() => largest(logits, true).1,
        _ => 0,
    }
}

/// The largest non-NaN logit (−∞ if none), as `fold(−∞, f32::max)`; where ±0 tie it may pick the other
/// zero, which no difference `l − max` can tell apart.
fn max_logit(logits: &[f32]) -> f32 {
    largest(logits, false).0
}

/// The largest non-NaN logit and, if `index`, the first index holding it (0 if none does).
fn largest(logits: &[f32], index: bool) -> (f32, u32) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::allows(crate::kernels::cpu::SimdLevel::Avx2) {
        // SAFETY: the CPU has AVX2, checked just above.
        return unsafe { largest_avx2(logits, index) };
    }
    largest_lanes(logits, index)
}

/// `largest_lanes` compiled for AVX2 (its lane loops become vector compares and blends).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn largest_avx2(logits: &[f32], index: bool) -> (f32, u32) {
    largest_lanes(logits, index)
}

/// Lanes the running maxima are kept in (two AVX2 vectors, one AVX-512 vector).
const LANES: usize = 16;

/// Two passes the compiler vectorizes: the maximum in independent lanes, then the first chunk of
/// `LANES` that holds it.
#[inline(always)]
fn largest_lanes(logits: &[f32], index: bool) -> (f32, u32) {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = logits.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let max = lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    if !index {
        return (max, 0);
    }
    for (k, c) in logits.chunks(LANES).enumerate() {
        if c.iter().fold(false, |hit, &v| hit | (v == max)) {
            return (max, (k * LANES + c.iter().position(|&v| v == max).expect("the chunk holds it")) as u32);
        }
    }
    (max, 0)
}

fn softmax(cands: &[(u32, f32)], temperature: f32) -> Vec<f64> {
    let max = cands.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max) as f64;
    let exps: Vec<f64> = cands.iter().map(|&(_, l)| ((l as f64 - max) / temperature as f64).exp()).collect();
    let sum: f64 = exps.iter().sum();
    exps.into_iter().map(|e| e / sum).collect()
}

fn apply_penalties(logits: &mut [f32], history: &[u32], p: &SamplingParams) {
    if !has_penalties(p) {
        return;
    }
    let window = if p.penalty_last_n == 0 { history } else { &history[history.len().saturating_sub(p.penalty_last_n)..] };
    let mut counts: HashMap<u32, u32> = HashMap::new();
    window.iter().for_each(|&t| *counts.entry(t).or_default() += 1);
    for (&tok, &count) in &counts {
        let Some(l) = logits.get_mut(tok as usize) else { continue };
        if p.repetition_penalty != 1.0 {
            *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
        }
        *l -= p.presence_penalty + p.frequency_penalty * count as f32;
    }
}

#[cfg(test)]
mod tests;

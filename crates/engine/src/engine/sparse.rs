//! Sparse prefill (SpecPrefill, Liu et al., ICML 2025; issue 21): a long prompt's tokens are scored, and
//! the target computes only the chosen chunks, every kept token at its original position.
//!
//! A sparsely prefilled request keeps the kept tokens in consecutive cells: its `tokens` begin with
//! them (compacted), `SparsePrompt` maps each cell to its position in the full prompt, and the model
//! rotates each token for that position (`Model::forward_at`); tokens after them (generated) continue
//! from the full prompt's length. Everything that counts cells (the scheduler, the KV manager, the
//! block tables) is unchanged. What is not a prefix of the prompt must never meet the prefix cache: the
//! request's blocks are looked up and registered only up to its genuine prefix (the leading kept
//! positions that are the prompt's own first positions, a prefix-cache hit among them), through
//! `KvCacheManager::limit_caching`.
//!
//! Scoring (`ScoringPass`, `plan_from`): a scorer model (a draft of the target's vocabulary, or the
//! target itself) runs its first `layers` layers over the prompt; the last `lookahead` prompt tokens'
//! queries attend over every position; a position's importance is the largest probability any head
//! gives it, the largest over those queries (or their mean, `Pooling`), averaged over the layers; a
//! chunk's score is the mean of its positions', raised to its neighbours' (`spread`). (SpecPrefill's
//! queries are the draft's generated look-ahead tokens; here they are the prompt's last tokens.) The
//! engine holds the request while it scores, a slice of the pass per step, so other requests keep
//! stepping.
//!
//! Idle recovery (`SparsePrefillConfig::recover`): the engine remembers the full prompts of its recent
//! sparse prefills (latest first, at most `MAX_RECOVERIES`) and, whenever it has nothing else to run,
//! prefills one in the background as an ordinary request of one token that nobody reads, a slice of
//! at most `recover_slice` tokens a step; its full blocks join the prefix cache as they are computed.
//! Any arriving request stops it before the next step (what it computed stays cached; it resumes from
//! there later), so it waits at most for the slice in flight.

use crate::model::{LogitsWanted, Model, Scratch, SeqInput, Tracer};
use half::f16;
use std::sync::Mutex;

/// When and how the engine prefills sparsely (`--spec-prefill-keep`; scoring with the target's own first
/// `layers` layers, `self` scoring).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SparsePrefillConfig {
    /// Share of the prompt (after a prefix-cache hit) kept.
    pub keep: f64,
    /// A prompt whose new suffix (beyond a prefix-cache hit) is shorter than this is prefilled whole
    /// (scoring costs time too).
    pub min_tokens: usize,
    /// Layers of the scoring pass.
    pub layers: usize,
    /// The prompt's last tokens whose attention scores the rest.
    pub lookahead: usize,
    /// Tokens per chunk kept or dropped together.
    pub chunk: usize,
    /// How the look-ahead queries' attention is pooled into a position's importance.
    pub pooling: Pooling,
    /// A chunk also takes its neighbours' scores (`spread`), so the text around an attended span (the
    /// number after the name a question asks for) is kept with it.
    pub spread: bool,
    /// Recompute the full prompt's keys and values of recent sparse prefills while the engine is idle
    /// (`Engine::start_recovery`), so a later turn finds the whole prefix in the cache.
    pub recover: bool,
    /// Tokens of recovery per step at most (a slice): what a request arriving mid-slice waits for.
    pub recover_slice: usize,
}

impl Default for SparsePrefillConfig {
    fn default() -> Self {
        SparsePrefillConfig { keep: 0.2, min_tokens: 4096, layers: 4, lookahead: 32, chunk: 32, pooling: Pooling::Max, spread: true, recover: false, recover_slice: 128 }
    }
}

/// Per look-ahead query, a position's importance is the largest probability any head gives it; then
/// over the queries their `Mean` or their `Max` (`reckon lab spec-prefill --rank-layers` compares them:
/// with `Max` and the spread, a needle's sentence ranks higher at every depth), and the mean over layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    Mean,
    Max,
}

/// The positions to keep of `prompt` under `config`, scored by `model`, the first `protect` (a prefix-cache
/// hit) kept whole; `None` where the prompt is too short or nothing would be dropped.
pub fn plan(model: &Model, prompt: &[u32], protect: usize, config: &SparsePrefillConfig) -> Option<Vec<usize>> {
    if !worth_scoring(prompt.len(), protect, config) {
        return None;
    }
    plan_from(&attention_by_layer(model, prompt, config.layers, config.lookahead), prompt.len(), protect, config)
}

/// Whether a prompt of `len` tokens, `protect` of them cached, is worth thinning: its new suffix is at
/// least `min_tokens` long (a short new turn after a long cached history is prefilled whole).
pub fn worth_scoring(len: usize, protect: usize, config: &SparsePrefillConfig) -> bool {
    let suffix = len.saturating_sub(protect);
    suffix >= config.min_tokens.max(2) && suffix > 2 * config.chunk
}

/// `plan` from a scoring pass's attention over a prompt of `len` tokens.
pub fn plan_from(attention: &[LayerAttention], len: usize, protect: usize, config: &SparsePrefillConfig) -> Option<Vec<usize>> {
    let imp = pool(attention, config.pooling);
    if imp.len() != len {
        return None;
    }
    let mut scores = chunk_scores(&imp, protect, config.chunk);
    if config.spread {
        scores = spread(&scores);
    }
    let kept = select(len, protect, config.chunk, &scores, config.keep);
    (kept.len() < len).then_some(kept)
}

/// A request's own word on sparse prefill (the API's `reckon.spec_prefill`): off, or this keep ratio
/// (the engine's other settings, or the defaults, for the rest).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SpecPrefillChoice {
    Off,
    Keep(f64),
}

/// Full prompts the engine remembers for idle recovery at most (the latest).
pub const MAX_RECOVERIES: usize = 8;

/// A sparsely prefilled prompt: cell `i < kept.len()` holds the prompt's token at position `kept[i]`;
/// later cells (generated tokens) sit at positions from `prompt_len` on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SparsePrompt {
    /// Kept positions of the prompt, increasing; the last is the prompt's last (its logits give the
    /// first token).
    pub kept: Vec<usize>,
    pub prompt_len: usize,
}

impl SparsePrompt {
    /// `kept` positions of a prompt of `prompt_len` tokens: increasing, ending with the last one.
    pub fn new(kept: Vec<usize>, prompt_len: usize) -> Option<SparsePrompt> {
        let ok = kept.last() == Some(&(prompt_len.checked_sub(1)?)) && kept.windows(2).all(|w| w[0] < w[1]);
        ok.then_some(SparsePrompt { kept, prompt_len })
    }

    /// The RoPE position of cell `i`.
    pub fn position(&self, i: usize) -> usize {
        match self.kept.get(i) {
            Some(&p) => p,
            None => self.prompt_len + i - self.kept.len(),
        }
    }

    /// Leading cells that hold the prompt's own first positions (a prefix, cacheable).
    pub fn genuine_prefix(&self) -> usize {
        self.kept.iter().enumerate().take_while(|&(i, &p)| i == p).count()
    }

    /// Prompt positions not computed.
    pub fn dropped(&self) -> usize {
        self.prompt_len - self.kept.len()
    }
}

/// The positions a sparse prefill keeps of a prompt of `len` tokens: the first `protect` (a prefix-cache
/// hit, never thinned), then, of the rest cut into chunks of `chunk` tokens (`scores[j]` for chunk j),
/// the first and the last chunk always and the best-scored others (ties: the earlier) until `keep` of the
/// rest's tokens are kept. In increasing order.
pub fn select(len: usize, protect: usize, chunk: usize, scores: &[f32], keep: f64) -> Vec<usize> {
    let protect = protect.min(len);
    let rest = len - protect;
    let chunk = chunk.max(1);
    let n_chunks = rest.div_ceil(chunk);
    debug_assert_eq!(scores.len(), n_chunks, "a score per chunk");
    let span = |j: usize| protect + j * chunk..(protect + (j + 1) * chunk).min(len);
    let mut take = vec![false; n_chunks];
    if n_chunks > 0 {
        take[0] = true;
        take[n_chunks - 1] = true;
    }
    let budget = (keep.clamp(0.0, 1.0) * rest as f64).ceil() as usize;
    let mut order: Vec<usize> = (0..n_chunks).collect();
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    let mut kept: usize = (0..n_chunks).filter(|&j| take[j]).map(|j| span(j).len()).sum();
    for j in order {
        if kept >= budget {
            break;
        }
        if !take[j] {
            take[j] = true;
            kept += span(j).len();
        }
    }
    (0..protect).chain((0..n_chunks).filter(|&j| take[j]).flat_map(span)).collect()
}

/// Keeps each layer's roped queries (`Qcur`) of the step it is armed for.
struct Queries(Mutex<Vec<(usize, Vec<f32>)>>);

impl Tracer for Queries {
    fn record(&self, name: &str, layer: usize, rows: &[f32], _n: usize) {
        if name == "Qcur" {
            self.0.lock().expect("not poisoned").push((layer, rows.to_vec()));
        }
    }
}

/// Attention probabilities of one query head (`q`, `[head_dim]`, roped) over the keys of `slots` in a
/// layer's f16 keys (`keys`: slot-major rows of `kv_dim`), reading KV head `kv_head`; `scale` multiplies
/// q·k. The softmax is over the given slots.
pub fn head_probs(q: &[f32], keys: &[f16], slots: &[usize], kv_head: usize, kv_dim: usize, scale: f32) -> Vec<f32> {
    let hd = q.len();
    let logits: Vec<f32> = slots
        .iter()
        .map(|&s| {
            let k = &keys[s * kv_dim + kv_head * hd..][..hd];
            scale * q.iter().zip(k).map(|(a, b)| a * b.to_f32()).sum::<f32>()
        })
        .collect();
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    e.into_iter().map(|x| x / sum).collect()
}

/// Per prompt position, its importance to the last `lookahead` tokens under `model`'s first `layers`
/// layers: the largest probability any head of a look-ahead query gives it, pooled over the queries
/// (`pooling`), averaged over the layers (see the module comment).
pub fn importance(model: &Model, prompt: &[u32], layers: usize, lookahead: usize, pooling: Pooling) -> Vec<f32> {
    pool(&attention_by_layer(model, prompt, layers, lookahead), pooling)
}

/// `importance` from the layers' attention: `pooling` over the queries, the mean over the layers given.
pub fn pool(by_layer: &[LayerAttention], pooling: Pooling) -> Vec<f32> {
    let n = by_layer.first().map_or(0, |l| l.mean.len());
    let mut imp = vec![0f32; n];
    for l in by_layer {
        let v = if pooling == Pooling::Max { &l.max } else { &l.mean };
        imp.iter_mut().zip(v).for_each(|(i, x)| *i += x);
    }
    let norm = by_layer.len().max(1) as f32;
    imp.iter_mut().for_each(|x| *x /= norm);
    imp
}

/// Each chunk's score raised to its neighbours' (the largest of chunks j-1, j, j+1).
pub fn spread(scores: &[f32]) -> Vec<f32> {
    (0..scores.len()).map(|j| scores[j.saturating_sub(1)..(j + 2).min(scores.len())].iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect()
}

/// What one scoring layer's look-ahead queries give each prompt position (`[n]` each): per query the
/// largest probability over heads, then `mean` over the queries and `max` over them.
#[derive(Clone, Debug, Default)]
pub struct LayerAttention {
    pub mean: Vec<f32>,
    pub max: Vec<f32>,
}

/// The look-ahead queries' attention over the prompt in each of `model`'s first `layers` layers (layer
/// order), in one go (`ScoringPass`).
pub fn attention_by_layer(model: &Model, prompt: &[u32], layers: usize, lookahead: usize) -> Vec<LayerAttention> {
    let mut pass = ScoringPass::new(model, prompt.to_vec(), layers, lookahead);
    while !pass.advance(model, 512) {}
    pass.into_attention()
}

/// A scoring pass that runs a slice at a time (the engine runs one slice per step, so other requests'
/// steps are not held up for the whole pass): the scorer's first `layers` layers prefill the prompt
/// before the look-ahead queries over a KV storage of its own, then the look-ahead queries in a step
/// of their own (whose queries the tracer keeps), then their attention is read off the stored keys.
pub struct ScoringPass {
    prompt: Vec<u32>,
    layers: usize,
    lookahead: usize,
    kv: crate::kv::KvStorage,
    table: Vec<u32>,
    scratch: Scratch,
    /// Prompt tokens computed.
    done: usize,
    attention: Option<Vec<LayerAttention>>,
}

impl ScoringPass {
    pub fn new(model: &Model, prompt: Vec<u32>, layers: usize, lookahead: usize) -> ScoringPass {
        const BS: usize = 16;
        let n = prompt.len();
        let kv = model.new_kv(BS, n.div_ceil(BS).max(1));
        let table: Vec<u32> = (0..kv.shape.num_blocks as u32).collect();
        let (layers, lookahead) = (layers.clamp(1, model.config.n_layers), lookahead.clamp(1, n.max(1)));
        ScoringPass { attention: (n == 0).then(Vec::new), prompt, layers, lookahead, kv, table, scratch: Scratch::default(), done: 0 }
    }

    /// Prompt tokens the pass still has to compute.
    pub fn remaining(&self) -> usize {
        if self.attention.is_some() {
            0
        } else {
            self.prompt.len() - self.done
        }
    }

    /// Runs up to `max_tokens` more of the pass (the look-ahead step whole); true once it is done.
    pub fn advance(&mut self, model: &Model, max_tokens: usize) -> bool {
        if self.attention.is_some() {
            return true;
        }
        let (n, w) = (self.prompt.len(), self.lookahead);
        let tables = std::slice::from_ref(&self.table);
        if self.done < n - w {
            let end = (self.done + max_tokens.max(1)).min(n - w);
            let quiet = Queries(Mutex::new(Vec::new()));
            let seq = SeqInput { tokens: &self.prompt[self.done..end], start_pos: self.done, block_tables: tables, logits: LogitsWanted::None, state: None };
            model.forward_layers(&[seq], self.layers, &mut self.kv, &mut self.scratch, &quiet);
            self.done = end;
            return false;
        }
        let armed = Queries(Mutex::new(Vec::new()));
        let seq = SeqInput { tokens: &self.prompt[n - w..], start_pos: n - w, block_tables: tables, logits: LogitsWanted::None, state: None };
        model.forward_layers(&[seq], self.layers, &mut self.kv, &mut self.scratch, &armed);
        self.done = n;
        self.attention = Some(self.read_attention(model, armed.0.into_inner().expect("not poisoned")));
        true
    }

    /// The attention, once `advance` said done (empty before).
    pub fn into_attention(self) -> Vec<LayerAttention> {
        self.attention.unwrap_or_default()
    }

    fn read_attention(&self, model: &Model, queries: Vec<(usize, Vec<f32>)>) -> Vec<LayerAttention> {
        let c = &model.config;
        let (n, w) = (self.prompt.len(), self.lookahead);
        let (q_dim, kv_dim, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
        let group = c.n_heads / c.n_kv_heads;
        let slots: Vec<usize> = (0..n).map(|p| self.kv.slot(&self.table, p)).collect();
        let mut out = Vec::new();
        for (layer, rows) in queries {
            // the layer's keys in position order as f32, converted once for every query and head
            let keys: Vec<f32> = slots.iter().flat_map(|&s| self.kv.key_row(layer, s).into_iter().map(|x| x.to_f32())).collect();
            let mut logits = vec![0f32; n];
            let mut la = LayerAttention { mean: vec![0f32; n], max: vec![0f32; n] };
            for j in 0..w {
                let qpos = n - w + j;
                let mut best = vec![0f32; qpos + 1];
                for h in 0..c.n_heads {
                    let q = &rows[j * q_dim + h * hd..][..hd];
                    let kh = (h / group) * hd;
                    for (p, l) in logits[..=qpos].iter_mut().enumerate() {
                        *l = c.attn_scale * dot(q, &keys[p * kv_dim + kh..][..hd]);
                    }
                    softmax_max_into(&logits[..=qpos], &mut best);
                }
                for (p, b) in best.into_iter().enumerate() {
                    la.mean[p] += b / w as f32;
                    la.max[p] = la.max[p].max(b);
                }
            }
            out.push(la);
        }
        out
    }
}

/// `a·b` in eight lanes (so the compiler vectorizes it).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `best[p] = max(best[p], softmax(logits)[p])`.
fn softmax_max_into(logits: &[f32], best: &mut [f32]) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for &l in logits {
        sum += (l - max).exp();
    }
    for (b, &l) in best.iter_mut().zip(logits) {
        *b = b.max((l - max).exp() / sum);
    }
}

/// Chunk scores for `select`: the mean importance of each chunk of `chunk` positions from `from` on.
pub fn chunk_scores(importance: &[f32], from: usize, chunk: usize) -> Vec<f32> {
    importance[from.min(importance.len())..].chunks(chunk.max(1)).map(|c| c.iter().sum::<f32>() / c.len() as f32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sparse_prompt_maps_cells_to_positions_and_continues_after_the_prompt() {
        let s = SparsePrompt::new(vec![0, 1, 2, 7, 8, 11], 12).unwrap();
        assert_eq!((0..9).map(|i| s.position(i)).collect::<Vec<_>>(), vec![0, 1, 2, 7, 8, 11, 12, 13, 14]);
        assert_eq!((s.genuine_prefix(), s.dropped()), (3, 6));
        assert!(SparsePrompt::new(vec![0, 3, 2, 11], 12).is_none(), "not increasing");
        assert!(SparsePrompt::new(vec![0, 3], 12).is_none(), "the last token is always kept");
        assert!(SparsePrompt::new(vec![], 0).is_none());
    }

    #[test]
    fn chunk_scores_average_each_chunk_after_the_protected_prefix() {
        assert_eq!(chunk_scores(&[9.0, 9.0, 1.0, 3.0, 2.0, 2.0, 5.0], 2, 2), vec![2.0, 2.0, 5.0]);
        assert!(chunk_scores(&[1.0], 4, 2).is_empty());
        assert_eq!(spread(&[0.0, 3.0, 1.0, 0.0, 0.0, 2.0]), vec![3.0, 3.0, 3.0, 1.0, 2.0, 2.0]);
        assert!(spread(&[]).is_empty());
    }

    #[test]
    fn head_probs_is_a_softmax_over_the_given_slots() {
        let keys: Vec<f16> = [1.0, 0.0, 0.0, 1.0, 2.0, 0.0, 0.0, 2.0, 1.0, 1.0, 0.0, 0.0].iter().map(|&x| f16::from_f32(x)).collect();
        // kv_dim 4: two KV heads of 2; three slots; head 1 of slot s is keys[s*4+2..s*4+4]
        let p = head_probs(&[1.0, 0.0], &keys, &[0, 2], 0, 4, 1.0);
        let (e1, e0) = (1f32.exp(), 1f32.exp());
        assert!((p[0] - e1 / (e1 + e0)).abs() < 1e-6 && (p.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        let p = head_probs(&[0.0, 1.0], &keys, &[0, 1], 1, 4, 2.0);
        // head 1: slot 0 (0, 1) -> 2, slot 1 (0, 2) -> 4
        assert!((p[1] - 4f32.exp() / (2f32.exp() + 4f32.exp())).abs() < 1e-6);
    }

    #[test]
    fn select_keeps_the_protected_prefix_the_ends_and_the_best_chunks() {
        // 4 protected, then 20 tokens in chunks of 4: scores pick chunk 2 after the ends (0 and 4)
        let kept = select(24, 4, 4, &[0.0, 0.1, 0.9, 0.5, 0.0], 0.5);
        assert_eq!(kept, [0, 1, 2, 3].into_iter().chain(4..8).chain(12..16).chain(20..24).collect::<Vec<_>>());
        // keep 1.0: everything; keep 0: the ends only (a short last chunk included)
        assert_eq!(select(23, 4, 4, &[0.0; 5], 1.0), (0..23).collect::<Vec<_>>());
        assert_eq!(select(23, 4, 4, &[0.0; 5], 0.0), (0..8).chain(20..23).collect::<Vec<_>>());
        // ties go to the earlier chunk
        assert_eq!(select(16, 0, 4, &[0.0, 1.0, 1.0, 0.0], 0.75), (0..8).chain(12..16).collect::<Vec<_>>());
    }
}

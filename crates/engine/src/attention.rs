//! Causal attention of a batch of query tokens over the paged KV storage.
//!
//! Each query token belongs to one sequence and attends to that sequence's cached positions
//! `[lo, pos]`, read through its block table (`lo > 0` only for sliding-window layers). Every (token,
//! head) output is computed by one task in a fixed order, so results do not depend on batch or threads.

use crate::debug_dump;
use crate::kv::KvStorage;
use crate::ggml_math::{dot_f16, soft_max, LaneAcc};
use half::f16;
use rayon::prelude::*;

/// Where one query token sits: its sequence's block table and its position.
#[derive(Clone, Copy, Debug)]
pub struct QueryPos<'a> {
    pub block_table: &'a [u32],
    pub pos: usize,
}

#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies q·k before the softmax.
    pub scale: f32,
    /// Sliding window: a query at `pos` sees positions `> pos - window` only.
    pub window: Option<usize>,
}

/// q: `[n_tokens, n_heads * head_dim]`, out: same shape.
///
/// Numerics follow ggml's non-flash CPU path so tokens match llama.cpp: q is rounded to f16 and dotted with
/// the f16 keys (`ggml_vec_dot_f16` order), the softmax is ggml's, the probabilities are rounded to f16 and
/// dotted with the f16 values per output dimension, lanes assigned by KV cell (= position here).
pub fn attend(shape: &AttnShape, kv: &KvStorage, layer: usize, queries: &[QueryPos], q: &[f32], out: &mut [f32]) {
    let q_dim = shape.n_heads * shape.head_dim;
    let hd = shape.head_dim;
    let (keys, values) = kv.layer(layer);
    let kv_dim = kv.shape.kv_dim;
    let group = shape.n_heads / shape.n_kv_heads;
    out.par_chunks_exact_mut(hd).enumerate().for_each_init(Scratch::default, |sc, (i, out_h)| {
        let (t, h) = (i / shape.n_heads, i % shape.n_heads);
        let query = &queries[t];
        let q_h = &q[t * q_dim + h * hd..][..hd];
        let kv_off = (h / group) * hd;
        let lo = shape.window.map_or(0, |w| (query.pos + 1).saturating_sub(w));
        sc.q16.clear();
        sc.q16.extend(q_h.iter().map(|&x| f16::from_f32(x)));
        sc.scores.clear();
        for p in lo..=query.pos {
            let slot = kv.slot(query.block_table, p);
            let k = &keys[slot * kv_dim + kv_off..][..hd];
            sc.scores.push(dot_f16(k, &sc.q16) * shape.scale);
        }
        let dump = t + 1 == queries.len() && debug_dump::enabled();
        if dump {
            debug_dump::dump(&format!("kq-h{h}"), layer, &sc.scores, 1);
        }
        soft_max(&mut sc.scores, lo);
        if dump {
            debug_dump::dump(&format!("kq_soft_max-h{h}"), layer, &sc.scores, 1);
        }
        weighted_values(sc, values, query, kv, kv_off, lo, out_h);
    });
}

/// out[d] = Σ_p f16(prob_p)·V_p[d], accumulated as ggml_vec_dot_f16 would over the KV cells (cell = position
/// here), see `LaneAcc`.
fn weighted_values(sc: &mut Scratch, values: &[f16], query: &QueryPos, kv: &KvStorage, kv_off: usize, lo: usize, out_h: &mut [f32]) {
    let hd = out_h.len();
    let kv_dim = kv.shape.kv_dim;
    sc.acc.reset(hd);
    for (p, &w) in (lo..=query.pos).zip(sc.scores.iter()) {
        let slot = kv.slot(query.block_table, p);
        sc.acc.add(p, f16::from_f32(w).to_f32(), &values[slot * kv_dim + kv_off..][..hd]);
    }
    sc.acc.reduce(out_h);
}

/// Per-task buffers, reused across the (token, head) pairs a worker handles.
#[derive(Default)]
struct Scratch {
    q16: Vec<f16>,
    scores: Vec<f32>,
    acc: LaneAcc,
}

//! Causal attention of a batch of query tokens over the paged KV storage.
//!
//! Each query token belongs to one sequence and attends to that sequence's cached positions
//! `[lo, pos]`, read through its block table (`lo > 0` only for sliding-window layers). Every (token,
//! head) output is computed by one task in a fixed order, so results do not depend on batch or threads.

use crate::kv::KvStorage;
use crate::quant::{vec_dot_kernel, GgmlType};
use half::f16;
use half::slice::HalfFloatSliceExt;
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
pub fn attend(shape: &AttnShape, kv: &KvStorage, layer: usize, queries: &[QueryPos], q: &[f32], out: &mut [f32]) {
    let q_dim = shape.n_heads * shape.head_dim;
    let hd = shape.head_dim;
    let (keys, values) = kv.layer(layer);
    let kv_dim = kv.shape.kv_dim;
    // ggml multiplies f16 keys with the query rounded to f16 (F16 vec_dot); do the same so scores match.
    let dot_f16 = vec_dot_kernel(GgmlType::F16);
    let group = shape.n_heads / shape.n_kv_heads;
    out.par_chunks_exact_mut(hd).enumerate().for_each_init(Scratch::default, |sc, (i, out_h)| {
        let (t, h) = (i / shape.n_heads, i % shape.n_heads);
        let query = &queries[t];
        let q_h = &q[t * q_dim + h * hd..][..hd];
        let kv_off = (h / group) * hd;
        let lo = shape.window.map_or(0, |w| (query.pos + 1).saturating_sub(w));
        sc.q16.clear();
        sc.q16.extend(q_h.iter().map(|&x| f16::from_f32(x)));
        let q_bytes = f16_bytes(&sc.q16);
        sc.scores.clear();
        for p in lo..=query.pos {
            let slot = kv.slot(query.block_table, p);
            let k = f16_bytes(&keys[slot * kv_dim + kv_off..][..hd]);
            sc.scores.push(dot_f16(hd, k, q_bytes) * shape.scale);
        }
        crate::ops::softmax_inplace(&mut sc.scores);
        // ggml multiplies the probabilities with f16 values as f16 too: round them the same way.
        sc.scores.iter_mut().for_each(|w| *w = f16::from_f32(*w).to_f32());
        out_h.fill(0.0);
        sc.v32.resize(hd, 0.0);
        for (p, &w) in (lo..=query.pos).zip(sc.scores.iter()) {
            let slot = kv.slot(query.block_table, p);
            values[slot * kv_dim + kv_off..][..hd].convert_to_f32_slice(&mut sc.v32);
            out_h.iter_mut().zip(&sc.v32).for_each(|(o, &x)| *o += w * x);
        }
    });
}

/// Per-task buffers, reused across the (token, head) pairs a worker handles.
#[derive(Default)]
struct Scratch {
    q16: Vec<f16>,
    scores: Vec<f32>,
    v32: Vec<f32>,
}

/// The bytes of an f16 slice, as the F16 vec_dot kernel takes them.
fn f16_bytes(x: &[f16]) -> &[u8] {
    // SAFETY: f16 is a plain 2-byte value (repr(transparent) over u16), any byte pattern is valid to read.
    unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u8>(), std::mem::size_of_val(x)) }
}

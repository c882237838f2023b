//! The attention sub-block shared by every architecture: q/k/v projections (+ biases, + per-head
//! norms where present), RoPE, writing k/v into the paged storage, attention, output projection.

use crate::matmul::{matmul_many_filled, QMatrix};
use super::config::ModelConfig;
use super::weights::LayerWeights;
use super::Scratch;
use crate::attention::{attend, AttnShape, QueryPos};
use crate::debug_dump::dump;
use crate::gguf::GgufFile;
use crate::kv::KvStorage;
use crate::ops::{self, Rope};

pub(super) struct LayerCtx<'a> {
    pub cfg: &'a ModelConfig,
    pub file: &'a GgufFile,
    pub layer: usize,
    pub rope: &'a Rope,
    pub queries: &'a [QueryPos<'a>],
    pub numerics: crate::model::Numerics,
}

/// A sub-block's input: `xn = rmsnorm(x) · weight`, after `x += proj` (the previous sub-block's output,
/// its residual add deferred to here) when `add_proj`.
pub(super) struct NormedInput<'w> {
    pub weight: &'w [f32],
    pub add_proj: bool,
}

/// The matmuls of `jobs` over `xn` made from `x` as `input` says (`xn`: `[n, d_model]`, written). The
/// add and the norm run inside the matmul's parallel run (`FillRows`), each token's row as alone.
pub(super) fn normed_matmul(input: &NormedInput, eps: f32, x: &mut [f32], proj: &[f32], xn: &mut [f32], act_q: &mut Vec<u8>, jobs: &mut [(QMatrix, &mut [f32])]) {
    let d = input.weight.len();
    let x_rows = ops::SharedRows::new(x, d);
    let fill = |first: usize, last: usize, out: &mut [f32]| {
        // SAFETY: the matmul hands each token range to one part; `x` is borrowed for the call.
        let x = unsafe { x_rows.rows(first, last) };
        if input.add_proj {
            x.iter_mut().zip(&proj[first * d..last * d]).for_each(|(a, &b)| *a += b);
        }
        ops::rms_norm_here(x, input.weight, eps, out);
    };
    matmul_many_filled(xn, &fill, act_q, jobs);
}

/// Tokens below which `finish_qkv` stays on the calling thread (a parallel run costs a few µs).
const FINISH_PAR_MIN_TOKENS: usize = 2;

/// Per token, in ggml's order: q/k/v biases, per-head q/k norms, RoPE of q and k, then k and v into the
/// token's KV cell. One parallel run over the tokens (each token's rows as alone), not one serial or
/// parallel pass per operation: at decode batches these ran on one thread while the other waited.
fn finish_qkv(ctx: &LayerCtx, w: &LayerWeights, kv: &mut KvStorage, s: &mut Scratch) {
    let c = ctx.cfg;
    let n = ctx.queries.len();
    let (hd, q_dim, kv_dim) = (c.head_dim, c.q_dim(), c.kv_dim());
    let writer = kv.layer_writer(ctx.layer);
    let (q, k, v) = (ops::SharedRows::new(&mut s.q, q_dim), ops::SharedRows::new(&mut s.k, kv_dim), ops::SharedRows::new(&mut s.v, kv_dim));
    let tokens = |first: usize, last: usize| {
        // SAFETY: each token range goes to one part; the buffers are borrowed for the run.
        let (q, k, v) = unsafe { (q.rows(first, last), k.rows(first, last), v.rows(first, last)) };
        for (buf, bias) in [(&mut *q, &w.bq), (&mut *k, &w.bk), (&mut *v, &w.bv)] {
            if let Some(b) = bias {
                buf.chunks_exact_mut(b.len()).for_each(|row| row.iter_mut().zip(b).for_each(|(a, &b)| *a += b));
            }
        }
        if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
            ops::rms_norm_inplace_here(q, qn, c.norm_eps);
            ops::rms_norm_inplace_here(k, kn, c.norm_eps);
        }
        for (i, qp) in ctx.queries[first..last].iter().enumerate() {
            ctx.rope.apply(&mut q[i * q_dim..(i + 1) * q_dim], hd, qp.pos);
            ctx.rope.apply(&mut k[i * kv_dim..(i + 1) * kv_dim], hd, qp.pos);
            // SAFETY: a batch's tokens have distinct cells, and this part alone handles this token.
            unsafe { writer.write(writer.slot(qp.block_table, qp.pos), &k[i * kv_dim..(i + 1) * kv_dim], &v[i * kv_dim..(i + 1) * kv_dim]) };
        }
    };
    let pool = crate::pool::current();
    if n < FINISH_PAR_MIN_TOKENS || pool.threads() == 1 {
        return tokens(0, n);
    }
    let parts = n.min(4 * pool.threads());
    pool.run(parts, &|p| tokens(p * n / parts, (p + 1) * n / parts));
}

/// Makes `s.xn` from `s.x` as `input` says (see `normed_matmul`), leaves the attention output projected
/// in `s.proj`.
pub(super) fn attention(ctx: &LayerCtx, w: &LayerWeights, input: &NormedInput, kv: &mut KvStorage, s: &mut Scratch) {
    let c = ctx.cfg;
    let n = ctx.queries.len();
    let (hd, q_dim, kv_dim) = (c.head_dim, c.q_dim(), c.kv_dim());
    super::resize(&mut s.xn, n * c.d_model);
    super::resize(&mut s.q, n * q_dim);
    super::resize(&mut s.k, n * kv_dim);
    super::resize(&mut s.v, n * kv_dim);
    crate::attention::prefetch_decode_kv(kv, ctx.layer, ctx.queries);
    let (wq, wk, wv) = (w.wq.view(ctx.file), w.wk.view(ctx.file), w.wv.view(ctx.file));
    let jobs = &mut [(wq, &mut s.q[..]), (wk, &mut s.k[..]), (wv, &mut s.v[..])];
    normed_matmul(input, c.norm_eps, &mut s.x, &s.proj, &mut s.xn, &mut s.act_q, jobs);
    dump("attn_norm", ctx.layer, &s.xn, n);
    finish_qkv(ctx, w, kv, s);
    dump("Qcur", ctx.layer, &s.q, n);
    dump("Kcur", ctx.layer, &s.k, n);
    dump("Vcur", ctx.layer, &s.v, n);
    if c.scale_q_first {
        ops::scale_inplace(&mut s.q, c.attn_scale);
    }
    let shape = AttnShape {
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: hd,
        scale: if c.scale_q_first { 1.0 } else { c.attn_scale },
        window: c.layer_window(ctx.layer),
        values_in_key_order: ctx.numerics == crate::model::Numerics::Packed,
    };
    super::resize(&mut s.attn, n * q_dim);
    attend(&shape, kv, ctx.layer, ctx.queries, &s.q, &mut s.attn);
    dump("kqv_out", ctx.layer, &s.attn, n);
    super::resize(&mut s.proj, n * c.d_model);
    w.wo.view(ctx.file).matmul(&s.attn, &mut s.act_q, &mut s.proj);
}

//! The attention sub-block shared by every architecture: q/k/v projections (+ biases, + per-head
//! norms where present), RoPE, writing k/v into the paged storage, attention, output projection.

use crate::matmul::matmul_many;
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

/// Reads `s.xn` ([n, d_model], already normed), leaves the attention output projected in `s.proj`.
pub(super) fn attention(ctx: &LayerCtx, w: &LayerWeights, kv: &mut KvStorage, s: &mut Scratch) {
    let c = ctx.cfg;
    let n = ctx.queries.len();
    let (hd, q_dim, kv_dim) = (c.head_dim, c.q_dim(), c.kv_dim());
    super::resize(&mut s.q, n * q_dim);
    super::resize(&mut s.k, n * kv_dim);
    super::resize(&mut s.v, n * kv_dim);
    crate::attention::prefetch_decode_kv(kv, ctx.layer, ctx.queries);
    let (wq, wk, wv) = (w.wq.view(ctx.file), w.wk.view(ctx.file), w.wv.view(ctx.file));
    matmul_many(&s.xn, &mut s.act_q, &mut [(wq, &mut s.q[..]), (wk, &mut s.k[..]), (wv, &mut s.v[..])]);
    for (buf, bias) in [(&mut s.q, &w.bq), (&mut s.k, &w.bk), (&mut s.v, &w.bv)] {
        if let Some(b) = bias {
            ops::add_bias(buf, b);
        }
    }
    if let (Some(qn), Some(kn)) = (&w.q_norm, &w.k_norm) {
        ops::rms_norm_inplace(&mut s.q, qn, c.norm_eps);
        ops::rms_norm_inplace(&mut s.k, kn, c.norm_eps);
    }
    for (x, dim) in [(&mut s.q, q_dim), (&mut s.k, kv_dim)] {
        ops::par_rows(x, dim, &[], 0, &|first, rows, _| {
            for (row, qp) in rows.chunks_exact_mut(dim).zip(&ctx.queries[first..]) {
                ctx.rope.apply(row, hd, qp.pos);
            }
        });
    }
    for (t, qp) in ctx.queries.iter().enumerate() {
        let slot = kv.slot(qp.block_table, qp.pos);
        kv.write(ctx.layer, slot, &s.k[t * kv_dim..(t + 1) * kv_dim], &s.v[t * kv_dim..(t + 1) * kv_dim]);
    }
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

//! llama (SmolLM2) and qwen2 (Qwen2.5: llama plus q/k/v biases and NeoX RoPE) decoder blocks:
//!   x += Wo·attn(rope(Wq·n1), rope(Wk·n1), Wv·n1),   n1 = rmsnorm(x)
//!   x += Wdown·(silu(Wgate·n2) ⊙ Wup·n2),             n2 = rmsnorm(x)

use crate::matmul::matmul_many;
use super::block::{attention, LayerCtx};
use super::weights::LayerWeights;
use super::{resize, Scratch};
use crate::kv::KvStorage;
use crate::debug_dump::dump;
use crate::ops;

pub(super) fn layer(ctx: &LayerCtx, w: &LayerWeights, kv: &mut KvStorage, s: &mut Scratch) {
    let c = ctx.cfg;
    let n = ctx.queries.len();
    resize(&mut s.xn, n * c.d_model);
    ops::rms_norm(&s.x, &w.attn_norm, c.norm_eps, &mut s.xn);
    dump("attn_norm", ctx.layer, &s.xn, n);
    attention(ctx, w, kv, s);
    dump("attn_out", ctx.layer, &s.proj, n);
    ops::add_inplace(&mut s.x, &s.proj);
    dump("ffn_inp", ctx.layer, &s.x, n);
    ops::rms_norm(&s.x, &w.ffn_norm, c.norm_eps, &mut s.xn);
    dump("ffn_norm", ctx.layer, &s.xn, n);
    resize(&mut s.gate, n * c.ffn_dim);
    resize(&mut s.up, n * c.ffn_dim);
    let (w_gate, w_up) = (w.w_gate.view(ctx.file), w.w_up.view(ctx.file));
    matmul_many(&s.xn, &mut s.act_q, &mut [(w_gate, &mut s.gate[..]), (w_up, &mut s.up[..])]);
    dump("ffn_gate", ctx.layer, &s.gate, n);
    dump("ffn_up", ctx.layer, &s.up, n);
    // One call per row, as ggml: swiglu's last partial vector (if ffn_dim % 16 != 0) is per row.
    ops::par_rows(&mut s.gate, c.ffn_dim, &s.up, c.ffn_dim, &|_, g, u| {
        g.chunks_exact_mut(c.ffn_dim).zip(u.chunks_exact(c.ffn_dim)).for_each(|(g, u)| crate::ggml_math::swiglu(g, u))
    });
    dump("ffn_swiglu", ctx.layer, &s.gate, n);
    w.w_down.view(ctx.file).matmul(&s.gate, &mut s.act_q, &mut s.proj);
    dump("ffn_out", ctx.layer, &s.proj, n);
    ops::add_inplace(&mut s.x, &s.proj);
    dump("l_out", ctx.layer, &s.x, n);
}

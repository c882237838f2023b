//! llama (SmolLM2) and qwen2 (Qwen2.5: llama plus q/k/v biases and NeoX RoPE) decoder blocks:
//!   x += Wo·attn(rope(Wq·n1), rope(Wk·n1), Wv·n1),   n1 = rmsnorm(x)
//!   x += Wdown·(silu(Wgate·n2) ⊙ Wup·n2),             n2 = rmsnorm(x)

use super::block::{attention, LayerCtx};
use super::weights::LayerWeights;
use super::{resize, Scratch};
use crate::kv::KvStorage;
use crate::ops;

pub(super) fn layer(ctx: &LayerCtx, w: &LayerWeights, kv: &mut KvStorage, s: &mut Scratch) {
    let c = ctx.cfg;
    let n = ctx.queries.len();
    resize(&mut s.xn, n * c.d_model);
    ops::rms_norm(&s.x, &w.attn_norm, c.norm_eps, &mut s.xn);
    attention(ctx, w, kv, s);
    ops::add_inplace(&mut s.x, &s.proj);
    ops::rms_norm(&s.x, &w.ffn_norm, c.norm_eps, &mut s.xn);
    resize(&mut s.gate, n * c.ffn_dim);
    resize(&mut s.up, n * c.ffn_dim);
    w.w_gate.view(ctx.file).matmul(&s.xn, &mut s.act_q, &mut s.gate);
    w.w_up.view(ctx.file).matmul(&s.xn, &mut s.act_q, &mut s.up);
    crate::ggml_math::swiglu(&mut s.gate, &s.up);
    w.w_down.view(ctx.file).matmul(&s.gate, &mut s.act_q, &mut s.proj);
    ops::add_inplace(&mut s.x, &s.proj);
}

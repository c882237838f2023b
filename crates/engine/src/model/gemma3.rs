//! gemma3 decoder block: like llama but with per-head q/k RMSNorm, a norm after each sub-block (before the
//! residual add), GELU(tanh) gating, and 5 of every 6 layers attending within a sliding window with their
//! own RoPE base (10,000; global layers use rope.freq_base). Norm weights in GGUF already include Gemma's +1.
//!   x += postnorm1(Wo·attn(rope(qnorm(Wq·n1)), rope(knorm(Wk·n1)), Wv·n1))
//!   x += postnorm2(Wdown·(gelu(Wgate·n2) ⊙ Wup·n2))

use crate::matmul::matmul_many;
use super::block::{attention, LayerCtx, NormedInput};
use super::weights::LayerWeights;
use super::{resize, Scratch};
use crate::kv::KvStorage;
use crate::debug_dump::dump;
use crate::ops;

pub(super) fn layer(ctx: &LayerCtx, w: &LayerWeights, kv: &mut KvStorage, s: &mut Scratch) {
    let c = ctx.cfg;
    let n = ctx.queries.len();
    let post_attn = w.post_attn_norm.as_ref().expect("gemma3 layers have post_attention_norm");
    let post_ffn = w.post_ffn_norm.as_ref().expect("gemma3 layers have post_ffw_norm");
    attention(ctx, w, &NormedInput { weight: &w.attn_norm, add_proj: false }, kv, s);
    ops::rms_norm_inplace(&mut s.proj, post_attn, c.norm_eps);
    ops::add_inplace(&mut s.x, &s.proj);
    dump("ffn_inp", ctx.layer, &s.x, n);
    ops::rms_norm(&s.x, &w.ffn_norm, c.norm_eps, &mut s.xn);
    resize(&mut s.gate, n * c.ffn_dim);
    resize(&mut s.up, n * c.ffn_dim);
    let (w_gate, w_up) = (w.w_gate.view(ctx.file), w.w_up.view(ctx.file));
    matmul_many(&s.xn, &mut s.act_q, &mut [(w_gate, &mut s.gate[..]), (w_up, &mut s.up[..])]);
    dump("ffn_norm", ctx.layer, &s.xn, n);
    dump("ffn_gate", ctx.layer, &s.gate, n);
    dump("ffn_up", ctx.layer, &s.up, n);
    ops::gelu_mul(&mut s.gate, &s.up);
    dump("ffn_geglu", ctx.layer, &s.gate, n);
    w.w_down.view(ctx.file).matmul(&s.gate, &mut s.act_q, &mut s.proj);
    dump("ffn_out", ctx.layer, &s.proj, n);
    ops::rms_norm_inplace(&mut s.proj, post_ffn, c.norm_eps);
    ops::add_inplace(&mut s.x, &s.proj);
    dump("l_out", ctx.layer, &s.x, n);
}

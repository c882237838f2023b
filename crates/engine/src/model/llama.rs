//! llama (SmolLM2) and qwen2 (Qwen2.5: llama plus q/k/v biases and NeoX RoPE) decoder blocks:
//!   x += Wo·attn(rope(Wq·n1), rope(Wk·n1), Wv·n1),   n1 = rmsnorm(x)
//!   x += Wdown·(silu(Wgate·n2) ⊙ Wup·n2),             n2 = rmsnorm(x)

use crate::matmul::matmul_many_filled;
use super::block::{attention, normed_matmul, LayerCtx, NormedInput};
use super::weights::LayerWeights;
use super::{resize, Scratch};
use crate::kv::KvStorage;
use crate::debug_dump::dump;
use crate::ops;

pub(super) fn layer(ctx: &LayerCtx, w: &LayerWeights, kv: &mut KvStorage, s: &mut Scratch) {
    let c = ctx.cfg;
    let n = ctx.queries.len();
    // The previous layer's last residual add (x += its FFN output) happens in this layer's first fill.
    let add_proj = std::mem::take(&mut s.residual_pending);
    attention(ctx, w, &NormedInput { weight: &w.attn_norm, add_proj }, kv, s);
    dump("attn_out", ctx.layer, &s.proj, n);
    resize(&mut s.gate, n * c.ffn_dim);
    resize(&mut s.up, n * c.ffn_dim);
    let (w_gate, w_up) = (w.w_gate.view(ctx.file), w.w_up.view(ctx.file));
    let ffn_input = NormedInput { weight: &w.ffn_norm, add_proj: true };
    normed_matmul(&ffn_input, c.norm_eps, &mut s.x, &s.proj, &mut s.xn, &mut s.act_q, &mut [(w_gate, &mut s.gate[..]), (w_up, &mut s.up[..])]);
    dump("ffn_inp", ctx.layer, &s.x, n);
    dump("ffn_norm", ctx.layer, &s.xn, n);
    dump("ffn_gate", ctx.layer, &s.gate, n);
    dump("ffn_up", ctx.layer, &s.up, n);
    // SwiGLU in the down projection's fill. One call per row, as ggml: swiglu's last partial vector (if
    // ffn_dim % 16 != 0) is per row.
    let (ffn, up) = (c.ffn_dim, &s.up[..]);
    let swiglu = |first: usize, last: usize, gate: &mut [f32]| {
        gate.chunks_exact_mut(ffn).zip(up[first * ffn..last * ffn].chunks_exact(ffn)).for_each(|(g, u)| crate::ggml_math::swiglu(g, u))
    };
    matmul_many_filled(&mut s.gate, &swiglu, &mut s.act_q, &mut [(w.w_down.view(ctx.file), &mut s.proj[..])]);
    dump("ffn_swiglu", ctx.layer, &s.gate, n);
    dump("ffn_out", ctx.layer, &s.proj, n);
    if crate::debug_dump::enabled() {
        ops::add_inplace(&mut s.x, &s.proj);
        dump("l_out", ctx.layer, &s.x, n);
    } else {
        s.residual_pending = true;
    }
}

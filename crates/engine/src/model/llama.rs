//! llama (SmolLM2, Llama 3.x, Mistral), and the block qwen2, qwen3 and phi3 share: pre-norm decoder blocks with SwiGLU,
//!   x += Wo·attn(rope(Wq·n1), rope(Wk·n1), Wv·n1),   n1 = rmsnorm(x)
//!   x += Wdown·(silu(Wgate·n2) ⊙ Wup·n2),             n2 = rmsnorm(x)
//! RoPE rotates adjacent pairs (x[2i], x[2i+1]) of each head: llama.cpp's "normal" layout.

use super::block::{attention, normed_matmul, AttentionWeights, FfnWeights, LayerCtx, NormedInput};
use super::config::{Meta, ModelConfig};
use super::weights::{Linear, Loader};
use super::{resize, Scratch};
use crate::error::Result;
use crate::kernels::matmul::matmul_many_filled;
use crate::kernels::ops::RopeStyle;
use crate::kv::KvStorage;

pub(super) fn config(meta: &Meta) -> Result<ModelConfig> {
    let mut c = meta.common(RopeStyle::Interleaved)?;
    // Llama 3.1+ long-context scaling: per-pair frequency divisors in a tensor (convert_hf_to_gguf's
    // `rope_freqs`), no `rope.scaling.type`.
    if meta.file.tensor_info("rope_freqs.weight").is_some() {
        c.rope_freq_factors = Some("rope_freqs.weight");
    }
    Ok(c)
}

/// One decoder block.
pub(super) struct Layer {
    pub attn_norm: Vec<f32>, // [d_model]
    pub attn: AttentionWeights,
    pub ffn_norm: Vec<f32>, // [d_model]
    pub ffn: FfnWeights,
}

impl Layer {
    pub fn load(ld: &Loader, cfg: &ModelConfig, i: usize) -> Result<Layer> {
        let n = |s: &str| format!("blk.{i}.{s}");
        Ok(Layer {
            attn_norm: ld.vector(&n("attn_norm.weight"), cfg.d_model)?,
            attn: AttentionWeights::load(ld, cfg, i)?,
            ffn_norm: ld.vector(&n("ffn_norm.weight"), cfg.d_model)?,
            ffn: FfnWeights::load(ld, cfg, i)?,
        })
    }

    pub fn matrices_mut(&mut self) -> Vec<&mut Linear> {
        self.ffn.with_attention(&mut self.attn)
    }

    /// The block on the step's residual stream. Its last add (x += the FFN's output in `s.proj`) is owed
    /// to the next reader of x, which does it inside its own parallel pass.
    pub fn forward(&self, ctx: &LayerCtx, kv: &mut KvStorage, s: &mut Scratch) {
        let add_proj = s.residual.take_owed();
        attention(ctx, &self.attn, &NormedInput { weight: &self.attn_norm, add_proj }, kv, s);
        ctx.trace("attn_out", &s.proj);
        ffn(ctx, &self.ffn_norm, &self.ffn, s);
    }
}

/// The feed-forward sub-block on the residual stream after a mixing sub-block left its output in
/// `s.proj` (its add owed): `x += proj; x += Wdown·(silu(Wgate·n2) ⊙ Wup·n2)`, this add owed in turn.
pub(super) fn ffn(ctx: &LayerCtx, ffn_norm: &[f32], ffn: &FfnWeights, s: &mut Scratch) {
        let c = ctx.cfg;
        let n = ctx.queries.len();
        resize(&mut s.gate, n * c.ffn_dim);
        resize(&mut s.up, n * c.ffn_dim);
        let (w_gate, w_up) = (ffn.gate.view(ctx.file), ffn.up.view(ctx.file));
        let ffn_input = NormedInput { weight: ffn_norm, add_proj: true };
        normed_matmul(&ffn_input, c.norm_eps, &mut s.residual.x, &s.proj, &mut s.xn, &mut s.act_q, &mut [(w_gate, &mut s.gate[..]), (w_up, &mut s.up[..])]);
        ctx.trace("ffn_inp", &s.residual.x);
        // SwiGLU in the down projection's fill. One call per row, as ggml: swiglu's last partial vector
        // (if ffn_dim % 16 != 0) is per row.
        let (ff, up) = (c.ffn_dim, &s.up[..]);
        let swiglu = |first: usize, last: usize, gate: &mut [f32]| {
            gate.chunks_exact_mut(ff).zip(up[first * ff..last * ff].chunks_exact(ff)).for_each(|(g, u)| crate::kernels::ggml::math::swiglu(g, u))
        };
        matmul_many_filled(&mut s.gate, &swiglu, &mut s.act_q, &mut [(ffn.down.view(ctx.file), &mut s.proj[..])]);
        ctx.trace("ffn_out", &s.proj);
        s.residual.owe_add();
        if ctx.tracer.is_some() {
            s.residual.settle(&s.proj);
            ctx.trace("l_out", &s.residual.x);
        }
}


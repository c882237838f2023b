//! gemma3: like llama but with per-head q/k RMSNorm, a norm after each sub-block (before the residual
//! add), GELU(tanh) gating, embeddings scaled by sqrt(d_model), and 5 of every 6 layers attending within
//! a sliding window with their own RoPE base (10,000; global layers use rope.freq_base). RoPE in NeoX
//! layout. Norm weights in GGUF already include Gemma's +1.
//!   x += postnorm1(Wo·attn(rope(qnorm(Wq·n1)), rope(knorm(Wk·n1)), Wv·n1)),   n1 = rmsnorm(x)
//!   x += postnorm2(Wdown·(gelu(Wgate·n2) ⊙ Wup·n2)),                        n2 = rmsnorm(x)

use super::block::{attention, AttentionWeights, FfnWeights, LayerCtx, NormedInput};
use super::config::{Meta, ModelConfig};
use super::weights::{Linear, Loader};
use super::{resize, Scratch};
use crate::error::Result;
use crate::kernels::matmul::matmul_many;
use crate::kernels::ops::{self, RopeStyle};
use crate::kv::KvStorage;

pub(super) fn config(meta: &Meta) -> Result<ModelConfig> {
    let mut c = meta.common(RopeStyle::Neox)?;
    c.sliding_window = Some(meta.usize("attention.sliding_window")?);
    c.swa_period = 6;
    c.rope_base_local = 10_000.0;
    // llama.cpp scales q before attention (not q·k): q is then rounded to f16 for the product.
    c.scale_q_first = true;
    // HF rounds sqrt(d_model) through the model's dtype; llama.cpp multiplies by the f32 value, as here.
    c.embed_scale = Some((c.d_model as f32).sqrt());
    Ok(c)
}

/// One decoder block.
pub(super) struct Layer {
    pub attn_norm: Vec<f32>, // [d_model]
    pub attn: AttentionWeights, // with q/k norms, [head_dim] each
    pub post_attn_norm: Vec<f32>, // [d_model]
    pub ffn_norm: Vec<f32>,  // [d_model]
    pub ffn: FfnWeights,
    pub post_ffn_norm: Vec<f32>, // [d_model]
}

impl Layer {
    pub fn load(ld: &Loader, cfg: &ModelConfig, i: usize) -> Result<Layer> {
        let (d, hd) = (cfg.d_model, cfg.head_dim);
        let n = |s: &str| format!("blk.{i}.{s}");
        let mut attn = AttentionWeights::load(ld, cfg, i)?;
        attn.qk_norm = Some([ld.vector(&n("attn_q_norm.weight"), hd)?, ld.vector(&n("attn_k_norm.weight"), hd)?]);
        Ok(Layer {
            attn_norm: ld.vector(&n("attn_norm.weight"), d)?,
            attn,
            post_attn_norm: ld.vector(&n("post_attention_norm.weight"), d)?,
            ffn_norm: ld.vector(&n("ffn_norm.weight"), d)?,
            ffn: FfnWeights::load(ld, cfg, i)?,
            post_ffn_norm: ld.vector(&n("post_ffw_norm.weight"), d)?,
        })
    }

    pub fn matrices_mut(&mut self) -> Vec<&mut Linear> {
        self.ffn.with_attention(&mut self.attn)
    }

    pub fn forward(&self, ctx: &LayerCtx, kv: &mut KvStorage, s: &mut Scratch) {
        let c = ctx.cfg;
        let n = ctx.queries.len();
        attention(ctx, &self.attn, &NormedInput { weight: &self.attn_norm, add_proj: false }, kv, s);
        ops::rms_norm_inplace(&mut s.proj, &self.post_attn_norm, c.norm_eps);
        ops::add_inplace(&mut s.residual.x, &s.proj);
        ctx.trace("ffn_inp", &s.residual.x);
        ops::rms_norm(&s.residual.x, &self.ffn_norm, c.norm_eps, &mut s.xn);
        resize(&mut s.gate, n * c.ffn_dim);
        resize(&mut s.up, n * c.ffn_dim);
        let (w_gate, w_up) = (self.ffn.gate.view(ctx.file), self.ffn.up.view(ctx.file));
        matmul_many(&s.xn, &mut s.act_q, &mut [(w_gate, &mut s.gate[..]), (w_up, &mut s.up[..])]);
        ops::gelu_mul(&mut s.gate, &s.up);
        self.ffn.down.view(ctx.file).matmul(&s.gate, &mut s.act_q, &mut s.proj);
        ctx.trace("ffn_out", &s.proj);
        ops::rms_norm_inplace(&mut s.proj, &self.post_ffn_norm, c.norm_eps);
        ops::add_inplace(&mut s.residual.x, &s.proj);
        ctx.trace("l_out", &s.residual.x);
    }
}

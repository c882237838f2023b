//! qwen3moe (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3's attention (per-head q/k norms, NeoX RoPE, a head
//! size of its own) and a mixture of SwiGLU experts in place of the dense feed-forward (moe.rs).
//!   x += Wo·attn(rope(qnorm(Wq·n1)), rope(knorm(Wk·n1)), Wv·n1),   n1 = rmsnorm(x)
//!   x += moe(n2),                                                n2 = rmsnorm(x)

use super::block::{attention, AttentionWeights, LayerCtx, NormedInput};
use super::config::{Meta, ModelConfig, MoeConfig};
use super::moe::MoeWeights;
use super::weights::{Linear, Loader};
use super::Scratch;
use crate::error::Result;
use crate::kernels::ops::RopeStyle;
use crate::kv::KvStorage;

pub(super) fn config(meta: &Meta) -> Result<ModelConfig> {
    let mut c = meta.common(RopeStyle::Neox)?;
    let n_used = meta.usize("expert_used_count")?;
    // llama.cpp's fallback where a file has no expert size: the dense size split over the used experts
    let ffn_dim = meta.usize("expert_feed_forward_length").unwrap_or(c.ffn_dim / n_used.max(1));
    c.moe = Some(MoeConfig { n_expert: meta.usize("expert_count")?, n_used, ffn_dim, norm_weights: true });
    Ok(c)
}

/// One decoder block.
pub(super) struct Layer {
    pub attn_norm: Vec<f32>, // [d_model]
    pub attn: AttentionWeights, // with q/k norms
    pub ffn_norm: Vec<f32>,  // [d_model]
    pub moe: MoeWeights,
}

impl Layer {
    pub fn load(ld: &Loader, cfg: &ModelConfig, i: usize) -> Result<Layer> {
        let n = |s: &str| format!("blk.{i}.{s}");
        let mut attn = AttentionWeights::load(ld, cfg, i)?;
        attn.qk_norm = Some(super::qwen3::qk_norms(ld, cfg, i)?);
        Ok(Layer { attn_norm: ld.vector(&n("attn_norm.weight"), cfg.d_model)?, attn, ffn_norm: ld.vector(&n("ffn_norm.weight"), cfg.d_model)?, moe: MoeWeights::load(ld, cfg, i)? })
    }

    pub fn matrices_mut(&mut self) -> Vec<&mut Linear> {
        let mut all: Vec<&mut Linear> = self.attn.matrices_mut().into();
        all.extend(self.moe.matrices_mut());
        all
    }

    /// The block on the step's residual stream; its last add is owed, as llama's (llama.rs).
    pub fn forward(&self, ctx: &LayerCtx, kv: &mut KvStorage, s: &mut Scratch) {
        let add_proj = s.residual.take_owed();
        attention(ctx, &self.attn, &NormedInput { weight: &self.attn_norm, add_proj }, kv, s);
        ctx.trace("attn_out", &s.proj);
        self.moe.forward(ctx, &NormedInput { weight: &self.ffn_norm, add_proj: true }, s);
        s.residual.owe_add();
        if ctx.tracer.is_some() {
            s.residual.settle(&s.proj);
            ctx.trace("l_out", &s.residual.x);
        }
    }
}

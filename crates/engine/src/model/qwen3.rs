//! qwen3 (Qwen3 dense): llama's block (llama.rs) without biases, with a per-head RMSNorm of q and of k
//! before RoPE (as gemma3), NeoX RoPE, and a head size of its own (`attention.key_length`, so q_dim may
//! differ from d_model: Qwen3-4B's 32 heads of 128 over 2,560).
//!   x += Wo·attn(rope(qnorm(Wq·n1)), rope(knorm(Wk·n1)), Wv·n1),   n1 = rmsnorm(x)
//!   x += Wdown·(silu(Wgate·n2) ⊙ Wup·n2),                        n2 = rmsnorm(x)

use super::config::{Meta, ModelConfig};
use super::llama::Layer;
use super::weights::Loader;
use crate::error::Result;
use crate::kernels::ops::RopeStyle;

pub(super) fn config(meta: &Meta) -> Result<ModelConfig> {
    meta.common(RopeStyle::Neox)
}

/// llama's block, its attention with the q/k norms ([head_dim] each).
pub(super) fn load_layer(ld: &Loader, cfg: &ModelConfig, i: usize) -> Result<Layer> {
    let mut layer = Layer::load(ld, cfg, i)?;
    layer.attn.qk_norm = Some(qk_norms(ld, cfg, i)?);
    Ok(layer)
}

/// Layer `i`'s q and k norm weights (qwen3moe's attention has them too).
pub(super) fn qk_norms(ld: &Loader, cfg: &ModelConfig, i: usize) -> Result<[Vec<f32>; 2]> {
    let n = |s: &str| format!("blk.{i}.{s}");
    Ok([ld.vector(&n("attn_q_norm.weight"), cfg.head_dim)?, ld.vector(&n("attn_k_norm.weight"), cfg.head_dim)?])
}

//! qwen2 (Qwen2.5): llama's block (llama.rs) with biases on the q, k and v projections, and RoPE rotating
//! the two halves of each head (x[i], x[i + rot/2]): llama.cpp's NeoX layout.

use super::config::{Meta, ModelConfig};
use super::llama::Layer;
use super::weights::Loader;
use crate::error::Result;
use crate::kernels::ops::RopeStyle;

pub(super) fn config(meta: &Meta) -> Result<ModelConfig> {
    meta.common(RopeStyle::Neox)
}

/// llama's block, its attention with the q/k/v biases ([q_dim], [kv_dim], [kv_dim]).
pub(super) fn load_layer(ld: &Loader, cfg: &ModelConfig, i: usize) -> Result<Layer> {
    let mut layer = Layer::load(ld, cfg, i)?;
    layer.attn.bias = Some(biases(ld, cfg, i)?);
    Ok(layer)
}

fn biases(ld: &Loader, cfg: &ModelConfig, i: usize) -> Result<[Vec<f32>; 3]> {
    let n = |s: &str| format!("blk.{i}.{s}");
    Ok([ld.vector(&n("attn_q.bias"), cfg.q_dim())?, ld.vector(&n("attn_k.bias"), cfg.kv_dim())?, ld.vector(&n("attn_v.bias"), cfg.kv_dim())?])
}


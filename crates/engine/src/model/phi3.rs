//! phi3 (Phi-3, Phi-3.5-mini, Phi-4-mini): llama's block (llama.rs) with its q/k/v in one fused matrix
//! and its gate and up in another, NeoX RoPE over the first `rope.dimension_count` dimensions of a head
//! (Phi-4-mini: 96 of 128), q scaled by 1/sqrt(head_dim) before attention (llama.cpp scales q, not
//! q·k), and RoPE frequency factors in tensors.
//!   [q; k; v] = Wqkv·n1                      Wqkv: [q_dim + 2 kv_dim, d_model]
//!   [gate; up] = Wgate_up·n2                 Wgate_up: [2 ffn_dim, d_model]
//! A fused matrix's parts are its row ranges, so each is loaded as a matrix of its own: every output
//! row's dot is the one the fused product computes.
//!
//! Rope factors: the long-context models carry `rope_factors_long` and `rope_factors_short`; llama.cpp
//! takes the short ones while the context is at most `rope.scaling.original_context_length`. reckon
//! takes the short ones and caps the context there (a longer context would need the long ones).

use super::block::{AttentionWeights, FfnWeights};
use super::config::{Meta, ModelConfig};
use super::llama::Layer;
use super::weights::Loader;
use crate::error::Result;
use crate::kernels::ops::RopeStyle;

pub(super) fn config(meta: &Meta) -> Result<ModelConfig> {
    let mut c = meta.common(RopeStyle::Neox)?;
    c.scale_q_first = true;
    if meta.file.tensor_info("rope_factors_short.weight").is_some() {
        c.rope_freq_factors = Some("rope_factors_short.weight");
    }
    if meta.file.tensor_info("rope_factors_long.weight").is_some() {
        if let Ok(original) = meta.usize("rope.scaling.original_context_length") {
            c.context_length = c.context_length.min(original);
        }
    }
    // llama.cpp reads phi3's sliding window and turns it off (its conversion sets it wrongly), as here.
    Ok(c)
}

/// llama's block from phi3's fused tensors (or separate q/k/v where a file has them).
pub(super) fn load_layer(ld: &Loader, cfg: &ModelConfig, i: usize) -> Result<Layer> {
    let n = |s: &str| format!("blk.{i}.{s}");
    let (d, q, kv, ff) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim(), cfg.ffn_dim);
    let attn = if ld.has(&n("attn_qkv.weight")) {
        let qkv = n("attn_qkv.weight");
        let rows = q + 2 * kv;
        AttentionWeights {
            wq: ld.linear_rows(&qkv, rows, 0, q, d)?,
            wk: ld.linear_rows(&qkv, rows, q, kv, d)?,
            wv: ld.linear_rows(&qkv, rows, q + kv, kv, d)?,
            wo: ld.linear(&n("attn_output.weight"), d, q)?,
            bias: None,
            qk_norm: None,
        }
    } else {
        AttentionWeights::load(ld, cfg, i)?
    };
    let up = n("ffn_up.weight");
    let ffn = FfnWeights { gate: ld.linear_rows(&up, 2 * ff, 0, ff, d)?, up: ld.linear_rows(&up, 2 * ff, ff, ff, d)?, down: ld.linear(&n("ffn_down.weight"), d, ff)? };
    Ok(Layer { attn_norm: ld.vector(&n("attn_norm.weight"), d)?, attn, ffn_norm: ld.vector(&n("ffn_norm.weight"), d)?, ffn })
}

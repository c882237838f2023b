//! lfm2 (Liquid's LFM2 / LFM2.5): a hybrid of gated short convolutions and attention. Most layers mix
//! tokens with a depthwise convolution over the last `l_cache` (3) positions instead of attention:
//!   [b; c; x] = Win·n1                     Win: [3 d_model, d_model]
//!   y_t = c_t ⊙ Σ_j w_j ⊙ (b ⊙ x)_{t-2+j}    w: [d_model, 3], j = 0..2, oldest first
//!   x += Wout·y,                            n1 = rmsnorm(x)
//! the rest are qwen3-style attention (per-head q/k norms, NeoX RoPE); every layer ends with a SwiGLU
//! feed-forward (llama's). A convolution's state is the last 2 positions of b ⊙ x per channel, carried per
//! sequence in `KvStorage::conv_states` (zeroed at position 0), with a snapshot at the end of the blocks that hold a
//! state slot so a prefix-cache hit resumes from its last block (`kv::conv_state`). GGUF keys: `shortconv.l_cache`, and
//! `attention.head_count_kv` per layer (0 for a convolution). The final norm is `token_embd_norm.weight`.

use super::block::{normed_matmul, FfnWeights, LayerCtx, NormedInput};
use super::config::{Meta, ModelConfig, ShortConv};
use super::llama::Layer as LlamaLayer;
use super::weights::{Linear, Loader};
use super::{resize, Capabilities, Scratch};
use crate::error::{Error, Result};
use crate::kernels::ops::RopeStyle;
use crate::kv::KvStorage;

pub(super) fn config(meta: &Meta) -> Result<ModelConfig> {
    let mut c = meta.common(RopeStyle::Neox)?;
    let kv_heads: Vec<u64> = match meta.file.get(&"lfm2.attention.head_count_kv") {
        Some(v) => match v.as_array() {
            Some(a) => a.iter().map(|x| x.as_u64().ok_or_else(|| Error::Metadata("lfm2.attention.head_count_kv: not integers".into()))).collect::<Result<_>>()?,
            None => vec![v.as_u64().unwrap_or(0); c.n_layers],
        },
        None => return Err(Error::Metadata("lfm2.attention.head_count_kv is missing".into())),
    };
    if kv_heads.len() != c.n_layers {
        return Err(Error::Metadata(format!("lfm2.attention.head_count_kv has {} entries for {} layers", kv_heads.len(), c.n_layers)));
    }
    let attn: Vec<u64> = kv_heads.iter().copied().filter(|&h| h > 0).collect();
    match attn.first() {
        Some(&h) if attn.iter().all(|&x| x == h) => c.n_kv_heads = h as usize,
        _ => return Err(Error::Unsupported(format!("lfm2 attention layers with KV head counts {kv_heads:?} (one count for every attention layer)"))),
    }
    let l_cache = meta.usize("shortconv.l_cache")?;
    if l_cache < 2 {
        return Err(Error::Metadata(format!("lfm2.shortconv.l_cache = {l_cache}: a convolution reads at least 2 positions")));
    }
    c.short_conv = Some(ShortConv { l_cache, is_conv: kv_heads.iter().map(|&h| h == 0).collect() });
    // The convolution layers' state is snapshotted at block ends (a prefix-cache hit resumes from it,
    // also from the disk tier) but not rolled back over rejected guesses, nor kept for positions a
    // window or sparse prefill skips: what would need that is refused, not run wrong.
    c.capabilities = Capabilities {
        speculation: false,
        sparse_prefill: false,
        sparse_attention: false,
        kv_window: false,
        state_snapshots: true,
        images: false,
        limitation: "lfm2 has recurrent (short-convolution) layers, whose state goes with its sequence and is not rolled back",
    };
    Ok(c)
}

/// One layer: attention (llama's block with q/k norms) or a short convolution, each with its FFN.
pub(super) enum Layer {
    Attention(LlamaLayer),
    Conv(ConvLayer),
}

pub(super) struct ConvLayer {
    pub norm: Vec<f32>,   // [d_model] operator norm
    pub b: Linear,        // [d_model, d_model] rows 0..d of in_proj
    pub c: Linear,        // rows d..2d
    pub x: Linear,        // rows 2d..3d
    pub kernel: Vec<f32>, // [d_model, l_cache]
    pub out: Linear,      // [d_model, d_model]
    pub ffn_norm: Vec<f32>,
    pub ffn: FfnWeights,
}

impl Layer {
    pub fn load(ld: &Loader, cfg: &ModelConfig, i: usize) -> Result<Layer> {
        let sc = cfg.short_conv.as_ref().expect("lfm2 has short convolutions");
        let n = |s: &str| format!("blk.{i}.{s}");
        let d = cfg.d_model;
        if !sc.is_conv[i] {
            let mut layer = LlamaLayer::load(ld, cfg, i)?;
            layer.attn.qk_norm = Some(super::qwen3::qk_norms(ld, cfg, i)?);
            return Ok(Layer::Attention(layer));
        }
        let inp = n("shortconv.in_proj.weight");
        Ok(Layer::Conv(ConvLayer {
            norm: ld.vector(&n("attn_norm.weight"), d)?,
            b: ld.linear_rows(&inp, 3 * d, 0, d, d)?,
            c: ld.linear_rows(&inp, 3 * d, d, d, d)?,
            x: ld.linear_rows(&inp, 3 * d, 2 * d, d, d)?,
            kernel: ld.vector(&n("shortconv.conv.weight"), d * sc.l_cache)?,
            out: ld.linear(&n("shortconv.out_proj.weight"), d, d)?,
            ffn_norm: ld.vector(&n("ffn_norm.weight"), d)?,
            ffn: FfnWeights::load(ld, cfg, i)?,
        }))
    }

    pub fn matrices_mut(&mut self) -> Vec<&mut Linear> {
        match self {
            Layer::Attention(l) => l.matrices_mut(),
            Layer::Conv(l) => {
                let mut all = vec![&mut l.b, &mut l.c, &mut l.x, &mut l.out];
                all.extend([&mut l.ffn.gate, &mut l.ffn.up, &mut l.ffn.down]);
                all
            }
        }
    }

    pub fn forward(&self, ctx: &LayerCtx, kv: &mut KvStorage, s: &mut Scratch) {
        match self {
            Layer::Attention(l) => l.forward(ctx, kv, s),
            Layer::Conv(l) => {
                l.mix(ctx, kv, s);
                ctx.trace("attn_out", &s.proj);
                super::llama::ffn(ctx, &l.ffn_norm, &l.ffn, s);
            }
        }
    }
}

impl ConvLayer {
    /// The convolution sub-block: `s.proj = Wout·y` (its residual add owed, as llama's attention's).
    fn mix(&self, ctx: &LayerCtx, kv: &mut KvStorage, s: &mut Scratch) {
        let c = ctx.cfg;
        let sc = c.short_conv.as_ref().expect("lfm2");
        let (n, d, keep) = (ctx.queries.len(), c.d_model, sc.l_cache - 1);
        let add_proj = s.residual.take_owed();
        resize(&mut s.xn, n * d);
        // b, c and x into the q, k and v buffers (sized [n, d] here)
        resize(&mut s.q, n * d);
        resize(&mut s.k, n * d);
        resize(&mut s.v, n * d);
        let jobs = &mut [(self.b.view(ctx.file), &mut s.q[..]), (self.c.view(ctx.file), &mut s.k[..]), (self.x.view(ctx.file), &mut s.v[..])];
        normed_matmul(&NormedInput { weight: &self.norm, add_proj }, c.norm_eps, &mut s.residual.x, &s.proj, &mut s.xn, &mut s.act_q, jobs);
        // bx = b ⊙ x, in place in s.v
        s.v.iter_mut().zip(&s.q).for_each(|(x, &b)| *x *= b);
        let layer = sc.conv_index(ctx.layer);
        let bs = kv.shape.block_size;
        resize(&mut s.attn, n * d);
        let mut window = vec![0.0f32; sc.l_cache];
        for (t, &seq) in ctx.seq_of.iter().enumerate() {
            let slot = ctx.states[seq].expect("a hybrid model's sequences have state slots");
            let (pos, table) = (ctx.positions[t], ctx.queries[t].block_table);
            debug_assert_eq!(pos, ctx.queries[t].pos, "no window or sparse prefill with conv layers");
            // the state at this token: the slot's own, or (first token of a chunk after a cache hit or a
            // recompute) the snapshot of the block that ends here
            let ending = (pos > 0 && pos % bs == 0).then(|| table[pos / bs - 1]);
            let (state, absorbed) = kv.conv_states.at(slot, layer, pos, ending);
            let bx = &s.v[t * d..(t + 1) * d];
            let out = &mut s.attn[t * d..(t + 1) * d];
            for ch in 0..d {
                let hist = &mut state[ch * keep..(ch + 1) * keep];
                window[..keep].copy_from_slice(hist);
                window[keep] = bx[ch];
                // ggml_ssm_conv: a row's dot in order, oldest position first, FMA-contracted as GCC builds it
                let w = &self.kernel[ch * sc.l_cache..(ch + 1) * sc.l_cache];
                let mut sum = 0.0f32;
                for (v, k) in window.iter().zip(w) {
                    sum = v.mul_add(*k, sum);
                }
                out[ch] = sum;
                hist.copy_from_slice(&window[1..]);
            }
            *absorbed = pos + 1;
            if (pos + 1) % bs == 0 {
                kv.conv_states.snapshot(slot, layer, table[pos / bs]);
            }
        }
        // y = c ⊙ conv
        s.attn.iter_mut().zip(&s.k).for_each(|(y, &cg)| *y = cg * *y);
        ctx.trace("conv_y", &s.attn);
        resize(&mut s.proj, n * d);
        self.out.view(ctx.file).matmul(&s.attn, &mut s.act_q, &mut s.proj);
    }
}

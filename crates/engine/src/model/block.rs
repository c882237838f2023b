//! What the architectures' layers share: the attention sub-block (q/k/v projections, their biases or
//! per-head norms where an architecture has them, RoPE, the KV write, paged attention, the output
//! projection), the normed matmul that feeds a sub-block, the residual stream, and tracing.

use super::weights::{Linear, Loader};
use super::{ModelConfig, Scratch};
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::kernels::attention::{attend, AttnShape, QueryPos};
use crate::kernels::matmul::{matmul_many_filled, QMatrix};
use crate::kernels::ops::{self, Rope};
use crate::kv::KvStorage;

/// Receives named activations during a forward step (parity debugging against llama.cpp's graph).
pub trait Tracer: Send + Sync {
    /// `rows`: `[n, width]` activations of the step's `n` tokens.
    fn record(&self, name: &str, layer: usize, rows: &[f32], n: usize);
}

/// Writes the last token's row of each activation to `{dir}/{name}-{layer}.f32` (raw little-endian
/// f32, overwritten every step), the layout bench/llamacpp_tensors.py compares.
pub struct DumpDir(pub std::path::PathBuf);

impl Tracer for DumpDir {
    fn record(&self, name: &str, layer: usize, rows: &[f32], n: usize) {
        if n == 0 {
            return;
        }
        let width = rows.len() / n;
        let bytes: Vec<u8> = rows[(n - 1) * width..].iter().flat_map(|x| x.to_le_bytes()).collect();
        let _ = std::fs::write(self.0.join(format!("{name}-{layer}.f32")), bytes);
    }
}

/// What a layer's forward step needs besides its weights and the buffers.
pub(super) struct LayerCtx<'a> {
    pub cfg: &'a ModelConfig,
    pub file: &'a GgufFile,
    pub layer: usize,
    /// The layer's slot in a KV block (`kv::layout`; the layer itself without a hybrid layout).
    pub kv_layer: usize,
    pub rope: &'a Rope,
    pub queries: &'a [QueryPos<'a>],
    /// Each query's position in its sequence (RoPE's); `queries[i].pos` is its place in the block table
    /// it reads, which a KV window renumbers (`kv::window`).
    pub positions: &'a [usize],
    pub numerics: crate::kernels::packed::Numerics,
    /// Sparse attention over each query's history (`kv::sparse`), in this layer.
    pub sparse: Option<crate::kv::SparseAttention>,
    pub tracer: Option<&'a dyn Tracer>,
    /// Each token's sequence (an index into the step's sequences), and each sequence's recurrent-state
    /// slot (`SeqInput::state`): a hybrid model's convolution layers read them.
    pub seq_of: &'a [usize],
    pub states: &'a [Option<u32>],
}

impl LayerCtx<'_> {
    pub fn trace(&self, name: &str, rows: &[f32]) {
        if let Some(t) = self.tracer {
            t.record(name, self.layer, rows, self.queries.len());
        }
    }
}

/// The residual stream `x` (`[n, d_model]`). A layer may leave its last add (`x += proj`) owed: the next
/// reader of `x` does it inside its own parallel pass (llama's blocks do, so the add costs no pass of its
/// own), and the model settles what is owed after the last layer.
#[derive(Default)]
pub(crate) struct Residual {
    pub x: Vec<f32>,
    owed: bool,
}

impl Residual {
    /// Starts a step: `n * d` values, nothing owed.
    pub fn reset(&mut self, len: usize) {
        self.x.resize(len, 0.0);
        self.owed = false;
    }

    /// `x += proj` is owed to the next reader.
    pub fn owe_add(&mut self) {
        self.owed = true;
    }

    /// Whether `x += proj` is owed; the caller now does it.
    pub fn take_owed(&mut self) -> bool {
        std::mem::take(&mut self.owed)
    }

    /// Does the owed add now, if any.
    pub fn settle(&mut self, proj: &[f32]) {
        if self.take_owed() {
            ops::add_inplace(&mut self.x, proj);
        }
    }
}

/// The attention projections of a layer, and the extras some architectures add.
pub(super) struct AttentionWeights {
    pub wq: Linear, // [q_dim, d_model]
    pub wk: Linear, // [kv_dim, d_model]
    pub wv: Linear, // [kv_dim, d_model]
    pub wo: Linear, // [d_model, q_dim]
    /// q/k/v biases ([q_dim], [kv_dim], [kv_dim]): qwen2.
    pub bias: Option<[Vec<f32>; 3]>,
    /// Per-head RMSNorm weights of q and k ([head_dim] each), before RoPE: gemma3.
    pub qk_norm: Option<[Vec<f32>; 2]>,
}

impl AttentionWeights {
    /// Layer `i`'s projections, without extras.
    pub fn load(ld: &Loader, cfg: &ModelConfig, i: usize) -> Result<Self> {
        let (d, q, kv) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim());
        let n = |s: &str| format!("blk.{i}.{s}");
        Ok(AttentionWeights {
            wq: ld.linear(&n("attn_q.weight"), q, d)?,
            wk: ld.linear(&n("attn_k.weight"), kv, d)?,
            wv: ld.linear(&n("attn_v.weight"), kv, d)?,
            wo: ld.linear(&n("attn_output.weight"), d, q)?,
            bias: None,
            qk_norm: None,
        })
    }

    pub fn matrices_mut(&mut self) -> [&mut Linear; 4] {
        [&mut self.wq, &mut self.wk, &mut self.wv, &mut self.wo]
    }
}

/// The feed-forward projections of a layer (the activation between them is the architecture's).
pub(super) struct FfnWeights {
    pub gate: Linear, // [ffn_dim, d_model]
    pub up: Linear,   // [ffn_dim, d_model]
    pub down: Linear, // [d_model, ffn_dim]
}

impl FfnWeights {
    pub fn load(ld: &Loader, cfg: &ModelConfig, i: usize) -> Result<Self> {
        let (d, ff) = (cfg.d_model, cfg.ffn_dim);
        let n = |s: &str| format!("blk.{i}.{s}");
        Ok(FfnWeights { gate: ld.linear(&n("ffn_gate.weight"), ff, d)?, up: ld.linear(&n("ffn_up.weight"), ff, d)?, down: ld.linear(&n("ffn_down.weight"), d, ff)? })
    }

    /// Every matrix of a layer: attention's, then these.
    pub fn with_attention<'a>(&'a mut self, attn: &'a mut AttentionWeights) -> Vec<&'a mut Linear> {
        let mut all: Vec<&mut Linear> = attn.matrices_mut().into();
        all.extend([&mut self.gate, &mut self.up, &mut self.down]);
        all
    }
}

/// A sub-block's input: `xn = rmsnorm(x) · weight`, after `x += proj` (the previous sub-block's output,
/// its residual add owed to here) when `add_proj`.
pub(super) struct NormedInput<'w> {
    pub weight: &'w [f32],
    pub add_proj: bool,
}

/// The matmuls of `jobs` over `xn` made from `x` as `input` says (`xn`: `[n, d_model]`, written). The
/// add and the norm run inside the matmul's parallel run (`FillRows`), each token's row as alone.
pub(super) fn normed_matmul(input: &NormedInput, eps: f32, x: &mut [f32], proj: &[f32], xn: &mut [f32], act_q: &mut Vec<u8>, jobs: &mut [(QMatrix, &mut [f32])]) {
    let d = input.weight.len();
    let x_rows = ops::SharedRows::new(x, d);
    let fill = |first: usize, last: usize, out: &mut [f32]| {
        // SAFETY: the matmul hands each token range to one part; `x` is borrowed for the call.
        let x = unsafe { x_rows.rows(first, last) };
        if input.add_proj {
            x.iter_mut().zip(&proj[first * d..last * d]).for_each(|(a, &b)| *a += b);
        }
        ops::rms_norm_here(x, input.weight, eps, out);
    };
    matmul_many_filled(xn, &fill, act_q, jobs);
}

/// Tokens below which `finish_qkv` stays on the calling thread (a parallel run costs a few µs).
const FINISH_PAR_MIN_TOKENS: usize = 2;

/// Per token, in ggml's order: q/k/v biases, per-head q/k norms, RoPE of q and k, then k and v into the
/// token's KV cell. One parallel run over the tokens (each token's rows as alone), not one pass per
/// operation: at decode batches those ran on one thread while the other waited.
fn finish_qkv(ctx: &LayerCtx, w: &AttentionWeights, kv: &mut KvStorage, s: &mut Scratch) {
    let c = ctx.cfg;
    let n = ctx.queries.len();
    let (hd, q_dim, kv_dim) = (c.head_dim, c.q_dim(), c.kv_dim());
    let writer = kv.layer_writer(ctx.kv_layer);
    let (q, k, v) = (ops::SharedRows::new(&mut s.q, q_dim), ops::SharedRows::new(&mut s.k, kv_dim), ops::SharedRows::new(&mut s.v, kv_dim));
    let tokens = |first: usize, last: usize| {
        // SAFETY: each token range goes to one part; the buffers are borrowed for the run.
        let (q, k, v) = unsafe { (q.rows(first, last), k.rows(first, last), v.rows(first, last)) };
        if let Some(biases) = &w.bias {
            for (buf, b) in [&mut *q, &mut *k, &mut *v].into_iter().zip(biases) {
                buf.chunks_exact_mut(b.len()).for_each(|row| row.iter_mut().zip(b).for_each(|(a, &b)| *a += b));
            }
        }
        if let Some([qn, kn]) = &w.qk_norm {
            ops::rms_norm_inplace_here(q, qn, c.norm_eps);
            ops::rms_norm_inplace_here(k, kn, c.norm_eps);
        }
        for (i, (qp, &pos)) in ctx.queries[first..last].iter().zip(&ctx.positions[first..last]).enumerate() {
            ctx.rope.apply(&mut q[i * q_dim..(i + 1) * q_dim], hd, pos);
            ctx.rope.apply(&mut k[i * kv_dim..(i + 1) * kv_dim], hd, pos);
            // SAFETY: a batch's tokens have distinct cells, and this part alone handles this token.
            unsafe { writer.write(writer.slot(qp.block_table, qp.pos), &k[i * kv_dim..(i + 1) * kv_dim], &v[i * kv_dim..(i + 1) * kv_dim]) };
        }
    };
    let pool = crate::pool::current();
    if n < FINISH_PAR_MIN_TOKENS || pool.threads() == 1 {
        return tokens(0, n);
    }
    let parts = n.min(4 * pool.threads());
    pool.run(parts, &|p| tokens(p * n / parts, (p + 1) * n / parts));
}

/// Makes `s.xn` from the residual stream as `input` says (see `normed_matmul`), leaves the attention
/// output projected in `s.proj`: `proj = Wo·attn(rope(q), rope(k), v)` over the paged KV.
pub(super) fn attention(ctx: &LayerCtx, w: &AttentionWeights, input: &NormedInput, kv: &mut KvStorage, s: &mut Scratch) {
    let c = ctx.cfg;
    let n = ctx.queries.len();
    let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
    super::resize(&mut s.xn, n * c.d_model);
    super::resize(&mut s.q, n * q_dim);
    super::resize(&mut s.k, n * kv_dim);
    super::resize(&mut s.v, n * kv_dim);
    crate::kernels::attention::prefetch_decode_kv(kv, ctx.kv_layer, ctx.queries);
    let (wq, wk, wv) = (w.wq.view(ctx.file), w.wk.view(ctx.file), w.wv.view(ctx.file));
    let jobs = &mut [(wq, &mut s.q[..]), (wk, &mut s.k[..]), (wv, &mut s.v[..])];
    normed_matmul(input, c.norm_eps, &mut s.residual.x, &s.proj, &mut s.xn, &mut s.act_q, jobs);
    ctx.trace("attn_norm", &s.xn);
    finish_qkv(ctx, w, kv, s);
    ctx.trace("Qcur", &s.q);
    ctx.trace("Kcur", &s.k);
    ctx.trace("Vcur", &s.v);
    if c.scale_q_first {
        ops::scale_inplace(&mut s.q, c.attn_scale);
    }
    let shape = AttnShape {
        n_heads: c.n_heads,
        n_kv_heads: c.n_kv_heads,
        head_dim: c.head_dim,
        scale: if c.scale_q_first { 1.0 } else { c.attn_scale },
        window: c.layer_window(ctx.layer),
        values_in_key_order: ctx.numerics == crate::kernels::packed::Numerics::Packed,
    };
    super::resize(&mut s.attn, n * q_dim);
    match ctx.sparse {
        Some(sparse) => {
            // each block of queries at depth through its view (sinks, picked history blocks, recent blocks)
            let views = crate::kernels::attention::sparse::select(&sparse, c.n_heads, kv, ctx.kv_layer, ctx.queries, &s.q);
            attend(&shape, kv, ctx.kv_layer, &views.apply(ctx.queries), &s.q, &mut s.attn);
        }
        None => attend(&shape, kv, ctx.kv_layer, ctx.queries, &s.q, &mut s.attn),
    }
    ctx.trace("kqv_out", &s.attn);
    super::resize(&mut s.proj, n * c.d_model);
    w.wo.view(ctx.file).matmul(&s.attn, &mut s.act_q, &mut s.proj);
}

//! A mixture-of-experts feed-forward (qwen3moe's; llama.cpp's `build_moe_ffn` with softmax gating):
//!   p = softmax(Wr·xn)                         Wr: [n_expert, d_model], p: [n_expert] per token
//!   E = the n_used largest p, largest first;   w_e = p_e (/ Σ_E p when the weights are normalised)
//!   out = Σ_{e in E, in that order} w_e · Wdown_e·(silu(Wgate_e·xn) ⊙ Wup_e·xn)
//! The experts' matmuls run by expert over the step's tokens that chose it, all of a projection's
//! experts in one parallel pass (`matmul_ranges`): a decode step reads only its chosen experts' rows,
//! and a prefill chunk reads each chosen expert once for all its tokens. Every row is computed as
//! alone (ggml's mul_mat_id is per row too), so batching changes no bit.

use super::block::{normed_matmul, LayerCtx, NormedInput};
use super::config::{ModelConfig, MoeConfig};
use super::weights::{Linear, Loader};
use super::Scratch;
use crate::error::Result;
use crate::kernels::ggml::math::{soft_max_row, swiglu};
use crate::kernels::matmul::matmul_ranges;

/// One layer's router and experts.
pub(super) struct MoeWeights {
    pub cfg: MoeConfig,
    pub router: Linear,    // [n_expert, d_model]
    pub gate: Vec<Linear>, // n_expert x [ffn_dim, d_model]
    pub up: Vec<Linear>,   // n_expert x [ffn_dim, d_model]
    pub down: Vec<Linear>, // n_expert x [d_model, ffn_dim]
}

/// A step's MoE buffers, reused between steps.
#[derive(Default)]
pub(crate) struct MoeScratch {
    logits: Vec<f32>,     // [n, n_expert] router logits, then probabilities
    chosen: Vec<(u32, f32)>, // [n, n_used] (expert, weight), largest first
    x: Vec<f32>,          // [n * n_used, d_model] each chosen expert's tokens' rows, expert after expert
    gate: Vec<f32>,       // [n * n_used, ffn_dim] the same rows through gate, then swiglu(gate, up)
    up: Vec<f32>,         // [n * n_used, ffn_dim]
    y: Vec<f32>,          // [n * n_used, d_model] through down
    slots: Vec<f32>,      // [n, n_used, d_model] each chosen expert's weighted output
}

impl MoeWeights {
    pub fn load(ld: &Loader, cfg: &ModelConfig, i: usize) -> Result<Self> {
        let m = cfg.moe.expect("an MoE architecture's config has experts");
        let (d, ff, ne) = (cfg.d_model, m.ffn_dim, m.n_expert);
        let n = |s: &str| format!("blk.{i}.{s}");
        Ok(MoeWeights {
            cfg: m,
            router: ld.linear(&n("ffn_gate_inp.weight"), ne, d)?,
            gate: ld.experts(&n("ffn_gate_exps.weight"), ne, ff, d)?,
            up: ld.experts(&n("ffn_up_exps.weight"), ne, ff, d)?,
            down: ld.experts(&n("ffn_down_exps.weight"), ne, d, ff)?,
        })
    }

    pub fn matrices_mut(&mut self) -> impl Iterator<Item = &mut Linear> {
        std::iter::once(&mut self.router).chain(self.gate.iter_mut()).chain(self.up.iter_mut()).chain(self.down.iter_mut())
    }

    /// `s.xn = rmsnorm(x)` made as `input` says, then the experts' sum into `s.proj` (`[n, d_model]`).
    pub fn forward(&self, ctx: &LayerCtx, input: &NormedInput, s: &mut Scratch) {
        let (c, m) = (ctx.cfg, self.cfg);
        let (n, d, ff) = (ctx.queries.len(), c.d_model, m.ffn_dim);
        let ms = &mut s.moe;
        super::resize(&mut s.xn, n * d);
        super::resize(&mut ms.logits, n * m.n_expert);
        let router = self.router.view(ctx.file);
        normed_matmul(input, c.norm_eps, &mut s.residual.x, &s.proj, &mut s.xn, &mut s.act_q, &mut [(router, &mut ms.logits[..])]);
        ctx.trace("ffn_moe_logits", &ms.logits);
        ms.chosen.clear();
        for row in ms.logits.chunks_exact_mut(m.n_expert) {
            choose(row, m, &mut ms.chosen);
        }
        super::resize(&mut ms.slots, n * m.n_used * d);
        // Each chosen expert's (token, slot) rows, in token order, the experts in id order; their tokens'
        // rows gathered expert after expert, so that expert e reads rows `tokens[e]` of `ms.x`.
        let mut rows: Vec<Vec<usize>> = vec![Vec::new(); m.n_expert];
        for (r, &(e, _)) in ms.chosen.iter().enumerate() {
            rows[e as usize].push(r);
        }
        let active: Vec<usize> = (0..m.n_expert).filter(|&e| !rows[e].is_empty()).collect();
        let total = ms.chosen.len();
        super::resize(&mut ms.x, total * d);
        let mut tokens: Vec<std::ops::Range<usize>> = Vec::with_capacity(active.len());
        let mut at = 0;
        for &e in &active {
            for &r in &rows[e] {
                let t = r / m.n_used;
                ms.x[at * d..(at + 1) * d].copy_from_slice(&s.xn[t * d..(t + 1) * d]);
                at += 1;
            }
            tokens.push(at - rows[e].len()..at);
        }
        // Gate and up of every active expert in one parallel pass, then down likewise (ggml's
        // mul_mat_id): the threads meet twice per layer, however many experts the step chose.
        super::resize(&mut ms.gate, total * ff);
        super::resize(&mut ms.up, total * ff);
        {
            let mut jobs: Vec<(crate::kernels::matmul::QMatrix, std::ops::Range<usize>, &mut [f32])> = Vec::with_capacity(2 * active.len());
            let (mut gate, mut up) = (&mut ms.gate[..], &mut ms.up[..]);
            for (&e, t) in active.iter().zip(&tokens) {
                let (g, g_rest) = std::mem::take(&mut gate).split_at_mut(t.len() * ff);
                let (u, u_rest) = std::mem::take(&mut up).split_at_mut(t.len() * ff);
                (gate, up) = (g_rest, u_rest);
                jobs.push((self.gate[e].view(ctx.file), t.clone(), g));
                jobs.push((self.up[e].view(ctx.file), t.clone(), u));
            }
            matmul_ranges(&ms.x, &mut s.act_q, &mut jobs);
        }
        // one call per row, as ggml (swiglu's last partial vector is per row)
        ms.gate.chunks_exact_mut(ff).zip(ms.up.chunks_exact(ff)).for_each(|(g, u)| swiglu(g, u));
        super::resize(&mut ms.y, total * d);
        {
            let mut jobs: Vec<(crate::kernels::matmul::QMatrix, std::ops::Range<usize>, &mut [f32])> = Vec::with_capacity(active.len());
            let mut y = &mut ms.y[..];
            for (&e, t) in active.iter().zip(&tokens) {
                let (ye, rest) = std::mem::take(&mut y).split_at_mut(t.len() * d);
                y = rest;
                jobs.push((self.down[e].view(ctx.file), t.clone(), ye));
            }
            matmul_ranges(&ms.gate, &mut s.act_q, &mut jobs);
        }
        for (&e, t) in active.iter().zip(&tokens) {
            for (y, &r) in ms.y[t.start * d..t.end * d].chunks_exact(d).zip(&rows[e]) {
                let w = ms.chosen[r].1;
                ms.slots[r * d..(r + 1) * d].iter_mut().zip(y).for_each(|(o, &v)| *o = v * w);
            }
        }
        // the chosen experts' outputs added in order of their weight, as ggml's chain of adds
        super::resize(&mut s.proj, n * d);
        for (out, slots) in s.proj.chunks_exact_mut(d).zip(ms.slots.chunks_exact(m.n_used * d)) {
            out.copy_from_slice(&slots[..d]);
            for slot in slots[d..].chunks_exact(d) {
                out.iter_mut().zip(slot).for_each(|(o, &v)| *o += v);
            }
        }
        ctx.trace("ffn_moe_out", &s.proj);
    }
}

/// One token's experts from its router logits (`row`, made its probabilities): the `n_used` largest,
/// largest first (ggml sorts all of them, descending), with their weights, renormalised to sum to one
/// where the architecture says (the sum taken in f64 as ggml_sum_rows, clamped at f16's smallest normal).
fn choose(row: &mut [f32], m: MoeConfig, out: &mut Vec<(u32, f32)>) {
    soft_max_row(row);
    let mut order: Vec<u32> = (0..row.len() as u32).collect();
    order.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
    let first = out.len();
    out.extend(order[..m.n_used].iter().map(|&e| (e, row[e as usize])));
    if m.norm_weights {
        let sum = out[first..].iter().map(|&(_, w)| w as f64).sum::<f64>() as f32;
        let sum = sum.max(6.103515625e-5);
        out[first..].iter_mut().for_each(|(_, w)| *w /= sum);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_experts_are_chosen_largest_first_and_their_weights_sum_to_one() {
        let m = MoeConfig { n_expert: 6, n_used: 3, ffn_dim: 1, norm_weights: true };
        let mut row = vec![0.5, 3.0, -1.0, 2.0, 2.5, 0.0];
        let mut out = Vec::new();
        choose(&mut row, m, &mut out);
        assert_eq!(out.iter().map(|c| c.0).collect::<Vec<_>>(), [1, 4, 3]);
        let sum: f32 = out.iter().map(|c| c.1).sum();
        assert!((sum - 1.0).abs() < 1e-6, "{sum}");
        assert!(out[0].1 > out[1].1 && out[1].1 > out[2].1);
    }
}

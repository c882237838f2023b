//! Batch activations (2+ tokens: decode batches and prefill) rewritten for the pair kernels
//! (`dot_avx512_pair`): two tokens side by side per block, so one 512-bit register carries both tokens'
//! accumulation chains.

use super::blocks::{rd_f16, Q8_0_BYTES, Q8_1_BYTES, QK};
use super::GgmlType;

/// Token pairs one kernel call takes (8 tokens).
pub const PAIRS_PER_CALL: usize = 4;

/// One 64-byte line of the pair layout.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub struct Line(pub [u8; 64]);

/// A batch's activations in the pair layout, for one weight type.
///
/// Pair `p` holds tokens `2p` and `2p + 1` (an odd batch's last pair repeats its last token; that result
/// is not used). Per pair, `lines_per_pair` lines: `nb` lines of quants (`[token 2p's 32 | token 2p+1's
/// 32]` per block; for Q8_0 weights each quant + 128, as u8), `nb` lines of `[d ×8 | d ×8]` (f32), and
/// for Q4_0/Q5_0 weights `nb` lines of `-offset · (sum of each lane's 4 quants)` (i32). For Q4_1
/// weights (Q8_1 activations) `sums` holds each block's `s` per group of `PAIRS_PER_CALL` pairs,
/// `[group][block][2 · PAIRS_PER_CALL]`.
#[derive(Default)]
pub struct PairActs {
    pub lines: Vec<Line>,
    pub lines_per_pair: usize,
    pub sums: Vec<f32>,
    pub n_pairs: usize,
}

/// The offset the quants of weight type `t` carry (Q4_0: q - 8, Q5_0: q - 16), whose `-offset · Σy`
/// lane terms the layout precomputes.
fn offset_of(t: GgmlType) -> Option<i32> {
    match t {
        GgmlType::Q4_0 => Some(8),
        GgmlType::Q5_0 => Some(16),
        _ => None,
    }
}

impl PairActs {
    /// Rewrites `n_tokens` plain activation rows (`t.dot_activation_type()`, `act_bytes` apart) of `n`
    /// elements for weight type `t`.
    pub fn build(&mut self, t: GgmlType, n: usize, plain: &[u8], act_bytes: usize, n_tokens: usize) {
        self.shape(t, n, n_tokens);
        fill_pairs(t, n, plain, act_bytes, n_tokens, &mut self.lines);
        self.fill_sums(t, n, plain, act_bytes, n_tokens);
    }

    /// Sizes the layout for `n_tokens` rows of `n` elements for weight type `t` (contents left stale:
    /// `fill_pairs` and `fill_sums` write them).
    pub fn shape(&mut self, t: GgmlType, n: usize, n_tokens: usize) {
        let nb = n / QK;
        self.n_pairs = n_tokens.div_ceil(2);
        self.lines_per_pair = lines_per_pair(t, n);
        self.lines.resize(self.n_pairs * self.lines_per_pair, Line([0; 64]));
        self.sums.clear();
        if t.dot_activation_type() == GgmlType::Q8_1 {
            self.sums.resize(self.n_pairs.div_ceil(PAIRS_PER_CALL) * nb * 2 * PAIRS_PER_CALL, 0.0);
        }
    }

    /// Q4_1 weights: every token's block sums `s` into `sums` (a no-op for the other types).
    pub fn fill_sums(&mut self, t: GgmlType, n: usize, plain: &[u8], act_bytes: usize, n_tokens: usize) {
        if t.dot_activation_type() != GgmlType::Q8_1 {
            return;
        }
        let nb = n / QK;
        for p in 0..self.n_pairs {
            for half in 0..2 {
                let row = &plain[(2 * p + half).min(n_tokens - 1) * act_bytes..];
                let (g, slot) = (p / PAIRS_PER_CALL, 2 * (p % PAIRS_PER_CALL) + half);
                for b in 0..nb {
                    self.sums[(g * nb + b) * 2 * PAIRS_PER_CALL + slot] = rd_f16(&row[b * Q8_1_BYTES..], 2);
                }
            }
        }
    }
}

/// Lines per token pair for weight type `t` and rows of `n` elements.
pub fn lines_per_pair(t: GgmlType, n: usize) -> usize {
    n / QK * if offset_of(t).is_some() { 3 } else { 2 }
}

/// Writes the lines (quants, scales, offset sums) of the pairs of the `n_tokens` plain rows in `plain`:
/// `lines[k · lines_per_pair..]` gets rows 2k and 2k + 1 (the last row twice when `n_tokens` is odd).
pub fn fill_pairs(t: GgmlType, n: usize, plain: &[u8], act_bytes: usize, n_tokens: usize, lines: &mut [Line]) {
    let nb = n / QK;
    let (block_bytes, qs_off) = match t.dot_activation_type() {
        GgmlType::Q8_0 => (Q8_0_BYTES, 2),
        GgmlType::Q8_1 => (Q8_1_BYTES, 4),
        other => panic!("pair layout: {other} activations"),
    };
    assert!(n_tokens >= 1 && plain.len() >= (n_tokens - 1) * act_bytes + nb * block_bytes, "pair layout: activation rows too short");
    let offset = offset_of(t);
    let flip = if t == GgmlType::Q8_0 { 0x80 } else { 0 };
    for (p, lines) in lines.chunks_exact_mut(lines_per_pair(t, n)).enumerate() {
        for half in 0..2 {
            let row = &plain[(2 * p + half).min(n_tokens - 1) * act_bytes..];
            for b in 0..nb {
                let blk = &row[b * block_bytes..(b + 1) * block_bytes];
                let qs = &blk[qs_off..qs_off + QK];
                for (dst, &q) in lines[b].0[32 * half..32 * half + 32].iter_mut().zip(qs) {
                    *dst = q ^ flip;
                }
                let d = rd_f16(blk, 0).to_le_bytes();
                for k in 0..8 {
                    lines[nb + b].0[32 * half + 4 * k..32 * half + 4 * k + 4].copy_from_slice(&d);
                }
                if let Some(off) = offset {
                    for k in 0..8 {
                        let sum: i32 = qs[4 * k..4 * k + 4].iter().map(|&q| q as i8 as i32).sum();
                        lines[2 * nb + b].0[32 * half + 4 * k..32 * half + 4 * k + 4].copy_from_slice(&(-off * sum).to_le_bytes());
                    }
                }
            }
        }
    }
}

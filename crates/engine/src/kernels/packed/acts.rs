//! Per-block side tables of a quantized activation row, computed once per matmul input so the kernels
//! read each as one broadcast: the scale as f32, and the sums the offset terms need.

use crate::kernels::ggml::blocks::*;
use crate::kernels::ggml::GgmlType;

/// One Q8_0 or Q8_1 activation block: `d` (f32), Q8_1's `s` (= d·Σq as ggml stored it, f16 → f32) and
/// the exact Σq (Q8_0; it turns the weights' unsigned codes back into signed values).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LSide {
    pub d: f32,
    pub s: f32,
    pub sum: i32,
    _pad: i32,
}

impl LSide {
    pub fn new(d: f32, s: f32, sum: i32) -> Self {
        LSide { d, s, sum, _pad: 0 }
    }
}

/// One Q8_K activation super-block: `d`, the 8 sums of 32 (Q4_K's min term, as the i16 pairs
/// `vpdpwssd` takes) and −32 × the 16 sums of 16 (Q6_K's offset, as i32 accumulator starts).
#[repr(C, align(32))]
#[derive(Clone, Copy, Debug, Default)]
pub struct KSide {
    pub d: f32,
    pub sum32: [i16; 8],
    _pad: [u8; 12],
    pub neg32_sum16: [i32; 16],
}

/// The side table of one matmul input: `blocks` entries per token, of the kind its activation type has.
#[derive(Default)]
pub struct ActSide {
    pub act: Option<GgmlType>,
    pub blocks: usize,
    pub legacy: Vec<LSide>,
    pub k: Vec<KSide>,
}

impl ActSide {
    /// Sizes the table for `n_tokens` rows of `cols` activations of type `act`.
    pub fn shape(&mut self, act: GgmlType, cols: usize, n_tokens: usize) {
        self.act = Some(act);
        self.blocks = cols / act.block_len();
        let (legacy, k) = if act == GgmlType::Q8_K { (0, n_tokens * self.blocks) } else { (n_tokens * self.blocks, 0) };
        self.legacy.resize(legacy, LSide::default());
        self.k.resize(k, KSide::default());
    }

    /// Raw pointers to the two tables, for parallel filling by token (`fill_token`).
    pub fn ptrs(&mut self) -> (*mut LSide, *mut KSide) {
        (self.legacy.as_mut_ptr(), self.k.as_mut_ptr())
    }

    /// Fills token `t`'s entries from its quantized row.
    ///
    /// # Safety
    /// `ptrs` come from `ptrs()` of a table shaped for at least `t + 1` tokens of this `act`/`blocks`,
    /// and no one else writes token `t`'s entries meanwhile.
    pub unsafe fn fill_token(act: GgmlType, blocks: usize, ptrs: (*mut LSide, *mut KSide), t: usize, row: &[u8]) {
        let bb = act.block_bytes();
        for (b, blk) in row.chunks_exact(bb).take(blocks).enumerate() {
            match act {
                GgmlType::Q8_0 => *ptrs.0.add(t * blocks + b) = LSide { d: rd_f16(blk, 0), s: 0.0, sum: code_sum(&blk[2..34]), _pad: 0 },
                GgmlType::Q8_1 => *ptrs.0.add(t * blocks + b) = LSide { d: rd_f16(blk, 0), s: rd_f16(blk, 2), sum: code_sum(&blk[4..36]), _pad: 0 },
                GgmlType::Q8_K => *ptrs.1.add(t * blocks + b) = k_side(blk),
                other => unreachable!("{other} is not an activation type of the packed kernels"),
            }
        }
    }
}

fn code_sum(q: &[u8]) -> i32 {
    q.iter().map(|&v| v as i8 as i32).sum()
}

/// The side entry of one Q8_K block (its bsums are ggml's exact sums of 16).
pub fn k_side(blk: &[u8]) -> KSide {
    let bsum = |i: usize| rd_i16(blk, Q8_K_BSUMS + 2 * i) as i32;
    KSide {
        d: rd_f32(blk, 0),
        sum32: std::array::from_fn(|j| (bsum(2 * j) + bsum(2 * j + 1)) as i16),
        _pad: [0; 12],
        neg32_sum16: std::array::from_fn(|j| -32 * bsum(j)),
    }
}

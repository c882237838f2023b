//! What the packed kernels of every instruction set share: a call's inputs (`Tile`), the per-token
//! unrolling, the weight prefetch.

use super::acts::{KSide, LSide};
use super::layout::GROUP;
use super::{PackedInput, PackedMatrix};
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;

/// Runs `$body` with `$t` = 0, 1, .. `$nt - 1` as separate copies (`$nt` a const generic up to 8): with
/// constant indices the per-token accumulators stay in registers. A plain `for t in 0..NT` was left
/// rolled by LLVM (the body is long), which kept them on the stack: a store and a reload per FMA.
macro_rules! unroll {
    ($nt:expr, |$t:ident| $body:block) => {
        unroll!(@ $nt, $t, $body, 0 1 2 3 4 5 6 7)
    };
    (@ $nt:expr, $t:ident, $body:block, $($i:literal)*) => {
        $(
            if $i < $nt {
                let $t: usize = $i;
                $body
            }
        )*
    };
}

pub(super) const Q4_0: u8 = 0;
pub(super) const Q4_1: u8 = 1;
pub(super) const Q5_0: u8 = 2;
pub(super) const Q8_0: u8 = 3;

pub(super) struct Tile<'a> {
    pub m: &'a PackedMatrix,
    pub group: usize,
    pub x: &'a PackedInput<'a>,
    pub t0: usize,
    pub out: *mut f32,
    pub out_stride: usize,
    /// Rows of the group that exist (16 but in a last partial group).
    pub valid: usize,
}

impl Tile<'_> {
    /// Token `t` of the tile's quantized row.
    #[inline(always)]
    pub(super) unsafe fn act_row(&self, t: usize) -> *const u8 {
        self.x.xq.as_ptr().add((self.t0 + t) * self.x.row_bytes)
    }

    #[inline(always)]
    /// Token `t`'s side entries, one per block (a pointer into the whole table, so reading entry b
    /// through it is in bounds for every b < blocks).
    pub(super) fn legacy_sides(&self, t: usize) -> *const LSide {
        let first = (self.t0 + t) * self.m.blocks;
        assert!(first + self.m.blocks <= self.x.side.legacy.len(), "side table shaped for the tile");
        // SAFETY: in bounds, checked just above.
        unsafe { self.x.side.legacy.as_ptr().add(first) }
    }

    /// Token `t`'s 256 codes of Q8_K super-block `b`.
    #[inline(always)]
    pub(super) unsafe fn k_quants(&self, t: usize, b: usize) -> *const u8 {
        use crate::kernels::ggml::blocks::{Q8_K_BYTES, Q8_K_QS};
        self.act_row(t).add(b * Q8_K_BYTES + Q8_K_QS)
    }

    #[inline(always)]
    pub(super) fn k_side(&self, t: usize, b: usize) -> &KSide {
        &self.x.side.k[(self.t0 + t) * self.m.blocks + b]
    }

    /// Token `t`'s outputs for the group's first row. Wrapping arithmetic: `out` is where token 0's row
    /// would be, which lies before the buffer when it holds only later tokens' rows (`matmul_ranges`).
    #[inline(always)]
    pub(super) unsafe fn out_row(&self, t: usize) -> *mut f32 {
        self.out.wrapping_add((self.t0 + t) * self.out_stride + self.group * GROUP)
    }
}

/// Bytes ahead of the group-block being computed that each block's loop asks into L2, in kernels that walk
/// a group's blocks once (AVX-512). Tuned at 10 KiB on models whose weights sit in L3; where they stream
/// from DRAM (the Llama-3.2-3B shape, Zen 4) 20-48 KiB decoded 5-7% faster than 10 KiB, and 64 KiB gained
/// less (docs/speed.md).
pub(super) const PREFETCH_AHEAD: usize = 32 << 10;

/// The same in the 256-bit kernels (AVX2, AVX-VNNI), which read each group-block in two halves of 8
/// rows. AVX2 takes both halves of a block before the next; there (3B shape, Zen 4, decode) 10 KiB
/// came out ahead of 32 KiB, as it did before that change (bench/results/size-decode-avx2-zen4-20261207).
/// AVX-VNNI's K-quant kernels still walk the group once per half, the second half from L2 or L1,
/// which 32 KiB ahead would evict.
pub(super) const PREFETCH_AHEAD_256: usize = 10 << 10;

/// Prefetches the `bytes` bytes `AHEAD` past `p` into L2, a line at a time, inside the block loop: the
/// groups follow one another in memory, so this is one sequential stream. (A burst per group from the
/// caller stalled on the full miss queue: 5% of a serving profile.)
#[inline(always)]
pub(super) unsafe fn prefetch_ahead<const AHEAD: usize>(p: *const u8, bytes: usize) {
    let mut off = 0;
    while off < bytes {
        _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(AHEAD + off) as *const i8);
        off += 64;
    }
}

pub(super) use unroll;

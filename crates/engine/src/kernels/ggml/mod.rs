//! ggml tensor types: block layouts, dequantization, activation quantization and the quantized dot
//! products (`vec_dot`) that every matrix-vector product in the engine is built from.
//!
//! Everything here but `packed` must agree bit for bit with ggml (ggml-common.h / ggml-quants.c): it is
//! the ggml numerics, whose promise is llama.cpp's logits. `packed` is reckon's own (faster) numerics,
//! defined by `packed::reference`. Layouts are read straight from `&[u8]` at fixed byte
//! offsets (GGUF data is little-endian and only 2-byte aligned within a tensor), never transmuted.
//!
//! `vec_dot` has a scalar reference per type (`dot_scalar`, mirrors ggml's generic C) and SIMD kernels
//! (`dot_avx2`, `dot_avx512`) chosen once at run time. The integer part of every block dot is exact in all
//! of them. For the quantized types both SIMD levels reproduce the f32 rounding sequence of ggml's x86
//! kernels, so their results are bit-identical to each other and to llama.cpp's CPU backend on x86
//! (tested against llama.cpp's own library, see tests/fixtures.rs); the scalar reference follows ggml's
//! generic order and differs in the last bits. The F32 dot is ggml's AVX-512 order at every level; the F16
//! dot is not bit-exact with ggml.
//!
//! Caveat for whole-model identity: llama.cpp on x86 repacks Q4_0 and Q4_K weights (ggml-cpu/repack.cpp,
//! `q4_0_8x8`, `q4_K_8x8`) and then uses other kernels with their own rounding order, and for batches of
//! 2+ tokens may use llamafile's sgemm; those are matmul-level choices this module does not mirror.

pub(crate) mod blocks;
mod dequant;
#[cfg(target_arch = "x86_64")]
mod dot_avx2;
#[cfg(target_arch = "x86_64")]
mod dot_avx2_multi;
#[cfg(target_arch = "x86_64")]
mod dot_avx2_multi_k;
#[cfg(target_arch = "x86_64")]
mod dot_avx512;
#[cfg(target_arch = "x86_64")]
mod dot_avx512_multi;
#[cfg(target_arch = "x86_64")]
mod dot_avx512_multi_k;
#[cfg(target_arch = "x86_64")]
mod dot_avx512_pair;
mod dot_scalar;
mod pair_acts;
pub mod math;
mod quantize;
#[cfg(test)]
pub(crate) mod tests;

/// `rows` random weight rows of `n` values of type `t` (sane scales), for tests outside this module.
#[cfg(test)]
pub(crate) fn random_weight_rows(t: GgmlType, rows: usize, n: usize, seed: u64) -> Vec<u8> {
    let mut rng = tests::Rng::new(seed);
    (0..rows).flat_map(|_| tests::random_weights(t, n, &mut rng)).collect()
}
#[cfg(target_arch = "x86_64")]
mod x86_util;

use blocks::QK;

pub use dequant::dequantize_row;
pub use quantize::{quantize_row, quantize_row_ggml_x86, quantize_row_legacy_with_sides};

/// A ggml tensor element type (the subset reckon supports). Q8_1 and Q8_K only ever hold activations.
#[allow(non_camel_case_types)] // ggml's own names
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
}

impl GgmlType {
    pub const ALL: [GgmlType; 12] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
    ];

    /// The type for a `ggml_type` id as stored in GGUF tensor infos; None for types reckon lacks.
    pub fn from_ggml_id(id: u32) -> Option<GgmlType> {
        GgmlType::ALL.into_iter().find(|t| t.ggml_id() == id)
    }

    pub fn ggml_id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
        }
    }

    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
        }
    }

    /// Elements per block: 1 for the float types, 32 for the legacy quants, 256 for the K-quants.
    pub fn block_len(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 => blocks::QK,
            Q4_K | Q5_K | Q6_K | Q8_K => blocks::QK_K,
        }
    }

    /// Bytes per block (sizeof the ggml block struct).
    pub fn block_bytes(self) -> usize {
        use GgmlType::*;
        match self {
            F32 => 4,
            F16 => 2,
            Q4_0 => blocks::Q4_0_BYTES,
            Q4_1 => blocks::Q4_1_BYTES,
            Q5_0 => blocks::Q5_0_BYTES,
            Q5_1 => blocks::Q5_1_BYTES,
            Q8_0 => blocks::Q8_0_BYTES,
            Q8_1 => blocks::Q8_1_BYTES,
            Q4_K => blocks::Q4_K_BYTES,
            Q5_K => blocks::Q5_K_BYTES,
            Q6_K => blocks::Q6_K_BYTES,
            Q8_K => blocks::Q8_K_BYTES,
        }
    }

    /// Bytes of a row of `n` elements; None if `n` is not a whole number of blocks.
    pub fn row_bytes(self, n: usize) -> Option<usize> {
        if !n.is_multiple_of(self.block_len()) {
            return None;
        }
        (n / self.block_len()).checked_mul(self.block_bytes())
    }

    /// The type activations are quantized to before `vec_dot` with weights of this type (ggml's
    /// `vec_dot_type` on CPU).
    pub fn dot_activation_type(self) -> GgmlType {
        use GgmlType::*;
        match self {
            F32 => F32,
            F16 => F16,
            Q4_0 | Q5_0 | Q8_0 => Q8_0,
            Q4_1 | Q5_1 | Q8_1 => Q8_1,
            Q4_K | Q5_K | Q6_K | Q8_K => Q8_K,
        }
    }

    /// Whether `vec_dot` accepts this type as the weight side (Q8_1 and Q8_K are activation-only).
    pub fn has_vec_dot(self) -> bool {
        !matches!(self, GgmlType::Q8_1 | GgmlType::Q8_K)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Bytes needed to hold `n` elements of an activation row quantized to `t` (n multiple of t.block_len()).
pub fn activation_row_bytes(t: GgmlType, n: usize) -> usize {
    t.row_bytes(n)
        .unwrap_or_else(|| panic!("{n} elements are not a whole number of {t} blocks"))
}

pub use super::cpu::{available_levels, simd_level, SimdLevel};

/// A `vec_dot` kernel for one weight type: `(n, weight_row, act_row) -> dot`. Every kernel checks
/// its slice lengths, so calling it is always safe; fetch it once per matmul to skip the dispatch.
pub type VecDotFn = fn(usize, &[u8], &[u8]) -> f32;

/// The kernel `vec_dot` would use for weight type `t`.
pub fn vec_dot_kernel(t: GgmlType) -> VecDotFn {
    vec_dot_kernel_at(simd_level(), t)
}

/// The kernel for weight type `t` at a given level; panics if this CPU lacks `level` or `t` has no
/// `vec_dot` (Q8_1, Q8_K).
pub fn vec_dot_kernel_at(level: SimdLevel, t: GgmlType) -> VecDotFn {
    assert!(
        level.is_available(),
        "SIMD level {} is not available on this CPU",
        level.name()
    );
    assert!(t.has_vec_dot(), "{t} is an activation type, it has no vec_dot");
    // SAFETY (of handing out the x86 kernels): they require exactly the CPU features that make
    // `level` available, which was just checked.
    #[cfg(target_arch = "x86_64")]
    {
        if level >= SimdLevel::Avx512 {
            if let Some(f) = dot_avx512::kernel(t) {
                return f;
            }
        }
        if level >= SimdLevel::Avx2 {
            if let Some(f) = dot_avx2::kernel(t) {
                return f;
            }
        }
    }
    dot_scalar::kernel(t)
}

/// Activation rows a multi-row kernel takes per call.
pub const MULTI: usize = 4;

/// `(n, weight_rows, weight_row_bytes, n_rows, act_rows, act_row_bytes, out)`: `n_rows` weight rows
/// (`weight_row_bytes` apart) against `k` plain activation rows `act_row_bytes` apart, where
/// `out.len() = n_rows · k` and `k` is a multiple of `MULTI`; `out[r * k + t]` is row r · token t,
/// bit-identical to the one-row kernel's. On AVX-512 K-quants only (legacy types take the pair kernels
/// there); on AVX2 the legacy types and Q4_K/Q6_K. Safe to call (checks lengths).
pub type MultiDotFn = fn(usize, &[u8], usize, usize, &[u8], usize, &mut [f32]);

/// The multi-token kernel for weight type `t` and rows of `n` elements at the current SIMD level, where
/// there is one.
pub fn multi_dot_kernel(t: GgmlType, n: usize) -> Option<MultiDotFn> {
    #[cfg(target_arch = "x86_64")]
    if simd_level() >= SimdLevel::Avx512 && n / QK <= dot_avx512_multi::MAX_BLOCKS {
        return dot_avx512_multi::kernel(t);
    }
    #[cfg(target_arch = "x86_64")]
    if simd_level() >= SimdLevel::Avx2 && simd_level() < SimdLevel::Avx512 {
        return dot_avx2_multi::tokens_kernel(t);
    }
    let _ = (t, n);
    None
}

/// `(n, weight_rows, weight_row_bytes, acts, first_pair, n_pairs, out)`: `MULTI` weight rows against the
/// tokens of pairs `first_pair..first_pair + n_pairs` (`first_pair` a multiple of `PAIRS_PER_CALL`,
/// `n_pairs` 1..=`PAIRS_PER_CALL`); `out[r * 2 * PAIRS_PER_CALL + k]` gets row r · the call's token k,
/// bit-identical to the one-row kernel. Safe to call (checks lengths).
pub type PairDotFn = fn(usize, &[u8], usize, &PairActs, usize, usize, &mut [f32; MULTI * 2 * PAIRS_PER_CALL]);

pub use pair_acts::{fill_pairs, lines_per_pair, Line, PairActs, PAIRS_PER_CALL};

/// The pair kernel (`MULTI` weight rows × up to `PAIRS_PER_CALL` token pairs, for batches of 2+ tokens) for
/// weight type `t` and rows of `n` elements at the current SIMD level, where there is one. It reads
/// activations in the pair layout (`PairActs`).
pub fn pair_dot_kernel(t: GgmlType, n: usize) -> Option<PairDotFn> {
    #[cfg(target_arch = "x86_64")]
    if simd_level() >= SimdLevel::Avx512 && n / QK <= dot_avx512_multi::MAX_BLOCKS {
        return dot_avx512_pair::kernel(t);
    }
    let _ = (t, n);
    None
}

/// `(n, weight_rows, weight_row_bytes, act_row) -> dots`: `MULTI` weight rows against one activation
/// row, each result bit-identical to the one-row kernel's. Safe to call (checks lengths).
pub type MultiRowFn = fn(usize, &[u8], usize, &[u8]) -> [f32; MULTI];

/// The multi-weight-row kernel for weight type `t` at the current SIMD level, where there is one.
pub fn multi_row_kernel(t: GgmlType) -> Option<MultiRowFn> {
    #[cfg(target_arch = "x86_64")]
    if simd_level() >= SimdLevel::Avx512 {
        return dot_avx512_multi::rows_kernel(t);
    }
    #[cfg(target_arch = "x86_64")]
    if simd_level() >= SimdLevel::Avx2 && simd_level() < SimdLevel::Avx512 {
        return dot_avx2_multi::rows_kernel(t);
    }
    let _ = t;
    None
}

/// Dot product of one weight row (type `t`, `n` elements) with one activation row already quantized
/// to `t.dot_activation_type()`.
pub fn vec_dot(t: GgmlType, n: usize, weight_row: &[u8], act_row: &[u8]) -> f32 {
    vec_dot_kernel(t)(n, weight_row, act_row)
}

/// Argument checks shared by every kernel: they make the unchecked SIMD loads in bounds.
#[inline(always)]
fn check_dot_args(t: GgmlType, n: usize, w: &[u8], a: &[u8]) {
    let wb = t.row_bytes(n);
    assert!(
        wb.is_some(),
        "vec_dot {t}: n={n} is not a multiple of {}",
        t.block_len()
    );
    assert!(
        w.len() >= wb.unwrap_or(0),
        "vec_dot {t}: weight row has {} bytes, need {wb:?}",
        w.len()
    );
    let ab = t.dot_activation_type().row_bytes(n).unwrap_or(usize::MAX);
    assert!(
        a.len() >= ab,
        "vec_dot {t}: activation row has {} bytes, need {ab}",
        a.len()
    );
}

/// Asks for every 64-byte line of `bytes` to be brought into L2 (`prefetcht1`; nothing elsewhere).
///
/// Why: the multi-row kernels read `MULTI` weight rows in lockstep, i.e. `MULTI` streams a row apart,
/// and on AMD Zen 4 that pattern alone read from memory at about half the bandwidth of one sequential
/// stream (docs/speed.md). Prefetching the rows a few calls ahead in address order, by the caller, turns
/// the memory traffic back into one sequential stream.
#[inline]
pub fn prefetch_l2(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for line in bytes.chunks(64) {
        // SAFETY: a prefetch of a valid address; it reads nothing architecturally.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(line.as_ptr() as *const i8) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

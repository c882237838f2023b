//! Helpers shared by the x86 kernels (`dot_avx2`, `dot_avx512`): unaligned loads, f16 scale
//! conversion, horizontal sums and the per-block pieces whose f32 rounding must match ggml's x86 code.
//! All require AVX2 + FMA + F16C; callers guarantee it (they are only reached through the kernels).

use std::arch::x86_64::*;

use super::blocks::*;

#[inline]
pub(super) unsafe fn rd16(p: *const u8) -> u32 {
    (p as *const u16).read_unaligned() as u32
}

#[inline]
pub(super) unsafe fn rd32(p: *const u8) -> u32 {
    (p as *const u32).read_unaligned()
}

// f16 scales are converted two or four at a time, from one u32/u64. Why: converting a lone f16
// lets LLVM insert its 16 bits into whatever register is at hand (`vpinsrw`), often a loop
// accumulator, which chains every block's conversion to the previous block's FMA (several times
// slower; docs/speed.md). A whole u32/u64 is moved in with `vmovd`/`vmovq`, which depends on nothing.

/// Lanes 0..2 = the two halves of `bits` (low half first) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn cvt_f16x2(bits: u32) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32))
}

/// Lanes 0..4 = the four halves of `bits` (lowest first) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn cvt_f16x4(bits: u64) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi64_si128(bits as i64))
}

/// One f16 at `p` as f32 (paired with a constant 1.0 that is multiplied in, to keep the pair).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
    let v = cvt_f16x2(rd16(p) | 0x3C00 << 16);
    _mm_cvtss_f32(_mm_mul_ss(v, _mm_movehdup_ps(v)))
}

/// d(x) * d(y) for the f16 scales at `px` and `py`, broadcast.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn d_prod(px: *const u8, py: *const u8) -> __m256 {
    let v = cvt_f16x2(rd16(px) | rd16(py) << 16);
    _mm256_broadcastss_ps(_mm_mul_ss(v, _mm_movehdup_ps(v)))
}

/// For Q4_1/Q5_1 x Q8_1, from the (d, m) of x and the (d, s) of y: returns dx*dy broadcast and
/// updates lane 1 of `summs` to fma(mx, sy, summs) (GCC contracts ggml's `summs += m * s`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dm_prod(px: *const u8, py: *const u8, summs: &mut __m128) -> __m256 {
    let v = cvt_f16x4(rd32(px) as u64 | (rd32(py) as u64) << 32); // [dx, mx, dy, sy]
    let w = _mm_movehl_ps(v, v); // [dy, sy, dy, sy]
    *summs = _mm_fmadd_ps(v, w, *summs);
    _mm256_broadcastss_ps(_mm_mul_ss(v, w))
}

#[inline]
pub(super) unsafe fn f32_at(p: *const u8) -> f32 {
    (p as *const f32).read_unaligned()
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn load256(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn load128(p: *const u8) -> __m128i {
    _mm_loadu_si128(p as *const __m128i)
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum_ps128(v: __m128) -> f32 {
    let s = _mm_add_ps(v, _mm_movehl_ps(v, v));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum_ps(v: __m256) -> f32 {
    hsum_ps128(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)))
}

// ---- K-quants ----

/// Q4_K/Q5_K per-block prologue: 16 i16 lanes holding the 8 scales (low lane) and 8 mins (high lane),
/// plus `sum_j mins[j] * (activation sum of sub-block j)` as 4 i32 partial sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn k4_scales_and_min_term(bx: *const u8, by: *const u8) -> (__m128i, __m128i) {
    let u = unpack_k4_scales(std::slice::from_raw_parts(bx.add(K4_SCALES), 12));
    let ms = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3] as i32, u[2] as i32, u[1] as i32, u[0] as i32));
    let bsums = load256(by.add(Q8_K_BSUMS));
    // adjacent 16-groups summed -> the 8 sub-block sums (|sum| <= 32*127, no i16 overflow)
    let q8s = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
    let min_term = _mm_madd_epi16(_mm256_extracti128_si256(ms, 1), q8s);
    (_mm256_castsi256_si128(ms), min_term)
}

/// The `- dmin * sum_j mins[j] * bsum_j` part of Q4_K/Q5_K, accumulated as ggml's x86 code does,
/// which differs between the two: Q4_K keeps 4 f32 lanes (`acc_m = fma(-y.d*dmin, prod, acc_m)`),
/// Q5_K first sums `prod` to one integer (`summs = fma(isum, -y.d*dmin, summs)`, lane 0).
/// `dd` = [y.d * d, y.d * dmin, ..].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn min_update(acc_m: __m128, dd: __m128, min_term: __m128i, q5: bool) -> __m128 {
    if q5 {
        let s = _mm_add_epi32(min_term, _mm_shuffle_epi32(min_term, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        _mm_fnmadd_ss(_mm_cvtepi32_ps(s), _mm_movehdup_ps(dd), acc_m)
    } else {
        _mm_fnmadd_ps(_mm_permute_ps(dd, 0b0101_0101), _mm_cvtepi32_ps(min_term), acc_m)
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn min_finish(acc_m: __m128, q5: bool) -> f32 {
    if q5 {
        _mm_cvtss_f32(acc_m)
    } else {
        hsum_ps128(acc_m)
    }
}

//! AVX2 kernels for several dots at once (CPUs without AVX-512): the legacy types (Q4_0, Q4_1, Q5_0, Q8_0)
//! as `R` weight rows × `T` activation rows per call — `MULTI` rows × 1 token for decode, 1 row × `MULTI`
//! tokens for batches. The one-row kernel (`dot_avx2`) is one FMA chain per dot, so it waits on the FMA
//! latency at every block; here `R·T` chains interleave, the weight block is unpacked once for the `T`
//! tokens and the activation block loaded once for the `R` rows. Each dot runs exactly the one-row
//! kernel's arithmetic (same i32 lanes, `fma(dx·dy, lanes, acc)` block after block, the same horizontal
//! sum and, for Q4_1, the same `summs` FMA chain), so every result is bit-identical to it (tested).

use std::arch::x86_64::*;

use super::blocks::*;
use super::x86_util::*;
use super::{check_dot_args, GgmlType, MultiDotFn, MultiRowFn, SimdLevel, MULTI};

const K_Q4_0: u8 = 0;
const K_Q4_1: u8 = 1;
const K_Q5_0: u8 = 2;
const K_Q8_0: u8 = 3;

/// Bytes of one weight block of kind `K`.
const fn weight_bytes(k: u8) -> usize {
    match k {
        K_Q4_0 => Q4_0_BYTES,
        K_Q4_1 => Q4_1_BYTES,
        K_Q5_0 => Q5_0_BYTES,
        _ => Q8_0_BYTES,
    }
}

/// The multi-token kernel (one weight row × `MULTI`-token groups) for `t`.
pub(super) fn tokens_kernel(t: GgmlType) -> Option<MultiDotFn> {
    assert!(SimdLevel::Avx2.is_available());
    Some(match t {
        GgmlType::Q4_0 => q4_0_tokens,
        GgmlType::Q4_1 => q4_1_tokens,
        GgmlType::Q5_0 => q5_0_tokens,
        GgmlType::Q8_0 => q8_0_tokens,
        _ => return None,
    })
}

/// The multi-row kernel (`MULTI` weight rows × one token) for `t`.
pub(super) fn rows_kernel(t: GgmlType) -> Option<MultiRowFn> {
    assert!(SimdLevel::Avx2.is_available());
    Some(match t {
        GgmlType::Q4_0 => q4_0_rows,
        GgmlType::Q4_1 => q4_1_rows,
        GgmlType::Q5_0 => q5_0_rows,
        GgmlType::Q8_0 => q8_0_rows,
        _ => return None,
    })
}

macro_rules! safe_kernels {
    ($($tokens:ident, $rows:ident => $t:ident, $k:ident;)*) => {$(
        fn $tokens(n: usize, w: &[u8], a: &[u8], stride: usize, out: &mut [f32]) {
            assert_eq!(out.len() % MULTI, 0, "multi dot: output is not whole groups of {MULTI}");
            for (g, o) in out.chunks_exact_mut(MULTI).enumerate() {
                let rows: [&[u8]; MULTI] = std::array::from_fn(|r| &a[((g * MULTI + r) * stride).min(a.len())..]);
                for row in rows {
                    check_dot_args(GgmlType::$t, n, w, row);
                }
                // SAFETY: handed out only when AVX2, FMA and F16C are present; `check_dot_args` proved
                // the weight row and every activation row in bounds.
                let res = unsafe { tile::<$k, 1, MULTI>(n / QK, [w.as_ptr()], rows.map(|r| r.as_ptr())) };
                o.copy_from_slice(&res[0]);
            }
        }

        fn $rows(n: usize, w: &[u8], stride: usize, a: &[u8]) -> [f32; MULTI] {
            let rows: [&[u8]; MULTI] = std::array::from_fn(|r| &w[(r * stride).min(w.len())..]);
            for row in rows {
                check_dot_args(GgmlType::$t, n, row, a);
            }
            // SAFETY: as above, for the weight rows and the one activation row.
            let res = unsafe { tile::<$k, MULTI, 1>(n / QK, rows.map(|r| r.as_ptr()), [a.as_ptr()]) };
            res.map(|r| r[0])
        }
    )*};
}

safe_kernels! {
    q4_0_tokens, q4_0_rows => Q4_0, K_Q4_0;
    q4_1_tokens, q4_1_rows => Q4_1, K_Q4_1;
    q5_0_tokens, q5_0_rows => Q5_0, K_Q5_0;
    q8_0_tokens, q8_0_rows => Q8_0, K_Q8_0;
}

/// Weight block `bx`'s 32 quants as bytes: signed (Q4_0, Q5_0, Q8_0; as `dot_avx2`) or, for Q4_1, the
/// unsigned nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weight_quants<const K: u8>(bx: *const u8) -> __m256i {
    match K {
        K_Q4_0 => _mm256_sub_epi8(nibbles32(bx.add(2)), _mm256_set1_epi8(8)),
        K_Q4_1 => nibbles32(bx.add(4)),
        // (nibble | bit<<4) - 16 == nibble | (bit clear ? 0xF0 : 0) read as i8
        K_Q5_0 => _mm256_or_si256(nibbles32(bx.add(6)), _mm256_andnot_si256(bits_to_bytes32(bx.add(2)), _mm256_set1_epi8(0xF0u8 as i8))),
        _ => load256(bx.add(2)),
    }
}

/// 16 packed bytes -> 32 nibbles in element order (`dot_avx2::nibbles32`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    let v = _mm256_broadcastsi128_si256(load128(p));
    let v = _mm256_blend_epi32(v, _mm256_srli_epi16(v, 4), 0xF0);
    _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
}

/// `dot_avx2::bits_to_bytes32`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bits_to_bytes32(p: *const u8) -> __m256i {
    let x = (p as *const u32).read_unaligned() as i32;
    let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x), shuf);
    let others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi64x(-1))
}

/// Four f16 scales as f32 lanes, lane `k` the one at `p[k]`: gathered into one u64 in general
/// registers and moved in with `vmovq`. (A lone 16-bit load became `vpinsrw` into a loop
/// accumulator's register, which chained every block to the previous block's FMA; see `x86_util`.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x4_at(p: [*const u8; 4]) -> __m128 {
    let bits = p.iter().enumerate().fold(0u64, |b, (k, &q)| b | (rd16(q) as u64) << (16 * k));
    cvt_f16x4(bits)
}

/// Lane `k` of `v` in all 8 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane(v: __m128, k: usize) -> __m256 {
    _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), _mm256_set1_epi32(k as i32))
}

/// `R` weight rows (`w[r]`, `nb` blocks of kind `K`) · `T` activation rows (`a[t]`, Q8_0, or Q8_1 for
/// Q4_1), `R·T = 4`: `out[r][t]`, each exactly `dot_avx2`'s one-row result. The per-block scale work runs
/// for the four (row, token) pairs at once in lanes `k = r·T + t`: `dx·dy` is one multiply of two
/// 4-lane vectors (the same f32 product as the one-row kernel's scalar one), Q4_1's `summs` one FMA.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const K: u8, const R: usize, const T: usize>(nb: usize, w: [*const u8; R], a: [*const u8; T]) -> [[f32; T]; R] {
    debug_assert_eq!(R * T, 4);
    let (wb, ab, qoff) = (weight_bytes(K), if K == K_Q4_1 { Q8_1_BYTES } else { Q8_0_BYTES }, if K == K_Q4_1 { 4 } else { 2 });
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let mut summs = _mm_setzero_ps(); // Q4_1: lane r·T + t = Σ m_x·s_y of (row r, token t)
    for i in 0..nb {
        let bx: [*const u8; R] = std::array::from_fn(|r| w[r].add(i * wb));
        let by: [*const u8; T] = std::array::from_fn(|t| a[t].add(i * ab));
        let pairs = |off: usize| -> ([*const u8; 4], [*const u8; 4]) {
            (std::array::from_fn(|k| bx[k / T].add(off)), std::array::from_fn(|k| by[k % T].add(off)))
        };
        let (xd, yd) = pairs(0);
        let d = _mm_mul_ps(f16x4_at(xd), f16x4_at(yd));
        if K == K_Q4_1 {
            let (xm, ys) = pairs(2);
            summs = _mm_fmadd_ps(f16x4_at(xm), f16x4_at(ys), summs);
        }
        let qx: [__m256i; R] = std::array::from_fn(|r| weight_quants::<K>(bx[r]));
        // |x| for the signed kinds (the u8 operand of vpmaddubsw), as `mul_sum_i8`
        let ux: [__m256i; R] = std::array::from_fn(|r| if K == K_Q4_1 { qx[r] } else { _mm256_sign_epi8(qx[r], qx[r]) });
        for t in 0..T {
            let qy = load256(by[t].add(qoff));
            for r in 0..R {
                let sy8 = if K == K_Q4_1 { qy } else { _mm256_sign_epi8(qy, qx[r]) };
                let lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(ux[r], sy8), ones));
                acc[r][t] = _mm256_fmadd_ps(lane(d, r * T + t), lanes, acc[r][t]);
            }
        }
    }
    let mut m = [0.0f32; 4];
    _mm_storeu_ps(m.as_mut_ptr(), summs);
    std::array::from_fn(|r| std::array::from_fn(|t| if K == K_Q4_1 { hsum_ps(acc[r][t]) + m[r * T + t] } else { hsum_ps(acc[r][t]) }))
}

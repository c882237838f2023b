//! AVX2 multi-token kernels for the K-quants in the test models (Q4_K, Q6_K; prefill and decode batches on
//! CPUs without AVX-512): one weight row against `MULTI` Q8_K activation rows. Per super-block the weight
//! side (quants, sub-block scales and mins) is unpacked once; each token then runs exactly the arithmetic
//! of `dot_avx2::k4_k5_impl` / `q6_k_impl` (the same integer lanes, the same f32 operations in the same
//! order), so every result is bit-identical to the one-row kernel (tested).

use std::arch::x86_64::*;

use super::blocks::*;
use super::x86_util::*;
use super::{check_dot_args, GgmlType, MULTI};

macro_rules! safe_kernels {
    ($($name:ident => $t:ident, $imp:ident;)*) => {$(
        pub(super) fn $name(n: usize, ws: &[u8], w_stride: usize, n_rows: usize, a: &[u8], stride: usize, out: &mut [f32]) {
            assert!(n_rows > 0 && out.len() % (n_rows * MULTI) == 0, "multi dot: output is not rows × whole groups of {MULTI}");
            for (r, row_out) in out.chunks_exact_mut(out.len() / n_rows).enumerate() {
                let w = &ws[(r * w_stride).min(ws.len())..];
                for (g, o) in row_out.chunks_exact_mut(MULTI).enumerate() {
                    let rows: [&[u8]; MULTI] = std::array::from_fn(|t| &a[((g * MULTI + t) * stride).min(a.len())..]);
                    for row in rows {
                        check_dot_args(GgmlType::$t, n, w, row);
                    }
                    // SAFETY: handed out only when AVX2, FMA and F16C are present; `check_dot_args`
                    // proved the weight row and every activation row in bounds.
                    o.copy_from_slice(&unsafe { $imp(n, w.as_ptr(), rows.map(|r| r.as_ptr())) });
                }
            }
        }
    )*};
}

safe_kernels! {
    q4_k_multi => Q4_K, q4_k_impl;
    q6_k_multi => Q6_K, q6_k_impl;
}

/// i16 lane `k` of `v` (8 lanes) in all 16 lanes (`dot_avx2::splat_i16`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn splat_i16(v: __m256i, k: usize) -> __m256i {
    _mm256_shuffle_epi8(v, _mm256_set1_epi16((((2 * k + 1) << 8) | (2 * k)) as i16))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_impl(n: usize, x: *const u8, y: [*const u8; MULTI]) -> [f32; MULTI] {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); MULTI];
    let mut acc_m = [_mm_setzero_ps(); MULTI];
    for i in 0..n / QK_K {
        let bx = x.add(i * Q4_K_BYTES);
        let dxm = cvt_f16x2(rd32(bx)); // [d, dmin]
        // `k4_scales_and_min_term`'s weight half: 8 scales (low 128 bits), 8 mins (high).
        let u = unpack_k4_scales(std::slice::from_raw_parts(bx.add(K4_SCALES), 12));
        let ms = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3] as i32, u[2] as i32, u[1] as i32, u[0] as i32));
        let mins = _mm256_extracti128_si256::<1>(ms);
        let sc = _mm256_castsi256_si128(ms);
        let scales = _mm256_set_m128i(sc, sc);
        let mut sumi = [_mm256_setzero_si256(); MULTI];
        for j in 0..4 {
            // 32 qs bytes: sub-block 2j in the low nibbles, 2j+1 in the high nibbles
            let qbits = load256(bx.add(Q4_K_QS + 32 * j));
            let ql = _mm256_and_si256(qbits, m4);
            let qh = _mm256_and_si256(_mm256_srli_epi16(qbits, 4), m4);
            let (sl, sh) = (splat_i16(scales, 2 * j), splat_i16(scales, 2 * j + 1));
            for t in 0..MULTI {
                let by = y[t].add(i * Q8_K_BYTES);
                let yl = load256(by.add(Q8_K_QS + 64 * j));
                let yh = load256(by.add(Q8_K_QS + 64 * j + 32));
                let pl = _mm256_madd_epi16(sl, _mm256_maddubs_epi16(ql, yl));
                let ph = _mm256_madd_epi16(sh, _mm256_maddubs_epi16(qh, yh));
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(pl, ph));
            }
        }
        for t in 0..MULTI {
            let by = y[t].add(i * Q8_K_BYTES);
            // lanes [y.d * d, y.d * dmin]
            let dd = _mm_mul_ps(_mm_set1_ps(f32_at(by)), dxm);
            let bsums = load256(by.add(Q8_K_BSUMS));
            let q8s = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256::<1>(bsums));
            acc_m[t] = min_update(acc_m[t], dd, _mm_madd_epi16(mins, q8s), false);
            acc[t] = _mm256_fmadd_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    let mut out = [0.0f32; MULTI];
    for t in 0..MULTI {
        out[t] = hsum_ps(acc[t]) + min_finish(acc_m[t], false);
    }
    out
}

/// The 2 high bits of each 6-bit quant of sub-block vector `k` of half `h`, in place (bits 4..6).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_hi(qh: __m256i, k: usize) -> __m256i {
    let m2 = _mm256_set1_epi8(0x03);
    _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32)), m2))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_impl(n: usize, x: *const u8, y: [*const u8; MULTI]) -> [f32; MULTI] {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); MULTI];
    for i in 0..n / QK_K {
        let bx = x.add(i * Q6_K_BYTES);
        let dx = f16_at(bx.add(Q6_K_D));
        let scales = load128(bx.add(Q6_K_SCALES));
        let scales16 = _mm256_cvtepi8_epi16(scales);
        // sumi starts at -32 · Σ_g sc[g]·bsums[g] (the offset of the unsigned 6-bit quants)
        let mut sumi = [_mm256_setzero_si256(); MULTI];
        for (t, s) in sumi.iter_mut().enumerate() {
            let offset = _mm256_madd_epi16(scales16, load256(y[t].add(i * Q8_K_BYTES + Q8_K_BSUMS)));
            *s = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32::<5>(offset));
        }
        for h in 0..2 {
            let ql0 = load256(bx.add(64 * h));
            let ql1 = load256(bx.add(64 * h + 32));
            let qh = load256(bx.add(Q6_K_QH + 32 * h));
            for k in 0..4 {
                let q = match k {
                    0 => _mm256_or_si256(_mm256_and_si256(ql0, m4), q6_hi(qh, 0)),
                    1 => _mm256_or_si256(_mm256_and_si256(ql1, m4), q6_hi(qh, 1)),
                    2 => _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4), q6_hi(qh, 2)),
                    _ => _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4), q6_hi(qh, 3)),
                };
                let g = (8 * h + 2 * k) as i64;
                let pick = _mm_set_epi64x((g + 1) * 0x0101010101010101, g * 0x0101010101010101);
                let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick));
                for (t, s) in sumi.iter_mut().enumerate() {
                    let yk = load256(y[t].add(i * Q8_K_BYTES + Q8_K_QS + 128 * h + 32 * k));
                    *s = _mm256_add_epi32(*s, _mm256_madd_epi16(sc, _mm256_maddubs_epi16(q, yk)));
                }
            }
        }
        for t in 0..MULTI {
            let d = f32_at(y[t].add(i * Q8_K_BYTES)) * dx;
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    let mut out = [0.0f32; MULTI];
    for t in 0..MULTI {
        out[t] = hsum_ps(acc[t]);
    }
    out
}

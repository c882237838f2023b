//! Multi-token AVX-512 kernels for the K-quants in the test models (Q4_K, Q6_K): one weight row against
//! `MULTI` Q8_K activation rows (plain layout). Per super-block the weight side (quants, sub-block scale
//! vectors) is unpacked once; each row then runs exactly the arithmetic of `dot_avx512::q4_k_impl` /
//! `q6_k_impl`, so every result is bit-identical to the one-row kernel.

use std::arch::x86_64::*;

use super::blocks::*;
use super::dot_avx512::{fold_lanes, halves_idx, join};
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
                    // SAFETY: handed out only when AVX-512 F/BW/VL/VNNI (and AVX2, FMA, F16C) are present;
                    // `check_dot_args` proved the weight row and every activation row in bounds.
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

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_k_impl(n: usize, x: *const u8, y: [*const u8; MULTI]) -> [f32; MULTI] {
    let m4 = _mm512_set1_epi8(0x0F);
    let idx = [halves_idx(0, 1), halves_idx(2, 3), halves_idx(4, 5), halves_idx(6, 7)];
    let mut acc = [_mm256_setzero_ps(); MULTI];
    let mut acc_m = [_mm_setzero_ps(); MULTI];
    for i in 0..n / QK_K {
        let bx = x.add(i * Q4_K_BYTES);
        let dxm = cvt_f16x2(rd32(bx)); // [d, dmin]
        // k4_scales_and_min_term's weight half: 8 scales (low 128 bits), 8 mins (high).
        let u = unpack_k4_scales(std::slice::from_raw_parts(bx.add(K4_SCALES), 12));
        let ms = _mm256_cvtepu8_epi16(_mm_set_epi32(u[3] as i32, u[2] as i32, u[1] as i32, u[0] as i32));
        let mins = _mm256_extracti128_si256(ms, 1);
        let sc = _mm512_castsi128_si512(_mm256_castsi256_si128(ms));
        let scs: [__m512i; 4] = std::array::from_fn(|j| _mm512_permutexvar_epi16(idx[j], sc));
        let qs: [__m512i; 4] = std::array::from_fn(|j| {
            let qbits = load256(bx.add(Q4_K_QS + 32 * j));
            _mm512_and_si512(join(qbits, _mm256_srli_epi16(qbits, 4)), m4)
        });
        for r in 0..MULTI {
            let by = y[r].add(i * Q8_K_BYTES);
            let dd = _mm_mul_ps(_mm_set1_ps(f32_at(by)), dxm);
            let bsums = load256(by.add(Q8_K_BSUMS));
            let q8s = _mm_hadd_epi16(_mm256_castsi256_si128(bsums), _mm256_extracti128_si256(bsums, 1));
            acc_m[r] = min_update(acc_m[r], dd, _mm_madd_epi16(mins, q8s), false);
            let mut sumi = _mm512_setzero_si512();
            for j in 0..4 {
                let p16 = _mm512_maddubs_epi16(qs[j], _mm512_loadu_si512(by.add(Q8_K_QS + 64 * j) as *const _));
                sumi = _mm512_dpwssd_epi32(sumi, scs[j], p16);
            }
            acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(fold_lanes(sumi)), acc[r]);
        }
    }
    std::array::from_fn(|r| hsum_ps(acc[r]) + min_finish(acc_m[r], false))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q6_k_impl(n: usize, x: *const u8, y: [*const u8; MULTI]) -> [f32; MULTI] {
    let m4 = _mm512_set1_epi8(0x0F);
    let m2 = _mm512_set1_epi8(0x03);
    let idx: [__m512i; 4] = std::array::from_fn(|r| {
        let lanes: [i16; 32] = std::array::from_fn(|l| (4 * r + l / 8) as i16);
        _mm512_loadu_si512(lanes.as_ptr() as *const _)
    });
    let mut acc = [_mm256_setzero_ps(); MULTI];
    for i in 0..n / QK_K {
        let bx = x.add(i * Q6_K_BYTES);
        let dx = f16_at(bx.add(Q6_K_D));
        let sc16 = _mm256_cvtepi8_epi16(load128(bx.add(Q6_K_SCALES)));
        let sc = _mm512_castsi256_si512(sc16);
        // q values in the order the one-row kernel uses them: (h0 lo, h0 hi, h1 lo, h1 hi).
        let mut qv = [_mm512_setzero_si512(); 4];
        for h in 0..2 {
            let ql = _mm512_loadu_si512(bx.add(64 * h) as *const _);
            let qh = load256(bx.add(Q6_K_QH + 32 * h));
            let qh = join(qh, _mm256_srli_epi16(qh, 2));
            qv[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16(_mm512_and_si512(qh, m2), 4));
            let hi_h = _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(qh, 4), m2), 4);
            qv[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), hi_h);
        }
        let scs: [__m512i; 4] = std::array::from_fn(|k| _mm512_permutexvar_epi16(idx[k], sc));
        for r in 0..MULTI {
            let by = y[r].add(i * Q8_K_BYTES);
            let d = f32_at(by) * dx;
            let offset = _mm256_madd_epi16(sc16, load256(by.add(Q8_K_BSUMS)));
            let mut sumi = _mm512_setzero_si512();
            for k in 0..4 {
                let yv = _mm512_loadu_si512(by.add(Q8_K_QS + 64 * k) as *const _);
                sumi = _mm512_dpwssd_epi32(sumi, scs[k], _mm512_maddubs_epi16(qv[k], yv));
            }
            let sumi = _mm256_sub_epi32(fold_lanes(sumi), _mm256_slli_epi32(offset, 5));
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc[r]);
        }
    }
    std::array::from_fn(|r| hsum_ps(acc[r]))
}

//! AVX2 (with FMA and F16C) versions of the routines in `super`, for x86 CPUs without AVX-512 (AMD Zen 2/3,
//! older Intel). They reproduce the *AVX-512* numerics, which reckon uses on every CPU so that a model's
//! bits do not depend on the machine: each 16-lane ggml vector is a pair of 8-lane registers `(lo, hi)`,
//! each lane keeps its own FMA chain, and the horizontal sums add exactly the pairs that
//! `_mm512_reduce_add_ps` adds. The tests check every routine against the scalar emulations bit for bit.

use std::arch::x86_64::*;

/// Whether this CPU runs the functions below.
pub fn available() -> bool {
    let f = crate::kernels::cpu::CpuFeatures::get();
    f.avx2 && f.fma && f.f16c
}

#[inline(always)]
fn c(bits: u32) -> f32 {
    f32::from_bits(bits)
}

/// ggml_v_expf on 8 lanes, with AVX-512's `_mm512_scalef_ps(j, n)` (one rounding of j·2^n) emulated: an
/// exact f32 multiply while every lane's 2^n and result are normal, else through f64 (exact, then rounded
/// once), as the scalar emulation does.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn v_expf(x: __m256) -> __m256 {
    let r = _mm256_set1_ps(c(0x4b40_0000));
    let z = _mm256_fmadd_ps(x, _mm256_set1_ps(c(0x3fb8_aa3b)), r);
    let n = _mm256_sub_ps(z, r);
    let b = _mm256_fnmadd_ps(n, _mm256_set1_ps(c(0x35bf_be8e)), _mm256_fnmadd_ps(n, _mm256_set1_ps(c(0x3f31_7200)), x));
    let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
    let d = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
    let u = _mm256_mul_ps(b, b);
    let j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(
            _mm256_fmadd_ps(_mm256_set1_ps(c(0x3c07_2010)), b, _mm256_set1_ps(c(0x3d2b_9f17))),
            u,
            _mm256_fmadd_ps(_mm256_set1_ps(c(0x3e2a_af33)), b, _mm256_set1_ps(c(0x3eff_fedb))),
        ),
        u,
        _mm256_fmadd_ps(_mm256_set1_ps(c(0x3f7f_fff6)), b, _mm256_set1_ps(1.0)),
    );
    let res = scalef(j, n);
    if _mm256_movemask_ps(d) == 0 {
        return res;
    }
    let zero = _mm256_setzero_ps();
    let alt = _mm256_blendv_ps(_mm256_set1_ps(f32::INFINITY), zero, _mm256_cmp_ps::<_CMP_LE_OQ>(n, zero));
    _mm256_blendv_ps(res, alt, d)
}

/// j·2^n (n integral) rounded once, as `_mm512_scalef_ps`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scalef(j: __m256, n: __m256) -> __m256 {
    // |j| < 2 here, so for n in -125..=127 both 2^n and j·2^n are normal and the product is exact.
    let normal = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(n, _mm256_set1_ps(-125.0)), _mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_set1_ps(127.0)));
    if _mm256_movemask_ps(normal) == 0xff {
        let pow = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127))));
        return _mm256_mul_ps(j, pow);
    }
    // Clamped so that the f64 exponent stays valid; lanes beyond ±192 are replaced by the caller.
    let n = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-1000.0)), _mm256_set1_ps(1000.0));
    let ni = _mm256_cvtps_epi32(n);
    let lo = scalef_f64(_mm256_castps256_ps128(j), _mm256_castsi256_si128(ni));
    let hi = scalef_f64(_mm256_extractf128_ps::<1>(j), _mm256_extracti128_si256::<1>(ni));
    _mm256_set_m128(hi, lo)
}

/// Four lanes of `scalef` in f64: j·2^n exactly, then rounded once to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scalef_f64(j4: __m128, n4: __m128i) -> __m128 {
    let pow = _mm256_castsi256_pd(_mm256_slli_epi64::<52>(_mm256_add_epi64(_mm256_cvtepi32_epi64(n4), _mm256_set1_epi64x(1023))));
    _mm256_cvtpd_ps(_mm256_mul_pd(_mm256_cvtps_pd(j4), pow))
}

/// `_mm512_reduce_add_ps` of the 16-lane vector `(lo, hi)`: halves, quarters, {2,3,0,1}, lanes 0 + 1.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn reduce_add(lo: __m256, hi: __m256) -> f32 {
    let t3 = _mm256_add_ps(hi, lo);
    let t6 = _mm_add_ps(_mm256_extractf128_ps::<1>(t3), _mm256_castps256_ps128(t3));
    let t8 = _mm_add_ps(t6, _mm_shuffle_ps::<0b01_00_11_10>(t6, t6));
    _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps::<0b01_01_01_01>(t8, t8))
}

/// Eight f16 values at `p`, in f32.
#[inline(always)]
unsafe fn load_ph(p: *const half::f16) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// ggml_vec_swiglu_f32's vector part (see `super::swiglu`); returns how many elements it did.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn swiglu(x: &mut [f32], g: &[f32]) -> usize {
    let n = x.len().min(g.len()) / 16 * 16;
    let one = _mm256_set1_ps(1.0);
    for i in (0..n).step_by(8) {
        let xv = _mm256_loadu_ps(x.as_ptr().add(i));
        let gv = _mm256_loadu_ps(g.as_ptr().add(i));
        let e = v_expf(_mm256_sub_ps(_mm256_setzero_ps(), xv));
        let silu = _mm256_div_ps(xv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(x.as_mut_ptr().add(i), _mm256_mul_ps(silu, gv));
    }
    n
}

/// ggml_soft_max over the cells `first_cell..first_cell + scores.len()`: see `super::soft_max`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn soft_max(scores: &mut [f32], first_cell: usize) {
    let len = scores.len();
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let maxv = _mm256_set1_ps(max);
    let mut sum = 0.0f64;
    let mut base = -((first_cell % 16) as isize); // score index of lane 0 of the current 16-lane vector
    let mut buf = [f32::NEG_INFINITY; 16];
    while base < len as isize {
        let (lo, hi) = ((-base).max(0) as usize, (len as isize - base).min(16) as usize);
        let full = lo == 0 && hi == 16;
        let p = if full {
            scores.as_mut_ptr().offset(base)
        } else {
            // a partial vector: masked lanes hold -inf, whose exp is 0
            buf = [f32::NEG_INFINITY; 16];
            buf[lo..hi].copy_from_slice(&scores[(base + lo as isize) as usize..(base + hi as isize) as usize]);
            buf.as_mut_ptr()
        };
        let e0 = v_expf(_mm256_sub_ps(_mm256_loadu_ps(p), maxv));
        let e1 = v_expf(_mm256_sub_ps(_mm256_loadu_ps(p.add(8)), maxv));
        _mm256_storeu_ps(p, e0);
        _mm256_storeu_ps(p.add(8), e1);
        if !full {
            scores[(base + lo as isize) as usize..(base + hi as isize) as usize].copy_from_slice(&buf[lo..hi]);
        }
        sum += reduce_add(e0, e1) as f64;
        base += 16;
    }
    let inv = (1.0 / sum) as f32;
    let invv = _mm256_set1_ps(inv);
    let mut i = 0;
    while i + 8 <= len {
        let p = scores.as_mut_ptr().add(i);
        _mm256_storeu_ps(p, _mm256_mul_ps(_mm256_loadu_ps(p), invv));
        i += 8;
    }
    scores[i..].iter_mut().for_each(|v| *v *= inv);
}

/// The four 16-lane accumulators of ggml_vec_dot_f16 over `x` (f16) and `y` (f32, exactly converted),
/// added `(a0 + a2) + (a1 + a3)`: returned as `(lo, hi)`. `n` is a multiple of 64.
#[inline(always)]
unsafe fn dot_lanes(x: *const half::f16, y: *const f32, n: usize) -> (__m256, __m256) {
    let mut acc = [_mm256_setzero_ps(); 8]; // vector j of ggml's four: acc[2j] (lanes 0..8), acc[2j+1]
    for step in (0..n).step_by(64) {
        for (k, a) in acc.iter_mut().enumerate() {
            let o = step + 8 * k;
            *a = _mm256_fmadd_ps(load_ph(x.add(o)), _mm256_loadu_ps(y.add(o)), *a);
        }
    }
    let lo = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
    let hi = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
    (lo, hi)
}

/// `dot_lanes` with the key already converted to f32 (exact): `hi + lo` of the 16-lane sum vector, the
/// first step of `reduce_add` (for `reduce_8_rows`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn key_sum_f32(x: *const f32, y: *const f32, n: usize) -> __m256 {
    let mut acc = [_mm256_setzero_ps(); 8];
    for step in (0..n).step_by(64) {
        for (k, a) in acc.iter_mut().enumerate() {
            let o = step + 8 * k;
            *a = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(o)), _mm256_loadu_ps(y.add(o)), *a);
        }
    }
    let lo = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
    let hi = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
    _mm256_add_ps(hi, lo)
}

/// `super::dot_f16` with the second vector already converted to f32 (exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16_f32(x: &[half::f16], y: &[f32]) -> f32 {
    let n = x.len().min(y.len());
    let full = n / 64 * 64;
    let (lo, hi) = dot_lanes(x.as_ptr(), y.as_ptr(), full);
    let mut sum = reduce_add(lo, hi) as f64;
    for (a, &b) in x[full..n].iter().zip(&y[full..n]) {
        sum += (a.to_f32() * b) as f64;
    }
    sum as f32
}

/// `dot_f16_f32` for 16 keys `keys[offsets[c]..][..hd]` (`hd` a multiple of 64): the per-key
/// `_mm512_reduce_add_ps` trees of 8 keys at a time run through one transpose network adding the same pairs.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16_f32_x16(keys: &[half::f16], offsets: &[usize], q: &[f32], out: &mut [f32]) {
    let hd = q.len();
    debug_assert!(hd % 64 == 0 && offsets.len() >= 16 && out.len() >= 16);
    // (plain loops, no closures: a closure is compiled without this function's features)
    for eight in 0..2 {
        let mut t3 = [_mm256_setzero_ps(); 8];
        for (k, t) in t3.iter_mut().enumerate() {
            let (lo, hi) = dot_lanes(keys.as_ptr().add(offsets[8 * eight + k]), q.as_ptr(), hd);
            *t = _mm256_add_ps(hi, lo);
        }
        _mm256_storeu_ps(out.as_mut_ptr().add(8 * eight), reduce_8_rows(&t3));
    }
}

/// The rest of `reduce_add` (from the 8-lane `hi + lo`) for 8 vectors at once: lane `k` of the result is
/// `t3[k]`'s sum.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn reduce_8_rows(t3: &[__m256; 8]) -> __m256 {
    // 128-bit halves: x[m] = [t6 of key 2m | t6 of key 2m + 1].
    let mut x = [_mm256_setzero_ps(); 4];
    for (m, xm) in x.iter_mut().enumerate() {
        let (a, b) = (t3[2 * m], t3[2 * m + 1]);
        *xm = _mm256_add_ps(_mm256_permute2f128_ps::<0x31>(a, b), _mm256_permute2f128_ps::<0x20>(a, b));
    }
    // {2,3,0,1}: y[p] = [key 4p: u0 u1, key 4p+2: u0 u1 | key 4p+1: u0 u1, key 4p+3: u0 u1].
    let mut y = [_mm256_setzero_ps(); 2];
    for (p, yp) in y.iter_mut().enumerate() {
        let (a, b) = (x[2 * p], x[2 * p + 1]);
        *yp = _mm256_add_ps(_mm256_shuffle_ps::<0x44>(a, b), _mm256_shuffle_ps::<0xEE>(a, b));
    }
    // lanes 0 + 1: r = [keys 0, 2, 4, 6 | 1, 3, 5, 7].
    let r = _mm256_add_ps(_mm256_shuffle_ps::<0x88>(y[0], y[1]), _mm256_shuffle_ps::<0xDD>(y[0], y[1]));
    _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// row += w·v over whole 16-element vectors (v converted from f16), as `super::LaneAcc::add`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn fma_row(row: &mut [f32], w: f32, v: &[half::f16]) {
    let n = row.len().min(v.len()) / 16 * 16;
    let wv = _mm256_set1_ps(w);
    for i in (0..n).step_by(8) {
        let p = row.as_mut_ptr().add(i);
        _mm256_storeu_ps(p, _mm256_fmadd_ps(wv, load_ph(v.as_ptr().add(i)), _mm256_loadu_ps(p)));
    }
}

/// `super::LaneAcc::add_cells` lane by lane, 64 values of a row at a time in 8 registers (`hd` a multiple
/// of 64): the same per-lane order as adding the cells one by one. `rows`: `[64, hd]`; returns the mask
/// of lanes written (the others are untouched).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn accumulate_lanes(rows: &mut [f32], hd: usize, first_cell: usize, w: &[f32], values: &[half::f16], offsets: &[usize]) -> u64 {
    debug_assert!(hd % 64 == 0 && rows.len() >= 64 * hd);
    let mut touched = 0u64;
    for lane in 0..64usize {
        // the first cell index i (into w/offsets) whose cell is in this lane
        let first = (lane + 64 - first_cell % 64) % 64;
        if first >= w.len() {
            continue;
        }
        for d0 in (0..hd).step_by(64) {
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut i = first;
            while i < w.len() {
                let wv = _mm256_set1_ps(w[i]);
                let pv = values.as_ptr().add(offsets[i] + d0);
                for (k, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(wv, load_ph(pv.add(8 * k)), *a);
                }
                i += 64;
            }
            let row = rows.as_mut_ptr().add(lane * hd + d0);
            for (k, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(row.add(8 * k), *a);
            }
        }
        touched |= 1 << lane;
    }
    touched
}

/// `super::reduce_lane_rows` for `hd` a multiple of 8, 8 dimensions at a time. `rows` is only read.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn reduce_lane_rows(rows: &[f32], hd: usize, out: &mut [f32]) {
    debug_assert!(hd % 8 == 0 && rows.len() >= 64 * hd && out.len() >= hd);
    let p = rows.as_ptr();
    for d in (0..hd).step_by(8) {
        let mut v = [_mm256_setzero_ps(); 16];
        for (l, vl) in v.iter_mut().enumerate() {
            let row = |lane: usize| p.add(lane * hd + d);
            *vl = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(row(l)), _mm256_loadu_ps(row(32 + l))), _mm256_add_ps(_mm256_loadu_ps(row(16 + l)), _mm256_loadu_ps(row(48 + l))));
        }
        for width in [8, 4] {
            for l in 0..width {
                v[l] = _mm256_add_ps(v[l], v[l + width]);
            }
        }
        _mm256_storeu_ps(out.as_mut_ptr().add(d), _mm256_add_ps(_mm256_add_ps(v[0], v[2]), _mm256_add_ps(v[1], v[3])));
    }
}

/// Rounds each value to the nearest f16 and back (ties to even, as `half::f16::from_f32`), 8 at a time.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn round_through_f16(x: &mut [f32]) -> usize {
    let n = x.len() / 8 * 8;
    for i in (0..n).step_by(8) {
        let p = x.as_mut_ptr().add(i);
        _mm256_storeu_ps(p, _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(p))));
    }
    n
}

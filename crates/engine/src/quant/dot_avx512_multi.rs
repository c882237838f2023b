//! AVX-512 kernels that dot one weight row with `MULTI` activation rows at once (prefill), for the
//! legacy block types that dominate the models (Q4_0, Q4_1, Q5_0, Q8_0).
//!
//! Each of the `MULTI` results is computed by exactly the instruction sequence of the one-row kernel in
//! `dot_avx512` (same integer lanes, same 8-lane f32 accumulator, block after block, same final sum), so
//! they are bit-identical to it and to llama.cpp. What changes is the work around it: the weight block
//! is loaded and unpacked once for all rows, and the `MULTI` independent FMA chains overlap instead of
//! each waiting on its own 4-cycle latency.

use std::arch::x86_64::*;

use super::blocks::*;
use super::x86_util::*;
use super::{check_dot_args, expanded_act_row_bytes, GgmlType, MultiDotFn, MultiRowFn, SimdLevel, MULTI};



/// The multi-row kernel for `t` at this level, if there is one.
pub(super) fn kernel(t: GgmlType) -> Option<MultiDotFn> {
    assert!(SimdLevel::Avx512.is_available());
    Some(match t {
        GgmlType::Q4_0 => q4_0_multi,
        GgmlType::Q4_1 => q4_1_multi,
        GgmlType::Q5_0 => q5_0_multi,
        GgmlType::Q8_0 => q8_0_multi,
        GgmlType::Q4_K => super::dot_avx512_multi_k::q4_k_multi,
        GgmlType::Q6_K => super::dot_avx512_multi_k::q6_k_multi,
        _ => return None,
    })
}

macro_rules! safe_kernels {
    ($($name:ident => $t:ident, $imp:ident;)*) => {$(
        fn $name(n: usize, w: &[u8], a: &[u8], stride: usize) -> [f32; MULTI] {
            let wb = GgmlType::$t.row_bytes(n).expect("n is a multiple of the block length");
            assert!(w.len() >= wb, "multi dot {}: weight row too short", GgmlType::$t);
            let need = expanded_act_row_bytes(n);
            assert!(stride >= need && a.len() >= (MULTI - 1) * stride + need, "multi dot {}: activation rows too short", GgmlType::$t);
            let rows: [*const u8; MULTI] = std::array::from_fn(|r| a[r * stride..].as_ptr());
            // SAFETY: handed out only when AVX-512 F/BW/VL/VNNI (and AVX2, FMA, F16C) are present; the
            // weight row and all MULTI expanded activation rows were checked to be long enough.
            unsafe { $imp(n, w.as_ptr(), rows) }
        }
    )*};
}

safe_kernels! {
    q4_0_multi => Q4_0, q4_0_impl;
    q4_1_multi => Q4_1, q4_1_impl;
    q5_0_multi => Q5_0, q5_0_impl;
    q8_0_multi => Q8_0, q8_0_impl;
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn join(a: __m256i, b: __m256i) -> __m512i {
    _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn load_pair(p0: *const u8, p1: *const u8) -> __m512i {
    join(load256(p0), load256(p1))
}

/// As `dot_avx512::nibbles_pair`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn nibbles_pair(p0: *const u8, p1: *const u8) -> __m512i {
    let v = _mm512_mask_broadcast_i32x4(_mm512_broadcast_i32x4(load128(p0)), 0xFF00, load128(p1));
    let v = _mm512_mask_srli_epi16(v, 0xFF00_FF00, v, 4);
    _mm512_and_si512(v, _mm512_set1_epi8(0x0F))
}

/// As `dot_avx512::d_pair`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn d_pair(x0: *const u8, y0: *const u8, x1: *const u8, y1: *const u8) -> (__m256, __m256) {
    let bits = rd16(x0) as u64 | (rd16(y0) as u64) << 16 | (rd16(x1) as u64) << 32 | (rd16(y1) as u64) << 48;
    let v = cvt_f16x4(bits);
    let d = _mm_mul_ps(v, _mm_movehdup_ps(v));
    (_mm256_broadcastss_ps(d), _mm256_broadcastss_ps(_mm_movehl_ps(d, d)))
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn high_ps(p: __m512) -> __m256 {
    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(p), 1))
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn f16_to_f32(p: *const u8) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(rd16(p) as i32)))
}

/// `dot_avx512::sum_pairs` for `MULTI` rows on one side: `$prep` runs once per block pair, `$body` once
/// per row `$r` and yields (d0, d1, 16 f32 lanes) exactly as the one-row body does.
macro_rules! sum_pairs_multi {
    ($nb:expr, |$b0:ident, $b1:ident| $prep:expr, |$r:ident, $w:ident| $body:expr) => {{
        let nb: usize = $nb;
        let mut acc = [_mm256_setzero_ps(); MULTI];
        let mut i = 0usize;
        while i + 1 < nb {
            let ($b0, $b1) = (i, i + 1);
            let $w = $prep;
            for $r in 0..MULTI {
                let (d0, d1, p) = $body;
                acc[$r] = _mm256_fmadd_ps(d0, _mm512_castps512_ps256(p), acc[$r]);
                acc[$r] = _mm256_fmadd_ps(d1, high_ps(p), acc[$r]);
            }
            i += 2;
        }
        if i < nb {
            let ($b0, $b1) = (i, i);
            let $w = $prep;
            for $r in 0..MULTI {
                let (d0, _, p) = $body;
                acc[$r] = _mm256_fmadd_ps(d0, _mm512_castps512_ps256(p), acc[$r]);
            }
        }
        let mut out = [0.0f32; MULTI];
        for (o, a) in out.iter_mut().zip(acc) {
            *o = hsum_ps(a);
        }
        out
    }};
}

/// Bytes ahead of the current weight block that the decode kernels prefetch (4 rows are read as one
/// stream; the hardware prefetcher alone left Gemma-3's 170 MB output matrix latency-bound).
const PREFETCH_AHEAD: usize = 2048;

/// Blocks whose scale products are prepared at a time (even, so block pairs stay ggml's pairs).
const CHUNK: usize = 32;

/// The multi-token loop over expanded activation rows. Per chunk of blocks, the weight scales
/// (`$scales`: block pointer -> (d, m)) are converted once and multiplied with every row's activation
/// scales in one go; `m·s` (Q4_1) is accumulated in block order as ggml's `summs` lane. Per block pair,
/// `$prep` unpacks the weight quants once and `$dot` (weight quants, activation quants -> i32 lanes)
/// runs per row; the f32 accumulation is the one-row kernel's.
macro_rules! multi_tokens {
    ($n:expr, $x:expr, $y:expr, $xbytes:expr, $has_min:expr, |$xb:ident| $scales:expr, |$x0:ident, $x1:ident| $prep:expr, |$wq:ident, $qy:ident| $dot:expr) => {{
        let (n, x, y): (usize, *const u8, [*const u8; MULTI]) = ($n, $x, $y);
        let nb = n / QK;
        let mut acc = [_mm256_setzero_ps(); MULTI];
        let mut ms = [0.0f32; MULTI];
        // Scratch for the chunk's scale products: written before read, so left uninitialised (zeroing it
        // per call showed up in the profile).
        let mut dprod_buf = [[std::mem::MaybeUninit::<f32>::uninit(); CHUNK + 16]; MULTI];
        let dprod: [*mut f32; MULTI] = std::array::from_fn(|r| dprod_buf[r].as_mut_ptr() as *mut f32);
        let mut dx_buf = [std::mem::MaybeUninit::<f32>::uninit(); CHUNK];
        let mut mx_buf = [std::mem::MaybeUninit::<f32>::uninit(); CHUNK];
        let (dx, mx) = (dx_buf.as_mut_ptr() as *mut f32, mx_buf.as_mut_ptr() as *mut f32);
        let mut c0 = 0;
        while c0 < nb {
            let cn = (nb - c0).min(CHUNK);
            for k in 0..cn {
                let $xb = x.add((c0 + k) * $xbytes);
                let (d, m) = $scales;
                (dx.add(k).write(d), mx.add(k).write(m));
            }
            // dx·dy, 16 blocks a vector.
            for r in 0..MULTI {
                let dy = (y[r].add(n) as *const f32).add(c0);
                for k in (0..cn).step_by(16) {
                    let m: __mmask16 = if cn - k >= 16 { 0xFFFF } else { (1u16 << (cn - k)) - 1 };
                    let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, dx.add(k)), _mm512_maskz_loadu_ps(m, dy.add(k)));
                    _mm512_mask_storeu_ps(dprod[r].add(k), m, v);
                }
            }
            // m·s in block order; the rows' chains interleave so their FMA latencies overlap.
            if $has_min {
                let sy: [*const f32; MULTI] = std::array::from_fn(|r| (y[r].add(n + 4 * nb) as *const f32).add(c0));
                for k in 0..cn {
                    for r in 0..MULTI {
                        ms[r] = mx.add(k).read().mul_add(sy[r].add(k).read_unaligned(), ms[r]);
                    }
                }
            }
            let mut k = 0;
            while k < cn {
                let i = c0 + k;
                let pair = k + 1 < cn;
                let $x0 = x.add(i * $xbytes);
                let $x1 = if pair { $x0.add($xbytes) } else { $x0 };
                let $wq = $prep;
                for r in 0..MULTI {
                    let $qy = if pair {
                        _mm512_loadu_si512(y[r].add(i * QK) as *const _)
                    } else {
                        _mm512_zextsi256_si512(load256(y[r].add(i * QK)))
                    };
                    let p = _mm512_cvtepi32_ps($dot);
                    acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&*dprod[r].add(k)), _mm512_castps512_ps256(p), acc[r]);
                    if pair {
                        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&*dprod[r].add(k + 1)), high_ps(p), acc[r]);
                    }
                }
                k += 2;
            }
            c0 += cn;
        }
        let mut out = [0.0f32; MULTI];
        for r in 0..MULTI {
            out[r] = if $has_min { hsum_ps(acc[r]) + ms[r] } else { hsum_ps(acc[r]) };
        }
        out
    }};
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_impl(n: usize, x: *const u8, y: [*const u8; MULTI]) -> [f32; MULTI] {
    let zero = _mm512_setzero_si512();
    multi_tokens!(n, x, y, Q8_0_BYTES, false, |xb| (f16_to_f32(xb), 0.0), |x0, x1| {
        let qx = load_pair(x0.add(2), x1.add(2));
        (_mm512_abs_epi8(qx), _mm512_movepi8_mask(qx))
    }, |w, qy| {
        // |x| as u8 times y with x's sign, as the one-row kernel
        let sy = _mm512_mask_sub_epi8(qy, w.1, zero, qy);
        _mm512_dpbusd_epi32(zero, w.0, sy)
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_0_impl(n: usize, x: *const u8, y: [*const u8; MULTI]) -> [f32; MULTI] {
    let zero = _mm512_setzero_si512();
    let eight = _mm512_set1_epi8(8);
    multi_tokens!(n, x, y, Q4_0_BYTES, false, |xb| (f16_to_f32(xb), 0.0), |x0, x1| nibbles_pair(x0.add(2), x1.add(2)), |q, qy| {
        _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, q, qy), _mm512_dpbusd_epi32(zero, eight, qy))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_0_impl(n: usize, x: *const u8, y: [*const u8; MULTI]) -> [f32; MULTI] {
    let zero = _mm512_setzero_si512();
    let sixteen = _mm512_set1_epi8(16);
    multi_tokens!(n, x, y, Q5_0_BYTES, false, |xb| (f16_to_f32(xb), 0.0), |x0, x1| {
        let qh0 = (x0.add(2) as *const u32).read_unaligned() as u64;
        let qh1 = (x1.add(2) as *const u32).read_unaligned() as u64;
        let nib = nibbles_pair(x0.add(6), x1.add(6));
        _mm512_mask_add_epi8(nib, qh0 | (qh1 << 32), nib, sixteen)
    }, |q, qy| {
        _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, q, qy), _mm512_dpbusd_epi32(zero, sixteen, qy))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_1_impl(n: usize, x: *const u8, y: [*const u8; MULTI]) -> [f32; MULTI] {
    let zero = _mm512_setzero_si512();
    multi_tokens!(n, x, y, Q4_1_BYTES, true, |xb| (f16_to_f32(xb), f16_to_f32(xb.add(2))), |x0, x1| {
        nibbles_pair(x0.add(4), x1.add(4))
    }, |q, qy| _mm512_dpbusd_epi32(zero, q, qy))
}

// ---- several weight rows against one activation row (decode) ----

/// The multi-weight-row kernel for `t` at this level, if there is one.
pub(super) fn rows_kernel(t: GgmlType) -> Option<MultiRowFn> {
    assert!(SimdLevel::Avx512.is_available());
    Some(match t {
        GgmlType::Q4_0 => q4_0_rows,
        GgmlType::Q4_1 => q4_1_rows,
        GgmlType::Q5_0 => q5_0_rows,
        GgmlType::Q8_0 => q8_0_rows,
        _ => return None,
    })
}

macro_rules! safe_row_kernels {
    ($($name:ident => $t:ident, $imp:ident;)*) => {$(
        fn $name(n: usize, w: &[u8], stride: usize, a: &[u8]) -> [f32; MULTI] {
            let rows: [&[u8]; MULTI] = std::array::from_fn(|r| &w[r * stride..]);
            for row in rows {
                check_dot_args(GgmlType::$t, n, row, a);
            }
            // SAFETY: as for the multi-activation kernels above.
            unsafe { $imp(n, rows.map(|r| r.as_ptr()), a.as_ptr()) }
        }
    )*};
}

safe_row_kernels! {
    q4_0_rows => Q4_0, q4_0_rows_impl;
    q4_1_rows => Q4_1, q4_1_rows_impl;
    q5_0_rows => Q5_0, q5_0_rows_impl;
    q8_0_rows => Q8_0, q8_0_rows_impl;
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_rows_impl(n: usize, x: [*const u8; MULTI], y: *const u8) -> [f32; MULTI] {
    let zero = _mm512_setzero_si512();
    sum_pairs_multi!(n / QK, |i0, i1| {
        let (y0, y1) = (y.add(i0 * Q8_0_BYTES), y.add(i1 * Q8_0_BYTES));
        (y0, y1, load_pair(y0.add(2), y1.add(2)))
    }, |r, a| {
        let (y0, y1, qy) = a;
        let (x0, x1) = (x[r].add(i0 * Q8_0_BYTES), x[r].add(i1 * Q8_0_BYTES));
        _mm_prefetch::<_MM_HINT_T0>(x0.add(PREFETCH_AHEAD) as *const i8);
        let qx = load_pair(x0.add(2), x1.add(2));
        let sy = _mm512_mask_sub_epi8(qy, _mm512_movepi8_mask(qx), zero, qy);
        let p = _mm512_dpbusd_epi32(zero, _mm512_abs_epi8(qx), sy);
        let (d0, d1) = d_pair(x0, y0, x1, y1);
        (d0, d1, _mm512_cvtepi32_ps(p))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_0_rows_impl(n: usize, x: [*const u8; MULTI], y: *const u8) -> [f32; MULTI] {
    let zero = _mm512_setzero_si512();
    let eight = _mm512_set1_epi8(8);
    sum_pairs_multi!(n / QK, |i0, i1| {
        let (y0, y1) = (y.add(i0 * Q8_0_BYTES), y.add(i1 * Q8_0_BYTES));
        let qy = load_pair(y0.add(2), y1.add(2));
        (y0, y1, qy, _mm512_dpbusd_epi32(zero, eight, qy))
    }, |r, a| {
        let (y0, y1, qy, offset) = a;
        let (x0, x1) = (x[r].add(i0 * Q4_0_BYTES), x[r].add(i1 * Q4_0_BYTES));
        _mm_prefetch::<_MM_HINT_T0>(x0.add(PREFETCH_AHEAD) as *const i8);
        let p = _mm512_dpbusd_epi32(zero, nibbles_pair(x0.add(2), x1.add(2)), qy);
        let p = _mm512_sub_epi32(p, offset);
        let (d0, d1) = d_pair(x0, y0, x1, y1);
        (d0, d1, _mm512_cvtepi32_ps(p))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_0_rows_impl(n: usize, x: [*const u8; MULTI], y: *const u8) -> [f32; MULTI] {
    let zero = _mm512_setzero_si512();
    let sixteen = _mm512_set1_epi8(16);
    sum_pairs_multi!(n / QK, |i0, i1| {
        let (y0, y1) = (y.add(i0 * Q8_0_BYTES), y.add(i1 * Q8_0_BYTES));
        let qy = load_pair(y0.add(2), y1.add(2));
        (y0, y1, qy, _mm512_dpbusd_epi32(zero, sixteen, qy))
    }, |r, a| {
        let (y0, y1, qy, offset) = a;
        let (x0, x1) = (x[r].add(i0 * Q5_0_BYTES), x[r].add(i1 * Q5_0_BYTES));
        _mm_prefetch::<_MM_HINT_T0>(x0.add(PREFETCH_AHEAD) as *const i8);
        let qh0 = (x0.add(2) as *const u32).read_unaligned() as u64;
        let qh1 = (x1.add(2) as *const u32).read_unaligned() as u64;
        let nib = nibbles_pair(x0.add(6), x1.add(6));
        let q = _mm512_mask_add_epi8(nib, qh0 | (qh1 << 32), nib, sixteen);
        let p = _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, q, qy), offset);
        let (d0, d1) = d_pair(x0, y0, x1, y1);
        (d0, d1, _mm512_cvtepi32_ps(p))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_1_rows_impl(n: usize, x: [*const u8; MULTI], y: *const u8) -> [f32; MULTI] {
    let zero = _mm512_setzero_si512();
    let mut summs = [_mm_setzero_ps(); MULTI];
    let s = sum_pairs_multi!(n / QK, |i0, i1| {
        let (y0, y1) = (y.add(i0 * Q8_1_BYTES), y.add(i1 * Q8_1_BYTES));
        (y0, y1, load_pair(y0.add(4), y1.add(4)))
    }, |r, a| {
        let (y0, y1, qy) = a;
        let (x0, x1) = (x[r].add(i0 * Q4_1_BYTES), x[r].add(i1 * Q4_1_BYTES));
        _mm_prefetch::<_MM_HINT_T0>(x0.add(PREFETCH_AHEAD) as *const i8);
        let d0 = dm_prod(x0, y0, &mut summs[r]);
        let d1 = if i0 != i1 { dm_prod(x1, y1, &mut summs[r]) } else { d0 };
        let p = _mm512_dpbusd_epi32(zero, nibbles_pair(x0.add(4), x1.add(4)), qy);
        (d0, d1, _mm512_cvtepi32_ps(p))
    });
    let mut out = s;
    for (o, sm) in out.iter_mut().zip(summs) {
        *o += _mm_cvtss_f32(_mm_movehdup_ps(sm));
    }
    out
}

//! AVX-512 kernels around the one-row kernels of `dot_avx512`: `MULTI` weight rows against one
//! activation row (decode), and the K-quant multi-token kernels (`dot_avx512_multi_k`) by type. (Batches
//! of legacy-type rows go to the pair kernels, `dot_avx512_pair`.)
//!
//! Each result is computed by exactly the instruction sequence of the one-row kernel in `dot_avx512`
//! (same integer lanes, same 8-lane f32 accumulator, block after block, same final sum), so it is
//! bit-identical to it and to llama.cpp. What changes is the work around it: the activation block is
//! loaded once for all rows, and the `MULTI` independent FMA chains overlap instead of each waiting on
//! its own 4-cycle latency.

use std::arch::x86_64::*;

use super::blocks::*;
use super::dot_avx512::{d_pair, high_ps, load_pair, nibbles_pair, PREFETCH_AHEAD};
use super::x86_util::*;
use super::{check_dot_args, GgmlType, MultiDotFn, MultiRowFn, SimdLevel, MULTI};

/// The multi-row kernel for `t` at this level, if there is one.
pub(super) fn kernel(t: GgmlType) -> Option<MultiDotFn> {
    assert!(SimdLevel::Avx512.is_available());
    Some(match t {
        GgmlType::Q4_K => super::dot_avx512_multi_k::q4_k_multi,
        GgmlType::Q6_K => super::dot_avx512_multi_k::q6_k_multi,
        _ => return None,
    })
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

/// Most blocks per row the pair kernels handle (they keep a tile's row scales on the stack): 8192
/// elements.
pub(super) const MAX_BLOCKS: usize = 256;

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

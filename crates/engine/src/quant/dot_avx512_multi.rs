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
use super::dot_avx512::{d_pair, high_ps, load_pair, nibbles_pair, PREFETCH_AHEAD};
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
        fn $name(n: usize, w: &[u8], a: &[u8], stride: usize, s_by_block: &[f32], out: &mut [f32]) {
            let wb = GgmlType::$t.row_bytes(n).expect("n is a multiple of the block length");
            assert!(w.len() >= wb, "multi dot {}: weight row too short", GgmlType::$t);
            assert!(n / QK <= MAX_BLOCKS, "multi dot {}: rows of {n} are too long", GgmlType::$t);
            let n_groups = out.len() / MULTI;
            assert_eq!(out.len(), n_groups * MULTI, "multi dot: output is not whole groups of {MULTI}");
            let need = expanded_act_row_bytes(n);
            assert!(n_groups == 0 || (stride >= need && a.len() >= (out.len() - 1) * stride + need), "multi dot {}: activation rows too short", GgmlType::$t);
            // SAFETY: handed out only when AVX-512 F/BW/VL/VNNI (and AVX2, FMA, F16C) are present; the
            // weight row, every expanded activation row and the output were checked to be long enough.
            let with_min = GgmlType::$t.dot_activation_type() == GgmlType::Q8_1;
            assert!(!with_min || s_by_block.len() >= (n / QK) * out.len(), "multi dot {}: s_by_block too short", GgmlType::$t);
            unsafe { $imp(n, w.as_ptr(), a.as_ptr(), stride, n_groups, s_by_block.as_ptr(), out.as_mut_ptr()) }
        }
    )*};
}

safe_kernels! {
    q4_0_multi => Q4_0, q4_0_impl;
    q4_1_multi => Q4_1, q4_1_impl;
    q5_0_multi => Q5_0, q5_0_impl;
    q8_0_multi => Q8_0, q8_0_impl;
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

/// Most blocks per row the multi-token kernels handle (they cache a whole row's unpacked weights on the
/// stack): 8192 elements.
pub(super) const MAX_BLOCKS: usize = 256;

/// The multi-token loop: one weight row against `n_groups · MULTI` expanded activation rows (`y0`,
/// `stride` bytes apart), results to `out[0..n_groups·MULTI]`.
///
/// The weight row is prepared once for all tokens: its scales (d, and m for Q4_1) as f32,
/// and per block pair the unpacked quants (`$prep`: (x0, x1) -> (u8 quants as one register, a 64-bit mask)).
/// Per group of MULTI rows, `d_x·d_y` is computed 16 blocks per vector, `m·s` (Q4_1) is accumulated in
/// block order with the rows' chains interleaved, and `$dot` (cached quants, mask, activation quants -> i32
/// lanes) runs per row and pair; the f32 accumulation is the one-row kernel's, so each result is its bits.
macro_rules! multi_tokens {
    ($n:expr, $x:expr, $y0:expr, $stride:expr, $n_groups:expr, $s_t:expr, $out:expr, $xbytes:expr, $has_min:expr,
     |$x0:ident, $x1:ident| $prep:expr, |$wq:ident, $wm:ident, $qy:ident| $dot:expr) => {{
        let (n, x, y0, stride, n_groups, s_t, out): (usize, *const u8, *const u8, usize, usize, *const f32, *mut f32) =
            ($n, $x, $y0, $stride, $n_groups, $s_t, $out);
        let nb = n / QK;
        let n_pairs = nb.div_ceil(2);
        debug_assert!(nb <= MAX_BLOCKS);
        // Row caches, written before read (left uninitialised: zeroing them per call showed in profiles).
        let mut wq_buf = [std::mem::MaybeUninit::<__m512i>::uninit(); MAX_BLOCKS / 2];
        let mut wm_buf = [std::mem::MaybeUninit::<u64>::uninit(); MAX_BLOCKS / 2];
        let mut dx_buf = [std::mem::MaybeUninit::<f32>::uninit(); MAX_BLOCKS];
        let mut mx_buf = [std::mem::MaybeUninit::<f32>::uninit(); MAX_BLOCKS];
        let mut dprod_buf = [[std::mem::MaybeUninit::<f32>::uninit(); MAX_BLOCKS]; MULTI];
        let (wq, wm) = (wq_buf.as_mut_ptr() as *mut __m512i, wm_buf.as_mut_ptr() as *mut u64);
        let (dx, mx) = (dx_buf.as_mut_ptr() as *mut f32, mx_buf.as_mut_ptr() as *mut f32);
        let dprod: [*mut f32; MULTI] = std::array::from_fn(|r| dprod_buf[r].as_mut_ptr() as *mut f32);
        // The blocks' f16 scale (and Q4_1's min, the next two bytes), 16 blocks per gather: f16 -> f32
        // is exact, so these are the one-row kernel's values. (One block at a time in scalar code, this
        // was about a fifth of the kernel's time in a decode step of 8 sequences.)
        let lane_offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32($xbytes as i32));
        for k in (0..nb).step_by(16) {
            let lanes: __mmask16 = if nb - k >= 16 { 0xFFFF } else { (1u16 << (nb - k)) - 1 };
            let offsets = _mm512_add_epi32(lane_offsets, _mm512_set1_epi32((k * $xbytes) as i32));
            let dm = _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), lanes, offsets, x as *const _);
            _mm512_mask_storeu_ps(dx.add(k), lanes, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
            if $has_min {
                _mm512_mask_storeu_ps(mx.add(k), lanes, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dm))));
            }
        }
        for pi in 0..n_pairs {
            let $x0 = x.add(2 * pi * $xbytes);
            let $x1 = if 2 * pi + 1 < nb { $x0.add($xbytes) } else { $x0 };
            let (q, m): (__m512i, u64) = $prep;
            _mm512_storeu_si512(wq.add(pi) as *mut _, q);
            wm.add(pi).write(m);
        }
        let n_tok = n_groups * MULTI;
        if $has_min {
            // Σ_k m_x[k]·s_t[k] per token, in block order, 16 tokens per vector (`s_t` is `[nb][n_tok]`):
            // each lane is one token's FMA chain, so the chains overlap. Parked in `out` until the end.
            // The chain stays in a register across blocks: a masked store reloaded by the next block's
            // masked load cannot be store-forwarded, and that stall was half of a 4-token decode step.
            for t in (0..n_tok).step_by(16) {
                let lanes: __mmask16 = if n_tok - t >= 16 { 0xFFFF } else { (1u16 << (n_tok - t)) - 1 };
                let mut acc = _mm512_setzero_ps();
                for k in 0..nb {
                    let sv = _mm512_maskz_loadu_ps(lanes, s_t.add(k * n_tok + t));
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(mx.add(k).read()), sv, acc);
                }
                _mm512_mask_storeu_ps(out.add(t), lanes, acc);
            }
        }
        for g in 0..n_groups {
            let y: [*const u8; MULTI] = std::array::from_fn(|r| y0.add((g * MULTI + r) * stride));
            // dx·dy, 16 blocks a vector.
            for r in 0..MULTI {
                let dy = y[r].add(n) as *const f32;
                for k in (0..nb).step_by(16) {
                    let m: __mmask16 = if nb - k >= 16 { 0xFFFF } else { (1u16 << (nb - k)) - 1 };
                    let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, dx.add(k)), _mm512_maskz_loadu_ps(m, dy.add(k)));
                    _mm512_mask_storeu_ps(dprod[r].add(k), m, v);
                }
            }
            let mut acc = [_mm256_setzero_ps(); MULTI];
            for pi in 0..n_pairs {
                let i = 2 * pi;
                let pair = i + 1 < nb;
                let $wq = _mm512_loadu_si512(wq.add(pi) as *const _);
                let $wm = wm.add(pi).read();
                for r in 0..MULTI {
                    let $qy = if pair {
                        _mm512_loadu_si512(y[r].add(i * QK) as *const _)
                    } else {
                        _mm512_zextsi256_si512(load256(y[r].add(i * QK)))
                    };
                    let p = _mm512_cvtepi32_ps($dot);
                    acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&*dprod[r].add(i)), _mm512_castps512_ps256(p), acc[r]);
                    if pair {
                        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(&*dprod[r].add(i + 1)), high_ps(p), acc[r]);
                    }
                }
            }
            for r in 0..MULTI {
                let v = if $has_min { hsum_ps(acc[r]) + out.add(g * MULTI + r).read() } else { hsum_ps(acc[r]) };
                out.add(g * MULTI + r).write(v);
            }
        }
    }};
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_impl(n: usize, x: *const u8, y0: *const u8, stride: usize, n_groups: usize, s_t: *const f32, out: *mut f32) {
    let zero = _mm512_setzero_si512();
    multi_tokens!(n, x, y0, stride, n_groups, s_t, out, Q8_0_BYTES, false, |x0, x1| {
        let qx = load_pair(x0.add(2), x1.add(2));
        (_mm512_abs_epi8(qx), _mm512_movepi8_mask(qx))
    }, |ax, sign, qy| {
        // |x| as u8 times y with x's sign, as the one-row kernel
        let sy = _mm512_mask_sub_epi8(qy, sign, zero, qy);
        _mm512_dpbusd_epi32(zero, ax, sy)
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_0_impl(n: usize, x: *const u8, y0: *const u8, stride: usize, n_groups: usize, s_t: *const f32, out: *mut f32) {
    let zero = _mm512_setzero_si512();
    let eight = _mm512_set1_epi8(8);
    multi_tokens!(n, x, y0, stride, n_groups, s_t, out, Q4_0_BYTES, false, |x0, x1| {
        (nibbles_pair(x0.add(2), x1.add(2)), 0)
    }, |q, _m, qy| {
        _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, q, qy), _mm512_dpbusd_epi32(zero, eight, qy))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_0_impl(n: usize, x: *const u8, y0: *const u8, stride: usize, n_groups: usize, s_t: *const f32, out: *mut f32) {
    let zero = _mm512_setzero_si512();
    let sixteen = _mm512_set1_epi8(16);
    multi_tokens!(n, x, y0, stride, n_groups, s_t, out, Q5_0_BYTES, false, |x0, x1| {
        let qh0 = (x0.add(2) as *const u32).read_unaligned() as u64;
        let qh1 = (x1.add(2) as *const u32).read_unaligned() as u64;
        let nib = nibbles_pair(x0.add(6), x1.add(6));
        (_mm512_mask_add_epi8(nib, qh0 | (qh1 << 32), nib, sixteen), 0)
    }, |q, _m, qy| {
        _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, q, qy), _mm512_dpbusd_epi32(zero, sixteen, qy))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_1_impl(n: usize, x: *const u8, y0: *const u8, stride: usize, n_groups: usize, s_t: *const f32, out: *mut f32) {
    let zero = _mm512_setzero_si512();
    multi_tokens!(n, x, y0, stride, n_groups, s_t, out, Q4_1_BYTES, true, |x0, x1| {
        (nibbles_pair(x0.add(4), x1.add(4)), 0)
    }, |q, _m, qy| _mm512_dpbusd_epi32(zero, q, qy))
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

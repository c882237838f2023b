//! AVX-512 kernels for decode batches (2-16 tokens): a tile of `MULTI` weight rows × up to `MULTI`
//! activation rows per call, every partial sum in registers.
//!
//! The multi-token kernels (`dot_avx512_multi`) stage a weight row's unpacked quants and scales on the
//! stack and pay that per row; over a handful of tokens the staging costs as much as the dots (measured:
//! `examples/matmul_bench.rs`). Here each block pair is unpacked once per weight row and used at once
//! for every token of the tile, and each activation pair is loaded once for every row.
//!
//! Every result is computed by the one-row kernel's instruction sequence (`dot_avx512`: the same i32 lanes,
//! the same 8-lane f32 accumulator block after block, the same `d_x·d_y` products, Q4_1's `m·s` chain in
//! block order, the same final sum), so it is bit-identical to it, whatever the batch.

use std::arch::x86_64::*;

use super::blocks::*;
use super::dot_avx512::{high_ps, load_pair, nibbles_pair, PREFETCH_AHEAD};
use super::dot_avx512_multi::MAX_BLOCKS;
use super::x86_util::*;
use super::{expanded_act_row_bytes, GgmlType, SimdLevel, TileDotFn, MULTI};

/// The tile kernel for weight type `t`, if there is one.
pub(super) fn kernel(t: GgmlType) -> Option<TileDotFn> {
    assert!(SimdLevel::Avx512.is_available());
    Some(match t {
        GgmlType::Q4_0 => q4_0_tile,
        GgmlType::Q4_1 => q4_1_tile,
        GgmlType::Q5_0 => q5_0_tile,
        GgmlType::Q8_0 => q8_0_tile,
        _ => return None,
    })
}

macro_rules! safe_tiles {
    ($($name:ident => $t:ident, $imp:ident;)*) => {$(
        #[allow(clippy::too_many_arguments)]
        fn $name(n: usize, w: &[u8], w_stride: usize, a: &[u8], a_stride: usize, s: &[f32], s_stride: usize, n_tok: usize, out: &mut [f32; MULTI * MULTI]) {
            let wb = GgmlType::$t.row_bytes(n).expect("n is a multiple of the block length");
            let nb = n / QK;
            assert!(nb <= MAX_BLOCKS, "tile dot {}: rows of {n} are too long", GgmlType::$t);
            assert!(w_stride >= wb && w.len() >= (MULTI - 1) * w_stride + wb, "tile dot {}: weight rows too short", GgmlType::$t);
            assert!((1..=MULTI).contains(&n_tok), "tile dot: {n_tok} tokens");
            let need = expanded_act_row_bytes(n);
            assert!(a_stride >= need && a.len() >= (n_tok - 1) * a_stride + need, "tile dot {}: activation rows too short", GgmlType::$t);
            let with_min = GgmlType::$t.dot_activation_type() == GgmlType::Q8_1;
            assert!(!with_min || (s_stride >= n_tok && s.len() >= (nb - 1) * s_stride + n_tok), "tile dot {}: s_by_block too short", GgmlType::$t);
            // SAFETY: handed out only when AVX-512 F/BW/VL/VNNI (and AVX2, FMA, F16C) are present; the
            // weight rows, activation rows and sums were checked to be long enough above.
            unsafe {
                match n_tok {
                    1 => $imp::<1>(n, w.as_ptr(), w_stride, a.as_ptr(), a_stride, s.as_ptr(), s_stride, out),
                    2 => $imp::<2>(n, w.as_ptr(), w_stride, a.as_ptr(), a_stride, s.as_ptr(), s_stride, out),
                    3 => $imp::<3>(n, w.as_ptr(), w_stride, a.as_ptr(), a_stride, s.as_ptr(), s_stride, out),
                    _ => $imp::<4>(n, w.as_ptr(), w_stride, a.as_ptr(), a_stride, s.as_ptr(), s_stride, out),
                }
            }
        }
    )*};
}

safe_tiles! {
    q4_0_tile => Q4_0, q4_0_impl;
    q4_1_tile => Q4_1, q4_1_impl;
    q5_0_tile => Q5_0, q5_0_impl;
    q8_0_tile => Q8_0, q8_0_impl;
}

/// The tile loop. Per weight row: the block scales (and Q4_1's mins) as f32, one gather per 16 blocks.
/// Per block pair: each token's activation quants (one load); per row, the unpacked quants (`$prep`:
/// (x0, x1) -> (u8 quants, 64-bit mask)) and Q4_1's `m·s` for every token (one lane each), then per
/// token `$dot` (quants, mask, activation quants -> i32 lanes) scaled by `d_x·d_y` into that (row,
/// token)'s 8-lane accumulator, as the one-row kernel does.
macro_rules! tile_loop {
    ($T:expr, $n:expr, $x:expr, $xs:expr, $y:expr, $ys:expr, $s:expr, $ss:expr, $out:expr, $xbytes:expr, $has_min:expr,
     |$x0:ident, $x1:ident| $prep:expr, |$wq:ident, $wm:ident, $qy:ident| $dot:expr) => {{
        let (n, x, xs, y, ys, s, ss, out): (usize, *const u8, usize, *const u8, usize, *const f32, usize, &mut [f32; MULTI * MULTI]) =
            ($n, $x, $xs, $y, $ys, $s, $ss, $out);
        let nb = n / QK;
        let n_pairs = nb.div_ceil(2);
        // Row scales; one element past the last block is written (zero) because an odd last block's pair
        // reads it (its product is not used).
        let mut dx = [[std::mem::MaybeUninit::<f32>::uninit(); MAX_BLOCKS + 1]; MULTI];
        let mut mx = [[std::mem::MaybeUninit::<f32>::uninit(); MAX_BLOCKS + 1]; MULTI];
        let lane_offsets = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32($xbytes as i32));
        for r in 0..MULTI {
            let (xr, dxr, mxr) = (x.add(r * xs), dx[r].as_mut_ptr() as *mut f32, mx[r].as_mut_ptr() as *mut f32);
            for k in (0..nb).step_by(16) {
                let lanes: __mmask16 = if nb - k >= 16 { 0xFFFF } else { (1u16 << (nb - k)) - 1 };
                let offsets = _mm512_add_epi32(lane_offsets, _mm512_set1_epi32((k * $xbytes) as i32));
                let dm = _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), lanes, offsets, xr as *const _);
                _mm512_mask_storeu_ps(dxr.add(k), lanes, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)));
                if $has_min {
                    _mm512_mask_storeu_ps(mxr.add(k), lanes, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dm))));
                }
            }
            dxr.add(nb).write(0.0);
            mxr.add(nb).write(0.0);
        }
        // d_x·d_y for every (row, token, block), 16 blocks per multiply, stored whole (padded) so the pair
        // loop reads each as a broadcast from memory: a load-port operation, where broadcasting a product
        // held in a register would take the shuffle port the extracts need.
        let mut dprod = [[[std::mem::MaybeUninit::<__m512>::uninit(); MAX_BLOCKS / 16 + 1]; $T]; MULTI];
        for k in (0..nb).step_by(16) {
            let lanes: __mmask16 = if nb - k >= 16 { 0xFFFF } else { (1u16 << (nb - k)) - 1 };
            for t in 0..$T {
                let dy = _mm512_maskz_loadu_ps(lanes, (y.add(t * ys + n) as *const f32).add(k));
                for r in 0..MULTI {
                    let dxv = _mm512_maskz_loadu_ps(lanes, (dx[r].as_ptr() as *const f32).add(k));
                    dprod[r][t][k / 16].write(_mm512_mul_ps(dxv, dy));
                }
            }
        }
        let t_lanes: __mmask8 = (1u8 << $T) - 1;
        let mut acc = [[_mm256_setzero_ps(); $T]; MULTI];
        let mut msum = [_mm_setzero_ps(); MULTI];
        for pi in 0..n_pairs {
            let i = 2 * pi;
            let pair = i + 1 < nb;
            // (Plain loops, no closures: a closure that is not inlined loses this function's AVX-512.)
            let mut qys = [_mm512_setzero_si512(); $T];
            for t in 0..$T {
                let yt = y.add(t * ys + i * QK);
                qys[t] = if pair { _mm512_loadu_si512(yt as *const _) } else { _mm512_zextsi256_si512(load256(yt)) };
            }
            let (s0, s1) = if $has_min {
                (_mm_maskz_loadu_ps(t_lanes, s.add(i * ss)), if pair { _mm_maskz_loadu_ps(t_lanes, s.add((i + 1) * ss)) } else { _mm_setzero_ps() })
            } else {
                (_mm_setzero_ps(), _mm_setzero_ps())
            };
            for r in 0..MULTI {
                let $x0 = x.add(r * xs + i * $xbytes);
                let $x1 = if pair { $x0.add($xbytes) } else { $x0 };
                _mm_prefetch::<_MM_HINT_T0>($x0.add(PREFETCH_AHEAD) as *const i8);
                let ($wq, $wm): (__m512i, u64) = $prep;
                if $has_min {
                    let mxr = mx[r].as_ptr() as *const f32;
                    msum[r] = _mm_fmadd_ps(_mm_set1_ps(mxr.add(i).read()), s0, msum[r]);
                    if pair {
                        msum[r] = _mm_fmadd_ps(_mm_set1_ps(mxr.add(i + 1).read()), s1, msum[r]);
                    }
                }
                for t in 0..$T {
                    let $qy = qys[t];
                    let p = _mm512_cvtepi32_ps($dot);
                    let d = dprod[r][t].as_ptr() as *const f32;
                    acc[r][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&*d.add(i)), _mm512_castps512_ps256(p), acc[r][t]);
                    if pair {
                        acc[r][t] = _mm256_fmadd_ps(_mm256_broadcast_ss(&*d.add(i + 1)), high_ps(p), acc[r][t]);
                    }
                }
            }
        }
        for r in 0..MULTI {
            let mut m = [0.0f32; 4];
            _mm_storeu_ps(m.as_mut_ptr(), msum[r]);
            for t in 0..$T {
                // No `+ 0.0` without mins: it would turn a -0.0 sum into +0.0, unlike the one-row kernel.
                out[r * MULTI + t] = if $has_min { hsum_ps(acc[r][t]) + m[t] } else { hsum_ps(acc[r][t]) };
            }
        }
    }};
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_impl<const T: usize>(n: usize, x: *const u8, xs: usize, y: *const u8, ys: usize, s: *const f32, ss: usize, out: &mut [f32; MULTI * MULTI]) {
    let zero = _mm512_setzero_si512();
    tile_loop!(T, n, x, xs, y, ys, s, ss, out, Q8_0_BYTES, false, |x0, x1| {
        let qx = load_pair(x0.add(2), x1.add(2));
        (_mm512_abs_epi8(qx), _mm512_movepi8_mask(qx))
    }, |ax, sign, qy| {
        // |x| as u8 times y with x's sign, as the one-row kernel
        let sy = _mm512_mask_sub_epi8(qy, sign, zero, qy);
        _mm512_dpbusd_epi32(zero, ax, sy)
    })
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_0_impl<const T: usize>(n: usize, x: *const u8, xs: usize, y: *const u8, ys: usize, s: *const f32, ss: usize, out: &mut [f32; MULTI * MULTI]) {
    let zero = _mm512_setzero_si512();
    let eight = _mm512_set1_epi8(8);
    tile_loop!(T, n, x, xs, y, ys, s, ss, out, Q4_0_BYTES, false, |x0, x1| {
        (nibbles_pair(x0.add(2), x1.add(2)), 0)
    }, |q, _m, qy| {
        _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, q, qy), _mm512_dpbusd_epi32(zero, eight, qy))
    })
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_0_impl<const T: usize>(n: usize, x: *const u8, xs: usize, y: *const u8, ys: usize, s: *const f32, ss: usize, out: &mut [f32; MULTI * MULTI]) {
    let zero = _mm512_setzero_si512();
    let sixteen = _mm512_set1_epi8(16);
    tile_loop!(T, n, x, xs, y, ys, s, ss, out, Q5_0_BYTES, false, |x0, x1| {
        let qh0 = (x0.add(2) as *const u32).read_unaligned() as u64;
        let qh1 = (x1.add(2) as *const u32).read_unaligned() as u64;
        let nib = nibbles_pair(x0.add(6), x1.add(6));
        (_mm512_mask_add_epi8(nib, qh0 | (qh1 << 32), nib, sixteen), 0)
    }, |q, _m, qy| {
        _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, q, qy), _mm512_dpbusd_epi32(zero, sixteen, qy))
    })
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_1_impl<const T: usize>(n: usize, x: *const u8, xs: usize, y: *const u8, ys: usize, s: *const f32, ss: usize, out: &mut [f32; MULTI * MULTI]) {
    let zero = _mm512_setzero_si512();
    tile_loop!(T, n, x, xs, y, ys, s, ss, out, Q4_1_BYTES, true, |x0, x1| {
        (nibbles_pair(x0.add(4), x1.add(4)), 0)
    }, |q, _m, qy| _mm512_dpbusd_epi32(zero, q, qy))
}

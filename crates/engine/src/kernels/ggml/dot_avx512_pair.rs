//! AVX-512 kernels for batches of 2+ tokens (decode batches and prefill): `MULTI` weight rows × up to
//! `PAIRS_PER_CALL` token pairs per call, two tokens per 512-bit register.
//!
//! ggml's f32 work per (row, token) is one 8-lane accumulator fed block after block by
//! `fma(d_x·d_y, lanes, acc)`. A one-token kernel holds two blocks per register and must split them
//! (extract the high half, two 256-bit FMAs) to keep that chain. Here the halves of a register are two
//! tokens at the same block instead: the weight block is unpacked once into both halves, one `vpdpbusd`
//! makes both tokens' i32 lanes, and one 512-bit multiply, conversion and FMA carry both chains on.
//! Per (row, token pair, block) that is 4 vector operations where the per-token tile took 5 per
//! (row, token, two blocks), i.e. 2 per token-block instead of 2.5, with no shuffle.
//!
//! Activations are rewritten once per matmul into the pair layout (`PairActs`): per pair and block, the
//! two tokens' quants side by side (one 64-byte load), `[d_y0 ×8 | d_y1 ×8]`, and for the offset
//! formats the offset times each lane's activation sum, so that the kernel's i32 lanes are the one-row
//! kernel's exactly. Every result is bit-identical to `dot_avx512`'s one-row kernel (tested).

use std::arch::x86_64::*;

use super::blocks::*;
use super::dot_avx512::PREFETCH_AHEAD;
use super::dot_avx512_multi::MAX_BLOCKS;
use super::x86_util::*;
use super::pair_acts::lines_per_pair;
use super::{GgmlType, PairActs, PairDotFn, SimdLevel, MULTI, PAIRS_PER_CALL};

/// The pair kernel for weight type `t`, if there is one.
pub(super) fn kernel(t: GgmlType) -> Option<PairDotFn> {
    assert!(SimdLevel::Avx512.is_available());
    Some(match t {
        GgmlType::Q4_0 => q4_0_pairs,
        GgmlType::Q4_1 => q4_1_pairs,
        GgmlType::Q5_0 => q5_0_pairs,
        GgmlType::Q8_0 => q8_0_pairs,
        _ => return None,
    })
}

macro_rules! safe_pairs {
    ($($name:ident => $t:ident, $imp:ident;)*) => {$(
        fn $name(n: usize, w: &[u8], w_stride: usize, acts: &PairActs, first_pair: usize, n_pairs: usize, out: &mut [f32; MULTI * 2 * PAIRS_PER_CALL]) {
            let wb = GgmlType::$t.row_bytes(n).expect("n is a multiple of the block length");
            let nb = n / QK;
            assert!(nb <= MAX_BLOCKS, "pair dot {}: rows of {n} are too long", GgmlType::$t);
            assert!(w_stride >= wb && w.len() >= (MULTI - 1) * w_stride + wb, "pair dot {}: weight rows too short", GgmlType::$t);
            assert!((1..=PAIRS_PER_CALL).contains(&n_pairs) && first_pair % PAIRS_PER_CALL == 0, "pair dot: pairs {first_pair}+{n_pairs}");
            let per_pair = lines_per_pair(GgmlType::$t, n);
            assert!(acts.lines_per_pair == per_pair && acts.lines.len() >= (first_pair + n_pairs) * per_pair, "pair dot {}: activations of another layout", GgmlType::$t);
            let with_sums = GgmlType::$t == GgmlType::Q4_1;
            let group = first_pair / PAIRS_PER_CALL;
            assert!(!with_sums || acts.sums.len() >= (group + 1) * nb * 2 * PAIRS_PER_CALL, "pair dot: block sums too short");
            let y = acts.lines[first_pair * per_pair..].as_ptr() as *const u8;
            let s = if with_sums { acts.sums[group * nb * 2 * PAIRS_PER_CALL..].as_ptr() } else { std::ptr::null() };
            // SAFETY: handed out only when AVX-512 F/BW/VL/VNNI (and AVX2, FMA, F16C) are present; the
            // weight rows, the pairs' lines and the sums were checked to be long enough above.
            unsafe {
                match n_pairs {
                    1 => $imp::<1>(n, w.as_ptr(), w_stride, y, per_pair * 64, s, out),
                    2 => $imp::<2>(n, w.as_ptr(), w_stride, y, per_pair * 64, s, out),
                    3 => $imp::<3>(n, w.as_ptr(), w_stride, y, per_pair * 64, s, out),
                    _ => $imp::<4>(n, w.as_ptr(), w_stride, y, per_pair * 64, s, out),
                }
            }
        }
    )*};
}

safe_pairs! {
    q4_0_pairs => Q4_0, q4_0_impl;
    q4_1_pairs => Q4_1, q4_1_impl;
    q5_0_pairs => Q5_0, q5_0_impl;
    q8_0_pairs => Q8_0, q8_0_impl;
}

/// The pair loop, block by block: per row, `$prep` unpacks the weight block into both halves of a
/// register (and may compute a per-row term); per pair, `$dot` (weights, row term, the pair's
/// quants line, its offset line) makes both tokens' i32 lanes, which are scaled by `d_x·d_y` into that
/// (row, pair)'s accumulator. Q4_1's `m·s` terms run for all 8 tokens in one 256-bit chain per row.
macro_rules! pair_loop {
    ($P:expr, $n:expr, $x:expr, $xs:expr, $y:expr, $ys:expr, $s:expr, $out:expr, $xbytes:expr, $has_min:expr,
     |$xb:ident| $prep:expr, |$w:ident, $wt:ident, $qy:ident, $oy:ident| $dot:expr) => {{
        let (n, x, xs, y, ys, s, out): (usize, *const u8, usize, *const u8, usize, *const f32, &mut [f32; MULTI * 2 * PAIRS_PER_CALL]) =
            ($n, $x, $xs, $y, $ys, $s, $out);
        let nb = n / QK;
        // Row scales (and Q4_1's mins) as f32, one gather per 16 blocks.
        let mut dx = [[std::mem::MaybeUninit::<f32>::uninit(); MAX_BLOCKS]; MULTI];
        let mut mx = [[std::mem::MaybeUninit::<f32>::uninit(); MAX_BLOCKS]; MULTI];
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
        }
        let mut acc = [[_mm512_setzero_ps(); $P]; MULTI];
        let mut msum = [_mm256_setzero_ps(); MULTI];
        for b in 0..nb {
            let sv = if $has_min { _mm256_loadu_ps(s.add(b * 2 * PAIRS_PER_CALL)) } else { _mm256_setzero_ps() };
            // (Plain loops, no closures: a closure that is not inlined loses this function's AVX-512.)
            for r in 0..MULTI {
                let $xb = x.add(r * xs + b * $xbytes);
                _mm_prefetch::<_MM_HINT_T0>($xb.wrapping_add(PREFETCH_AHEAD) as *const i8);
                let ($w, $wt): (__m512i, __m512i) = $prep;
                let dxv = _mm512_set1_ps((dx[r].as_ptr() as *const f32).add(b).read());
                if $has_min {
                    let m = _mm256_set1_ps((mx[r].as_ptr() as *const f32).add(b).read());
                    msum[r] = _mm256_fmadd_ps(m, sv, msum[r]);
                }
                for p in 0..$P {
                    let yp = y.add(p * ys);
                    let $qy = yp.add(b * 64);
                    // (wrapping: the Q4_1 and Q8_0 layouts have no offset lines, and this pointer is unused there)
                    let $oy = yp.wrapping_add((2 * nb + b) * 64);
                    let lanes: __m512i = $dot;
                    let d = _mm512_mul_ps(dxv, _mm512_load_ps(yp.add((nb + b) * 64) as *const f32));
                    acc[r][p] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(lanes), acc[r][p]);
                }
            }
        }
        let mut all = [_mm512_setzero_ps(); MULTI * PAIRS_PER_CALL];
        for r in 0..MULTI {
            for p in 0..$P {
                all[r * PAIRS_PER_CALL + p] = acc[r][p];
            }
        }
        let sums = hsum_halves(&all);
        for (m, sum) in sums.iter().enumerate() {
            // No `+ 0.0` without mins: it would turn a -0.0 sum into +0.0, unlike the one-row kernel.
            let v = if $has_min { _mm512_add_ps(*sum, _mm512_insertf32x8::<1>(_mm512_castps256_ps512(msum[2 * m]), msum[2 * m + 1])) } else { *sum };
            _mm512_storeu_ps(out.as_mut_ptr().add(16 * m), v);
        }
    }};
}

/// `hsum_ps` (ggml's `hsum_float_8`: `(x0+x4 + x2+x6) + (x1+x5 + x3+x7)`) of both 8-lane halves of
/// 16 accumulators at once, `acc[4r + p]` = (row r, pair p): result `m` lane `j` is the sum of (row
/// `2m + j / 8`, token `j % 8`), i.e. `out[16m + j]`. The same additions as 32 `hsum_ps` calls, by a
/// transpose network: ~45 vector operations instead of ~200 (at 576 columns the per-call sums were a
/// seventh of the kernel).
#[inline(always)]
unsafe fn hsum_halves(acc: &[__m512; 16]) -> [__m512; 2] {
    // quarters (4 lanes) of S_i: [A_2i.h0, A_2i.h1, A_2i+1.h0, A_2i+1.h1], lanes x_k + x_k+4
    let s: [__m512; 8] = std::array::from_fn(|i| {
        let (a, b) = (acc[2 * i], acc[2 * i + 1]);
        _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(a, b), _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b))
    });
    // per quarter of W_j: [S_2j (l0+l2), S_2j (l1+l3), S_2j+1 (l0+l2), S_2j+1 (l1+l3)]
    let w: [__m512; 4] = std::array::from_fn(|j| {
        let (a, b) = (s[2 * j], s[2 * j + 1]);
        _mm512_add_ps(_mm512_shuffle_ps::<0b01_00_01_00>(a, b), _mm512_shuffle_ps::<0b11_10_11_10>(a, b))
    });
    // F_m lane 4q + e = S_4m+e quarter q's sum = out[16m + 4e + q]; transposed to out order
    let idx = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    std::array::from_fn(|m| {
        let (a, b) = (w[2 * m], w[2 * m + 1]);
        let f = _mm512_add_ps(_mm512_shuffle_ps::<0b10_00_10_00>(a, b), _mm512_shuffle_ps::<0b11_01_11_01>(a, b));
        _mm512_permutexvar_ps(idx, f)
    })
}

/// The 32 nibbles of a legacy block (16 qs bytes at `p`) in element order, in both halves:
/// 128-bit lanes [low, high, low, high].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn nibbles_twice(p: *const u8) -> __m512i {
    let v = _mm512_broadcast_i32x4(load128(p));
    let v = _mm512_mask_srli_epi16(v, 0xFF00_FF00, v, 4); // the odd 128-bit lanes
    _mm512_and_si512(v, _mm512_set1_epi8(0x0F))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_impl<const P: usize>(n: usize, x: *const u8, xs: usize, y: *const u8, ys: usize, s: *const f32, out: &mut [f32; MULTI * 2 * PAIRS_PER_CALL]) {
    let zero = _mm512_setzero_si512();
    let bias = _mm512_set1_epi8(-128);
    pair_loop!(P, n, x, xs, y, ys, s, out, Q8_0_BYTES, false, |xb| {
        // x (i8) in both halves, and -128·(each lane's 4 weights): the activations come as y + 128
        // (u8), so the lanes are Σ (y + 128)·x - 128·Σ x = Σ x·y, the one-row kernel's integers.
        let qx = _mm512_broadcast_i64x4(load256(xb.add(2)));
        (qx, _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, bias, qx)))
    }, |qx, corr, qy, _oy| {
        _mm512_dpbusd_epi32(corr, _mm512_load_si512(qy as *const _), qx)
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_0_impl<const P: usize>(n: usize, x: *const u8, xs: usize, y: *const u8, ys: usize, s: *const f32, out: &mut [f32; MULTI * 2 * PAIRS_PER_CALL]) {
    let zero = _mm512_setzero_si512();
    pair_loop!(P, n, x, xs, y, ys, s, out, Q4_0_BYTES, false, |xb| (nibbles_twice(xb.add(2)), zero), |q, _z, qy, oy| {
        // Σ (q - 8)·y = Σ q·y - 8·Σ y, the last term precomputed per lane
        _mm512_dpbusd_epi32(_mm512_load_si512(oy as *const _), q, _mm512_load_si512(qy as *const _))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q5_0_impl<const P: usize>(n: usize, x: *const u8, xs: usize, y: *const u8, ys: usize, s: *const f32, out: &mut [f32; MULTI * 2 * PAIRS_PER_CALL]) {
    let zero = _mm512_setzero_si512();
    let sixteen = _mm512_set1_epi8(16);
    pair_loop!(P, n, x, xs, y, ys, s, out, Q5_0_BYTES, false, |xb| {
        // bit e of qh is the 5th bit of element e, in both halves
        let qh = (xb.add(2) as *const u32).read_unaligned() as u64;
        let nib = nibbles_twice(xb.add(6));
        (_mm512_mask_add_epi8(nib, qh | (qh << 32), nib, sixteen), zero)
    }, |q, _z, qy, oy| {
        _mm512_dpbusd_epi32(_mm512_load_si512(oy as *const _), q, _mm512_load_si512(qy as *const _))
    })
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn q4_1_impl<const P: usize>(n: usize, x: *const u8, xs: usize, y: *const u8, ys: usize, s: *const f32, out: &mut [f32; MULTI * 2 * PAIRS_PER_CALL]) {
    let zero = _mm512_setzero_si512();
    pair_loop!(P, n, x, xs, y, ys, s, out, Q4_1_BYTES, true, |xb| (nibbles_twice(xb.add(4)), zero), |q, _z, qy, _oy| {
        _mm512_dpbusd_epi32(zero, q, _mm512_load_si512(qy as *const _))
    })
}

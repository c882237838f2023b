//! The two hot loops of `tiled` (a tile's scores, its per-lane value sums) for CPUs with AVX2 but not
//! AVX-512, on 8-lane registers with the same numerics: each score is the 16-lane ggml dot of
//! `ggml_math::avx2` (four accumulators as `(lo, hi)` pairs, the same reduction tree), each lane's value
//! sum the same FMA chain. The orchestration (tiles, softmax rows, split phases) is `tiled`'s.

use super::tiled::{TileGeom, PREFETCH_CELLS, SCORE_PREFETCH_CHUNKS};
use crate::kernels::ggml::math::avx2::{key_sum_f32, reduce_8_rows};
use half::f16;
use std::arch::x86_64::*;
use std::ops::Range;

/// Rows whose value sums are held in registers at once (× 4 vectors of 8 values: 12 of the 16 registers).
const ROWS_PER_PASS: usize = 3;
/// Value vectors (8 values each) per pass over a lane's cells.
const VECS_PER_PASS: usize = 4;

/// `tiled::chunk_scores` on AVX2: each chunk's 16 keys converted to f32 once into `kbuf`, then every
/// row's 16 dots, 8 keys per reduction network.
///
/// # Safety
/// AVX2, FMA and F16C; `offsets` holds `g.n_keys` rows of `hd` values inside `keys`; `scores` has
/// `[g.rows, g.n_pad]` floats and `q32` `[g.rows, hd]`.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn chunk_scores(keys: &[f16], hd: usize, g: &TileGeom, offsets: &[usize], q32: &[f32], chunks: Range<usize>, kbuf: &mut Vec<f32>, scores: *mut f32) {
    debug_assert!(hd % 64 == 0);
    kbuf.resize(16 * hd, 0.0);
    for c0 in chunks.map(|c| 16 * c) {
        // keys SCORE_PREFETCH_CHUNKS chunks ahead (see `tiled::chunk_scores_nv`)
        for &off in offsets.iter().skip(c0 + 16 * SCORE_PREFETCH_CHUNKS).take(16) {
            for line in (0..hd * 2).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>((keys.as_ptr().add(off) as *const i8).add(line));
            }
        }
        for c in 0..16 {
            let dst = kbuf.as_mut_ptr().add(c * hd);
            if c0 + c < g.n_keys {
                let src = keys.as_ptr().add(offsets[c0 + c]);
                for k in (0..hd).step_by(8) {
                    _mm256_storeu_ps(dst.add(k), _mm256_cvtph_ps(_mm_loadu_si128(src.add(k) as *const __m128i)));
                }
            } else {
                std::ptr::write_bytes(dst, 0, hd);
            }
        }
        for r in 0..g.rows {
            let q = q32.as_ptr().add(r * hd);
            if hd == 64 {
                // q in registers for the chunk's 16 keys (the general loop reloads it for every key)
                let qv: [__m256; 8] = std::array::from_fn(|k| _mm256_loadu_ps(q.add(8 * k)));
                for eight in 0..2 {
                    let mut t3 = [_mm256_setzero_ps(); 8];
                    for (k, t) in t3.iter_mut().enumerate() {
                        *t = key_sum64(kbuf.as_ptr().add((8 * eight + k) * 64), &qv);
                    }
                    _mm256_storeu_ps(scores.add(r * g.n_pad + c0 + 8 * eight), reduce_8_rows(&t3));
                }
                continue;
            }
            for eight in 0..2 {
                let mut t3 = [_mm256_setzero_ps(); 8];
                for (k, t) in t3.iter_mut().enumerate() {
                    *t = key_sum_f32(kbuf.as_ptr().add((8 * eight + k) * hd), q, hd);
                }
                _mm256_storeu_ps(scores.add(r * g.n_pad + c0 + 8 * eight), reduce_8_rows(&t3));
            }
        }
    }
}

/// `key_sum_f32` for head size 64 with q in registers: the same sums, `(a0 + a4) + (a2 + a6)` and
/// `(a1 + a5) + (a3 + a7)` of the products a_j = k_j·q_j. Products of f16 values (q is rounded to f16) are
/// exact in f32, so `fma(k4, q4, a0)` rounds `a0 + a4` as the addition does (and `a0 = fma(k0, q0, +0)`,
/// as there, is never -0): 8 FMAs and 3 adds instead of 8 FMAs and 6 adds.
#[inline(always)]
unsafe fn key_sum64(k: *const f32, q: &[__m256; 8]) -> __m256 {
    let a = |j: usize| _mm256_loadu_ps(k.add(8 * j));
    let zero = _mm256_setzero_ps();
    let a04 = _mm256_fmadd_ps(a(4), q[4], _mm256_fmadd_ps(a(0), q[0], zero));
    let a26 = _mm256_fmadd_ps(a(6), q[6], _mm256_fmadd_ps(a(2), q[2], zero));
    let a15 = _mm256_fmadd_ps(a(5), q[5], _mm256_fmadd_ps(a(1), q[1], zero));
    let a37 = _mm256_fmadd_ps(a(7), q[7], _mm256_fmadd_ps(a(3), q[3], zero));
    _mm256_add_ps(_mm256_add_ps(a15, a37), _mm256_add_ps(a04, a26))
}

/// `tiled::lane_sums` on AVX2: `rs` rows (probabilities at `w`, row stride `g.n_pad`), lanes `lanes`, into
/// `dst` (`[rs, 64, hd]`), `ROWS_PER_PASS` rows at a time.
///
/// # Safety
/// As `chunk_scores`, for `values`; `w` has `rs` rows of `g.n_pad` and `dst` `[rs, 64, hd]` floats.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn lane_sums(values: &[f16], hd: usize, g: &TileGeom, offsets: &[usize], w: *const f32, rs: usize, lanes: Range<usize>, dst: *mut f32) {
    for r0 in (0..rs).step_by(ROWS_PER_PASS) {
        let (w, dst) = (w.add(r0 * g.n_pad), dst.add(r0 * 64 * hd));
        let args = (values, hd, g, offsets, w, lanes.clone(), dst);
        match (rs - r0).min(ROWS_PER_PASS) {
            3 => lane_sums_n::<3>(args),
            2 => lane_sums_n::<2>(args),
            _ => lane_sums_n::<1>(args),
        }
    }
}

type LaneArgs<'a> = (&'a [f16], usize, &'a TileGeom, &'a [usize], *const f32, Range<usize>, *mut f32);

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane_sums_n<const RS: usize>((values, hd, g, offsets, w, lanes, dst): LaneArgs) {
    debug_assert!(hd % (8 * VECS_PER_PASS) == 0);
    let short = g.n_keys <= 2 * 64 * PREFETCH_CELLS;
    for lane in lanes {
        let first = (lane + 64 - g.lo0 % 64) % 64;
        for v0 in (0..hd / 8).step_by(VECS_PER_PASS) {
            let mut acc = [[_mm256_setzero_ps(); VECS_PER_PASS]; RS];
            let mut i = first;
            while i < g.n_keys {
                let ahead = if short { i + 1 } else { i + 64 * PREFETCH_CELLS };
                if let Some(&ahead) = offsets.get(ahead) {
                    _mm_prefetch::<_MM_HINT_T0>(values.as_ptr().add(ahead + 8 * v0) as *const i8);
                }
                let pv = values.as_ptr().add(offsets[i] + 8 * v0);
                let mut wv = [_mm256_setzero_ps(); RS];
                for (r, x) in wv.iter_mut().enumerate() {
                    *x = _mm256_set1_ps(*w.add(r * g.n_pad + i));
                }
                for k in 0..VECS_PER_PASS {
                    let v = _mm256_cvtph_ps(_mm_loadu_si128(pv.add(8 * k) as *const __m128i));
                    for r in 0..RS {
                        acc[r][k] = _mm256_fmadd_ps(wv[r], v, acc[r][k]);
                    }
                }
                i += 64;
            }
            for (r, acc_r) in acc.iter().enumerate() {
                let row = dst.add((r * 64 + lane) * hd + 8 * v0);
                for (k, a) in acc_r.iter().enumerate() {
                    _mm256_storeu_ps(row.add(8 * k), *a);
                }
            }
        }
    }
}

//! The value pass of the packed numerics: `out[r] = Σ_j p[r][j] · v_j`, one FMA chain per output value
//! over the tile's cells in position order, from 0.
//!
//! ggml's value pass is a dot of each output dimension with the probabilities in 64 lanes (cell j in
//! lane j mod 64), so an exact copy keeps a `[64, head_dim]` buffer per row and reduces it at the end:
//! at the depths of serving (a few hundred cells) that buffer was written and read more than K and V
//! themselves, and its lane-by-lane walk read V 64 rows apart. Here V is read once, in order, and each
//! row's sums stay in registers. Cells outside a row's range have p = +0 and add exactly nothing, so a
//! row's result does not depend on the tile it is in.

use super::tiled::TileGeom;
use half::f16;
use std::arch::x86_64::*;

/// Rows whose sums are held in registers at once (× `VECS` vectors).
const ROWS: usize = 6;
/// Vectors of 16 values per pass over the cells (AVX-512); value ranges are whole passes (hd % 64 == 0).
pub(super) const VECS: usize = 4;

/// Rows `rows` (probabilities at `w`, row stride `g.n_pad`), output values `vals` (a range of 16-value
/// vectors, `hd / 16` in all: a multiple of `VECS` of them, or a single one), into `out(r)` (row r's `hd`
/// outputs).
///
/// # Safety
/// AVX-512 F or AVX2 (with FMA and F16C); `offsets` holds `g.n_keys` value rows of `hd` inside `values`;
/// `out(r)` is valid for `hd` writes, which no one else makes meanwhile.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn values(values: &[f16], hd: usize, g: &TileGeom, offsets: &[usize], w: *const f32, rows: std::ops::Range<usize>, vals: std::ops::Range<usize>, out: &dyn Fn(usize) -> *mut f32) {
    if crate::ggml_math::avx512_available() {
        values_avx512(values, hd, g, offsets, w, rows, vals, out)
    } else {
        values_avx2(values, g, offsets, w, rows, vals, out)
    }
}

#[target_feature(enable = "avx512f,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn values_avx512(values: &[f16], hd: usize, g: &TileGeom, offsets: &[usize], w: *const f32, rows: std::ops::Range<usize>, vals: std::ops::Range<usize>, out: &dyn Fn(usize) -> *mut f32) {
    debug_assert!(vals.end * 16 <= hd && (vals.len() % VECS == 0 || vals.len() == 1));
    let step = if vals.len() == 1 { 1 } else { VECS };
    let mut r0 = rows.start;
    while r0 < rows.end {
        let rs = ROWS.min(rows.end - r0);
        for v0 in vals.clone().step_by(step) {
            let a = Pass { values, g, offsets, w: w.add(r0 * g.n_pad), v0, out: &|r| out(r0 + r) };
            macro_rules! by_rows {
                ($v:literal) => {
                    match rs {
                        6 => pass_avx512::<6, $v>(&a),
                        5 => pass_avx512::<5, $v>(&a),
                        4 => pass_avx512::<4, $v>(&a),
                        3 => pass_avx512::<3, $v>(&a),
                        2 => pass_avx512::<2, $v>(&a),
                        _ => pass_avx512::<1, $v>(&a),
                    }
                };
            }
            if step == 1 {
                by_rows!(1)
            } else {
                by_rows!(4)
            }
        }
        r0 += rs;
    }
}

struct Pass<'a> {
    values: &'a [f16],
    g: &'a TileGeom,
    offsets: &'a [usize],
    /// The pass's first row's probabilities (row stride `g.n_pad`).
    w: *const f32,
    /// First output vector.
    v0: usize,
    out: &'a dyn Fn(usize) -> *mut f32,
}

/// Cells ahead whose values a pass prefetches (far enough for DRAM: see `tiled::SCORE_PREFETCH_CHUNKS`).
const AHEAD: usize = 32;

#[inline]
#[target_feature(enable = "avx512f,fma,f16c")]
unsafe fn pass_avx512<const R: usize, const V: usize>(a: &Pass) {
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    let base = a.values.as_ptr().add(16 * a.v0);
    for j in 0..a.g.n_keys {
        if let Some(&ahead) = a.offsets.get(j + AHEAD) {
            _mm_prefetch::<_MM_HINT_T0>(base.add(ahead) as *const i8);
        }
        let pv = base.add(a.offsets[j]) as *const __m256i;
        let v: [__m512; V] = std::array::from_fn(|k| _mm512_cvtph_ps(_mm256_loadu_si256(pv.add(k))));
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let p = _mm512_set1_ps(*a.w.add(r * a.g.n_pad + j));
            for (s, vk) in acc_r.iter_mut().zip(&v) {
                *s = _mm512_fmadd_ps(p, *vk, *s);
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        let o = (a.out)(r).add(16 * a.v0);
        for (k, s) in acc_r.iter().enumerate() {
            _mm512_storeu_ps(o.add(16 * k), *s);
        }
    }
}

/// `values_avx512` on 8-lane registers: the same chains, 8 values at a time.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values_avx2(values: &[f16], g: &TileGeom, offsets: &[usize], w: *const f32, rows: std::ops::Range<usize>, vals: std::ops::Range<usize>, out: &dyn Fn(usize) -> *mut f32) {
    for r in rows {
        let wr = w.add(r * g.n_pad);
        for v in vals.clone() {
            // two 8-value halves of the 16-value vector v
            let mut acc = [_mm256_setzero_ps(); 2];
            let base = values.as_ptr().add(16 * v);
            for j in 0..g.n_keys {
                let pv = base.add(offsets[j]) as *const __m128i;
                let p = _mm256_set1_ps(*wr.add(j));
                for (h, s) in acc.iter_mut().enumerate() {
                    *s = _mm256_fmadd_ps(p, _mm256_cvtph_ps(_mm_loadu_si128(pv.add(h))), *s);
                }
            }
            let o = out(r).add(16 * v);
            _mm256_storeu_ps(o, acc[0]);
            _mm256_storeu_ps(o.add(8), acc[1]);
        }
    }
}

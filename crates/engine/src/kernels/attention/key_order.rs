//! The value pass of the packed numerics: `out[r] = Σ_j p[r][j] · v_j`, one FMA chain per output value
//! over each *run* of `RUN` positions (run k holds positions `k·RUN..(k+1)·RUN`, whatever the tile), from
//! 0; the runs' sums are then added in position order (the first run's sum as it is).
//!
//! ggml's value pass is a dot of each output dimension with the probabilities in 64 lanes (cell j in
//! lane j mod 64), so an exact copy keeps a `[64, head_dim]` buffer per row and reduces it at the end:
//! at the depths of serving (a few hundred cells) that buffer was written and read more than K and V
//! themselves, and its lane-by-lane walk read V 64 rows apart. Here V is read once, in order, and each
//! row's sums stay in registers. Runs let a lone token's long context be summed by several threads at
//! once (`tiled::attend_split`, one part per run) with the same bits as one thread. Cells outside a row's
//! range have p = +0 and add exactly nothing (for finite values; an f16 overflow to inf would poison
//! them, as it does ggml's lanes), so a row's result does not depend on the tile it is in.

use super::tiled::TileGeom;
use half::f16;
use std::arch::x86_64::*;
use std::ops::Range;

use super::RUN;

/// Rows whose sums are held in registers at once (× `VECS` vectors).
const ROWS: usize = 6;
/// Vectors of 16 values per pass over the cells (AVX-512).
const VECS: usize = 4;

/// The tile's cells (indices into `offsets` and a score row) in each run they cover, in order.
pub(super) fn runs(g: &TileGeom) -> impl Iterator<Item = Range<usize>> + '_ {
    debug_assert!(g.n_keys > 0, "a tile attends at least its own cell");
    let (first, last) = (g.lo0 / RUN, (g.lo0 + g.n_keys - 1) / RUN);
    (first..=last).map(move |k| (k * RUN).max(g.lo0) - g.lo0..((k + 1) * RUN).min(g.lo0 + g.n_keys) - g.lo0)
}

/// Rows `rows` (probabilities at `w`, row stride `g.n_pad`) into `out(r)` (row r's `hd` outputs): every
/// run's chains, folded in order.
///
/// # Safety
/// AVX-512 F or AVX2 (with FMA and F16C), `hd % 16 == 0`; `offsets` holds `g.n_keys` value rows of `hd`
/// inside `values`; `out(r)` is valid for `hd` writes, which no one else makes meanwhile.
pub(super) unsafe fn values(values: &[f16], hd: usize, g: &TileGeom, offsets: &[usize], w: *const f32, rows: Range<usize>, out: &dyn Fn(usize) -> *mut f32) {
    for (k, cells) in runs(g).enumerate() {
        run_values(values, hd, g, offsets, w, rows.clone(), cells, k > 0, out);
    }
}

/// One run's chains for rows `rows` over `cells` (one run's cells of the tile): stored into `out(r)`, or
/// added to what it holds (`add`, the later runs of a fold).
///
/// # Safety
/// As `values`; with `add`, `out(r)` holds the earlier runs' sum.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn run_values(values: &[f16], hd: usize, g: &TileGeom, offsets: &[usize], w: *const f32, rows: Range<usize>, cells: Range<usize>, add: bool, out: &dyn Fn(usize) -> *mut f32) {
    debug_assert!(hd % 16 == 0);
    if crate::kernels::ggml::math::avx512_available() {
        run_values_avx512(values, hd, g, offsets, w, rows, cells, add, out)
    } else if rows.len() >= BUFFERED_MIN_ROWS {
        let src = |j: usize, dst: *mut f32| convert_row_avx2(values.as_ptr().add(offsets[j]), offsets.get(j + AHEAD).map(|&o| values.as_ptr().add(o)), hd, dst);
        with_chunk_bufs(hd, rows.len(), |vbuf, acc| buffered_avx2(hd, g.n_pad, w, rows, cells, add, out, vbuf, acc, &src))
    } else {
        run_values_avx2(values, hd, g, offsets, w, rows, cells, add, out)
    }
}

/// Rows from which the AVX2 pass converts each chunk of values once for all of them (`buffered_avx2`);
/// fewer rows (a lone token's group) take the register pass, which converts per 3 rows.
pub(super) const BUFFERED_MIN_ROWS: usize = 6;
/// Cells per chunk of the buffered pass at most: `[CHUNK, hd]` f32 (16 KiB at head size 64) stays in L1
/// while every row group reads it; larger heads take `chunk_cells(hd)`.
pub(super) const CHUNK: usize = 64;

/// Cells per chunk for head size `hd`: 16 KiB of f32 values, at least 16 cells.
pub(super) fn chunk_cells(hd: usize) -> usize {
    (4096 / hd).clamp(16, CHUNK)
}
/// Rows whose sums the buffered AVX2 pass holds at once (× 2 vectors of 8 values: 12 registers, the
/// chunk's two value vectors and the broadcast probability make 15 of the 16).
const ROWS_BUF: usize = 6;

thread_local! {
    /// The buffered pass's `[CHUNK, hd]` values and `[rows, hd]` running sums.
    static CHUNK_BUFS: std::cell::RefCell<(Vec<f32>, Vec<f32>)> = const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// `f(vbuf, acc)` with this thread's buffers of `buffered_avx2` for head size `hd` and `rows` rows.
pub(super) fn with_chunk_bufs<T>(hd: usize, rows: usize, f: impl FnOnce(&mut [f32], &mut [f32]) -> T) -> T {
    CHUNK_BUFS.with_borrow_mut(|(vbuf, acc)| {
        vbuf.resize(CHUNK * hd, 0.0);
        acc.resize(rows * hd, 0.0);
        f(vbuf, acc)
    })
}

/// One value row of `hd` f16 values at `src` into `dst` as f32, asking for the row at `ahead` too.
///
/// # Safety
/// AVX2 and F16C; `src` has `hd` values and `dst` room for them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn convert_row_avx2(src: *const f16, ahead: Option<*const f16>, hd: usize, dst: *mut f32) {
    if let Some(a) = ahead {
        for line in (0..2 * hd).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>((a as *const i8).add(line));
        }
    }
    for k in (0..hd).step_by(8) {
        _mm256_storeu_ps(dst.add(k), _mm256_cvtph_ps(_mm_loadu_si128(src.add(k) as *const __m128i)));
    }
}

/// One run's chains for many rows on AVX2, the same bits as `run_values_avx2`: the run's cells go
/// through in chunks of `chunk_cells(hd)`, each written as f32 into `vbuf` once by `src(cell, dst)` (an f16
/// conversion, or a quantized row's exact dequantization), then every row group's chains continue over
/// it from `acc`, where they wait between chunks (an f32 stored and reloaded is the same f32). The
/// register pass converted each value once per 3 rows, and its 17 live registers spilled two sums.
///
/// # Safety
/// AVX2 and FMA; `w` has the rows' probabilities (stride `n_pad`) for `cells`; `vbuf` holds `CHUNK * hd`
/// and `acc` `rows.len() * hd` floats; `src` writes `hd` floats; `out(r)` as in `run_values`.
#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn buffered_avx2(hd: usize, n_pad: usize, w: *const f32, rows: Range<usize>, cells: Range<usize>, add: bool, out: &dyn Fn(usize) -> *mut f32, vbuf: &mut [f32], acc: &mut [f32], src: &dyn Fn(usize, *mut f32)) {
    debug_assert!(hd % 16 == 0 && vbuf.len() >= CHUNK * hd && acc.len() >= rows.len() * hd);
    let mut c0 = cells.start;
    while c0 < cells.end {
        let n = chunk_cells(hd).min(cells.end - c0);
        for i in 0..n {
            src(c0 + i, vbuf.as_mut_ptr().add(i * hd));
        }
        let mut r0 = rows.start;
        while r0 < rows.end {
            let a = BufPass { vbuf: vbuf.as_ptr(), hd, n, w: w.add(r0 * n_pad + c0), n_pad, acc: acc.as_mut_ptr().add((r0 - rows.start) * hd), first: c0 == cells.start };
            match ROWS_BUF.min(rows.end - r0) {
                6 => buf_pass_avx2::<6>(&a),
                5 => buf_pass_avx2::<5>(&a),
                4 => buf_pass_avx2::<4>(&a),
                3 => buf_pass_avx2::<3>(&a),
                2 => buf_pass_avx2::<2>(&a),
                _ => buf_pass_avx2::<1>(&a),
            }
            r0 += ROWS_BUF;
        }
        c0 += n;
    }
    for r in rows.clone() {
        let (o, s) = (out(r), acc.as_ptr().add((r - rows.start) * hd));
        for k in (0..hd).step_by(8) {
            let v = _mm256_loadu_ps(s.add(k));
            _mm256_storeu_ps(o.add(k), if add { _mm256_add_ps(_mm256_loadu_ps(o.add(k)), v) } else { v });
        }
    }
}

struct BufPass {
    /// `[n, hd]` f32 values of the chunk's cells.
    vbuf: *const f32,
    hd: usize,
    n: usize,
    /// The pass's first row's probability of the chunk's first cell (row stride `n_pad`).
    w: *const f32,
    n_pad: usize,
    /// The pass's first row's running sums (row stride `hd`).
    acc: *mut f32,
    /// The run's first chunk: the chains start from +0, as the register pass's.
    first: bool,
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn buf_pass_avx2<const R: usize>(a: &BufPass) {
    for v0 in (0..a.hd).step_by(16) {
        let mut s = [[_mm256_setzero_ps(); 2]; R];
        if !a.first {
            for (r, s) in s.iter_mut().enumerate() {
                let at = a.acc.add(r * a.hd + v0);
                *s = [_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))];
            }
        }
        for j in 0..a.n {
            let x = a.vbuf.add(j * a.hd + v0);
            let (x0, x1) = (_mm256_loadu_ps(x), _mm256_loadu_ps(x.add(8)));
            for (r, s) in s.iter_mut().enumerate() {
                let p = _mm256_set1_ps(*a.w.add(r * a.n_pad + j));
                s[0] = _mm256_fmadd_ps(p, x0, s[0]);
                s[1] = _mm256_fmadd_ps(p, x1, s[1]);
            }
        }
        for (r, s) in s.iter().enumerate() {
            let at = a.acc.add(r * a.hd + v0);
            _mm256_storeu_ps(at, s[0]);
            _mm256_storeu_ps(at.add(8), s[1]);
        }
    }
}

#[target_feature(enable = "avx512f,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_values_avx512(values: &[f16], hd: usize, g: &TileGeom, offsets: &[usize], w: *const f32, rows: Range<usize>, cells: Range<usize>, add: bool, out: &dyn Fn(usize) -> *mut f32) {
    let mut r0 = rows.start;
    while r0 < rows.end {
        let rs = ROWS.min(rows.end - r0);
        let mut v0 = 0;
        while v0 < hd / 16 {
            let a = Pass { values, g, offsets, w: w.add(r0 * g.n_pad), v0, cells: cells.clone(), add, out: &|r| out(r0 + r) };
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
            if hd / 16 - v0 >= VECS {
                by_rows!(4);
                v0 += VECS;
            } else {
                by_rows!(1);
                v0 += 1;
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
    cells: Range<usize>,
    /// Add to the outputs instead of storing.
    add: bool,
    out: &'a dyn Fn(usize) -> *mut f32,
}

/// Cells ahead whose values a pass prefetches (far enough for DRAM: see `tiled::SCORE_PREFETCH_CHUNKS`).
const AHEAD: usize = 32;

#[inline]
#[target_feature(enable = "avx512f,fma,f16c")]
unsafe fn pass_avx512<const R: usize, const V: usize>(a: &Pass) {
    let mut acc = [[_mm512_setzero_ps(); V]; R];
    let base = a.values.as_ptr().add(16 * a.v0);
    for j in a.cells.clone() {
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
            let s = if a.add { _mm512_add_ps(_mm512_loadu_ps(o.add(16 * k)), *s) } else { *s };
            _mm512_storeu_ps(o.add(16 * k), s);
        }
    }
}

/// Rows whose sums the AVX2 pass holds at once (× 2 vectors of 16 values, 4 registers each row).
const ROWS_AVX2: usize = 3;

/// `run_values_avx512` on 8-lane registers: the same chains (one per output value, cells in order),
/// `ROWS_AVX2` rows × 2 vectors of 16 values at a time, so each value is converted once for the pass's
/// rows and 12 independent chains hide the FMA latency (one row and one vector at a time was bound by it).
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn run_values_avx2(values: &[f16], hd: usize, g: &TileGeom, offsets: &[usize], w: *const f32, rows: Range<usize>, cells: Range<usize>, add: bool, out: &dyn Fn(usize) -> *mut f32) {
    let mut r0 = rows.start;
    while r0 < rows.end {
        let rs = ROWS_AVX2.min(rows.end - r0);
        let mut v0 = 0;
        while v0 < hd / 16 {
            let a = Pass { values, g, offsets, w: w.add(r0 * g.n_pad), v0, cells: cells.clone(), add, out: &|r| out(r0 + r) };
            macro_rules! by_rows {
                ($v:literal) => {
                    match rs {
                        3 => pass_avx2::<3, $v>(&a),
                        2 => pass_avx2::<2, $v>(&a),
                        _ => pass_avx2::<1, $v>(&a),
                    }
                };
            }
            if hd / 16 - v0 >= 2 {
                by_rows!(2);
                v0 += 2;
            } else {
                by_rows!(1);
                v0 += 1;
            }
        }
        r0 += rs;
    }
}

/// `pass_avx512` on AVX2: V vectors of 16 values as 2V halves of 8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pass_avx2<const R: usize, const V: usize>(a: &Pass) {
    let mut acc = [[[_mm256_setzero_ps(); 2]; V]; R];
    let base = a.values.as_ptr().add(16 * a.v0);
    for j in a.cells.clone() {
        if let Some(&ahead) = a.offsets.get(j + AHEAD) {
            _mm_prefetch::<_MM_HINT_T0>(base.add(ahead) as *const i8);
        }
        let pv = base.add(a.offsets[j]) as *const __m128i;
        let v: [[__m256; 2]; V] = std::array::from_fn(|k| [_mm256_cvtph_ps(_mm_loadu_si128(pv.add(2 * k))), _mm256_cvtph_ps(_mm_loadu_si128(pv.add(2 * k + 1)))]);
        for (r, acc_r) in acc.iter_mut().enumerate() {
            let p = _mm256_set1_ps(*a.w.add(r * a.g.n_pad + j));
            for (s, vk) in acc_r.iter_mut().zip(&v) {
                s[0] = _mm256_fmadd_ps(p, vk[0], s[0]);
                s[1] = _mm256_fmadd_ps(p, vk[1], s[1]);
            }
        }
    }
    for (r, acc_r) in acc.iter().enumerate() {
        let o = (a.out)(r).add(16 * a.v0);
        for (k, s) in acc_r.iter().enumerate() {
            for (h, s) in s.iter().enumerate() {
                let at = o.add(16 * k + 8 * h);
                let s = if a.add { _mm256_add_ps(_mm256_loadu_ps(at), *s) } else { *s };
                _mm256_storeu_ps(at, s);
            }
        }
    }
}



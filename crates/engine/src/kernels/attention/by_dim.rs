//! The packed numerics' scores: keys stored by dimension (`kv::KeyLayout::ByDim`, each group of G = 16
//! cells of one KV head as `[head_dim][16]` f16), and each score one FMA chain over the dimensions:
//! ```text
//! s = +0;  for d in 0..head_dim { s = fma(f16(q[d]), k[d], s) }     then times the attention scale
//! ```
//! With 16 cells of a dimension side by side, one conversion serves 16 cells, each row's q[d] is one
//! broadcast, and 16 chains run in the lanes of one vector (two on AVX2): no transpose and no horizontal
//! sum, where ggml's order (four accumulators per key, then a reduction tree across them) costs about
//! half again as many vector operations per key (docs/speed.md, "What is left", item 3). The chain is
//! the same on every ISA and in the scalar reference, so the bits do not depend on the CPU, the batch,
//! the tile or the threads.

use crate::kv::key_group;
use half::f16;
use std::ops::Range;

/// How many groups ahead the score pass prefetches keys (a decode step reads them from DRAM).
const PREFETCH_GROUPS: usize = 3;

/// One layer's keys stored by dimension, and which KV head of which sequence the scores read.
#[derive(Clone, Copy)]
pub(super) struct ByDimKeys<'a> {
    pub keys: &'a [f16],
    pub n_kv_heads: usize,
    pub hd: usize,
    pub bs: usize,
    pub block_table: &'a [u32],
    pub kv_head: usize,
}

/// The cells a score pass covers: positions `lo0..lo0 + n_keys` of the sequence, written at column
/// `p - lo0` of each row (`stride` floats per row). They are read by groups of G cells aligned to G
/// (group i starts at position `(lo0 / G + i) * G`); cells of a group outside the range are not written.
#[derive(Clone, Copy)]
pub(super) struct Cells {
    pub lo0: usize,
    pub n_keys: usize,
}

impl ByDimKeys<'_> {
    fn group(&self) -> usize {
        key_group(self.bs)
    }

    /// Groups covering `cells`.
    pub(super) fn n_groups(&self, cells: Cells) -> usize {
        let g = self.group();
        (cells.lo0 + cells.n_keys - 1) / g - cells.lo0 / g + 1
    }

    /// First position of group i, and the index of its first key in `keys` (`[hd][G]` from there).
    #[inline(always)]
    fn group_at(&self, cells: Cells, i: usize) -> (usize, usize) {
        let g = self.group();
        let start = (cells.lo0 / g + i) * g;
        let block = self.block_table[start / self.bs] as usize;
        (start, ((block * self.n_kv_heads + self.kv_head) * self.bs + start % self.bs) * self.hd)
    }
}

/// Scores (before the attention scale) of `rows` query rows against the cells of groups `groups`:
/// `q32` is `[rows, hd]`, q rounded to f16 (as f32); row r's score of position p goes to
/// `out[r * stride + p - cells.lo0]`.
///
/// # Safety
/// `out` holds `rows` rows of `stride >= cells.n_keys` floats, and no one else writes the columns of
/// these groups meanwhile; the block table covers the cells, inside `keys`.
pub(super) unsafe fn scores(k: &ByDimKeys, cells: Cells, q32: &[f32], rows: usize, groups: Range<usize>, out: *mut f32, stride: usize) {
    debug_assert!(q32.len() >= rows * k.hd && stride >= cells.n_keys);
    #[cfg(target_arch = "x86_64")]
    if k.group() == 16 {
        if crate::kernels::ggml::math::avx512_available() {
            return x86::scores_avx512(k, cells, q32, rows, groups, out, stride);
        }
        if crate::kernels::ggml::math::avx2_available() {
            return x86::scores_avx2(k, cells, q32, rows, groups, out, stride);
        }
    }
    scores_scalar(k, cells, q32, rows, groups, out, stride)
}

/// `scores` one chain at a time: the definition the vector kernels are tested against, and the path of
/// block sizes that 16 does not divide.
///
/// # Safety
/// As `scores`.
pub(super) unsafe fn scores_scalar(k: &ByDimKeys, cells: Cells, q32: &[f32], rows: usize, groups: Range<usize>, out: *mut f32, stride: usize) {
    let (g, hd) = (k.group(), k.hd);
    for i in groups {
        let (start, at) = k.group_at(cells, i);
        for lane in 0..g {
            let p = start + lane;
            if p < cells.lo0 || p >= cells.lo0 + cells.n_keys {
                continue;
            }
            for r in 0..rows {
                let q = &q32[r * hd..(r + 1) * hd];
                let mut s = 0.0f32;
                for (d, &qd) in q.iter().enumerate() {
                    s = qd.mul_add(k.keys[at + d * g + lane].to_f32(), s);
                }
                *out.add(r * stride + p - cells.lo0) = s;
            }
        }
    }
}

/// Writes 16 scores of group start `start` to a row (`row` = column 0), the lanes inside `cells` only.
#[inline(always)]
unsafe fn store_16(row: *mut f32, cells: Cells, start: usize, s: &[f32; 16]) {
    if start >= cells.lo0 && start + 16 <= cells.lo0 + cells.n_keys {
        std::ptr::copy_nonoverlapping(s.as_ptr(), row.add(start - cells.lo0), 16);
        return;
    }
    for (lane, &x) in s.iter().enumerate() {
        let p = start + lane;
        if p >= cells.lo0 && p < cells.lo0 + cells.n_keys {
            *row.add(p - cells.lo0) = x;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// Rows whose chains stay in registers at once on AVX-512 (one vector each); more rows convert a
    /// group's keys into a buffer once and run 8 at a time.
    const ROWS_512: usize = 8;
    /// On AVX2: two vectors a row, the group's two key vectors and a broadcast (15 of 16 registers).
    const ROWS_256: usize = 6;

    thread_local! {
        /// A group's keys as f32 (`[hd][16]`), for tiles of many rows.
        static KBUF: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }

    /// This thread's key buffer of at least `n` floats. (A pointer, not a closure over the buffer: a
    /// closure would not inherit the kernels' target features, and its intrinsics would become calls.)
    /// Valid until the next call on this thread; the score passes do not nest.
    fn kbuf(n: usize) -> *mut f32 {
        KBUF.with_borrow_mut(|b| {
            if b.len() < n {
                b.resize(n, 0.0);
            }
            b.as_mut_ptr()
        })
    }

    #[inline(always)]
    unsafe fn prefetch_group(k: &ByDimKeys, cells: Cells, i: usize, n_groups: usize) {
        if i < n_groups {
            let (_, at) = k.group_at(cells, i);
            let p = k.keys.as_ptr().add(at) as *const i8;
            for line in (0..32 * k.hd).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(p.add(line));
            }
        }
    }

    #[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
    pub(super) unsafe fn scores_avx512(k: &ByDimKeys, cells: Cells, q32: &[f32], rows: usize, groups: Range<usize>, out: *mut f32, stride: usize) {
        let (hd, n_groups) = (k.hd, k.n_groups(cells));
        let q = q32.as_ptr();
        let buf = if rows > ROWS_512 { kbuf(16 * hd) } else { std::ptr::null_mut() };
        {
            let mut i = groups.start;
            while i < groups.end {
                // A few rows' chains alone would wait on the FMA latency: run several groups at once.
                let g = match rows {
                    1 => 8,
                    2 => 4,
                    3 => 3,
                    4 => 2,
                    _ => 1,
                };
                if g > 1 && i + g <= groups.end {
                    for j in i..i + g {
                        prefetch_group(k, cells, j + PREFETCH_GROUPS, n_groups);
                    }
                    match rows {
                        1 => multi_512::<1, 8>(k, cells, i, q, out, stride),
                        2 => multi_512::<2, 4>(k, cells, i, q, out, stride),
                        3 => multi_512::<3, 3>(k, cells, i, q, out, stride),
                        _ => multi_512::<4, 2>(k, cells, i, q, out, stride),
                    }
                    i += g;
                    continue;
                }
                prefetch_group(k, cells, i + PREFETCH_GROUPS, n_groups);
                let (start, at) = k.group_at(cells, i);
                let kp = k.keys.as_ptr().add(at);
                i += 1;
                if rows <= ROWS_512 {
                    match rows {
                        1 => rows_512::<1>(kp, hd, q, cells, start, out, stride),
                        2 => rows_512::<2>(kp, hd, q, cells, start, out, stride),
                        3 => rows_512::<3>(kp, hd, q, cells, start, out, stride),
                        4 => rows_512::<4>(kp, hd, q, cells, start, out, stride),
                        5 => rows_512::<5>(kp, hd, q, cells, start, out, stride),
                        6 => rows_512::<6>(kp, hd, q, cells, start, out, stride),
                        7 => rows_512::<7>(kp, hd, q, cells, start, out, stride),
                        _ => rows_512::<8>(kp, hd, q, cells, start, out, stride),
                    }
                    continue;
                }
                for d in 0..hd {
                    _mm512_storeu_ps(buf.add(16 * d), _mm512_cvtph_ps(_mm256_loadu_si256(kp.add(16 * d) as *const __m256i)));
                }
                let mut r0 = 0;
                while r0 < rows {
                    let (q, out) = (q.add(r0 * hd), out.add(r0 * stride));
                    let b = buf as *const f32;
                    match rows - r0 {
                        1 => buf_512::<1>(b, hd, q, cells, start, out, stride),
                        2 => buf_512::<2>(b, hd, q, cells, start, out, stride),
                        3 => buf_512::<3>(b, hd, q, cells, start, out, stride),
                        4 => buf_512::<4>(b, hd, q, cells, start, out, stride),
                        5 => buf_512::<5>(b, hd, q, cells, start, out, stride),
                        6 => buf_512::<6>(b, hd, q, cells, start, out, stride),
                        7 => buf_512::<7>(b, hd, q, cells, start, out, stride),
                        _ => buf_512::<8>(b, hd, q, cells, start, out, stride),
                    }
                    r0 += ROWS_512;
                }
            }
        }
    }

    /// R rows × G groups from group `i0`: R·G independent chains, enough to cover the FMA latency
    /// (each row's chain over one group is a serial run of `hd` FMAs).
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
    unsafe fn multi_512<const R: usize, const G: usize>(k: &ByDimKeys, cells: Cells, i0: usize, q: *const f32, out: *mut f32, stride: usize) {
        let hd = k.hd;
        let mut starts = [0usize; G];
        let mut kps = [std::ptr::null::<f16>(); G];
        for j in 0..G {
            let (start, at) = k.group_at(cells, i0 + j);
            (starts[j], kps[j]) = (start, k.keys.as_ptr().add(at));
        }
        let mut s = [[_mm512_setzero_ps(); R]; G];
        for d in 0..hd {
            let mut kd = [_mm512_setzero_ps(); G];
            for j in 0..G {
                kd[j] = _mm512_cvtph_ps(_mm256_loadu_si256(kps[j].add(16 * d) as *const __m256i));
            }
            for r in 0..R {
                let qd = _mm512_set1_ps(*q.add(r * hd + d));
                for j in 0..G {
                    s[j][r] = _mm512_fmadd_ps(qd, kd[j], s[j][r]);
                }
            }
        }
        for j in 0..G {
            store_rows_512(&s[j], cells, starts[j], out, stride);
        }
    }

    /// R rows × one group, each dimension's 16 keys converted in a register.
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
    unsafe fn rows_512<const R: usize>(kp: *const f16, hd: usize, q: *const f32, cells: Cells, start: usize, out: *mut f32, stride: usize) {
        let mut s = [_mm512_setzero_ps(); R];
        for d in 0..hd {
            let kd = _mm512_cvtph_ps(_mm256_loadu_si256(kp.add(16 * d) as *const __m256i));
            for (r, s) in s.iter_mut().enumerate() {
                *s = _mm512_fmadd_ps(_mm512_set1_ps(*q.add(r * hd + d)), kd, *s);
            }
        }
        store_rows_512(&s, cells, start, out, stride);
    }

    /// R rows × one group converted into `buf` (`[hd][16]` f32).
    #[inline]
    #[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
    unsafe fn buf_512<const R: usize>(buf: *const f32, hd: usize, q: *const f32, cells: Cells, start: usize, out: *mut f32, stride: usize) {
        let mut s = [_mm512_setzero_ps(); R];
        for d in 0..hd {
            let kd = _mm512_loadu_ps(buf.add(16 * d));
            for (r, s) in s.iter_mut().enumerate() {
                *s = _mm512_fmadd_ps(_mm512_set1_ps(*q.add(r * hd + d)), kd, *s);
            }
        }
        store_rows_512(&s, cells, start, out, stride);
    }

    #[inline(always)]
    unsafe fn store_rows_512<const R: usize>(s: &[__m512; R], cells: Cells, start: usize, out: *mut f32, stride: usize) {
        let full = start >= cells.lo0 && start + 16 <= cells.lo0 + cells.n_keys;
        for (r, s) in s.iter().enumerate() {
            let row = out.add(r * stride);
            if full {
                _mm512_storeu_ps(row.add(start - cells.lo0), *s);
            } else {
                let mut a = [0f32; 16];
                _mm512_storeu_ps(a.as_mut_ptr(), *s);
                store_16(row, cells, start, &a);
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn scores_avx2(k: &ByDimKeys, cells: Cells, q32: &[f32], rows: usize, groups: Range<usize>, out: *mut f32, stride: usize) {
        let (hd, n_groups) = (k.hd, k.n_groups(cells));
        let q = q32.as_ptr();
        let buf = if rows > ROWS_256 { kbuf(16 * hd) } else { std::ptr::null_mut() };
        {
            for i in groups {
                prefetch_group(k, cells, i + PREFETCH_GROUPS, n_groups);
                let (start, at) = k.group_at(cells, i);
                let kp = k.keys.as_ptr().add(at);
                if rows <= ROWS_256 {
                    match rows {
                        1 => rows_256::<1>(kp, hd, q, cells, start, out, stride),
                        2 => rows_256::<2>(kp, hd, q, cells, start, out, stride),
                        3 => rows_256::<3>(kp, hd, q, cells, start, out, stride),
                        4 => rows_256::<4>(kp, hd, q, cells, start, out, stride),
                        5 => rows_256::<5>(kp, hd, q, cells, start, out, stride),
                        _ => rows_256::<6>(kp, hd, q, cells, start, out, stride),
                    }
                    continue;
                }
                for i in (0..16 * hd).step_by(8) {
                    _mm256_storeu_ps(buf.add(i), _mm256_cvtph_ps(_mm_loadu_si128(kp.add(i) as *const __m128i)));
                }
                let mut r0 = 0;
                while r0 < rows {
                    let (q, out) = (q.add(r0 * hd), out.add(r0 * stride));
                    let b = buf as *const f32;
                    match rows - r0 {
                        1 => buf_256::<1>(b, hd, q, cells, start, out, stride),
                        2 => buf_256::<2>(b, hd, q, cells, start, out, stride),
                        3 => buf_256::<3>(b, hd, q, cells, start, out, stride),
                        4 => buf_256::<4>(b, hd, q, cells, start, out, stride),
                        5 => buf_256::<5>(b, hd, q, cells, start, out, stride),
                        _ => buf_256::<6>(b, hd, q, cells, start, out, stride),
                    }
                    r0 += ROWS_256;
                }
            }
        }
    }

    /// R rows × one group on 8-lane registers, each dimension's keys converted in two registers.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn rows_256<const R: usize>(kp: *const f16, hd: usize, q: *const f32, cells: Cells, start: usize, out: *mut f32, stride: usize) {
        let mut s = [[_mm256_setzero_ps(); 2]; R];
        for d in 0..hd {
            let k0 = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(16 * d) as *const __m128i));
            let k1 = _mm256_cvtph_ps(_mm_loadu_si128(kp.add(16 * d + 8) as *const __m128i));
            for (r, s) in s.iter_mut().enumerate() {
                let qd = _mm256_broadcast_ss(&*q.add(r * hd + d));
                s[0] = _mm256_fmadd_ps(qd, k0, s[0]);
                s[1] = _mm256_fmadd_ps(qd, k1, s[1]);
            }
        }
        store_rows_256(&s, cells, start, out, stride);
    }

    /// R rows × one group converted into `buf` (`[hd][16]` f32), on 8-lane registers.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn buf_256<const R: usize>(buf: *const f32, hd: usize, q: *const f32, cells: Cells, start: usize, out: *mut f32, stride: usize) {
        let mut s = [[_mm256_setzero_ps(); 2]; R];
        for d in 0..hd {
            let (k0, k1) = (_mm256_loadu_ps(buf.add(16 * d)), _mm256_loadu_ps(buf.add(16 * d + 8)));
            for (r, s) in s.iter_mut().enumerate() {
                let qd = _mm256_broadcast_ss(&*q.add(r * hd + d));
                s[0] = _mm256_fmadd_ps(qd, k0, s[0]);
                s[1] = _mm256_fmadd_ps(qd, k1, s[1]);
            }
        }
        store_rows_256(&s, cells, start, out, stride);
    }

    #[inline(always)]
    unsafe fn store_rows_256<const R: usize>(s: &[[__m256; 2]; R], cells: Cells, start: usize, out: *mut f32, stride: usize) {
        let full = start >= cells.lo0 && start + 16 <= cells.lo0 + cells.n_keys;
        for (r, s) in s.iter().enumerate() {
            let row = out.add(r * stride);
            if full {
                _mm256_storeu_ps(row.add(start - cells.lo0), s[0]);
                _mm256_storeu_ps(row.add(start - cells.lo0 + 8), s[1]);
            } else {
                let mut a = [0f32; 16];
                _mm256_storeu_ps(a.as_mut_ptr(), s[0]);
                _mm256_storeu_ps(a.as_mut_ptr().add(8), s[1]);
                store_16(row, cells, start, &a);
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::super::*;
        use super::{scores_avx2, scores_avx512};
        use crate::kernels::attention::fixture::noise;
        use crate::kv::{KeyLayout, KvDtypes, KvShape, KvStorage};

        /// Both vector kernels give the scalar chains' bits: 1 to 9 rows and tiles of 24 and 56 (in
        /// registers and through the key buffer; up to 4 rows over several groups at once, which a
        /// 600-cell range reaches), head sizes 64, 128 and 256, ranges that start and end inside a group,
        /// scattered blocks of 16 and 32 cells, and a call per group range.
        #[test]
        fn vector_chains_equal_the_scalar_chains() {
            use crate::kernels::cpu::{tests::test_needs, SimdLevel};
            if !test_needs(SimdLevel::Avx2, "by-dimension scores vs scalar") {
                return;
            }
            let avx512 = crate::kernels::ggml::math::avx512_available();
            for (hd, bs, n_kv, lo0, n_keys) in [(64usize, 16usize, 3usize, 0usize, 37usize), (64, 32, 2, 5, 200), (128, 16, 2, 17, 150), (256, 16, 1, 3, 45), (64, 16, 1, 32, 16), (64, 16, 2, 7, 600)] {
                let blocks = (lo0 + n_keys).div_ceil(bs);
                let table: Vec<u32> = (0..blocks as u32).map(|b| (b * 7 + 3) % (blocks as u32 + 5)).collect();
                let num_blocks = blocks + 5;
                let shape = KvShape { num_layers: 1, kv_dim: n_kv * hd, head_dim: hd, block_size: bs, num_blocks, dtypes: KvDtypes::F16, key_layout: KeyLayout::ByDim };
                let mut kv = KvStorage::new(shape);
                for slot in 0..num_blocks * bs {
                    let k: Vec<f32> = (0..n_kv * hd).map(|i| 3.0 * noise(i + 977 * slot, 0.5)).collect();
                    kv.write(0, slot, &k, &k);
                }
                let cells = Cells { lo0, n_keys };
                for rows in [1, 2, 3, 4, 5, 6, 7, 8, 9, 24, 56] {
                    let q32: Vec<f32> = (0..rows * hd).map(|i| half::f16::from_f32(2.0 * noise(i, 4.25)).to_f32()).collect();
                    let k = ByDimKeys { keys: kv.layer(0).0, n_kv_heads: n_kv, hd, bs, block_table: &table, kv_head: n_kv - 1 };
                    let n = k.n_groups(cells);
                    let stride = n_keys + 3;
                    let run = |f: unsafe fn(&ByDimKeys, Cells, &[f32], usize, Range<usize>, *mut f32, usize)| {
                        let mut out = vec![f32::NAN; rows * stride];
                        // in two calls, as the split path's parts
                        unsafe {
                            f(&k, cells, &q32, rows, 0..n / 2, out.as_mut_ptr(), stride);
                            f(&k, cells, &q32, rows, n / 2..n, out.as_mut_ptr(), stride);
                        }
                        out.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                    };
                    let reference = run(scores_scalar);
                    assert_eq!(run(scores_avx2), reference, "AVX2 hd {hd} bs {bs} rows {rows} cells {lo0}+{n_keys}");
                    if avx512 {
                        assert_eq!(run(scores_avx512), reference, "AVX-512 hd {hd} bs {bs} rows {rows} cells {lo0}+{n_keys}");
                    }
                    // columns past the range stay unwritten; the range is written
                    let row0: Vec<f32> = reference[..stride].iter().map(|&b| f32::from_bits(b)).collect();
                    assert!(row0[..n_keys].iter().all(|x| x.is_finite()) && row0[n_keys..].iter().all(|x| x.is_nan()));
                    // the chain, spelled out for one cell
                    let (p, r) = (lo0 + n_keys - 1, rows - 1);
                    let key = kv.key_row(0, kv.slot(&table, p));
                    let want = (0..hd).fold(0.0f32, |s, d| q32[r * hd + d].mul_add(key[(n_kv - 1) * hd + d].to_f32(), s));
                    assert_eq!(f32::from_bits(reference[r * stride + n_keys - 1]).to_bits(), want.to_bits());
                }
            }
        }
    }
}

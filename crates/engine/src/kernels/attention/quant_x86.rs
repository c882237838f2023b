//! `quant::attend` on x86: tiles of consecutive tokens × one KV head, all the head's query rows
//! together, as `tiled` does for f16; cells in 16-cell chunks that never cross a KV block (positions
//! 16-aligned, block sizes multiples of 16), so a chunk's keys are one region's vectors. Scores by
//! AVX-512 VNNI (or AVX-VNNI's 256-bit `vpdpbusd`, or AVX2 `maddubs`), then ggml's softmax per row, then the values in key order. Same bits
//! as `quant::reference` (see there for the definition).

use super::quant::quantize_query;
use super::{AttnShape, OutPtr, QueryPos, RUN};
use crate::kernels::cpu::{simd_level, SimdLevel};
use crate::kernels::ggml::math::{avx512_available, soft_max};
use crate::kv::quant::Region;
use crate::kv::{KvDtype, QuantLayer};
use crate::pool;
use std::arch::x86_64::*;
use std::ops::Range;

/// Cells a lone token must attend before its tiles' phases are split across the threads.
const SPLIT_MIN_CELLS: usize = 1024;

/// One tile: tokens `tokens` (consecutive positions of one sequence) × KV head `kv_head`.
struct Job<'a> {
    shape: &'a AttnShape,
    kv: &'a QuantLayer<'a>,
    bs: usize,
    queries: &'a [QueryPos<'a>],
    q: &'a [f32],
    tokens: Range<usize>,
    kv_head: usize,
    group: usize,
    rows: usize,
    /// Position of cell 0 (the first token's first position, rounded down to 16).
    base: usize,
    /// Cells `base..base + n_cells`, up to the last token's position.
    n_cells: usize,
    /// `n_cells` rounded up to 16: the stride of a score row.
    n_pad: usize,
}

impl Job<'_> {
    fn table(&self) -> &[u32] {
        self.queries[self.tokens.start].block_table
    }

    /// Row r's token index and query head.
    fn row_target(&self, r: usize) -> (usize, usize) {
        (self.tokens.start + r / self.group, self.kv_head * self.group + r % self.group)
    }

    /// The region (block, this KV head) holding cell `cell` (relative to `base`), and the cell's index
    /// in the block.
    #[inline(always)]
    fn region(&self, r: &Region, data: &[u8], cell: usize) -> (*const u8, usize) {
        let pos = self.base + cell;
        let at = self.kv.region_at(r, self.table()[pos / self.bs], self.kv_head);
        debug_assert!(at + r.bytes() <= data.len());
        // SAFETY (of the callers' reads): the block is the sequence's, inside the layer's storage.
        (unsafe { data.as_ptr().add(at) }, pos % self.bs)
    }

    /// Runs of `RUN` positions as cell ranges.
    fn runs(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        let (first, last) = (self.base / RUN, (self.base + self.n_cells - 1) / RUN);
        (first..=last).map(move |k| (k * RUN).max(self.base) - self.base..((k + 1) * RUN).min(self.base + self.n_cells) - self.base)
    }
}

/// A tile's buffers.
#[derive(Default)]
struct Bufs {
    q: Vec<i8>,
    dq: Vec<f32>,
    qsum: Vec<i32>,
    /// `[rows, n_pad]`: scores, then probabilities (0 outside each row's range).
    scores: Vec<f32>,
    /// `[runs, rows, hd]`: each run's value sums (the phase-split path).
    runs: Vec<f32>,
}

impl Bufs {
    fn prepare(&mut self, job: &Job) {
        let hd = job.shape.head_dim;
        let nb = hd / 32;
        self.q.resize(job.rows * hd, 0);
        self.dq.resize(job.rows * nb, 0.0);
        self.qsum.resize(job.rows * nb, 0);
        let q_dim = job.shape.n_heads * hd;
        for r in 0..job.rows {
            let (t, h) = job.row_target(r);
            let x = &job.q[t * q_dim + h * hd..][..hd];
            quantize_query(x, &mut self.q[r * hd..(r + 1) * hd], &mut self.dq[r * nb..(r + 1) * nb], &mut self.qsum[r * nb..(r + 1) * nb]);
        }
        self.scores.resize(job.rows * job.n_pad, 0.0);
    }
}

thread_local! {
    static BUFS: std::cell::RefCell<Vec<Bufs>> = const { std::cell::RefCell::new(Vec::new()) };
}

pub(super) fn attend(shape: &AttnShape, kv: &QuantLayer, bs: usize, queries: &[QueryPos], q: &[f32], out: OutPtr) {
    let group = shape.n_heads / shape.n_kv_heads;
    let tiles = super::tiled::tiles(queries);
    let decode = tiles.iter().all(|t| t.len() == 1);
    let order: Vec<(usize, Range<usize>)> = if decode {
        tiles.iter().flat_map(|t| (0..shape.n_kv_heads).map(move |h| (h, t.clone()))).collect()
    } else {
        (0..shape.n_kv_heads).flat_map(|h| tiles.iter().map(move |t| (h, t.clone()))).collect()
    };
    let jobs: Vec<Job> = order
        .into_iter()
        .map(|(kv_head, tokens)| {
            let base = shape.first_pos(queries[tokens.start].pos) / 16 * 16;
            let n_cells = queries[tokens.end - 1].pos + 1 - base;
            Job { shape, kv, bs, queries, q, rows: tokens.len() * group, tokens, kv_head, group, base, n_cells, n_pad: n_cells.div_ceil(16) * 16 }
        })
        .collect();
    let pool = pool::current();
    let longest = jobs.iter().map(|j| j.n_cells).max().unwrap_or(0);
    if jobs.len() >= 2 * pool.threads() || longest < SPLIT_MIN_CELLS {
        pool.run(jobs.len(), &|i| {
            let job = &jobs[i];
            BUFS.with_borrow_mut(|b| {
                b.resize_with(b.len().max(1), Bufs::default);
                let b = &mut b[0];
                b.prepare(job);
                // SAFETY: AVX2 or AVX-512 (the caller checked); the buffers are sized by `prepare`; the
                // job's output rows are its own.
                unsafe {
                    scores(job, &b.q, &b.dq, &b.qsum, 0..job.n_pad / 16, b.scores.as_mut_ptr());
                    for r in 0..job.rows {
                        finish_row(job, r, &mut b.scores[r * job.n_pad..(r + 1) * job.n_pad]);
                    }
                    for (k, cells) in job.runs().enumerate() {
                        values(job, b.scores.as_ptr(), 0..job.rows, cells, k > 0, &|r| out_row(job, r, out));
                    }
                }
            });
        });
        return;
    }
    split(&jobs, out);
}

/// Row r's output in `out`.
///
/// # Safety
/// `out` is `attend`'s `[n_tokens, n_heads * hd]` output; the row is the caller's alone.
unsafe fn out_row(job: &Job, r: usize, out: OutPtr) -> *mut f32 {
    let (t, h) = job.row_target(r);
    out.0.add((t * job.shape.n_heads + h) * job.shape.head_dim)
}

/// Row r's scores to probabilities: scaled, ggml's softmax over the row's own cells, 0 elsewhere.
fn finish_row(job: &Job, r: usize, row: &mut [f32]) {
    let (t, _) = job.row_target(r);
    let pos = job.queries[t].pos;
    let lo = job.shape.first_pos(pos);
    let (a, b) = (lo - job.base, pos + 1 - job.base);
    row[a..b].iter_mut().for_each(|s| *s *= job.shape.scale);
    soft_max(&mut row[a..b], lo);
    row[..a].fill(0.0);
    row[b..].fill(0.0);
}

/// A few tiles over long contexts (a lone token, a small decode batch): each phase (scores by chunk
/// range, softmax by row, values by run, the runs' fold by row) is one parallel run, so every thread works
/// on every layer. Same bits as one part per tile.
fn split(jobs: &[Job], out: OutPtr) {
    let hd = jobs[0].shape.head_dim;
    BUFS.with_borrow_mut(|bufs| {
        bufs.resize_with(bufs.len().max(jobs.len()), Bufs::default);
        let runs: Vec<Vec<Range<usize>>> = jobs.iter().map(|j| j.runs().collect()).collect();
        for ((job, b), runs) in jobs.iter().zip(bufs.iter_mut()).zip(&runs) {
            b.prepare(job);
            b.runs.resize(runs.len() * job.rows * hd, 0.0);
        }
        // The phases write scores and run sums through these (from `as_mut_ptr`, so writes are allowed);
        // the shared reborrow below reads only the other fields.
        let ptrs: Vec<(OutPtr, OutPtr)> = bufs[..jobs.len()].iter_mut().map(|b| (OutPtr(b.scores.as_mut_ptr()), OutPtr(b.runs.as_mut_ptr()))).collect();
        let bufs = &bufs[..jobs.len()];
        let rows: Vec<(usize, usize)> = jobs.iter().enumerate().flat_map(|(i, j)| (0..j.rows).map(move |r| (i, r))).collect();
        let pool = pool::current();
        let splits = 2 * pool.threads();
        // SAFETY (every phase): AVX2 or AVX-512 (checked by `quant::attend`); each part writes its own
        // score columns, row, run sums or output row, in buffers that outlive the runs.
        pool.run(jobs.len() * splits, &|part| {
            let (i, k) = (part / splits, part % splits);
            let (job, b) = (&jobs[i], &bufs[i]);
            let n = job.n_pad / 16;
            unsafe { scores(job, &b.q, &b.dq, &b.qsum, k * n / splits..(k + 1) * n / splits, ptrs[i].0 .0) };
        });
        pool.run(rows.len(), &|p| {
            let (i, r) = rows[p];
            let n_pad = jobs[i].n_pad;
            finish_row(&jobs[i], r, unsafe { std::slice::from_raw_parts_mut(ptrs[i].0 .0.add(r * n_pad), n_pad) });
        });
        let parts: Vec<(usize, usize)> = runs.iter().enumerate().flat_map(|(i, r)| (0..r.len()).map(move |k| (i, k))).collect();
        pool.run(parts.len(), &|p| {
            let (i, k) = parts[p];
            let job = &jobs[i];
            let dst = |r: usize| unsafe { ptrs[i].1 .0.add((k * job.rows + r) * hd) };
            unsafe { values(job, ptrs[i].0 .0, 0..job.rows, runs[i][k].clone(), false, &dst) };
        });
        pool.run(rows.len(), &|p| {
            let (i, r) = rows[p];
            let job = &jobs[i];
            unsafe {
                let o = std::slice::from_raw_parts_mut(out_row(job, r, out), hd);
                o.copy_from_slice(std::slice::from_raw_parts(ptrs[i].1 .0.add(r * hd), hd));
                for k in 1..runs[i].len() {
                    let run = std::slice::from_raw_parts(ptrs[i].1 .0.add((k * job.rows + r) * hd), hd);
                    o.iter_mut().zip(run).for_each(|(a, &b)| *a += b);
                }
            }
        });
    });
}

fn vnni() -> bool {
    let f = crate::kernels::cpu::CpuFeatures::get();
    avx512_available() && f.avx512vnni && f.avx512bw
}

/// Scores of every row against the 16-cell chunks `chunks`, at `out` (`[rows, n_pad]`); cells past
/// the last get garbage that `finish_row` overwrites.
///
/// # Safety
/// AVX2 or AVX-512; `out` holds `[job.rows, job.n_pad]` floats.
unsafe fn scores(job: &Job, q: &[i8], dq: &[f32], qsum: &[i32], chunks: Range<usize>, out: *mut f32) {
    let rows = Rows { q, dq, qsum, hd: job.shape.head_dim };
    let r = &job.kv.k;
    for ch in chunks {
        let (region, cell0) = job.region(r, job.kv.keys, 16 * ch);
        if 16 * ch + 32 < job.n_cells {
            let (next, c) = job.region(r, job.kv.keys, 16 * ch + 32);
            prefetch_key_chunk(r, next, c);
        }
        let dst = out.add(16 * ch);
        if vnni() {
            let mut r0 = 0;
            while r0 < job.rows {
                let n = (job.rows - r0).min(8);
                let a = (r, region, cell0, &rows, r0, dst.add(r0 * job.n_pad), job.n_pad);
                match n {
                    8 => scores_vnni::<8>(a),
                    7 => scores_vnni::<7>(a),
                    6 => scores_vnni::<6>(a),
                    5 => scores_vnni::<5>(a),
                    4 => scores_vnni::<4>(a),
                    3 => scores_vnni::<3>(a),
                    2 => scores_vnni::<2>(a),
                    _ => scores_vnni::<1>(a),
                }
                r0 += n;
            }
        } else {
            let avxvnni = simd_level() == SimdLevel::AvxVnni;
            let mut r0 = 0;
            while r0 < job.rows {
                let n = (job.rows - r0).min(4);
                for half in 0..2 {
                    let a = (r, region, cell0 + 8 * half, &rows, r0, dst.add(r0 * job.n_pad + 8 * half), job.n_pad);
                    match (avxvnni, n) {
                        (true, 4) => scores_avxvnni::<4>(a),
                        (true, 3) => scores_avxvnni::<3>(a),
                        (true, 2) => scores_avxvnni::<2>(a),
                        (true, _) => scores_avxvnni::<1>(a),
                        (false, 4) => scores_avx2::<4>(a),
                        (false, 3) => scores_avx2::<3>(a),
                        (false, 2) => scores_avx2::<2>(a),
                        (false, _) => scores_avx2::<1>(a),
                    }
                }
                r0 += n;
            }
        }
    }
}

/// Asks for a chunk's key vectors and scales to be brought into L1 (the chunks of one head are a
/// region's worth apart, which the hardware prefetcher did not follow).
#[inline(always)]
unsafe fn prefetch_key_chunk(r: &Region, region: *const u8, cell0: usize) {
    let groups = if r.dtype == KvDtype::Q8_0 { r.hd / 4 } else { r.hd / 8 };
    for j in 0..groups {
        _mm_prefetch::<_MM_HINT_T0>(region.add((j * r.bs + cell0) * 4) as *const i8);
    }
    _mm_prefetch::<_MM_HINT_T0>(region.add(r.scales_at() + 2 * cell0) as *const i8);
}

/// A tile's quantized query rows.
struct Rows<'a> {
    q: &'a [i8],
    dq: &'a [f32],
    qsum: &'a [i32],
    hd: usize,
}

impl Rows<'_> {
    /// Quants `4j..4j + 4` of row r as one i32 (the operand a dot instruction broadcasts).
    #[inline(always)]
    unsafe fn quad(&self, r: usize, j: usize) -> i32 {
        (self.q.as_ptr().add(r * self.hd + 4 * j) as *const i32).read_unaligned()
    }
}

type ScoreArgs<'a> = (&'a Region, *const u8, usize, &'a Rows<'a>, usize, *mut f32, usize);

/// R rows × 16 cells from `cell0`: per 32-value block, dpbusd of the keys (biased to unsigned by 128,
/// or the q4_0 nibbles, biased by 8) with each row's broadcast quants, the bias times Σq subtracted, then
/// the block's term `(dq · dk) · isum` added to the score.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512dq,fma,f16c")]
unsafe fn scores_vnni<const R: usize>((r, region, cell0, rows, r0, dst, stride): ScoreArgs) {
    let (hd, bs) = (r.hd, r.bs);
    let q8 = r.dtype == KvDtype::Q8_0;
    let bias = if q8 { 128 } else { 8 };
    let scales = region.add(r.scales_at() + 2 * cell0);
    let (flip, low) = (_mm512_set1_epi8(-128), _mm512_set1_epi8(0x0F));
    let mut s = [_mm512_setzero_ps(); R];
    for b in 0..hd / 32 {
        let mut acc = [_mm512_setzero_si512(); R];
        if q8 {
            for j in 8 * b..8 * b + 8 {
                let k = _mm512_xor_si512(_mm512_loadu_si512(region.add((j * bs + cell0) * 4) as *const _), flip);
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_dpbusd_epi32(*a, k, _mm512_set1_epi32(rows.quad(r0 + i, j)));
                }
            }
        } else {
            for m in 4 * b..4 * b + 4 {
                let v = _mm512_loadu_si512(region.add((m * bs + cell0) * 4) as *const _);
                let (lo, hi) = (_mm512_and_si512(v, low), _mm512_and_si512(_mm512_srli_epi16::<4>(v), low));
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_dpbusd_epi32(*a, lo, _mm512_set1_epi32(rows.quad(r0 + i, 2 * m)));
                    *a = _mm512_dpbusd_epi32(*a, hi, _mm512_set1_epi32(rows.quad(r0 + i, 2 * m + 1)));
                }
            }
        }
        let dk = _mm512_cvtph_ps(_mm256_loadu_si256(scales.add(2 * b * bs) as *const __m256i));
        let nb = hd / 32;
        for (i, (a, s)) in acc.iter().zip(s.iter_mut()).enumerate() {
            let isum = _mm512_sub_epi32(*a, _mm512_set1_epi32(bias * rows.qsum[(r0 + i) * nb + b]));
            let t = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(rows.dq[(r0 + i) * nb + b]), dk), _mm512_cvtepi32_ps(isum));
            *s = if b == 0 { t } else { _mm512_add_ps(*s, t) };
        }
    }
    for (i, s) in s.iter().enumerate() {
        _mm512_storeu_ps(dst.add(i * stride), *s);
    }
}

/// `scores_vnni` for 8 cells on AVX-VNNI (AVX2 CPUs with `vpdpbusd` on 256-bit registers: Intel client
/// cores since Alder Lake): the keys biased as there, the same integers, so the same bits. A row's 4
/// quants of 8 cells take one `vpdpbusd`, where `scores_avx2` takes `vpsignb`, `vpmaddubsw`, `vpmaddwd`
/// and an add (q8_0).
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn scores_avxvnni<const R: usize>((r, region, cell0, rows, r0, dst, stride): ScoreArgs) {
    let (hd, bs) = (r.hd, r.bs);
    let q8 = r.dtype == KvDtype::Q8_0;
    let bias = if q8 { 128 } else { 8 };
    let scales = region.add(r.scales_at() + 2 * cell0);
    let (flip, low) = (_mm256_set1_epi8(-128), _mm256_set1_epi8(0x0F));
    let mut s = [_mm256_setzero_ps(); R];
    for b in 0..hd / 32 {
        let mut acc = [_mm256_setzero_si256(); R];
        if q8 {
            for j in 8 * b..8 * b + 8 {
                let k = _mm256_xor_si256(_mm256_loadu_si256(region.add((j * bs + cell0) * 4) as *const __m256i), flip);
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_dpbusd_avx_epi32(*a, k, _mm256_set1_epi32(rows.quad(r0 + i, j)));
                }
            }
        } else {
            for m in 4 * b..4 * b + 4 {
                let v = _mm256_loadu_si256(region.add((m * bs + cell0) * 4) as *const __m256i);
                let (lo, hi) = (_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16::<4>(v), low));
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_dpbusd_avx_epi32(*a, lo, _mm256_set1_epi32(rows.quad(r0 + i, 2 * m)));
                    *a = _mm256_dpbusd_avx_epi32(*a, hi, _mm256_set1_epi32(rows.quad(r0 + i, 2 * m + 1)));
                }
            }
        }
        let dk = _mm256_cvtph_ps(_mm_loadu_si128(scales.add(2 * b * bs) as *const __m128i));
        let nb = hd / 32;
        for (i, (a, s)) in acc.iter().zip(s.iter_mut()).enumerate() {
            let isum = _mm256_sub_epi32(*a, _mm256_set1_epi32(bias * rows.qsum[(r0 + i) * nb + b]));
            let t = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(rows.dq[(r0 + i) * nb + b]), dk), _mm256_cvtepi32_ps(isum));
            *s = if b == 0 { t } else { _mm256_add_ps(*s, t) };
        }
    }
    for (i, s) in s.iter().enumerate() {
        _mm256_storeu_ps(dst.add(i * stride), *s);
    }
}

/// `scores_vnni` for 8 cells on AVX2: `maddubs` of |k| with q signed by k (q8_0; no bias), then `madd`
/// with ones to i32; or `maddubs` of the nibbles with q (q4_0; bias 8), summed in i16 over the block.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scores_avx2<const R: usize>((r, region, cell0, rows, r0, dst, stride): ScoreArgs) {
    let (hd, bs) = (r.hd, r.bs);
    let q8 = r.dtype == KvDtype::Q8_0;
    let scales = region.add(r.scales_at() + 2 * cell0);
    let (ones, low) = (_mm256_set1_epi16(1), _mm256_set1_epi8(0x0F));
    let mut s = [_mm256_setzero_ps(); R];
    for b in 0..hd / 32 {
        let mut acc = [_mm256_setzero_si256(); R];
        if q8 {
            for j in 8 * b..8 * b + 8 {
                let k = _mm256_loadu_si256(region.add((j * bs + cell0) * 4) as *const __m256i);
                let ak = _mm256_abs_epi8(k);
                for (i, a) in acc.iter_mut().enumerate() {
                    let sq = _mm256_sign_epi8(_mm256_set1_epi32(rows.quad(r0 + i, j)), k);
                    *a = _mm256_add_epi32(*a, _mm256_madd_epi16(_mm256_maddubs_epi16(ak, sq), ones));
                }
            }
        } else {
            // the block's 8 `maddubs` add up in i16: 16 products of at most 15 · 127 per lane (30,480 <
            // 2^15), so one `madd` per block widens them instead of one per 8 dims
            let mut p16 = [_mm256_setzero_si256(); R];
            for m in 4 * b..4 * b + 4 {
                let v = _mm256_loadu_si256(region.add((m * bs + cell0) * 4) as *const __m256i);
                let (lo, hi) = (_mm256_and_si256(v, low), _mm256_and_si256(_mm256_srli_epi16::<4>(v), low));
                for (i, p) in p16.iter_mut().enumerate() {
                    *p = _mm256_add_epi16(*p, _mm256_maddubs_epi16(lo, _mm256_set1_epi32(rows.quad(r0 + i, 2 * m))));
                    *p = _mm256_add_epi16(*p, _mm256_maddubs_epi16(hi, _mm256_set1_epi32(rows.quad(r0 + i, 2 * m + 1))));
                }
            }
            for (a, p) in acc.iter_mut().zip(&p16) {
                *a = _mm256_madd_epi16(*p, ones);
            }
        }
        let dk = _mm256_cvtph_ps(_mm_loadu_si128(scales.add(2 * b * bs) as *const __m128i));
        let nb = hd / 32;
        for (i, (a, s)) in acc.iter().zip(s.iter_mut()).enumerate() {
            let bias = if q8 { 0 } else { 8 * rows.qsum[(r0 + i) * nb + b] };
            let isum = _mm256_sub_epi32(*a, _mm256_set1_epi32(bias));
            let t = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(rows.dq[(r0 + i) * nb + b]), dk), _mm256_cvtepi32_ps(isum));
            *s = if b == 0 { t } else { _mm256_add_ps(*s, t) };
        }
    }
    for (i, s) in s.iter().enumerate() {
        _mm256_storeu_ps(dst.add(i * stride), *s);
    }
}

/// The value chains of rows `rows` (probabilities at `w`, stride `n_pad`) over `cells` (one run's):
/// stored into `out(r)`, or added to it (`add`: the later runs of a fold).
///
/// # Safety
/// AVX2 or AVX-512; `out(r)` is valid for `hd` writes that no one else makes meanwhile.
unsafe fn values(job: &Job, w: *const f32, rows: Range<usize>, cells: Range<usize>, add: bool, out: &dyn Fn(usize) -> *mut f32) {
    let hd = job.shape.head_dim;
    if avx512_available() {
        let mut r0 = rows.start;
        while r0 < rows.end {
            let n = (rows.end - r0).min(6);
            for v0 in (0..hd / 16).step_by(4) {
                let a = (job, w, r0, cells.clone(), v0, add, out);
                // 64 dims at a time; a head of 32 (or 32 past a multiple of 64) takes one pass of 32
                match (n, hd / 16 - v0 >= 4) {
                    (6, true) => values_avx512::<6, 4>(a),
                    (5, true) => values_avx512::<5, 4>(a),
                    (4, true) => values_avx512::<4, 4>(a),
                    (3, true) => values_avx512::<3, 4>(a),
                    (2, true) => values_avx512::<2, 4>(a),
                    (_, true) => values_avx512::<1, 4>(a),
                    (6, false) => values_avx512::<6, 2>(a),
                    (5, false) => values_avx512::<5, 2>(a),
                    (4, false) => values_avx512::<4, 2>(a),
                    (3, false) => values_avx512::<3, 2>(a),
                    (2, false) => values_avx512::<2, 2>(a),
                    (_, false) => values_avx512::<1, 2>(a),
                }
            }
            r0 += n;
        }
    } else if rows.len() >= super::key_order::BUFFERED_MIN_ROWS {
        // each cell dequantized once for all the rows (`key_order::buffered_avx2`), not once per 5
        let r = &job.kv.v;
        let src = |j: usize, dst: *mut f32| {
            let (region, c) = job.region(r, job.kv.values, j);
            if j % 16 == 0 && j + 32 < cells.end {
                let (next, c) = job.region(r, job.kv.values, j + 32);
                prefetch_value_chunk(r, next, c);
            }
            dequant_row_avx2(r, region, c, dst)
        };
        super::key_order::with_chunk_bufs(hd, rows.len(), |vbuf, acc| super::key_order::buffered_avx2(hd, job.n_pad, w, rows, cells.clone(), add, out, vbuf, acc, &src));
    } else {
        let mut r0 = rows.start;
        while r0 < rows.end {
            let n = (rows.end - r0).min(5);
            for v0 in (0..hd / 8).step_by(2) {
                let a = (job, w, r0, cells.clone(), v0, add, out);
                match n {
                    5 => values_avx2::<5>(a),
                    4 => values_avx2::<4>(a),
                    3 => values_avx2::<3>(a),
                    2 => values_avx2::<2>(a),
                    _ => values_avx2::<1>(a),
                }
            }
            r0 += n;
        }
    }
}

type ValueArgs<'a> = (&'a Job<'a>, *const f32, usize, Range<usize>, usize, bool, &'a dyn Fn(usize) -> *mut f32);

/// Chunk `ch` of a value pass over `cells`: its region, the block index of its first cell, and its cells
/// that are in `cells`. It also asks for the chunk two ahead to be brought into L1 (its cells' rows and
/// scales): a head's chunks are regions apart, which the hardware prefetcher did not follow from DRAM.
/// (A function, not an iterator's closure: closures are compiled without the caller's target features
/// and were not inlined, 3% of a decode step.)
#[inline(always)]
unsafe fn value_chunk(job: &Job, r: &Region, ch: usize, cells: &Range<usize>) -> (*const u8, usize, Range<usize>) {
    if 16 * ch + 32 < cells.end {
        let (next, c) = job.region(r, job.kv.values, 16 * ch + 32);
        let row_bytes = r.dtype.quant_bytes(r.hd);
        for line in (c * row_bytes..(c + 16) * row_bytes).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(next.add(line) as *const i8);
        }
        for b in 0..r.hd / 32 {
            _mm_prefetch::<_MM_HINT_T0>(next.add(r.scales_at() + 2 * (b * r.bs + c)) as *const i8);
        }
    }
    let (region, cell0) = job.region(r, job.kv.values, 16 * ch);
    (region, cell0, (16 * ch).max(cells.start)..(16 * ch + 16).min(cells.end))
}

/// Asks for the 16 value rows from cell `c` of a region, and their scales, to be brought into L1.
#[inline(always)]
unsafe fn prefetch_value_chunk(r: &Region, region: *const u8, c: usize) {
    let row_bytes = r.dtype.quant_bytes(r.hd);
    for line in (c * row_bytes..(c + 16) * row_bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(region.add(line) as *const i8);
    }
    for b in 0..r.hd / 32 {
        _mm_prefetch::<_MM_HINT_T0>(region.add(r.scales_at() + 2 * (b * r.bs + c)) as *const i8);
    }
}

/// Cell `c`'s `hd` values of a value region, dequantized exactly (`q · d`) into `dst` as f32.
///
/// # Safety
/// AVX2; `region` is a value region of `r`, `dst` has room for `r.hd` floats.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant_row_avx2(r: &Region, region: *const u8, c: usize, dst: *mut f32) {
    let (hd, bs) = (r.hd, r.bs);
    let row = region.add(c * r.dtype.quant_bytes(hd));
    let (low, eight) = (_mm256_set1_epi32(0x0F), _mm256_set1_epi32(8));
    for b in 0..hd / 32 {
        let d = _mm256_set1_ps(half::f16::from_bits((region.add(r.scales_at() + 2 * (b * bs + c)) as *const u16).read_unaligned()).to_f32());
        let out = dst.add(32 * b);
        if r.dtype == KvDtype::Q8_0 {
            for k in 0..4 {
                let qi = _mm256_cvtepi8_epi32(_mm_loadl_epi64(row.add(32 * b + 8 * k) as *const __m128i));
                _mm256_storeu_ps(out.add(8 * k), _mm256_mul_ps(_mm256_cvtepi32_ps(qi), d));
            }
        } else {
            // a block's 16 bytes: dims 0..16 in the low nibbles, 16..32 in the high ones
            for k in 0..2 {
                let n = _mm256_cvtepu8_epi32(_mm_loadl_epi64(row.add(16 * b + 8 * k) as *const __m128i));
                let (lo, hi) = (_mm256_sub_epi32(_mm256_and_si256(n, low), eight), _mm256_sub_epi32(_mm256_srli_epi32::<4>(n), eight));
                _mm256_storeu_ps(out.add(8 * k), _mm256_mul_ps(_mm256_cvtepi32_ps(lo), d));
                _mm256_storeu_ps(out.add(16 + 8 * k), _mm256_mul_ps(_mm256_cvtepi32_ps(hi), d));
            }
        }
    }
}

/// R rows × dims `16·v0 .. 16·v0 + 16·NV` (NV = 4: two scale blocks; 2: one): per cell the values
/// dequantized once (`q · d`, exact), then one FMA per row and vector.
#[target_feature(enable = "avx512f,avx512bw,fma,f16c")]
unsafe fn values_avx512<const R: usize, const NV: usize>((job, w, r0, cells, v0, add, out): ValueArgs) {
    let r = &job.kv.v;
    let (hd, bs) = (r.hd, r.bs);
    let q8 = r.dtype == KvDtype::Q8_0;
    let row_bytes = r.dtype.quant_bytes(hd);
    let (low, eight) = (_mm512_set1_epi32(0x0F), _mm512_set1_epi32(8));
    let mut acc = [[_mm512_setzero_ps(); NV]; R];
    for ch in cells.start / 16..cells.end.div_ceil(16) {
        let (region, cell0, span) = value_chunk(job, r, ch, &cells);
        let scales = region.add(r.scales_at() + 2 * cell0);
        let mut d = [[0f32; 16]; 2];
        for (k, d) in d.iter_mut().enumerate().take(NV / 2) {
            _mm512_storeu_ps(d.as_mut_ptr(), _mm512_cvtph_ps(_mm256_loadu_si256(scales.add(2 * (v0 / 2 + k) * bs) as *const __m256i)));
        }
        for c in span {
            let cell = region.add((cell0 + c % 16) * row_bytes);
            let mut x = [_mm512_setzero_ps(); NV];
            if q8 {
                for (k, x) in x.iter_mut().enumerate() {
                    let qi = _mm512_cvtepi8_epi32(_mm_loadu_si128(cell.add(16 * (v0 + k)) as *const __m128i));
                    *x = _mm512_mul_ps(_mm512_cvtepi32_ps(qi), _mm512_set1_ps(d[k / 2][c % 16]));
                }
            } else {
                for k in 0..NV / 2 {
                    let b = v0 / 2 + k;
                    let n = _mm512_cvtepu8_epi32(_mm_loadu_si128(cell.add(16 * b) as *const __m128i));
                    let dv = _mm512_set1_ps(d[k][c % 16]);
                    x[2 * k] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(n, low), eight)), dv);
                    x[2 * k + 1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32::<4>(n), eight)), dv);
                }
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                let p = _mm512_set1_ps(*w.add((r0 + i) * job.n_pad + c));
                for (a, x) in acc.iter_mut().zip(&x) {
                    *a = _mm512_fmadd_ps(p, *x, *a);
                }
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        let o = out(r0 + i).add(16 * v0);
        for (k, a) in acc.iter().enumerate() {
            let v = if add { _mm512_add_ps(_mm512_loadu_ps(o.add(16 * k)), *a) } else { *a };
            _mm512_storeu_ps(o.add(16 * k), v);
        }
    }
}

/// `values_avx512` for dims `8·v0 .. 8·v0 + 16` (half a scale block) on AVX2.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values_avx2<const R: usize>((job, w, r0, cells, v0, add, out): ValueArgs) {
    let r = &job.kv.v;
    let (hd, bs) = (r.hd, r.bs);
    let q8 = r.dtype == KvDtype::Q8_0;
    let row_bytes = r.dtype.quant_bytes(hd);
    let (b, high) = (v0 / 4, v0 % 4 >= 2);
    let (low, eight) = (_mm256_set1_epi32(0x0F), _mm256_set1_epi32(8));
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    for ch in cells.start / 16..cells.end.div_ceil(16) {
        let (region, cell0, span) = value_chunk(job, r, ch, &cells);
        let mut d = [0f32; 16];
        let scales = region.add(r.scales_at() + 2 * (b * bs + cell0));
        _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(scales as *const __m128i)));
        _mm256_storeu_ps(d.as_mut_ptr().add(8), _mm256_cvtph_ps(_mm_loadu_si128(scales.add(16) as *const __m128i)));
        for c in span {
            let cell = region.add((cell0 + c % 16) * row_bytes);
            let dv = _mm256_set1_ps(d[c % 16]);
            let mut x = [_mm256_setzero_ps(); 2];
            for (k, x) in x.iter_mut().enumerate() {
                let qi = if q8 {
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64(cell.add(8 * (v0 + k)) as *const __m128i))
                } else {
                    let n = _mm256_cvtepu8_epi32(_mm_loadl_epi64(cell.add(16 * b + 8 * k) as *const __m128i));
                    _mm256_sub_epi32(if high { _mm256_srli_epi32::<4>(n) } else { _mm256_and_si256(n, low) }, eight)
                };
                *x = _mm256_mul_ps(_mm256_cvtepi32_ps(qi), dv);
            }
            for (i, acc) in acc.iter_mut().enumerate() {
                let p = _mm256_set1_ps(*w.add((r0 + i) * job.n_pad + c));
                for (a, x) in acc.iter_mut().zip(&x) {
                    *a = _mm256_fmadd_ps(p, *x, *a);
                }
            }
        }
    }
    for (i, acc) in acc.iter().enumerate() {
        let o = out(r0 + i).add(8 * v0);
        for (k, a) in acc.iter().enumerate() {
            let v = if add { _mm256_add_ps(_mm256_loadu_ps(o.add(8 * k)), *a) } else { *a };
            _mm256_storeu_ps(o.add(8 * k), v);
        }
    }
}

//! Prefill attention by tiles, AVX-512 (or AVX2, whose score and value loops are in `tiled_avx2`): one part handles one KV head for a run of consecutive query
//! tokens of one sequence, all `group` query heads of that KV head together ("rows"). Each key and value
//! is converted from f16 once per tile instead of once per (token, head), and then serves every row from
//! L1; at depth that conversion and the L2 latency of the strided K/V rows were most of attention's time.
//!
//! Every output keeps the numerics of the per-(token, head) path in `super::head`, so results are
//! bit-identical to it (and to llama.cpp): the same f16-rounded q, the same product and addition trees per
//! score (`reduce_16_rows`), the same softmax call per row, and the same per-lane value sums. Rows in a
//! tile attend to slightly different ranges (causal mask, sliding window); a cell outside a row's range
//! gets weight +0, and `acc + 0·v == acc` exactly for finite v, so the padding adds nothing.

use super::{slot_runs, AttnShape, OutPtr, QueryPos};
use crate::kernels::ggml::math::avx512::{reduce_16_rows, reduce_finish, reduce_pair_16, reduce_pair_4, reduce_pair_8};
use crate::kernels::ggml::math::{avx512_available, reduce_lane_rows, round_through_f16, soft_max};
use half::f16;
use std::arch::x86_64::*;
use std::ops::Range;

/// Query tokens per tile. Rows = tokens × group (24 for SmolLM2, 32 for Gemma-3, 56 for Qwen2.5); the
/// scores of a tile at depth 4096 take rows × 16 KiB, which stays in L2.
pub(super) const TILE_TOKENS: usize = 8;

/// Rows whose value sums are held in registers at once (× 4 vectors of 16 values).
const ROWS_PER_PASS: usize = 6;
/// Value vectors (16 values each) per pass over a lane's cells.
const VECS_PER_PASS: usize = 4;

/// How many 16-cell chunks ahead the score pass prefetches keys: one chunk is less work at decode than a
/// DRAM access takes, and serving reads K/V from DRAM (8 sequences × a few hundred cells of 30 layers is
/// more than L3).
pub(super) const SCORE_PREFETCH_CHUNKS: usize = 3;

/// How many cells ahead (in a lane) the value pass prefetches.
pub(super) const PREFETCH_CELLS: usize = 4;

/// Splits the batch into runs of consecutive positions of one sequence, at most `TILE_TOKENS` long.
pub(super) fn tiles(queries: &[QueryPos]) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = Vec::new();
    for (t, qp) in queries.iter().enumerate() {
        if let Some(last) = out.last_mut() {
            let prev = &queries[t - 1];
            let same_seq = std::ptr::eq(prev.block_table, qp.block_table) && prev.pos + 1 == qp.pos;
            if same_seq && last.len() < TILE_TOKENS {
                last.end = t + 1;
                continue;
            }
        }
        out.push(t..t + 1);
    }
    out
}

/// One tile's inputs: the layer's K/V storage and which tokens and KV head to attend.
pub(super) struct TileJob<'a> {
    pub shape: &'a AttnShape,
    pub queries: &'a [QueryPos<'a>],
    /// `[n_tokens, n_heads * head_dim]`
    pub q: &'a [f32],
    pub keys: &'a [f16],
    pub values: &'a [f16],
    pub kv_dim: usize,
    pub block_size: usize,
    pub tokens: Range<usize>,
    pub kv_head: usize,
    /// Keys stored by dimension: scores by `by_dim`'s chains.
    pub keys_by_dim: bool,
}

/// Per-worker buffers, reused across tiles.
#[derive(Default)]
pub(super) struct TileScratch {
    /// `[rows, hd]`: each row's q rounded to f16 (kept as f32).
    q32: Vec<f32>,
    /// Row offsets of the tile's cells (positions `lo..=hi`) of this KV head in the layer storage.
    offsets: Vec<usize>,
    /// `[16, hd]` keys of one chunk, converted to f32.
    kbuf: Vec<f32>,
    /// `[rows, n_pad]`: scores, then the f16-rounded probabilities (0 outside each row's range).
    scores: Vec<f32>,
    /// `[ROWS_PER_PASS, 64, hd]`: per-lane value sums of the rows of one pass.
    lanes: Vec<f32>,
}

/// The cells and rows of a tile.
#[derive(Clone, Copy)]
pub(super) struct TileGeom {
    group: usize,
    pub(super) rows: usize,
    /// First attended position (of the first token) and the number of cells up to the last token's.
    pub(super) lo0: usize,
    pub(super) n_keys: usize,
    /// `n_keys` rounded up to whole 16-cell chunks: the row stride of the scores.
    pub(super) n_pad: usize,
}

impl TileGeom {
    /// One row over `n_keys` cells from position `lo0` (the per-head path's value pass).
    pub(super) fn one_row(lo0: usize, n_keys: usize) -> TileGeom {
        TileGeom { group: 1, rows: 1, lo0, n_keys, n_pad: n_keys }
    }
}

impl TileJob<'_> {
    fn lo(&self, pos: usize) -> usize {
        self.shape.first_pos(pos)
    }

    fn geom(&self) -> TileGeom {
        let group = self.shape.n_heads / self.shape.n_kv_heads;
        let lo0 = self.lo(self.queries[self.tokens.start].pos);
        let n_keys = self.queries[self.tokens.end - 1].pos + 1 - lo0;
        TileGeom { group, rows: self.tokens.len() * group, lo0, n_keys, n_pad: n_keys.div_ceil(16) * 16 }
    }

    /// Keys stored by dimension, read for this tile's sequence and KV head.
    fn by_dim(&self) -> super::by_dim::ByDimKeys<'_> {
        let (hd, n_kv_heads) = (self.shape.head_dim, self.shape.n_kv_heads);
        let block_table = self.queries[self.tokens.start].block_table;
        super::by_dim::ByDimKeys { keys: self.keys, n_kv_heads, hd, bs: self.block_size, block_table, kv_head: self.kv_head }
    }

    /// The units `chunk_scores` splits a tile's cells into: 16-cell chunks from the first cell, or with
    /// keys by dimension their groups (aligned to positions, so one more where the first is not).
    fn n_score_chunks(&self, g: &TileGeom) -> usize {
        if self.keys_by_dim {
            self.by_dim().n_groups(super::by_dim::Cells { lo0: g.lo0, n_keys: g.n_keys })
        } else {
            g.n_pad / 16
        }
    }

    /// Where each attended cell's key/value row of this KV head starts in the layer storage.
    fn fill_offsets(&self, g: &TileGeom, offsets: &mut Vec<usize>) {
        let kv_off = self.kv_head * self.shape.head_dim;
        offsets.clear();
        let first = &self.queries[self.tokens.start];
        for (_, first_slot, len) in slot_runs(first.block_table, self.block_size, g.lo0, g.lo0 + g.n_keys - 1) {
            offsets.extend((first_slot..first_slot + len).map(|slot| slot * self.kv_dim + kv_off));
        }
    }

    /// `q32[r]` = q of row r (token `r / group`, head `kv_head * group + r % group`) rounded to f16.
    fn fill_rounded_queries(&self, g: &TileGeom, q32: &mut Vec<f32>) {
        let hd = self.shape.head_dim;
        let q_dim = self.shape.n_heads * hd;
        q32.clear();
        for t in self.tokens.clone() {
            q32.extend_from_slice(&self.q[t * q_dim + self.kv_head * g.group * hd..][..g.group * hd]);
        }
        round_through_f16(q32);
    }

    /// (token, head) of row r.
    fn row_target(&self, g: &TileGeom, r: usize) -> (usize, usize) {
        (self.tokens.start + r / g.group, self.kv_head * g.group + r % g.group)
    }

    /// Row r's output (`hd` floats) in `out`.
    ///
    /// # Safety
    /// `out` must be the `[n_tokens, n_heads * hd]` output of `attend`, and no one else may use this row.
    #[allow(clippy::mut_from_ref)]
    unsafe fn out_row(&self, g: &TileGeom, r: usize, out: OutPtr) -> &mut [f32] {
        let hd = self.shape.head_dim;
        let (t, head) = self.row_target(g, r);
        std::slice::from_raw_parts_mut(out.0.add(t * self.shape.n_heads * hd + head * hd), hd)
    }
}

/// Attention for one tile; writes the `group` head outputs of each of its tokens.
///
/// # Safety
/// The CPU must have AVX-512 F/DQ or AVX2, and FMA and F16C. `out` must point at `[n_tokens, n_heads *
/// hd]` floats of which this call alone writes the chunks of (token in `job.tokens`, head of
/// `job.kv_head`).
pub(super) unsafe fn attend_tile(job: &TileJob, sc: &mut TileScratch, out: OutPtr) {
    let hd = job.shape.head_dim;
    let g = job.geom();
    job.fill_rounded_queries(&g, &mut sc.q32);
    job.fill_offsets(&g, &mut sc.offsets);
    sc.scores.clear();
    sc.scores.resize(g.rows * g.n_pad, 0.0);
    chunk_scores(job, &g, &sc.offsets, &sc.q32, 0..job.n_score_chunks(&g), &mut sc.kbuf, sc.scores.as_mut_ptr());
    for r in 0..g.rows {
        finish_row(job, &g, r, &mut sc.scores[r * g.n_pad..(r + 1) * g.n_pad]);
    }
    if job.shape.values_in_key_order {
        let w = sc.scores.as_ptr();
        let out_row = |r: usize| job.out_row(&g, r, out).as_mut_ptr();
        return super::key_order::values(job.values, hd, &g, &sc.offsets, w, 0..g.rows, &out_row);
    }
    sc.lanes.resize(ROWS_PER_PASS * 64 * hd, 0.0);
    for r0 in (0..g.rows).step_by(ROWS_PER_PASS) {
        let rs = ROWS_PER_PASS.min(g.rows - r0);
        lane_sums(job, &g, &sc.offsets, sc.scores.as_ptr().add(r0 * g.n_pad), rs, 0..64, sc.lanes.as_mut_ptr());
        for r in r0..r0 + rs {
            reduce_lane_rows(&mut sc.lanes[(r - r0) * 64 * hd..(r - r0 + 1) * 64 * hd], hd, job.out_row(&g, r, out));
        }
    }
}

/// Row r's scores to probabilities: scaled, ggml's softmax over the row's own cells, rounded to f16, and
/// +0 for the tile's cells outside the row's range.
fn finish_row(job: &TileJob, g: &TileGeom, r: usize, row: &mut [f32]) {
    let (t, _) = job.row_target(g, r);
    let pos = job.queries[t].pos;
    let (a, b) = (job.lo(pos) - g.lo0, pos + 1 - g.lo0);
    row[a..b].iter_mut().for_each(|s| *s *= job.shape.scale);
    soft_max(&mut row[a..b], job.lo(pos));
    round_through_f16(&mut row[a..b]);
    row[..a].fill(0.0);
    row[b..].fill(0.0);
}

/// Decode-sized batches at depth: the tiles' phases (scores by key range, softmax by row, value sums by
/// lane range, reduction by row) each run as parallel parts, so a single token's few KV heads still use
/// every thread, and the group's heads share each key and value conversion. Same bits as `attend_tile`.
///
/// # Safety
/// The CPU must have AVX-512 F/DQ or AVX2, and FMA and F16C; `jobs` must cover disjoint outputs of `out`, the
/// `[n_tokens, n_heads * hd]` output of `attend`.
pub(super) unsafe fn attend_split(jobs: &[TileJob], out: OutPtr) {
    let Some(first) = jobs.first() else { return };
    let hd = first.shape.head_dim;
    let geoms: Vec<TileGeom> = jobs.iter().map(|j| j.geom()).collect();
    // Buffers kept from the previous call (this runs once per layer per decode step): every element the
    // phases read is written first, so they are resized, never cleared.
    SPLIT_BUFS.with_borrow_mut(|bufs| {
        bufs.resize_with(bufs.len().max(jobs.len()), SplitBufs::default);
        for ((job, g), b) in jobs.iter().zip(&geoms).zip(bufs.iter_mut()) {
            job.fill_rounded_queries(g, &mut b.q32);
            job.fill_offsets(g, &mut b.offsets);
            b.scores.resize(g.rows * g.n_pad, 0.0);
            if job.shape.values_in_key_order {
                // the runs' partial sums: [run, rows, hd]
                b.lanes.resize(super::key_order::runs(g).count() * g.rows * hd, 0.0);
            } else {
                b.lanes.resize(g.rows * 64 * hd, 0.0);
            }
        }
        run_split_phases(jobs, &geoms, &mut bufs[..jobs.len()], out);
    });
}

/// The four phases of `attend_split` over prepared buffers.
///
/// # Safety
/// As `attend_split`.
unsafe fn run_split_phases(jobs: &[TileJob], geoms: &[TileGeom], bufs: &mut [SplitBufs], out: OutPtr) {
    let hd = jobs[0].shape.head_dim;
    let ptrs: Vec<(OutPtr, OutPtr)> = bufs.iter_mut().map(|b| (OutPtr(b.scores.as_mut_ptr()), OutPtr(b.lanes.as_mut_ptr()))).collect();
    let bufs = &*bufs;
    let rows: Vec<(usize, usize)> = geoms.iter().enumerate().flat_map(|(i, g)| (0..g.rows).map(move |r| (i, r))).collect();
    let pool = crate::pool::current();
    let key_splits = 2 * pool.threads();
    // SAFETY (all four phases): AVX-512 or AVX2 per the contract; every part writes a disjoint range (its chunks'
    // score columns, its row, its lanes, its output row) of buffers that outlive the runs.
    pool.run(jobs.len() * key_splits, &|part| {
        let (i, k) = (part / key_splits, part % key_splits);
        let (b, g) = (&bufs[i], &geoms[i]);
        let n_chunks = jobs[i].n_score_chunks(g);
        let chunks = k * n_chunks / key_splits..(k + 1) * n_chunks / key_splits;
        SPLIT_KBUF.with_borrow_mut(|kbuf| unsafe { chunk_scores(&jobs[i], g, &b.offsets, &b.q32, chunks, kbuf, ptrs[i].0 .0) });
    });
    pool.run(rows.len(), &|p| {
        let (i, r) = rows[p];
        let g = &geoms[i];
        let row = unsafe { std::slice::from_raw_parts_mut(ptrs[i].0 .0.add(r * g.n_pad), g.n_pad) };
        finish_row(&jobs[i], g, r, row);
    });
    if jobs[0].shape.values_in_key_order {
        // Parts by (tile, run of positions), all the tile's rows (they share each value's conversion),
        // into the run buffers; then each row's runs added in order (`key_order`).
        let runs: Vec<Vec<Range<usize>>> = geoms.iter().map(|g| super::key_order::runs(g).collect()).collect();
        let parts: Vec<(usize, usize)> = runs.iter().enumerate().flat_map(|(i, r)| (0..r.len()).map(move |k| (i, k))).collect();
        pool.run(parts.len(), &|part| {
            let (i, k) = parts[part];
            let (b, g) = (&bufs[i], &geoms[i]);
            let run_out = |r: usize| unsafe { ptrs[i].1 .0.add((k * g.rows + r) * hd) };
            unsafe { super::key_order::run_values(jobs[i].values, hd, g, &b.offsets, ptrs[i].0 .0, 0..g.rows, runs[i][k].clone(), false, &run_out) };
        });
        pool.run(rows.len(), &|p| {
            let (i, r) = rows[p];
            let g = &geoms[i];
            unsafe {
                let o = jobs[i].out_row(g, r, out);
                o.copy_from_slice(std::slice::from_raw_parts(ptrs[i].1 .0.add(r * hd), hd));
                for k in 1..runs[i].len() {
                    let run = std::slice::from_raw_parts(ptrs[i].1 .0.add((k * g.rows + r) * hd), hd);
                    o.iter_mut().zip(run).for_each(|(a, &b)| *a += b);
                }
            }
        });
        return;
    }
    const LANE_SPLITS: usize = 4;
    pool.run(jobs.len() * LANE_SPLITS, &|part| {
        let (i, k) = (part / LANE_SPLITS, part % LANE_SPLITS);
        let (b, g) = (&bufs[i], &geoms[i]);
        let lanes = k * 64 / LANE_SPLITS..(k + 1) * 64 / LANE_SPLITS;
        for r0 in (0..g.rows).step_by(ROWS_PER_PASS) {
            let rs = ROWS_PER_PASS.min(g.rows - r0);
            unsafe {
                let w = ptrs[i].0 .0.add(r0 * g.n_pad);
                lane_sums(&jobs[i], g, &b.offsets, w, rs, lanes.clone(), ptrs[i].1 .0.add(r0 * 64 * hd));
            }
        }
    });
    pool.run(rows.len(), &|p| {
        let (i, r) = rows[p];
        let g = &geoms[i];
        unsafe {
            let lanes = std::slice::from_raw_parts_mut(ptrs[i].1 .0.add(r * 64 * hd), 64 * hd);
            reduce_lane_rows(lanes, hd, jobs[i].out_row(g, r, out));
        }
    });
}

/// One split tile's buffers, reused across calls; the phases write scores and lanes through raw pointers
/// (disjoint ranges per part).
#[derive(Default)]
struct SplitBufs {
    q32: Vec<f32>,
    offsets: Vec<usize>,
    /// `[rows, n_pad]`
    scores: Vec<f32>,
    /// `[rows, 64, hd]` (ggml's value lanes), or `[runs, rows, hd]` (values in key order)
    lanes: Vec<f32>,
}

thread_local! {
    static SPLIT_KBUF: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    static SPLIT_BUFS: std::cell::RefCell<Vec<SplitBufs>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Scores of every row against the cells of 16-cell chunks `chunks`, written at `scores` (`[rows, n_pad]`):
/// each chunk's keys are converted to f32 once, then each row's 16 dots run as in `dot_f16_f32_x16`
/// (cells past the range score garbage that `finish_row` overwrites with 0). With keys by dimension,
/// `chunks` are `by_dim`'s groups and the scores its chains.
///
/// # Safety
/// AVX-512 F/DQ or AVX2, with FMA and F16C; `scores` has `[g.rows, g.n_pad]` floats.
unsafe fn chunk_scores(job: &TileJob, g: &TileGeom, offsets: &[usize], q32: &[f32], chunks: Range<usize>, kbuf: &mut Vec<f32>, scores: *mut f32) {
    if job.keys_by_dim {
        let cells = super::by_dim::Cells { lo0: g.lo0, n_keys: g.n_keys };
        return super::by_dim::scores(&job.by_dim(), cells, q32, g.rows, chunks, scores, g.n_pad);
    }
    if avx512_available() {
        chunk_scores_avx512(job, g, offsets, q32, chunks, kbuf, scores)
    } else {
        super::tiled_avx2::chunk_scores(job.keys, job.shape.head_dim, g, offsets, q32, chunks, kbuf, scores)
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn chunk_scores_avx512(job: &TileJob, g: &TileGeom, offsets: &[usize], q32: &[f32], chunks: Range<usize>, kbuf: &mut Vec<f32>, scores: *mut f32) {
    // A compile-time vector count keeps q and the sums in registers and unrolls the dots.
    let args = (job.keys, g, offsets, q32, chunks, kbuf, scores);
    match job.shape.head_dim / 16 {
        // Decode tiles of a small GQA group (SmolLM2: 3 query heads per KV head).
        4 if g.rows == 1 => chunk_scores_few_64::<1>(args),
        4 if g.rows == 2 => chunk_scores_few_64::<2>(args),
        4 if g.rows == 3 => chunk_scores_few_64::<3>(args),
        4 => chunk_scores_nv::<4>(args),
        8 => chunk_scores_nv::<8>(args),
        16 => chunk_scores_nv::<16>(args),
        nv => unreachable!("tiles need a head size of 64, 128 or 256, not {}", nv * 16),
    }
}

type ScoreArgs<'a> = (&'a [f16], &'a TileGeom, &'a [usize], &'a [f32], Range<usize>, &'a mut Vec<f32>, *mut f32);

#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn chunk_scores_nv<const NV: usize>((keys, g, offsets, q32, chunks, kbuf, scores): ScoreArgs) {
    let hd = NV * 16;
    kbuf.resize(16 * hd, 0.0);
    for c0 in chunks.map(|c| 16 * c) {
        // The next chunk's keys: rows `kv_dim` apart within a block, blocks anywhere; the hardware
        // prefetcher did not keep up at decode (profile: the key loads waited on L3).
        for &off in offsets.iter().skip(c0 + 16 * SCORE_PREFETCH_CHUNKS).take(16) {
            for line in (0..hd * 2).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>((keys.as_ptr().add(off) as *const i8).add(line));
            }
        }
        for c in 0..16 {
            let dst = kbuf.as_mut_ptr().add(c * hd);
            if c0 + c < g.n_keys {
                let src = keys.as_ptr().add(offsets[c0 + c]) as *const __m256i;
                for k in 0..NV {
                    _mm512_storeu_ps(dst.add(16 * k), _mm512_cvtph_ps(_mm256_loadu_si256(src.add(k))));
                }
            } else {
                std::ptr::write_bytes(dst, 0, hd);
            }
        }
        for r in 0..g.rows {
            let mut q = [_mm512_setzero_ps(); NV];
            for (k, qk) in q.iter_mut().enumerate() {
                *qk = _mm512_loadu_ps(q32.as_ptr().add(r * hd + 16 * k));
            }
            let s = reduce_16_rows(&key_sums::<NV>(kbuf.as_ptr(), &q));
            _mm512_storeu_ps(scores.add(r * g.n_pad + c0), s);
        }
    }
}

/// `chunk_scores_nv::<4>` for tiles of R ≤ 3 rows (head size 64), the same operations without the f32
/// key buffer: with so few rows, writing each converted key to memory and reading it back per row cost
/// more than the dots. Keys come in pairs, straight from f16 registers, and each row's 16-key reduction
/// tree (`reduce_16_rows`'s levels) is run as its pairs arrive, so a row holds at most three partial sums.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn chunk_scores_few_64<const R: usize>((keys, g, offsets, q32, chunks, _kbuf, scores): ScoreArgs) {
    let zero = _mm512_setzero_ps();
    let mut q = [[zero; 4]; R];
    for (r, qr) in q.iter_mut().enumerate() {
        for (k, qk) in qr.iter_mut().enumerate() {
            *qk = _mm512_loadu_ps(q32.as_ptr().add(r * 64 + 16 * k));
        }
    }
    for c0 in chunks.map(|c| 16 * c) {
        for &off in offsets.iter().skip(c0 + 16 * SCORE_PREFETCH_CHUNKS).take(16) {
            for line in (0..128).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>((keys.as_ptr().add(off) as *const i8).add(line));
            }
        }
        let (mut x_half, mut y_half, mut z_half, mut out) = ([zero; R], [zero; R], [zero; R], [zero; R]);
        for pair in 0..8 {
            let ka = key64(keys, offsets, g.n_keys, c0 + 2 * pair);
            let kb = key64(keys, offsets, g.n_keys, c0 + 2 * pair + 1);
            for r in 0..R {
                let x = reduce_pair_16(key_sum64(&ka, &q[r]), key_sum64(&kb, &q[r]));
                if pair % 2 == 0 {
                    x_half[r] = x;
                    continue;
                }
                let y = reduce_pair_8(x_half[r], x);
                if pair % 4 == 1 {
                    y_half[r] = y;
                    continue;
                }
                let z = reduce_pair_4(y_half[r], y);
                if pair == 3 {
                    z_half[r] = z;
                } else {
                    out[r] = reduce_finish(z_half[r], z);
                }
            }
        }
        for (r, o) in out.iter().enumerate() {
            _mm512_storeu_ps(scores.add(r * g.n_pad + c0), *o);
        }
    }
}

/// Key `c` of the tile (64 values) as f32, or zeros past the last key (as the key buffer's padding).
#[inline(always)]
unsafe fn key64(keys: &[f16], offsets: &[usize], n_keys: usize, c: usize) -> [__m512; 4] {
    if c >= n_keys {
        return [_mm512_setzero_ps(); 4];
    }
    let src = keys.as_ptr().add(offsets[c]) as *const __m256i;
    // Spelled out, no closure: one left out of line would lose the caller's AVX-512 features.
    [
        _mm512_cvtph_ps(_mm256_loadu_si256(src)),
        _mm512_cvtph_ps(_mm256_loadu_si256(src.add(1))),
        _mm512_cvtph_ps(_mm256_loadu_si256(src.add(2))),
        _mm512_cvtph_ps(_mm256_loadu_si256(src.add(3))),
    ]
}

/// Head size 64, one key: ggml_vec_dot_f16's one step, a_j = k_j·q_j, then `(a0 + a2) + (a1 + a3)`.
/// Products of f16 values are exact in f32, so fma(k2, q2, a0) rounds a0 + a2 exactly as the addition
/// does (and a0 = fma(k0, q0, +0) is never -0): 5 ops, not 7.
#[inline(always)]
unsafe fn key_sum64(k: &[__m512; 4], q: &[__m512; 4]) -> __m512 {
    let zero = _mm512_setzero_ps();
    let a02 = _mm512_fmadd_ps(k[2], q[2], _mm512_fmadd_ps(k[0], q[0], zero));
    let a13 = _mm512_fmadd_ps(k[3], q[3], _mm512_fmadd_ps(k[1], q[1], zero));
    _mm512_add_ps(a02, a13)
}

/// For each of 16 keys (`kbuf`, `[16, hd]` f32): ggml_vec_dot_f16's four 16-lane accumulators over the
/// key and q, and their `(a0 + a2) + (a1 + a3)` sum, ready for `reduce_16_rows`.
#[inline(always)]
unsafe fn key_sums<const NV: usize>(kbuf: *const f32, q: &[__m512; NV]) -> [__m512; 16] {
    // Plain loops, no closures: a closure that is not inlined is compiled without the caller's AVX-512
    // features and turns every intrinsic into a call (head size 256 ran ~30x slower that way).
    let zero = _mm512_setzero_ps();
    let mut v = [zero; 16];
    for (c, vc) in v.iter_mut().enumerate() {
        let pk = kbuf.add(c * NV * 16);
        if NV == 4 {
            let k = [_mm512_loadu_ps(pk), _mm512_loadu_ps(pk.add(16)), _mm512_loadu_ps(pk.add(32)), _mm512_loadu_ps(pk.add(48))];
            *vc = key_sum64(&k, &[q[0], q[1], q[2], q[3]]);
            continue;
        }
        let mut acc = [zero; 4];
        for step in (0..NV).step_by(4) {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(_mm512_loadu_ps(pk.add(16 * (step + j))), q[step + j], *a);
            }
        }
        *vc = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
    }
    v
}

/// Per-lane value sums of `rs` rows (probabilities at `w`, row stride `n_pad`) for the lanes `lanes`,
/// into `dst` (`[rs, 64, hd]`): lane `l` adds its cells (positions ≡ l mod 64, ascending) as `LaneAcc`
/// does, `VECS_PER_PASS` vectors of every row at a time, so each value vector is converted once for `rs`
/// rows.
///
/// # Safety
/// AVX-512 F/DQ or AVX2, with FMA and F16C; `w` has `rs` rows of `g.n_pad`, `dst` `[rs, 64, hd]` floats.
unsafe fn lane_sums(job: &TileJob, g: &TileGeom, offsets: &[usize], w: *const f32, rs: usize, lanes: Range<usize>, dst: *mut f32) {
    if avx512_available() {
        lane_sums_avx512(job, g, offsets, w, rs, lanes, dst)
    } else {
        super::tiled_avx2::lane_sums(job.values, job.shape.head_dim, g, offsets, w, rs, lanes, dst)
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn lane_sums_avx512(job: &TileJob, g: &TileGeom, offsets: &[usize], w: *const f32, rs: usize, lanes: Range<usize>, dst: *mut f32) {
    let args = (job.values, job.shape.head_dim, g, offsets, w, lanes, dst);
    match rs {
        6 => lane_sums_n::<6>(args),
        5 => lane_sums_n::<5>(args),
        4 => lane_sums_n::<4>(args),
        3 => lane_sums_n::<3>(args),
        2 => lane_sums_n::<2>(args),
        _ => lane_sums_n::<1>(args),
    }
}

type LaneArgs<'a> = (&'a [f16], usize, &'a TileGeom, &'a [usize], *const f32, Range<usize>, *mut f32);

#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn lane_sums_n<const RS: usize>((values, hd, g, offsets, w, lanes, dst): LaneArgs) {
    debug_assert!(hd % (16 * VECS_PER_PASS) == 0);
    let short = g.n_keys <= 2 * 64 * PREFETCH_CELLS;
    for lane in lanes {
        // the first cell index (into offsets / a score row) whose position is in this lane
        let first = (lane + 64 - g.lo0 % 64) % 64;
        for v0 in (0..hd / 16).step_by(VECS_PER_PASS) {
            let mut acc = [[_mm512_setzero_ps(); VECS_PER_PASS]; RS];
            let mut i = first;
            while i < g.n_keys {
                // A lane's cells are 64 positions apart, too far for the hardware prefetcher: fetch this
                // lane's cell PREFETCH_CELLS ahead, or over a short context (a few cells a lane) the next
                // lane's cell at this depth.
                let ahead = if short { i + 1 } else { i + 64 * PREFETCH_CELLS };
                if let Some(&ahead) = offsets.get(ahead) {
                    let p = values.as_ptr().add(ahead + 16 * v0) as *const i8;
                    _mm_prefetch::<_MM_HINT_T0>(p);
                    _mm_prefetch::<_MM_HINT_T0>(p.add(64));
                }
                let pv = values.as_ptr().add(offsets[i] + 16 * v0) as *const __m256i;
                let mut v = [_mm512_setzero_ps(); VECS_PER_PASS];
                for (k, vk) in v.iter_mut().enumerate() {
                    *vk = _mm512_cvtph_ps(_mm256_loadu_si256(pv.add(k)));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let wv = _mm512_set1_ps(*w.add(r * g.n_pad + i));
                    for (a, vk) in acc_r.iter_mut().zip(&v) {
                        *a = _mm512_fmadd_ps(wv, *vk, *a);
                    }
                }
                i += 64;
            }
            for (r, acc_r) in acc.iter().enumerate() {
                let row = dst.add((r * 64 + lane) * hd + 16 * v0);
                for (k, a) in acc_r.iter().enumerate() {
                    _mm512_storeu_ps(row.add(16 * k), *a);
                }
            }
        }
    }
}

//! Prefill attention by tiles, AVX-512: one part handles one KV head for a run of consecutive query
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
use crate::debug_dump;
use crate::ggml_math::avx512::{reduce_16_rows, soft_max};
use crate::ggml_math::reduce_lane_rows;
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

/// How many cells ahead (in a lane) the value pass prefetches.
const PREFETCH_CELLS: usize = 4;

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
    pub layer: usize,
    pub tokens: Range<usize>,
    pub kv_head: usize,
}

/// Per-worker buffers, reused across tiles.
#[derive(Default)]
pub(super) struct TileScratch {
    /// `[rows, hd]`: each row's q rounded to f16 (kept as f32).
    q32: Vec<f32>,
    /// Row offsets of the tile's cells (positions `lo..=hi`) in the layer storage.
    offsets: Vec<usize>,
    /// `[16, hd]` keys of one chunk, converted to f32.
    kbuf: Vec<f32>,
    /// `[rows, n_pad]`: scores, then the f16-rounded probabilities (0 outside each row's range).
    scores: Vec<f32>,
    /// `[ROWS_PER_PASS, 64, hd]`: per-lane value sums of the rows of one pass.
    lanes: Vec<f32>,
}

impl TileJob<'_> {
    fn lo(&self, pos: usize) -> usize {
        self.shape.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// Attention for one tile; writes the `group` head outputs of each of its tokens.
///
/// # Safety
/// The CPU must have AVX-512 F/DQ, FMA and F16C. `out` must point at `[n_tokens, n_heads * hd]` floats
/// of which this call alone writes the chunks of (token in `job.tokens`, head of `job.kv_head`).
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
pub(super) unsafe fn attend_tile(job: &TileJob, sc: &mut TileScratch, out: OutPtr) {
    let sh = job.shape;
    let hd = sh.head_dim;
    let group = sh.n_heads / sh.n_kv_heads;
    let rows = job.tokens.len() * group;
    let (first, last) = (&job.queries[job.tokens.start], &job.queries[job.tokens.end - 1]);
    let (lo0, hi) = (job.lo(first.pos), last.pos);
    let n_keys = hi + 1 - lo0;
    let n_pad = n_keys.div_ceil(16) * 16;

    load_rounded_queries(job, sc, group);
    sc.offsets.clear();
    for (_, first_slot, len) in slot_runs(first.block_table, job.block_size, lo0, hi) {
        sc.offsets.extend((first_slot..first_slot + len).map(|slot| slot * job.kv_dim + job.kv_head * hd));
    }
    sc.scores.clear();
    sc.scores.resize(rows * n_pad, 0.0);
    tile_scores(job, sc, rows, n_pad);

    for r in 0..rows {
        let t = job.tokens.start + r / group;
        let pos = job.queries[t].pos;
        let (a, b) = (job.lo(pos) - lo0, pos + 1 - lo0);
        let row = &mut sc.scores[r * n_pad..(r + 1) * n_pad];
        row[a..b].iter_mut().for_each(|s| *s *= sh.scale);
        let dump = t + 1 == job.queries.len() && debug_dump::enabled();
        let head = job.kv_head * group + r % group;
        if dump {
            debug_dump::dump(&format!("kq-h{head}"), job.layer, &row[a..b], 1);
        }
        soft_max(&mut row[a..b], job.lo(pos));
        if dump {
            debug_dump::dump(&format!("kq_soft_max-h{head}"), job.layer, &row[a..b], 1);
        }
        round_to_f16(&mut row[a..b]);
        row[..a].fill(0.0);
        row[b..].fill(0.0);
    }

    let q_dim = sh.n_heads * hd;
    for r0 in (0..rows).step_by(ROWS_PER_PASS) {
        let rs = ROWS_PER_PASS.min(rows - r0);
        value_lanes(job, sc, r0, rs, lo0, n_pad);
        for r in r0..r0 + rs {
            let t = job.tokens.start + r / group;
            let head = job.kv_head * group + r % group;
            // SAFETY: (t, head) is one of this tile's outputs, inside `out` (see the contract).
            let out_h = std::slice::from_raw_parts_mut(out.0.add(t * q_dim + head * hd), hd);
            reduce_lane_rows(&mut sc.lanes[(r - r0) * 64 * hd..(r - r0 + 1) * 64 * hd], hd, out_h);
        }
    }
}

/// `sc.q32[r]` = q of row r (token `r / group`, head `kv_head * group + r % group`) rounded to f16.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn load_rounded_queries(job: &TileJob, sc: &mut TileScratch, group: usize) {
    let hd = job.shape.head_dim;
    let q_dim = job.shape.n_heads * hd;
    sc.q32.clear();
    for t in job.tokens.clone() {
        let q = &job.q[t * q_dim + job.kv_head * group * hd..][..group * hd];
        sc.q32.extend_from_slice(q);
    }
    round_to_f16(&mut sc.q32);
}

/// `x = f32(f16(x))`, round to nearest even like `half`'s conversion.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn round_to_f16(x: &mut [f32]) {
    let n = x.len() / 16 * 16;
    for i in (0..n).step_by(16) {
        let p = x.as_mut_ptr().add(i);
        let h = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_loadu_ps(p));
        _mm512_storeu_ps(p, _mm512_cvtph_ps(h));
    }
    for v in &mut x[n..] {
        *v = f16::from_f32(*v).to_f32();
    }
}

/// Scores of every row against every cell, 16 cells at a time: the chunk's keys are converted to f32
/// once, then each row's 16 dots run as in `dot_f16_f32_x16` (cells past the range score garbage that
/// the softmax step overwrites with 0).
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn tile_scores(job: &TileJob, sc: &mut TileScratch, rows: usize, n_pad: usize) {
    // A compile-time vector count keeps q and the sums in registers and unrolls the dots.
    match job.shape.head_dim / 16 {
        4 => tile_scores_nv::<4>(job, sc, rows, n_pad),
        8 => tile_scores_nv::<8>(job, sc, rows, n_pad),
        16 => tile_scores_nv::<16>(job, sc, rows, n_pad),
        nv => unreachable!("tiles need a head size of 64, 128 or 256, not {}", nv * 16),
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn tile_scores_nv<const NV: usize>(job: &TileJob, sc: &mut TileScratch, rows: usize, n_pad: usize) {
    let hd = NV * 16;
    sc.kbuf.resize(16 * hd, 0.0);
    let n_keys = sc.offsets.len();
    for c0 in (0..n_pad).step_by(16) {
        for c in 0..16 {
            let dst = sc.kbuf.as_mut_ptr().add(c * hd);
            if c0 + c < n_keys {
                let src = job.keys.as_ptr().add(sc.offsets[c0 + c]) as *const __m256i;
                for k in 0..NV {
                    _mm512_storeu_ps(dst.add(16 * k), _mm512_cvtph_ps(_mm256_loadu_si256(src.add(k))));
                }
            } else {
                std::ptr::write_bytes(dst, 0, hd);
            }
        }
        for r in 0..rows {
            let q: [__m512; NV] = std::array::from_fn(|k| _mm512_loadu_ps(sc.q32.as_ptr().add(r * hd + 16 * k)));
            let s = reduce_16_rows(&key_sums::<NV>(sc.kbuf.as_ptr(), &q));
            _mm512_storeu_ps(sc.scores.as_mut_ptr().add(r * n_pad + c0), s);
        }
    }
}

/// For each of 16 keys (`kbuf`, `[16, hd]` f32): ggml_vec_dot_f16's four 16-lane accumulators over the
/// key and q, and their `(a0 + a2) + (a1 + a3)` sum, ready for `reduce_16_rows`.
#[inline(always)]
unsafe fn key_sums<const NV: usize>(kbuf: *const f32, q: &[__m512; NV]) -> [__m512; 16] {
    let zero = _mm512_setzero_ps();
    std::array::from_fn(|c| {
        let k = |i: usize| _mm512_loadu_ps(kbuf.add((c * NV + i) * 16));
        if NV == 4 {
            // One step: a_j = k_j·q_j. Products of f16 values are exact in f32, so fma(k2, q2, a0) rounds
            // a0 + a2 exactly as the addition does (and a0 = fma(k0, q0, +0) is never -0): 5 ops, not 7.
            let a02 = _mm512_fmadd_ps(k(2), q[2], _mm512_fmadd_ps(k(0), q[0], zero));
            let a13 = _mm512_fmadd_ps(k(3), q[3], _mm512_fmadd_ps(k(1), q[1], zero));
            return _mm512_add_ps(a02, a13);
        }
        let mut acc = [zero; 4];
        for step in (0..NV).step_by(4) {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(k(step + j), q[step + j], *a);
            }
        }
        _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]))
    })
}

/// Per-lane value sums of rows `r0..r0 + rs` into `sc.lanes` (`[rs, 64, hd]`): lane `l` adds its cells
/// (positions ≡ l mod 64, ascending) as `LaneAcc` does, `VECS_PER_PASS` vectors of every row at a time,
/// so each value vector is converted once for `rs` rows.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn value_lanes(job: &TileJob, sc: &mut TileScratch, r0: usize, rs: usize, lo0: usize, n_pad: usize) {
    match rs {
        6 => value_lanes_n::<6>(job, sc, r0, lo0, n_pad),
        5 => value_lanes_n::<5>(job, sc, r0, lo0, n_pad),
        4 => value_lanes_n::<4>(job, sc, r0, lo0, n_pad),
        3 => value_lanes_n::<3>(job, sc, r0, lo0, n_pad),
        2 => value_lanes_n::<2>(job, sc, r0, lo0, n_pad),
        _ => value_lanes_n::<1>(job, sc, r0, lo0, n_pad),
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn value_lanes_n<const RS: usize>(job: &TileJob, sc: &mut TileScratch, r0: usize, lo0: usize, n_pad: usize) {
    let hd = job.shape.head_dim;
    debug_assert!(hd % (16 * VECS_PER_PASS) == 0);
    sc.lanes.resize(ROWS_PER_PASS * 64 * hd, 0.0);
    let w = sc.scores.as_ptr().add(r0 * n_pad);
    let n_keys = sc.offsets.len();
    for lane in 0..64usize {
        // the first cell index (into offsets / a score row) whose position is in this lane
        let first = (lane + 64 - lo0 % 64) % 64;
        for v0 in (0..hd / 16).step_by(VECS_PER_PASS) {
            let mut acc = [[_mm512_setzero_ps(); VECS_PER_PASS]; RS];
            let mut i = first;
            while i < n_keys {
                // A lane's cells are 64 positions apart, too far for the hardware prefetcher.
                if let Some(&ahead) = sc.offsets.get(i + 64 * PREFETCH_CELLS) {
                    _mm_prefetch::<_MM_HINT_T0>(job.values.as_ptr().add(ahead + 16 * v0) as *const i8);
                }
                let pv = job.values.as_ptr().add(sc.offsets[i] + 16 * v0) as *const __m256i;
                let v: [__m512; VECS_PER_PASS] = std::array::from_fn(|k| _mm512_cvtph_ps(_mm256_loadu_si256(pv.add(k))));
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let wv = _mm512_set1_ps(*w.add(r * n_pad + i));
                    for (a, vk) in acc_r.iter_mut().zip(&v) {
                        *a = _mm512_fmadd_ps(wv, *vk, *a);
                    }
                }
                i += 64;
            }
            for (r, acc_r) in acc.iter().enumerate() {
                let dst = sc.lanes.as_mut_ptr().add((r * 64 + lane) * hd + 16 * v0);
                for (k, a) in acc_r.iter().enumerate() {
                    _mm512_storeu_ps(dst.add(16 * k), *a);
                }
            }
        }
    }
}


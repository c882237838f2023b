//! Causal attention of a batch of query tokens over the paged KV storage.
//!
//! Each query token belongs to one sequence and attends to that sequence's cached positions
//! `[lo, pos]`, read through its block table (`lo > 0` only for sliding-window layers). Every (token,
//! head) output is computed by one task in a fixed order, so results do not depend on batch or threads.

use crate::kv::KvStorage;
use crate::kernels::ggml::math::{dot_f16_f32, dot_f16_f32_x16, round_through_f16, soft_max, LaneAcc};
use half::f16;
use half::slice::HalfFloatSliceExt;
use crate::pool;

mod by_dim;
#[cfg(target_arch = "x86_64")]
mod key_order;
mod quant;
pub mod sparse;
#[cfg(target_arch = "x86_64")]
mod quant_x86;

/// Positions per run of the packed numerics' value sums (`key_order`): each output value is one FMA
/// chain per run of `RUN` positions, the runs' sums added in order.
const RUN: usize = 1024;
#[cfg(target_arch = "x86_64")]
mod tiled;
#[cfg(target_arch = "x86_64")]
mod tiled_avx2;

/// Where one query token sits: its sequence's block table and its position.
#[derive(Clone, Copy, Debug)]
pub struct QueryPos<'a> {
    pub block_table: &'a [u32],
    pub pos: usize,
}

#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    /// Multiplies q·k before the softmax.
    pub scale: f32,
    /// Sliding window: a query at `pos` sees positions `> pos - window` only.
    pub window: Option<usize>,
    /// The value pass of the packed numerics: each output value one FMA chain over the cells in position
    /// order (`key_order`), instead of ggml's 64-lane dot. (The scores follow the keys' layout: one FMA
    /// chain per cell over keys stored by dimension, `by_dim`, else ggml's order; the softmax is ggml's.)
    pub values_in_key_order: bool,
}

impl AttnShape {
    /// The first position a query at `pos` attends to (0 without a window).
    #[inline]
    pub fn first_pos(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// q: `[n_tokens, n_heads * head_dim]`, out: same shape.
///
/// Numerics follow ggml's non-flash CPU path so tokens match llama.cpp: q is rounded to f16 and dotted with
/// the f16 keys (`ggml_vec_dot_f16` order), the softmax is ggml's, the probabilities are rounded to f16 and
/// dotted with the f16 values per output dimension, lanes assigned by KV cell (= position here). The
/// packed numerics change two sums: scores over keys stored by dimension (`by_dim`) and values in key
/// order (`AttnShape::values_in_key_order`).
pub fn attend(shape: &AttnShape, kv: &KvStorage, layer: usize, queries: &[QueryPos], q: &[f32], out: &mut [f32]) {
    let q_dim = shape.n_heads * shape.head_dim;
    assert_eq!(out.len(), queries.len() * q_dim, "attention output is not [n, q_dim]");
    assert_eq!(q.len(), queries.len() * q_dim, "attention queries are not [n, q_dim]");
    let out_ptr = OutPtr(out.as_mut_ptr());
    if let Some(layer) = kv.layer_quant(layer) {
        return quant::attend(shape, &layer, kv.shape.block_size, queries, q, out_ptr);
    }
    #[cfg(target_arch = "x86_64")]
    if shape.head_dim % 64 == 0 && (crate::kernels::ggml::math::avx512_available() || crate::kernels::ggml::math::avx2_available()) {
        let tiles = tiled::tiles(queries);
        if let Some(mode) = tiled_mode(shape, queries, &tiles) {
            return attend_tiled(mode, shape, kv, layer, queries, &tiles, q, out_ptr);
        }
    }
    attend_per_head(shape, kv, layer, queries, q, out_ptr);
}

/// K/V bytes of one layer a decode batch may prefetch at most: beyond, the prefetched cells push the
/// layer's weights and activations out of the cores' L2 (1 MiB each) and the step gets slower
/// (docs/speed.md, "Why the kernels look as they do").
const PREFETCH_KV_MAX: usize = 768 << 10;

/// Asks for the K/V rows a decode batch (one token of each of several sequences) will attend to in
/// `layer` to be brought into L2, one part per sequence. Called before the layer's q/k/v matmul, which
/// at decode-batch sizes is bound by arithmetic, so the DRAM reads of the cache overlap it instead of
/// stalling attention later. Does nothing for prefill chunks or a lone token, or when the cells are more
/// than `PREFETCH_KV_MAX`.
pub fn prefetch_decode_kv(kv: &KvStorage, layer: usize, queries: &[QueryPos]) {
    if kv.shape.dtypes.is_quantized() {
        return;
    }
    let distinct = queries.windows(2).all(|w| !std::ptr::eq(w[0].block_table, w[1].block_table));
    let bytes_per_cell = 2 * 2 * kv.shape.kv_dim;
    if queries.len() < 2 || !distinct || queries.iter().map(|q| q.pos).sum::<usize>() * bytes_per_cell > PREFETCH_KV_MAX {
        return;
    }
    let (keys, values) = kv.layer(layer);
    let (bs, kv_dim, by_dim) = (kv.shape.block_size, kv.shape.kv_dim, kv.shape.keys_by_dim());
    pool::current().run(queries.len(), &|i| {
        let qp = &queries[i];
        for b in (0..qp.pos.div_ceil(bs)).filter(|&b| qp.block_table[b] != crate::kv::NULL_BLOCK) {
            // the sequence's cells before its new token: whole blocks, the last one in part (not those a
            // sliding window released); keys by dimension spread a block's cells over all of it
            let block = kv_dim * bs * qp.block_table[b] as usize;
            let cells = block..block + kv_dim * (qp.pos - b * bs).min(bs);
            for (arr, cells) in [(keys, if by_dim { block..block + kv_dim * bs } else { cells.clone() }), (values, cells.clone())] {
                let f16s = &arr[cells];
                // SAFETY: f16 is plain 2-byte data; the view covers exactly the same memory.
                crate::kernels::ggml::prefetch_l2(unsafe { std::slice::from_raw_parts(f16s.as_ptr() as *const u8, 2 * f16s.len()) });
            }
        }
    });
}

/// `attend` with one part per (token, head): decode over short contexts, and CPUs without AVX-512. Public
/// as the reference the other paths are tested and benchmarked against (`tools/src/bin/attn_bench.rs`).
pub fn attend_per_head_path(shape: &AttnShape, kv: &KvStorage, layer: usize, queries: &[QueryPos], q: &[f32], out: &mut [f32]) {
    assert_eq!(out.len(), queries.len() * shape.n_heads * shape.head_dim, "attention output is not [n, q_dim]");
    assert_eq!(q.len(), out.len(), "attention queries are not [n, q_dim]");
    attend_per_head(shape, kv, layer, queries, q, OutPtr(out.as_mut_ptr()));
}

fn attend_per_head(shape: &AttnShape, kv: &KvStorage, layer: usize, queries: &[QueryPos], q: &[f32], out_ptr: OutPtr) {
    let n = queries.len();
    let hd = shape.head_dim;
    let group = shape.n_heads / shape.n_kv_heads;
    pool::current().run(n * shape.n_heads, &|part| {
        // Parts run KV head by KV head (then token, then head within the group), so consecutive parts read
        // the same keys and values: at depth one KV head's cache fits in L2, all of it does not.
        let (kvh, rest) = (part / (n * group), part % (n * group));
        let (t, h) = (rest / group, kvh * group + rest % group);
        let i = t * shape.n_heads + h;
        let out_ptr = out_ptr; // the whole wrapper (Sync), not its raw field
        // SAFETY: output chunk i (hd values) belongs to this part only (parts map one-to-one onto (t, h)),
        // inside `out` by the assert above.
        let out_h = unsafe { std::slice::from_raw_parts_mut(out_ptr.0.add(i * hd), hd) };
        SCRATCH.with_borrow_mut(|sc| head_part(shape, queries, q, kv, layer, i, sc, out_h));
    });
}

/// How a batch runs on AVX-512 or AVX2 (`tiled`): one part per tile when there are enough tiles (prefill, decode
/// batches); otherwise, over a long context, by phases split across the threads; otherwise (a lone token
/// over a short context) one part per head.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy, PartialEq)]
enum TiledMode {
    PerTile,
    Split,
}

/// Cells a small batch must attend (at its last token) before the phase-split path pays for its extra
/// pool runs.
#[cfg(target_arch = "x86_64")]
const SPLIT_MIN_CELLS: usize = 1024;

#[cfg(target_arch = "x86_64")]
fn tiled_mode(shape: &AttnShape, queries: &[QueryPos], tiles: &[std::ops::Range<usize>]) -> Option<TiledMode> {
    // Tiles whenever there are enough of them for the threads: decode batches of several sequences too
    // (a tile reads each cell's key once for all its rows; the per-head path reads it once per head).
    let n_jobs = tiles.len() * shape.n_kv_heads;
    if queries.len() >= 2 * tiled::TILE_TOKENS || n_jobs >= 2 * pool::current().threads() {
        return Some(TiledMode::PerTile);
    }
    let longest = queries.iter().map(|qp| qp.pos + 1 - shape.first_pos(qp.pos)).max();
    (longest >= Some(SPLIT_MIN_CELLS)).then_some(TiledMode::Split)
}

/// `attend` by tiles of consecutive tokens × one KV head; the same bits as the per-head path.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn attend_tiled(mode: TiledMode, shape: &AttnShape, kv: &KvStorage, layer: usize, queries: &[QueryPos], tiles: &[std::ops::Range<usize>], q: &[f32], out_ptr: OutPtr) {
    let (keys, values) = kv.layer(layer);
    // KV head by KV head, so consecutive parts read the same keys and values (prefill: a sequence's
    // tiles share them); but a decode batch's one-token tiles share nothing, and there a sequence's KV
    // heads in a row read each slot's K/V rows whole, in address order.
    let decode = tiles.iter().all(|t| t.len() == 1);
    let order: Vec<(usize, std::ops::Range<usize>)> = if decode {
        tiles.iter().flat_map(|t| (0..shape.n_kv_heads).map(move |h| (h, t.clone()))).collect()
    } else {
        (0..shape.n_kv_heads).flat_map(|h| tiles.iter().map(move |t| (h, t.clone()))).collect()
    };
    let jobs: Vec<tiled::TileJob> = order
        .into_iter()
        .map(|(kv_head, tokens)| tiled::TileJob {
            shape,
            queries,
            q,
            keys,
            values,
            kv_dim: kv.shape.kv_dim,
            block_size: kv.shape.block_size,
            tokens,
            kv_head,
            keys_by_dim: kv.shape.keys_by_dim(),
        })
        .collect();
    match mode {
        // SAFETY: AVX-512 or AVX2 was checked by `attend`; the jobs' outputs (their tokens × their KV head's
        // query heads) are disjoint, inside `out` (asserted by `attend`).
        TiledMode::Split => unsafe { tiled::attend_split(&jobs, out_ptr) },
        TiledMode::PerTile => pool::current().run(jobs.len(), &|part| {
            // SAFETY: as above; each part runs one job.
            TILE_SCRATCH.with_borrow_mut(|sc| unsafe { tiled::attend_tile(&jobs[part], sc, out_ptr) });
        }),
    }
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    static TILE_SCRATCH: std::cell::RefCell<tiled::TileScratch> = std::cell::RefCell::new(tiled::TileScratch::default());
}

/// A raw pointer that parallel parts use to write disjoint chunks of one output buffer.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: every part writes only its own chunk, see `attend`.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Attention output `i` = (token `i / n_heads`, head `i % n_heads`).
#[allow(clippy::too_many_arguments)]
fn head_part(shape: &AttnShape, queries: &[QueryPos], q: &[f32], kv: &KvStorage, layer: usize, i: usize, sc: &mut Scratch, out_h: &mut [f32]) {
    let q_dim = shape.n_heads * shape.head_dim;
    let hd = shape.head_dim;
    let (keys, values) = kv.layer(layer);
    let group = shape.n_heads / shape.n_kv_heads;
    let (t, h) = (i / shape.n_heads, i % shape.n_heads);
    let query = &queries[t];
    let job = HeadJob {
        q: &q[t * q_dim + h * hd..][..hd],
        keys,
        values,
        kv_dim: kv.shape.kv_dim,
        kv_off: (h / group) * hd,
        block_size: kv.shape.block_size,
        block_table: query.block_table,
        lo: shape.first_pos(query.pos),
        pos: query.pos,
        scale: shape.scale,
        values_in_key_order: shape.values_in_key_order,
        keys_by_dim: kv.shape.keys_by_dim(),
        n_kv_heads: shape.n_kv_heads,
    };
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::ggml::math::avx512_available() {
        // SAFETY: the CPU has the features the wrapper enables, checked just above.
        return unsafe { head_avx512(&job, sc, out_h) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::ggml::math::avx2_available() {
        // SAFETY: the CPU has the features the wrapper enables, checked just above.
        return unsafe { head_avx2(&job, sc, out_h) };
    }
    head(&job, sc, out_h);
}

/// One (query token, head) pair's inputs.
struct HeadJob<'a> {
    q: &'a [f32],
    keys: &'a [f16],
    values: &'a [f16],
    kv_dim: usize,
    /// Offset of this head's KV head within a slot's `kv_dim` values.
    kv_off: usize,
    block_size: usize,
    block_table: &'a [u32],
    /// Attended positions: `lo..=pos`.
    lo: usize,
    pos: usize,
    scale: f32,
    values_in_key_order: bool,
    /// Keys stored by dimension (`by_dim`), `n_kv_heads` of them a cell.
    keys_by_dim: bool,
    n_kv_heads: usize,
}

/// Positions `lo..=pos` of a sequence as runs `(first position, first slot, length)` of consecutive
/// slots, one block-table lookup per block. (An iterator rather than a callback: closures would not
/// inherit the AVX-512 features of `head_avx512`, and the per-cell routines would stop inlining.)
#[inline(always)]
fn slot_runs(block_table: &[u32], bs: usize, lo: usize, pos: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    (lo / bs..=pos / bs).map(move |b| {
        let start = (b * bs).max(lo);
        let end = ((b + 1) * bs - 1).min(pos);
        (start, block_table[b] as usize * bs + start - b * bs, end + 1 - start)
    })
}

/// `head` compiled for AVX-512, so the per-cell f16 dots and value FMAs inline into its loops.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn head_avx512(job: &HeadJob, sc: &mut Scratch, out_h: &mut [f32]) {
    head(job, sc, out_h)
}

/// `head` compiled for AVX2 (CPUs without AVX-512), for the same reason.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn head_avx2(job: &HeadJob, sc: &mut Scratch, out_h: &mut [f32]) {
    head(job, sc, out_h)
}

/// Scores, softmax and the weighted sum of values for one (query token, head) pair.
///
/// Numerics follow ggml's non-flash CPU path so tokens match llama.cpp: q is rounded to f16 and dotted with
/// the f16 keys (`ggml_vec_dot_f16` order), the softmax is ggml's, the probabilities are rounded to f16 and
/// dotted with the f16 values per output dimension, lanes assigned by KV cell (= position here).
#[inline(always)]
fn head(job: &HeadJob, sc: &mut Scratch, out_h: &mut [f32]) {
    let hd = job.q.len();
    sc.q16.clear();
    sc.q16.extend(job.q.iter().map(|&x| f16::from_f32(x)));
    sc.q32.clear();
    sc.q32.extend_from_slice(job.q);
    round_through_f16(&mut sc.q32);
    sc.offsets.clear();
    for (_, first_slot, len) in slot_runs(job.block_table, job.block_size, job.lo, job.pos) {
        sc.offsets.extend((first_slot..first_slot + len).map(|slot| slot * job.kv_dim + job.kv_off));
    }
    let n = sc.offsets.len();
    sc.scores.clear();
    sc.scores.resize(n, 0.0);
    if job.keys_by_dim {
        let k = by_dim::ByDimKeys { keys: job.keys, n_kv_heads: job.n_kv_heads, hd, bs: job.block_size, block_table: job.block_table, kv_head: job.kv_off / hd };
        let cells = by_dim::Cells { lo0: job.lo, n_keys: n };
        // SAFETY: one row of n scores; the block table covers lo..=pos, inside the layer's keys.
        unsafe { by_dim::scores(&k, cells, &sc.q32, 1, 0..k.n_groups(cells), sc.scores.as_mut_ptr(), n) };
    }
    let mut c = if job.keys_by_dim { n } else { 0 };
    while c + 16 <= n && dot_f16_f32_x16(job.keys, &sc.offsets[c..c + 16], &sc.q32, &mut sc.scores[c..c + 16]) {
        c += 16;
    }
    for c in c..n {
        // (with keys by dimension, c == n: done above)
        let off = sc.offsets[c];
        sc.scores[c] = dot_f16_f32(&job.keys[off..off + hd], &sc.q16, &sc.q32);
    }
    for s in sc.scores.iter_mut() {
        *s *= job.scale;
    }
    soft_max(&mut sc.scores, job.lo);
    // out[d] = Σ_p f16(prob_p)·V_p[d], accumulated as ggml_vec_dot_f16 would over the KV cells, see LaneAcc
    // (or, with values in key order, one FMA chain per d over the cells in order).
    round_through_f16(&mut sc.scores);
    if job.values_in_key_order {
        return values_in_key_order(job.values, hd, job.lo, &sc.scores, &sc.offsets, out_h, &mut sc.vrow);
    }
    sc.acc.reset(hd);
    sc.acc.add_cells(job.lo, &sc.scores, job.values, &sc.offsets);
    sc.acc.reduce(out_h);
}

/// One row's value pass in key order (see `key_order`: chains per run of positions, folded in order),
/// cells from position `lo`: the vector routines where the head size allows, else the same chains one
/// value at a time.
fn values_in_key_order(values: &[f16], hd: usize, lo: usize, w: &[f32], offsets: &[usize], out: &mut [f32], vrow: &mut Vec<f32>) {
    #[cfg(target_arch = "x86_64")]
    if hd % 16 == 0 && (crate::kernels::ggml::math::avx512_available() || crate::kernels::ggml::math::avx2_available()) {
        let g = tiled::TileGeom::one_row(lo, offsets.len());
        let o = out.as_mut_ptr();
        // SAFETY: AVX-512 or AVX2 checked above; offsets hold n value rows of hd inside `values`; `out`
        // has hd values, written by this call only.
        unsafe { key_order::values(values, hd, &g, offsets, w.as_ptr(), 0..1, &|_| o) };
        return;
    }
    values_in_key_order_scalar(values, hd, lo, w, offsets, out, vrow);
}

/// `values_in_key_order` one value at a time: the definition the vector routines are tested against.
fn values_in_key_order_scalar(values: &[f16], hd: usize, lo: usize, w: &[f32], offsets: &[usize], out: &mut [f32], vrow: &mut Vec<f32>) {
    vrow.resize(2 * hd, 0.0);
    let (vrow, run_sum) = vrow.split_at_mut(hd);
    let mut j = 0;
    while j < offsets.len() {
        let end = ((lo + j) / RUN + 1) * RUN - lo;
        run_sum.fill(0.0);
        for (&p, &off) in w[j..end.min(offsets.len())].iter().zip(&offsets[j..]) {
            values[off..off + hd].convert_to_f32_slice(vrow);
            for (o, &v) in run_sum.iter_mut().zip(vrow.iter()) {
                *o = p.mul_add(v, *o);
            }
        }
        if j == 0 {
            out.copy_from_slice(run_sum);
        } else {
            out.iter_mut().zip(run_sum.iter()).for_each(|(a, &b)| *a += b);
        }
        j = end;
    }
}

/// Per-task buffers, reused across the (token, head) pairs a worker handles.
#[derive(Default)]
struct Scratch {
    q16: Vec<f16>,
    /// q16 converted back to f32 (exact), for the key dots.
    q32: Vec<f32>,
    /// Where each attended cell's key/value row starts in the layer's storage.
    offsets: Vec<usize>,
    scores: Vec<f32>,
    acc: LaneAcc,
    /// One value row as f32 (values in key order).
    vrow: Vec<f32>,
}

/// The attention tests' inputs: three sequences with scattered blocks in one storage, and a batch.
#[cfg(test)]
pub(super) mod fixture {
    use super::QueryPos;
    use crate::kv::{KeyLayout, KvDtypes, KvShape, KvStorage};

    pub fn noise(i: usize, salt: f32) -> f32 {
        ((i as f32 * 0.7071 + salt).sin() * 43758.547).fract() * 2.0 - 1.0
    }

    /// Positions of the three sequences.
    pub const LENS: [usize; 3] = [250, 37, 1300];

    /// A one-layer storage of `dtypes` (f16 keys laid out as `key_layout`) holding the three sequences'
    /// keys and values (blocks scattered: every other one, then in reverse), and their block tables.
    pub fn three_sequences(kv_dim: usize, head_dim: usize, bs: usize, dtypes: KvDtypes, key_layout: KeyLayout) -> (KvStorage, Vec<Vec<u32>>) {
        let nb = |len: usize| len.div_ceil(bs);
        let tables: Vec<Vec<u32>> = vec![
            (0..nb(LENS[0])).map(|b| (b * 2 + 1) as u32).collect(),
            (0..nb(LENS[1])).map(|b| (2 * nb(LENS[0]) + 2 + b) as u32).rev().collect(),
            (0..nb(LENS[2])).map(|b| (2 * nb(LENS[0]) + nb(LENS[1]) + 4 + b) as u32).rev().collect(),
        ];
        let num_blocks = 2 * nb(LENS[0]) + nb(LENS[1]) + nb(LENS[2]) + 8;
        let mut kv = KvStorage::new(KvShape { num_layers: 1, kv_dim, head_dim, block_size: bs, num_blocks, dtypes, key_layout });
        for (s, table) in tables.iter().enumerate() {
            for pos in 0..LENS[s] {
                let k: Vec<f32> = (0..kv_dim).map(|i| 3.0 * noise(i + 1000 * pos, s as f32)).collect();
                let v: Vec<f32> = (0..kv_dim).map(|i| noise(i + 1000 * pos, 7.0 + s as f32)).collect();
                let slot = kv.slot(table, pos);
                kv.write(0, slot, &k, &v);
            }
        }
        (kv, tables)
    }

    /// The batch: the last 45 positions of sequence 0, the last 30 of 1, the last 20 of 2.
    pub fn batch(tables: &[Vec<u32>]) -> Vec<QueryPos<'_>> {
        let mut queries = Vec::new();
        for (s, n) in [(0, 45), (1, 30), (2, 20)] {
            for pos in LENS[s] - n..LENS[s] {
                queries.push(QueryPos { block_table: &tables[s], pos });
            }
        }
        queries
    }
}

#[cfg(test)]
mod tests {
    use super::fixture::{batch, noise, three_sequences};
    use super::*;

    /// Every path gives the per-head path's bits: a batch (by tiles where the CPU allows), and single
    /// tokens (phase-split over a long context): several sequences, partial tiles, GQA groups, head sizes
    /// 64/128/256, a sliding window; with the ggml numerics (keys in rows, ggml's value lanes) and the
    /// packed ones (keys by dimension, values in key order).
    #[test]
    fn tiled_and_split_attention_equal_the_per_head_path() {
        if !crate::kernels::cpu::tests::test_needs(crate::kernels::cpu::SimdLevel::Avx2, "tiled and split attention vs the per-head path") {
            return;
        }
        // (9, 3, 64, Some(600)): the longest sequence's windows cross position 1024, a run boundary of the
        // packed value sums. Head size 64 with groups of 1, 2 and 3: the few-row decode scores.
        let cases = [(9, 3, 64, None), (4, 1, 256, Some(40)), (14, 2, 64, None), (4, 2, 128, Some(1500)), (4, 2, 128, None), (9, 3, 64, Some(600)), (4, 4, 64, None), (4, 2, 64, Some(100))];
        for ((n_heads, n_kv_heads, head_dim, window), values_in_key_order) in cases.iter().flat_map(|&c| [(c, false), (c, true)]) {
            let shape = AttnShape { n_heads, n_kv_heads, head_dim, scale: 0.125, window, values_in_key_order };
            let kv_dim = n_kv_heads * head_dim;
            let layout = if values_in_key_order { crate::kv::KeyLayout::ByDim } else { crate::kv::KeyLayout::Rows };
            let (kv, tables) = three_sequences(kv_dim, head_dim, 16, crate::kv::KvDtypes::F16, layout);
            let queries = batch(&tables);
            let q_dim = n_heads * head_dim;
            let q: Vec<f32> = (0..queries.len() * q_dim).map(|i| 2.0 * noise(i, 3.3)).collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let mut batched = vec![0.0; q.len()];
            attend(&shape, &kv, 0, &queries, &q, &mut batched);
            let mut per_head = vec![0.0; q.len()];
            attend_per_head(&shape, &kv, 0, &queries, &q, OutPtr(per_head.as_mut_ptr()));
            assert_eq!(bits(&batched), bits(&per_head), "heads {n_heads}/{n_kv_heads} hd {head_dim} window {window:?} key order {values_in_key_order}: batch");
            for (t, qp) in queries.iter().enumerate() {
                let mut one = vec![0.0; q_dim];
                attend(&shape, &kv, 0, std::slice::from_ref(qp), &q[t * q_dim..(t + 1) * q_dim], &mut one);
                assert_eq!(bits(&one), bits(&per_head[t * q_dim..(t + 1) * q_dim]), "heads {n_heads}/{n_kv_heads} hd {head_dim} window {window:?}: token {t} alone");
            }
            // a decode batch: one token of each sequence
            let picks = [44, 74, 94];
            let dq: Vec<QueryPos> = picks.iter().map(|&t| queries[t]).collect();
            let dqv: Vec<f32> = picks.iter().flat_map(|&t| q[t * q_dim..(t + 1) * q_dim].to_vec()).collect();
            let mut dec = vec![0.0; dqv.len()];
            attend(&shape, &kv, 0, &dq, &dqv, &mut dec);
            for (k, &t) in picks.iter().enumerate() {
                assert_eq!(bits(&dec[k * q_dim..(k + 1) * q_dim]), bits(&per_head[t * q_dim..(t + 1) * q_dim]), "decode batch token {t}");
            }
        }
    }

    /// The vector value passes in key order (AVX-512, AVX2) give the scalar chains' bits: one and several
    /// runs of positions, head sizes 64 and 128, a start inside a run.
    #[test]
    fn key_order_values_equal_the_scalar_chains() {
        if !crate::kernels::cpu::tests::test_needs(crate::kernels::cpu::SimdLevel::Avx2, "key-order value pass vs scalar") {
            return;
        }
        for (hd, lo, n) in [(64, 0, 37), (64, 1000, 2100), (128, 5, 1500)] {
            let cells = 3000;
            let values: Vec<f16> = (0..cells * hd).map(|i| f16::from_f32(noise(i, 1.5))).collect();
            let offsets: Vec<usize> = (0..n).map(|j| ((j * 7) % cells) * hd).collect();
            let w: Vec<f32> = (0..n).map(|j| noise(j, 9.0).abs() / n as f32).collect();
            let (mut simd, mut scalar, mut vrow) = (vec![0.0; hd], vec![0.0; hd], Vec::new());
            values_in_key_order(&values, hd, lo, &w, &offsets, &mut simd, &mut vrow);
            values_in_key_order_scalar(&values, hd, lo, &w, &offsets, &mut scalar, &mut vrow);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&simd), bits(&scalar), "hd {hd} lo {lo} n {n}");
        }
    }
}

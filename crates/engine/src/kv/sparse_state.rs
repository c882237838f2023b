//! Sparse attention's state beside the keys and values it reads (`kv::sparse` picks the blocks): for
//! each (layer, block), the per-dimension range of its keys (the Quest bound's input), and the history
//! blocks its queries read, picked at its first position. Held by `KvStorage`, which clears a block's
//! state whenever its keys are written; no model or tensor code here.

use super::quant::Region;
use super::storage::{key_group, KvShape};
use half::f16;
use half::slice::HalfFloatSliceExt;
use std::sync::atomic::{AtomicBool, Ordering};

pub(super) struct SparseState {
    num_layers: usize,
    num_blocks: usize,
    kv_dim: usize,
    bounds: KeyBounds,
    picks: Picks,
}

/// A layer's keys as the storage holds them, for the bounds.
pub(super) enum LayerKeys<'a> {
    F16(&'a [f16]),
    /// The layer's (block, KV head) regions, read back as `q · d` (`Region::read`).
    Quant(Region, &'a [u8]),
}

/// The history blocks (indices into the owning sequence's block table) the queries of a block read
/// under sparse attention, picked at the block's first position (`kv::sparse`): `len[layer *
/// num_blocks + block]` of the `per` entries at `idx[(layer * num_blocks + block) * per..]`, or
/// `NO_PICK`. Writing a block's first position picks anew; a block restored from the disk tier holds
/// none. Indices stay valid while the block is shared: a block is shared with its whole prefix.
struct Picks {
    per: usize,
    idx: Vec<u32>,
    len: Vec<u32>,
}

const NO_PICK: u32 = u32::MAX;

/// `vals`: `[layer][block][2][kv_dim]` f32, the minimum then the maximum of each key dimension over the
/// block's cells (exact: the f16 keys, or a quantized key's `q · d`, are f32 values; -0 is stored as +0). `fresh[layer * num_blocks + block]`:
/// whether `vals` holds the block's current keys; every write to a block's cells clears it, and
/// `refresh_key_bounds` computes what is stale when a reader needs it.
struct KeyBounds {
    vals: Vec<f32>,
    fresh: Vec<AtomicBool>,
}

impl SparseState {
    /// Bounds for every (layer, block), 2 × kv_dim f32 each (2 / bs of the f16 keys and values), and room
    /// for `pick_blocks` picks each.
    pub fn new(num_layers: usize, num_blocks: usize, kv_dim: usize, pick_blocks: usize) -> SparseState {
        let n = num_layers * num_blocks;
        let bounds = KeyBounds { vals: vec![0.0; n * 2 * kv_dim], fresh: (0..n).map(|_| AtomicBool::new(false)).collect() };
        SparseState { num_layers, num_blocks, kv_dim, bounds, picks: Picks::new(n, pick_blocks) }
    }

    /// Room for `pick_blocks` picks each: the picks are forgotten if that changes, the bounds kept.
    pub fn keep_picks(&mut self, pick_blocks: usize) {
        if self.picks.per != pick_blocks {
            self.picks = Picks::new(self.num_layers * self.num_blocks, pick_blocks);
        }
    }

    /// Bytes the state takes per block (all layers).
    pub fn bytes_per_block(num_layers: usize, kv_dim: usize, pick_blocks: usize) -> usize {
        num_layers * (2 * kv_dim * 4 + pick_blocks * 4 + 4)
    }

    /// The picks kept for the queries of block `b` in `layer` (`set_pick`), if any.
    pub fn pick(&self, layer: usize, b: u32) -> Option<&[u32]> {
        let picks = &self.picks;
        let at = layer * self.num_blocks + b as usize;
        let len = picks.len[at];
        (len != NO_PICK).then(|| &picks.idx[at * picks.per..at * picks.per + len as usize])
    }

    /// Keeps `picked` (indices into the block table of `b`'s sequence) for the queries of block `b` in
    /// `layer`.
    pub fn set_pick(&mut self, layer: usize, b: u32, picked: &[usize]) {
        let picks = &mut self.picks;
        assert!(picked.len() <= picks.per, "at most the budget's blocks");
        let at = layer * self.num_blocks + b as usize;
        picks.idx[at * picks.per..][..picked.len()].iter_mut().zip(picked).for_each(|(d, &i)| *d = i as u32);
        picks.len[at] = picked.len() as u32;
    }

    /// Computes the key bounds of those of `blocks` (ids) in `layer` whose keys changed since, in
    /// parallel, from `keys` (the layer's, shaped as `shape` says).
    pub fn refresh(&mut self, layer: usize, blocks: &[u32], keys: LayerKeys, shape: &KvShape) {
        let (kv_dim, hd, bs, nb) = (shape.kv_dim, shape.head_dim, shape.block_size, shape.num_blocks);
        let by_dim = shape.keys_by_dim();
        let bounds = &mut self.bounds;
        let stale: Vec<u32> = blocks.iter().copied().filter(|&b| !bounds.fresh[layer * nb + b as usize].load(Ordering::Relaxed)).collect();
        if stale.is_empty() {
            return;
        }
        let out = crate::kernels::ops::SharedRows::new(&mut bounds.vals[layer * nb * 2 * kv_dim..(layer + 1) * nb * 2 * kv_dim], 2 * kv_dim);
        let parts = stale.len().min(4 * crate::pool::current().threads());
        crate::pool::current().run(parts, &|p| {
            let mut cells = vec![0f32; bs * kv_dim];
            for &b in &stale[p * stale.len() / parts..(p + 1) * stale.len() / parts] {
                let b = b as usize;
                // SAFETY: each block id appears once in `stale` (a block table holds an id once), so its
                // row goes to one part.
                let row = unsafe { out.rows(b, b + 1) };
                match &keys {
                    LayerKeys::Quant(r, bytes) => block_quant_key_bounds(r, &bytes[b * kv_dim / hd * r.bytes()..(b + 1) * kv_dim / hd * r.bytes()], kv_dim, row),
                    LayerKeys::F16(keys) => block_key_bounds(&keys[b * bs * kv_dim..(b + 1) * bs * kv_dim], by_dim, kv_dim, hd, bs, &mut cells, row),
                }
            }
        });
        for &b in &stale {
            bounds.fresh[layer * nb + b as usize].store(true, Ordering::Relaxed);
        }
    }

    /// Block `b`'s key bounds in `layer`: `[2][kv_dim]`, minimums then maximums (`refresh` first).
    pub fn bounds(&self, layer: usize, b: u32) -> &[f32] {
        let (kv_dim, nb) = (self.kv_dim, self.num_blocks);
        debug_assert!(self.bounds.fresh[layer * nb + b as usize].load(Ordering::Relaxed), "refreshed");
        let at = (layer * nb + b as usize) * 2 * kv_dim;
        &self.bounds.vals[at..at + 2 * kv_dim]
    }

    /// `layer`'s fresh flags, one per block: a writer of the layer's cells clears its block's.
    pub fn fresh(&self, layer: usize) -> &[AtomicBool] {
        &self.bounds.fresh[layer * self.num_blocks..(layer + 1) * self.num_blocks]
    }

    /// Forgets block `b`'s state (its keys are replaced).
    pub fn clear(&mut self, b: u32) {
        let nb = self.num_blocks;
        (0..self.num_layers).for_each(|l| self.bounds.fresh[l * nb + b as usize].store(false, Ordering::Relaxed));
        (0..self.num_layers).for_each(|l| self.picks.len[l * nb + b as usize] = NO_PICK);
    }
}

impl Picks {
    fn new(n: usize, per: usize) -> Picks {
        Picks { per, idx: vec![0; n * per], len: vec![NO_PICK; n] }
    }
}

/// Per-dimension minimums and maximums (`out`: `[2][kv_dim]`) of one block's f16 keys (`keys`: the
/// block's part of a layer, by dimension or in rows); `cells`: a buffer of `bs * kv_dim`.
fn block_key_bounds(keys: &[f16], by_dim: bool, kv_dim: usize, hd: usize, bs: usize, cells: &mut [f32], out: &mut [f32]) {
    keys.convert_to_f32_slice(cells);
    let (lo, hi) = out.split_at_mut(kv_dim);
    lo.fill(f32::INFINITY);
    hi.fill(f32::NEG_INFINITY);
    let g = key_group(bs);
    for c in 0..bs {
        for i in 0..kv_dim {
            // by dimension: `[kv_head][bs / g][hd][g]`; rows: `[bs][kv_dim]`
            let x = if by_dim { cells[((i / hd) * bs + c / g * g) * hd + (i % hd) * g + c % g] } else { cells[c * kv_dim + i] };
            lo[i] = lo[i].min(x);
            hi[i] = hi[i].max(x);
        }
    }
    // (-0 and +0 compare equal, so which one min/max returns is unspecified; the scores must not depend on it)
    lo.iter_mut().chain(hi.iter_mut()).for_each(|x| *x += 0.0);
}

/// The same minimums and maximums (`out`: `[2][kv_dim]`) of one block's quantized keys (`regions`: the
/// block's (KV head) regions of a layer, in order): each key as the attention kernels read it, `q · d`.
fn block_quant_key_bounds(r: &Region, regions: &[u8], kv_dim: usize, out: &mut [f32]) {
    let hd = r.hd;
    let (lo, hi) = out.split_at_mut(kv_dim);
    lo.fill(f32::INFINITY);
    hi.fill(f32::NEG_INFINITY);
    let (mut q, mut d) = (vec![0i32; hd], vec![0f32; hd / 32]);
    for (h, region) in regions.chunks_exact(r.bytes()).enumerate() {
        for c in 0..r.bs {
            r.read(region, c, true, &mut q, &mut d);
            for i in 0..hd {
                let x = q[i] as f32 * d[i / 32];
                lo[h * hd + i] = lo[h * hd + i].min(x);
                hi[h * hd + i] = hi[h * hd + i].max(x);
            }
        }
    }
    lo.iter_mut().chain(hi.iter_mut()).for_each(|x| *x += 0.0);
}

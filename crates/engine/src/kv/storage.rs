//! KV storage: the keys and values of every cached token, in fixed-size blocks of token slots.
//!
//! The model never owns it: callers pass it into `forward` together with each sequence's block table,
//! so a scheduler can page, share and free blocks without touching tensors. Layout per layer, f16 (llama.cpp's
//! default): values `v[block][slot][kv_dim]` with `kv_dim = n_kv_heads * head_dim`; keys the same
//! (`KeyLayout::Rows`, the ggml numerics), or by dimension (`KeyLayout::ByDim`, the packed numerics):
//! ```text
//! k[block][kv_head][bs / G][head_dim][G]   G = 16 when the block size is a multiple of 16, else bs
//! ```
//! so the 16 cells of a group sit side by side for each dimension, and a score is one FMA chain over the
//! dimensions with 16 cells in the lanes of a vector (`kernels::attention::by_dim`). Quantized
//! (`kv::quant`): `k[block][kv_head]` regions of a block's cells of one head. Every way, a block's cells of
//! a layer are one contiguous byte range, which is what the disk tier saves.

use super::layout::KvLayout;
use super::quant::{KvDtype, KvDtypes, Region};
use super::sparse_state::{LayerKeys, SparseState};
use crate::huge_buf::HugeBuf;
use half::f16;
use half::slice::HalfFloatSliceExt;
use std::sync::atomic::{AtomicBool, Ordering};

// Blocks are saved to disk as the bytes in memory: f16 little-endian.
#[cfg(not(target_endian = "little"))]
compile_error!("the KV storage's disk format assumes a little-endian machine");

/// How f16 keys are laid out in a block (see the module comment). Quantized keys have their own layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KeyLayout {
    /// `[slot][kv_dim]`: a cell's keys in a row (ggml's layout, the ggml numerics' score order).
    #[default]
    Rows,
    /// `[kv_head][bs / G][head_dim][G]` per block (the packed numerics).
    ByDim,
}

/// Cells per dimension-major group in blocks of `bs` cells: 16 (one AVX-512 vector of f32), or the
/// whole block when 16 does not divide it (then only the scalar kernels read it).
#[inline]
pub fn key_group(bs: usize) -> usize {
    if bs % 16 == 0 { 16 } else { bs }
}

/// Index (in f16 elements of a layer's keys) of dimension `d` of KV head `h` of cell `slot`, keys by
/// dimension.
#[inline(always)]
pub fn by_dim_index(slot: usize, h: usize, d: usize, n_kv_heads: usize, hd: usize, bs: usize) -> usize {
    let g = key_group(bs);
    let (block, c) = (slot / bs, slot % bs);
    ((block * n_kv_heads + h) * bs + c / g * g) * hd + d * g + c % g
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub num_layers: usize,
    pub kv_dim: usize,
    /// Values per KV head (the quantized layouts are per head).
    pub head_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub dtypes: KvDtypes,
    /// f16 keys' layout (ignored when keys are quantized).
    pub key_layout: KeyLayout,
}

impl KvShape {
    /// Whether f16 keys are stored by dimension.
    pub fn keys_by_dim(&self) -> bool {
        !self.dtypes.is_quantized() && self.key_layout == KeyLayout::ByDim
    }
}

/// One layer's quantized keys and values, with their regions' geometry (`kv::quant`).
#[derive(Clone, Copy)]
pub struct QuantLayer<'a> {
    pub(crate) keys: &'a [u8],
    pub(crate) values: &'a [u8],
    pub(crate) k: Region,
    pub(crate) v: Region,
    pub(crate) n_kv_heads: usize,
}

impl QuantLayer<'_> {
    /// Byte offset of (block, KV head)'s region of keys (`k`) or values.
    #[inline]
    pub(crate) fn region_at(&self, r: &Region, block: u32, kv_head: usize) -> usize {
        (block as usize * self.n_kv_heads + kv_head) * r.bytes()
    }
}

pub struct KvStorage {
    /// `num_layers` is the layers a block holds: every model layer, or a hybrid layout's page slots.
    pub shape: KvShape,
    /// Which slot of a block, and which of a sequence's block tables, serve each model layer.
    layout: KvLayout,
    /// Every layer's keys then values, one mapping: huge pages need 2 MiB-aligned runs of 2 MiB, which a
    /// layer's own buffer (1.7 MiB for SmolLM2's 4,400 f16 cells) would not hold; on 4 KiB pages a decode
    /// at depth 4096 ran at two thirds of the speed. f16 elements, so f16 views are aligned; quantized
    /// cells are viewed as bytes. Huge pages: a decode step reads cells scattered over the pool (`huge_buf`).
    data: HugeBuf<f16>,
    /// Bytes of one layer's keys, and of its values.
    k_bytes: usize,
    v_bytes: usize,
    /// Sparse attention's key bounds and picks of each (layer, block) (`kv::sparse_state`); only once
    /// `keep_sparse_state` asked for them.
    sparse: Option<SparseState>,
    /// A hybrid model's recurrent state per sequence slot (`SeqInput::state`).
    pub conv_states: super::ConvStates,
}

impl KvStorage {
    pub fn new(shape: KvShape) -> Self {
        Self::with_layout(shape, KvLayout::uniform(shape.num_layers))
    }

    /// A storage whose blocks are `layout`'s pages (`shape.num_layers` is its slots).
    pub fn with_layout(shape: KvShape, layout: KvLayout) -> Self {
        assert_eq!(layout.slots(), shape.num_layers, "a block holds the layout's slots");
        assert!(shape.kv_dim % shape.head_dim == 0, "kv_dim is whole heads");
        shape.dtypes.check_shape(shape.head_dim, shape.block_size).expect("KV dtypes checked before the storage is made");
        let cells = shape.num_blocks * shape.block_size;
        let (k_bytes, v_bytes) = (cells * shape.dtypes.k.bytes(shape.kv_dim), cells * shape.dtypes.v.bytes(shape.kv_dim));
        // Even (32-value blocks of even byte sizes), so every part starts f16-aligned.
        debug_assert!(k_bytes % 2 == 0 && v_bytes % 2 == 0);
        KvStorage { shape, layout, data: HugeBuf::zeroed(shape.num_layers * (k_bytes + v_bytes) / 2), k_bytes, v_bytes, sparse: None, conv_states: Default::default() }
    }

    /// Keeps sparse attention's state from now on (`SparseState`): per-block key bounds and the picks of
    /// at most `pick_blocks` blocks a block's queries read.
    pub fn keep_sparse_state(&mut self, pick_blocks: usize) {
        match &mut self.sparse {
            Some(state) => state.keep_picks(pick_blocks),
            None => self.sparse = Some(SparseState::new(self.shape.num_layers, self.shape.num_blocks, self.shape.kv_dim, pick_blocks)),
        }
    }

    /// Bytes `keep_sparse_state` adds per block (all layers).
    pub fn sparse_state_bytes_per_block(num_layers: usize, kv_dim: usize, pick_blocks: usize) -> usize {
        SparseState::bytes_per_block(num_layers, kv_dim, pick_blocks)
    }

    fn sparse_state(&self) -> &SparseState {
        self.sparse.as_ref().expect("keep_sparse_state first")
    }

    /// The picks kept for the queries of block `b` in `layer` (`set_sparse_pick`), if any.
    pub fn sparse_pick(&self, layer: usize, b: u32) -> Option<&[u32]> {
        self.sparse_state().pick(layer, b)
    }

    /// Keeps `picked` (indices into the block table of `b`'s sequence) for the queries of block `b` in
    /// `layer`.
    pub fn set_sparse_pick(&mut self, layer: usize, b: u32, picked: &[usize]) {
        self.sparse.as_mut().expect("keep_sparse_state first").set_pick(layer, b, picked);
    }

    /// Computes the key bounds of those of `blocks` (ids) in `layer` whose keys changed since, in
    /// parallel. The blocks must be full: a later write to one of them makes it stale again.
    pub fn refresh_key_bounds(&mut self, layer: usize, blocks: &[u32]) {
        let rk = self.layer_ranges(layer).0;
        // quantized keys: the layer's (block, KV head) regions, read back as `q · d` (`Region::read`)
        let keys = match self.shape.dtypes.is_quantized() {
            true => LayerKeys::Quant(self.region(self.shape.dtypes.k), &as_bytes(&self.data)[rk]),
            false => LayerKeys::F16(&self.data[rk.start / 2..rk.end / 2]),
        };
        self.sparse.as_mut().expect("keep_sparse_state first").refresh(layer, blocks, keys, &self.shape);
    }

    /// Block `b`'s key bounds in `layer`: `[2][kv_dim]`, minimums then maximums (`refresh_key_bounds`
    /// first).
    pub fn key_bounds(&self, layer: usize, b: u32) -> &[f32] {
        self.sparse_state().bounds(layer, b)
    }

    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Bytes held for keys and values of all layers.
    pub fn num_bytes(&self) -> usize {
        self.shape.num_blocks * self.block_bytes()
    }

    /// The storage slot of position `pos` of a sequence with this block table.
    #[inline]
    pub fn slot(&self, block_table: &[u32], pos: usize) -> usize {
        let bs = self.shape.block_size;
        block_table[pos / bs] as usize * bs + pos % bs
    }

    fn region(&self, dtype: KvDtype) -> Region {
        Region { dtype, hd: self.shape.head_dim, bs: self.shape.block_size }
    }

    /// Byte ranges of `layer`'s keys and values in `data`.
    fn layer_ranges(&self, layer: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let at = layer * (self.k_bytes + self.v_bytes);
        (at..at + self.k_bytes, at + self.k_bytes..at + self.k_bytes + self.v_bytes)
    }

    fn bytes(&self) -> &[u8] {
        as_bytes(&self.data)
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`; every byte pattern is a valid f16.
        unsafe { std::slice::from_raw_parts_mut(self.data.as_mut_ptr().cast::<u8>(), 2 * self.data.len()) }
    }

    /// A writer of `layer`'s cells that the parts of a parallel run share, each writing its own tokens'
    /// cells (see `LayerWriter::write`).
    pub fn layer_writer(&mut self, layer: usize) -> LayerWriter<'_> {
        let (k, v) = (self.region(self.shape.dtypes.k), self.region(self.shape.dtypes.v));
        let (rk, rv) = self.layer_ranges(layer);
        let (kv_dim, block_size) = (self.shape.kv_dim, self.shape.block_size);
        let base = self.bytes_mut().as_mut_ptr();
        // SAFETY: both ranges are inside the buffer.
        let (keys, values) = unsafe { (base.add(rk.start), base.add(rv.start)) };
        let keys_by_dim = self.shape.keys_by_dim();
        let fresh = self.sparse.as_ref().map(|s| s.fresh(layer));
        LayerWriter { keys, values, len_k: rk.len(), len_v: rv.len(), kv_dim, block_size, head_dim: self.shape.head_dim, keys_by_dim, k, v, fresh, _storage: std::marker::PhantomData }
    }

    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let w = self.layer_writer(layer);
        // SAFETY: `&mut self`: no one else reads or writes the storage meanwhile.
        unsafe { w.write(slot, k, v) };
    }

    /// Bytes of one block: keys and values of every layer.
    pub fn block_bytes(&self) -> usize {
        self.shape.block_size * self.shape.dtypes.bytes_per_token(self.shape.num_layers, self.shape.kv_dim)
    }

    /// Byte ranges (in `data`) of block `b`'s keys then values, layer by layer.
    fn block_ranges(&self, b: u32) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        let bs = self.shape.block_size;
        (0..self.shape.num_layers).flat_map(move |layer| {
            let (rk, rv) = self.layer_ranges(layer);
            [(rk, self.shape.dtypes.k), (rv, self.shape.dtypes.v)].map(|(r, d)| {
                let n = bs * d.bytes(self.shape.kv_dim);
                r.start + b as usize * n..r.start + (b as usize + 1) * n
            })
        })
    }

    /// Block `b`'s keys and values: per layer its keys then its values (f16 little-endian, or the
    /// quantized regions' bytes).
    pub fn read_block(&self, b: u32) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.block_bytes());
        for r in self.block_ranges(b) {
            out.extend_from_slice(&self.bytes()[r]);
        }
        out
    }

    /// Overwrites block `b` with bytes from `read_block` (of a storage of the same shape).
    pub fn write_block(&mut self, b: u32, data: &[u8]) {
        assert_eq!(data.len(), self.block_bytes(), "a block's bytes");
        if let Some(state) = &mut self.sparse {
            state.clear(b);
        }
        let ranges: Vec<std::ops::Range<usize>> = self.block_ranges(b).collect();
        let mut at = 0;
        for r in ranges {
            let n = r.len();
            self.bytes_mut()[r].copy_from_slice(&data[at..at + n]);
            at += n;
        }
    }

    /// All f16 keys and values of one layer, indexed by slot, or None when the cells are quantized.
    pub fn layer_f16(&self, layer: usize) -> Option<(&[f16], &[f16])> {
        if self.shape.dtypes.is_quantized() {
            return None;
        }
        let (rk, rv) = self.layer_ranges(layer);
        Some((&self.data[rk.start / 2..rk.end / 2], &self.data[rv.start / 2..rv.end / 2]))
    }

    /// All f16 keys and values of one layer, indexed by slot (f16 storage only).
    pub fn layer(&self, layer: usize) -> (&[f16], &[f16]) {
        self.layer_f16(layer).expect("an f16 KV storage")
    }

    /// The f16 keys of `slot` in `layer` (`[kv_dim]`, heads in order), whatever their layout.
    pub fn key_row(&self, layer: usize, slot: usize) -> Vec<f16> {
        let (keys, _) = self.layer(layer);
        let (kv_dim, hd, bs) = (self.shape.kv_dim, self.shape.head_dim, self.shape.block_size);
        if !self.shape.keys_by_dim() {
            return keys[slot * kv_dim..(slot + 1) * kv_dim].to_vec();
        }
        let n_kv = kv_dim / hd;
        (0..kv_dim).map(|i| keys[by_dim_index(slot, i / hd, i % hd, n_kv, hd, bs)]).collect()
    }

    /// One layer's quantized cells, or None for f16 storage.
    pub fn layer_quant(&self, layer: usize) -> Option<QuantLayer<'_>> {
        if !self.shape.dtypes.is_quantized() {
            return None;
        }
        let (rk, rv) = self.layer_ranges(layer);
        Some(QuantLayer {
            keys: &self.bytes()[rk],
            values: &self.bytes()[rv],
            k: self.region(self.shape.dtypes.k),
            v: self.region(self.shape.dtypes.v),
            n_kv_heads: self.shape.kv_dim / self.shape.head_dim,
        })
    }
}

/// The bytes of `data`.
fn as_bytes(data: &[f16]) -> &[u8] {
    // SAFETY: f16 is plain 2-byte data; the view covers exactly the slice's memory.
    unsafe { std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), 2 * data.len()) }
}

/// One layer's keys and values, written cell by cell from several threads (`KvStorage::layer_writer`).
pub struct LayerWriter<'a> {
    keys: *mut u8,
    values: *mut u8,
    len_k: usize,
    len_v: usize,
    kv_dim: usize,
    block_size: usize,
    head_dim: usize,
    /// f16 keys by dimension (`KeyLayout::ByDim`).
    keys_by_dim: bool,
    k: Region,
    v: Region,
    /// The layer's key bounds' fresh flags (`SparseState::fresh`), cleared by each write to a block.
    fresh: Option<&'a [AtomicBool]>,
    _storage: std::marker::PhantomData<&'a mut KvStorage>,
}

// SAFETY: the writer only hands out writes of whole cells, and `write`'s callers promise that no two
// threads write the same cell at once (a batch's tokens have distinct slots).
unsafe impl Send for LayerWriter<'_> {}
unsafe impl Sync for LayerWriter<'_> {}

impl LayerWriter<'_> {
    /// `KvStorage::slot`.
    pub fn slot(&self, block_table: &[u32], pos: usize) -> usize {
        block_table[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }

    /// `KvStorage::write` of one cell: `k` and `v` are `[kv_dim]`, rounded to f16 or quantized.
    ///
    /// # Safety
    /// No other thread writes or reads cell `slot` of this layer during the call.
    pub unsafe fn write(&self, slot: usize, k: &[f32], v: &[f32]) {
        let d = self.kv_dim;
        assert!(k.len() == d && v.len() == d, "a KV cell is [kv_dim]");
        if let Some(fresh) = self.fresh {
            fresh[slot / self.block_size].store(false, Ordering::Relaxed);
        }
        for (base, len, r, x, keys) in [(self.keys, self.len_k, &self.k, k, true), (self.values, self.len_v, &self.v, v, false)] {
            if r.dtype == KvDtype::F16 && keys && self.keys_by_dim {
                let (hd, bs) = (self.head_dim, self.block_size);
                assert!((slot / bs + 1) * bs * d * 2 <= len, "KV cell {slot} out of range");
                let base = base.cast::<f16>();
                for (i, &x) in x.iter().enumerate() {
                    // SAFETY: in bounds (the cell's block is, checked), exclusive and aligned as below.
                    unsafe { *base.add(by_dim_index(slot, i / hd, i % hd, d / hd, hd, bs)) = f16::from_f32(x) };
                }
                continue;
            }
            if r.dtype == KvDtype::F16 {
                assert!((slot + 1) * d * 2 <= len, "KV cell {slot} out of range");
                // SAFETY: in bounds (checked), exclusive by the caller's promise, f16-aligned (the buffer
                // holds f16); the storage outlives `self`.
                let cell = unsafe { std::slice::from_raw_parts_mut(base.cast::<f16>().add(slot * d), d) };
                // `half`'s slice conversion (F16C where present) rounds to nearest even, as `f16::from_f32`.
                cell.convert_from_f32_slice(x);
                continue;
            }
            let (block, c) = (slot / self.block_size, slot % self.block_size);
            let heads = d / r.hd;
            for h in 0..heads {
                let at = (block * heads + h) * r.bytes();
                assert!(at + r.bytes() <= len, "KV cell {slot} out of range");
                // SAFETY: the region is in bounds (checked); `Region::write` touches only cell `c`'s bytes
                // (its quants and scales; a q4_0 byte holds two dims of one cell), which are this call's
                // alone by the caller's promise.
                unsafe { r.write(base.add(at), c, &x[h * r.hd..(h + 1) * r.hd], keys) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_read_writes_back_into_another_block() {
        let mut kv = KvStorage::new(KvShape { num_layers: 2, kv_dim: 3, head_dim: 3, block_size: 2, num_blocks: 3, dtypes: KvDtypes::F16, key_layout: KeyLayout::Rows });
        for layer in 0..2 {
            for slot in 0..6 {
                let x = (layer * 10 + slot) as f32;
                kv.write(layer, slot, &[x, x + 0.5, -x], &[x * 2.0, 1.0, 0.25]);
            }
        }
        let block1 = kv.read_block(1);
        assert_eq!(block1.len(), kv.block_bytes());
        kv.write_block(2, &block1);
        assert_eq!(kv.read_block(2), block1);
        let (k, v) = kv.layer(1);
        assert_eq!((k[4 * 3..6 * 3].to_vec(), v[4 * 3..6 * 3].to_vec()), (k[2 * 3..4 * 3].to_vec(), v[2 * 3..4 * 3].to_vec()));
    }

    /// Keys by dimension hold the same f16 keys as rows, for block sizes that 16 divides and not; a
    /// block's bytes are still one range (its cells' keys of every head).
    #[test]
    fn keys_by_dimension_hold_the_rows_keys() {
        for bs in [16, 32, 4, 5] {
            let shape = |key_layout| KvShape { num_layers: 2, kv_dim: 128, head_dim: 64, block_size: bs, num_blocks: 4, dtypes: KvDtypes::F16, key_layout };
            let (mut rows, mut by_dim) = (KvStorage::new(shape(KeyLayout::Rows)), KvStorage::new(shape(KeyLayout::ByDim)));
            for layer in 0..2 {
                for slot in 0..4 * bs {
                    let k: Vec<f32> = (0..128).map(|i| ((layer * 1000 + slot * 128 + i) as f32 * 0.37).sin()).collect();
                    let v: Vec<f32> = k.iter().map(|x| x * 2.0 - 0.5).collect();
                    rows.write(layer, slot, &k, &v);
                    by_dim.write(layer, slot, &k, &v);
                }
            }
            for layer in 0..2 {
                assert_eq!(rows.layer(layer).1, by_dim.layer(layer).1, "values stay rows");
                for slot in 0..4 * bs {
                    assert_eq!(rows.key_row(layer, slot), by_dim.key_row(layer, slot), "bs {bs} slot {slot}");
                }
            }
            let g = key_group(bs);
            assert_eq!(by_dim.layer(0).0[by_dim_index(bs + 1, 1, 3, 2, 64, bs)], rows.layer(0).0[(bs + 1) * 128 + 64 + 3]);
            assert_eq!(by_dim_index(bs + 1, 1, 3, 2, 64, bs), (2 + 1) * bs * 64 + 3 * g + 1);
            let block1 = by_dim.read_block(1);
            by_dim.write_block(3, &block1);
            for c in 0..bs {
                assert_eq!(by_dim.key_row(1, 3 * bs + c), rows.key_row(1, bs + c));
            }
        }
    }

    #[test]
    fn quantized_blocks_read_and_write_back_whole() {
        for dtypes in ["q8_0", "q4_0", "q8_0,q4_0"] {
            let dtypes = KvDtypes::parse(dtypes).unwrap();
            let shape = KvShape { num_layers: 2, kv_dim: 128, head_dim: 64, block_size: 16, num_blocks: 3, dtypes, key_layout: KeyLayout::Rows };
            let mut kv = KvStorage::new(shape);
            for layer in 0..2 {
                for slot in 0..48 {
                    let k: Vec<f32> = (0..128).map(|i| ((layer * 1000 + slot * 128 + i) as f32 * 0.1).sin()).collect();
                    let v: Vec<f32> = k.iter().map(|x| x * 2.0 - 0.5).collect();
                    kv.write(layer, slot, &k, &v);
                }
            }
            let block1 = kv.read_block(1);
            assert_eq!(block1.len(), kv.block_bytes());
            assert_eq!(kv.block_bytes(), 16 * dtypes.bytes_per_token(2, 128));
            assert_ne!(kv.read_block(2), block1);
            kv.write_block(2, &block1);
            assert_eq!(kv.read_block(2), block1, "{dtypes:?}");
        }
    }
}

//! KV storage: the keys and values of every cached token, in fixed-size blocks of token slots.
//!
//! The model never owns it: callers pass it into `forward` together with each sequence's block table,
//! so a scheduler can page, share and free blocks without touching tensors. Layout per layer:
//! `k[block][slot][kv_dim]` with `kv_dim = n_kv_heads * head_dim`, stored as f16 (llama.cpp's default).

use crate::huge_buf::HugeBuf;
use half::f16;
use half::slice::HalfFloatSliceExt;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    pub num_layers: usize,
    pub kv_dim: usize,
    pub block_size: usize,
    pub num_blocks: usize,
}

pub struct KvStorage {
    pub shape: KvShape,
    /// Per layer: `[num_blocks * block_size * kv_dim]` keys, then values.
    /// Huge pages: a decode step reads cells scattered over the whole pool (see `huge_buf`).
    keys: Vec<HugeBuf<f16>>,
    values: Vec<HugeBuf<f16>>,
}

impl KvStorage {
    pub fn new(shape: KvShape) -> Self {
        let len = shape.num_blocks * shape.block_size * shape.kv_dim;
        KvStorage {
            shape,
            keys: (0..shape.num_layers).map(|_| HugeBuf::zeroed(len)).collect(),
            values: (0..shape.num_layers).map(|_| HugeBuf::zeroed(len)).collect(),
        }
    }

    /// Bytes held for keys and values of all layers.
    pub fn num_bytes(&self) -> usize {
        2 * self.shape.num_layers * self.shape.num_blocks * self.shape.block_size * self.shape.kv_dim * 2
    }

    /// The storage slot of position `pos` of a sequence with this block table.
    #[inline]
    pub fn slot(&self, block_table: &[u32], pos: usize) -> usize {
        let bs = self.shape.block_size;
        block_table[pos / bs] as usize * bs + pos % bs
    }

    /// A writer of `layer`'s cells that the parts of a parallel run share, each writing its own tokens'
    /// cells (see `LayerWriter::write`).
    pub fn layer_writer(&mut self, layer: usize) -> LayerWriter<'_> {
        let kv_dim = self.shape.kv_dim;
        let (k, v) = (&mut self.keys[layer], &mut self.values[layer]);
        LayerWriter { keys: k.as_mut_ptr(), values: v.as_mut_ptr(), len: k.len(), kv_dim, block_size: self.shape.block_size, _storage: std::marker::PhantomData }
    }

    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let d = self.shape.kv_dim;
        // `half`'s slice conversion (F16C where present) rounds to nearest even, as `f16::from_f32`.
        self.keys[layer][slot * d..(slot + 1) * d].convert_from_f32_slice(k);
        self.values[layer][slot * d..(slot + 1) * d].convert_from_f32_slice(v);
    }

    /// Bytes of one block: keys and values of every layer.
    pub fn block_bytes(&self) -> usize {
        2 * self.shape.num_layers * self.shape.block_size * self.shape.kv_dim * 2
    }

    /// Range of block `b`'s elements in a layer's keys (or values).
    fn block_range(&self, b: u32) -> std::ops::Range<usize> {
        let n = self.shape.block_size * self.shape.kv_dim;
        b as usize * n..(b as usize + 1) * n
    }

    /// Block `b`'s keys and values: per layer its keys then its values, f16 little-endian.
    pub fn read_block(&self, b: u32) -> Vec<u8> {
        let r = self.block_range(b);
        let mut out = Vec::with_capacity(self.block_bytes());
        for (k, v) in self.keys.iter().zip(&self.values) {
            for part in [&k[r.clone()], &v[r.clone()]] {
                extend_le_bytes(&mut out, part);
            }
        }
        out
    }

    /// Overwrites block `b` with bytes from `read_block` (of a storage of the same shape).
    pub fn write_block(&mut self, b: u32, data: &[u8]) {
        assert_eq!(data.len(), self.block_bytes(), "a block's bytes");
        let r = self.block_range(b);
        let part = r.len() * 2;
        let mut src = data.chunks_exact(part);
        for (k, v) in self.keys.iter_mut().zip(self.values.iter_mut()) {
            for dst in [&mut k[r.clone()], &mut v[r.clone()]] {
                copy_le_bytes(dst, src.next().expect("length checked"));
            }
        }
    }

    /// All keys and values of one layer, indexed by slot.
    pub fn layer(&self, layer: usize) -> (&[f16], &[f16]) {
        (&self.keys[layer], &self.values[layer])
    }
}

/// One layer's keys and values, written cell by cell from several threads (`KvStorage::layer_writer`).
pub struct LayerWriter<'a> {
    keys: *mut f16,
    values: *mut f16,
    len: usize,
    kv_dim: usize,
    block_size: usize,
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

    /// `KvStorage::write` of one cell.
    ///
    /// # Safety
    /// No other thread writes or reads cell `slot` of this layer during the call.
    pub unsafe fn write(&self, slot: usize, k: &[f32], v: &[f32]) {
        let d = self.kv_dim;
        assert!((slot + 1) * d <= self.len && k.len() == d && v.len() == d, "KV cell {slot} out of range");
        // SAFETY: in bounds (checked), exclusive by the caller's promise; the storage outlives `self`.
        let (kc, vc) = unsafe { (std::slice::from_raw_parts_mut(self.keys.add(slot * d), d), std::slice::from_raw_parts_mut(self.values.add(slot * d), d)) };
        kc.convert_from_f32_slice(k);
        vc.convert_from_f32_slice(v);
    }
}

/// Appends f16 values as little-endian bytes (one copy on little-endian machines).
fn extend_le_bytes(out: &mut Vec<u8>, values: &[f16]) {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: f16 is a plain 2-byte value with no padding; its in-memory bytes are its bits in
        // little-endian order on this target.
        let bytes = unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values)) };
        out.extend_from_slice(bytes);
    }
    #[cfg(not(target_endian = "little"))]
    for x in values {
        out.extend_from_slice(&x.to_bits().to_le_bytes());
    }
}

/// Overwrites f16 values from little-endian bytes (one copy on little-endian machines).
fn copy_le_bytes(dst: &mut [f16], src: &[u8]) {
    assert_eq!(src.len(), std::mem::size_of_val(dst));
    #[cfg(target_endian = "little")]
    {
        // SAFETY: lengths are equal (checked above), the regions cannot overlap (one is borrowed mutably),
        // and every bit pattern is a valid f16.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr().cast::<u8>(), src.len()) };
    }
    #[cfg(not(target_endian = "little"))]
    for (x, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *x = f16::from_bits(u16::from_le_bytes([c[0], c[1]]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_read_writes_back_into_another_block() {
        let mut kv = KvStorage::new(KvShape { num_layers: 2, kv_dim: 3, block_size: 2, num_blocks: 3 });
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
}

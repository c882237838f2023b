//! KV storage: the keys and values of every cached token, in fixed-size blocks of token slots.
//!
//! The model never owns it: callers pass it into `forward` together with each sequence's block table,
//! so a scheduler can page, share and free blocks without touching tensors. Layout per layer:
//! `k[block][slot][kv_dim]` with `kv_dim = n_kv_heads * head_dim`, stored as f16 (llama.cpp's default).

use half::f16;

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
    keys: Vec<Vec<f16>>,
    values: Vec<Vec<f16>>,
}

impl KvStorage {
    pub fn new(shape: KvShape) -> Self {
        let len = shape.num_blocks * shape.block_size * shape.kv_dim;
        KvStorage {
            shape,
            keys: (0..shape.num_layers).map(|_| vec![f16::ZERO; len]).collect(),
            values: (0..shape.num_layers).map(|_| vec![f16::ZERO; len]).collect(),
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

    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let d = self.shape.kv_dim;
        let dst_k = &mut self.keys[layer][slot * d..(slot + 1) * d];
        dst_k.iter_mut().zip(k).for_each(|(o, &x)| *o = f16::from_f32(x));
        let dst_v = &mut self.values[layer][slot * d..(slot + 1) * d];
        dst_v.iter_mut().zip(v).for_each(|(o, &x)| *o = f16::from_f32(x));
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
        let mut src = data.chunks_exact(2).map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])));
        for (k, v) in self.keys.iter_mut().zip(self.values.iter_mut()) {
            for x in k[r.clone()].iter_mut().chain(v[r.clone()].iter_mut()) {
                *x = src.next().expect("length checked");
            }
        }
    }

    /// All keys and values of one layer, indexed by slot.
    pub fn layer(&self, layer: usize) -> (&[f16], &[f16]) {
        (&self.keys[layer], &self.values[layer])
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

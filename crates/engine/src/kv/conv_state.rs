//! The recurrent state of a hybrid model's short-convolution layers (LFM2's), beside the paged KV.
//!
//! Per sequence slot and conv layer: the last `l_cache - 1` positions of the layer's gated input,
//! `[channel][position]` f32, oldest first, and how many of the sequence's tokens it has absorbed.
//! Snapshots: the pool lends some blocks a state slot (`BlockPool::give_state`, every N-th block of a
//! sequence); the state after such a block's last token is kept there, per conv layer, written by the
//! same token pass that writes the block's keys and values. A prefix-cache hit ends on a block with a
//! snapshot (`KvCacheManager` cuts it there), so a sequence whose state is not at its chunk's start
//! takes it from the snapshot of the block that ends there. Position 0 starts from zeros. The disk tier
//! keeps a block's snapshot beside its keys and values (`snapshot_bytes`, `write_snapshot`).

use super::block_pool::NO_STATE;

/// Every sequence slot's state and every snapshot slot's, grown as they are first used.
#[derive(Default)]
pub struct ConvStates {
    /// f32 values of one layer's state (`d_model × (l_cache − 1)`) and the conv layers.
    layer_len: usize,
    layers: usize,
    states: Vec<f32>,     // [slot][layer][layer_len]
    absorbed: Vec<usize>, // [slot][layer] tokens the state has taken in
    snapshots: Vec<f32>,  // [snapshot slot][layer][layer_len]
    /// Per block, its snapshot slot (`BlockPool::state_slots`, copied before each step).
    snapshot_of: Vec<u32>,
}

impl ConvStates {
    /// States of `layers` conv layers of `layer_len` values each.
    pub fn new(layers: usize, layer_len: usize) -> Self {
        ConvStates { layers, layer_len, ..Default::default() }
    }

    /// The pool's block -> snapshot slot map, as it stands for the coming step.
    pub fn map_snapshots(&mut self, of_block: &[u32]) {
        self.snapshot_of.clear();
        self.snapshot_of.extend_from_slice(of_block);
    }

    fn snapshot_slot(&self, block: u32) -> Option<usize> {
        self.snapshot_of.get(block as usize).copied().filter(|&s| s != NO_STATE).map(|s| s as usize)
    }

    /// Slot `slot`'s state in conv layer `layer`, made to stand at `pos` tokens: zeros at 0; the
    /// snapshot of the block that ends at `pos` (`ending_block`) when the state stands elsewhere (a
    /// prefix-cache hit, a recompute).
    pub fn at(&mut self, slot: u32, layer: usize, pos: usize, ending_block: Option<u32>) -> (&mut [f32], &mut usize) {
        let (layers, layer_len) = (self.layers, self.layer_len);
        let i = slot as usize * layers + layer;
        if self.absorbed.len() <= i {
            self.absorbed.resize((slot as usize + 1) * layers, usize::MAX);
            self.states.resize((slot as usize + 1) * layers * layer_len, 0.0);
        }
        let range = i * layer_len..(i + 1) * layer_len;
        if self.absorbed[i] != pos {
            if pos == 0 {
                self.states[range.clone()].fill(0.0);
            } else {
                let b = ending_block.expect("a state that stands elsewhere is restored from the block ending at its position");
                let s = self.snapshot_slot(b).unwrap_or_else(|| panic!("block {b} ends a hit but holds no state snapshot"));
                let j = (s * layers + layer) * layer_len;
                assert!(self.snapshots.len() >= j + layer_len, "snapshot slot {s} was never written");
                let (states, snaps) = (&mut self.states, &self.snapshots);
                states[range.clone()].copy_from_slice(&snaps[j..j + layer_len]);
            }
            self.absorbed[i] = pos;
        }
        (&mut self.states[range], &mut self.absorbed[i])
    }

    /// Slot `slot` goes to another sequence: its state stands nowhere until that sequence's first token.
    pub fn forget(&mut self, slot: u32) {
        let layers = self.layers.max(1);
        let first = slot as usize * layers;
        for a in self.absorbed.iter_mut().skip(first).take(layers) {
            *a = usize::MAX;
        }
    }

    /// Keeps slot `slot`'s state of `layer` as the snapshot of `block` (its last token just absorbed),
    /// if the block holds a snapshot slot.
    pub fn snapshot(&mut self, slot: u32, layer: usize, block: u32) {
        let Some(s) = self.snapshot_slot(block) else { return };
        let (layers, len) = (self.layers, self.layer_len);
        let j = (s * layers + layer) * len;
        if self.snapshots.len() < j + len {
            self.snapshots.resize((s + 1) * layers * len, 0.0);
        }
        let i = (slot as usize * layers + layer) * len;
        self.snapshots[j..j + len].copy_from_slice(&self.states[i..i + len]);
    }

    /// Bytes of one snapshot (every conv layer's state).
    pub fn snapshot_len(&self) -> usize {
        self.layers * self.layer_len * 4
    }

    /// Snapshot slot `s`'s bytes (f32 little-endian, layer after layer), for the disk tier.
    pub fn snapshot_bytes(&self, s: u32) -> Vec<u8> {
        let n = self.layers * self.layer_len;
        let j = s as usize * n;
        let mut out = Vec::with_capacity(n * 4);
        match self.snapshots.get(j..j + n) {
            Some(v) => v.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes())),
            None => out.resize(n * 4, 0),
        }
        out
    }

    /// Fills the snapshot of `block` (which holds a slot) from `bytes` (`snapshot_bytes`' layout).
    pub fn write_snapshot(&mut self, block: u32, bytes: &[u8]) {
        let n = self.layers * self.layer_len;
        assert_eq!(bytes.len(), n * 4, "a snapshot's bytes");
        let s = self.snapshot_slot(block).expect("a restored block with a snapshot holds a state slot");
        if self.snapshots.len() < (s + 1) * n {
            self.snapshots.resize((s + 1) * n, 0.0);
        }
        for (x, b) in self.snapshots[s * n..(s + 1) * n].iter_mut().zip(bytes.chunks_exact(4)) {
            *x = f32::from_le_bytes(b.try_into().expect("4 bytes"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_starts_at_zero_and_comes_back_from_a_block_snapshot() {
        let mut c = ConvStates::new(2, 4);
        // blocks 5 and 6 hold snapshot slots 1 and 0
        let mut map = vec![NO_STATE; 8];
        (map[5], map[6]) = (1, 0);
        c.map_snapshots(&map);
        let (s, n) = c.at(1, 0, 0, None);
        assert_eq!(s, &[0.0; 4]);
        s.copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        *n = 16;
        c.snapshot(1, 0, 5);
        // the same slot at 16: its own state
        assert_eq!(c.at(1, 0, 16, Some(5)).0, &[1.0, 2.0, 3.0, 4.0]);
        // another slot at 16 (a cache hit of one block): block 5's snapshot
        assert_eq!(c.at(0, 0, 16, Some(5)).0, &[1.0, 2.0, 3.0, 4.0]);
        // back at 0: zeros again
        assert_eq!(c.at(1, 0, 0, None).0, &[0.0; 4]);
        // a slot handed to another sequence whose hit ends where the old one stood: the snapshot, not
        // the old sequence's state
        let (s, n) = c.at(0, 0, 16, Some(5));
        s.copy_from_slice(&[9.0; 4]);
        *n = 32;
        c.snapshot(0, 0, 6);
        c.forget(0);
        assert_eq!(c.at(0, 0, 32, Some(5)).0, &[1.0, 2.0, 3.0, 4.0]);
        // a block without a slot keeps nothing
        c.snapshot(0, 0, 7);
        // the disk tier's round trip: block 5's snapshot into block 6's slot
        let bytes = c.snapshot_bytes(1);
        assert_eq!(bytes.len(), c.snapshot_len());
        c.write_snapshot(6, &bytes);
        c.forget(0);
        assert_eq!(c.at(0, 0, 32, Some(6)).0, &[1.0, 2.0, 3.0, 4.0]);
    }
}

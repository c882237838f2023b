//! The recurrent state of a hybrid model's short-convolution layers (LFM2's), beside the paged KV.
//!
//! Per sequence slot and conv layer: the last `l_cache - 1` positions of the layer's gated input,
//! `[channel][position]` f32, oldest first, and how many of the sequence's tokens it has absorbed.
//! Per KV block and conv layer: a snapshot of the state after the block's last token, written as that
//! token is computed. A block's keys and values and its snapshot are written by the same token pass, so
//! a prefix-cache hit of whole blocks finds the state at its end in its last block: a sequence whose
//! state is not at its chunk's start takes it from there (`KvStorage`'s blocks are the prefix cache's).
//! Position 0 starts from zeros.

/// Every slot's state and every block's snapshot, grown as they are first used.
#[derive(Default)]
pub struct ConvStates {
    /// f32 values of one layer's state (`d_model × (l_cache − 1)`) and the conv layers.
    layer_len: usize,
    layers: usize,
    states: Vec<f32>, // [slot][layer][layer_len]
    absorbed: Vec<usize>, // [slot][layer] tokens the state has taken in
    snapshots: Vec<f32>, // [block][layer][layer_len]
}

impl ConvStates {
    fn shape(&mut self, layers: usize, layer_len: usize) {
        assert!(self.layer_len == 0 || (self.layer_len, self.layers) == (layer_len, layers), "one state shape per storage");
        (self.layers, self.layer_len) = (layers, layer_len);
    }

    /// Slot `slot`'s state in conv layer `layer` (of `layers`, each `layer_len` values), made to stand
    /// at `pos` tokens: zeros at 0; the snapshot of the block that ends at `pos` (`ending_block`) when
    /// the state stands elsewhere (a prefix-cache hit, a recompute).
    pub fn at(&mut self, slot: u32, layer: usize, layers: usize, layer_len: usize, pos: usize, ending_block: Option<u32>) -> (&mut [f32], &mut usize) {
        self.shape(layers, layer_len);
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
                let b = ending_block.expect("a state that stands elsewhere is restored from the block ending at its position") as usize;
                let j = (b * layers + layer) * layer_len;
                assert!(self.snapshots.len() >= j + layer_len, "block {b} has no conv-state snapshot");
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

    /// Keeps slot `slot`'s state of `layer` as the snapshot of `block` (its last token just absorbed).
    pub fn snapshot(&mut self, slot: u32, layer: usize, block: u32) {
        let (layers, len) = (self.layers, self.layer_len);
        let j = (block as usize * layers + layer) * len;
        if self.snapshots.len() < j + len {
            self.snapshots.resize((block as usize + 1) * layers * len, 0.0);
        }
        let i = (slot as usize * layers + layer) * len;
        self.snapshots[j..j + len].copy_from_slice(&self.states[i..i + len]);
    }

    /// Bytes the slots and snapshots used so far hold.
    pub fn bytes(&self) -> usize {
        (self.states.len() + self.snapshots.len()) * 4 + self.absorbed.len() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_starts_at_zero_and_comes_back_from_a_block_snapshot() {
        let mut c = ConvStates::default();
        let (s, n) = c.at(1, 0, 2, 4, 0, None);
        assert_eq!(s, &[0.0; 4]);
        s.copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        *n = 16;
        c.snapshot(1, 0, 5);
        // the same slot at 16: its own state
        assert_eq!(c.at(1, 0, 2, 4, 16, Some(5)).0, &[1.0, 2.0, 3.0, 4.0]);
        // another slot at 16 (a cache hit of one block): block 5's snapshot
        assert_eq!(c.at(0, 0, 2, 4, 16, Some(5)).0, &[1.0, 2.0, 3.0, 4.0]);
        // back at 0: zeros again
        assert_eq!(c.at(1, 0, 2, 4, 0, None).0, &[0.0; 4]);
        // a slot handed to another sequence whose hit ends where the old one stood: the snapshot, not
        // the old sequence's state
        let (s, n) = c.at(0, 0, 2, 4, 16, Some(5));
        s.copy_from_slice(&[9.0; 4]);
        *n = 32;
        c.snapshot(0, 0, 6);
        c.forget(0);
        assert_eq!(c.at(0, 0, 2, 4, 32, Some(5)).0, &[1.0, 2.0, 3.0, 4.0]);
    }
}

//! The recurrent state of a hybrid model's short-convolution layers (LFM2's), beside the paged KV: per
//! sequence slot, for each conv layer, the last `l_cache - 1` positions of the layer's gated input,
//! `[conv layer][channel][position]` f32, oldest position first. A slot's state is the sequence's after
//! its last computed token; the model zeroes it when a sequence starts at position 0.

/// Every slot's state, grown as slots are first used.
#[derive(Default)]
pub struct ConvStates {
    per_slot: usize,
    data: Vec<f32>,
}

impl ConvStates {
    /// Slot `slot`'s state of `per_slot` values (the model's size; the same for every slot).
    pub fn slot_mut(&mut self, slot: u32, per_slot: usize) -> &mut [f32] {
        assert!(self.per_slot == 0 || self.per_slot == per_slot, "one state size per storage");
        self.per_slot = per_slot;
        let end = (slot as usize + 1) * per_slot;
        if self.data.len() < end {
            self.data.resize(end, 0.0);
        }
        &mut self.data[end - per_slot..end]
    }

    /// Bytes the slots used so far hold.
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }
}

//! The fixed set of KV blocks, by id: which are free, and how many sequences hold each one.
//!
//! Holds no tensors: a block id indexes `KvStorage`'s blocks, which the model reads and writes. The
//! number of blocks is fixed at start-up (from the KV memory budget), so admission and preemption are
//! decisions about ids, testable without a model.

use std::collections::VecDeque;

#[derive(Debug)]
pub struct BlockPool {
    /// Free block ids, next to hand out at the front. Freed blocks join at the back, so the blocks freed
    /// longest ago are reused first (the order the prefix cache will evict in).
    free: VecDeque<u32>,
    /// Sequences holding each block.
    ref_counts: Vec<u32>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        let num_blocks = u32::try_from(num_blocks).expect("block ids are u32");
        BlockPool { free: (0..num_blocks).collect(), ref_counts: vec![0; num_blocks as usize] }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// `n` blocks from the front of the free queue, or `None` (and nothing taken) if fewer are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let blocks: Vec<u32> = self.free.drain(..n).collect();
        for &b in &blocks {
            debug_assert_eq!(self.ref_counts[b as usize], 0, "block {b} was free and held");
            self.ref_counts[b as usize] = 1;
        }
        Some(blocks)
    }

    /// Releases one hold on each block of a sequence's table. Blocks nobody holds any more join the free
    /// queue tail first (last block first), so that a sequence's later blocks are reused before its
    /// earlier ones: a shared prefix outlives the suffixes built on it.
    pub fn release(&mut self, block_table: &[u32]) {
        for &b in block_table.iter().rev() {
            let count = &mut self.ref_counts[b as usize];
            assert!(*count > 0, "block {b} released more often than it was held");
            *count -= 1;
            if *count == 0 {
                self.free.push_back(b);
            }
        }
    }

    /// How many sequences hold block `b`.
    pub fn ref_count(&self, b: u32) -> u32 {
        self.ref_counts[b as usize]
    }

    /// The free queue, front first (for tests and metrics).
    pub fn free_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.free.iter().copied()
    }
}

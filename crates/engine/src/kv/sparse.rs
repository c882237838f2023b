//! Query-aware block-sparse attention over a sequence's history (`--sparse-attention N`, after Quest,
//! Tang et al. 2024): a query at depth reads its sinks, its most recent blocks, and the `N` positions'
//! worth of older blocks whose keys can score highest against it, instead of every cell.
//!
//! Regions of a query at `pos` in block `j = pos / bs`, in whole blocks:
//! - sinks `[0, sink_end)`, always read;
//! - history `[sink_end, local_start)`, where `local_start` is the first position of block `j -
//!   local_blocks`; when it holds more than `budget_blocks` blocks, the picks (`pick`) are that many of
//!   them, by an upper bound of q·k over each block (`kernels::attention::sparse`), else all are read;
//! - local `[local_start, pos]`, always read.
//!
//! The picks are made once per block of queries, by the q of the block's first position (its leader),
//! and every query of the block reads through the same view (`view`): the sink blocks, the picked
//! blocks in order, the local blocks. So a prefill chunk's queries share views 16 at a time and the
//! attention kernels tile them as dense attention's (one-token tiles cost about twice as much a cell),
//! and the bounds are computed for one query in 16. A leader's picks are kept with its block
//! (`KvStorage::sparse_pick`) for the block's later queries, which may come in later steps. Every block
//! stays in memory, since a later block may pick what this one skipped: the option saves time, not
//! memory.
//!
//! What a query reads is a function of its leader's q and the keys before the leader's local region,
//! never of how its prompt was chunked or what else ran in the step, so greedy output stays the same
//! across batches, chunkings and cache states (a prefix-cache hit ends at a block boundary, so the
//! first computed query of a request is a leader). It is not dense attention's output: a picked block
//! set is an approximation, measured by `reckon lab eviction --sparse-attention` (recall) and `reckon
//! lab prefix` (time).

use std::ops::Range;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SparseAttention {
    /// History positions a query reads at most, picked by block (`N`, rounded up to whole blocks).
    pub budget: usize,
    /// Recent positions every query reads besides its own block's (rounded up to whole blocks).
    pub local: usize,
    /// Leading positions every query reads (rounded up to whole blocks).
    pub sinks: usize,
}

impl SparseAttention {
    /// Sink blocks: `sinks` rounded up to whole blocks.
    pub fn sink_blocks(&self, bs: usize) -> usize {
        self.sinks.div_ceil(bs)
    }

    /// History blocks a query picks when it has more.
    pub fn budget_blocks(&self, bs: usize) -> usize {
        self.budget.div_ceil(bs).max(1)
    }

    /// Blocks before its own a query reads whole: `local` rounded up to whole blocks.
    pub fn local_blocks(&self, bs: usize) -> usize {
        self.local.div_ceil(bs)
    }

    /// The first position of a query's local region: `local_blocks` blocks before the block holding
    /// `pos` (0 near the start). The same for every query of a block, as the rest of its view.
    pub fn local_start(&self, pos: usize, bs: usize) -> usize {
        (pos / bs).saturating_sub(self.local_blocks(bs)) * bs
    }

    /// The history blocks a query at `pos` picks from; empty when it reads all of them (no more than the
    /// budget).
    pub fn candidates(&self, pos: usize, bs: usize) -> Range<usize> {
        let lo = self.sink_blocks(bs);
        let hi = (self.local_start(pos, bs) / bs).max(lo);
        if hi - lo <= self.budget_blocks(bs) {
            lo..lo
        } else {
            lo..hi
        }
    }

    /// The `budget_blocks` candidates with the highest scores (`scores[i]` for block `candidates.start +
    /// i`), ascending. Ties go to the earlier block, and the order is total (`f32::total_cmp`), so the
    /// set is a function of the scores alone.
    pub fn pick(&self, candidates: Range<usize>, scores: &[f32], bs: usize) -> Vec<usize> {
        assert_eq!(scores.len(), candidates.len(), "a score per candidate block");
        let k = self.budget_blocks(bs).min(candidates.len());
        let mut order: Vec<usize> = (0..scores.len()).collect();
        if k < order.len() {
            order.select_nth_unstable_by(k, |&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
            order.truncate(k);
        }
        order.sort_unstable();
        order.into_iter().map(|i| candidates.start + i).collect()
    }

    /// The block table a query at `pos` reads through, given its `picked` history blocks (ascending), and
    /// its position in it.
    pub fn view(&self, table: &[u32], picked: &[usize], pos: usize, bs: usize) -> (Vec<u32>, usize) {
        let sink_blocks = self.sink_blocks(bs);
        let local = self.local_start(pos, bs) / bs;
        debug_assert!(picked.iter().all(|&b| (sink_blocks..local).contains(&b)), "picked blocks lie in the history");
        let view: Vec<u32> = table[..sink_blocks].iter().chain(picked.iter().map(|&b| &table[b])).chain(&table[local..]).copied().collect();
        (view, (sink_blocks + picked.len()) * bs + pos - local * bs)
    }

    /// Distinguishes KV computed under this configuration from any other (the disk tier's files): a
    /// nonzero code from the three sizes and the version of the rules above (2: picks by block leader).
    pub fn code(&self) -> u32 {
        let mut h: u32 = 0x811c_9dc5;
        for x in [2, self.budget, self.local, self.sinks] {
            for b in (x as u64).to_le_bytes() {
                h = (h ^ b as u32).wrapping_mul(0x0100_0193);
            }
        }
        h | 1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: SparseAttention = SparseAttention { budget: 40, local: 20, sinks: 4 };

    #[test]
    fn a_query_picks_among_history_blocks_only_past_the_budget() {
        // budget 40 → 3 blocks of 16; sinks → block 0; local 20 → the 2 blocks before the query's own
        assert_eq!((S.sink_blocks(16), S.budget_blocks(16), S.local_blocks(16)), (1, 3, 2));
        // pos 79 (block 4): local from block 2, history block 1 only, within the budget
        assert_eq!(S.local_start(79, 16), 32);
        assert!(S.candidates(79, 16).is_empty());
        // block 6 (96..112): history blocks 1..4, three, still within the budget
        assert!(S.candidates(96, 16).is_empty() && S.candidates(111, 16).is_empty());
        // block 7: history 1..5, four blocks; every query of the block has the same regions
        assert_eq!(S.candidates(112, 16), 1..5);
        assert_eq!(S.candidates(127, 16), 1..5);
        assert_eq!(S.local_start(112, 16), S.local_start(127, 16));
        // a short sequence has no history
        assert!(S.candidates(3, 16).is_empty());
    }

    #[test]
    fn picks_are_the_highest_scores_ties_to_the_earlier_block() {
        assert_eq!(S.pick(1..6, &[0.5, 2.0, -1.0, 2.0, 1.0], 16), vec![2, 4, 5]);
        assert_eq!(S.pick(1..6, &[1.0, 1.0, 1.0, 1.0, 1.0], 16), vec![1, 2, 3]);
        // NaN orders above every number under total_cmp; what matters is that the set is determined
        assert_eq!(S.pick(1..6, &[f32::NAN, 0.0, 3.0, 2.0, 1.0], 16), vec![1, 3, 4]);
        assert_eq!(S.pick(2..4, &[0.0, 1.0], 16), vec![2, 3]);
    }

    #[test]
    fn the_view_holds_sinks_picks_and_the_local_blocks() {
        let table: Vec<u32> = (100..110).collect();
        // pos 120 (block 7): local from block 5
        let (view, vpos) = S.view(&table, &[2, 4], 120, 16);
        assert_eq!(view, vec![100, 102, 104, 105, 106, 107, 108, 109]);
        assert_eq!(vpos, 3 * 16 + (120 - 80));
        // the query's own cell is the same through the view
        assert_eq!(view[vpos / 16] * 16 + (vpos % 16) as u32, table[120 / 16] * 16 + 120 % 16);
        // the block's other queries read the same view, one cell on per position
        assert_eq!(S.view(&table, &[2, 4], 113, 16), (view, vpos - 7));
        assert_ne!(S.code(), SparseAttention { budget: 48, ..S }.code());
    }
}

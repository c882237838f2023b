//! A StreamingLLM rotating window (`--kv-window N --kv-sinks S`, Xiao et al. 2023): every layer of a
//! sequence attends to its first tokens (the attention sinks) and its last tokens only, and whole blocks
//! between them are returned to the pool, so a sequence's KV memory is bounded however long it runs.
//!
//! Blocks are the unit:
//! - the sinks are the first `S` positions rounded up to whole blocks, `[0, sink_end)`;
//! - a query at `pos` attends to `[0, sink_end)` and to `[first_live(pos), pos]`, where `first_live` is
//!   the first position of the block holding `pos + 1 - N`: at least the last `N` positions, at most
//!   `N + block_size - 1`;
//! - a block is dead once no later query attends to it, and is released (its table entry becomes
//!   `NULL_BLOCK`).
//!
//! What a query attends to is a function of its position alone (not of how its prompt was chunked, what
//! else ran in the step, or whether a prefix was cached), so greedy output stays identical across batches
//! and cache states, as without a window.
//!
//! Positions: every token keeps its original position. Its key is rotated (RoPE) once, at its index in
//! the sequence, and never again; the sinks keep positions `0..sink_end`. A window bounds memory, not
//! length: sequences stay within the model's context length (StreamingLLM's re-indexing of positions
//! inside the cache, to run past the trained length, is not done).

/// A released block's entry in a request's block table: nothing may read or write through it.
pub const NULL_BLOCK: u32 = u32::MAX;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvWindow {
    /// Recent positions every query attends to (`N`, at least one block).
    pub window: usize,
    /// Leading positions every query attends to (`S`, rounded up to whole blocks).
    pub sinks: usize,
}

impl KvWindow {
    /// The first position after the sink blocks.
    pub fn sink_end(&self, block_size: usize) -> usize {
        self.sinks.div_ceil(block_size) * block_size
    }

    /// The first position of the block holding `pos + 1 - window` (0 while the window reaches back to
    /// the start).
    pub fn first_live(&self, pos: usize, block_size: usize) -> usize {
        (pos + 1).saturating_sub(self.window) / block_size * block_size
    }

    /// The positions a query at `pos` does not attend to, `[sink_end, first_live)`; empty while the
    /// window and the sinks meet.
    pub fn gap(&self, pos: usize, block_size: usize) -> std::ops::Range<usize> {
        let sink_end = self.sink_end(block_size);
        sink_end..self.first_live(pos, block_size).max(sink_end)
    }

    /// Blocks no query at or after position `next` attends to: `gap(next)` in blocks.
    pub fn dead_blocks(&self, next: usize, block_size: usize) -> std::ops::Range<usize> {
        let g = self.gap(next, block_size);
        g.start / block_size..g.end / block_size
    }

    /// Blocks a sequence of `len` positions holds once the blocks behind its window are released.
    pub fn held_blocks(&self, len: usize, block_size: usize) -> usize {
        len.div_ceil(block_size) - self.dead_blocks(len, block_size).len()
    }

    /// Most blocks a sequence holds at once when its steps carry at most `max_chunk` tokens: the sinks,
    /// the window's blocks, and a chunk's.
    pub fn max_blocks(&self, block_size: usize, max_chunk: usize) -> usize {
        self.sink_end(block_size) / block_size + self.window.div_ceil(block_size) + 1 + max_chunk.div_ceil(block_size)
    }

    /// The block table a query at `pos` reads through (positions renumbered so that what it attends to
    /// is one run): the sink blocks, then the table's blocks from `first_live(pos)` on (to its end, so
    /// the later queries of a chunk with the same gap share it); and the query's position in it. `None`
    /// when nothing is skipped (the real table and position serve).
    pub fn view(&self, table: &[u32], pos: usize, block_size: usize) -> Option<(Vec<u32>, usize)> {
        let g = self.gap(pos, block_size);
        if g.is_empty() {
            return None;
        }
        let (sink_blocks, live) = (g.start / block_size, g.end / block_size);
        let view: Vec<u32> = table[..sink_blocks].iter().chain(&table[live..]).copied().collect();
        // (a released block is never live for a later query; checked, as a read through one would be out
        // of the storage's bounds)
        assert!(view.iter().all(|&b| b != NULL_BLOCK), "a query at {pos} reads a released block");
        Some((view, pos - g.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_query_attends_to_the_sink_blocks_and_at_least_the_last_window_positions() {
        let w = KvWindow { window: 40, sinks: 4 };
        assert_eq!(w.sink_end(16), 16);
        // pos 55: 55 + 1 - 40 = 16 is in block 1, so nothing is skipped
        assert!(w.gap(55, 16).is_empty());
        assert!(w.gap(63, 16).is_empty());
        // pos 71: 32 is in block 2; block 1 (16..32) is skipped
        assert_eq!(w.gap(71, 16), 16..32);
        assert_eq!(w.dead_blocks(71, 16), 1..2);
        // the window is N..N + block_size - 1 positions
        for pos in 0..500 {
            let g = w.gap(pos, 16);
            let attended = g.start.min(pos + 1) + (pos + 1 - g.end.max(g.start).min(pos + 1));
            if !g.is_empty() {
                let recent = pos + 1 - g.end;
                assert!((40..40 + 16).contains(&recent), "pos {pos}: {recent} recent positions");
                assert_eq!(attended, 16 + recent);
            }
        }
    }

    #[test]
    fn the_view_renumbers_positions_past_the_gap() {
        let w = KvWindow { window: 20, sinks: 1 };
        let table = [7, NULL_BLOCK, NULL_BLOCK, 3, 9, 4];
        // pos 70: 70 + 1 - 20 = 51 is in block 3 (48..64): blocks 1 and 2 are skipped
        let (view, vpos) = w.view(&table, 70, 16).unwrap();
        assert_eq!(view, vec![7, 3, 9, 4]);
        assert_eq!(vpos, 70 - 32);
        // the slot of a position is the same through the view
        assert_eq!(view[vpos / 16] * 16 + (vpos % 16) as u32, table[70 / 16] * 16 + 70 % 16);
        assert_eq!(w.view(&[1, 2], 20, 16), None);
    }

    #[test]
    fn no_sinks_keep_no_blocks() {
        let w = KvWindow { window: 16, sinks: 0 };
        assert_eq!(w.sink_end(16), 0);
        assert_eq!(w.dead_blocks(48, 16), 0..2);
        // no sink blocks, the window's block, one for a window off the block grid, a 512-token chunk's
        assert_eq!(w.max_blocks(16, 512), 1 + 1 + 32);
    }
}

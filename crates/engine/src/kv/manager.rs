//! A request's KV blocks: which cached blocks its prompt can reuse, which blocks it gets as it grows, which
//! of its full blocks join the prefix cache, and their release. Holds block ids only (vLLM v1's
//! `KVCacheManager` over its `BlockPool`); the scheduler asks it, the engine never reaches past it.
//!
//! Prefix caching: every full block a request computes is registered under a key chained from its
//! parent's key and its token ids. A request being admitted (new, or preempted and back) takes the longest
//! run of cached blocks equal to its leading full blocks, capped so that at least its last token is
//! computed (its logits are needed), and starts computing after them. Hits are whole blocks, so no
//! request ever writes into a block another one holds.

use super::block_pool::{BlockHash, BlockPool, EvictedBlock};
use super::window::{KvWindow, NULL_BLOCK};

/// One request's blocks and its place in the prefix cache. Made by `KvCacheManager::new_blocks`, changed
/// only by the manager.
#[derive(Clone, Debug, Default)]
pub struct RequestBlocks {
    /// The blocks holding the request's positions, in order: position `p` is in `table[p / block_size]`.
    pub table: Vec<u32>,
    /// The parent key of the first block: the pool's root, or a salted one.
    root: BlockHash,
    /// Keys of the request's full blocks so far, each computed once.
    hashes: Vec<BlockHash>,
    /// Leading blocks of `table` registered in the prefix cache.
    num_registered: usize,
    /// Prompt blocks `first..first + n` whose keys and values the engine holds (read from the disk
    /// tier), usable at first admission if the memory hit reaches `first`.
    restorable: Option<(usize, usize)>,
    /// Cached blocks of the prefix held while the request waits for a disk read, so the read still
    /// continues them at admission.
    pinned: Vec<u32>,
    /// With a window: table entries before this one that left it are released (`NULL_BLOCK`); 0 while
    /// none is.
    released_to: usize,
}

/// What admitting a waiting request took: its first `num_computed_tokens` are in its blocks (a cache
/// hit, and restored blocks once the engine fills them), and its table has room for `num_new_tokens`
/// more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    pub num_computed_tokens: usize,
    pub num_new_tokens: usize,
    /// Restored blocks to fill before the step: `blocks[i]` gets the engine's restorable block
    /// `skip + i` (counted from the first block it offered).
    pub restore: Option<(usize, Vec<u32>)>,
}

/// For a waiting request: the parent key of its first block, the keys of the blocks a cache hit may
/// cover (all full blocks but the one holding the last token), and how many are cached in memory now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrefixProbe {
    pub root: BlockHash,
    pub hashes: Vec<BlockHash>,
    pub in_memory: usize,
}

/// Prefix cache counters, in prompt tokens, over first admissions (as vLLM's queries and hits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Prompt tokens of admitted requests.
    pub queried_tokens: u64,
    /// Of those, tokens found in the cache (memory or disk).
    pub hit_tokens: u64,
    /// Of the hits, tokens restored from the disk tier.
    pub disk_hit_tokens: u64,
}

#[derive(Debug)]
pub struct KvCacheManager {
    block_size: usize,
    prefix_caching: bool,
    window: Option<KvWindow>,
    pool: BlockPool,
    stats: PrefixCacheStats,
}

impl KvCacheManager {
    pub fn new(block_size: usize, pool: BlockPool, prefix_caching: bool) -> Self {
        assert!(block_size > 0, "blocks hold at least one token");
        KvCacheManager { block_size, prefix_caching, window: None, pool, stats: PrefixCacheStats::default() }
    }

    /// Every sequence keeps only its sinks and its window (`kv::window`): dead blocks are released as it
    /// grows. Its blocks are keyed under a root of their own, so they never serve (nor are served by) a
    /// sequence that attends to everything, also in a disk tier shared with another configuration.
    pub fn with_window(mut self, window: Option<KvWindow>) -> Self {
        self.window = window;
        self
    }

    pub fn window(&self) -> Option<KvWindow> {
        self.window
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn stats(&self) -> PrefixCacheStats {
        self.stats
    }

    /// A new request's (empty) blocks; with a cache salt it shares cached blocks only with requests of
    /// the same salt (vLLM's `cache_salt`).
    pub fn new_blocks(&self, cache_salt: Option<&[u8]>) -> RequestBlocks {
        let mut root = cache_salt.map_or(self.pool.root(), |s| self.pool.salted_root(s));
        if let Some(w) = self.window {
            root = self.pool.hash(root, &[u32::MAX, w.window as u32, w.sinks as u32]);
        }
        RequestBlocks { root, ..RequestBlocks::default() }
    }

    /// See `PrefixProbe`. Takes nothing.
    pub fn probe(&self, tokens: &[u32], blocks: &RequestBlocks) -> PrefixProbe {
        let max_blocks = tokens.len().saturating_sub(1) / self.block_size;
        let mut hashes = Vec::with_capacity(max_blocks);
        self.extend_chain(blocks.root, &mut hashes, tokens, max_blocks);
        let in_memory = if self.prefix_caching { self.pool.lookup(blocks.root, &hashes, tokens, self.block_size).len() } else { 0 };
        PrefixProbe { root: blocks.root, hashes, in_memory }
    }

    /// Holds the cached blocks of a waiting request's prefix while the engine reads its next blocks
    /// from the disk tier (they must still be there at admission, for the read to continue them).
    pub fn pin_prefix(&mut self, tokens: &[u32], blocks: &mut RequestBlocks) {
        debug_assert!(blocks.table.is_empty() && blocks.pinned.is_empty(), "pin a waiting request once");
        let hit = self.cached_prefix(tokens, blocks);
        self.pool.acquire(&hit);
        blocks.pinned = hit;
    }

    /// The engine holds the keys and values of prompt blocks `first..first + n` (from the disk tier).
    pub fn offer_restored(&mut self, blocks: &mut RequestBlocks, first: usize, n: usize) {
        if blocks.table.is_empty() && n > 0 {
            blocks.restorable = Some((first, n));
        }
    }

    /// Admits a waiting request whose first chunk may carry up to `budget` tokens: takes its cached
    /// prefix (and restorable blocks: fewer, down to none, when the pool is short) and blocks for the
    /// chunk. `None`, and nothing taken, when the free blocks do not suffice. `first_admission` counts
    /// the request in the prefix-cache statistics (a preempted request coming back is not counted again).
    pub fn admit(&mut self, tokens: &[u32], blocks: &mut RequestBlocks, budget: usize, first_admission: bool) -> Option<Admission> {
        debug_assert!(blocks.table.is_empty(), "waiting requests hold no blocks");
        let hit = self.cached_prefix(tokens, blocks);
        let (bs, m) = (self.block_size, hit.len());
        let (mut restore, skip) = match blocks.restorable {
            Some((first, n)) if m >= first && m < first + n => (first + n - m, m - first),
            _ => (0, 0),
        };
        // Free blocks this admission needs with `r` restored blocks (those need blocks too). Unheld hit
        // blocks sit in the free queue: taking them leaves the rest for new blocks.
        let (len, free) = (tokens.len(), self.pool.num_free() - self.pool.num_unheld(&hit));
        let needed = |r: usize| {
            let computed = (m + r) * bs;
            (computed + (len - computed).min(budget)).div_ceil(bs) - m
        };
        while restore > 0 && needed(restore) > free {
            restore -= 1;
        }
        if needed(restore) > free {
            return None;
        }
        let computed = (m + restore) * bs;
        let n_new = (len - computed).min(budget);
        self.pool.acquire(&hit);
        self.pool.release(&std::mem::take(&mut blocks.pinned));
        if first_admission {
            // (a first admission's tokens are its prompt)
            self.stats.queried_tokens += len as u64;
            self.stats.hit_tokens += computed as u64;
            self.stats.disk_hit_tokens += (restore * bs) as u64;
        }
        blocks.restorable = None;
        blocks.num_registered = m;
        blocks.table = hit;
        assert!(self.allocate_slots(blocks, computed + n_new), "the free blocks were counted");
        let restore = (restore > 0).then(|| (skip, blocks.table[m..m + restore].to_vec()));
        Some(Admission { num_computed_tokens: computed, num_new_tokens: n_new, restore })
    }

    /// Grows the table to hold `num_tokens` positions; false (nothing taken) if the pool is short.
    pub fn allocate_slots(&mut self, blocks: &mut RequestBlocks, num_tokens: usize) -> bool {
        let missing = num_tokens.div_ceil(self.block_size).saturating_sub(blocks.table.len());
        match self.pool.allocate(missing) {
            Some(new) => {
                blocks.table.extend(new);
                true
            }
            None => false,
        }
    }

    /// Registers the request's newly computed full blocks (its first `num_computed` tokens) in the prefix
    /// cache.
    pub fn cache_full_blocks(&mut self, tokens: &[u32], num_computed: usize, blocks: &mut RequestBlocks) {
        if !self.prefix_caching {
            return;
        }
        let bs = self.block_size;
        let mut full = num_computed / bs;
        // Once the window has released a block, no block after the sinks can be reached by a lookup (it
        // walks the chain from the first block): none is registered.
        if let Some(w) = self.window.filter(|_| blocks.released_to > 0) {
            full = full.min(w.sink_end(bs) / bs);
        }
        self.extend_hashes(tokens, blocks, full);
        for j in blocks.num_registered..full {
            let (parent_hash, parent) = match j.checked_sub(1) {
                Some(p) => (blocks.hashes[p], Some(blocks.table[p])),
                None => (blocks.root, None),
            };
            self.pool.register(blocks.table[j], blocks.hashes[j], parent_hash, parent, &tokens[j * bs..(j + 1) * bs]);
            blocks.num_registered = j + 1;
        }
    }

    /// With a window: releases the blocks no query at or after position `next` attends to (their
    /// entries become `NULL_BLOCK`). Without one, does nothing.
    pub fn release_outside_window(&mut self, blocks: &mut RequestBlocks, next: usize) {
        let Some(w) = self.window else { return };
        let dead = w.dead_blocks(next, self.block_size);
        let end = dead.end.min(blocks.table.len());
        for j in dead.start.max(blocks.released_to)..end {
            let b = std::mem::replace(&mut blocks.table[j], NULL_BLOCK);
            if b != NULL_BLOCK {
                self.pool.release_uncached(b);
            }
        }
        if end > dead.start {
            blocks.released_to = blocks.released_to.max(end);
        }
    }

    /// Releases every block the request holds (the last first, so a shared prefix outlives its
    /// suffixes in the cache). Its keys stay: a preempted request recomputes the same blocks.
    pub fn free(&mut self, blocks: &mut RequestBlocks) {
        self.pool.release(&std::mem::take(&mut blocks.table));
        self.pool.release(&std::mem::take(&mut blocks.pinned));
        blocks.num_registered = 0;
        blocks.released_to = 0;
    }

    /// Cached blocks handed out again since the last call: their contents are about to be overwritten.
    pub fn take_evicted(&mut self) -> Vec<EvictedBlock> {
        self.pool.take_evicted()
    }

    /// The cached blocks holding the request's leading full blocks (none with caching off), leaving at
    /// least its last token to compute.
    fn cached_prefix(&mut self, tokens: &[u32], blocks: &mut RequestBlocks) -> Vec<u32> {
        if !self.prefix_caching {
            return Vec::new();
        }
        let max_blocks = (tokens.len() - 1) / self.block_size;
        self.extend_hashes(tokens, blocks, max_blocks);
        self.pool.lookup(blocks.root, &blocks.hashes[..max_blocks], tokens, self.block_size)
    }

    /// Computes the keys of the request's first `n_blocks` full blocks that it does not have yet.
    fn extend_hashes(&self, tokens: &[u32], blocks: &mut RequestBlocks, n_blocks: usize) {
        let root = blocks.root;
        self.extend_chain(root, &mut blocks.hashes, tokens, n_blocks);
    }

    /// Extends `hashes` (the keys of `tokens`' first blocks, chained from `root`) to `n_blocks` keys.
    fn extend_chain(&self, root: BlockHash, hashes: &mut Vec<BlockHash>, tokens: &[u32], n_blocks: usize) {
        let bs = self.block_size;
        for j in hashes.len()..n_blocks {
            let parent = hashes.last().copied().unwrap_or(root);
            hashes.push(self.pool.hash(parent, &tokens[j * bs..(j + 1) * bs]));
        }
    }
}

//! A request's KV blocks: which cached blocks its prompt can reuse, which blocks it gets as it grows, which
//! of its full blocks join the prefix cache, and their release. Holds block ids only (vLLM v1's
//! `KVCacheManager` over its `BlockPool`); the scheduler asks it, the engine never reaches past it.
//!
//! Prefix caching: every full block a request computes is registered under a key chained from its
//! parent's key and its token ids. A request being admitted (new, or preempted and back) takes the longest
//! run of cached blocks equal to its leading full blocks, capped so that at least its last token is
//! computed (its logits are needed), and starts computing after them. Hits are whole blocks, so no
//! request ever writes into a block another one holds.
//!
//! Layer groups (`kv::layout`): a request has a block table per group, all from one pool, each group's
//! blocks keyed under a root of its own (a page of one group holds other layers than another's).
//!
//! Windows (a sliding group's, or a StreamingLLM window over every layer, `kv::window`): full blocks are
//! registered before those behind the window are released, and a released block stays cached, so a
//! later request's hit needs only the blocks its next query attends to (vLLM's sliding-window cache
//! hit): the hit is the longest prefix that every full-attention group holds from its first block and
//! every windowed group holds over its sink blocks and the window before the prefix's end. What a query
//! attends to depends on its position alone, so a block computed by another request holds what this
//! one would compute: an agent session under a window keeps its cache turn after turn.
//!
//! A hybrid recurrent model (`with_state_snapshots(every)`): a prefix-cache hit must also restore the
//! recurrent state at its end, which the model snapshots into the state slot of a block
//! (`BlockPool::give_state`). Every `every`-th block of a sequence asks for a slot as it is allocated, so
//! a hit is cut to the longest prefix whose last block holds one: a multiple of `every` blocks when the
//! slots suffice. Larger `every`: fewer snapshots kept, hits in coarser steps.

use super::block_pool::{BlockHash, BlockPool, EvictedBlock};
use super::layout::KvLayout;
use super::window::{KvWindow, NULL_BLOCK};

/// One request's blocks and its place in the prefix cache. Made by `KvCacheManager::new_blocks`, changed
/// only by the manager.
#[derive(Clone, Debug, Default)]
pub struct RequestBlocks {
    /// Per layer group (one for most models), the blocks holding the request's positions in order:
    /// position `p` is in `tables[g][p / block_size]`.
    tables: Vec<Vec<u32>>,
    /// Per layer group, its place in the prefix cache.
    groups: Vec<GroupKeys>,
    /// Prompt blocks `first..first + loaded.len()` the engine read from the disk tier, as `(first,
    /// loaded)`: `loaded[i]` unless the read skipped block `first + i` (a window's gap: no query after
    /// the read attends to it). Usable at first admission if the memory hit reaches `first`.
    restorable: Option<(usize, Vec<bool>)>,
    /// With recurrent state: which of the restorable blocks came with the state after them.
    restorable_states: Vec<bool>,
    /// Cached blocks of the prefix held while the request waits for a disk read, so the read still
    /// continues them at admission.
    pinned: Vec<u32>,
    /// Only positions before this one are looked up in or registered with the prefix cache: a sparse
    /// prefill's cells after it hold a thinned prompt (`engine::sparse`), which is no prefix.
    cache_limit: Option<usize>,
}

/// One layer group's keys of a request's blocks.
#[derive(Clone, Debug, Default)]
struct GroupKeys {
    /// The parent key of the first block: the pool's root, or a salted one, per group.
    root: BlockHash,
    /// Keys of the request's full blocks so far, each computed once.
    hashes: Vec<BlockHash>,
    /// Leading blocks of the table registered in the prefix cache.
    num_registered: usize,
    /// With a window: table entries before this one that left it are released (`NULL_BLOCK`, all those
    /// after the sink blocks); 0 while none is.
    released_to: usize,
}

impl RequestBlocks {
    /// The first layer group's table (the only one without a hybrid layout).
    pub fn table(&self) -> &[u32] {
        self.tables.first().map_or(&[], |t| &t[..])
    }

    /// Every layer group's table (`kv::layout`).
    pub fn tables(&self) -> &[Vec<u32>] {
        &self.tables
    }

    /// Positions past which the request's blocks never meet the prefix cache (`KvCacheManager::limit_caching`).
    pub fn cache_limit(&self) -> Option<usize> {
        self.cache_limit
    }

    /// Blocks held now, over all groups.
    pub fn num_held(&self) -> usize {
        self.tables.iter().flatten().filter(|&&b| b != NULL_BLOCK).count()
    }
}

/// What admitting a waiting request took: its first `num_computed_tokens` are in its blocks (a cache
/// hit, and restored blocks once the engine fills them), and its table has room for `num_new_tokens`
/// more.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    pub num_computed_tokens: usize,
    pub num_new_tokens: usize,
    /// Restored blocks to fill before the step: `blocks[i]` gets the engine's restorable block
    /// `skip + i` (counted from the first block it offered); none where it is `NULL_BLOCK` (in a
    /// window's gap).
    pub restore: Option<(usize, Vec<u32>)>,
}

/// For a waiting request: the parent key of its first block, the keys of the blocks a cache hit may
/// cover (all full blocks but the one holding the last token), and how many of them a hit in memory
/// would cover now (under a window: the blocks it needs are cached, those in its gap may not be).
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
    /// Of the hits, tokens restored from the disk tier (under a window, the blocks of the restore's gap
    /// count too, as a memory hit's gap does, although they are neither read nor held).
    pub disk_hit_tokens: u64,
}

#[derive(Debug)]
pub struct KvCacheManager {
    block_size: usize,
    prefix_caching: bool,
    window: Option<KvWindow>,
    /// Each layer group's sliding window (`kv::layout`); one group without a hybrid layout.
    sliding: Vec<Option<KvWindow>>,
    pool: BlockPool,
    stats: PrefixCacheStats,
    /// A hybrid recurrent model's snapshot interval in blocks (0: no recurrent state).
    state_every: usize,
}

impl KvCacheManager {
    pub fn new(block_size: usize, pool: BlockPool, prefix_caching: bool) -> Self {
        assert!(block_size > 0, "blocks hold at least one token");
        KvCacheManager { block_size, prefix_caching, window: None, sliding: vec![None], pool, stats: PrefixCacheStats::default(), state_every: 0 }
    }

    /// Every sequence keeps only its sinks and its window (`kv::window`): dead blocks are released (and
    /// stay cached) as it grows. Its blocks are keyed under a root of their own, so they never serve (nor
    /// are served by) a sequence that attends to everything, also in a disk tier shared with another
    /// configuration.
    pub fn with_window(mut self, window: Option<KvWindow>) -> Self {
        assert!(window.is_none() || self.sliding.len() == 1, "a KV window applies to a one-group layout");
        self.window = window;
        self
    }

    /// A block table per layer group of `layout`, a sliding group's releasing what leaves its window.
    pub fn with_layout(mut self, layout: &KvLayout) -> Self {
        assert!(self.window.is_none() || !layout.is_hybrid(), "a KV window applies to a one-group layout");
        self.sliding = (0..layout.num_groups()).map(|g| layout.kv_window(g)).collect();
        self
    }

    /// A hybrid recurrent model's prefix-cache hits end where a block holds a state snapshot: every
    /// `every`-th block asks for a slot (the pool's, `BlockPool::with_state_slots`). One-group layouts,
    /// no window.
    pub fn with_state_snapshots(mut self, every: usize) -> Self {
        assert!(every > 0 && self.sliding.len() == 1 && self.window.is_none(), "state snapshots go with one group and no window");
        self.state_every = every;
        self
    }

    /// Gives state slots to blocks `from..` of `table` (just allocated) that end an `every`-block run.
    fn give_states(&mut self, table: &[u32], from: usize) {
        if self.state_every == 0 {
            return;
        }
        for (j, &b) in table.iter().enumerate().skip(from) {
            if (j + 1) % self.state_every == 0 {
                self.pool.give_state(b);
            }
        }
    }

    /// The longest of the first `m` blocks of `hit` that ends on a block holding a state snapshot (all
    /// `m` without recurrent state).
    fn state_end(&self, hit: &[u32], m: usize) -> usize {
        if self.state_every == 0 {
            return m;
        }
        (1..=m).rev().find(|&k| self.pool.state_slot(hit[k - 1]).is_some()).unwrap_or(0)
    }

    pub fn num_groups(&self) -> usize {
        self.sliding.len()
    }

    pub fn window(&self) -> Option<KvWindow> {
        self.window
    }

    /// Leading positions of a request (up to `upto`) whose draft-model keys and values its blocks hold
    /// (`BlockPool::draft_cells`; one-group layouts, which a draft model requires).
    pub fn draft_valid_prefix(&self, blocks: &RequestBlocks, upto: usize) -> usize {
        let mut n = 0;
        for &b in blocks.table() {
            if n >= upto || b == NULL_BLOCK {
                break;
            }
            let cells = self.pool.draft_cells(b);
            n += cells;
            if cells < self.block_size {
                break;
            }
        }
        n.min(upto)
    }

    /// The draft model computed positions `from..to` of a request: its blocks record them.
    pub fn mark_draft(&mut self, blocks: &RequestBlocks, from: usize, to: usize) {
        let bs = self.block_size;
        if from >= to {
            return;
        }
        for i in from / bs..to.div_ceil(bs) {
            if let Some(&b) = blocks.table().get(i).filter(|&&b| b != NULL_BLOCK) {
                // only a run that continues the block's valid cells counts
                if self.pool.draft_cells(b) >= from.max(i * bs) - i * bs {
                    self.pool.mark_draft_cells(b, (to - i * bs).min(bs));
                }
            }
        }
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
        // (the first group keeps the one-group key, so a one-group layout's keys are as before)
        let group_root = |g: usize| if g == 0 { root } else { self.pool.hash(root, &[u32::MAX - 1, g as u32]) };
        let groups = (0..self.num_groups()).map(|g| GroupKeys { root: group_root(g), ..GroupKeys::default() }).collect();
        RequestBlocks { tables: vec![Vec::new(); self.num_groups()], groups, ..RequestBlocks::default() }
    }

    /// From now on only the request's positions before `n` are looked up in or registered with the
    /// prefix cache (a sparse prefill's genuine prefix; `engine::sparse`). Only lowers the limit.
    pub fn limit_caching(&self, blocks: &mut RequestBlocks, n: usize) {
        blocks.cache_limit = Some(blocks.cache_limit.map_or(n, |l| l.min(n)));
    }

    /// Full blocks of the request that may meet the prefix cache.
    fn cacheable_blocks(&self, blocks: &RequestBlocks) -> usize {
        blocks.cache_limit.map_or(usize::MAX, |l| l / self.block_size)
    }

    /// See `PrefixProbe` (the first group's blocks: the disk tier, which asks, serves one-group layouts
    /// only). Takes nothing.
    pub fn probe(&self, tokens: &[u32], blocks: &RequestBlocks) -> PrefixProbe {
        let max_blocks = (tokens.len().saturating_sub(1) / self.block_size).min(self.cacheable_blocks(blocks));
        let mut hashes = Vec::with_capacity(max_blocks);
        let root = blocks.groups[0].root;
        self.extend_chain(root, &mut hashes, tokens, max_blocks);
        let in_memory = match (self.prefix_caching, self.window) {
            (false, _) => 0,
            // (the hit admission would take: a read from the disk tier continues it)
            (true, Some(w)) => self.longest_windowed_hit(w, root, &hashes, tokens).len(),
            (true, None) => {
                let hit = self.pool.lookup(root, &hashes, tokens, self.block_size);
                self.state_end(&hit, hit.len())
            }
        };
        PrefixProbe { root, hashes, in_memory }
    }

    /// Holds the cached blocks of a waiting request's prefix while the engine reads its next blocks
    /// from the disk tier (they must still be there at admission, for the read to continue them).
    pub fn pin_prefix(&mut self, tokens: &[u32], blocks: &mut RequestBlocks) {
        debug_assert!(blocks.num_held() == 0 && blocks.pinned.is_empty(), "pin a waiting request once");
        let (_, hits) = self.cached_prefix(tokens, blocks);
        let hit: Vec<u32> = hits.into_iter().flatten().filter(|&b| b != NULL_BLOCK).collect();
        self.pool.acquire(&hit);
        blocks.pinned = hit;
    }

    /// The engine read prompt blocks `first..first + loaded.len()` from the disk tier: it holds the
    /// keys and values of those with `loaded[i]` (see `RequestBlocks::restorable`), and, with recurrent
    /// state, the state snapshot after those with `states[i]` (empty: none).
    pub fn offer_restored(&mut self, blocks: &mut RequestBlocks, first: usize, loaded: Vec<bool>, states: Vec<bool>) {
        if blocks.num_held() == 0 && !loaded.is_empty() {
            blocks.restorable_states = states;
            blocks.restorable = Some((first, loaded));
        }
    }

    /// Admits a waiting request whose first chunk may carry up to `budget` tokens: takes its cached
    /// prefix (and restorable blocks: fewer, down to none, when the pool is short) and blocks for the
    /// chunk. `None`, and nothing taken, when the free blocks do not suffice. `first_admission` counts
    /// the request in the prefix-cache statistics (a preempted request coming back is not counted again).
    pub fn admit(&mut self, tokens: &[u32], blocks: &mut RequestBlocks, budget: usize, first_admission: bool) -> Option<Admission> {
        debug_assert!(blocks.num_held() == 0, "waiting requests hold no blocks");
        let (m, hits) = self.cached_prefix(tokens, blocks);
        let (bs, groups) = (self.block_size, self.num_groups());
        let (mut restore, skip, loaded) = match &blocks.restorable {
            Some((first, loaded)) if m >= *first && m < first + loaded.len() && groups == 1 => (first + loaded.len() - m, m - first, loaded[m - first..].to_vec()),
            _ => (0, 0, Vec::new()),
        };
        // Free blocks this admission needs with `r` restored blocks (those need blocks too), in every
        // group. Unheld hit blocks sit in the free queue: taking them leaves the rest for new blocks.
        let held: Vec<u32> = hits.iter().flatten().copied().filter(|&b| b != NULL_BLOCK).collect();
        let (len, free) = (tokens.len(), self.pool.num_free() - self.pool.num_unheld(&held));
        // Restored blocks that a query at the end of the restore no longer attends to (a window's gap,
        // which the disk read skipped, or, when the restore is cut short, loaded but no longer needed)
        // get no block; what was read for them is dropped.
        let window = self.window;
        let dead = |r: usize| -> Vec<bool> {
            let gap = window.map_or(0..0, |w| w.dead_blocks((m + r) * bs, bs));
            (m..m + r).map(|j| gap.contains(&j)).collect()
        };
        let needed = |r: usize| {
            let computed = (m + r) * bs;
            groups * ((computed + (len - computed).min(budget)).div_ceil(bs) - m) - dead(r).iter().filter(|&&d| d).count()
        };
        // A shorter restore has a shorter gap: a block the read skipped may be attended to again.
        let readable = |r: usize| dead(r).iter().zip(&loaded).all(|(&d, &l)| d || l);
        // With recurrent state, a restore ends on a block read with its snapshot, and every block read
        // with one gets a slot.
        let states: Vec<bool> = (0..loaded.len()).map(|i| blocks.restorable_states.get(skip + i).copied().unwrap_or(false)).collect();
        let slots = if self.state_every > 0 { self.pool.state_slots_available(&held) } else { 0 };
        let state_ok = |r: usize| self.state_every == 0 || r == 0 || (states[r - 1] && states[..r].iter().filter(|&&s| s).count() <= slots);
        while restore > 0 && (needed(restore) > free || !readable(restore) || !state_ok(restore)) {
            restore -= 1;
        }
        if needed(restore) > free {
            return None;
        }
        let computed = (m + restore) * bs;
        let n_new = (len - computed).min(budget);
        self.pool.acquire(&held);
        self.pool.release(&std::mem::take(&mut blocks.pinned));
        if first_admission {
            // (a first admission's tokens are its prompt)
            self.stats.queried_tokens += len as u64;
            self.stats.hit_tokens += computed as u64;
            self.stats.disk_hit_tokens += (restore * bs) as u64;
        }
        blocks.restorable = None;
        blocks.restorable_states.clear();
        for (table, hit) in blocks.tables.iter_mut().zip(hits) {
            *table = hit;
        }
        // (restores are for one-group layouts)
        let dead = dead(restore);
        let mut fresh = self.pool.allocate(dead.iter().filter(|&&d| !d).count()).expect("the free blocks were counted").into_iter();
        blocks.tables[0].extend(dead.iter().map(|&d| if d { NULL_BLOCK } else { fresh.next().expect("one per live block") }));
        for (i, &b) in blocks.tables[0][m..m + restore].iter().enumerate() {
            if states[i] {
                assert!(self.pool.give_state(b), "the state slots were counted");
            }
        }
        for (keys, table) in blocks.groups.iter_mut().zip(&blocks.tables) {
            keys.num_registered = m;
            keys.released_to = table.iter().rposition(|&b| b == NULL_BLOCK).map_or(0, |j| j + 1);
        }
        assert!(self.allocate_slots(blocks, computed + n_new), "the free blocks were counted");
        // (`NULL_BLOCK` entries: reads to drop)
        let restore = (restore > 0).then(|| (skip, blocks.tables[0][m..m + restore].to_vec()));
        Some(Admission { num_computed_tokens: computed, num_new_tokens: n_new, restore })
    }

    /// Grows the table to hold `num_tokens` positions; false (nothing taken) if the pool is short.
    pub fn allocate_slots(&mut self, blocks: &mut RequestBlocks, num_tokens: usize) -> bool {
        let want = num_tokens.div_ceil(self.block_size);
        let missing: usize = blocks.tables.iter().map(|t| want.saturating_sub(t.len())).sum();
        let Some(new) = self.pool.allocate(missing) else { return false };
        let old_len = blocks.tables[0].len();
        let mut new = new.into_iter();
        for table in &mut blocks.tables {
            let n = want.saturating_sub(table.len());
            table.extend(new.by_ref().take(n));
        }
        if self.state_every > 0 {
            let table = std::mem::take(&mut blocks.tables[0]);
            self.give_states(&table, old_len);
            blocks.tables[0] = table;
        }
        true
    }

    /// Releases the blocks after the first `num_tokens` positions' (the cells of rejected speculative
    /// guesses; never registered, so uncached).
    pub fn truncate(&mut self, blocks: &mut RequestBlocks, num_tokens: usize) {
        let keep = num_tokens.div_ceil(self.block_size);
        for (keys, table) in blocks.groups.iter().zip(&mut blocks.tables) {
            debug_assert!(keys.num_registered <= keep, "a registered block is never speculative");
            if table.len() > keep {
                let rest = table.split_off(keep);
                self.pool.release(&rest);
            }
        }
    }

    /// Records that the request's first `num_computed` tokens are computed: the full blocks are
    /// registered in the prefix cache, then the blocks that left a window are released (cached).
    pub fn advance(&mut self, tokens: &[u32], num_computed: usize, blocks: &mut RequestBlocks) {
        self.cache_full_blocks(tokens, num_computed, blocks);
        self.release_outside_window(blocks, num_computed);
    }

    /// Registers the request's newly computed full blocks (its first `num_computed` tokens) in the prefix
    /// cache.
    pub fn cache_full_blocks(&mut self, tokens: &[u32], num_computed: usize, blocks: &mut RequestBlocks) {
        if !self.prefix_caching {
            return;
        }
        let bs = self.block_size;
        let cacheable = self.cacheable_blocks(blocks);
        for (keys, table) in blocks.groups.iter_mut().zip(&blocks.tables) {
            let full = (num_computed / bs).min(cacheable);
            Self::extend_chain_with(&self.pool, bs, keys.root, &mut keys.hashes, tokens, full);
            for j in keys.num_registered..full {
                let (parent_hash, parent) = match j.checked_sub(1) {
                    Some(p) => (keys.hashes[p], Some(table[p]).filter(|&b| b != NULL_BLOCK)),
                    None => (keys.root, None),
                };
                if table[j] != NULL_BLOCK {
                    self.pool.register(table[j], keys.hashes[j], parent_hash, parent, &tokens[j * bs..(j + 1) * bs], j == 0);
                }
                keys.num_registered = j + 1;
            }
        }
    }

    /// Releases the blocks no query at or after position `next` attends to, under a StreamingLLM window
    /// and in sliding groups (their entries become `NULL_BLOCK`; registered ones stay cached, a later hit
    /// needs only its window's blocks). Without either, does nothing.
    pub fn release_outside_window(&mut self, blocks: &mut RequestBlocks, next: usize) {
        for (g, (keys, table)) in blocks.groups.iter_mut().zip(&mut blocks.tables).enumerate() {
            let Some(w) = self.group_window(g) else { continue };
            let dead = w.dead_blocks(next, self.block_size);
            let end = dead.end.min(table.len());
            for j in dead.start.max(keys.released_to)..end {
                let b = std::mem::replace(&mut table[j], NULL_BLOCK);
                if b != NULL_BLOCK {
                    self.pool.release(&[b]);
                }
            }
            if end > dead.start {
                keys.released_to = keys.released_to.max(end);
            }
        }
    }

    /// Releases every block the request holds (the last positions first, so a shared prefix outlives its
    /// suffixes in the cache; a position's blocks in every group together, so no group's prefix is
    /// evicted long before another's). Its keys stay: a preempted request recomputes the same blocks.
    pub fn free(&mut self, blocks: &mut RequestBlocks) {
        let len = blocks.tables.iter().map(Vec::len).max().unwrap_or(0);
        // (`release` goes through its list backwards)
        let order: Vec<u32> = (0..len).flat_map(|j| blocks.tables.iter().filter_map(move |t| t.get(j).copied())).collect();
        self.pool.release(&order);
        blocks.tables.iter_mut().for_each(Vec::clear);
        self.pool.release(&std::mem::take(&mut blocks.pinned));
        for keys in &mut blocks.groups {
            keys.num_registered = 0;
            keys.released_to = 0;
        }
    }

    /// Drops every cached prefix if no request holds a block (`BlockPool::reset_cache`).
    pub fn reset_cache(&mut self) -> bool {
        self.pool.reset_cache()
    }

    /// Records KV-cache events (`kv::events`) from now on.
    pub fn record_events(&mut self) {
        self.pool.record_events();
    }

    /// The KV-cache events since the last call.
    pub fn take_events(&mut self) -> Vec<super::KvEvent> {
        self.pool.take_events()
    }

    /// Cached blocks handed out again since the last call: their contents are about to be overwritten.
    pub fn take_evicted(&mut self) -> Vec<EvictedBlock> {
        self.pool.take_evicted()
    }

    /// Group `g`'s window: its sliding window, or the StreamingLLM window (one-group layouts only).
    fn group_window(&self, g: usize) -> Option<KvWindow> {
        self.sliding[g].or(self.window)
    }

    /// The request's cached prefix, leaving at least its last token to compute: `m` blocks, and per group
    /// the blocks holding them (a windowed group's entries between its sinks and its window `NULL_BLOCK`).
    /// `m` is the largest count that every full-attention group holds from the first block and every
    /// windowed group holds over the blocks a query at position `m * block_size` attends to. None with
    /// caching off.
    fn cached_prefix(&mut self, tokens: &[u32], blocks: &mut RequestBlocks) -> (usize, Vec<Vec<u32>>) {
        let groups = self.num_groups();
        if !self.prefix_caching {
            return (0, vec![Vec::new(); groups]);
        }
        let bs = self.block_size;
        let max_blocks = ((tokens.len() - 1) / bs).min(self.cacheable_blocks(blocks));
        for keys in &mut blocks.groups {
            Self::extend_chain_with(&self.pool, bs, keys.root, &mut keys.hashes, tokens, max_blocks);
        }
        let mut hits: Vec<Vec<u32>> = vec![Vec::new(); groups];
        let mut m = max_blocks;
        for (g, keys) in blocks.groups.iter().enumerate().filter(|(g, _)| self.group_window(*g).is_none()) {
            hits[g] = self.pool.lookup(keys.root, &keys.hashes[..max_blocks], tokens, bs);
            m = m.min(hits[g].len());
        }
        // the largest m (from the full groups' down) whose sinks and window every windowed group holds
        'm: loop {
            for (g, keys) in blocks.groups.iter().enumerate() {
                let Some(w) = self.group_window(g) else { continue };
                match self.windowed_hit(w, keys.root, &keys.hashes[..m], tokens) {
                    Ok(hit) => hits[g] = hit,
                    Err(shorter) => {
                        m = shorter;
                        continue 'm;
                    }
                }
            }
            break;
        }
        for (g, hit) in hits.iter_mut().enumerate() {
            if self.group_window(g).is_none() {
                hit.truncate(m);
            }
        }
        if self.state_every > 0 {
            let m = self.state_end(&hits[0], m);
            hits[0].truncate(m);
            return (m, hits);
        }
        (m, hits)
    }

    /// A windowed group's longest hit within `hashes` (`windowed_hit`, m lowered until one is whole).
    fn longest_windowed_hit(&self, w: KvWindow, root: BlockHash, hashes: &[BlockHash], tokens: &[u32]) -> Vec<u32> {
        let mut m = hashes.len();
        loop {
            match self.windowed_hit(w, root, &hashes[..m], tokens) {
                Ok(hit) => return hit,
                Err(shorter) => m = shorter,
            }
        }
    }

    /// A windowed group's hit over all of `hashes` (m blocks): its sink blocks, `NULL_BLOCK` for the gap,
    /// then the run a query at position `m * block_size` attends to. Else the longest m' < m that may
    /// still hit: a block the hit needs is missing, and every shorter hit that reaches past it needs it
    /// too (a shorter hit's window starts no later), so m' is that block's index.
    fn windowed_hit(&self, w: KvWindow, root: BlockHash, hashes: &[BlockHash], tokens: &[u32]) -> Result<Vec<u32>, usize> {
        let (bs, m) = (self.block_size, hashes.len());
        let sinks = (w.sink_end(bs) / bs).min(m);
        let lo = (w.first_live(m * bs, bs) / bs).max(sinks);
        let head = self.pool.lookup(root, &hashes[..sinks], tokens, bs);
        if head.len() < sinks {
            return Err(head.len());
        }
        let run = self.pool.lookup_from(root, hashes, tokens, bs, lo);
        if run.len() < m - lo {
            return Err(lo + run.len());
        }
        Ok(head.into_iter().chain(std::iter::repeat_n(NULL_BLOCK, lo - sinks)).chain(run).collect())
    }

    /// Extends `hashes` (the keys of `tokens`' first blocks, chained from `root`) to `n_blocks` keys.
    fn extend_chain(&self, root: BlockHash, hashes: &mut Vec<BlockHash>, tokens: &[u32], n_blocks: usize) {
        Self::extend_chain_with(&self.pool, self.block_size, root, hashes, tokens, n_blocks);
    }

    fn extend_chain_with(pool: &BlockPool, bs: usize, root: BlockHash, hashes: &mut Vec<BlockHash>, tokens: &[u32], n_blocks: usize) {
        for j in hashes.len()..n_blocks {
            let parent = hashes.last().copied().unwrap_or(root);
            hashes.push(pool.hash(parent, &tokens[j * bs..(j + 1) * bs]));
        }
    }
}

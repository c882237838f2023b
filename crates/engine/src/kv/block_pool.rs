//! The fixed set of KV blocks, by id: which are free, how many sequences hold each one, and which hold a
//! cached prefix that a later request may reuse.
//!
//! Holds no tensors: a block id indexes `KvStorage`'s blocks, which the model reads and writes. The
//! number of blocks is fixed at start-up (from the KV memory budget), so admission, preemption and
//! caching are decisions about ids, testable without a model.
//!
//! Prefix cache (as vLLM's block pool): a full block, once computed, is registered under a key chained
//! from its parent's key and its own token ids. When no sequence holds it any more it stays cached in the
//! free queue and is either found again (taken back out of the queue) or evicted when the queue's front
//! reaches it. A lookup never trusts the key alone: the stored token ids must be equal and the stored
//! parent must be the very block (id and generation) matched for the previous position, so a hash
//! collision can never serve another prefix's keys and values. The exception is the first block of a
//! run after a window's gap (`lookup_from`), whose parent block may be gone: there the parent's key
//! must be equal, and the 128-bit chained SHA-256 key stands for the whole prefix.
//!
//! State slots (a hybrid recurrent model's, `with_state_slots`): a fixed set of recurrent-state snapshot
//! slots, each lent to one block, in which the model leaves the sequence's state after the block's last
//! token (`kv::conv_state`). A cached block ends a usable prefix-cache hit only if it holds a slot. A
//! slot goes back when its block is handed out again, or released uncached; when none is free, a block
//! that wants one takes it from a cached block nobody holds (the next to be evicted first), which then
//! ends no hit: the slots are fewer than the blocks, and a shorter hit only costs compute.

use super::free_queue::FreeQueue;
use sha2::{Digest, Sha256};
use std::collections::HashMap;

/// A full block's key: chained from the parent block's key (or the pool's root key for the first block)
/// and the block's token ids.
pub type BlockHash = u128;

/// Computes a block's key from its parent's key and its token ids.
pub type BlockHasher = fn(BlockHash, &[u32]) -> BlockHash;

/// SHA-256 of the parent key and the token ids (little-endian), first 128 bits: stable across processes
/// (the disk tier relies on it) and not collidable on purpose by a client.
pub fn sha256_block_hash(parent: BlockHash, tokens: &[u32]) -> BlockHash {
    let mut h = Sha256::new();
    h.update(parent.to_le_bytes());
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    let digest = h.finalize();
    u128::from_le_bytes(digest[..16].try_into().expect("SHA-256 has 32 bytes"))
}

/// What a cached block holds, to check a lookup against.
#[derive(Clone, Debug)]
struct CacheEntry {
    hash: BlockHash,
    parent_hash: BlockHash,
    /// The block (id, generation) before this one in the sequence that computed it; `None` for the first.
    parent: Option<(u32, u32)>,
    tokens: Box<[u32]>,
}

/// A cached block whose id was just handed out again: its keys and values are about to be overwritten.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvictedBlock {
    pub block: u32,
    pub hash: BlockHash,
    pub parent_hash: BlockHash,
    pub tokens: Box<[u32]>,
    /// The state slot it held (its snapshot is there until the slot's next owner is computed).
    pub state: Option<u32>,
}

/// No state slot (`BlockPool::state_slots`).
pub const NO_STATE: u32 = u32::MAX;

/// Recurrent-state snapshot slots lent to blocks (see the module doc).
#[derive(Debug, Default)]
struct StateSlots {
    /// Per block, its slot or `NO_STATE`.
    of_block: Vec<u32>,
    /// Slots no block holds, next to lend at the end.
    free: Vec<u32>,
}

#[derive(Debug)]
pub struct BlockPool {
    /// Blocks nobody holds, next to hand out at the front. Uncached blocks go to the front, cached ones to
    /// the back (least recently used first, a sequence's later blocks before its earlier ones).
    free: FreeQueue,
    /// Sequences holding each block.
    ref_counts: Vec<u32>,
    /// Bumped each time a cached block is evicted, so a child entry never matches its parent's successor.
    generations: Vec<u32>,
    entries: Vec<Option<CacheEntry>>,
    /// Key -> cached blocks with that key (more than one only if two sequences computed the same prefix
    /// at once, or keys collide).
    by_hash: HashMap<BlockHash, Vec<u32>>,
    num_cached: usize,
    hasher: BlockHasher,
    /// The parent key of a sequence's first block (a model fingerprint: other models never match).
    root: BlockHash,
    evicted: Vec<EvictedBlock>,
    /// Per block, how many of its leading cells hold a draft model's keys and values for the block's
    /// present tokens (speculative decoding's `draft` proposer, which shares the block ids): 0 when the
    /// block is handed out anew, raised as a request's draft computes them.
    draft_cells: Vec<u16>,
    /// A hybrid recurrent model's snapshot slots, if any.
    states: Option<StateSlots>,
    /// KV-cache events since the last `take_events`, when they are recorded (`kv::events`).
    events: Option<Vec<super::KvEvent>>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        Self::with_hasher(num_blocks, sha256_block_hash, 0)
    }

    pub fn with_hasher(num_blocks: usize, hasher: BlockHasher, root: BlockHash) -> Self {
        let n = u32::try_from(num_blocks).expect("block ids are u32");
        BlockPool {
            free: FreeQueue::new(n),
            ref_counts: vec![0; num_blocks],
            generations: vec![0; num_blocks],
            entries: vec![None; num_blocks],
            by_hash: HashMap::new(),
            num_cached: 0,
            hasher,
            root,
            evicted: Vec::new(),
            draft_cells: vec![0; num_blocks],
            states: None,
            events: None,
        }
    }

    /// Records which keys are stored and removed (`kv::events`), for `take_events`.
    pub fn record_events(&mut self) {
        self.events.get_or_insert_with(Vec::new);
    }

    /// The events recorded since the last call, in order.
    pub fn take_events(&mut self) -> Vec<super::KvEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// With `n` recurrent-state snapshot slots to lend to blocks (see the module doc).
    pub fn with_state_slots(mut self, n: usize) -> Self {
        let n = u32::try_from(n).expect("state slots are u32");
        self.states = Some(StateSlots { of_block: vec![NO_STATE; self.num_blocks()], free: (0..n).rev().collect() });
        self
    }

    /// Block `b`'s state slot.
    pub fn state_slot(&self, b: u32) -> Option<u32> {
        self.states.as_ref().map(|s| s.of_block[b as usize]).filter(|&s| s != NO_STATE)
    }

    /// Every block's state slot (`NO_STATE` for none; empty without slots): what the model writes.
    pub fn state_slots(&self) -> &[u32] {
        self.states.as_ref().map_or(&[], |s| &s.of_block)
    }

    /// Lends block `b` a state slot: a free one, or one taken from the cached block nobody holds that is
    /// next to be evicted. False when every slot is held by blocks in use.
    pub fn give_state(&mut self, b: u32) -> bool {
        let Some(states) = self.states.as_mut() else { return false };
        if states.of_block[b as usize] != NO_STATE {
            return true;
        }
        let slot = match states.free.pop() {
            Some(slot) => slot,
            None => {
                let Some(from) = self.free.iter().find(|&f| states.of_block[f as usize] != NO_STATE) else { return false };
                std::mem::replace(&mut states.of_block[from as usize], NO_STATE)
            }
        };
        states.of_block[b as usize] = slot;
        true
    }

    /// State slots `give_state` could lend now when `taking` (blocks about to be held) are held.
    pub fn state_slots_available(&self, taking: &[u32]) -> usize {
        let Some(states) = self.states.as_ref() else { return 0 };
        states.free.len() + self.free.iter().filter(|&f| states.of_block[f as usize] != NO_STATE && !taking.contains(&f)).count()
    }

    fn drop_state(&mut self, b: u32) {
        if let Some(states) = self.states.as_mut() {
            let slot = std::mem::replace(&mut states.of_block[b as usize], NO_STATE);
            if slot != NO_STATE {
                states.free.push(slot);
            }
        }
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks nobody holds (cached ones included: they are reclaimable).
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks holding a registered prefix, held or not.
    pub fn num_cached(&self) -> usize {
        self.num_cached
    }

    /// The root key for requests carrying this cache salt: their blocks never match other requests'
    /// (vLLM's `cache_salt`, for tenants that must not observe each other's prefixes through timing).
    pub fn salted_root(&self, salt: &[u8]) -> BlockHash {
        let mut h = Sha256::new();
        h.update(self.root.to_le_bytes());
        h.update(b"cache_salt");
        h.update(salt);
        u128::from_le_bytes(h.finalize()[..16].try_into().expect("SHA-256 has 32 bytes"))
    }

    /// The key of the block after the one keyed `parent` (a root key for a sequence's first block)
    /// holding `tokens`.
    pub fn hash(&self, parent: BlockHash, tokens: &[u32]) -> BlockHash {
        (self.hasher)(parent, tokens)
    }

    /// `n` blocks from the front of the free queue, or `None` (and nothing taken) if fewer are free.
    /// Cached blocks among them are evicted (see `take_evicted`).
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let blocks: Vec<u32> = (0..n).map(|_| self.free.pop_front().expect("counted")).collect();
        for &b in &blocks {
            debug_assert_eq!(self.ref_counts[b as usize], 0, "block {b} was free and held");
            self.ref_counts[b as usize] = 1;
            self.draft_cells[b as usize] = 0;
            self.evict(b);
            self.drop_state(b);
        }
        Some(blocks)
    }

    fn evict(&mut self, b: u32) {
        let Some(entry) = self.entries[b as usize].take() else { return };
        let same_key = self.by_hash.get_mut(&entry.hash).expect("cached blocks are indexed");
        same_key.retain(|&x| x != b);
        if same_key.is_empty() {
            self.by_hash.remove(&entry.hash);
            if let Some(events) = self.events.as_mut() {
                events.push(super::KvEvent::BlockRemoved { hash: entry.hash, medium: super::Medium::Memory });
            }
        }
        self.num_cached -= 1;
        self.generations[b as usize] = self.generations[b as usize].wrapping_add(1);
        let CacheEntry { hash, parent_hash, tokens, .. } = entry;
        let state = self.state_slot(b);
        self.evicted.push(EvictedBlock { block: b, hash, parent_hash, tokens, state });
    }

    /// Cached blocks evicted since the last call, in eviction order.
    pub fn take_evicted(&mut self) -> Vec<EvictedBlock> {
        std::mem::take(&mut self.evicted)
    }

    /// Releases one hold on each block of a sequence's table. Blocks nobody holds any more join the free
    /// queue: uncached ones at the front (reused first, they hold nothing worth keeping), cached ones at
    /// the back, last block first, so a shared prefix outlives the suffixes built on it.
    /// Entries released by a window (`NULL_BLOCK`) are skipped.
    pub fn release(&mut self, block_table: &[u32]) {
        for &b in block_table.iter().rev().filter(|&&b| b != super::window::NULL_BLOCK) {
            let count = &mut self.ref_counts[b as usize];
            assert!(*count > 0, "block {b} released more often than it was held");
            *count -= 1;
            if *count == 0 {
                if self.entries[b as usize].is_some() {
                    self.free.push_back(b);
                } else {
                    self.free.push_front(b);
                    // (an uncached block's snapshot serves no one)
                    self.drop_state(b);
                }
            }
        }
    }

    /// The longest run of cached blocks holding a sequence's first full blocks: `root` is the parent key of
    /// its first block, `hashes[i]` the key of block `i`, `tokens` the sequence's tokens (at least
    /// `hashes.len()` blocks of them). Takes nothing.
    pub fn lookup(&self, root: BlockHash, hashes: &[BlockHash], tokens: &[u32], block_size: usize) -> Vec<u32> {
        self.lookup_from(root, hashes, tokens, block_size, 0)
    }

    /// `lookup` of the run of cached blocks holding full blocks `first..` of a sequence (a sliding-window
    /// layer group's, whose earlier blocks may be gone): block `first` is matched by its key, its parent's
    /// key and its tokens (its parent block may have been evicted), each later one also as the child of
    /// the block matched before it.
    pub fn lookup_from(&self, root: BlockHash, hashes: &[BlockHash], tokens: &[u32], block_size: usize, first: usize) -> Vec<u32> {
        let mut hit: Vec<u32> = Vec::new();
        for (i, hash) in hashes.iter().enumerate().skip(first) {
            let want = &tokens[i * block_size..(i + 1) * block_size];
            let parent = hit.last().map(|&p| (p, self.generations[p as usize]));
            let parent_hash = if i == 0 { root } else { hashes[i - 1] };
            let found = self.by_hash.get(hash).and_then(|blocks| {
                blocks.iter().copied().find(|&b| {
                    let e = self.entries[b as usize].as_ref().expect("indexed blocks are cached");
                    (e.parent == parent || (i == first && i > 0)) && e.parent_hash == parent_hash && &*e.tokens == want
                })
            });
            match found {
                Some(b) => hit.push(b),
                None => break,
            }
        }
        hit
    }

    /// Of these blocks, how many nobody holds (taking them shrinks the free queue).
    pub fn num_unheld(&self, blocks: &[u32]) -> usize {
        blocks.iter().filter(|&&b| self.ref_counts[b as usize] == 0).count()
    }

    /// Adds one hold on each block (found by `lookup`), taking unheld ones out of the free queue.
    pub fn acquire(&mut self, blocks: &[u32]) {
        for &b in blocks {
            if self.ref_counts[b as usize] == 0 {
                self.free.remove(b);
            }
            self.ref_counts[b as usize] += 1;
        }
    }

    /// Registers a full, computed block: `hash` is its key, `parent_hash` its parent's key (the sequence's
    /// root key for a first block, `first`), `parent` the block before it in the same sequence. A block
    /// already cached (found by a lookup) keeps its entry.
    pub fn register(&mut self, block: u32, hash: BlockHash, parent_hash: BlockHash, parent: Option<u32>, tokens: &[u32], first: bool) {
        if self.entries[block as usize].is_some() {
            return;
        }
        let entry = CacheEntry { hash, parent_hash, parent: parent.map(|p| (p, self.generations[p as usize])), tokens: tokens.into() };
        self.entries[block as usize] = Some(entry);
        let same_key = self.by_hash.entry(hash).or_default();
        same_key.push(block);
        if same_key.len() == 1 {
            if let Some(events) = self.events.as_mut() {
                events.push(super::KvEvent::BlockStored { hash, parent: (!first).then_some(parent_hash), tokens: tokens.into(), medium: super::Medium::Memory });
            }
        }
        self.num_cached += 1;
    }

    /// Drops every cached prefix (vLLM's `reset_prefix_cache`, SGLang's `flush_cache`), if no sequence
    /// holds a block; false (nothing dropped) otherwise. Records `AllBlocksCleared`.
    pub fn reset_cache(&mut self) -> bool {
        if self.ref_counts.iter().any(|&c| c > 0) {
            return false;
        }
        for b in 0..self.num_blocks() as u32 {
            if self.entries[b as usize].take().is_some() {
                self.generations[b as usize] = self.generations[b as usize].wrapping_add(1);
            }
            self.drop_state(b);
        }
        self.by_hash.clear();
        self.num_cached = 0;
        if let Some(events) = self.events.as_mut() {
            events.push(super::KvEvent::AllBlocksCleared);
        }
        true
    }

    /// The parent key of every sequence's first block.
    pub fn root(&self) -> BlockHash {
        self.root
    }

    /// Every cached block, as it would be described on eviction (to save them all at shutdown): free
    /// ones in eviction order, then held ones.
    pub fn cached_blocks(&self) -> Vec<EvictedBlock> {
        let held = (0..self.num_blocks() as u32).filter(|&b| self.ref_counts[b as usize] > 0);
        let describe = |b: u32| {
            let e = self.entries[b as usize].as_ref()?;
            Some(EvictedBlock { block: b, hash: e.hash, parent_hash: e.parent_hash, tokens: e.tokens.clone(), state: self.state_slot(b) })
        };
        self.free.iter().chain(held).filter_map(describe).collect()
    }

    /// Leading cells of block `b` that hold the draft model's keys and values (see `draft_cells`).
    pub fn draft_cells(&self, b: u32) -> usize {
        self.draft_cells[b as usize] as usize
    }

    /// The draft model wrote block `b`'s cells `..n` for its present tokens (never lowers the count:
    /// a shared block's cells are the same whoever wrote them).
    pub fn mark_draft_cells(&mut self, b: u32, n: usize) {
        let c = &mut self.draft_cells[b as usize];
        *c = (*c).max(u16::try_from(n).expect("a block's cells fit u16"));
    }

    /// How many sequences hold block `b`.
    pub fn ref_count(&self, b: u32) -> u32 {
        self.ref_counts[b as usize]
    }

    /// The free queue, front first (for tests and metrics).
    pub fn free_ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.free.iter()
    }
}

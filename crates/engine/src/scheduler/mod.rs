//! Continuous batching: which sequences run in the next model step, and how many of their tokens.
//!
//! Holds token ids and block ids only, never tensors, so every decision is tested without a model
//! (`tests.rs`, exact block ids). One invariant carries it, as in vLLM's v1 scheduler: each sequence's
//! `num_computed_tokens` (tokens whose keys and values are in its blocks) catches up with its `tokens`
//! (prompt, then generated). A step schedules, per sequence, the next `tokens[num_computed..]` chunk that
//! fits the step's token budget: a whole or partial prompt (chunked prefill) or one new token (decode), all
//! in the same batch. When a chunk reaches the end of the tokens, the step's logits for it are sampled and
//! the new token is appended, so the next step decodes it.
//!
//! - Running sequences are served first, oldest first; then waiting ones are admitted first come, first
//!   served, only when their chunk's blocks are free (a large request at the head of the queue is not
//!   overtaken).
//! - A step that decodes carries at most `max_prefill_tokens_while_decoding` prompt tokens: a prompt that
//!   arrives while others decode is prefilled over several steps, each of which delays their next token
//!   by a bounded amount, instead of one step as long as the whole prompt (Sarathi-Serve's stall-free
//!   batching). Steps with nothing to decode use the whole `max_batch_tokens`.
//! - When a running sequence needs a block and none is free, the newest running sequence is preempted:
//!   its blocks are released, `num_computed_tokens` returns to 0, and it goes back to the front of the
//!   waiting queue to be recomputed later (prompt and generated tokens, one prefill).
//! - Prefix caching: every full block a sequence computes is registered in the pool under its chained
//!   key. A sequence being admitted (new, or preempted and back) first takes the longest run of cached
//!   blocks equal to its leading full blocks, capped so that at least its last token is computed (its
//!   logits are needed), and starts computing after them. Hits are whole blocks, so no sequence ever
//!   writes into a block another one holds.

mod block_pool;
mod free_queue;
#[cfg(test)]
mod prefix_tests;
#[cfg(test)]
mod tests;

pub use block_pool::{sha256_block_hash, BlockHash, BlockHasher, BlockPool, EvictedBlock};

use std::collections::{HashMap, VecDeque};

pub type SeqId = u64;

#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Token budget of one step (prefill chunks plus decodes).
    pub max_batch_tokens: usize,
    /// Prompt (prefill) tokens a step may carry when it also decodes: a prompt arriving while others
    /// decode is prefilled in chunks of at most this many tokens, so it delays their next tokens by a
    /// bounded amount (stall-free batching, as in Sarathi-Serve). `usize::MAX`: no separate limit.
    pub max_prefill_tokens_while_decoding: usize,
    /// Sequences running at once.
    pub max_running: usize,
    /// Longest sequence (prompt plus generated tokens) the model may see.
    pub max_model_len: usize,
    /// Reuse cached blocks of earlier sequences' prefixes (automatic prefix caching).
    pub prefix_caching: bool,
}

/// One request's tokens and where its KV state is.
#[derive(Clone, Debug)]
pub struct Sequence {
    pub id: SeqId,
    /// Prompt, then generated tokens.
    pub tokens: Vec<u32>,
    pub num_prompt_tokens: usize,
    /// Tokens whose keys and values are in `block_table`'s blocks.
    pub num_computed_tokens: usize,
    pub block_table: Vec<u32>,
    /// Generated tokens allowed (prompt + this fits `max_model_len`).
    pub max_new_tokens: usize,
    pub num_preemptions: u32,
    /// Prompt tokens found in the prefix cache at first admission (not computed for this request).
    pub num_cached_tokens: usize,
    /// The parent key of the first block: the pool's root, or a salted one (`set_cache_salt`).
    root: BlockHash,
    /// Keys of the sequence's full blocks so far, each computed once.
    block_hashes: Vec<BlockHash>,
    /// Leading blocks of `block_table` registered in the prefix cache.
    num_registered_blocks: usize,
    /// Blocks `first..first + n` of the prompt whose keys and values the engine holds (read from the disk
    /// tier), usable at first admission if the memory hit reaches `first`.
    restorable: Option<(usize, usize)>,
    /// Not admitted until the engine has read its blocks from the disk tier (`hold`, `offer_restored`).
    held: bool,
    /// Cached blocks of its prefix held for it while `held`, so the disk read still continues them at
    /// admission.
    pinned: Vec<u32>,
}

impl Sequence {
    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }
}

/// One sequence's share of a step: tokens `start..start + len` of its `tokens`, at positions equal to
/// their indices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledChunk {
    pub id: SeqId,
    pub start: usize,
    pub len: usize,
    /// The chunk ends at the sequence's last token: its logits are sampled after the step.
    pub samples: bool,
}

/// What the next model step computes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub chunks: Vec<ScheduledChunk>,
    /// Sequences preempted while planning (now waiting, their blocks released).
    pub preempted: Vec<SeqId>,
    /// Cached blocks handed out again while planning: their contents are overwritten by this step.
    pub evicted: Vec<EvictedBlock>,
    /// Blocks to fill with restored keys and values before this step runs.
    pub restores: Vec<Restore>,
}

/// Restored blocks of a sequence admitted in this step: `blocks[i]` gets the engine's restorable block
/// `skip + i` (counted from the offer's first block).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restore {
    pub id: SeqId,
    pub skip: usize,
    pub blocks: Vec<u32>,
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum AddError {
    /// The id is already in use.
    Duplicate(SeqId),
    EmptyPrompt,
    /// Prompt plus at least one generated token exceeds `max_model_len`.
    TooLong { prompt: usize, max_model_len: usize },
    /// The prompt plus one token needs more blocks than the whole pool has, so it could never run.
    TooLargeForPool { blocks_needed: usize, num_blocks: usize },
}

impl std::fmt::Display for AddError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AddError::Duplicate(id) => write!(f, "sequence id {id} is already scheduled"),
            AddError::EmptyPrompt => write!(f, "the prompt is empty"),
            AddError::TooLong { prompt, max_model_len } => {
                write!(f, "the prompt has {prompt} tokens; this model's context is {max_model_len} tokens, prompt and output included")
            }
            AddError::TooLargeForPool { blocks_needed, num_blocks } => {
                write!(f, "the prompt needs {blocks_needed} KV blocks; the KV memory budget holds {num_blocks}")
            }
        }
    }
}

impl std::error::Error for AddError {}

#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    pool: BlockPool,
    seqs: HashMap<SeqId, Sequence>,
    /// Admission order; preempted sequences return to the front.
    waiting: VecDeque<SeqId>,
    /// Oldest admitted first; the last one is preempted first.
    running: Vec<SeqId>,
    num_preemptions: u64,
    prefix_stats: PrefixCacheStats,
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

impl Scheduler {
    pub fn new(config: SchedulerConfig, num_blocks: usize) -> Self {
        Self::with_pool(config, BlockPool::new(num_blocks))
    }

    /// A scheduler over a given pool (its hash function and root key).
    pub fn with_pool(config: SchedulerConfig, pool: BlockPool) -> Self {
        assert!(config.block_size > 0 && config.max_batch_tokens > 0 && config.max_running > 0, "scheduler limits must be positive");
        Scheduler {
            config,
            pool,
            seqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            num_preemptions: 0,
            prefix_stats: PrefixCacheStats::default(),
        }
    }

    pub fn prefix_stats(&self) -> PrefixCacheStats {
        self.prefix_stats
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn seq(&self, id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&id)
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Preemptions since start-up.
    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Whether a step could do anything: something runs, or waits without being held.
    pub fn has_runnable_work(&self) -> bool {
        !self.running.is_empty() || self.waiting.iter().any(|id| !self.seqs[id].held)
    }

    /// Queues a request; `max_new_tokens` is capped so prompt plus output fits `max_model_len`.
    pub fn add(&mut self, id: SeqId, prompt: Vec<u32>, max_new_tokens: usize) -> Result<(), AddError> {
        if self.seqs.contains_key(&id) {
            return Err(AddError::Duplicate(id));
        }
        if prompt.is_empty() {
            return Err(AddError::EmptyPrompt);
        }
        let max_model_len = self.config.max_model_len;
        if prompt.len() >= max_model_len {
            return Err(AddError::TooLong { prompt: prompt.len(), max_model_len });
        }
        let blocks_needed = (prompt.len() + 1).div_ceil(self.config.block_size);
        if blocks_needed > self.pool.num_blocks() {
            return Err(AddError::TooLargeForPool { blocks_needed, num_blocks: self.pool.num_blocks() });
        }
        let seq = Sequence {
            id,
            num_prompt_tokens: prompt.len(),
            max_new_tokens: max_new_tokens.min(max_model_len - prompt.len()),
            tokens: prompt,
            num_computed_tokens: 0,
            block_table: Vec::new(),
            num_preemptions: 0,
            num_cached_tokens: 0,
            root: self.pool.root(),
            block_hashes: Vec::new(),
            num_registered_blocks: 0,
            restorable: None,
            held: false,
            pinned: Vec::new(),
        };
        self.seqs.insert(id, seq);
        self.waiting.push_back(id);
        Ok(())
    }

    /// Removes a sequence (finished, or its client went away) and releases its blocks. Returns it, or
    /// `None` for an unknown id.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let seq = self.seqs.remove(&id)?;
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
        self.pool.release(&seq.block_table);
        self.pool.release(&seq.pinned);
        Some(seq)
    }

    /// Plans the next step (see the module comment). Blocks for every scheduled chunk are allocated
    /// before this returns; the plan is empty when nothing can run.
    pub fn schedule(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.config.max_batch_tokens;
        // Prefill tokens still allowed in this step (limited only when it decodes too).
        let decoding = self.running.iter().any(|&id| self.is_decoding(id));
        let mut prefill_budget = if decoding { self.config.max_prefill_tokens_while_decoding } else { usize::MAX };
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let is_decode = self.is_decoding(id);
            let n_new = self.chunk_len(id, if is_decode { budget } else { budget.min(prefill_budget) });
            if n_new == 0 {
                i += 1;
                continue;
            }
            // Free blocks by preempting the newest running sequences; stop if that is this one.
            let mut fits = self.allocate_for(id, n_new);
            while !fits && self.running.len() > i + 1 {
                let victim = self.running.pop().expect("more than i + 1 running");
                self.preempt(victim);
                plan.preempted.push(victim);
                fits = self.allocate_for(id, n_new);
            }
            if !fits {
                self.running.remove(i);
                self.preempt(id);
                plan.preempted.push(id);
                break;
            }
            plan.chunks.push(self.chunk(id, n_new));
            budget -= n_new;
            if !is_decode {
                prefill_budget -= n_new;
            }
            i += 1;
        }
        if plan.preempted.is_empty() {
            self.admit_waiting(&mut plan, budget.min(prefill_budget));
        }
        plan.evicted = self.pool.take_evicted();
        plan
    }

    /// Waiting sequences, first come first served, while the budget, the running limit and free blocks
    /// allow; the first one that does not fit stops admission.
    fn admit_waiting(&mut self, plan: &mut StepPlan, mut budget: usize) {
        let mut i = 0;
        while let Some(&id) = self.waiting.get(i) {
            if self.seqs[&id].held {
                // its blocks are being read from disk; the ones behind it do not wait for that
                i += 1;
                continue;
            }
            if budget == 0 || self.running.len() >= self.config.max_running {
                break;
            }
            let hit = self.cached_prefix(id);
            let (bs, m) = (self.config.block_size, hit.len());
            let seq = &self.seqs[&id];
            let (mut restore, skip) = match seq.restorable {
                Some((first, n)) if m >= first && m < first + n => (first + n - m, m - first),
                _ => (0, 0),
            };
            // Free blocks this admission needs with `r` restored blocks (those need blocks too): when the
            // pool is short, restore fewer rather than wait, down to none.
            // (unheld hit blocks are in the free queue: taking them leaves the rest for new blocks)
            let (len, free) = (seq.tokens.len(), self.pool.num_free() - self.pool.num_unheld(&hit));
            let needed = |r: usize| {
                let computed = (m + r) * bs;
                (computed + (len - computed).min(budget)).div_ceil(bs) - m
            };
            while restore > 0 && needed(restore) > free {
                restore -= 1;
            }
            if needed(restore) > free {
                break;
            }
            let computed = (m + restore) * bs;
            let n_new = (len - computed).min(budget);
            self.pool.acquire(&hit);
            let seq = self.seqs.get_mut(&id).expect("waiting ids are known");
            self.pool.release(&std::mem::take(&mut seq.pinned));
            debug_assert!(seq.block_table.is_empty() && seq.num_computed_tokens == 0, "waiting sequences hold nothing");
            if seq.num_preemptions == 0 {
                seq.num_cached_tokens = computed;
                self.prefix_stats.queried_tokens += seq.num_prompt_tokens as u64;
                self.prefix_stats.hit_tokens += computed as u64;
                self.prefix_stats.disk_hit_tokens += (restore * bs) as u64;
            }
            seq.restorable = None;
            seq.num_registered_blocks = m;
            seq.block_table = hit;
            seq.num_computed_tokens = computed;
            assert!(self.allocate_for(id, n_new), "the free blocks were counted");
            if restore > 0 {
                plan.restores.push(Restore { id, skip, blocks: self.seqs[&id].block_table[m..m + restore].to_vec() });
            }
            self.waiting.remove(i);
            self.running.push(id);
            plan.chunks.push(self.chunk(id, n_new));
            budget -= n_new;
        }
    }

    /// Gives a waiting sequence's blocks keys of their own: it shares cached blocks only with sequences
    /// of the same salt. Call right after `add`.
    pub fn set_cache_salt(&mut self, id: SeqId, salt: &[u8]) {
        let root = self.pool.salted_root(salt);
        if let Some(seq) = self.seqs.get_mut(&id) {
            assert!(seq.block_hashes.is_empty() && seq.num_computed_tokens == 0, "salt a sequence before it runs");
            seq.root = root;
        }
    }

    /// For a waiting sequence: the parent key of its first block, the keys of the blocks a cache hit may
    /// cover (all full blocks but the one holding the last token), and how many of them are cached in
    /// memory now. Takes nothing.
    pub fn probe(&self, id: SeqId) -> Option<(BlockHash, Vec<BlockHash>, usize)> {
        let seq = self.seqs.get(&id)?;
        let (bs, tokens) = (self.config.block_size, &seq.tokens);
        let max_blocks = tokens.len().saturating_sub(1) / bs;
        let mut hashes: Vec<BlockHash> = Vec::with_capacity(max_blocks);
        extend_chain(&self.pool, seq.root, &mut hashes, tokens, max_blocks, bs);
        let in_memory = if self.config.prefix_caching { self.pool.lookup(seq.root, &hashes, tokens, bs).len() } else { 0 };
        Some((seq.root, hashes, in_memory))
    }

    /// Tells the scheduler the engine holds the keys and values of blocks `first..first + n` of a
    /// waiting sequence's prompt (see `Restore`).
    /// Ends a `hold`.
    pub fn offer_restored(&mut self, id: SeqId, first: usize, n: usize) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.held = false;
            if seq.num_computed_tokens == 0 && n > 0 {
                seq.restorable = Some((first, n));
            }
        }
    }

    /// Keeps a waiting sequence (before its first admission) out of admission until `offer_restored`,
    /// while the engine reads its blocks from the disk tier; sequences behind it are admitted meanwhile.
    pub fn hold(&mut self, id: SeqId) {
        let Some(seq) = self.seqs.get(&id) else { return };
        if seq.num_computed_tokens > 0 || seq.num_preemptions > 0 || seq.held {
            return;
        }
        // keep the prefix cached in memory now: the read continues it
        let hit = self.cached_prefix(id);
        self.pool.acquire(&hit);
        let seq = self.seqs.get_mut(&id).expect("checked above");
        seq.pinned = hit;
        seq.held = true;
    }

    /// The cached blocks holding `id`'s leading full blocks (none with caching off), leaving at least
    /// its last token to compute.
    fn cached_prefix(&mut self, id: SeqId) -> Vec<u32> {
        if !self.config.prefix_caching {
            return Vec::new();
        }
        let bs = self.config.block_size;
        let seq = self.seqs.get_mut(&id).expect("waiting ids are known");
        let max_blocks = (seq.tokens.len() - 1) / bs;
        extend_hashes(seq, max_blocks, bs, &self.pool);
        self.pool.lookup(seq.root, &seq.block_hashes[..max_blocks], &seq.tokens, bs)
    }

    /// Registers `id`'s newly computed full blocks in the prefix cache.
    fn register_full_blocks(&mut self, id: SeqId) {
        let bs = self.config.block_size;
        let Some(seq) = self.seqs.get_mut(&id) else { return };
        let full = seq.num_computed_tokens / bs;
        extend_hashes(seq, full, bs, &self.pool);
        for j in seq.num_registered_blocks..full {
            let (parent_hash, parent) = match j.checked_sub(1) {
                Some(p) => (seq.block_hashes[p], Some(seq.block_table[p])),
                None => (seq.root, None),
            };
            self.pool.register(seq.block_table[j], seq.block_hashes[j], parent_hash, parent, &seq.tokens[j * bs..(j + 1) * bs]);
        }
        seq.num_registered_blocks = seq.num_registered_blocks.max(full);
    }

    /// Whether `id`'s next chunk is its one newest generated token (a decode): its whole prompt is
    /// computed and one token is left. (The last token of a recompute after preemption counts too: one
    /// token either way.)
    fn is_decoding(&self, id: SeqId) -> bool {
        let seq = &self.seqs[&id];
        seq.num_computed_tokens >= seq.num_prompt_tokens && seq.num_computed_tokens + 1 == seq.tokens.len()
    }

    /// Tokens of `id` not yet computed, capped by the budget.
    fn chunk_len(&self, id: SeqId, budget: usize) -> usize {
        let seq = &self.seqs[&id];
        (seq.tokens.len() - seq.num_computed_tokens).min(budget)
    }

    fn chunk(&self, id: SeqId, len: usize) -> ScheduledChunk {
        let seq = &self.seqs[&id];
        let start = seq.num_computed_tokens;
        ScheduledChunk { id, start, len, samples: start + len == seq.tokens.len() }
    }

    /// Grows `id`'s block table to hold `num_computed + n_new` tokens; false (nothing taken) if the pool
    /// is short.
    fn allocate_for(&mut self, id: SeqId, n_new: usize) -> bool {
        let seq = self.seqs.get_mut(&id).expect("scheduled ids are known");
        let blocks = (seq.num_computed_tokens + n_new).div_ceil(self.config.block_size);
        let missing = blocks.saturating_sub(seq.block_table.len());
        match self.pool.allocate(missing) {
            Some(new) => {
                seq.block_table.extend(new);
                true
            }
            None => false,
        }
    }

    /// Releases `id`'s blocks and puts it at the front of the waiting queue, to be recomputed.
    fn preempt(&mut self, id: SeqId) {
        let seq = self.seqs.get_mut(&id).expect("running ids are known");
        self.pool.release(&seq.block_table);
        seq.block_table.clear();
        seq.num_computed_tokens = 0;
        seq.num_registered_blocks = 0;
        seq.num_preemptions += 1;
        self.num_preemptions += 1;
        self.waiting.push_front(id);
    }

    /// Records a finished step: each chunk's tokens are now computed, and every chunk that `samples`
    /// gets its sampled token appended: `sampled` holds one token per such chunk, in plan order. Chunks of
    /// sequences removed meanwhile (aborted) are skipped.
    pub fn complete_step(&mut self, plan: &StepPlan, sampled: &[u32]) {
        let mut sampled = sampled.iter();
        for chunk in &plan.chunks {
            let token = if chunk.samples { Some(*sampled.next().expect("one sampled token per sampling chunk")) } else { None };
            let Some(seq) = self.seqs.get_mut(&chunk.id) else { continue };
            assert_eq!(seq.num_computed_tokens, chunk.start, "sequence {} changed between plan and step", chunk.id);
            seq.num_computed_tokens += chunk.len;
            seq.tokens.extend(token);
            if self.config.prefix_caching {
                self.register_full_blocks(chunk.id);
            }
        }
        assert!(sampled.next().is_none(), "more sampled tokens than sampling chunks");
    }
}

/// Computes the keys of `seq`'s first `n_blocks` full blocks that it does not have yet.
fn extend_hashes(seq: &mut Sequence, n_blocks: usize, block_size: usize, pool: &BlockPool) {
    extend_chain(pool, seq.root, &mut seq.block_hashes, &seq.tokens, n_blocks, block_size);
}

/// Extends `hashes` (the keys of `tokens`' first blocks, chained from `root`) to `n_blocks` keys.
fn extend_chain(pool: &BlockPool, root: BlockHash, hashes: &mut Vec<BlockHash>, tokens: &[u32], n_blocks: usize, block_size: usize) {
    for j in hashes.len()..n_blocks {
        let parent = hashes.last().copied().unwrap_or(root);
        hashes.push(pool.hash(parent, &tokens[j * block_size..(j + 1) * block_size]));
    }
}

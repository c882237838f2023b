//! Continuous batching: which requests run in the next model step, and how many of their tokens.
//!
//! Holds requests (token ids, block ids) and asks the `KvCacheManager` for blocks; never tensors, so
//! every decision is tested without a model (`scheduler_tests.rs`, exact block ids). A step schedules,
//! per request, the next `tokens[num_computed_tokens..]` chunk that fits the step's token budget: a whole
//! or partial prompt (chunked prefill) or one new token (decode), all in the same batch. When a chunk
//! reaches the end of the tokens, the step's logits for it are sampled and the new token is appended, so
//! the next step decodes it.
//!
//! - Running requests are served first, oldest first; then waiting ones are admitted first come, first
//!   served, only when their chunk's blocks are free (a large request at the head of the queue is not
//!   overtaken).
//! - A step that decodes carries at most `max_prefill_tokens_while_decoding` prompt tokens: a prompt that
//!   arrives while others decode is prefilled over several steps, each of which delays their next token
//!   by a bounded amount, instead of one step as long as the whole prompt (Sarathi-Serve's stall-free
//!   batching). Steps with nothing to decode use the whole `max_batch_tokens`.
//! - When a running request needs a block and none is free, the newest running request is preempted:
//!   its blocks are released, `num_computed_tokens` returns to 0, and it goes back to the front of the
//!   waiting queue to be recomputed later (prompt and generated tokens, one prefill).
//! - Admission first takes the request's cached prefix (see `kv::manager`).
//! - With a KV window (`kv::window`), a request's blocks that no later query attends to are released
//!   after every step, so a long sequence holds its sinks, its window and one chunk's blocks; so do
//!   the sliding layer groups of a hybrid layout (`kv::layout`), each in a block table of its own.

use super::request::{Request, RequestId, RequestStatus};
use crate::kv::{BlockHash, BlockPool, EvictedBlock, KvCacheManager, PrefixCacheStats};
use std::collections::{HashMap, VecDeque};

#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Token budget of one step (prefill chunks plus decodes).
    pub max_batch_tokens: usize,
    /// Prompt (prefill) tokens a step may carry when it also decodes: a prompt arriving while others
    /// decode is prefilled in chunks of at most this many tokens (stall-free batching, as in
    /// Sarathi-Serve). `usize::MAX`: no separate limit.
    pub max_prefill_tokens_while_decoding: usize,
    /// Requests running at once.
    pub max_running: usize,
    /// Tokens a background request (sparse prefill's idle recovery) computes in one step at most: a
    /// request arriving mid-step waits for at most one such slice.
    pub max_background_chunk: usize,
}

/// One request's share of a step: tokens `start..start + len` of its `tokens`, at positions equal to
/// their indices, where the last `draft` of them are the request's speculative guesses
/// (`Request::spec`'s draft, after its newest token; `engine::spec`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduledChunk {
    pub id: RequestId,
    pub start: usize,
    pub len: usize,
    /// The chunk ends at the request's last token: its logits are sampled after the step (with guesses,
    /// the logits of the last token and of every guess).
    pub samples: bool,
    pub draft: usize,
    /// With a draft model: the positions `from..to` of the request's tokens it computes before the step
    /// (its keys and values, catching up from `SpecState::draft_computed`); when the chunk's guesses come
    /// from it, `to` is the chunk's start plus one (through the newest token), and it then decodes the
    /// guesses one by one.
    pub draft_span: Option<(usize, usize)>,
}

/// What the next model step computes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    pub chunks: Vec<ScheduledChunk>,
    /// Requests preempted while planning (now waiting, their blocks released).
    pub preempted: Vec<RequestId>,
    /// Cached blocks handed out again while planning: their contents are overwritten by this step.
    pub evicted: Vec<EvictedBlock>,
    /// Blocks to fill with restored keys and values before this step runs.
    pub restores: Vec<Restore>,
}

impl StepPlan {
    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }
}

/// Restored blocks of a request admitted in this step: `blocks[i]` gets the engine's restorable block
/// `skip + i` (counted from the offer's first block); none where it is `NULL_BLOCK` (a window's gap).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restore {
    pub id: RequestId,
    pub skip: usize,
    pub blocks: Vec<u32>,
}

pub struct Scheduler {
    config: SchedulerConfig,
    kv: KvCacheManager,
    requests: HashMap<RequestId, Request>,
    /// Admission order; preempted requests return to the front.
    waiting: VecDeque<RequestId>,
    /// Oldest admitted first; the last one is preempted first.
    running: Vec<RequestId>,
    num_preemptions: u64,
    /// The step-cost model `--spec auto` decides by (`spec::Controller`).
    controller: super::spec::Controller,
    /// The draft model's cost model (one pass of its, by tokens).
    draft_controller: super::spec::Controller,
    /// The controller's expected speedup at its latest choice (`spec::Controller::gain`).
    spec_gain: Option<f64>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig, kv: KvCacheManager) -> Self {
        assert!(config.max_batch_tokens > 0 && config.max_running > 0, "scheduler limits must be positive");
        Scheduler { config, kv, requests: HashMap::new(), waiting: VecDeque::new(), running: Vec::new(), num_preemptions: 0, controller: Default::default(), draft_controller: Default::default(), spec_gain: None }
    }

    /// Drops every cached prefix if no request holds a block (`BlockPool::reset_cache`).
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.kv.reset_cache()
    }

    /// Records KV-cache events (`kv::events`) from now on.
    pub fn record_kv_events(&mut self) {
        self.kv.record_events();
    }

    /// The KV-cache events since the last call.
    pub fn take_kv_events(&mut self) -> Vec<crate::kv::KvEvent> {
        self.kv.take_events()
    }

    pub fn kv(&self) -> &KvCacheManager {
        &self.kv
    }

    pub fn pool(&self) -> &BlockPool {
        self.kv.pool()
    }

    pub fn prefix_stats(&self) -> PrefixCacheStats {
        self.kv.stats()
    }

    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.requests.get(&id)
    }

    pub fn request_mut(&mut self, id: RequestId) -> Option<&mut Request> {
        self.requests.get_mut(&id)
    }

    pub fn request_ids(&self) -> impl Iterator<Item = RequestId> + '_ {
        self.requests.keys().copied()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// A step of `tokens` tokens took `secs` (the model step and sampling): what `--spec auto` learns the
    /// step cost from.
    pub fn observe_step(&mut self, tokens: usize, secs: f64) {
        self.controller.observe(tokens, secs);
    }

    /// One pass of the draft model over `tokens` tokens took `secs`.
    pub fn observe_draft_step(&mut self, tokens: usize, secs: f64) {
        self.draft_controller.observe(tokens, secs);
    }

    /// What the controller expected its latest choice of guesses to gain (`spec::Controller::gain`).
    pub fn spec_gain(&self) -> Option<f64> {
        self.spec_gain
    }

    pub fn draft_controller(&self) -> &super::spec::Controller {
        &self.draft_controller
    }

    pub fn controller(&self) -> &super::spec::Controller {
        &self.controller
    }

    /// Preemptions since start-up.
    pub fn num_preemptions(&self) -> u64 {
        self.num_preemptions
    }

    pub fn has_work(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Whether a step could do anything: something runs, or waits without waiting for the disk.
    pub fn has_runnable_work(&self) -> bool {
        !self.running.is_empty() || self.waiting.iter().any(|id| self.requests[id].status == RequestStatus::Waiting)
    }

    /// Queues a new request (validated: its prompt and one more token fit the context and the cache).
    pub fn add(&mut self, req: Request) {
        debug_assert!(!self.requests.contains_key(&req.id), "request id {} is already scheduled", req.id);
        debug_assert!(req.num_prompt_tokens > 0 && req.blocks.num_held() == 0);
        self.waiting.push_back(req.id);
        self.requests.insert(req.id, req);
    }

    /// Removes a request (finished, or its client went away) and releases its blocks. Returns it, or
    /// `None` for an unknown id.
    pub fn finish(&mut self, id: RequestId) -> Option<Request> {
        let mut req = self.requests.remove(&id)?;
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&w| w != id);
        self.kv.free(&mut req.blocks);
        Some(req)
    }

    /// Plans the next step (see the module comment). Blocks for every scheduled chunk are allocated
    /// before this returns; the plan is empty when nothing can run.
    pub fn schedule(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.config.max_batch_tokens;
        // Prefill tokens still allowed in this step (limited only when it decodes too).
        let decoding = self.running.iter().any(|id| self.requests[id].is_decoding());
        let mut prefill_budget = if decoding { self.config.max_prefill_tokens_while_decoding } else { usize::MAX };
        self.choose_guesses(budget, prefill_budget);
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let is_decode = self.requests[&id].is_decoding();
            let mut n_new = self.chunk_len(id, if is_decode { budget } else { budget.min(prefill_budget) });
            if n_new == 0 {
                i += 1;
                continue;
            }
            if is_decode {
                n_new += self.propose(id, budget - 1);
            }
            // Guesses first give way to a short pool; then the newest running requests are preempted,
            // until that would be this one.
            let mut fits = self.allocate_for(id, n_new);
            if !fits && n_new > 1 {
                self.drop_draft(id);
                n_new = 1;
                fits = self.allocate_for(id, n_new);
            }
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
        plan.evicted = self.kv.take_evicted();
        plan
    }

    /// Waiting requests, first come first served, while the budget, the running limit and free blocks
    /// allow; the first one that does not fit stops admission.
    fn admit_waiting(&mut self, plan: &mut StepPlan, mut budget: usize) {
        let mut i = 0;
        while let Some(&id) = self.waiting.get(i) {
            let req = self.requests.get_mut(&id).expect("waiting ids are known");
            if matches!(req.status, RequestStatus::WaitingForDisk | RequestStatus::Scoring) {
                // its blocks are being read from disk, or its prompt scored; the ones behind it do not
                // wait for that
                i += 1;
                continue;
            }
            if budget == 0 || self.running.len() >= self.config.max_running {
                break;
            }
            let first_admission = req.num_preemptions == 0;
            let slice = if req.background { budget.min(self.config.max_background_chunk.max(1)) } else { budget };
            let Some(admitted) = self.kv.admit(&req.tokens, &mut req.blocks, slice, first_admission) else { break };
            if first_admission {
                req.num_cached_tokens = admitted.num_computed_tokens;
            }
            req.num_computed_tokens = admitted.num_computed_tokens;
            if let Some(spec) = req.spec.as_mut().filter(|s| s.config.draft) {
                spec.draft_computed = self.kv.draft_valid_prefix(&req.blocks, req.num_computed_tokens);
            }
            self.kv.release_outside_window(&mut req.blocks, req.num_computed_tokens);
            req.status = RequestStatus::Running;
            if let Some((skip, blocks)) = admitted.restore {
                plan.restores.push(Restore { id, skip, blocks });
            }
            self.waiting.remove(i);
            self.running.push(id);
            plan.chunks.push(self.chunk(id, admitted.num_new_tokens));
            budget -= admitted.num_new_tokens;
        }
    }

    /// Thins a waiting request's prompt to the `kept` positions before its first admission (a sparse
    /// prefill, `engine::sparse`): from then on its blocks meet the prefix cache only over its genuine
    /// prefix. False (nothing changed) if the request is unknown, started, or the positions are invalid.
    pub fn sparsify(&mut self, id: RequestId, kept: Vec<usize>) -> bool {
        let Some(req) = self.requests.get_mut(&id) else { return false };
        if !matches!(req.status, RequestStatus::Waiting | RequestStatus::Scoring) || req.num_preemptions > 0 || !req.sparsify(kept) {
            return false;
        }
        let genuine = req.sparse.as_ref().expect("just sparsified").genuine_prefix();
        self.kv.limit_caching(&mut req.blocks, genuine);
        true
    }

    /// For a waiting request: its prefix keys and how many of its blocks are cached in memory (see
    /// `PrefixProbe`). Takes nothing.
    pub fn probe(&self, id: RequestId) -> Option<(BlockHash, Vec<BlockHash>, usize)> {
        let req = self.requests.get(&id)?;
        let p = self.kv.probe(&req.tokens, &req.blocks);
        Some((p.root, p.hashes, p.in_memory))
    }

    /// Keeps a new waiting request out of admission while the engine scores its prompt for a sparse
    /// prefill (`sparsify` may then thin it); `release_scoring` ends it. False if it is not such a request.
    pub fn hold_for_scoring(&mut self, id: RequestId) -> bool {
        let Some(req) = self.requests.get_mut(&id) else { return false };
        if req.num_computed_tokens > 0 || req.num_preemptions > 0 || req.status != RequestStatus::Waiting {
            return false;
        }
        req.status = RequestStatus::Scoring;
        true
    }

    /// Ends `hold_for_scoring`: the request may be admitted.
    pub fn release_scoring(&mut self, id: RequestId) {
        if let Some(req) = self.requests.get_mut(&id).filter(|r| r.status == RequestStatus::Scoring) {
            req.status = RequestStatus::Waiting;
        }
    }

    /// Keeps a waiting request (before its first admission) out of admission until `offer_restored`,
    /// while the engine reads its blocks from the disk tier; requests behind it are admitted meanwhile.
    pub fn hold(&mut self, id: RequestId) {
        let Some(req) = self.requests.get_mut(&id) else { return };
        if req.num_computed_tokens > 0 || req.num_preemptions > 0 || req.status != RequestStatus::Waiting {
            return;
        }
        self.kv.pin_prefix(&req.tokens, &mut req.blocks);
        req.status = RequestStatus::WaitingForDisk;
    }

    /// Tells the scheduler the engine read blocks `first..first + loaded.len()` of a waiting request's
    /// prompt from the disk tier and holds the keys and values of those with `loaded[i]` (see
    /// `Restore`), and, for a hybrid recurrent model, the state snapshot after those with `states[i]`
    /// (empty: none). Ends a `hold`.
    pub fn offer_restored(&mut self, id: RequestId, first: usize, loaded: Vec<bool>, states: Vec<bool>) {
        if let Some(req) = self.requests.get_mut(&id) {
            if req.status == RequestStatus::WaitingForDisk {
                req.status = RequestStatus::Waiting;
            }
            self.kv.offer_restored(&mut req.blocks, first, loaded, states);
        }
    }

    /// Tokens of `id` not yet computed, capped by the budget.
    fn chunk_len(&self, id: RequestId, budget: usize) -> usize {
        let req = &self.requests[&id];
        let budget = if req.background { budget.min(self.config.max_background_chunk.max(1)) } else { budget };
        (req.tokens.len() - req.num_computed_tokens).min(budget)
    }

    fn chunk(&self, id: RequestId, len: usize) -> ScheduledChunk {
        let req = &self.requests[&id];
        let start = req.num_computed_tokens;
        let draft = req.spec.as_ref().map_or(0, |s| s.draft.len());
        let samples = start + len - draft == req.tokens.len();
        // the draft model follows every prompt chunk (so it can guess from the first token on), and
        // catches up before it guesses; a decode without its guesses leaves it behind, to catch up later
        // in one pass. At most a step's budget of catching up at once.
        let draft_span = req.spec.as_ref().filter(|s| s.config.draft).and_then(|s| {
            let (from, budget) = (s.draft_computed, self.config.max_batch_tokens);
            let to = if s.from_model && draft > 0 {
                start + 1
            } else if !req.is_decoding() {
                (start + len).min(from + budget)
            } else if start + 1 - from > budget {
                // too far behind to guess in one pass (a prefix hit on blocks without its cells): a
                // step's budget of catching up each step until it can
                (start + 1).min(from + budget)
            } else {
                return None;
            };
            (from < to).then_some((from, to))
        });
        ScheduledChunk { id, start, len, samples, draft, draft_span }
    }

    /// Whether the draft model can guess for `req` in this step: it is at most a step's budget behind.
    fn draft_ready(&self, req: &Request) -> bool {
        req.spec.as_ref().is_some_and(|s| s.config.draft && req.num_computed_tokens + 1 - s.draft_computed <= self.config.max_batch_tokens)
    }

    /// For a decoding request that speculates: the n-gram proposer's guesses after its newest token (at
    /// most `room` of them, and one fewer than the tokens it may still generate), kept as its draft.
    /// Returns how many.
    fn propose(&mut self, id: RequestId, room: usize) -> usize {
        let ready = self.draft_ready(&self.requests[&id]);
        let req = self.requests.get_mut(&id).expect("scheduled ids are known");
        let left = req.max_new_tokens.saturating_sub(req.num_generated());
        let Some(spec) = req.spec.as_mut() else { return 0 };
        let k = spec.config.k.min(room).min(left.saturating_sub(1));
        if spec.config.auto {
            // chosen for the whole step by `choose_guesses`
            spec.draft.truncate(k);
        } else if spec.config.draft {
            // the draft model's guesses, written by the engine before the step (placeholders until then)
            spec.from_model = ready && k > 0;
            spec.draft = vec![0; if spec.from_model { k } else { 0 }];
        } else {
            spec.draft = super::spec::propose_ngram(&req.tokens, &req.prediction, req.tokens.len() - req.num_prompt_tokens, &super::spec::SpecConfig { k, ..spec.config });
        }
        if spec.draft.is_empty() {
            spec.from_model = false;
        }
        spec.draft.len()
    }

    /// `--spec auto`: every running request that decodes and speculates gets the proposer's guesses, of
    /// which the controller keeps those that pay in this step (`spec::Controller::choose`), given the
    /// step's other tokens: one per decode, and the prompt tokens its prefill chunks will carry.
    fn choose_guesses(&mut self, budget: usize, prefill_budget: usize) {
        let mut auto = Vec::new();
        let (mut decodes, mut prefill) = (0, 0);
        // a draft model's guess costs one of its passes of one token (conservative: requests drafting
        // together share a pass); unknown until its passes were seen at two sizes
        let draft_cost = self.draft_controller.time(1).unwrap_or(0.0);
        let running = self.running.clone();
        for id in &running {
            let ready = self.draft_ready(&self.requests[id]);
            let req = self.requests.get_mut(id).expect("running ids are known");
            if !req.is_decoding() {
                prefill += req.tokens.len() - req.num_computed_tokens;
                continue;
            }
            decodes += 1;
            let left = req.max_new_tokens.saturating_sub(req.num_generated());
            let generated = req.tokens.len() - req.num_prompt_tokens;
            let Some(spec) = req.spec.as_mut().filter(|s| s.config.auto) else { continue };
            let config = super::spec::SpecConfig { k: spec.config.k.min(left.saturating_sub(1)), ..spec.config };
            // the n-gram proposal costs nothing; where it finds none, the draft model's
            spec.draft = super::spec::propose_ngram(&req.tokens, &req.prediction, generated, &config);
            spec.from_model = spec.draft.is_empty() && ready && config.k > 0;
            if spec.from_model {
                spec.draft = vec![0; config.k];
            }
            let cost = if spec.from_model { draft_cost } else { 0.0 };
            auto.push((*id, spec.acceptance(spec.from_model), spec.draft.len(), cost));
        }
        if auto.is_empty() {
            return;
        }
        let base = (decodes + prefill.min(prefill_budget)).min(budget);
        let candidates: Vec<(f64, usize, f64)> = auto.iter().map(|a| (a.1, a.2, a.3)).collect();
        let take = self.controller.choose(base, decodes, &candidates);
        self.spec_gain = self.controller.gain(base, decodes, &candidates, &take).or(self.spec_gain);
        for ((id, ..), n) in auto.into_iter().zip(take) {
            if let Some(spec) = self.requests.get_mut(&id).and_then(|r| r.spec.as_mut()) {
                spec.draft.truncate(n);
                spec.from_model &= n > 0;
            }
        }
    }

    fn drop_draft(&mut self, id: RequestId) {
        if let Some(spec) = self.requests.get_mut(&id).and_then(|r| r.spec.as_mut()) {
            spec.draft.clear();
            spec.from_model = false;
        }
    }

    /// Grows `id`'s blocks to hold `num_computed + n_new` tokens; false (nothing taken) if the pool is
    /// short.
    fn allocate_for(&mut self, id: RequestId, n_new: usize) -> bool {
        let req = self.requests.get_mut(&id).expect("scheduled ids are known");
        self.kv.allocate_slots(&mut req.blocks, req.num_computed_tokens + n_new)
    }

    /// Releases `id`'s blocks and puts it at the front of the waiting queue, to be recomputed.
    fn preempt(&mut self, id: RequestId) {
        self.drop_draft(id);
        let req = self.requests.get_mut(&id).expect("running ids are known");
        self.kv.free(&mut req.blocks);
        req.num_computed_tokens = 0;
        if let Some(spec) = req.spec.as_mut() {
            spec.draft_computed = 0;
        }
        req.num_preemptions += 1;
        req.status = RequestStatus::Waiting;
        self.num_preemptions += 1;
        self.waiting.push_front(id);
    }

    /// Records a finished step: each chunk's tokens are now computed (and its full blocks cached), and
    /// every chunk that `samples` gets its new tokens appended: `sampled` holds them per such chunk, in
    /// plan order (one token, or with guesses the kept guesses and the model's next token). The cells of
    /// rejected guesses are behind `num_computed_tokens` no more: blocks holding only those are released
    /// (never registered). Chunks of requests removed meanwhile (aborted) are skipped.
    pub fn complete_step(&mut self, plan: &StepPlan, sampled: &[Vec<u32>]) {
        let mut sampled = sampled.iter();
        for chunk in &plan.chunks {
            let new: &[u32] = if chunk.samples { sampled.next().expect("tokens per sampling chunk") } else { &[] };
            let Some(req) = self.requests.get_mut(&chunk.id) else { continue };
            debug_assert_eq!(req.num_computed_tokens, chunk.start, "request {} changed between plan and step", chunk.id);
            let kept = new.len().saturating_sub(1);
            debug_assert!(kept <= chunk.draft, "request {}: {kept} guesses kept of {}", chunk.id, chunk.draft);
            req.num_computed_tokens += chunk.len - chunk.draft + kept;
            req.tokens.extend_from_slice(new);
            if chunk.draft > 0 {
                if let Some(spec) = req.spec.as_mut() {
                    spec.record(chunk.draft, kept, spec.from_model);
                    spec.draft.clear();
                }
                self.kv.truncate(&mut req.blocks, req.num_computed_tokens);
            }
            if let (Some((from, to)), Some(spec)) = (chunk.draft_span, req.spec.as_mut()) {
                // the draft model also wrote its guesses but the last: those kept are its own
                let guessed = if spec.from_model { chunk.draft.saturating_sub(1).min(kept) } else { 0 };
                spec.draft_computed = (to + guessed).min(req.num_computed_tokens);
                self.kv.mark_draft(&req.blocks, from, spec.draft_computed);
            }
            if let Some(spec) = req.spec.as_mut() {
                spec.from_model = false;
            }
            self.kv.advance(&req.tokens, req.num_computed_tokens, &mut req.blocks);
        }
        debug_assert!(sampled.next().is_none(), "more sampled tokens than sampling chunks");
    }
}

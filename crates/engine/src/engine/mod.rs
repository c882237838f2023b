//! The engine: every running request, the scheduler, the KV storage and the model, advanced one step at a
//! time. `Engine::step` reads as vLLM v1's: schedule (who runs, which blocks) -> execute (one batched
//! forward pass over the paged KV, then sampling) -> update (append tokens, detokenize, stop, send token
//! events, free what finished).
//!
//! `EngineHandle` (handle.rs) runs an `Engine` on its own thread behind a channel; the server, the CLI,
//! the benchmarks and the lab all use it. The engine emits token events, never API JSON.

mod events;
mod handle;
mod request;
mod scheduler;
pub mod slow;
pub mod sparse;
pub mod spec;
mod stop;
mod validate;
#[cfg(test)]
mod scheduler_hybrid_tests;
#[cfg(test)]
mod scheduler_prefix_tests;
#[cfg(test)]
mod scheduler_tests;
#[cfg(test)]
mod scheduler_window_tests;

pub use events::{Completion, Event, TokenLogprobs, Timings, Usage};
pub use handle::{spawn, spawn_with, spawn_with_draft, spawn_with_models, EngineHandle, EngineStats};
pub use request::{Detokenizer, FinishReason, Request, RequestId, RequestStatus};
pub use scheduler::{Restore, ScheduledChunk, Scheduler, SchedulerConfig, StepPlan};
pub use stop::{StopMatcher, StopOutcome};
pub use validate::{validate, Field, GenerateParams, HeldBlocks, Limits, RequestError, ValidatedRequest, MAX_LOGPROBS, MAX_STOP_STRINGS};

use crate::kv::offload::{DiskOffload, RestoreReply, RestoredBlocks};
use crate::kv::{kv_numerics_version, BlockPool, DiskTierConfig, KvCacheManager, KvDtypes, KvFormat, KvLayout, KvStorage, KvWindow, SparseAttention};
use crate::model::{LogitsWanted, Model, Scratch, SeqInput};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks (fixed at start-up from the memory budget).
    pub num_blocks: usize,
    /// Token budget of one step.
    pub max_batch_tokens: usize,
    /// Prefill tokens of a step that also decodes (`SchedulerConfig::max_prefill_tokens_while_decoding`).
    pub max_prefill_tokens_while_decoding: usize,
    /// Requests running at once.
    pub max_running: usize,
    /// Requests waiting at most; more are refused (`RequestError::QueueFull`).
    pub max_waiting: usize,
    /// Longest sequence, prompt and output together.
    pub max_model_len: usize,
    /// Reuse the KV blocks of earlier requests' common prefixes.
    pub prefix_caching: bool,
    /// Park the thread pool's workers after each forward pass (see `Engine::execute`).
    pub rest_pool_between_steps: bool,
    /// How keys and values are stored (`--kv-dtype`); `KvDtypes::check_shape` must accept the model's
    /// head size and `block_size`.
    pub kv_dtypes: KvDtypes,
    /// A StreamingLLM window (`--kv-window`, `--kv-sinks`): every sequence keeps its sinks and its last
    /// positions only (`kv::window`).
    pub kv_window: Option<KvWindow>,
    /// Block-sparse attention over each query's history (`--sparse-attention`, `kv::sparse`); f16 KV,
    /// no window.
    pub sparse_attention: Option<SparseAttention>,
    /// Sliding-window layers (Gemma-3's) in layer groups of their own, which keep their window's blocks
    /// only (`kv::layout`). In effect only without `kv_window` and without a disk tier
    /// (`EngineConfig::kv_layout`).
    pub hybrid_kv: bool,
    /// Speculative decoding with the n-gram proposer for every request without a grammar (`engine::spec`);
    /// `None`: only requests that bring a prediction speculate (with the default configuration).
    pub spec: Option<spec::SpecConfig>,
    /// Sparse prefill of long prompts (`engine::sparse`), scored by the model's own first layers.
    pub spec_prefill: Option<sparse::SparsePrefillConfig>,
    /// Slow-state detection and its fallback (`engine::slow`).
    pub slow_state: slow::SlowStateConfig,
}

impl EngineConfig {
    /// The KV layout this configuration gets for `model` (with a disk tier: `disk_tier`): hybrid where
    /// asked and possible, else one group. `num_blocks` counts its pages.
    pub fn kv_layout(&self, model: &Model, disk_tier: bool) -> KvLayout {
        model.kv_layout(self.hybrid_kv && self.kv_window.is_none() && !(disk_tier && self.prefix_caching) && !self.has_draft_model())
    }

    /// Speculation with a draft model (`SpecConfig::draft`): its keys and values share the target's
    /// block ids, so the layout is one group.
    pub fn has_draft_model(&self) -> bool {
        self.spec.is_some_and(|s| s.draft)
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_blocks: 1024,
            max_batch_tokens: 512,
            max_prefill_tokens_while_decoding: usize::MAX,
            max_running: 64,
            max_waiting: 256,
            max_model_len: 4096,
            prefix_caching: true,
            rest_pool_between_steps: true,
            kv_dtypes: KvDtypes::F16,
            kv_window: None,
            sparse_attention: None,
            hybrid_kv: false,
            spec: None,
            spec_prefill: None,
            slow_state: Default::default(),
        }
    }
}

/// The tokens a step gave the request `id`: one, or with speculation the kept guesses and the model's
/// next token.
struct Sampled {
    id: RequestId,
    tokens: Vec<(u32, Option<TokenLogprobs>)>,
    /// The request's grammar failed: it ends with this error (no token) instead of going on unconstrained.
    error: Option<String>,
}

/// The draft model of speculative decoding, with its keys and values: a storage of the target's number
/// of blocks, indexed by the same block ids (`engine::spec`).
struct Drafter {
    model: Arc<Model>,
    kv: KvStorage,
    scratch: Scratch,
}

pub struct Engine {
    model: Arc<Model>,
    /// The model that scores prompts for sparse prefill (`engine::sparse`); the model itself without one.
    scorer: Option<Arc<Model>>,
    drafter: Option<Drafter>,
    detok: Arc<dyn Detokenizer>,
    kv: KvStorage,
    scratch: Scratch,
    scheduler: Scheduler,
    offload: Option<DiskOffload>,
    stats: Arc<EngineStats>,
    config: EngineConfig,
    /// A logits row with a grammar's mask applied (constrained requests).
    masked: Vec<f32>,
    /// Seconds the draft model took in the step in flight.
    draft_secs: f64,
    /// Idle recovery (`engine::sparse`): full prompts to recompute (with their cache salt and the
    /// tokens their sparse prefill dropped), latest first; the one in flight as a background request.
    recovery: std::collections::VecDeque<Recovery>,
    recovering: Option<(RequestId, tokio::sync::mpsc::UnboundedReceiver<Event>, Recovery)>,
    /// The next background request's id (counting down from `FIRST_BACKGROUND_ID`).
    next_background_id: RequestId,
    /// Sparse prefill's scoring passes of held requests, first come first served, a slice a step.
    scoring: std::collections::VecDeque<ScoringJob>,
    /// The host's state as the steps show it (`engine::slow`), and the pool of the fallback: the engine
    /// thread alone, partitioned as the normal pool.
    slow: slow::SlowState,
    serial_pool: Option<crate::pool::Pool>,
}

/// A request's prompt being scored for a sparse prefill (`engine::sparse`).
struct ScoringJob {
    id: RequestId,
    pass: sparse::ScoringPass,
    config: sparse::SparsePrefillConfig,
    cache_salt: Option<String>,
    /// Prompt tokens the prefix cache held when it arrived (kept whole).
    protect: usize,
}

/// A sparse prefill's full prompt, for idle recovery.
#[derive(Clone)]
struct Recovery {
    /// The request whose prompt this is: when it ends, its computed output joins the prompt (the
    /// blocks a full prefill's sequence would have left in the cache, for the next turn).
    id: RequestId,
    prompt: Vec<u32>,
    cache_salt: Option<String>,
    dropped: usize,
}

/// Ids of background requests count down from here (clients' count up from 1).
const FIRST_BACKGROUND_ID: RequestId = RequestId::MAX;

impl Engine {
    /// An engine over `model` with `config`'s KV cache; with `disk`, the prefix cache also keeps blocks
    /// in that directory (ignored when prefix caching is off); with `draft` (which `config.spec` must
    /// name, `SpecConfig::draft`), a draft model of the same vocabulary proposes guesses. Fails if the
    /// directory cannot be used or the draft does not fit the model.
    pub fn new(model: Arc<Model>, draft: Option<Arc<Model>>, detok: Arc<dyn Detokenizer>, config: EngineConfig, disk: Option<DiskTierConfig>) -> std::io::Result<Engine> {
        let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
        if draft.is_some() != config.has_draft_model() {
            return Err(invalid("a draft model goes with speculation that uses it (SpecConfig::draft)".into()));
        }
        if config.has_draft_model() && config.kv_window.is_some() {
            return Err(invalid("a draft model is not combined with a KV window".into()));
        }
        if config.sparse_attention.is_some() && config.kv_window.is_some() {
            return Err(invalid("sparse attention is not combined with a KV window".into()));
        }
        let drafter = match draft {
            Some(d) if d.config.vocab_size != model.config.vocab_size => {
                return Err(invalid(format!("the draft model's vocabulary has {} tokens, the model's {}", d.config.vocab_size, model.config.vocab_size)));
            }
            Some(d) => {
                config.kv_dtypes.check_shape(d.config.head_dim, config.block_size).map_err(|e| invalid(format!("draft model: {e}")))?;
                let kv = d.new_kv_in(d.kv_layout(false), config.kv_dtypes, config.block_size, config.num_blocks);
                Some(Drafter { model: d, kv, scratch: Scratch::default() })
            }
            None => None,
        };
        let layout = config.kv_layout(&model, disk.is_some());
        let kv = model.new_kv_in(layout.clone(), config.kv_dtypes, config.block_size, config.num_blocks);
        let offload = match disk.filter(|_| config.prefix_caching) {
            Some(d) => {
                let format = KvFormat {
                    model: model.fingerprint(),
                    num_layers: kv.shape.num_layers as u32,
                    kv_dim: kv.shape.kv_dim as u32,
                    block_size: config.block_size as u32,
                    dtype: config.kv_dtypes.code(),
                    // KV computed under sparse attention is another KV: its files are never served to
                    // dense attention or another configuration
                    version: kv_numerics_version(model.numerics()) ^ config.sparse_attention.map_or(0, |s| s.code() << 8),
                };
                Some(DiskOffload::open(&d, format, config.kv_window)?)
            }
            None => None,
        };
        let root = offload.as_ref().map_or(0, |o| o.root());
        let pool = BlockPool::with_hasher(config.num_blocks, crate::kv::sha256_block_hash, root);
        let scheduler_config = SchedulerConfig {
            max_batch_tokens: config.max_batch_tokens,
            max_prefill_tokens_while_decoding: config.max_prefill_tokens_while_decoding,
            max_running: config.max_running,
            max_background_chunk: config.spec_prefill.map_or(usize::MAX, |s| s.recover_slice),
        };
        let scheduler = Scheduler::new(scheduler_config, KvCacheManager::new(config.block_size, pool, config.prefix_caching).with_window(config.kv_window).with_layout(&layout));
        Ok(Engine { model, scorer: None, drafter, detok, kv, scratch: Scratch::default(), scheduler, offload, stats: Arc::new(EngineStats::default()), config, masked: Vec::new(), draft_secs: 0.0, recovery: Default::default(), recovering: None, next_background_id: FIRST_BACKGROUND_ID, scoring: Default::default(), slow: slow::SlowState::new(config.slow_state), serial_pool: None })
    }

    /// Scores prompts for sparse prefill with `scorer` (a smaller model of the same vocabulary, as
    /// SpecPrefill's draft) instead of the model itself.
    pub fn with_scorer(mut self, scorer: Arc<Model>) -> std::io::Result<Engine> {
        if scorer.config.vocab_size != self.model.config.vocab_size {
            let m = format!("the scorer's vocabulary has {} tokens, the model's {}", scorer.config.vocab_size, self.model.config.vocab_size);
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, m));
        }
        self.scorer = Some(scorer);
        Ok(self)
    }

    /// What a request must fit.
    pub fn limits(&self) -> Limits {
        Limits {
            max_model_len: self.config.max_model_len,
            vocab_size: self.model.config.vocab_size,
            kv_cache_tokens: self.config.num_blocks * self.config.block_size,
            block_size: self.config.block_size,
            held: self.held_blocks(),
        }
    }

    /// The KV layout in effect (`EngineConfig::kv_layout`).
    pub fn kv_layout(&self) -> &KvLayout {
        self.kv.layout()
    }

    /// Bytes of one layer's key and value of one token.
    pub fn kv_cell_bytes(&self) -> usize {
        self.config.kv_dtypes.bytes_per_token(1, self.model.config.kv_dim())
    }

    fn held_blocks(&self) -> HeldBlocks {
        let (bs, chunk) = (self.config.block_size, self.config.max_batch_tokens);
        if let Some(w) = self.config.kv_window {
            return HeldBlocks { full_groups: 0, capped_groups: 1, cap: w.max_blocks(bs, chunk) };
        }
        let layout = self.kv.layout();
        let windows: Vec<_> = (0..layout.num_groups()).filter_map(|g| layout.kv_window(g)).collect();
        let cap = windows.iter().map(|w| w.max_blocks(bs, chunk)).max().unwrap_or(0);
        HeldBlocks { full_groups: layout.num_groups() - windows.len(), capped_groups: windows.len(), cap }
    }

    pub fn stats(&self) -> &Arc<EngineStats> {
        &self.stats
    }

    pub fn has_work(&self) -> bool {
        self.scheduler.has_work()
    }

    /// Whether a step could do anything (not only requests waiting for disk reads).
    pub fn has_runnable_work(&self) -> bool {
        self.scheduler.has_runnable_work() || !self.scoring.is_empty()
    }

    /// Queues a request. `restore_reply` delivers a disk read started for it, if its prompt's next blocks
    /// are in the disk tier.
    pub fn add_request(&mut self, id: RequestId, req: ValidatedRequest, events: UnboundedSender<Event>, arrived: Instant, restore_reply: Option<RestoreReply>) {
        // an arriving request stops an idle recovery before the next step
        self.stop_recovery();
        let blocks = self.scheduler.kv().new_blocks(req.cache_salt().map(str::as_bytes));
        let cache_salt = req.cache_salt().map(str::to_string);
        let mut req = Request::new(id, req, blocks, events, arrived);
        let sparse_prefill = match req.spec_prefill {
            None => self.config.spec_prefill,
            Some(sparse::SpecPrefillChoice::Off) => None,
            Some(sparse::SpecPrefillChoice::Keep(keep)) => Some(sparse::SparsePrefillConfig { keep, ..self.config.spec_prefill.unwrap_or_default() }),
        }
        .filter(|_| req.constraint.is_none());
        // (a grammar masks each token as it is sampled: such requests do not guess ahead)
        if req.constraint.is_none() && (self.config.spec.is_some() || !req.prediction.is_empty()) {
            req.spec = Some(spec::SpecState { config: self.config.spec.clone().unwrap_or_default(), ..Default::default() });
        }
        self.scheduler.add(req);
        if let Some(config) = sparse_prefill {
            self.start_scoring(id, config, cache_salt);
        }
        // (a request being scored reads nothing from the disk tier: its prompt may be thinned)
        let scoring = self.scoring.back().is_some_and(|j| j.id == id);
        if let (Some(offload), Some(reply), false) = (self.offload.as_mut(), restore_reply, scoring) {
            let req = self.scheduler.request(id).expect("just added");
            let probe = self.scheduler.kv().probe(&req.tokens, &req.blocks);
            if offload.start_restore(id, &probe, &req.tokens, &self.kv, reply) {
                self.scheduler.hold(id);
            }
        }
    }

    /// Holds a new request whose prompt is long enough for a sparse prefill while its scoring pass runs
    /// (`engine::sparse`; a slice each step, `advance_scoring`), keeping whatever the prefix cache holds
    /// now whole.
    fn start_scoring(&mut self, id: RequestId, config: sparse::SparsePrefillConfig, cache_salt: Option<String>) {
        let Some(req) = self.scheduler.request(id) else { return };
        let protect = self.scheduler.kv().probe(&req.tokens, &req.blocks).in_memory * self.config.block_size;
        if !sparse::worth_scoring(req.tokens.len(), protect, &config) {
            return;
        }
        let started = Instant::now();
        let scorer: &Model = self.scorer.as_deref().unwrap_or(&self.model);
        let pass = sparse::ScoringPass::new(scorer, req.tokens.clone(), config.layers, config.lookahead);
        if self.scheduler.hold_for_scoring(id) {
            self.scoring.push_back(ScoringJob { id, pass, config, cache_salt, protect });
        }
        self.stats.spec_prefill_scoring_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// One slice (a step's token budget) of the oldest scoring pass; a finished one thins its request
    /// and lets it be admitted.
    fn advance_scoring(&mut self) {
        let Some(job) = self.scoring.front_mut() else { return };
        let started = Instant::now();
        let scorer: &Model = match &self.scorer {
            Some(s) => s,
            None => &self.model,
        };
        let done = job.pass.advance(scorer, self.config.max_batch_tokens);
        self.stats.spec_prefill_scoring_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if done {
            let job = self.scoring.pop_front().expect("just advanced");
            self.finish_scoring(job);
        }
    }

    fn finish_scoring(&mut self, job: ScoringJob) {
        let ScoringJob { id, pass, config, cache_salt, protect } = job;
        let Some(req) = self.scheduler.request(id) else { return };
        let planned = sparse::plan_from(&pass.into_attention(), req.tokens.len(), protect, &config);
        let prompt = req.tokens.clone();
        if let Some(kept) = planned {
            let dropped = prompt.len() - kept.len();
            if self.scheduler.sparsify(id, kept) {
                if config.recover {
                    self.recovery.push_front(Recovery { id, prompt, cache_salt, dropped });
                    self.recovery.truncate(sparse::MAX_RECOVERIES);
                    self.stats.spec_prefill_recovery_debt.store(self.recovery_debt() as u64, Ordering::Relaxed);
                }
                self.stats.spec_prefill_requests.fetch_add(1, Ordering::Relaxed);
                self.stats.spec_prefill_dropped_tokens.fetch_add(dropped as u64, Ordering::Relaxed);
                // (a draft model would see the thinned prompt at its cells' positions)
                if let Some(spec) = self.scheduler.request_mut(id).and_then(|r| r.spec.as_mut()) {
                    spec.config.draft = false;
                }
            }
        }
        self.scheduler.release_scoring(id);
    }

    /// Tokens the remembered sparse prefills dropped (the one being recovered included).
    fn recovery_debt(&self) -> usize {
        self.recovery.iter().chain(self.recovering.as_ref().map(|r| &r.2)).map(|r| r.dropped).sum()
    }

    /// With nothing else to run: starts (or keeps) recomputing the latest remembered sparse prefill's
    /// full prompt as a background request (`engine::sparse`). True while one is in flight.
    pub fn start_recovery(&mut self) -> bool {
        if self.recovering.is_some() {
            return true;
        }
        while let Some(r) = self.recovery.pop_front() {
            let params = GenerateParams { ignore_eos: true, cache_salt: r.cache_salt.clone(), ..GenerateParams::greedy(r.prompt.clone(), 1) };
            let Ok(valid) = validate(params, &self.limits()) else { continue };
            let id = self.next_background_id;
            self.next_background_id -= 1;
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let blocks = self.scheduler.kv().new_blocks(r.cache_salt.as_deref().map(str::as_bytes));
            let mut req = Request::new(id, valid, blocks, tx, Instant::now());
            req.background = true;
            self.scheduler.add(req);
            self.recovering = Some((id, rx, r));
            return true;
        }
        false
    }

    /// Stops the background recovery, if any, before the next step; what it computed stays cached, and
    /// its prompt goes back to the front of the queue.
    pub fn stop_recovery(&mut self) {
        if let Some((id, _, r)) = self.recovering.take() {
            self.remove(id);
            self.recovery.push_front(r);
        }
    }

    /// A disk read finished: the request may be admitted, with the blocks read.
    pub fn restored(&mut self, r: RestoredBlocks) {
        let (id, first, loaded) = (r.id, r.first, r.blocks.iter().map(Option::is_some).collect());
        if self.offload.as_mut().is_some_and(|o| o.restored(r)) {
            self.scheduler.offer_restored(id, first, loaded);
        }
    }

    /// Stops a request; it gets `Finished { reason: Abort }` unless it already finished.
    pub fn abort(&mut self, id: RequestId) {
        self.finish(id, FinishReason::Abort);
    }

    /// Ends a request with an error event (cut short by a shutdown); its blocks are freed.
    pub fn fail(&mut self, id: RequestId, message: &str) {
        if let Some(req) = self.remove(id) {
            req.send(Event::Error(message.to_string()));
            self.stats.failed_requests.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn request_ids(&self) -> Vec<RequestId> {
        self.scheduler.request_ids().collect()
    }

    /// One step: schedule -> execute -> update.
    pub fn step(&mut self) {
        // a slice of a sparse prefill's scoring pass, then the requests' step (other requests are not
        // held up for a whole pass)
        self.advance_scoring();
        let scheduling = Instant::now();
        let mut plan = self.scheduler.schedule();
        self.prepare_blocks(&mut plan);
        if plan.is_empty() {
            return;
        }
        let started = Instant::now();
        for c in &plan.chunks {
            let req = self.scheduler.request_mut(c.id).expect("planned requests exist");
            if req.times.first_scheduled.is_none() {
                req.times.first_scheduled = Some(started);
                // restored blocks were written by now; what the admission did not use is dropped
                if let Some(o) = self.offload.as_mut() {
                    o.forget(c.id);
                }
            }
        }
        self.draft_secs = 0.0;
        let recovering = self.recovering.as_ref().and_then(|r| plan.chunks.iter().find(|c| c.id == r.0)).map(|c| c.len);
        if let Some(len) = recovering {
            self.stats.spec_prefill_recovery_steps.fetch_add(1, Ordering::Relaxed);
            self.stats.spec_prefill_recovered_tokens.fetch_add(len as u64, Ordering::Relaxed);
        }
        let mode = self.slow.plan(started);
        let sampled = if mode == slow::Mode::Fallback {
            let pool = self.serial_pool.take().unwrap_or_else(|| crate::pool::Pool::serial(crate::pool::current().threads()));
            let sampled = pool.install(|| self.execute(&plan));
            self.serial_pool = Some(pool);
            sampled
        } else {
            self.execute(&plan)
        };
        let step_ms = started.elapsed().as_secs_f64() * 1e3;
        self.observe_host(&plan, mode, step_ms / 1e3 - self.draft_secs);
        if recovering.is_some() {
            self.stats.spec_prefill_recovery_ns.fetch_add((step_ms * 1e6) as u64, Ordering::Relaxed);
            self.stats.spec_prefill_recovery_max_step_ns.fetch_max((step_ms * 1e6) as u64, Ordering::Relaxed);
        }
        // the target's step alone: the draft model's passes are fitted apart
        self.scheduler.observe_step(plan.chunks.iter().map(|c| c.len).sum(), step_ms / 1e3 - self.draft_secs);
        self.stats.step_ns.fetch_add((step_ms * 1e6) as u64, Ordering::Relaxed);
        self.stats.draft_ns.fetch_add((self.draft_secs * 1e9) as u64, Ordering::Relaxed);
        let emitting = Instant::now();
        self.update(&plan, sampled);
        // ms: the model step and sampling; schedule_ms and emit_ms: the engine's own work around it.
        let step_tokens: usize = plan.chunks.iter().map(|c| c.len).sum();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        tracing::debug!(sequences = plan.chunks.len(), tokens = step_tokens, ms = step_ms, schedule_ms = ms(started - scheduling), emit_ms = ms(emitting.elapsed()), "step");
    }

    /// Feeds the step's time to the slow-state model; a change of state is logged and counted.
    fn observe_host(&mut self, plan: &StepPlan, mode: slow::Mode, secs: f64) {
        let shape = slow::StepShape { tokens: plan.chunks.iter().map(|c| c.len).sum(), sequences: plan.chunks.len(), context: plan.chunks.iter().map(|c| c.start + c.len).sum() };
        let now = Instant::now();
        match self.slow.observe(shape, mode, secs, now) {
            Some(slow::Transition::Entered { median_ratio }) => {
                tracing::warn!("slow state: steps take {median_ratio:.1}x what this host's model of them says; running steps on the engine thread alone until a probe step is back within the model");
                self.stats.slow_state.store(true, Ordering::Relaxed);
                self.stats.slow_state_episodes.fetch_add(1, Ordering::Relaxed);
                self.stats.slow_state_since_ms.store(crate::engine::handle::unix_ms(), Ordering::Relaxed);
            }
            Some(slow::Transition::Left { after, probe_ratio }) => {
                tracing::warn!("slow state over after {:.0} ms (a probe step at {probe_ratio:.2}x the model): back to the normal configuration", after.as_secs_f64() * 1e3);
                self.stats.slow_state.store(false, Ordering::Relaxed);
                self.stats.slow_state_ns.fetch_add(after.as_nanos() as u64, Ordering::Relaxed);
            }
            None => {}
        }
        if mode == slow::Mode::Fallback {
            self.stats.slow_state_fallback_steps.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Blocks the plan hands out again are saved to the disk tier before anything overwrites them; then
    /// restored blocks are written into the blocks their admissions got.
    fn prepare_blocks(&mut self, plan: &mut StepPlan) {
        let Some(offload) = self.offload.as_mut() else { return };
        offload.save_evicted(&self.kv, std::mem::take(&mut plan.evicted));
        for r in &plan.restores {
            offload.write_restore(&mut self.kv, r.id, r.skip, &r.blocks);
        }
    }

    /// The draft model's share of a step: one pass over every chunk's `draft_span` (catching up, through
    /// the newest token of requests it guesses for), then one pass per further guess over the requests
    /// still guessing; each guess is the draft's argmax. The guesses replace the requests' placeholders.
    fn run_draft(&mut self, plan: &StepPlan) {
        let Engine { drafter, scheduler, .. } = self;
        let Some(d) = drafter.as_mut() else { return };
        let spans: Vec<&ScheduledChunk> = plan.chunks.iter().filter(|c| c.draft_span.is_some()).collect();
        if spans.is_empty() {
            return;
        }
        let guessing = |c: &ScheduledChunk| c.draft > 0 && scheduler.request(c.id).and_then(|r| r.spec.as_ref()).is_some_and(|s| s.from_model);
        let vocab = d.model.config.vocab_size;
        let argmax = |row: &[f32]| row.iter().enumerate().fold((0, f32::NEG_INFINITY), |best, (i, &l)| if l > best.1 { (i, l) } else { best }).0 as u32;
        let started = Instant::now();
        let inputs: Vec<SeqInput> = spans
            .iter()
            .map(|c| {
                let (from, to) = c.draft_span.expect("filtered");
                let req = scheduler.request(c.id).expect("planned requests exist");
                let logits = if guessing(c) { LogitsWanted::Last } else { LogitsWanted::None };
                SeqInput { tokens: &req.tokens[from..to], start_pos: from, block_tables: req.blocks.tables(), logits }
            })
            .collect();
        let tokens: usize = inputs.iter().map(|i| i.tokens.len()).sum();
        let logits = d.model.forward(&inputs, &mut d.kv, &mut d.scratch);
        // (chunk, guesses so far)
        let mut guesses: Vec<(&ScheduledChunk, Vec<u32>)> = spans.iter().filter(|c| guessing(c)).enumerate().map(|(r, c)| (*c, vec![argmax(&logits[r * vocab..(r + 1) * vocab])])).collect();
        drop(inputs);
        let mut timings = vec![(tokens, started.elapsed().as_secs_f64())];
        for j in 1.. {
            let started = Instant::now();
            let inputs: Vec<SeqInput> = guesses
                .iter()
                .filter(|(c, _)| c.draft > j)
                .map(|(c, g)| {
                    let req = scheduler.request(c.id).expect("planned requests exist");
                    SeqInput { tokens: &g[j - 1..j], start_pos: c.start + j, block_tables: req.blocks.tables(), logits: LogitsWanted::Last }
                })
                .collect();
            if inputs.is_empty() {
                break;
            }
            let n = inputs.len();
            let logits = d.model.forward(&inputs, &mut d.kv, &mut d.scratch);
            let next: Vec<u32> = (0..n).map(|r| argmax(&logits[r * vocab..(r + 1) * vocab])).collect();
            drop(inputs);
            for ((_, g), t) in guesses.iter_mut().filter(|(c, _)| c.draft > j).zip(next) {
                g.push(t);
            }
            timings.push((n, started.elapsed().as_secs_f64()));
        }
        for (c, g) in guesses {
            let spec = scheduler.request_mut(c.id).and_then(|r| r.spec.as_mut()).expect("guessing requests speculate");
            debug_assert_eq!(g.len(), c.draft);
            spec.draft = g;
        }
        for (tokens, secs) in timings {
            scheduler.observe_draft_step(tokens, secs);
            self.draft_secs += secs;
        }
    }

    /// Runs the model on the plan's chunks and samples a token for every chunk that ends its request.
    fn execute(&mut self, plan: &StepPlan) -> Vec<Sampled> {
        self.run_draft(plan);
        // a speculating chunk's tokens: its newest token, then its guesses
        let guessed: Vec<Vec<u32>> = plan
            .chunks
            .iter()
            .filter(|c| c.draft > 0)
            .map(|c| {
                let req = self.scheduler.request(c.id).expect("planned requests exist");
                let draft = &req.spec.as_ref().expect("a chunk with guesses speculates").draft;
                [&req.tokens[c.start..], &draft[..]].concat()
            })
            .collect();
        let mut guessed_iter = guessed.iter();
        let inputs: Vec<SeqInput> = plan
            .chunks
            .iter()
            .map(|c| {
                let req = self.scheduler.request(c.id).expect("planned requests exist");
                let logits = match (c.samples, c.draft) {
                    (false, _) => LogitsWanted::None,
                    (true, 0) => LogitsWanted::Last,
                    (true, _) => LogitsWanted::All,
                };
                let tokens = if c.draft > 0 { &guessed_iter.next().expect("one per speculating chunk")[..] } else { &req.tokens[c.start..c.start + c.len] };
                debug_assert_eq!(tokens.len(), c.len);
                SeqInput { tokens, start_pos: c.start, block_tables: req.blocks.tables(), logits }
            })
            .collect();
        // a sparsely prefilled request's cells sit at their positions in the full prompt
        let positions: Vec<Option<Vec<usize>>> = plan
            .chunks
            .iter()
            .map(|c| {
                let req = self.scheduler.request(c.id).expect("planned requests exist");
                req.sparse.as_ref().map(|s| (c.start..c.start + c.len).map(|i| s.position(i)).collect())
            })
            .collect();
        let positions: Vec<Option<&[usize]>> = positions.iter().map(|p| p.as_deref()).collect();
        let logits = self.model.forward_at(&inputs, &positions, self.config.kv_window, self.config.sparse_attention, &mut self.kv, &mut self.scratch);
        if self.config.rest_pool_between_steps {
            // The pool's workers park now: while the token events go out, the HTTP threads they wake find
            // a free core instead of preempting this thread (on a 2-core host, each wake-up landed on
            // this thread's core while the other ran a spinning worker).
            crate::pool::current().rest();
        }
        let vocab = self.model.config.vocab_size;
        let mut out = Vec::new();
        let mut row = 0;
        for c in plan.chunks.iter().filter(|c| c.samples) {
            let rows: Vec<&[f32]> = (row..row + 1 + c.draft).map(|r| &logits[r * vocab..(r + 1) * vocab]).collect();
            row += 1 + c.draft;
            let lg = rows[0];
            let req = self.scheduler.request_mut(c.id).expect("planned requests exist");
            if c.draft > 0 {
                let draft = std::mem::take(&mut req.spec.as_mut().expect("speculating").draft);
                let new = spec::verify(&mut req.sampler, &rows, &draft, &req.tokens);
                let logprobs = |i: usize, t: u32| req.logprobs.map(|k| token_logprobs(rows[i], t, k));
                let tokens = new.iter().enumerate().map(|(i, &t)| (t, logprobs(i, t))).collect();
                req.spec.as_mut().expect("speculating").draft = draft;
                out.push(Sampled { id: c.id, tokens, error: None });
                continue;
            }
            let token = match req.constraint.as_mut() {
                None => req.sampler.sample(lg, &req.tokens),
                Some(constraint) => {
                    // the grammar's mask on a copy of the row. A grammar that fails (it should not: every
                    // token it is given was allowed by its own mask) ends the request with an error:
                    // text past it would not be held to the grammar, yet read as if it were.
                    self.masked.clear();
                    self.masked.extend_from_slice(lg);
                    let sampled = match constraint.mask(&mut self.masked) {
                        Ok(()) => {
                            let token = req.sampler.sample(&self.masked, &req.tokens);
                            constraint.advance(token).map(|()| token).map_err(|e| format!("the grammar rejected token {token}: {e}"))
                        }
                        Err(e) => Err(format!("the grammar's mask failed: {e}")),
                    };
                    match sampled {
                        Ok(token) => token,
                        Err(e) => {
                            let generated = req.num_generated();
                            tracing::warn!(request = c.id, "constrained decoding failed after {generated} tokens, the request ends: {e}");
                            out.push(Sampled { id: c.id, tokens: Vec::new(), error: Some(format!("constrained decoding failed after {generated} tokens: {e}")) });
                            continue;
                        }
                    }
                }
            };
            let logprobs = req.logprobs.map(|k| token_logprobs(lg, token, k));
            out.push(Sampled { id: c.id, tokens: vec![(token, logprobs)], error: None });
        }
        out
    }

    /// Records the step: tokens computed and appended, then per sampled token its text and whether its
    /// request ends.
    fn update(&mut self, plan: &StepPlan, sampled: Vec<Sampled>) {
        let tokens: Vec<Vec<u32>> = sampled.iter().map(|s| s.tokens.iter().map(|t| t.0).collect()).collect();
        self.scheduler.complete_step(plan, &tokens);
        for c in plan.chunks.iter().filter(|c| c.draft > 0) {
            let kept = tokens.iter().zip(plan.chunks.iter().filter(|c| c.samples)).find(|(_, s)| s.id == c.id).map_or(0, |(t, _)| t.len() - 1);
            self.stats.spec_drafts.fetch_add(1, Ordering::Relaxed);
            self.stats.spec_draft_tokens.fetch_add(c.draft as u64, Ordering::Relaxed);
            self.stats.spec_accepted_tokens.fetch_add(kept as u64, Ordering::Relaxed);
            let per_pos = &self.stats.spec_accepted_per_pos;
            for p in 0..kept {
                per_pos[p.min(per_pos.len() - 1)].fetch_add(1, Ordering::Relaxed);
            }
        }
        let now = Instant::now();
        for s in sampled {
            if let Some(e) = s.error {
                self.fail(s.id, &e);
                continue;
            }
            let req = self.scheduler.request_mut(s.id).expect("sampled requests exist");
            req.times.first_token.get_or_insert(now);
            let first = req.tokens.len() - s.tokens.len();
            let mut ended = None;
            for (j, (token, logprobs)) in s.tokens.into_iter().enumerate() {
                if !req.background {
                    self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
                }
                let (text, finish) = req.process_token(first + j, &*self.detok);
                let delivered = req.send_token(token, text, logprobs);
                ended = match finish {
                    Some(reason) => Some(reason),
                    None if !delivered => Some(FinishReason::Abort),
                    None => None,
                };
                if ended.is_some() {
                    // tokens a step gave past the end are not the answer's
                    req.tokens.truncate(first + j + 1);
                    break;
                }
            }
            if let Some(reason) = ended {
                self.finish(s.id, reason);
            }
        }
    }

    /// Ends a request: its blocks back to the pool at once, its last event.
    fn finish(&mut self, id: RequestId, reason: FinishReason) {
        let Some(req) = self.remove(id) else { return };
        if req.background {
            // a recovery done: its full blocks are in the prefix cache
            if self.recovering.as_ref().is_some_and(|r| r.0 == id) {
                self.recovering = None;
            }
            self.stats.spec_prefill_recovery_debt.store(self.recovery_debt() as u64, Ordering::Relaxed);
            return;
        }
        if let Some(r) = self.recovery.iter_mut().find(|r| r.id == id) {
            r.prompt.extend_from_slice(&req.tokens[req.num_prompt_tokens..req.num_computed_tokens.max(req.num_prompt_tokens)]);
        }
        let now = Instant::now();
        let (accepted, drafted) = req.spec.as_ref().map_or((0, 0), |s| (s.accepted, s.drafted));
        let usage = Usage {
            prompt_tokens: req.num_prompt_tokens_in_full(),
            completion_tokens: req.num_generated(),
            cached_tokens: req.num_cached_tokens,
            accepted_prediction_tokens: accepted,
            rejected_prediction_tokens: drafted - accepted,
        };
        let since = |t: Option<Instant>| t.unwrap_or(now).duration_since(req.times.arrived);
        let timings = Timings { queue: since(req.times.first_scheduled), time_to_first_token: since(req.times.first_token), end_to_end: now.duration_since(req.times.arrived) };
        req.send(Event::Finished { reason, usage, timings, stop: req.matched_stop().map(str::to_string) });
        self.stats.prompt_tokens.fetch_add(req.num_prompt_tokens_in_full() as u64, Ordering::Relaxed);
        let counter = if reason == FinishReason::Abort { &self.stats.aborted_requests } else { &self.stats.finished_requests };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn remove(&mut self, id: RequestId) -> Option<Request> {
        self.scoring.retain(|j| j.id != id);
        let req = self.scheduler.finish(id)?;
        if let Some(o) = self.offload.as_mut() {
            o.forget(id);
        }
        Some(req)
    }

    /// Saves every cached block to the disk tier (if any): at shutdown, after the last request.
    pub fn close(&mut self) {
        if let Some(mut offload) = self.offload.take() {
            offload.close(&self.kv, self.scheduler.pool().cached_blocks());
        }
    }

    /// Copies the live figures into `stats` (read by metrics without stopping the engine).
    pub fn publish_stats(&self) {
        let s = &self.stats;
        let pool = self.scheduler.pool();
        // Blocks first, the request counts last (Release; `/metrics` reads the counts first, Acquire): a
        // reader that sees a finished request gone also sees its blocks freed.
        s.blocks_used.store(pool.num_blocks() - pool.num_free(), Ordering::Relaxed);
        // (a background recovery is not a request anyone waits for)
        let background = self.recovering.as_ref().and_then(|r| self.scheduler.request(r.0)).map(|r| r.status);
        s.waiting.store(self.scheduler.num_waiting() - usize::from(background.is_some_and(|b| b != RequestStatus::Running)), Ordering::Release);
        s.running.store(self.scheduler.num_running() - usize::from(background == Some(RequestStatus::Running)), Ordering::Release);
        s.preemptions.store(self.scheduler.num_preemptions(), Ordering::Relaxed);
        let prefix = self.scheduler.prefix_stats();
        s.prefix_cache_queried_tokens.store(prefix.queried_tokens, Ordering::Relaxed);
        s.prefix_cache_hit_tokens.store(prefix.hit_tokens, Ordering::Relaxed);
        s.prefix_cache_blocks.store(pool.num_cached(), Ordering::Relaxed);
        s.prefix_cache_disk_hit_tokens.store(prefix.disk_hit_tokens, Ordering::Relaxed);
        s.prefix_cache_disk_blocks.store(self.offload.as_ref().map_or(0, |o| o.num_files()), Ordering::Relaxed);
        let (a, b) = self.scheduler.controller().cost().unwrap_or((0.0, 0.0));
        s.step_cost_a_ns.store((a * 1e9) as u64, Ordering::Relaxed);
        s.step_cost_b_ns.store((b * 1e9) as u64, Ordering::Relaxed);
        s.draft_step_ns.store((self.scheduler.draft_controller().time(1).unwrap_or(0.0) * 1e9) as u64, Ordering::Relaxed);
        s.spec_gain_milli.store(self.scheduler.spec_gain().map_or(0, |g| (g * 1e3) as u64), Ordering::Relaxed);
    }
}

/// Natural-log probabilities of `token` and of the `k` most likely tokens (ties by lower id).
fn token_logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    let lp = |l: f32| (l as f64 - lse) as f32;
    if k == 0 {
        return TokenLogprobs { logprob: lp(logits[token as usize]), top: Vec::new() };
    }
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(order.len());
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if k > 0 && k < order.len() {
        order.select_nth_unstable_by(k - 1, by_logit);
    }
    order.truncate(k);
    order.sort_unstable_by(by_logit);
    TokenLogprobs { logprob: lp(logits[token as usize]), top: order.into_iter().map(|t| (t, lp(logits[t as usize]))).collect() }
}

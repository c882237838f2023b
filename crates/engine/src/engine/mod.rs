//! The engine: every running request, the scheduler, the KV storage and the model, advanced one step at a
//! time. `Engine::step` reads as vLLM v1's: schedule (who runs, which blocks) -> execute (one batched
//! forward pass over the paged KV, then sampling) -> update (append tokens, detokenize, stop, send token
//! events, free what finished).
//!
//! `EngineHandle` (handle.rs) runs an `Engine` on its own thread behind a channel; the server, the CLI,
//! the benchmarks and the lab all use it. The engine emits token events, never API JSON.

mod config;
mod events;
mod forward;
mod handle;
mod request;
mod sample;
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

pub use config::EngineConfig;
use sample::Sampled;
pub use events::{Completion, Event, TokenLogprobs, Timings, Usage};
pub use handle::{spawn, spawn_with, spawn_with_draft, spawn_with_models, EngineHandle, EngineStats};
pub use request::{Detokenizer, FinishReason, Request, RequestId, RequestStatus};
pub use scheduler::{Restore, ScheduledChunk, Scheduler, SchedulerConfig, StepPlan};
pub use stop::{StopMatcher, StopOutcome};
pub use validate::{validate, Field, GenerateParams, HeldBlocks, Limits, RequestError, ValidatedRequest, MAX_LOGPROBS, MAX_STOP_STRINGS};

use crate::kv::offload::{DiskOffload, RestoreReply, RestoredBlocks};
use crate::kv::{kv_numerics_version, BlockPool, DiskTierConfig, KvCacheManager, KvFormat, KvLayout, KvStorage};
use crate::model::{Model, Scratch};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

pub struct Engine {
    model: Arc<Model>,
    /// The model that scores prompts for sparse prefill (`engine::sparse`); the model itself without one.
    scorer: Option<Arc<Model>>,
    drafter: Option<spec::Drafter>,
    detok: Arc<dyn Detokenizer>,
    kv: KvStorage,
    scratch: Scratch,
    scheduler: Scheduler,
    offload: Option<DiskOffload>,
    stats: Arc<EngineStats>,
    config: EngineConfig,
    /// The sample/constrain stage (`engine::sample`).
    sampling: sample::SampleStage,
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
        let drafter = draft.map(|d| spec::Drafter::new(d, &model, &config).map_err(invalid)).transpose()?;
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
        Ok(Engine { model, scorer: None, drafter, detok, kv, scratch: Scratch::default(), scheduler, offload, stats: Arc::new(EngineStats::default()), config, sampling: Default::default(), draft_secs: 0.0, recovery: Default::default(), recovering: None, next_background_id: FIRST_BACKGROUND_ID, scoring: Default::default(), slow: slow::SlowState::new(config.slow_state), serial_pool: None })
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

    /// The draft, forward and sample stages: the draft model's guesses, the model over the plan's chunks,
    /// and a token (or a speculating chunk's kept guesses) for every chunk that ends its request.
    fn execute(&mut self, plan: &StepPlan) -> Vec<Sampled> {
        if let Some(d) = self.drafter.as_mut() {
            self.draft_secs += d.run(plan, &mut self.scheduler);
        }
        let logits = forward::run(&self.model, &self.config, plan, &self.scheduler, &mut self.kv, &mut self.scratch);
        if self.config.rest_pool_between_steps {
            // The pool's workers park now: while the token events go out, the HTTP threads they wake find
            // a free core instead of preempting this thread (on a 2-core host, each wake-up landed on
            // this thread's core while the other ran a spinning worker).
            crate::pool::current().rest();
        }
        self.sampling.sample(plan, logits, self.model.config.vocab_size, &mut self.scheduler)
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

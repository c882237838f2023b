//! The engine: every running request, the scheduler, the KV storage and the model, advanced one step at a
//! time. `Engine::step` runs its stages in order, each feature in the module that owns its state:
//! - schedule: who runs, with which blocks (`scheduler`; speculation's guesses are planned there);
//! - prepare: the disk tier's evictions and restores (`kv::offload`); a slice of a sparse prefill's
//!   scoring pass before it (`spec_prefill`);
//! - draft: the draft model's guesses (`spec::Drafter`);
//! - forward: one batched pass over the paged KV (`forward`), on the slow-state fallback's pool when the
//!   host is slow (`slow`);
//! - sample/constrain: tokens, guesses checked, grammars applied (`sample`);
//! - update: tokens appended, detokenized, stopped, sent as events; what finished is freed.
//!
//! `EngineHandle` (handle.rs) runs an `Engine` on its own thread behind a channel; the server, the CLI,
//! the benchmarks and the lab all use it. The engine emits token events, never API JSON.

mod config;
mod events;
mod forward;
mod handle;
mod reasoning;
mod request;
mod sample;
mod scheduler;
pub mod slow;
pub mod sparse;
pub mod spec;
mod spec_prefill;
mod state_slots;
mod stats;
mod stop;
mod validate;
#[cfg(test)]
mod scheduler_hybrid_tests;
#[cfg(test)]
mod scheduler_prefix_tests;
#[cfg(test)]
mod scheduler_state_tests;
#[cfg(test)]
mod scheduler_tests;
#[cfg(test)]
mod scheduler_window_tests;

pub use config::EngineConfig;
use sample::Sampled;
pub use events::{Completion, Event, TokenLogprobs, Timings, Usage};
pub use handle::{spawn, spawn_engine, spawn_with, spawn_with_draft, spawn_with_models, EngineHandle};
pub use reasoning::ReasoningBudget;
pub use stats::EngineStats;
pub use request::{Detokenizer, FinishReason, Request, RequestId, RequestStatus};
pub use scheduler::{Restore, ScheduledChunk, Scheduler, SchedulerConfig, StepPlan};
pub use stop::{StopMatcher, StopOutcome};
pub use validate::{validate, Field, GenerateParams, HeldBlocks, Limits, RequestError, ValidatedRequest, MAX_LOGPROBS, MAX_STOP_STRINGS};

use crate::kv::offload::{DiskOffload, RestoreReply, RestoredBlocks};
use crate::kv::{BlockPool, DiskTierConfig, KvCacheManager, KvLayout, KvStorage};
use crate::model::{Model, Scratch};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

pub struct Engine {
    model: Arc<Model>,
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
    /// Sparse prefill's scoring passes and idle recovery (`engine::spec_prefill`).
    spec_prefill: spec_prefill::SpecPrefill,
    /// The host's state as the steps show it, and the fallback (`engine::slow`).
    slow: slow::SlowStage,
    /// A hybrid model's recurrent-state slot per request (`engine::state_slots`).
    state_slots: state_slots::StateSlots,
    /// Where each step's KV-cache events go (`kv::events`), if anywhere.
    kv_events: Option<crate::kv::KvEventSink>,
}

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
        config.check_capabilities(&model.config).map_err(invalid)?;
        let drafter = draft.map(|d| spec::Drafter::new(d, &model, &config).map_err(invalid)).transpose()?;
        let layout = config.kv_layout(&model, disk.is_some());
        let kv = model.new_kv_in(layout.clone(), config.kv_dtypes, config.block_size, config.num_blocks);
        let offload = config.open_disk_tier(&model, &kv, disk)?;
        let root = offload.as_ref().map_or(0, |o| o.root());
        let mut pool = BlockPool::with_hasher(config.num_blocks, crate::kv::sha256_block_hash, root);
        let recurrent = model.config.short_conv.is_some();
        if recurrent {
            pool = pool.with_state_slots(config.state_snapshot_slots());
        }
        let scheduler_config = SchedulerConfig {
            max_batch_tokens: config.max_batch_tokens,
            max_prefill_tokens_while_decoding: config.max_prefill_tokens_while_decoding,
            max_running: config.max_running,
            max_background_chunk: config.spec_prefill.map_or(usize::MAX, |s| s.recover_slice),
        };
        let mut manager = KvCacheManager::new(config.block_size, pool, config.prefix_caching).with_window(config.kv_window).with_layout(&layout);
        if recurrent {
            manager = manager.with_state_snapshots(config.state_snapshot_every);
        }
        let scheduler = Scheduler::new(scheduler_config, manager);
        Ok(Engine { model, drafter, detok, kv, scratch: Scratch::default(), scheduler, offload, stats: Arc::new(EngineStats::default()), config, sampling: Default::default(), draft_secs: 0.0, spec_prefill: Default::default(), slow: slow::SlowStage::new(config.slow_state), state_slots: Default::default(), kv_events: None })
    }

    /// Sends which prefix-cache keys are stored and removed (`kv::events`), in memory and on the disk
    /// tier, to `sink`: one call per step that changed the cache, one per disk-tier write or deletion.
    pub fn with_kv_events(mut self, sink: crate::kv::KvEventSink) -> Engine {
        self.scheduler.record_kv_events();
        if let Some(o) = self.offload.as_mut() {
            o.send_events_to(sink.clone());
        }
        self.kv_events = Some(sink);
        self
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// Drops every cached prefix in memory (the disk tier keeps its files) when no request holds a
    /// block: false, and nothing dropped, while requests run or wait on a disk read. A background
    /// recovery (`engine::spec_prefill`) is stopped first.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.stop_recovery();
        let done = self.scheduler.reset_prefix_cache();
        self.publish_kv_events();
        done
    }

    fn publish_kv_events(&mut self) {
        if let Some(sink) = &self.kv_events {
            let events = self.scheduler.take_kv_events();
            if !events.is_empty() {
                sink(events);
            }
        }
    }

    /// Scores prompts for sparse prefill with `scorer` (a smaller model of the same vocabulary, as
    /// SpecPrefill's draft) instead of the model itself.
    pub fn with_scorer(mut self, scorer: Arc<Model>) -> std::io::Result<Engine> {
        if scorer.config.vocab_size != self.model.config.vocab_size {
            let m = format!("the scorer's vocabulary has {} tokens, the model's {}", scorer.config.vocab_size, self.model.config.vocab_size);
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, m));
        }
        self.spec_prefill.set_scorer(scorer);
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
            capabilities: self.model.config.capabilities,
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
        self.scheduler.has_runnable_work() || self.spec_prefill.is_scoring()
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
        if req.constraint.is_none() && req.reasoning.is_none() && (self.config.spec.is_some() || !req.prediction.is_empty()) {
            req.spec = Some(spec::SpecState { config: self.config.spec.clone().unwrap_or_default(), ..Default::default() });
        }
        self.scheduler.add(req);
        if let Some(config) = sparse_prefill {
            self.spec_prefill.start(id, config, cache_salt, &self.model, &mut self.scheduler, self.config.block_size, &self.stats);
        }
        // (a request being scored reads nothing from the disk tier: its prompt may be thinned)
        let scoring = self.spec_prefill.scores(id);
        if let (Some(offload), Some(reply), false) = (self.offload.as_mut(), restore_reply, scoring) {
            let req = self.scheduler.request(id).expect("just added");
            let probe = self.scheduler.kv().probe(&req.tokens, &req.blocks);
            if offload.start_restore(id, &probe, &req.tokens, &self.kv, reply) {
                self.scheduler.hold(id);
            }
        }
    }

    /// With nothing else to run: starts (or keeps) recomputing the latest remembered sparse prefill's
    /// full prompt as a background request (`engine::spec_prefill`). True while one is in flight.
    pub fn start_recovery(&mut self) -> bool {
        let limits = self.limits();
        self.spec_prefill.start_recovery(&mut self.scheduler, &limits)
    }

    /// Stops the background recovery, if any, before the next step; what it computed stays cached.
    pub fn stop_recovery(&mut self) {
        if let Some(id) = self.spec_prefill.stop_recovery() {
            self.remove(id);
        }
    }

    /// A disk read finished: the request may be admitted, with the blocks read.
    pub fn restored(&mut self, r: RestoredBlocks) {
        let (id, first, loaded) = (r.id, r.first, r.blocks.iter().map(Option::is_some).collect());
        // (a hybrid recurrent model's block file may carry the state after the block: more bytes)
        let block_bytes = self.kv.block_bytes();
        let states = if self.model.config.short_conv.is_some() { r.blocks.iter().map(|b| b.as_ref().is_some_and(|b| b.len() > block_bytes)).collect() } else { Vec::new() };
        if self.offload.as_mut().is_some_and(|o| o.restored(r)) {
            self.scheduler.offer_restored(id, first, loaded, states);
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

    /// One step: schedule -> prepare -> draft -> forward -> sample/constrain -> update.
    pub fn step(&mut self) {
        // a slice of a sparse prefill's scoring pass (other requests are not held up for a whole pass)
        self.spec_prefill.advance(&self.model, &mut self.scheduler, self.config.max_batch_tokens, &self.stats);
        let scheduling = Instant::now();
        let mut plan = self.scheduler.schedule();
        self.prepare(&mut plan);
        if plan.is_empty() {
            self.publish_kv_events();
            return;
        }
        let started = Instant::now();
        let recovering = self.spec_prefill.recovering_in(&plan, &self.stats);
        let (mode, pool) = self.slow.begin(started);
        let sampled = match &pool {
            Some(serial) => serial.install(|| self.execute(&plan)),
            None => self.execute(&plan),
        };
        let secs = started.elapsed().as_secs_f64();
        // the target's step alone: the draft model's passes are fitted apart
        self.slow.end(slow::StepShape::of(&plan), mode, pool, secs - self.draft_secs, &self.stats);
        self.scheduler.observe_step(plan.chunks.iter().map(|c| c.len).sum(), secs - self.draft_secs);
        self.stats.count_step(secs, self.draft_secs, recovering.is_some());
        let emitting = Instant::now();
        self.update(&plan, sampled);
        self.publish_kv_events();
        // ms: the model step and sampling; schedule_ms and emit_ms: the engine's own work around it.
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        tracing::debug!(sequences = plan.chunks.len(), tokens = plan.chunks.iter().map(|c| c.len).sum::<usize>(), ms = secs * 1e3, schedule_ms = ms(started - scheduling), emit_ms = ms(emitting.elapsed()), "step");
    }

    /// Blocks the plan hands out again are saved to the disk tier before anything overwrites them; then
    /// restored blocks are written into the blocks their admissions got, and what an admission did not
    /// use is dropped. The draft model's time starts at zero.
    fn prepare(&mut self, plan: &mut StepPlan) {
        self.draft_secs = 0.0;
        if self.model.config.short_conv.is_some() {
            // which blocks keep a state snapshot, and where, as admission and allocation left it
            self.kv.conv_states.map_snapshots(self.scheduler.pool().state_slots());
        }
        if let Some(offload) = self.offload.as_mut() {
            offload.save_evicted(&self.kv, std::mem::take(&mut plan.evicted));
            for r in &plan.restores {
                offload.write_restore(&mut self.kv, r.id, r.skip, &r.blocks);
            }
        }
        let now = Instant::now();
        for c in &plan.chunks {
            let req = self.scheduler.request_mut(c.id).expect("planned requests exist");
            if req.times.first_scheduled.is_none() {
                req.times.first_scheduled = Some(now);
                if let Some(o) = self.offload.as_mut() {
                    o.forget(c.id);
                }
            }
        }
    }

    /// The draft, forward and sample stages: the draft model's guesses, the model over the plan's chunks,
    /// and a token (or a speculating chunk's kept guesses) for every chunk that ends its request.
    fn execute(&mut self, plan: &StepPlan) -> Vec<Sampled> {
        if let Some(d) = self.drafter.as_mut() {
            self.draft_secs += d.run(plan, &mut self.scheduler);
        }
        let states: Vec<Option<u32>> = if self.model.config.short_conv.is_some() {
            let scheduler = &self.scheduler;
            self.state_slots.release_gone(|id| scheduler.request(id).is_some());
            let (slots, kv) = (&mut self.state_slots, &mut self.kv);
            plan.chunks
                .iter()
                .map(|c| {
                    let (slot, fresh) = slots.slot(c.id);
                    if fresh {
                        kv.conv_states.forget(slot);
                    }
                    Some(slot)
                })
                .collect()
        } else {
            vec![None; plan.chunks.len()]
        };
        let logits = forward::run(&self.model, &self.config, plan, &self.scheduler, &states, &mut self.kv, &mut self.scratch);
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
        self.stats.count_guesses(plan, &tokens);
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
        self.spec_prefill.finished(&req, &self.stats);
        if req.background {
            return;
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
        self.spec_prefill.forget(id);
        let req = self.scheduler.finish(id)?;
        if let Some(o) = self.offload.as_mut() {
            o.forget(id);
        }
        Some(req)
    }

    /// After a panic in a step: the engine's state may be inconsistent, so nothing of it is used again.
    /// Every request gets an error event (its client answers in its API's shape) and nothing more is
    /// written to the disk tier; the scheduler, the KV and the pool are left as they are, to be dropped.
    pub fn abandon(&mut self, message: &str) {
        if let Some(o) = self.offload.as_mut() {
            o.abandon();
        }
        self.offload = None;
        for id in self.scheduler.request_ids() {
            if let Some(req) = self.scheduler.request(id).filter(|r| !r.background) {
                req.send(Event::Error(message.to_string()));
                self.stats.failed_requests.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Saves every cached block to the disk tier (if any): at shutdown, after the last request.
    pub fn close(&mut self) {
        if let Some(mut offload) = self.offload.take() {
            offload.close(&self.kv, self.scheduler.pool().cached_blocks());
        }
    }
}

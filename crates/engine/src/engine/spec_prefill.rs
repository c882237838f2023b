//! The sparse-prefill stage (SpecPrefill, `--spec-prefill-keep`; the planning is `engine::sparse`): a
//! new request whose prompt is long enough is held while a scorer (the model's first layers, or a
//! smaller model) reads it, a slice a step; then only its most attended chunks are prefilled. With
//! `recover`, the full prompts of recent sparse prefills are recomputed while the engine is idle, as
//! background requests, so a later turn finds the whole prefix cached.

use super::{sparse, validate, EngineStats, Event, GenerateParams, Limits, Request, RequestId, Scheduler, StepPlan};
use crate::model::Model;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;

/// Ids of background requests count down from here (clients' count up from 1).
const FIRST_BACKGROUND_ID: RequestId = RequestId::MAX;

/// A request's prompt being scored for a sparse prefill.
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

pub(super) struct SpecPrefill {
    /// The model that scores prompts; the engine's own model without one.
    scorer: Option<Arc<Model>>,
    /// Scoring passes of held requests, first come first served, a slice a step.
    scoring: VecDeque<ScoringJob>,
    /// Full prompts to recompute, latest first; the one in flight as a background request.
    recovery: VecDeque<Recovery>,
    recovering: Option<(RequestId, UnboundedReceiver<Event>, Recovery)>,
    /// The next background request's id (counting down from `FIRST_BACKGROUND_ID`).
    next_background_id: RequestId,
}

impl Default for SpecPrefill {
    fn default() -> Self {
        SpecPrefill { scorer: None, scoring: VecDeque::new(), recovery: VecDeque::new(), recovering: None, next_background_id: FIRST_BACKGROUND_ID }
    }
}

impl SpecPrefill {
    pub fn set_scorer(&mut self, scorer: Arc<Model>) {
        self.scorer = Some(scorer);
    }

    /// Whether a scoring pass is waiting for steps.
    pub fn is_scoring(&self) -> bool {
        !self.scoring.is_empty()
    }

    /// Whether request `id` is held for its scoring pass.
    pub fn scores(&self, id: RequestId) -> bool {
        self.scoring.iter().any(|j| j.id == id)
    }

    /// Holds a new request whose prompt is long enough for a sparse prefill while its scoring pass runs
    /// (a slice each step, `advance`), keeping whatever the prefix cache holds now whole.
    pub fn start(&mut self, id: RequestId, config: sparse::SparsePrefillConfig, cache_salt: Option<String>, model: &Model, scheduler: &mut Scheduler, block_size: usize, stats: &EngineStats) {
        let Some(req) = scheduler.request(id) else { return };
        let protect = scheduler.kv().probe(&req.tokens, &req.blocks).in_memory * block_size;
        if !sparse::worth_scoring(req.tokens.len(), protect, &config) {
            return;
        }
        let started = Instant::now();
        let scorer: &Model = self.scorer.as_deref().unwrap_or(model);
        let pass = sparse::ScoringPass::new(scorer, req.tokens.clone(), config.layers, config.lookahead);
        if scheduler.hold_for_scoring(id) {
            self.scoring.push_back(ScoringJob { id, pass, config, cache_salt, protect });
        }
        stats.spec_prefill_scoring_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    /// One slice (`tokens`) of the oldest scoring pass; a finished one thins its request and lets it be
    /// admitted.
    pub fn advance(&mut self, model: &Model, scheduler: &mut Scheduler, tokens: usize, stats: &EngineStats) {
        let Some(job) = self.scoring.front_mut() else { return };
        let started = Instant::now();
        let done = job.pass.advance(self.scorer.as_deref().unwrap_or(model), tokens);
        stats.spec_prefill_scoring_ns.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if done {
            let job = self.scoring.pop_front().expect("just advanced");
            self.finish_scoring(job, scheduler, stats);
        }
    }

    fn finish_scoring(&mut self, job: ScoringJob, scheduler: &mut Scheduler, stats: &EngineStats) {
        let ScoringJob { id, pass, config, cache_salt, protect } = job;
        let Some(req) = scheduler.request(id) else { return };
        let planned = sparse::plan_from(&pass.into_attention(), req.tokens.len(), protect, &config);
        let prompt = req.tokens.clone();
        if let Some(kept) = planned {
            let dropped = prompt.len() - kept.len();
            if scheduler.sparsify(id, kept) {
                if config.recover {
                    self.recovery.push_front(Recovery { id, prompt, cache_salt, dropped });
                    self.recovery.truncate(sparse::MAX_RECOVERIES);
                    stats.spec_prefill_recovery_debt.store(self.debt() as u64, Ordering::Relaxed);
                }
                stats.spec_prefill_requests.fetch_add(1, Ordering::Relaxed);
                stats.spec_prefill_dropped_tokens.fetch_add(dropped as u64, Ordering::Relaxed);
                // (a draft model would see the thinned prompt at its cells' positions)
                if let Some(spec) = scheduler.request_mut(id).and_then(|r| r.spec.as_mut()) {
                    spec.config.draft = false;
                }
            }
        }
        scheduler.release_scoring(id);
    }

    /// Tokens the remembered sparse prefills dropped (the one being recovered included).
    fn debt(&self) -> usize {
        self.recovery.iter().chain(self.recovering.as_ref().map(|r| &r.2)).map(|r| r.dropped).sum()
    }

    /// With nothing else to run: starts (or keeps) recomputing the latest remembered sparse prefill's
    /// full prompt as a background request. True while one is in flight.
    pub fn start_recovery(&mut self, scheduler: &mut Scheduler, limits: &Limits) -> bool {
        if self.recovering.is_some() {
            return true;
        }
        while let Some(r) = self.recovery.pop_front() {
            let params = GenerateParams { ignore_eos: true, cache_salt: r.cache_salt.clone(), ..GenerateParams::greedy(r.prompt.clone(), 1) };
            let Ok(valid) = validate(params, limits) else { continue };
            let id = self.next_background_id;
            self.next_background_id -= 1;
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            let blocks = scheduler.kv().new_blocks(r.cache_salt.as_deref().map(str::as_bytes));
            let mut req = Request::new(id, valid, blocks, tx, Instant::now());
            req.background = true;
            scheduler.add(req);
            self.recovering = Some((id, rx, r));
            return true;
        }
        false
    }

    /// Stops the background recovery, if any: its prompt goes back to the front of the queue, and the
    /// engine removes the request it returns (what it computed stays cached).
    pub fn stop_recovery(&mut self) -> Option<RequestId> {
        let (id, _, r) = self.recovering.take()?;
        self.recovery.push_front(r);
        Some(id)
    }

    /// The background recovery's request, if one is in flight.
    pub fn background(&self) -> Option<RequestId> {
        self.recovering.as_ref().map(|r| r.0)
    }

    /// The tokens the plan computes for the background recovery (counted in `stats`), if any.
    pub fn recovering_in(&self, plan: &StepPlan, stats: &EngineStats) -> Option<usize> {
        let len = self.recovering.as_ref().and_then(|r| plan.chunks.iter().find(|c| c.id == r.0)).map(|c| c.len)?;
        stats.spec_prefill_recovery_steps.fetch_add(1, Ordering::Relaxed);
        stats.spec_prefill_recovered_tokens.fetch_add(len as u64, Ordering::Relaxed);
        Some(len)
    }

    /// A request ended: a background one ends its recovery; a client's whose prompt is remembered adds
    /// its computed output to that prompt.
    pub fn finished(&mut self, req: &Request, stats: &EngineStats) {
        if req.background {
            // a recovery done: its full blocks are in the prefix cache
            if self.recovering.as_ref().is_some_and(|r| r.0 == req.id) {
                self.recovering = None;
            }
            stats.spec_prefill_recovery_debt.store(self.debt() as u64, Ordering::Relaxed);
        } else if let Some(r) = self.recovery.iter_mut().find(|r| r.id == req.id) {
            r.prompt.extend_from_slice(&req.tokens[req.num_prompt_tokens..req.num_computed_tokens.max(req.num_prompt_tokens)]);
        }
    }

    /// A request left the engine: its scoring pass, if any, is dropped.
    pub fn forget(&mut self, id: RequestId) {
        self.scoring.retain(|j| j.id != id);
    }
}

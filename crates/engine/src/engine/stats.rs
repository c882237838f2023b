//! The engine's live figures: atomics the engine thread writes after each step and `/metrics` reads
//! without stopping it.

use super::{Engine, RequestStatus, StepPlan};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Milliseconds since the Unix epoch (0 if the clock is before it).
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Live figures for metrics, updated after every step and read without stopping the engine.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    pub blocks_used: AtomicUsize,
    pub preemptions: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Requests that ended with `Stop` or `Length`.
    pub finished_requests: AtomicU64,
    pub aborted_requests: AtomicU64,
    /// Requests that ended with an error event (a failed step, or cut short at shutdown).
    pub failed_requests: AtomicU64,
    /// Prompt tokens of admitted requests, and of those the ones found in the prefix cache.
    pub prefix_cache_queried_tokens: AtomicU64,
    pub prefix_cache_hit_tokens: AtomicU64,
    /// Blocks holding a cached prefix (held by a request or not).
    pub prefix_cache_blocks: AtomicUsize,
    /// Of the hit tokens, those read back from the disk tier; block files there.
    pub prefix_cache_disk_hit_tokens: AtomicU64,
    pub prefix_cache_disk_blocks: AtomicUsize,
    /// Speculative decoding: steps that carried guesses, guesses, and guesses kept.
    pub spec_drafts: AtomicU64,
    pub spec_draft_tokens: AtomicU64,
    pub spec_accepted_tokens: AtomicU64,
    /// Guesses kept at each position of a step's guesses (`vllm:spec_decode_num_accepted_tokens_per_pos`;
    /// positions past the last counted in it).
    pub spec_accepted_per_pos: [AtomicU64; 16],
    /// Sparse prefill: requests thinned, and prompt tokens they did not compute.
    pub spec_prefill_requests: AtomicU64,
    pub spec_prefill_dropped_tokens: AtomicU64,
    /// Nanoseconds the scoring passes took (on the engine thread, before the requests' prefill).
    pub spec_prefill_scoring_ns: AtomicU64,
    /// Idle recovery: prompt tokens a sparse prefill left uncomputed and not yet recovered, recovery
    /// steps run and prompt tokens they computed.
    pub spec_prefill_recovery_debt: AtomicU64,
    pub spec_prefill_recovery_steps: AtomicU64,
    pub spec_prefill_recovered_tokens: AtomicU64,
    /// Time of the steps that carried a recovery slice (their whole step).
    pub spec_prefill_recovery_ns: AtomicU64,
    /// The longest such step.
    pub spec_prefill_recovery_max_step_ns: AtomicU64,
    /// Slow-state detection (`engine::slow`): in one now, since when (Unix ms), slow states so far,
    /// time spent in ended ones, and steps the fallback ran.
    pub slow_state: AtomicBool,
    pub slow_state_since_ms: AtomicU64,
    pub slow_state_episodes: AtomicU64,
    pub slow_state_ns: AtomicU64,
    pub slow_state_fallback_steps: AtomicU64,
    /// Nanoseconds of model steps (the target's and the draft model's passes), and of those the draft
    /// model's.
    pub step_ns: AtomicU64,
    pub draft_ns: AtomicU64,
    /// The step-cost fit of `--spec auto` (`spec::Controller`), `T(n) = a + b·n` in nanoseconds, and
    /// the draft model's fitted pass of one token (0 until fitted).
    pub step_cost_a_ns: AtomicU64,
    pub step_cost_b_ns: AtomicU64,
    pub draft_step_ns: AtomicU64,
    /// The controller's expected speedup at its latest choice, in thousandths (0 until it chose).
    pub spec_gain_milli: AtomicU64,
    /// Submitted but not yet seen by the engine (counts toward the waiting limit).
    pub(super) unseen: AtomicUsize,
}

impl EngineStats {
    /// A step of `secs`, of which the draft model took `draft_secs`; `recovery`: it carried an idle
    /// recovery's slice.
    pub(super) fn count_step(&self, secs: f64, draft_secs: f64, recovery: bool) {
        let nanos = (secs * 1e9) as u64;
        if recovery {
            self.spec_prefill_recovery_ns.fetch_add(nanos, Ordering::Relaxed);
            self.spec_prefill_recovery_max_step_ns.fetch_max(nanos, Ordering::Relaxed);
        }
        self.step_ns.fetch_add(nanos, Ordering::Relaxed);
        self.draft_ns.fetch_add((draft_secs * 1e9) as u64, Ordering::Relaxed);
    }

    /// Speculation's counters for a step: per chunk that carried guesses, the guesses and those kept
    /// (`tokens`: each sampling chunk's tokens, the kept guesses and one more).
    pub(super) fn count_guesses(&self, plan: &StepPlan, tokens: &[Vec<u32>]) {
        for c in plan.chunks.iter().filter(|c| c.draft > 0) {
            let kept = tokens.iter().zip(plan.chunks.iter().filter(|c| c.samples)).find(|(_, s)| s.id == c.id).map_or(0, |(t, _)| t.len() - 1);
            self.spec_drafts.fetch_add(1, Ordering::Relaxed);
            self.spec_draft_tokens.fetch_add(c.draft as u64, Ordering::Relaxed);
            self.spec_accepted_tokens.fetch_add(kept as u64, Ordering::Relaxed);
            let per_pos = &self.spec_accepted_per_pos;
            for p in 0..kept {
                per_pos[p.min(per_pos.len() - 1)].fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl Engine {
    /// Copies the live figures into `stats` (read by metrics without stopping the engine).
    pub fn publish_stats(&self) {
        let s = &self.stats;
        let pool = self.scheduler.pool();
        // Blocks first, the request counts last (Release; `/metrics` reads the counts first, Acquire): a
        // reader that sees a finished request gone also sees its blocks freed.
        s.blocks_used.store(pool.num_blocks() - pool.num_free(), Ordering::Relaxed);
        // (a background recovery is not a request anyone waits for)
        let background = self.spec_prefill.background().and_then(|id| self.scheduler.request(id)).map(|r| r.status);
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

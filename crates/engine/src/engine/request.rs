//! One request's whole life in the engine, in one type: its tokens and how many of them are computed, its
//! KV blocks, its sampler, its detokenizer and stop criteria, and where its events go. The scheduler
//! keeps every live request and changes it in place (as nano-vllm's scheduler does its `Sequence`); the
//! engine turns each sampled token into text and decides here whether the request ends.
//!
//! The invariant the scheduler keeps (vLLM v1's): `num_computed_tokens` (tokens whose keys and values are
//! in `blocks`) catches up with `tokens.len()` (prompt, then generated). A prefill chunk, a decode step
//! and a prefix-cache hit each just advance it.

use super::events::{Event, TokenLogprobs};
use super::stop::{StopMatcher, StopOutcome};
use super::validate::ValidatedRequest;
use crate::kv::RequestBlocks;
use crate::sampler::Sampler;
use crate::tokenizer::{Tokenizer, Utf8Stream};
use std::time::Instant;
use tokio::sync::mpsc::UnboundedSender;

pub type RequestId = u64;

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token, a stop token or a stop string.
    Stop,
    /// `max_new_tokens` or the context was reached.
    Length,
    /// The client went away or asked to stop.
    Abort,
}

/// Where a live request is in the scheduler.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    /// Queued for admission (new, or preempted and back at the front).
    Waiting,
    /// Queued, but not admitted until the engine has read its next prompt blocks from the disk tier.
    WaitingForDisk,
    /// Queued, but not admitted until the engine has scored its prompt for a sparse prefill
    /// (`engine::sparse`), a slice a step.
    Scoring,
    /// In the running batch: it has blocks and is computed a chunk at a time.
    Running,
}

/// How a token id turns into text, and whether it ends a generation: the tokenizer, or a stand-in in
/// tests on tiny random models.
pub trait Detokenizer: Send + Sync {
    fn token_bytes(&self, id: u32) -> Vec<u8>;
    fn is_end_of_generation(&self, id: u32) -> bool;
}

impl Detokenizer for Tokenizer {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        Tokenizer::token_bytes(self, id, false)
    }

    fn is_end_of_generation(&self, id: u32) -> bool {
        self.is_eog(id)
    }
}

/// When a request reached each stage (for its `Timings`).
#[derive(Clone, Copy, Debug)]
pub struct RequestTimes {
    pub arrived: Instant,
    pub first_scheduled: Option<Instant>,
    pub first_token: Option<Instant>,
}

pub struct Request {
    pub id: RequestId,
    /// Prompt, then generated tokens.
    pub tokens: Vec<u32>,
    pub num_prompt_tokens: usize,
    /// Tokens whose keys and values are in `blocks`.
    pub num_computed_tokens: usize,
    /// Generated tokens allowed (prompt plus these fit the context).
    pub max_new_tokens: usize,
    pub status: RequestStatus,
    pub num_preemptions: u32,
    /// Prompt tokens found in the prefix cache at first admission (not computed for this request).
    pub num_cached_tokens: usize,
    pub blocks: RequestBlocks,
    pub sampler: Sampler,
    /// Also return this many alternatives' log-probabilities with each token.
    pub logprobs: Option<usize>,
    /// The grammar the answer must match, advanced by every sampled token.
    pub constraint: Option<crate::grammar::Constraint>,
    /// Speculative decoding (`engine::spec`): set by the engine where it speculates for this request.
    pub spec: Option<super::spec::SpecState>,
    /// The client's guess of the output (OpenAI's `prediction`), for the proposer.
    pub prediction: Vec<u32>,
    /// A cap on the answer's reasoning (`engine::reasoning`), applied by the sample stage.
    pub reasoning: Option<super::reasoning::ReasoningState>,
    /// A sparse prefill (`engine::sparse`): `tokens` begins with the kept prompt tokens, each cell at its
    /// position in the full prompt.
    pub sparse: Option<super::sparse::SparsePrompt>,
    /// The engine's own idle recovery of a sparse prefill (`engine::sparse`): not counted in the
    /// request statistics.
    pub background: bool,
    /// The request's own word on sparse prefill, read when it is queued.
    pub spec_prefill: Option<super::sparse::SpecPrefillChoice>,
    pub times: RequestTimes,
    output: Output,
    events: UnboundedSender<Event>,
}

/// The generated text so far and what ends it.
struct Output {
    ignore_eos: bool,
    stop_token_ids: Vec<u32>,
    utf8: Utf8Stream,
    stop_strings: StopMatcher,
}

impl Output {
    /// Everything still held back, at the end of the generation (an incomplete character as U+FFFD),
    /// cut before a stop string if that completes one (then true).
    fn flush(&mut self) -> (String, bool) {
        match self.stop_strings.push(&self.utf8.finish()) {
            StopOutcome::Continue(mut t) => {
                t.push_str(&self.stop_strings.finish());
                (t, false)
            }
            StopOutcome::Stopped(t) => (t, true),
        }
    }
}

impl Request {
    /// A new request, waiting. `blocks`: `KvCacheManager::new_blocks` for its cache salt.
    pub fn new(id: RequestId, req: ValidatedRequest, blocks: RequestBlocks, events: UnboundedSender<Event>, arrived: Instant) -> Request {
        let p = req.into_params();
        Request {
            id,
            num_prompt_tokens: p.prompt.len(),
            tokens: p.prompt,
            num_computed_tokens: 0,
            max_new_tokens: p.max_new_tokens.expect("validated requests have a limit"),
            status: RequestStatus::Waiting,
            num_preemptions: 0,
            num_cached_tokens: 0,
            blocks,
            sampler: Sampler::new(p.sampling),
            logprobs: p.logprobs,
            constraint: p.constraint,
            spec: None,
            prediction: p.prediction,
            reasoning: p.reasoning_budget.map(super::reasoning::ReasoningState::new),
            sparse: None,
            background: false,
            spec_prefill: p.spec_prefill,
            times: RequestTimes { arrived, first_scheduled: None, first_token: None },
            output: Output { ignore_eos: p.ignore_eos, stop_token_ids: p.stop_token_ids, utf8: Utf8Stream::default(), stop_strings: StopMatcher::new(p.stop) },
            events,
        }
    }

    pub fn num_generated(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }

    /// The prompt's length before a sparse prefill thinned it (what usage reports).
    pub fn num_prompt_tokens_in_full(&self) -> usize {
        self.sparse.as_ref().map_or(self.num_prompt_tokens, |s| s.prompt_len)
    }

    /// Thins the prompt of a request that has computed and generated nothing to the `kept` positions
    /// (`engine::sparse`); false (nothing changed) if it cannot be: already started, or positions that
    /// are not increasing or do not end with the prompt's last.
    pub fn sparsify(&mut self, kept: Vec<usize>) -> bool {
        if self.num_computed_tokens > 0 || self.tokens.len() != self.num_prompt_tokens || self.sparse.is_some() {
            return false;
        }
        let Some(sparse) = super::sparse::SparsePrompt::new(kept, self.num_prompt_tokens) else { return false };
        self.tokens = sparse.kept.iter().map(|&p| self.tokens[p]).collect();
        self.num_prompt_tokens = self.tokens.len();
        self.sparse = Some(sparse);
        true
    }

    /// Whether the next chunk is the one newest generated token (a decode): the whole prompt is computed
    /// and one token is left. (The last token of a recompute after preemption counts too.)
    pub fn is_decoding(&self) -> bool {
        self.num_computed_tokens >= self.num_prompt_tokens && self.num_computed_tokens + 1 == self.tokens.len()
    }

    /// The text the newest token (already appended to `tokens`) completes, and whether the request ends
    /// with it: an end-of-generation or stop token, a completed stop string, or the length limit.
    pub fn process_new_token(&mut self, detok: &dyn Detokenizer) -> (String, Option<FinishReason>) {
        self.process_token(self.tokens.len() - 1, detok)
    }

    /// `process_new_token` for the token at `tokens[at]` (a step that kept speculated tokens appends
    /// several; they are processed in order, and the request may end before the last).
    pub fn process_token(&mut self, at: usize, detok: &dyn Detokenizer) -> (String, Option<FinishReason>) {
        let token = self.tokens[at];
        let at_limit = at + 1 - self.num_prompt_tokens >= self.max_new_tokens;
        // a complete grammar ends the answer even under ignore_eos (it allows nothing but the end)
        let grammar_done = self.constraint.as_ref().is_some_and(|c| c.is_complete());
        let out = &mut self.output;
        if ((!out.ignore_eos || grammar_done) && detok.is_end_of_generation(token)) || out.stop_token_ids.contains(&token) {
            // the stop token itself has no text; what was held back is sent
            return (out.flush().0, Some(FinishReason::Stop));
        }
        let delta = out.utf8.push(&detok.token_bytes(token));
        let mut text = match out.stop_strings.push(&delta) {
            StopOutcome::Continue(t) => t,
            StopOutcome::Stopped(t) => return (t, Some(FinishReason::Stop)),
        };
        if !at_limit {
            return (text, None);
        }
        let (rest, stopped) = out.flush();
        text.push_str(&rest);
        (text, Some(if stopped { FinishReason::Stop } else { FinishReason::Length }))
    }

    /// The stop string that ended the request, if one did.
    pub fn matched_stop(&self) -> Option<&str> {
        self.output.stop_strings.matched()
    }

    /// Sends an event to the client; false if it has gone away.
    pub fn send(&self, event: Event) -> bool {
        self.events.send(event).is_ok()
    }

    /// A token event; false if the client has gone away.
    pub fn send_token(&self, id: u32, text: String, logprobs: Option<TokenLogprobs>) -> bool {
        self.send(Event::Token { id, text, logprobs })
    }
}

#[cfg(test)]
impl Request {
    /// A greedy request for scheduler tests; its events go nowhere.
    pub(crate) fn for_test(id: RequestId, prompt: Vec<u32>, max_new_tokens: usize, blocks: RequestBlocks) -> Request {
        let (events, _) = tokio::sync::mpsc::unbounded_channel();
        let params = super::validate::GenerateParams::greedy(prompt, max_new_tokens);
        Request::new(id, ValidatedRequest::unchecked(params), blocks, events, Instant::now())
    }
}

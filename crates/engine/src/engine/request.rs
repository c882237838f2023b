//! What goes into the engine (a request) and what comes out (token events). No API JSON here: the
//! server maps these to OpenAI or Anthropic shapes.

use crate::sampler::SamplingParams;
use std::time::Duration;

pub type RequestId = u64;

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    /// Token ids (the server applies the chat template and tokenizes).
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Generated tokens at most (also capped by the context).
    pub max_new_tokens: usize,
    /// Tokens that end the generation besides the model's end-of-generation tokens.
    pub stop_token_ids: Vec<u32>,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// Return the chosen token's log-probability and this many alternatives per token (`None`: none).
    pub logprobs: Option<usize>,
    /// Share prefix-cache blocks only with requests carrying the same salt (vLLM's `cache_salt`).
    pub cache_salt: Option<String>,
}

impl GenerateRequest {
    pub fn greedy(prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        GenerateRequest { prompt, sampling: SamplingParams::greedy(), max_new_tokens, stop_token_ids: Vec::new(), ignore_eos: false, logprobs: None, cache_salt: None }
    }
}

/// Log-probabilities of one generated token under the model's own distribution (natural log of the
/// softmax of the raw logits: before penalties, temperature and truncation, as vLLM's default).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation or stop token.
    Stop,
    /// `max_new_tokens` or the context was reached.
    Length,
    /// The client went away or asked to stop.
    Abort,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV state was reused rather than computed (prefix cache).
    pub cached_tokens: usize,
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Timings {
    /// Arrival to first scheduled step.
    pub queue: Duration,
    /// Arrival to the first generated token.
    pub time_to_first_token: Duration,
    /// Arrival to the end.
    pub end_to_end: Duration,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// One generated token and the text it completes (may be empty while a UTF-8 character is split
    /// across tokens). The final stop token, if any, is reported with empty text.
    Token { id: u32, text: String, logprobs: Option<TokenLogprobs> },
    /// The last event of a request.
    Finished { reason: FinishReason, usage: Usage, timings: Timings },
    /// The request failed; no more events follow.
    Error(String),
}

/// Everything one request produced, gathered from its events by `Completion::wait`.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub ids: Vec<u32>,
    pub text: String,
    pub reason: FinishReason,
    pub usage: Usage,
    pub timings: Timings,
}

impl Completion {
    /// Blocks until the request ends (for code outside an async runtime: benchmarks, tests). `Err` holds
    /// the engine's error, or says the engine stopped without a last event.
    pub fn wait(mut events: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Result<Completion, String> {
        let (mut ids, mut text) = (Vec::new(), String::new());
        while let Some(ev) = events.blocking_recv() {
            match ev {
                Event::Token { id, text: t, .. } => {
                    ids.push(id);
                    text.push_str(&t);
                }
                Event::Finished { reason, usage, timings } => return Ok(Completion { ids, text, reason, usage, timings }),
                Event::Error(e) => return Err(e),
            }
        }
        Err("the engine stopped before the request finished".into())
    }
}

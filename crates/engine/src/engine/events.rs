//! What comes out of the engine: token events, one request's usage and timings. No API JSON here: the
//! server shapes these as its APIs' responses.

use super::request::FinishReason;
use std::time::Duration;

/// Log-probabilities of one generated token under the model's own distribution (natural log of the
/// softmax of the raw logits: before penalties, temperature and truncation, as vLLM's default).
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, most likely first.
    pub top: Vec<(u32, f32)>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV state was reused rather than computed (prefix cache).
    pub cached_tokens: usize,
    /// Speculative decoding: guessed tokens the model kept, and those it rejected (OpenAI's
    /// `accepted_prediction_tokens` / `rejected_prediction_tokens`).
    pub accepted_prediction_tokens: usize,
    pub rejected_prediction_tokens: usize,
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
    /// One generated token and the text that can be sent for it: complete UTF-8 only, and never part of
    /// a stop string (text that may begin one is held back and comes with a later token, or is dropped
    /// when the stop string completes). An end-of-generation or stop token comes with empty text.
    Token { id: u32, text: String, logprobs: Option<TokenLogprobs> },
    /// The last event of a request that ended normally (or was aborted). `stop`: the stop string that
    /// ended it, if one did (`reason` is then `Stop`).
    Finished { reason: FinishReason, usage: Usage, timings: Timings, stop: Option<String> },
    /// The request failed, or was cut short (a shutdown's drain timed out); no more events follow.
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
    /// Blocks until the request ends (for code outside an async runtime: the CLI, benchmarks, tests).
    /// `Err` holds the engine's error, or says the engine stopped without a last event.
    pub fn wait(events: tokio::sync::mpsc::UnboundedReceiver<Event>) -> Result<Completion, String> {
        Self::wait_with(events, |_, _| {})
    }

    /// `wait`, calling `on_token(id, text)` as each token arrives (for streaming to a terminal).
    pub fn wait_with(mut events: tokio::sync::mpsc::UnboundedReceiver<Event>, mut on_token: impl FnMut(u32, &str)) -> Result<Completion, String> {
        let (mut ids, mut text) = (Vec::new(), String::new());
        while let Some(ev) = events.blocking_recv() {
            match ev {
                Event::Token { id, text: t, .. } => {
                    on_token(id, &t);
                    ids.push(id);
                    text.push_str(&t);
                }
                Event::Finished { reason, usage, timings, .. } => return Ok(Completion { ids, text, reason, usage, timings }),
                Event::Error(e) => return Err(e),
            }
        }
        Err("the engine stopped before the request finished".into())
    }
}

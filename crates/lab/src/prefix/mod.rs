//! `reckon lab prefix`: what automatic prefix caching buys an agent session.
//!
//! Replays a multi-turn conversation (a ~1,500-token system prompt with tool schemas, then user turns of
//! 150-300 tokens, each turn resending the whole history with the model's own replies) through the
//! engine with the prefix cache on and off, interleaved (on/off, then off/on, ...). Per request it
//! records the prompt tokens, where the prompt first differs from every earlier sequence of the session
//! (so the ideal hit), the tokens the cache supplied, the tokens actually prefilled, and the time to
//! first token. Several sessions can share the system prompt (interleaved turns), and a timestamp at the
//! start of the system prompt shows how a changing early token defeats the cache.

pub(crate) mod conversation;
pub mod report;

use crate::LabError;
use reckon_engine::engine::{spawn, Completion, EngineConfig, EngineHandle, GenerateParams};
use reckon_engine::model::Model;
use reckon_engine::template::{ChatMessage, ChatTemplate};
use reckon_engine::tokenizer::Tokenizer;
use serde::Serialize;
use std::sync::Arc;

#[derive(Clone, Debug)]
pub struct PrefixSpec {
    pub turns: usize,
    /// Conversations sharing the system prompt, their turns interleaved.
    pub sessions: usize,
    /// System prompt size, tokens.
    pub prefix_tokens: usize,
    /// User message size range, tokens.
    pub turn_tokens: (usize, usize),
    /// Reply tokens at most (greedy; replies go back into the history).
    pub max_tokens: usize,
    pub passes: usize,
    /// Start the system prompt with the turn's time.
    pub timestamp: bool,
    /// The engine of both arms (`prefix_caching` is set per arm).
    pub engine: EngineConfig,
}

/// One request of one pass of one arm.
#[derive(Clone, Debug, Serialize)]
pub struct TurnRecord {
    pub pass: usize,
    pub prefix_cache: bool,
    pub session: usize,
    pub turn: usize,
    pub prompt_tokens: usize,
    /// Position of the first prompt token that no earlier sequence of this pass (prompt and reply) has
    /// at the same place: the longest prefix any cache could supply.
    pub first_difference: usize,
    /// The tokens at that position, and what the closest earlier sequence had there.
    pub difference: String,
    pub cached_tokens: usize,
    pub prefilled_tokens: usize,
    pub ttft_ms: f64,
    pub e2e_ms: f64,
    pub reply_tokens: Vec<u32>,
}

/// Runs every pass of both arms; `on_record` sees each request as it finishes.
pub fn run(
    model: &Arc<Model>,
    tok: &Arc<Tokenizer>,
    template: &ChatTemplate,
    spec: &PrefixSpec,
    mut on_record: impl FnMut(&TurnRecord),
) -> Result<Vec<TurnRecord>, LabError> {
    let mut records = Vec::new();
    for pass in 0..spec.passes {
        let arms = if pass % 2 == 0 { [true, false] } else { [false, true] };
        for prefix_cache in arms {
            let engine = spawn(model.clone(), tok.clone(), EngineConfig { prefix_caching: prefix_cache, ..spec.engine });
            let mut session = Replay { engine, tok, template, spec, pass, prefix_cache, histories: vec![Vec::new(); spec.sessions], seen: Vec::new() };
            for turn in 0..spec.turns {
                for s in 0..spec.sessions {
                    let r = session.turn(s, turn)?;
                    on_record(&r);
                    records.push(r);
                }
            }
        }
    }
    Ok(records)
}

/// One arm of one pass: the conversations so far, and every sequence the engine has seen.
struct Replay<'a> {
    engine: EngineHandle,
    tok: &'a Tokenizer,
    template: &'a ChatTemplate,
    spec: &'a PrefixSpec,
    pass: usize,
    prefix_cache: bool,
    /// Per session: user and assistant messages so far.
    histories: Vec<Vec<ChatMessage>>,
    /// Prompt and reply token ids of earlier requests.
    seen: Vec<Vec<u32>>,
}

impl Replay<'_> {
    fn turn(&mut self, session: usize, turn: usize) -> Result<TurnRecord, LabError> {
        let spec = self.spec;
        let system = conversation::system_prompt(self.tok, spec.prefix_tokens, spec.timestamp.then_some(turn))?;
        let user = conversation::user_turn(self.tok, session, turn, spec.turn_tokens.0, spec.turn_tokens.1)?;
        let mut messages = vec![ChatMessage::new("system", &system)];
        messages.extend(self.histories[session].iter().cloned());
        messages.push(ChatMessage::new("user", &user));
        let prompt = self.tok.encode(&self.template.render(&messages, true)?, true, true)?;
        let (first_difference, difference) = self.first_difference(&prompt);
        let out = generate(&self.engine, prompt.clone(), spec.max_tokens)?;
        self.histories[session].push(ChatMessage::new("user", &user));
        self.histories[session].push(ChatMessage::new("assistant", &out.text));
        self.seen.push([prompt.as_slice(), &out.ids].concat());
        Ok(TurnRecord {
            pass: self.pass,
            prefix_cache: self.prefix_cache,
            session,
            turn,
            prompt_tokens: prompt.len(),
            first_difference,
            difference,
            cached_tokens: out.usage.cached_tokens,
            prefilled_tokens: prompt.len() - out.usage.cached_tokens,
            ttft_ms: out.timings.time_to_first_token.as_secs_f64() * 1e3,
            e2e_ms: out.timings.end_to_end.as_secs_f64() * 1e3,
            reply_tokens: out.ids,
        })
    }

    /// The longest common prefix with an earlier sequence, and the text where they part.
    fn first_difference(&self, prompt: &[u32]) -> (usize, String) {
        let common = |s: &Vec<u32>| s.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        let Some(best) = self.seen.iter().max_by_key(|s| common(s)) else { return (0, String::new()) };
        let n = common(best);
        let text = |ids: &[u32]| {
            let bytes: Vec<u8> = ids.iter().flat_map(|&t| self.tok.token_bytes(t, false)).collect();
            String::from_utf8_lossy(&bytes).replace('\n', "\\n")
        };
        let (before, new, old) = (&prompt[n.saturating_sub(4)..n], &prompt[n..(n + 4).min(prompt.len())], &best[n.min(best.len())..(n + 4).min(best.len())]);
        (n, format!("after '{}' comes '{}' where an earlier request had '{}'", text(before), text(new), text(old)))
    }
}

fn generate(engine: &EngineHandle, prompt: Vec<u32>, max_tokens: usize) -> Result<Completion, LabError> {
    let (_, rx) = engine.submit(GenerateParams::greedy(prompt, max_tokens)).map_err(|e| LabError::Request(e.to_string()))?;
    Completion::wait(rx).map_err(LabError::Request)
}

//! A single sequence over its own contiguous KV storage: what `reckon run`, `chat` and `bench` drive.
//! (The server will drive the same `Model::forward` through the scheduler and a shared block pool.)

use crate::error::{Error, Result};
use crate::kv::KvStorage;
use crate::model::{LogitsWanted, Model, Scratch, SeqInput};

pub const BLOCK_SIZE: usize = 16;

pub struct Session<'m> {
    model: &'m Model,
    kv: KvStorage,
    block_table: Vec<u32>,
    /// Tokens whose keys/values are in `kv`, in order.
    computed: Vec<u32>,
    scratch: Scratch,
}

impl<'m> Session<'m> {
    /// A session that can hold `max_tokens` positions.
    pub fn new(model: &'m Model, max_tokens: usize) -> Self {
        let num_blocks = max_tokens.div_ceil(BLOCK_SIZE).max(1);
        Session {
            model,
            kv: model.new_kv(BLOCK_SIZE, num_blocks),
            block_table: (0..num_blocks as u32).collect(),
            computed: Vec::new(),
            scratch: Scratch::default(),
        }
    }

    pub fn capacity(&self) -> usize {
        self.block_table.len() * BLOCK_SIZE
    }

    /// Forgets cached tokens past `len` (their KV slots are overwritten by later steps).
    pub fn truncate(&mut self, len: usize) {
        self.computed.truncate(len);
    }

    pub fn tokens(&self) -> &[u32] {
        &self.computed
    }

    /// Makes the cached tokens equal to `prompt`, reusing the longest common prefix already computed and
    /// computing the rest in chunks of `chunk` tokens. Returns the logits after the last prompt token.
    pub fn prefill(&mut self, prompt: &[u32], chunk: usize) -> Result<Vec<f32>> {
        if prompt.is_empty() {
            return Err(Error::InvalidRequest("empty prompt".into()));
        }
        self.check_room(prompt.len())?;
        let common = self.computed.iter().zip(prompt).take_while(|(a, b)| a == b).count();
        // The last prompt token is always recomputed so that it has logits.
        self.computed.truncate(common.min(prompt.len() - 1));
        let mut logits = Vec::new();
        while self.computed.len() < prompt.len() {
            let start = self.computed.len();
            let end = (start + chunk.max(1)).min(prompt.len());
            let wanted = if end == prompt.len() { LogitsWanted::Last } else { LogitsWanted::None };
            logits = self.step(&prompt[start..end], wanted)?.to_vec();
        }
        Ok(logits)
    }

    /// Appends one token and returns the logits for the next.
    pub fn decode(&mut self, token: u32) -> Result<&[f32]> {
        self.check_room(self.computed.len() + 1)?;
        self.step(&[token], LogitsWanted::Last)
    }

    /// Appends `tokens` and returns logits for every one of them (`[tokens.len(), vocab]`).
    pub fn forward_all(&mut self, tokens: &[u32]) -> Result<&[f32]> {
        self.check_room(self.computed.len() + tokens.len())?;
        self.step(tokens, LogitsWanted::All)
    }

    fn check_room(&self, needed: usize) -> Result<()> {
        if needed > self.capacity() {
            return Err(Error::InvalidRequest(format!(
                "sequence of {needed} tokens does not fit the context of {} tokens",
                self.capacity()
            )));
        }
        Ok(())
    }

    fn step(&mut self, tokens: &[u32], logits: LogitsWanted) -> Result<&[f32]> {
        let input = SeqInput { tokens, start_pos: self.computed.len(), block_table: &self.block_table, logits };
        let out = self.model.forward(&[input], &mut self.kv, &mut self.scratch)?;
        self.computed.extend_from_slice(tokens);
        Ok(out)
    }
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token was sampled (it is not part of the output).
    Stop,
    /// `max_new_tokens` were generated.
    Length,
    /// The context is full.
    ContextFull,
    /// The callback asked to stop.
    Cancelled,
}

impl Session<'_> {
    /// Prefills `prompt`, then samples up to `max_new_tokens`, calling `on_token` with each new token
    /// (return false to stop). Tokens in `stop_ids` end generation and are not passed on.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        max_new_tokens: usize,
        sampler: &mut crate::sampler::Sampler,
        stop_ids: &[u32],
        mut on_token: impl FnMut(u32) -> bool,
    ) -> Result<FinishReason> {
        let mut logits = self.prefill(prompt, 512)?;
        for i in 0..max_new_tokens {
            let token = sampler.sample(&logits, &self.computed);
            if stop_ids.contains(&token) {
                return Ok(FinishReason::Stop);
            }
            if !on_token(token) {
                return Ok(FinishReason::Cancelled);
            }
            if i + 1 == max_new_tokens {
                break;
            }
            if self.computed.len() + 1 > self.capacity() {
                return Ok(FinishReason::ContextFull);
            }
            logits = self.decode(token)?.to_vec();
        }
        Ok(FinishReason::Length)
    }
}

//! The draft model of speculative decoding (`--spec draft`, and `auto` with a draft model): its weights,
//! its keys and values (a storage of the target's number of blocks, indexed by the same block ids), and
//! its share of each step, run before the target's forward pass.

use crate::engine::{EngineConfig, ScheduledChunk, Scheduler, StepPlan};
use crate::kv::KvStorage;
use crate::model::{LogitsWanted, Model, Scratch, SeqInput};
use std::sync::Arc;
use std::time::Instant;

pub struct Drafter {
    model: Arc<Model>,
    kv: KvStorage,
    scratch: Scratch,
}

impl Drafter {
    /// A drafter for `target` with `config`'s KV cache; an error says why `model` cannot draft for it.
    pub fn new(model: Arc<Model>, target: &Model, config: &EngineConfig) -> Result<Drafter, String> {
        if model.config.vocab_size != target.config.vocab_size {
            return Err(format!("the draft model's vocabulary has {} tokens, the model's {}", model.config.vocab_size, target.config.vocab_size));
        }
        config.kv_dtypes.check_shape(model.config.head_dim, config.block_size).map_err(|e| format!("draft model: {e}"))?;
        let kv = model.new_kv_in(model.kv_layout(false), config.kv_dtypes, config.block_size, config.num_blocks);
        Ok(Drafter { model, kv, scratch: Scratch::default() })
    }

    /// The draft model's share of a step: one pass over every chunk's `draft_span` (catching up, through
    /// the newest token of requests it guesses for), then one pass per further guess over the requests
    /// still guessing; each guess is the draft's argmax. The guesses replace the requests' placeholders.
    /// Returns the seconds its passes took.
    pub fn run(&mut self, plan: &StepPlan, scheduler: &mut Scheduler) -> f64 {
        let d = self;
        let spans: Vec<&ScheduledChunk> = plan.chunks.iter().filter(|c| c.draft_span.is_some()).collect();
        if spans.is_empty() {
            return 0.0;
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
                SeqInput { tokens: &req.tokens[from..to], start_pos: from, block_tables: req.blocks.tables(), logits, state: None }
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
                    SeqInput { tokens: &g[j - 1..j], start_pos: c.start + j, block_tables: req.blocks.tables(), logits: LogitsWanted::Last, state: None }
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
        let mut total = 0.0;
        for (tokens, secs) in timings {
            scheduler.observe_draft_step(tokens, secs);
            total += secs;
        }
        total
    }
}

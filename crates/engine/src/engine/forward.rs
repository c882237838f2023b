//! The forward stage: the model over a step's chunks, through the paged KV. A chunk's tokens are its
//! request's next ones, or for a speculating chunk its newest token and its guesses; a sparsely
//! prefilled request's cells sit at their positions in the full prompt.

use super::{EngineConfig, Scheduler, StepPlan};
use crate::kv::KvStorage;
use crate::model::{LogitsWanted, Model, Scratch, SeqInput};

/// The logits of the plan's sampling chunks: one row per chunk that samples, `1 + draft` rows for a
/// speculating one, in plan order (`[rows, vocab]`).
/// `states`: each chunk's recurrent-state slot (a hybrid model's; None otherwise).
pub(super) fn run<'s>(model: &Model, config: &EngineConfig, plan: &StepPlan, scheduler: &Scheduler, states: &[Option<u32>], kv: &mut KvStorage, scratch: &'s mut Scratch) -> &'s [f32] {
    // a speculating chunk's tokens: its newest token, then its guesses
    let guessed: Vec<Vec<u32>> = plan
        .chunks
        .iter()
        .filter(|c| c.draft > 0)
        .map(|c| {
            let req = scheduler.request(c.id).expect("planned requests exist");
            let draft = &req.spec.as_ref().expect("a chunk with guesses speculates").draft;
            [&req.tokens[c.start..], &draft[..]].concat()
        })
        .collect();
    let mut guessed_iter = guessed.iter();
    let inputs: Vec<SeqInput> = plan
        .chunks
        .iter()
        .zip(states)
        .map(|(c, &state)| {
            let req = scheduler.request(c.id).expect("planned requests exist");
            let logits = match (c.samples, c.draft) {
                (false, _) => LogitsWanted::None,
                (true, 0) => LogitsWanted::Last,
                (true, _) => LogitsWanted::All,
            };
            let tokens = if c.draft > 0 { &guessed_iter.next().expect("one per speculating chunk")[..] } else { &req.tokens[c.start..c.start + c.len] };
            debug_assert_eq!(tokens.len(), c.len);
            SeqInput { tokens, start_pos: c.start, block_tables: req.blocks.tables(), logits, state }
        })
        .collect();
    // a sparsely prefilled request's cells sit at their positions in the full prompt
    let positions: Vec<Option<Vec<usize>>> = plan
        .chunks
        .iter()
        .map(|c| {
            let req = scheduler.request(c.id).expect("planned requests exist");
            req.sparse.as_ref().map(|s| (c.start..c.start + c.len).map(|i| s.position(i)).collect())
        })
        .collect();
    let positions: Vec<Option<&[usize]>> = positions.iter().map(|p| p.as_deref()).collect();
        model.forward_at(&inputs, &positions, config.attention(), kv, scratch)
}

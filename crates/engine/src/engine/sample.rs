//! The sample/constrain stage: each sampling chunk's token from its logits row, through its request's
//! sampler; a speculating chunk's guesses checked against its rows (`spec::verify`); a constrained
//! request's row masked by its grammar first, and the grammar advanced by the token. A grammar that
//! fails ends its request with an error (never unconstrained text presented as constrained). A request
//! whose reasoning budget is spent takes the tokens that close its reasoning (`engine::reasoning`).

use super::{spec, RequestId, Scheduler, StepPlan, TokenLogprobs};

/// The tokens a step gave the request `id`: one, or with speculation the kept guesses and the model's
/// next token.
pub(super) struct Sampled {
    pub id: RequestId,
    pub tokens: Vec<(u32, Option<TokenLogprobs>)>,
    /// The request's grammar failed: it ends with this error (no token) instead of going on unconstrained.
    pub error: Option<String>,
}

/// The stage's own state: a logits row with a grammar's mask applied.
#[derive(Default)]
pub(super) struct SampleStage {
    masked: Vec<f32>,
}

impl SampleStage {
    /// `logits` as `forward::run` returns them (`[rows, vocab]`); one `Sampled` per sampling chunk, in
    /// plan order.
    pub fn sample(&mut self, plan: &StepPlan, logits: &[f32], vocab: usize, scheduler: &mut Scheduler) -> Vec<Sampled> {
        let mut out = Vec::new();
        let mut row = 0;
        for c in plan.chunks.iter().filter(|c| c.samples) {
            let rows: Vec<&[f32]> = (row..row + 1 + c.draft).map(|r| &logits[r * vocab..(r + 1) * vocab]).collect();
            row += 1 + c.draft;
            let lg = rows[0];
            let req = scheduler.request_mut(c.id).expect("planned requests exist");
            if c.draft > 0 {
                let draft = std::mem::take(&mut req.spec.as_mut().expect("speculating").draft);
                let new = spec::verify(&mut req.sampler, &rows, &draft, &req.tokens);
                let logprobs = |i: usize, t: u32| req.logprobs.map(|k| token_logprobs(rows[i], t, k));
                let tokens = new.iter().enumerate().map(|(i, &t)| (t, logprobs(i, t))).collect();
                req.spec.as_mut().expect("speculating").draft = draft;
                out.push(Sampled { id: c.id, tokens, error: None });
                continue;
            }
            let forced = req.reasoning.as_ref().and_then(|r| r.forced());
            let token = match (req.constraint.as_mut(), forced) {
                (None, Some(token)) => token,
                (None, None) => req.sampler.sample(lg, &req.tokens),
                (Some(constraint), forced) => {
                    // the grammar's mask on a copy of the row. A grammar that fails (it should not: every
                    // token it is given was allowed by its own mask) ends the request with an error:
                    // text past it would not be held to the grammar, yet read as if it were.
                    self.masked.clear();
                    self.masked.extend_from_slice(lg);
                    let sampled = match constraint.mask(&mut self.masked) {
                        Ok(()) => {
                            // (a forced token the grammar does not allow fails the request below)
                            let token = forced.unwrap_or_else(|| req.sampler.sample(&self.masked, &req.tokens));
                            constraint.advance(token).map(|()| token).map_err(|e| format!("the grammar rejected token {token}: {e}"))
                        }
                        Err(e) => Err(format!("the grammar's mask failed: {e}")),
                    };
                    match sampled {
                        Ok(token) => token,
                        Err(e) => {
                            let generated = req.num_generated();
                            tracing::warn!(request = c.id, "constrained decoding failed after {generated} tokens, the request ends: {e}");
                            out.push(Sampled { id: c.id, tokens: Vec::new(), error: Some(format!("constrained decoding failed after {generated} tokens: {e}")) });
                            continue;
                        }
                    }
                }
            };
            if let Some(r) = req.reasoning.as_mut() {
                r.observe(token);
            }
            let logprobs = req.logprobs.map(|k| token_logprobs(lg, token, k));
            out.push(Sampled { id: c.id, tokens: vec![(token, logprobs)], error: None });
        }
        out
    }
}

/// Natural-log probabilities of `token` and of the `k` most likely tokens (ties by lower id).
fn token_logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    let lp = |l: f32| (l as f64 - lse) as f32;
    if k == 0 {
        return TokenLogprobs { logprob: lp(logits[token as usize]), top: Vec::new() };
    }
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(order.len());
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if k > 0 && k < order.len() {
        order.select_nth_unstable_by(k - 1, by_logit);
    }
    order.truncate(k);
    order.sort_unstable_by(by_logit);
    TokenLogprobs { logprob: lp(logits[token as usize]), top: order.into_iter().map(|t| (t, lp(logits[t as usize]))).collect() }
}

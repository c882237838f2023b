//! Speculative decoding: a proposer guesses a request's next tokens, the model checks them all in one step
//! (the request's chunk carries its newest token and the guesses, beside other requests' decodes and
//! prefill chunks), and the guesses the model agrees with are kept, plus the model's own next token.
//!
//! - **Proposers.** `ngram` (prompt lookup): the longest suffix of the sequence (`max_n` down to `min_n`
//!   tokens) that occurred before, in the sequence or in the client's prediction (OpenAI's `prediction`),
//!   proposes the up to `k` tokens that followed its latest occurrence. No weights, no tensors: the
//!   scheduler calls it. `draft`: a smaller model with the target's vocabulary decodes `k` tokens ahead
//!   greedily, with its own keys and values in the same paged pool (a second storage indexed by the
//!   request's block ids, as vLLM v1 gives a drafter's layers the target's block table). The scheduler
//!   plans what the draft model computes (`ScheduledChunk::draft_span`); the engine runs it before the
//!   target's step.
//! - **Verification** (`verify`): row i of the chunk's logits is the model's distribution after the
//!   newest token and guesses 0..i. Each row's token is drawn as decoding one token at a time would draw
//!   it (greedy: the argmax; with temperature, with the random number that position would use), and
//!   guess i is kept while it is that token; the first row where it is not gives its token instead, and
//!   if every guess is kept the last row gives one more. Both proposers' distributions are a point mass
//!   on their guess (the draft model's is its argmax), so this is Leviathan et al.'s rule: the output
//!   has exactly the target's distribution, and the same tokens as without speculation, greedy or
//!   seeded (both numerics give a token the same logits whatever else its step computes).
//! - **Rollback**: the cells of rejected guesses were written; `num_computed_tokens` stops after the kept
//!   ones, so they are overwritten later, blocks holding nothing kept are released, and the prefix cache
//!   only ever registers blocks of computed, kept tokens. The draft model's cells are valid up to the
//!   request's `SpecState::draft_computed`; a block records how many of its leading cells hold the
//!   draft's keys and values (`BlockPool::draft_cells`, reset when the block is handed out anew), so a
//!   prefix hit gives the draft model its share of the prefix too.

mod draft;

pub use draft::Drafter;

use crate::sampler::Sampler;

/// How a request speculates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpecConfig {
    /// Most tokens guessed per step.
    pub k: usize,
    /// Shortest and longest suffix the n-gram proposer matches.
    pub min_n: usize,
    pub max_n: usize,
    /// Carry only the guesses that pay (`Controller`): `--spec auto`. Otherwise every guess the
    /// proposer makes, up to `k`.
    pub auto: bool,
    /// The engine has a draft model: it proposes where the n-gram proposer finds nothing (`auto`), or
    /// always (not `auto`). Its keys and values follow every prompt chunk.
    pub draft: bool,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig { k: 4, min_n: 2, max_n: 4, auto: false, draft: false }
    }
}

/// A request's speculation: its configuration, the client's prediction, the guesses of the step in
/// flight and what was kept so far.
#[derive(Clone, Debug, Default)]
pub struct SpecState {
    pub config: SpecConfig,
    /// Tokens of the client's guess of the output (OpenAI's `prediction`), searched after the sequence.
    pub prediction: Vec<u32>,
    /// The guesses the scheduled chunk carries after the request's newest token.
    pub draft: Vec<u32>,
    /// Guesses proposed, and kept, over the request.
    pub drafted: usize,
    pub accepted: usize,
    /// Steps that carried guesses.
    pub drafts: usize,
    /// The step's guesses come from the draft model (the scheduler plans their number; the engine
    /// writes them into `draft` before the step).
    pub from_model: bool,
    /// Leading positions whose draft-model keys and values are written (with a draft model).
    pub draft_computed: usize,
    /// Per proposer (`[ngram, draft model]`), the request's acceptance as decayed counts
    /// (`SpecState::acceptance`): guesses kept, and guesses decided (kept, or the first rejected of a
    /// step).
    pub kept_w: [f64; 2],
    pub decided_w: [f64; 2],
}

impl SpecState {
    /// Records a step's outcome: `kept` of `drafted` guesses, from the draft model or not.
    pub fn record(&mut self, drafted: usize, kept: usize, from_model: bool) {
        self.drafts += 1;
        self.drafted += drafted;
        self.accepted += kept;
        // geometric model: each guess is kept with probability α once the one before it was; a step
        // decides its kept guesses and, if one was rejected, that one
        const DECAY: f64 = 0.8;
        let p = usize::from(from_model);
        self.kept_w[p] = DECAY * self.kept_w[p] + kept as f64;
        self.decided_w[p] = DECAY * self.decided_w[p] + (kept + usize::from(kept < drafted)) as f64;
    }

    /// α of a proposer (the draft model's, or the n-gram's): the chance that a guess is kept given the
    /// one before it was (a prior of one kept and one rejected guess before any step).
    pub fn acceptance(&self, from_model: bool) -> f64 {
        let p = usize::from(from_model);
        (self.kept_w[p] + 1.0) / (self.decided_w[p] + 2.0)
    }
}

/// The break-even controller of `--spec auto`: the engine's step time as a line in the step's tokens,
/// `T(n) = a + b·n`, fitted online (least squares over recent steps, older ones decayed), and per step the
/// guesses worth carrying. A guess that would be the (j+1)-th of a request with acceptance α adds an
/// expected α^(j+1) tokens and costs `b` seconds; the step's rate is (its expected tokens) / T. The
/// controller adds guesses, best first, while each one's tokens per second (α^(j+1) / b) beat the rate
/// of the step without it, so speculation stops when steps are already full of other requests' tokens
/// (T large against b), and for requests whose guesses are rarely kept.
#[derive(Clone, Debug, Default)]
pub struct Controller {
    // decayed sums for the fit: weight, x, y, x², xy
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
}

impl Controller {
    /// A step of `tokens` tokens took `secs`.
    pub fn observe(&mut self, tokens: usize, secs: f64) {
        if !secs.is_finite() || secs <= 0.0 {
            return;
        }
        const DECAY: f64 = 0.98;
        let x = tokens as f64;
        self.w = DECAY * self.w + 1.0;
        self.sx = DECAY * self.sx + x;
        self.sy = DECAY * self.sy + secs;
        self.sxx = DECAY * self.sxx + x * x;
        self.sxy = DECAY * self.sxy + x * secs;
    }

    /// `(a, b)` of `T(n) = a + b·n`, once steps of different sizes were seen; b at least a tiny fraction
    /// of a (a step never gets cheaper with more tokens).
    pub fn cost(&self) -> Option<(f64, f64)> {
        let var = self.w * self.sxx - self.sx * self.sx;
        if self.w < 2.0 || var <= 1e-9 * self.w * self.w {
            return None;
        }
        let b = (self.w * self.sxy - self.sx * self.sy) / var;
        let a = (self.sy - b * self.sx) / self.w;
        let a = a.max(1e-6);
        Some((a, b.max(a * 1e-4)))
    }

    /// The fitted time of a step of `tokens` tokens.
    pub fn time(&self, tokens: usize) -> Option<f64> {
        self.cost().map(|(a, b)| a + b * tokens as f64)
    }

    /// How many of its proposed guesses each request carries: `requests[i]` = (acceptance α, guesses
    /// proposed, seconds each guess costs before the step: the draft model's pass, 0 for the n-gram
    /// proposer); `base_tokens`: the step's tokens without guesses; `base_outputs`: tokens the step gives
    /// without guesses (its decodes). Before the step cost is known, every proposed guess.
    pub fn choose(&self, base_tokens: usize, base_outputs: usize, requests: &[(f64, usize, f64)]) -> Vec<usize> {
        let Some((a, b)) = self.cost() else { return requests.iter().map(|r| r.1).collect() };
        let mut take = vec![0; requests.len()];
        let (mut tokens, mut time) = (base_outputs as f64, a + b * base_tokens as f64);
        loop {
            // the next guess of each request: α^(j+1) expected tokens for b plus its drafting
            let best = (0..requests.len()).filter(|&i| take[i] < requests[i].1).map(|i| (i, requests[i].0.powi(take[i] as i32 + 1), b + requests[i].2)).max_by(|x, y| (x.1 / x.2).total_cmp(&(y.1 / y.2)));
            match best {
                Some((i, gain, cost)) if gain / cost > tokens / time => {
                    take[i] += 1;
                    tokens += gain;
                    time += cost;
                }
                _ => return take,
            }
        }
    }

    /// The expected tokens per second of a step carrying `take[i]` of request i's guesses (as `choose`
    /// gets them) over the same step without guesses: what the controller expects to gain. `None`
    /// before the step cost is known or without decodes.
    pub fn gain(&self, base_tokens: usize, base_outputs: usize, requests: &[(f64, usize, f64)], take: &[usize]) -> Option<f64> {
        let (a, b) = self.cost()?;
        if base_outputs == 0 {
            return None;
        }
        let base_time = a + b * base_tokens as f64;
        let (mut tokens, mut time) = (base_outputs as f64, base_time);
        for (r, &n) in requests.iter().zip(take) {
            tokens += (1..=n).map(|j| r.0.powi(j as i32)).sum::<f64>();
            time += n as f64 * (b + r.2);
        }
        Some((tokens / time) / (base_outputs as f64 / base_time))
    }
}

/// The n-gram proposal after `tokens`: the up to `k` tokens that followed the latest earlier occurrence
/// of the longest suffix (`max_n` down to `min_n` tokens) found in `tokens`, or what followed the
/// occurrence in `prediction` nearest position `generated` (the output's length so far); the longer of
/// the two proposals. Empty when nothing matches.
pub fn propose_ngram(tokens: &[u32], prediction: &[u32], generated: usize, c: &SpecConfig) -> Vec<u32> {
    if c.k == 0 {
        return Vec::new();
    }
    for n in (c.min_n.max(1)..=c.max_n).rev() {
        if n > tokens.len() {
            continue;
        }
        let suffix = &tokens[tokens.len() - n..];
        // the latest occurrence that ends before the suffix itself, in the sequence and in the
        // prediction; the longer proposal wins (the prediction's on a tie: the client's own guess)
        let after = |seq: &[u32], end: Option<usize>| end.map_or(Vec::new(), |end| seq[end..(end + c.k).min(seq.len())].to_vec());
        let ours = after(tokens, (n..tokens.len()).rev().find(|&end| &tokens[end - n..end] == suffix));
        // in the prediction, the occurrence nearest the output's own position (it guesses the output
        // from its start; the latest occurrence would skip ahead in a text that repeats itself)
        let near = (n..prediction.len()).filter(|&end| &prediction[end - n..end] == suffix).min_by_key(|&end| (end.abs_diff(generated), usize::MAX - end));
        let theirs = after(prediction, near);
        let best = if theirs.len() >= ours.len() { theirs } else { ours };
        if !best.is_empty() {
            return best;
        }
    }
    Vec::new()
}

/// Checks `draft` against the chunk's logit rows (`rows[i]`: after the newest token and `draft[..i]`;
/// `draft.len() + 1` rows). Returns the tokens to append: the kept guesses, then the model's own token.
/// `history` is the sequence so far (for penalties); `sample` draws a row's token when a row decides.
pub fn verify(sampler: &mut Sampler, rows: &[&[f32]], draft: &[u32], history: &[u32]) -> Vec<u32> {
    debug_assert_eq!(rows.len(), draft.len() + 1);
    let mut seq = history.to_vec();
    let mut out = Vec::with_capacity(draft.len() + 1);
    for (i, &guess) in draft.iter().enumerate() {
        match sampler.accept_or_resample(rows[i], &seq, guess) {
            None => {
                out.push(guess);
                seq.push(guess);
            }
            Some(token) => {
                out.push(token);
                return out;
            }
        }
    }
    out.push(sampler.sample(rows[draft.len()], &seq));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::SamplingParams;

    fn c(k: usize) -> SpecConfig {
        SpecConfig { k, min_n: 2, max_n: 3, auto: false, draft: false }
    }

    #[test]
    fn the_controller_fits_the_step_cost_and_guesses_only_where_it_pays() {
        let mut ctl = Controller::default();
        assert_eq!(ctl.choose(1, 1, &[(0.9, 4, 0.0)]), vec![4], "no cost model yet: every guess");
        // a memory-bound step: 10 ms, and 0.5 ms per token
        for n in [1, 1, 5, 9, 1, 64, 512, 3] {
            ctl.observe(n, 0.010 + 0.0005 * n as f64);
        }
        let (a, b) = ctl.cost().unwrap();
        assert!((a - 0.010).abs() < 1e-9 && (b - 0.0005).abs() < 1e-9, "{a} {b}");
        // one stream: guesses that are usually kept pay, up to the proposal
        assert_eq!(ctl.choose(1, 1, &[(0.9, 4, 0.0)]), vec![4]);
        // ones that are rarely kept do not: 0.02 tokens for 0.5 ms, against 1 token per 10.5 ms
        assert_eq!(ctl.choose(1, 1, &[(0.02, 4, 0.0)]), vec![0]);
        // in a step already full of prefill tokens (512 of them: 266 ms for one token), even good
        // guesses pay: they cost 0.5 ms each against a rate of 1 token per 266 ms
        assert_eq!(ctl.choose(513, 1, &[(0.5, 4, 0.0)]), vec![4]);
        // eight streams at α 0.5: each first guess (0.5 tokens for 0.5 ms) beats the step's rate (8 tokens
        // per 14 ms); the fourth (0.0625 tokens) does not
        let got = ctl.choose(8, 8, &[(0.5, 4, 0.0); 8]);
        assert!(got.iter().all(|&k| (1..4).contains(&k)), "{got:?}");
        // a compute-bound step (each token costs as much as the step's fixed part) never pays
        let mut busy = Controller::default();
        for n in [1, 2, 8, 16] {
            busy.observe(n, 0.001 + 0.01 * n as f64);
        }
        assert_eq!(busy.choose(8, 8, &[(0.6, 4, 0.0); 8]), vec![0; 8]);
        // a draft model whose pass costs a third of the target's step (3.5 ms): at α 0.8 two guesses pay
        // (the third, 0.51 tokens for 4 ms, not against 2.44 per 18.5 ms), at α 0.6 one (0.6 tokens for
        // 4 ms against 1 per 10.5 ms), at α 0.3 none
        assert_eq!(ctl.choose(1, 1, &[(0.8, 4, 0.0035)]), vec![2]);
        assert_eq!(ctl.choose(1, 1, &[(0.6, 4, 0.0035)]), vec![1]);
        assert_eq!(ctl.choose(1, 1, &[(0.3, 4, 0.0035)]), vec![0]);
        // the gain it expects: 1.8 tokens in 14.5 ms against 1 in 10.5 ms
        let g = ctl.gain(1, 1, &[(0.8, 4, 0.0035)], &[1]).unwrap();
        assert!((g - 1.8 / 0.0145 * 0.0105).abs() < 1e-9, "{g}");
        assert_eq!(ctl.gain(1, 1, &[(0.8, 4, 0.0035)], &[0]), Some(1.0));
    }

    #[test]
    fn acceptance_follows_the_kept_guesses() {
        let mut s = SpecState::default();
        assert_eq!(s.acceptance(false), 0.5);
        for _ in 0..10 {
            s.record(4, 4, false);
        }
        assert!(s.acceptance(false) > 0.9, "{}", s.acceptance(false));
        // the draft model's guesses are counted apart
        assert_eq!(s.acceptance(true), 0.5);
        // a rejected first guess decides one guess: twenty such steps (about five, decayed) bring α
        // down to where the prior still holds it
        for _ in 0..20 {
            s.record(4, 0, false);
        }
        assert!(s.acceptance(false) < 0.2, "{}", s.acceptance(false));
        assert_eq!((s.drafts, s.drafted, s.accepted), (30, 120, 40));
    }

    #[test]
    fn the_longest_suffix_seen_before_proposes_what_followed_it() {
        // ... 1 2 3 [9 8 7] ... 1 2 3 -> 9 8 7
        let t = [5, 1, 2, 3, 9, 8, 7, 6, 1, 2, 3];
        assert_eq!(propose_ngram(&t, &[], 0, &c(3)), vec![9, 8, 7]);
        assert_eq!(propose_ngram(&t, &[], 0, &c(2)), vec![9, 8]);
        // the latest occurrence wins
        let t = [2, 3, 4, 2, 3, 5, 2, 3];
        assert_eq!(propose_ngram(&t, &[], 0, &c(1)), vec![5]);
        // a proposal stops at the end of the sequence
        let t = [4, 4, 4];
        assert_eq!(propose_ngram(&t, &[], 0, &c(5)), vec![4]);
        // nothing matches
        assert!(propose_ngram(&[1, 2, 3, 4], &[], 0, &c(4)).is_empty());
        assert!(propose_ngram(&[1, 2, 3, 1, 2], &[], 0, &c(0)).is_empty());
    }

    #[test]
    fn the_prediction_is_searched_too_and_the_longer_proposal_wins() {
        let prediction = [10, 11, 12, 13, 14];
        assert_eq!(propose_ngram(&[1, 11, 12], &prediction, 2, &c(2)), vec![13, 14]);
        // the prediction's end proposes nothing
        assert!(propose_ngram(&[1, 13, 14], &prediction, 2, &c(2)).is_empty());
        // the sequence's own match runs into its end (two tokens); the prediction's gives three
        assert_eq!(propose_ngram(&[5, 11, 12, 11, 12], &[10, 11, 12, 13, 14, 15], 3, &c(3)), vec![13, 14, 15]);
        // on a tie, the prediction's; in a prediction that repeats itself, the occurrence nearest the
        // output's position
        assert_eq!(propose_ngram(&[9, 1, 2], &[1, 2, 3, 1, 2, 4, 1, 2, 5], 2, &c(1)), vec![3]);
        assert_eq!(propose_ngram(&[9, 1, 2, 3, 1, 2], &[1, 2, 3, 1, 2, 4, 1, 2, 5], 5, &c(1)), vec![4]);
        assert_eq!(propose_ngram(&[5, 11, 12, 11, 12], &prediction, 3, &c(3)), vec![13, 14]);
        assert_eq!(propose_ngram(&[11, 12, 9, 7, 6, 11, 12], &[], 0, &c(3)), vec![9, 7, 6]);
    }

    #[test]
    fn greedy_verification_keeps_the_agreeing_prefix_and_adds_the_models_token() {
        let mut s = Sampler::new(SamplingParams::greedy());
        let row = |best: usize| -> Vec<f32> { (0..8).map(|i| if i == best { 1.0 } else { 0.0 }).collect() };
        let rows = [row(3), row(4), row(6), row(7)];
        let rows: Vec<&[f32]> = rows.iter().map(|r| &r[..]).collect();
        assert_eq!(verify(&mut s, &rows, &[3, 4, 5], &[1]), vec![3, 4, 6]);
        assert_eq!(verify(&mut s, &rows, &[3, 4, 6], &[1]), vec![3, 4, 6, 7]);
        assert_eq!(verify(&mut s, &rows[..1], &[], &[1]), vec![3]);
        assert_eq!(verify(&mut s, &rows[..2], &[2], &[1]), vec![3]);
    }
}

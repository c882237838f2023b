//! A cap on an answer's reasoning (Anthropic's `thinking.budget_tokens`): the tokens generated inside
//! the model's reasoning block are counted, and once the budget is spent the block's closing tokens are
//! forced, so the answer begins there instead of the model reasoning on. The sample stage asks which
//! token is forced (`forced`) and reports every token it gives (`observe`); a request with a budget does
//! not speculate (a forced token is no guess to verify).

use std::collections::VecDeque;

/// What a request asks: at most `tokens` inside the block that `open` begins and `close` ends (token
/// ids, as the model's tokenizer writes `<think>` and `</think>`); `starts_inside` when the prompt
/// already opened it (templates whose generation prompt ends with `<think>`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReasoningBudget {
    pub tokens: usize,
    pub open: Vec<u32>,
    pub close: Vec<u32>,
    pub starts_inside: bool,
}

/// A request's progress against its budget.
#[derive(Clone, Debug)]
pub struct ReasoningState {
    budget: ReasoningBudget,
    inside: bool,
    /// Tokens generated inside the block so far (the closing tokens not counted).
    spent: usize,
    /// Closing tokens forced so far; `Some` once the budget is spent and the block not yet closed.
    forcing: Option<usize>,
    /// The last tokens generated, enough to see `open` or `close` end among them.
    recent: VecDeque<u32>,
}

impl ReasoningState {
    pub fn new(budget: ReasoningBudget) -> Self {
        ReasoningState { inside: budget.starts_inside, spent: 0, forcing: None, recent: VecDeque::new(), budget }
    }

    /// The token the answer must take next, if the budget is spent mid-block.
    pub fn forced(&self) -> Option<u32> {
        match self.forcing {
            Some(i) => self.budget.close.get(i).copied(),
            None if self.inside && self.spent >= self.budget.tokens => self.budget.close.first().copied(),
            None => None,
        }
    }

    /// Records the token the answer took.
    pub fn observe(&mut self, token: u32) {
        let window = self.budget.open.len().max(self.budget.close.len()).max(1);
        self.recent.push_back(token);
        while self.recent.len() > window {
            self.recent.pop_front();
        }
        let ends_with = |seq: &[u32]| !seq.is_empty() && self.recent.len() >= seq.len() && self.recent.iter().skip(self.recent.len() - seq.len()).eq(seq.iter());
        if self.inside {
            if self.forcing.is_none() && self.spent >= self.budget.tokens {
                self.forcing = Some(0);
            }
            match &mut self.forcing {
                Some(i) => *i += 1,
                None => self.spent += 1,
            }
            let closed_by_force = self.forcing.is_some_and(|i| i >= self.budget.close.len());
            if ends_with(&self.budget.close) || closed_by_force {
                self.inside = false;
                self.forcing = None;
            }
        } else if ends_with(&self.budget.open) {
            self.inside = true;
        }
    }

    /// Tokens spent inside the block so far.
    pub fn spent(&self) -> usize {
        self.spent
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OPEN: u32 = 100;
    const CLOSE: [u32; 2] = [101, 102];

    fn budget(tokens: usize, starts_inside: bool) -> ReasoningState {
        ReasoningState::new(ReasoningBudget { tokens, open: vec![OPEN], close: CLOSE.to_vec(), starts_inside })
    }

    /// Runs a model that would reason for ever (token 7), taking the forced tokens: the tokens given.
    fn run(mut s: ReasoningState, prefix: &[u32], n: usize) -> Vec<u32> {
        let mut out = prefix.to_vec();
        for &t in prefix {
            s.observe(t);
        }
        while out.len() < n {
            let t = s.forced().unwrap_or(7);
            s.observe(t);
            out.push(t);
        }
        out
    }

    #[test]
    fn the_block_is_closed_when_the_budget_is_spent() {
        assert_eq!(run(budget(3, true), &[], 8), vec![7, 7, 7, 101, 102, 7, 7, 7]);
        // a block the model opens itself counts from its open
        assert_eq!(run(budget(2, false), &[5, OPEN], 8), vec![5, OPEN, 7, 7, 101, 102, 7, 7]);
        // outside a block nothing is forced
        assert_eq!(run(budget(0, false), &[], 4), vec![7, 7, 7, 7]);
        // a zero budget closes at once
        assert_eq!(run(budget(0, true), &[], 4), vec![101, 102, 7, 7]);
    }

    #[test]
    fn a_block_the_model_closes_itself_within_budget_is_left_alone() {
        let mut s = budget(5, true);
        for t in [7, 7, 101, 102] {
            assert_eq!(s.forced(), None);
            s.observe(t);
        }
        assert_eq!(s.spent(), 4);
        for _ in 0..10 {
            assert_eq!(s.forced(), None);
            s.observe(7);
        }
        // a second block has what is left of the budget: spent counts across blocks
        s.observe(OPEN);
        assert_eq!(s.forced(), None);
        s.observe(7);
        assert_eq!(s.forced(), Some(101));
    }
}

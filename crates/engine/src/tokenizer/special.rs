//! Splitting raw text on special-token texts before tokenization (llama.cpp's `tokenizer_st_partition`).
//!
//! llama.cpp takes the special tokens (CONTROL, USER_DEFINED, UNKNOWN) longest text first, and for each
//! one splits every still-raw fragment at all its non-overlapping occurrences, left to right. So a longer
//! token wins anywhere in the text, not just at the same position. CONTROL and UNKNOWN tokens take part
//! only when special tokens are parsed; USER_DEFINED ones always do. A byte trie finds which special
//! tokens occur at all, so the (up to thousands of) absent ones cost nothing.

use super::vocab::{Vocab, ATTR_CONTROL, ATTR_UNKNOWN, ATTR_USER_DEFINED};
use std::ops::Range;

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Fragment {
    Text(Range<usize>),
    Token(u32),
}

struct Node {
    children: Vec<(u8, u32)>,
    /// Position in `order` of the token ending here, or u32::MAX.
    rank: u32,
}

pub(crate) struct SpecialMatcher {
    /// Special token ids, longest text first (ties by id).
    order: Vec<u32>,
    nodes: Vec<Node>,
}

impl SpecialMatcher {
    pub(crate) fn new(vocab: &Vocab) -> SpecialMatcher {
        let mut order: Vec<u32> = (0..vocab.len() as u32)
            .filter(|&id| vocab.attrs[id as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
            .collect();
        order.sort_by_key(|&id| std::cmp::Reverse(vocab.text(id as usize).len()));
        let mut m = SpecialMatcher { order, nodes: vec![Node { children: Vec::new(), rank: u32::MAX }] };
        for rank in 0..m.order.len() {
            let text = vocab.text(m.order[rank] as usize).as_bytes();
            let mut node = 0usize;
            for &b in text {
                node = match m.nodes[node].children.iter().find(|&&(c, _)| c == b) {
                    Some(&(_, child)) => child as usize,
                    None => {
                        m.nodes.push(Node { children: Vec::new(), rank: u32::MAX });
                        let child = m.nodes.len() - 1;
                        m.nodes[node].children.push((b, child as u32));
                        child
                    }
                };
            }
            m.nodes[node].rank = m.nodes[node].rank.min(rank as u32);
        }
        m
    }

    /// Ranks of the special tokens that occur somewhere in `text`, ascending.
    fn present(&self, text: &[u8]) -> Vec<u32> {
        let mut found = Vec::new();
        for start in 0..text.len() {
            let mut node = 0usize;
            for &b in &text[start..] {
                match self.nodes[node].children.iter().find(|&&(c, _)| c == b) {
                    Some(&(_, child)) => node = child as usize,
                    None => break,
                }
                if self.nodes[node].rank != u32::MAX {
                    found.push(self.nodes[node].rank);
                }
            }
        }
        found.sort_unstable();
        found.dedup();
        found
    }

    pub(crate) fn partition(&self, vocab: &Vocab, text: &str, parse_special: bool) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut frags = vec![Fragment::Text(0..text.len())];
        for rank in self.present(text.as_bytes()) {
            let id = self.order[rank as usize];
            if !parse_special && vocab.attrs[id as usize] & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                continue;
            }
            let needle = vocab.text(id as usize);
            let mut out = Vec::with_capacity(frags.len() + 2);
            for f in frags {
                let Fragment::Text(range) = f else {
                    out.push(f);
                    continue;
                };
                let mut pos = range.start;
                while let Some(i) = text[pos..range.end].find(needle) {
                    if i > 0 {
                        out.push(Fragment::Text(pos..pos + i));
                    }
                    out.push(Fragment::Token(id));
                    pos += i + needle.len();
                }
                if pos < range.end {
                    out.push(Fragment::Text(pos..range.end));
                }
            }
            frags = out;
        }
        frags
    }
}

//! SentencePiece-style BPE over scores (llama.cpp's `llm_tokenizer_spm`): the text (spaces already escaped
//! to U+2581) is split into UTF-8 chars, then the adjacent pair whose concatenation is a token with the
//! highest score is merged, repeatedly (ties: leftmost). Symbols that are not tokens fall back to their
//! bytes as `<0xXX>` tokens.

use super::vocab::Vocab;
use crate::error::{Error, Result};
use std::cmp::Ordering;
use std::collections::BinaryHeap;

const NONE: usize = usize::MAX;

struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

// Max-heap order: higher score first; on equal scores the smaller left index first.
impl Ord for Bigram {
    fn cmp(&self, other: &Self) -> Ordering {
        if self.score < other.score {
            Ordering::Less
        } else if self.score > other.score {
            Ordering::Greater
        } else {
            other.left.cmp(&self.left)
        }
    }
}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}

struct Sym {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

/// Byte-fallback ids: `<0xXX>`, else the byte itself as a one-char token (ASCII only).
pub(crate) fn byte_tokens(vocab: &Vocab) -> Vec<Option<u32>> {
    (0..=255u8)
        .map(|b| {
            vocab.id(&format!("<0x{b:02X}>")).or_else(|| {
                if b.is_ascii() {
                    vocab.id(&(b as char).to_string())
                } else {
                    None
                }
            })
        })
        .collect()
}

/// Appends the tokens of `text` (already escaped) to `out`.
pub(crate) fn encode(vocab: &Vocab, bytes: &[Option<u32>], text: &str, out: &mut Vec<u32>) -> Result<()> {
    let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
    for (i, (start, c)) in text.char_indices().enumerate() {
        syms.push(Sym { start, len: c.len_utf8(), prev: i.wrapping_sub(1), next: i + 1 });
    }
    let Some(last) = syms.last_mut() else { return Ok(()) };
    last.next = NONE;

    let mut heap = BinaryHeap::with_capacity(syms.len());
    let try_add = |heap: &mut BinaryHeap<Bigram>, syms: &[Sym], left: usize, right: usize| {
        if left == NONE || right == NONE {
            return;
        }
        let size = syms[left].len + syms[right].len;
        let start = syms[left].start;
        if let Some(id) = vocab.id(&text[start..start + size]) {
            heap.push(Bigram { score: vocab.scores[id as usize], left, right, size });
        }
    };
    for i in 1..syms.len() {
        try_add(&mut heap, &syms, i - 1, i);
    }
    while let Some(b) = heap.pop() {
        let (l, r) = (b.left, b.right);
        // Stale if either side was merged away or grew since the pair was queued.
        if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != b.size {
            continue;
        }
        syms[l].len = b.size;
        syms[r].len = 0;
        let next = syms[r].next;
        syms[l].next = next;
        if next != NONE {
            syms[next].prev = l;
        }
        let prev = syms[l].prev;
        try_add(&mut heap, &syms, prev, l);
        try_add(&mut heap, &syms, l, next);
    }

    let mut i = 0;
    while i != NONE {
        let s = &syms[i];
        let piece = &text[s.start..s.start + s.len];
        match vocab.id(piece) {
            Some(id) => out.push(id),
            None => {
                for b in piece.bytes() {
                    let id = bytes[b as usize]
                        .ok_or_else(|| Error::Tokenizer(format!("no byte-fallback token for byte 0x{b:02X}")))?;
                    out.push(id);
                }
            }
        }
        i = s.next;
    }
    Ok(())
}

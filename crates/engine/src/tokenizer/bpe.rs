//! Byte-level BPE (GPT-2 style): each pre-tokenized word is mapped through the GPT-2 byte alphabet, split
//! into chars, and adjacent pairs are merged lowest merge rank first (ties: leftmost), as llama.cpp's
//! `llm_tokenizer_bpe_session` does with its priority queue.

use super::table::PairMap;
use super::unicode::ByteAlphabet;
use super::vocab::Vocab;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

type ExtraMap = HashMap<Box<str>, u32>;

const NONE: u32 = u32::MAX;

fn pair(a: u32, b: u32) -> u64 {
    (a as u64) << 32 | b as u64
}

/// Merge ranks keyed by the ids of the two pieces. Pieces are vocabulary tokens, or (rarely) strings that
/// appear in a merge without being tokens, which get ids from `n_vocab` upwards.
pub(crate) struct BpeMerges {
    ranks: PairMap,
    extra: ExtraMap,
    n_vocab: u32,
}

impl BpeMerges {
    /// `merges` are "left right" strings in rank order; like llama.cpp the split is at the first space
    /// after the first byte, and the first occurrence of a pair keeps its rank.
    pub(crate) fn new(merges: &[&str], vocab: &Vocab) -> BpeMerges {
        let n_vocab = vocab.len() as u32;
        let mut m = BpeMerges { ranks: PairMap::with_capacity(merges.len()), extra: ExtraMap::new(), n_vocab };
        for (rank, merge) in merges.iter().enumerate() {
            let space = merge.bytes().skip(1).position(|b| b == b' ').map(|i| i + 1);
            let (left, right) = match space {
                Some(i) => (&merge[..i], &merge[i + 1..]),
                None => ("", ""),
            };
            let key = pair(m.intern(left, vocab), m.intern(right, vocab));
            m.ranks.insert_first(key, rank as u32);
        }
        m
    }

    fn intern(&mut self, s: &str, vocab: &Vocab) -> u32 {
        if let Some(id) = vocab.id(s) {
            return id;
        }
        let next = self.n_vocab + self.extra.len() as u32;
        *self.extra.entry(s.into()).or_insert(next)
    }

    fn piece(&self, s: &str, vocab: &Vocab) -> u32 {
        vocab.id(s).or_else(|| self.extra.get(s).copied()).unwrap_or(NONE)
    }

    fn rank(&self, a: u32, b: u32) -> Option<u32> {
        if a == NONE || b == NONE {
            return None;
        }
        self.ranks.get(pair(a, b))
    }

    /// Appends the tokens of one word (raw UTF-8; the byte alphabet is applied here).
    pub(crate) fn encode_word(&self, word: &str, vocab: &Vocab, ignore_merges: bool, out: &mut Vec<u32>) {
        let alphabet = ByteAlphabet::get();
        let encoded: String = word.bytes().map(|b| alphabet.encode(b)).collect();
        if ignore_merges {
            if let Some(id) = vocab.id(&encoded) {
                out.push(id);
                return;
            }
        }
        self.merge(&encoded, vocab, out);
    }

    fn merge(&self, word: &str, vocab: &Vocab, out: &mut Vec<u32>) {
        struct Sym {
            start: usize,
            len: usize,
            prev: usize,
            next: usize,
            piece: u32,
        }
        let mut syms: Vec<Sym> = Vec::with_capacity(word.len());
        for (i, (start, c)) in word.char_indices().enumerate() {
            let len = c.len_utf8();
            syms.push(Sym {
                start,
                len,
                prev: i.wrapping_sub(1),
                next: i + 1,
                piece: self.piece(&word[start..start + len], vocab),
            });
        }
        if let Some(last) = syms.last_mut() {
            last.next = usize::MAX;
        }
        // (rank, left, right, left len, right len); Reverse makes it a min-heap: lowest rank, then leftmost.
        let mut heap = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<_>, syms: &[Sym], l: usize, r: usize| {
            if l == usize::MAX || r == usize::MAX {
                return;
            }
            if let Some(rank) = self.rank(syms[l].piece, syms[r].piece) {
                heap.push(Reverse((rank, l, r, syms[l].len, syms[r].len)));
            }
        };
        for i in 1..syms.len() {
            push(&mut heap, &syms, i - 1, i);
        }
        while let Some(Reverse((_, l, r, llen, rlen))) = heap.pop() {
            // Stale if either side has changed since the pair was queued.
            if syms[l].len == 0 || syms[r].len == 0 || syms[l].len != llen || syms[r].len != rlen {
                continue;
            }
            let merged_len = llen + rlen;
            syms[l].len = merged_len;
            syms[l].piece = self.piece(&word[syms[l].start..syms[l].start + merged_len], vocab);
            syms[r].len = 0;
            let next = syms[r].next;
            syms[l].next = next;
            if next != usize::MAX {
                syms[next].prev = l;
            }
            let prev = syms[l].prev;
            push(&mut heap, &syms, prev, l);
            push(&mut heap, &syms, l, next);
        }
        for s in syms.iter().filter(|s| s.len > 0) {
            if s.piece < self.n_vocab {
                out.push(s.piece);
                continue;
            }
            // Not a token: llama.cpp looks each byte up as a one-byte string; only ASCII can be found.
            for b in word[s.start..s.start + s.len].bytes().filter(u8::is_ascii) {
                if let Some(id) = vocab.id(std::str::from_utf8(&[b]).unwrap()) {
                    out.push(id);
                }
            }
        }
    }
}

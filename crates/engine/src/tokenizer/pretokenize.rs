//! Pre-tokenization for byte-level BPE: splitting text into words before merges, per `tokenizer.ggml.pre`.
//!
//! llama.cpp runs a list of regexes in sequence; each one splits every piece produced by the previous one
//! into its matches *and* the unmatched gaps between them. The GPT-2 and LLaMA-3 regexes have hand-written
//! matchers in llama.cpp (`unicode_regex_split_custom_*`), which are not exactly the regexes they name; the
//! rest go through std::regex on a "collapsed" text where every non-ASCII codepoint becomes one byte that
//! stands for its class. Both are reproduced here as small hand-written matchers over codepoint classes.

use super::unicode::{class, is_number, is_punctuation, Class};
use std::ops::Range;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PreTokenizer {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)` (llama.cpp's custom matcher).
    Gpt2,
    /// `\p{N}` (each digit alone), then GPT-2. starcoder, smollm, refact, command-r, ...
    DigitsThenGpt2,
    /// The LLaMA-3 regex with single digits (`\p{N}`): qwen2, stablelm2, ...
    Qwen2,
    /// The LLaMA-3 regex (`\p{N}{1,3}`).
    Llama3,
    /// llama.cpp's fallback list: punctuation runs, GPT-2, number runs, ASCII digit triples.
    Default,
}

/// One regex of the list, as a matcher.
#[derive(Clone, Copy)]
enum Stage {
    Gpt2,
    /// llama3-style matcher, with numbers grouped by at most this many digits.
    Llama3 {
        max_digits: usize,
    },
    /// `X` for a class predicate: each matching char is its own piece.
    Each(fn(char) -> bool),
    /// `X+`: maximal runs.
    Runs(fn(char) -> bool),
    /// `[0-9][0-9][0-9]`.
    AsciiTriples,
}

fn punct_or_symbol(c: char) -> bool {
    is_punctuation(c) || "$+<=>^~|".contains(c)
}

impl PreTokenizer {
    /// The pre-tokenizer for a `tokenizer.ggml.pre` name, with whether llama.cpp sets `ignore_merges` and
    /// whether it turns on `add_bos` by default for it. None for names llama.cpp knows that are not implemented.
    pub(crate) fn from_name(pre: &str) -> Option<(PreTokenizer, bool, bool)> {
        Some(match pre {
            "" | "default" => (PreTokenizer::Default, false, false),
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
            | "jina-v5-nano" => (PreTokenizer::Llama3, true, true),
            "dbrx" | "smaug-bpe" => (PreTokenizer::Llama3, false, false),
            "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "a.x-4.0"
            | "mellum" | "modern-bert" | "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" | "exaone4"
            | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" => (PreTokenizer::Gpt2, false, false),
            "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
                (PreTokenizer::DigitsThenGpt2, false, false)
            }
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan" | "solar-open" => {
                (PreTokenizer::Qwen2, false, false)
            }
            _ => return None,
        })
    }

    fn stages(self) -> &'static [Stage] {
        match self {
            PreTokenizer::Gpt2 => &[Stage::Gpt2],
            PreTokenizer::DigitsThenGpt2 => &[Stage::Each(is_number), Stage::Gpt2],
            PreTokenizer::Qwen2 => &[Stage::Llama3 { max_digits: 1 }],
            PreTokenizer::Llama3 => &[Stage::Llama3 { max_digits: 3 }],
            PreTokenizer::Default => {
                &[Stage::Runs(punct_or_symbol), Stage::Gpt2, Stage::Runs(is_number), Stage::AsciiTriples]
            }
        }
    }

    /// Splits `text` into words, returned as byte ranges that cover `text` in order.
    pub(crate) fn split(self, text: &str) -> Vec<Range<usize>> {
        let mut offsets: Vec<usize> = text.char_indices().map(|(i, _)| i).collect();
        let cps: Vec<char> = text.chars().collect();
        offsets.push(text.len());
        let cls: Vec<Class> = cps.iter().map(|&c| class(c)).collect();
        let mut pieces = vec![(0, cps.len())];
        if cps.is_empty() {
            return Vec::new();
        }
        for &stage in self.stages() {
            let mut out = Vec::with_capacity(pieces.len() * 2);
            for &(a, b) in &pieces {
                let mut cut = Cutter { out: &mut out, prev: a };
                let t = Text { cps: &cps, cls: &cls, end: b };
                match stage {
                    Stage::Gpt2 => t.gpt2(a, &mut cut),
                    Stage::Llama3 { max_digits } => t.llama3(a, max_digits, &mut cut),
                    Stage::Each(pred) => t.each(a, pred, &mut cut),
                    Stage::Runs(pred) => t.runs(a, pred, &mut cut),
                    Stage::AsciiTriples => t.ascii_triples(a, &mut cut),
                }
                cut.to(b); // whatever no match covered stays a piece of its own
            }
            pieces = out;
        }
        pieces.into_iter().map(|(a, b)| offsets[a]..offsets[b]).collect()
    }
}

/// Collects pieces: each `to(end)` closes the piece that began where the previous one ended.
struct Cutter<'a> {
    out: &'a mut Vec<(usize, usize)>,
    prev: usize,
}

impl Cutter<'_> {
    fn to(&mut self, end: usize) {
        if end > self.prev {
            self.out.push((self.prev, end));
        }
        self.prev = end;
    }
}

/// One piece under a matcher: positions at or past `end` are out of range.
struct Text<'a> {
    cps: &'a [char],
    cls: &'a [Class],
    end: usize,
}

impl Text<'_> {
    fn class_at(&self, p: usize) -> Option<Class> {
        (p < self.end).then(|| self.cls[p])
    }

    fn is(&self, p: usize, c: Class) -> bool {
        self.class_at(p) == Some(c)
    }

    fn is_newline(&self, p: usize) -> bool {
        p < self.end && matches!(self.cps[p], '\r' | '\n')
    }

    /// `'s|'t|'re|'ve|'m|'ll|'d` at `pos` (ASCII-case-insensitive if `fold`): the length matched, or 0.
    fn contraction(&self, pos: usize, fold: bool) -> usize {
        if self.cps[pos] != '\'' || pos + 1 >= self.end {
            return 0;
        }
        let low = |c: char| if fold { c.to_ascii_lowercase() } else { c };
        let n = low(self.cps[pos + 1]);
        if matches!(n, 's' | 't' | 'm' | 'd') {
            return 2;
        }
        if pos + 2 < self.end {
            let nn = low(self.cps[pos + 2]);
            if matches!((n, nn), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                return 3;
            }
        }
        0
    }

    /// The white-space tail shared by both matchers: `\s*[\r\n]+` (if `newlines`), `\s+(?!\S)`, `\s+`,
    /// and finally a lone char when nothing matched. Returns the new position.
    fn whitespace(&self, pos: usize, newlines: bool) -> usize {
        let mut n = 0;
        let mut last_newline = None;
        while self.is(pos + n, Class::Space) {
            if newlines && self.is_newline(pos + n) {
                last_newline = Some(pos + n + 1);
            }
            n += 1;
        }
        if let Some(end) = last_newline {
            end
        } else if n > 1 && pos + n < self.end {
            pos + n - 1
        } else if n > 0 {
            pos + n
        } else {
            pos + 1
        }
    }

    fn gpt2(&self, mut pos: usize, cut: &mut Cutter) {
        while pos < self.end {
            let c = self.cps[pos];
            let k = self.contraction(pos, false);
            if k > 0 {
                pos += k;
                cut.to(pos);
                continue;
            }
            // <space>?\p{L}+ | <space>?\p{N}+ | <space>?[^\s\p{L}\p{N}]+
            let lead = if c == ' ' { self.class_at(pos + 1) } else { self.class_at(pos) };
            if let Some(run @ (Class::Letter | Class::Number | Class::Other)) = lead {
                pos += (c == ' ') as usize;
                while self.is(pos, run) {
                    pos += 1;
                }
                cut.to(pos);
                continue;
            }
            pos = self.whitespace(pos, false);
            cut.to(pos);
        }
    }

    fn llama3(&self, mut pos: usize, max_digits: usize, cut: &mut Cutter) {
        while pos < self.end {
            let c = self.cps[pos];
            let f = self.cls[pos];
            let k = self.contraction(pos, true);
            if k > 0 {
                pos += k;
                cut.to(pos);
                continue;
            }
            // [^\r\n\p{L}\p{N}]?\p{L}+
            if !(c == '\r' || c == '\n' || f == Class::Number)
                && (f == Class::Letter || self.is(pos + 1, Class::Letter))
            {
                pos += 1;
                while self.is(pos, Class::Letter) {
                    pos += 1;
                }
                cut.to(pos);
                continue;
            }
            // \p{N}{1,max_digits}
            if f == Class::Number {
                let mut start = pos;
                while self.is(pos, Class::Number) {
                    pos += 1;
                    if pos - start >= max_digits {
                        cut.to(pos);
                        start = pos;
                    }
                }
                cut.to(pos);
                continue;
            }
            // <space>?[^\s\p{L}\p{N}]+[\r\n]*
            let lead = if c == ' ' { self.class_at(pos + 1) } else { Some(f) };
            if lead == Some(Class::Other) || (c == ' ' && lead.is_none()) {
                pos += (c == ' ') as usize;
                while self.is(pos, Class::Other) {
                    pos += 1;
                }
                while self.is_newline(pos) {
                    pos += 1;
                }
                cut.to(pos);
                continue;
            }
            pos = self.whitespace(pos, true);
            cut.to(pos);
        }
    }

    fn each(&self, mut pos: usize, pred: fn(char) -> bool, cut: &mut Cutter) {
        while pos < self.end {
            if pred(self.cps[pos]) {
                cut.to(pos);
                cut.to(pos + 1);
            }
            pos += 1;
        }
    }

    fn runs(&self, mut pos: usize, pred: fn(char) -> bool, cut: &mut Cutter) {
        while pos < self.end {
            if pred(self.cps[pos]) {
                cut.to(pos);
                while pos < self.end && pred(self.cps[pos]) {
                    pos += 1;
                }
                cut.to(pos);
            } else {
                pos += 1;
            }
        }
    }

    fn ascii_triples(&self, mut pos: usize, cut: &mut Cutter) {
        while pos < self.end {
            if pos + 3 <= self.end && self.cps[pos..pos + 3].iter().all(|c| c.is_ascii_digit()) {
                cut.to(pos);
                cut.to(pos + 3);
                pos += 3;
            } else {
                pos += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(p: PreTokenizer, text: &str) -> Vec<&str> {
        p.split(text).into_iter().map(|r| &text[r]).collect()
    }

    #[test]
    fn gpt2_words() {
        let w = words(PreTokenizer::Gpt2, "Hello, world! I'm  fine\n\n  ok 123");
        assert_eq!(w, ["Hello", ",", " world", "!", " I", "'m", " ", " fine", "\n\n ", " ok", " 123"]);
        assert_eq!(words(PreTokenizer::Gpt2, "a   "), ["a", "   "]);
    }

    #[test]
    fn smollm_splits_digits() {
        assert_eq!(words(PreTokenizer::DigitsThenGpt2, "x 1234 y"), ["x", " ", "1", "2", "3", "4", " y"]);
    }

    #[test]
    fn qwen2_and_llama3() {
        let w = words(PreTokenizer::Qwen2, "I'M  here:\r\n\n  12 (ok)?!\n");
        assert_eq!(w, ["I", "'M", " ", " here", ":\r\n\n", " ", " ", "1", "2", " (", "ok", ")?!\n"]);
        assert_eq!(words(PreTokenizer::Llama3, "1234567"), ["123", "456", "7"]);
        assert_eq!(words(PreTokenizer::Qwen2, "a \t b"), ["a", " \t", " b"]);
    }

    #[test]
    fn default_list() {
        assert_eq!(words(PreTokenizer::Default, "a+b 12345"), ["a", "+", "b", " ", "123", "45"]);
    }
}

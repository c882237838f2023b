//! Unit tests on tiny hand-built vocabularies, written into in-memory GGUF files.

use super::*;
use crate::gguf::writer::GgufWriter;
use crate::gguf::Value;

const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER: i32 = 4;
const BYTE: i32 = 6;

struct Spec<'a> {
    model: &'a str,
    pre: &'a str,
    tokens: Vec<(String, i32, f32)>,
    merges: Vec<&'a str>,
    extra: Vec<(&'a str, Value)>,
}

impl<'a> Spec<'a> {
    fn new(model: &'a str) -> Self {
        Spec { model, pre: "gpt-2", tokens: Vec::new(), merges: Vec::new(), extra: Vec::new() }
    }
    fn tok(mut self, text: &str, ty: i32, score: f32) -> Self {
        self.tokens.push((text.to_string(), ty, score));
        self
    }
    fn build(self) -> Tokenizer {
        let mut w = GgufWriter::new();
        let strs = |v: Vec<String>| Value::Array(v.into_iter().map(Value::String).collect());
        w.meta("tokenizer.ggml.model", Value::String(self.model.into()));
        w.meta("tokenizer.ggml.pre", Value::String(self.pre.into()));
        w.meta("tokenizer.ggml.tokens", strs(self.tokens.iter().map(|t| t.0.clone()).collect()));
        w.meta("tokenizer.ggml.token_type", Value::Array(self.tokens.iter().map(|t| Value::I32(t.1)).collect()));
        w.meta("tokenizer.ggml.scores", Value::Array(self.tokens.iter().map(|t| Value::F32(t.2)).collect()));
        if self.model == "gpt2" {
            w.meta("tokenizer.ggml.merges", strs(self.merges.iter().map(|m| m.to_string()).collect()));
        }
        for (k, v) in self.extra {
            w.meta(k, v);
        }
        let file = GgufFile::from_vec(w.to_bytes()).expect("valid gguf");
        Tokenizer::from_gguf(&file).expect("tokenizer")
    }
}

/// A byte-level BPE vocabulary: ids 0.. are the given texts (in the GPT-2 alphabet).
fn bpe(tokens: &[&str], merges: &[&'static str]) -> Spec<'static> {
    let mut s = Spec::new("gpt2");
    for t in tokens {
        s = s.tok(t, NORMAL, 0.0);
    }
    s.merges = merges.to_vec();
    s
}

fn ids(t: &Tokenizer, texts: &[&str]) -> Vec<u32> {
    texts.iter().map(|s| t.token_id(s).unwrap_or_else(|| panic!("no token {s:?}"))).collect()
}

#[test]
fn bpe_applies_merges_by_rank() {
    let t = bpe(&["a", "b", "c", "bc", "ab", "abc"], &["b c", "a b", "a bc"]).build();
    // "b c" (rank 0) wins over "a b" (rank 1), then "a bc" applies.
    assert_eq!(t.encode("abc", false, false).unwrap(), ids(&t, &["abc"]));
    let t = bpe(&["a", "b", "c", "bc", "ab"], &["b c", "a b"]).build();
    assert_eq!(t.encode("abc", false, false).unwrap(), ids(&t, &["a", "bc"]));
    let t = bpe(&["a", "b", "c", "bc", "ab"], &["a b", "b c"]).build();
    assert_eq!(t.encode("abc", false, false).unwrap(), ids(&t, &["ab", "c"]));
}

#[test]
fn bpe_ties_merge_leftmost_first() {
    let t = bpe(&["a", "aa"], &["a a"]).build();
    assert_eq!(t.encode("aaa", false, false).unwrap(), ids(&t, &["aa", "a"]));
    assert_eq!(t.encode("aaaa", false, false).unwrap(), ids(&t, &["aa", "aa"]));
}

#[test]
fn bpe_uses_byte_alphabet_and_words() {
    // " hi" is one GPT-2 word; the space is 'Ġ' in the byte alphabet.
    let t = bpe(&["Ġ", "h", "i", "Ġh", "Ġhi", "!"], &["Ġ h", "Ġh i"]).build();
    assert_eq!(t.encode(" hi!", false, false).unwrap(), ids(&t, &["Ġhi", "!"]));
    assert_eq!(t.decode(&t.encode(" hi!", false, false).unwrap(), false), " hi!");
    // Words are merged separately: "hi" + " hi" never merges across the word boundary.
    assert_eq!(t.encode("hi hi", false, false).unwrap(), ids(&t, &["h", "i", "Ġhi"]));
}

#[test]
fn bpe_emoji_through_byte_tokens_and_incremental_decoder() {
    let alphabet = unicode::ByteAlphabet::get();
    let chars: Vec<String> = "😀".bytes().map(|b| alphabet.encode(b).to_string()).collect();
    let refs: Vec<&str> = chars.iter().map(String::as_str).collect();
    let t = bpe(&refs, &[]).build();
    let toks = t.encode("😀", false, false).unwrap();
    assert_eq!(toks.len(), 4);
    let mut dec = IncrementalDecoder::new(&t, false);
    let pieces: Vec<String> = toks.iter().map(|&id| dec.push(id)).collect();
    assert_eq!(pieces, ["", "", "", "😀"]);
    assert_eq!(dec.finish(), "");
    // Cut off: the held-back bytes come out as one replacement char, never as broken UTF-8.
    let mut dec = IncrementalDecoder::new(&t, false);
    assert_eq!(dec.push(toks[0]) + &dec.push(toks[1]), "");
    assert!(dec.has_pending());
    assert_eq!(dec.finish(), "\u{FFFD}");
    assert_eq!(t.decode(&toks[..2], false), "\u{FFFD}");
}

fn spm_base() -> Spec<'static> {
    let mut s = Spec::new("llama").tok("<unk>", 2, 0.0).tok("<s>", CONTROL, 0.0).tok("</s>", CONTROL, 0.0);
    for b in 0..=255u8 {
        s = s.tok(&format!("<0x{b:02X}>"), BYTE, 0.0);
    }
    s.extra.push(("tokenizer.ggml.add_space_prefix", Value::Bool(false)));
    s
}

#[test]
fn spm_merges_by_score_with_byte_fallback() {
    let t = spm_base()
        .tok("a", NORMAL, -1.0)
        .tok("b", NORMAL, -1.0)
        .tok("c", NORMAL, -1.0)
        .tok("ab", NORMAL, -3.0)
        .tok("bc", NORMAL, -2.0)
        .tok("▁", NORMAL, -1.0)
        .tok("▁a", NORMAL, -5.0)
        .build();
    assert_eq!(t.bos_id(), Some(1));
    // "bc" scores higher than "ab".
    assert_eq!(t.encode("abc", false, false).unwrap(), ids(&t, &["a", "bc"]));
    // BOS by default for SPM; the space becomes ▁ and merges with "a"; "é" is not a token -> its bytes.
    let toks = t.encode(" aé", true, false).unwrap();
    assert_eq!(toks, ids(&t, &["<s>", "▁a", "<0xC3>", "<0xA9>"]));
    assert_eq!(t.decode(&toks, false), " aé");
    assert_eq!(t.decode(&toks, true), "<s> aé");
    // The incremental decoder holds back the first byte of "é".
    let mut dec = IncrementalDecoder::new(&t, false);
    let out: Vec<String> = toks.iter().map(|&id| dec.push(id)).collect();
    assert_eq!(out, ["", " a", "", "é"]);
}

#[test]
fn spm_add_space_prefix_after_specials() {
    let mut s = spm_base().tok("a", NORMAL, -1.0).tok("▁", NORMAL, -1.0).tok("▁a", NORMAL, -0.5);
    s.extra.clear(); // add_space_prefix defaults to true for SPM
    let t = s.build();
    assert_eq!(t.encode("a</s>a", false, true).unwrap(), ids(&t, &["▁a", "</s>", "▁a"]));
    assert_eq!(t.encode("a</s>a", false, false).unwrap().len(), 1 + 4 + 1); // "▁a" + "</s>" as bytes + "a"
}

#[test]
fn special_tokens_split_before_tokenization() {
    let t = bpe(&["a", "b", "<", ">", "|", "x"], &[])
        .tok("<|x|>", CONTROL, 0.0)
        .tok("<|x|>>", CONTROL, 0.0)
        .tok("<b>", USER, 0.0)
        .build();
    let ctl = t.token_id("<|x|>").unwrap();
    let longer = t.token_id("<|x|>>").unwrap();
    let user = t.token_id("<b>").unwrap();
    let a = t.token_id("a").unwrap();
    assert_eq!(t.encode("a<|x|>a", false, true).unwrap(), [a, ctl, a]);
    // Without parse_special the control text is plain text; user-defined tokens still match.
    let plain = t.encode("a<|x|>a<b>", false, false).unwrap();
    assert!(!plain.contains(&ctl) && plain.ends_with(&[user]));
    // The longest special text is taken first, anywhere in the text.
    assert_eq!(t.encode("<|x|>><|x|>", false, true).unwrap(), [longer, ctl]);
    // Control tokens render only on request; user-defined ones always.
    assert_eq!(t.decode(&[a, ctl, user], false), "a<b>");
    assert_eq!(t.decode(&[a, ctl, user], true), "a<|x|><b>");
}

#[test]
fn eog_set_follows_llama_cpp() {
    let mut s = bpe(&["a", "<|im_end|>", "<|endoftext|>", "<|im_start|>", "</s>"], &[]);
    s.extra.push(("tokenizer.ggml.eos_token_id", Value::U32(1)));
    let t = s.build();
    assert_eq!(t.eos_id(), Some(1));
    assert_eq!(t.eog_ids(), [1, 2, 4]);
    // Detected end markers become control tokens even though the file says "normal".
    assert!(t.is_control(1) && t.is_control(4) && !t.is_control(3));
    assert_eq!(t.decode(&[0, 1], false), "a");
    assert!(!t.adds_bos());
}

#[test]
fn pre_tokenizer_for_smollm_splits_digits() {
    let mut s = bpe(&["1", "2", "12", "Ġ", "Ġ1"], &["1 2", "Ġ 1"]);
    s.pre = "smollm";
    let t = s.build();
    assert_eq!(t.encode("12", false, false).unwrap(), ids(&t, &["1", "2"]));
    assert_eq!(t.encode(" 1", false, false).unwrap(), ids(&t, &["Ġ", "1"]));
}

#[test]
fn rejects_unknown_models() {
    let mut w = GgufWriter::new();
    w.meta("tokenizer.ggml.model", Value::String("bert".into()));
    w.meta("tokenizer.ggml.tokens", Value::Array(vec![Value::String("a".into())]));
    let file = GgufFile::from_vec(w.to_bytes()).unwrap();
    assert!(matches!(Tokenizer::from_gguf(&file), Err(Error::Tokenizer(_))));
}

#[test]
fn tokenizer_is_shareable() {
    fn check<T: Send + Sync>() {}
    check::<Tokenizer>();
    check::<IncrementalDecoder<'static>>();
}

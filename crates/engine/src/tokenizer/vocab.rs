//! The vocabulary as llama.cpp loads it: token texts, scores, attributes, and the special ids it resolves
//! from metadata plus its text-based auto-detection (EOT, FIM, end-of-generation tokens).

use super::table::{TextIndex, Texts};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;

/// Token attributes, llama.cpp's `llama_token_attr` bits.
pub(crate) const ATTR_UNKNOWN: u16 = 1 << 0;
pub(crate) const ATTR_UNUSED: u16 = 1 << 1;
pub(crate) const ATTR_NORMAL: u16 = 1 << 2;
pub(crate) const ATTR_CONTROL: u16 = 1 << 3;
pub(crate) const ATTR_USER_DEFINED: u16 = 1 << 4;
pub(crate) const ATTR_BYTE: u16 = 1 << 5;

pub(crate) struct Vocab {
    texts: Texts,
    index: TextIndex,
    pub(crate) scores: Vec<f32>,
    pub(crate) attrs: Vec<u16>,
}

impl Vocab {
    /// Reads `tokenizer.ggml.tokens`, `.scores` and `.token_type`.
    pub(crate) fn load(file: &GgufFile) -> Result<Vocab> {
        let tokens = file.get_str_array("tokenizer.ggml.tokens")?;
        let n = tokens.len();
        if n == 0 || n > u32::MAX as usize / 2 {
            return Err(Error::Tokenizer(format!("vocabulary has {n} tokens")));
        }
        let scores = match file.get("tokenizer.ggml.scores") {
            Some(_) => file.get_f32_array("tokenizer.ggml.scores")?,
            None => vec![0.0; n],
        };
        let types = match file.get("tokenizer.ggml.token_type") {
            Some(_) => file.get_i64_array("tokenizer.ggml.token_type")?,
            None => vec![1; n],
        };
        if scores.len() < n || types.len() < n {
            return Err(Error::Tokenizer(format!(
                "{n} tokens but {} scores and {} token types",
                scores.len(),
                types.len()
            )));
        }
        let mut texts = Texts::with_capacity(n, tokens.iter().map(|t| t.len()).sum());
        for (i, &t) in tokens.iter().enumerate() {
            if t.is_empty() {
                texts.push(&format!("[EMPTY_{i}]"));
            } else {
                texts.push(t);
            }
        }
        let index = TextIndex::build(&texts).map_err(|(a, b)| {
            Error::Tokenizer(format!("duplicate token {:?} has ids {a} and {b}", texts.get(a as usize)))
        })?;
        let attrs = types[..n]
            .iter()
            .map(|&t| match t {
                1 => ATTR_NORMAL,
                2 => ATTR_UNKNOWN,
                3 => ATTR_CONTROL,
                4 => ATTR_USER_DEFINED,
                5 => ATTR_UNUSED,
                6 => ATTR_BYTE,
                _ => 0,
            })
            .collect();
        Ok(Vocab { texts, index, scores: scores[..n].to_vec(), attrs })
    }

    pub(crate) fn len(&self) -> usize {
        self.texts.len()
    }

    pub(crate) fn id(&self, text: &str) -> Option<u32> {
        self.index.get(&self.texts, text)
    }

    /// The text of token `id` (which must be in range).
    pub(crate) fn text(&self, id: usize) -> &str {
        self.texts.get(id)
    }
}

/// The special ids llama.cpp ends up with.
pub(crate) struct Specials {
    pub(crate) bos: Option<u32>,
    pub(crate) eos: Option<u32>,
    pub(crate) eog: Vec<u32>,
}

const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// Resolves bos/eos and the end-of-generation set, and (like llama.cpp) marks the auto-detected special
/// tokens as CONTROL, which changes how they are partitioned and rendered.
pub(crate) fn resolve_specials(file: &GgufFile, vocab: &mut Vocab, spm: bool) -> Specials {
    let n = vocab.len() as u64;
    let key = |name: &str, default: Option<u32>| -> Option<u32> {
        let default = default.filter(|&d| (d as u64) < n);
        match file.get(&format!("tokenizer.ggml.{name}")).and_then(|v| v.as_u64()) {
            Some(id) if id < n => Some(id as u32),
            _ => default,
        }
    };
    let (bos_default, eos_default) = if spm { (Some(1), Some(2)) } else { (Some(11), Some(11)) };
    let bos = key("bos_token_id", bos_default);
    let eos = key("eos_token_id", eos_default);
    let mut eot = key("eot_token_id", None);
    let mut eom = key("eom_token_id", None);
    let mut fim = [
        key("prefix_token_id", key("fim_pre_token_id", None)),
        key("suffix_token_id", key("fim_suf_token_id", None)),
        key("middle_token_id", key("fim_mid_token_id", None)),
        key("fim_pad_token_id", None),
        key("fim_rep_token_id", None),
        key("fim_sep_token_id", None),
    ];
    let fim_texts = [FIM_PRE_TEXTS, FIM_SUF_TEXTS, FIM_MID_TEXTS, FIM_PAD_TEXTS, FIM_REP_TEXTS, FIM_SEP_TEXTS];

    // Text-based detection. llama.cpp walks a hash map, so when several candidates exist which one wins is
    // unspecified; we take the lowest id.
    let lowest = |vocab: &Vocab, texts: &[&str]| texts.iter().filter_map(|t| vocab.id(t)).min();
    let detect = |slot: &mut Option<u32>, texts: &[&str], vocab: &mut Vocab| {
        if slot.is_none() {
            *slot = lowest(vocab, texts);
            if let Some(id) = *slot {
                vocab.attrs[id as usize] |= ATTR_CONTROL;
            }
        }
    };
    detect(&mut eot, EOT_TEXTS, vocab);
    detect(&mut eom, &["<|eom_id|>"], vocab);
    for (slot, texts) in fim.iter_mut().zip(fim_texts) {
        detect(slot, texts, vocab);
    }

    let mut eog: Vec<u32> = fim[3..].iter().flatten().copied().collect();
    let found: Vec<u32> = EOG_TEXTS.iter().filter_map(|t| vocab.id(t)).collect();
    for id in found {
        eog.push(id);
        vocab.attrs[id as usize] |= ATTR_CONTROL;
    }
    for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
        if let Some(id) = vocab.id(t) {
            vocab.attrs[id as usize] = ATTR_USER_DEFINED; // gpt-oss: always rendered
        }
    }
    eog.extend([eos, eot, eom].into_iter().flatten());
    eog.sort_unstable();
    eog.dedup();

    let find = |eog: &[u32], vocab: &Vocab, t: &str| eog.iter().copied().find(|&id| vocab.text(id as usize) == t);
    let has = |t: &str| find(&eog, vocab, t).is_some();
    // o200k_harmony / solar-open: "<|end|>" does not end generation there.
    let drop_end = (has("<|return|>") && has("<|call|>")) || (has("<|calls|>") && has("<|flush|>"));
    // gemma4 / paddleocr: "</s>" is not an end of generation when "<|tool_response>" exists.
    let drop_s = has("<|tool_response>");
    if let Some(end) = find(&eog, vocab, "<|end|>").filter(|_| drop_end) {
        eog.retain(|&id| id != end);
        vocab.attrs[end as usize] = ATTR_USER_DEFINED;
    }
    if let Some(s) = find(&eog, vocab, "</s>").filter(|_| drop_s) {
        eog.retain(|&id| id != s);
        vocab.attrs[s as usize] = ATTR_NORMAL;
    }
    Specials { bos, eos, eog }
}

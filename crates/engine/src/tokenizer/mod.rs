//! Tokenizers that reproduce llama.cpp token for token on GGUF models.
//!
//! Two model families are implemented:
//! - `tokenizer.ggml.model = "gpt2"`: byte-level BPE with merge ranks, after a pre-tokenizer chosen by
//!   `tokenizer.ggml.pre` (module `pretokenize`);
//! - `tokenizer.ggml.model = "llama"`: SentencePiece-style BPE over token scores with `<0xXX>` byte
//!   fallback (Gemma 3, LLaMA 1/2, Mistral ...).
//!
//! Both first split the text on special-token texts (module `special`), then tokenize each raw fragment.
//! The vocabulary's attributes and special ids follow llama.cpp's loader, including its text-based
//! detection of end-of-turn tokens (module `vocab`), so [`Tokenizer::eog_ids`] is llama.cpp's
//! `llama_vocab_is_eog` set.

mod bpe;
mod decode;
mod pretokenize;
mod special;
mod spm;
mod table;
#[cfg(test)]
mod tests;
mod unicode;
mod vocab;

pub use decode::{IncrementalDecoder, Utf8Stream};

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use bpe::BpeMerges;
use pretokenize::PreTokenizer;
use special::{Fragment, SpecialMatcher};
use vocab::Vocab;

enum Model {
    Bpe { merges: BpeMerges, pre: PreTokenizer, ignore_merges: bool },
    Spm { byte_tokens: Vec<Option<u32>> },
}

/// A loaded tokenizer. Immutable and `Send + Sync`: share it behind an `Arc`.
pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
    specials: SpecialMatcher,
    bos: Option<u32>,
    eos: Option<u32>,
    eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("model", &self.model_name())
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eog", &self.eog)
            .finish()
    }
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Tokenizer> {
        let model_name = file.get_str("tokenizer.ggml.model")?;
        let pre_name = file.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("");
        let spm = match model_name {
            "llama" => true,
            "gpt2" => false,
            other => return Err(Error::Tokenizer(format!("unsupported tokenizer model {other:?}"))),
        };
        let mut vocab = Vocab::load(file)?;
        let (model, default_add_bos) = if spm {
            (Model::Spm { byte_tokens: spm::byte_tokens(&vocab) }, true)
        } else {
            let (pre, ignore_merges, add_bos) = PreTokenizer::from_name(pre_name)
                .ok_or_else(|| Error::Tokenizer(format!("unsupported pre-tokenizer {pre_name:?}")))?;
            let merges = file
                .get_str_array("tokenizer.ggml.merges")
                .map_err(|_| Error::Tokenizer("gpt2 tokenizer without tokenizer.ggml.merges".into()))?;
            (Model::Bpe { merges: BpeMerges::new(&merges, &vocab), pre, ignore_merges }, add_bos)
        };
        let add_bos = file.get_bool_or("tokenizer.ggml.add_bos_token", default_add_bos)?;
        let add_eos = file.get_bool_or("tokenizer.ggml.add_eos_token", false)?;
        let add_space_prefix = file.get_bool_or("tokenizer.ggml.add_space_prefix", spm)?;
        let found = vocab::resolve_specials(file, &mut vocab, spm);
        if add_bos && found.bos.is_none() {
            return Err(Error::Tokenizer("add_bos_token is true but there is no BOS token".into()));
        }
        if add_eos && found.eos.is_none() {
            return Err(Error::Tokenizer("add_eos_token is true but there is no EOS token".into()));
        }
        let specials = SpecialMatcher::new(&vocab);
        Ok(Tokenizer {
            vocab,
            model,
            specials,
            bos: found.bos,
            eos: found.eos,
            eog: found.eog,
            add_bos,
            add_eos,
            add_space_prefix,
        })
    }

    /// Tokenizes `text` like `llama_tokenize(vocab, text, add_special, parse_special)`.
    ///
    /// `add_special`: add BOS (and EOS) as the model's `add_bos_token`/`add_eos_token` say.
    /// `parse_special`: recognise the texts of control tokens (like `<|im_start|>`) as those tokens;
    /// user-defined tokens are recognised either way, as in llama.cpp.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let frags = self.specials.partition(&self.vocab, text, parse_special);
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        match &self.model {
            Model::Spm { byte_tokens } => {
                let mut prev_special = true;
                for f in frags {
                    match f {
                        Fragment::Text(r) => {
                            let prefix = if self.add_space_prefix && prev_special { " " } else { "" };
                            let escaped = format!("{prefix}{}", &text[r]).replace(' ', "\u{2581}");
                            spm::encode(&self.vocab, byte_tokens, &escaped, &mut out)?;
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            Model::Bpe { merges, pre, ignore_merges } => {
                for f in frags {
                    match f {
                        Fragment::Text(r) => {
                            let fragment = &text[r];
                            for w in pre.split(fragment) {
                                merges.encode_word(&fragment[w], &self.vocab, *ignore_merges, &mut out);
                            }
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        Ok(out)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// Every token id that ends generation (llama.cpp's `llama_vocab_is_eog` set), ascending: EOS, EOT,
    /// EOM, FIM pad/repo/file-separator, and tokens whose text is a known end marker such as
    /// `<|im_end|>`, `<end_of_turn>`, `<|endoftext|>` or `</s>`.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }

    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// Whether a token is a control token (rendered as empty text unless specials are rendered).
    pub fn is_control(&self, id: u32) -> bool {
        self.vocab.attrs.get(id as usize).is_some_and(|&a| a & (vocab::ATTR_CONTROL | vocab::ATTR_UNKNOWN) != 0)
    }

    /// The token's text as stored in the vocabulary (GPT-2 byte alphabet / `▁` escaped).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        ((id as usize) < self.vocab.len()).then(|| self.vocab.text(id as usize))
    }

    /// The id of the token whose vocabulary text is exactly `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id(text)
    }

    /// "gpt2" or "llama", as in `tokenizer.ggml.model`.
    pub fn model_name(&self) -> &'static str {
        match self.model {
            Model::Bpe { .. } => "gpt2",
            Model::Spm { .. } => "llama",
        }
    }
}

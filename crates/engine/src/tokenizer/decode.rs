//! Rendering tokens back to bytes (llama.cpp's `token_to_piece`), whole-sequence decoding, and an
//! incremental decoder for streaming that only ever emits complete UTF-8.

use super::unicode::ByteAlphabet;
use super::vocab::{ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_USER_DEFINED};
use super::{Model, Tokenizer};

impl Tokenizer {
    /// The raw bytes token `id` stands for: byte-level BPE tokens are mapped back from the GPT-2 byte
    /// alphabet, SentencePiece tokens get `▁` -> ` `, `<0xXX>` byte tokens give that byte. Control and
    /// unknown tokens render as empty unless `render_special` (then as their text); user-defined tokens
    /// always render as their text; unused tokens and unknown ids render as nothing.
    pub fn token_bytes(&self, id: u32, render_special: bool) -> Vec<u8> {
        let Some(text) = self.token_text(id) else { return Vec::new() };
        let attr = self.vocab.attrs[id as usize];
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL) != 0 && !render_special {
            return Vec::new();
        }
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED) != 0 {
            return text.as_bytes().to_vec();
        }
        if attr & ATTR_NORMAL != 0 {
            return match self.model {
                Model::Spm { .. } => text.replace('\u{2581}', " ").into_bytes(),
                Model::Bpe { .. } => byte_level_decode(text),
            };
        }
        if attr & ATTR_BYTE != 0 {
            let hex = text.get(3..5).unwrap_or("");
            return vec![u8::from_str_radix(hex, 16).unwrap_or(0)];
        }
        Vec::new()
    }

    /// Concatenates the tokens' bytes; invalid UTF-8 (e.g. a multi-byte char cut off at the end) is
    /// replaced by U+FFFD.
    pub fn decode(&self, ids: &[u32], render_special: bool) -> String {
        let bytes: Vec<u8> = ids.iter().flat_map(|&id| self.token_bytes(id, render_special)).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

/// llama.cpp's `llama_decode_text`: chars outside the byte alphabet come out as a visible marker.
fn byte_level_decode(text: &str) -> Vec<u8> {
    let alphabet = ByteAlphabet::get();
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match alphabet.decode(c) {
            Some(b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(text.as_bytes());
                out.push(b']');
            }
        }
    }
    out
}

/// Streaming detokenizer: push token ids as they are generated and get back the text that is complete so
/// far. A UTF-8 sequence split across tokens (byte-fallback tokens, byte-level BPE pieces of an emoji) is
/// held back until it completes; bytes that can never form a valid sequence come out as U+FFFD.
///
/// It borrows the tokenizer; hold the tokenizer in an `Arc` and the decoder next to it for as long as a
/// generation runs (or keep a `Utf8Stream` and pass it each token's bytes).
pub struct IncrementalDecoder<'a> {
    tok: &'a Tokenizer,
    render_special: bool,
    stream: Utf8Stream,
}

impl<'a> IncrementalDecoder<'a> {
    pub fn new(tok: &'a Tokenizer, render_special: bool) -> Self {
        IncrementalDecoder { tok, render_special, stream: Utf8Stream::default() }
    }

    /// Adds one token; returns the newly completed text (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        self.stream.push(&self.tok.token_bytes(id, self.render_special))
    }

    /// Returns whatever is still held back, an incomplete trailing sequence as U+FFFD.
    pub fn finish(&mut self) -> String {
        self.stream.finish()
    }

    /// Whether bytes of an incomplete character are being held back.
    pub fn has_pending(&self) -> bool {
        self.stream.has_pending()
    }
}

/// Bytes in, complete UTF-8 text out: the state of `IncrementalDecoder` without the tokenizer borrow.
#[derive(Clone, Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Adds bytes; returns the newly completed text (possibly empty).
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        self.take(false)
    }

    /// Returns whatever is still held back, an incomplete trailing sequence as U+FFFD.
    pub fn finish(&mut self) -> String {
        self.take(true)
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    fn take(&mut self, flush: bool) -> String {
        let mut out = String::new();
        let mut start = 0;
        while start < self.pending.len() {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&self.pending[start..start + valid]).expect("valid prefix"));
                    start += valid;
                    match e.error_len() {
                        Some(n) => {
                            out.push('\u{FFFD}');
                            start += n;
                        }
                        None if flush => {
                            out.push('\u{FFFD}');
                            start = self.pending.len();
                        }
                        None => break, // incomplete tail: wait for more bytes
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}

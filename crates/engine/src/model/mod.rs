//! Decoder-only transformers over GGUF weights: the forward pass for a batch of tokens from several
//! sequences, against KV storage the caller owns.
//!
//! `forward` takes every scheduled sequence's new tokens (a prefill chunk or one decode token), writes their
//! keys/values into the caller's paged `KvStorage` at the slots their block tables give, and returns logits
//! for the rows the caller asked for. The model holds no per-sequence state.

mod block;
pub mod config;
mod gemma3;
mod llama;
pub mod weights;

pub use config::{Arch, ModelConfig};

use crate::attention::QueryPos;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kv::{KvShape, KvStorage};
use crate::ops::{self, Rope};
use crate::quant::dequantize_row;
pub use crate::quant::packed::Numerics;
use weights::{load_weights, Weights};

/// Which logits a sequence wants back from a forward step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsWanted {
    None,
    /// For its last token only (sampling the next token).
    Last,
    /// For every token (teacher forcing, perplexity).
    All,
}

/// One sequence's part of a batch: `tokens` sit at positions `start_pos..start_pos + tokens.len()`;
/// positions before `start_pos` are already in the KV storage.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub start_pos: usize,
    pub block_table: &'a [u32],
    pub logits: LogitsWanted,
}

/// Activations of one forward step, kept between steps so their memory is reused.
#[derive(Default)]
pub struct Scratch {
    pub(crate) x: Vec<f32>,        // [n, d_model] residual stream
    pub(crate) xn: Vec<f32>,       // [n, d_model] normed input of a sub-block
    pub(crate) q: Vec<f32>,        // [n, q_dim]
    pub(crate) k: Vec<f32>,        // [n, kv_dim]
    pub(crate) v: Vec<f32>,        // [n, kv_dim]
    pub(crate) attn: Vec<f32>,     // [n, q_dim]
    pub(crate) proj: Vec<f32>,     // [n, d_model] sub-block output
    pub(crate) gate: Vec<f32>,     // [n, ffn_dim]
    pub(crate) up: Vec<f32>,       // [n, ffn_dim]
    pub(crate) act_q: Vec<u8>,     // quantized activations for matmul
    /// `x += proj` is still to be done (a llama layer leaves its last residual add to whoever reads x
    /// next, which does it inside its own parallel run).
    pub(crate) residual_pending: bool,
    logits: Vec<f32>,              // [n_logit_rows, vocab]
}

fn resize(buf: &mut Vec<f32>, len: usize) {
    buf.resize(len, 0.0);
}

pub struct Model {
    pub config: ModelConfig,
    numerics: Numerics,
    file: GgufFile,
    weights: Weights,
    rope_global: Rope,
    rope_local: Rope,
}

impl Model {
    /// Loads with this process's default numerics (`Numerics::from_env`).
    pub fn load(file: GgufFile) -> Result<Self> {
        Self::load_with(file, Numerics::from_env())
    }

    /// Loads with the given numerics; packed falls back to ggml where this CPU lacks the packed kernels
    /// (`numerics()` tells which it got).
    pub fn load_with(file: GgufFile, numerics: Numerics) -> Result<Self> {
        let numerics = if numerics == Numerics::Packed && !crate::quant::packed::kernels_available() { Numerics::Ggml } else { numerics };
        let config = ModelConfig::from_gguf(&file)?;
        let weights = load_weights(&file, &config, numerics)?;
        let rope_global = Rope::new(config.rope_style, config.rot_dim, config.rope_base);
        let rope_local = Rope::new(config.rope_style, config.rot_dim, config.rope_base_local);
        Ok(Model { config, numerics, file, weights, rope_global, rope_local })
    }

    /// The matmul arithmetic this model was loaded with.
    pub fn numerics(&self) -> Numerics {
        self.numerics
    }

    pub fn file(&self) -> &GgufFile {
        &self.file
    }

    /// A 128-bit fingerprint of the model file: its size, its first 4 MiB (metadata, tokenizer and tensor
    /// table) and 64 KiB samples at 64 points of the tensor data. Files of the prefix cache's disk tier
    /// name the model they were computed with by it.
    pub fn fingerprint(&self) -> u128 {
        use sha2::{Digest, Sha256};
        let raw = self.file.raw();
        let mut h = Sha256::new();
        h.update((raw.len() as u64).to_le_bytes());
        h.update(&raw[..raw.len().min(4 << 20)]);
        let sample = 64 << 10;
        for i in 0..64 {
            let at = (raw.len() / 64 * i).min(raw.len().saturating_sub(sample));
            h.update(&raw[at..(at + sample).min(raw.len())]);
        }
        u128::from_le_bytes(h.finalize()[..16].try_into().expect("SHA-256 has 32 bytes"))
    }

    /// A KV storage shaped for this model.
    pub fn new_kv(&self, block_size: usize, num_blocks: usize) -> KvStorage {
        KvStorage::new(KvShape { num_layers: self.config.n_layers, kv_dim: self.config.kv_dim(), block_size, num_blocks })
    }

    /// Runs one step over all `seqs`; returns logits `[rows, vocab]`, one row per wanted logit in order.
    pub fn forward<'s>(&self, seqs: &[SeqInput], kv: &mut KvStorage, scratch: &'s mut Scratch) -> Result<&'s [f32]> {
        let queries = self.check_batch(seqs, kv)?;
        let n = queries.len();
        let c = &self.config;
        self.embed(seqs, scratch);
        for (il, layer) in self.weights.layers.iter().enumerate() {
            let rope = if c.layer_window(il).is_some() { &self.rope_local } else { &self.rope_global };
            let ctx = block::LayerCtx { cfg: c, file: &self.file, layer: il, rope, queries: &queries, numerics: self.numerics };
            match c.arch {
                Arch::Llama | Arch::Qwen2 => llama::layer(&ctx, layer, kv, scratch),
                Arch::Gemma3 => gemma3::layer(&ctx, layer, kv, scratch),
            }
        }
        if std::mem::take(&mut scratch.residual_pending) {
            ops::add_inplace(&mut scratch.x, &scratch.proj);
        }
        let rows = logit_rows(seqs);
        resize(&mut scratch.xn, rows.len() * c.d_model);
        for (out, &t) in scratch.xn.chunks_exact_mut(c.d_model).zip(&rows) {
            ops::rms_norm(&scratch.x[t * c.d_model..(t + 1) * c.d_model], &self.weights.output_norm, c.norm_eps, out);
        }
        resize(&mut scratch.logits, rows.len() * c.vocab_size);
        debug_assert!(n >= rows.len());
        self.weights.output.view(&self.file).matmul(&scratch.xn, &mut scratch.act_q, &mut scratch.logits);
        Ok(&scratch.logits)
    }

    /// Checks token ids, block tables and positions; returns each token's query position.
    fn check_batch<'a>(&self, seqs: &[SeqInput<'a>], kv: &KvStorage) -> Result<Vec<QueryPos<'a>>> {
        let mut queries = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= self.config.vocab_size) {
                return Err(Error::InvalidRequest(format!("token id {bad} is outside the vocabulary ({})", self.config.vocab_size)));
            }
            let end = s.start_pos + s.tokens.len();
            if s.block_table.len() * kv.shape.block_size < end {
                return Err(Error::InvalidRequest(format!("sequence {i}: block table holds fewer than {end} positions")));
            }
            if let Some(&b) = s.block_table.iter().find(|&&b| b as usize >= kv.shape.num_blocks) {
                return Err(Error::InvalidRequest(format!("sequence {i}: block {b} is outside the KV storage")));
            }
            queries.extend((s.start_pos..end).map(|pos| QueryPos { block_table: s.block_table, pos }));
        }
        if queries.is_empty() {
            return Err(Error::InvalidRequest("empty batch".into()));
        }
        Ok(queries)
    }

    /// Fills the residual stream with token embeddings (scaled by sqrt(d_model) for gemma3).
    fn embed(&self, seqs: &[SeqInput], scratch: &mut Scratch) {
        let d = self.config.d_model;
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        resize(&mut scratch.x, tokens.len() * d);
        scratch.residual_pending = false;
        let table = self.weights.embed.view(&self.file);
        let row_bytes = table.dtype.row_bytes(d).expect("checked at load");
        for (out, &t) in scratch.x.chunks_exact_mut(d).zip(&tokens) {
            dequantize_row(table.dtype, &table.bytes[t as usize * row_bytes..][..row_bytes], out);
        }
        if self.config.arch == Arch::Gemma3 {
            // Gemma scales embeddings by sqrt(d_model), rounded through the model's dtype in HF; llama.cpp
            // multiplies by the f32 value.
            ops::scale_inplace(&mut scratch.x, (d as f32).sqrt());
        }
    }
}

/// Indices (in batch order) of the tokens whose logits are wanted.
fn logit_rows(seqs: &[SeqInput]) -> Vec<usize> {
    let mut rows = Vec::new();
    let mut start = 0;
    for s in seqs {
        let n = s.tokens.len();
        match s.logits {
            LogitsWanted::None => {}
            LogitsWanted::Last => rows.push(start + n - 1),
            LogitsWanted::All => rows.extend(start..start + n),
        }
        start += n;
    }
    rows
}

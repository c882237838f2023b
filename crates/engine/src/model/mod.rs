//! Decoder-only transformers over GGUF weights: the forward pass for a batch of tokens from several
//! sequences, against KV storage the caller owns.
//!
//! `forward` takes every scheduled sequence's new tokens (a prefill chunk or one decode token), writes their
//! keys/values into the caller's paged `KvStorage` at the slots their block tables give, and returns logits
//! for the rows the caller asked for. The model holds no per-sequence state.

mod block;
pub mod capabilities;
pub mod config;
mod gemma3;
mod lfm2;
mod llama;
mod moe;
mod phi3;
mod qwen2;
mod qwen3;
mod qwen3moe;
mod weights;

pub use block::{DumpDir, Tracer};
pub use capabilities::{Capabilities, Feature};
pub use config::{Arch, ModelConfig};

use crate::kernels::attention::QueryPos;
use crate::error::Result;
use crate::gguf::GgufFile;
use crate::kv::{Attention, KeyLayout, KvDtypes, KvLayout, KvShape, KvStorage, KvWindow, NULL_BLOCK};
use crate::kernels::ops::{self, Rope};
use crate::kernels::ggml::dequantize_row;
pub use crate::kernels::packed::Numerics;
use block::{LayerCtx, Residual};
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
    /// One block table per layer group of the storage's layout (`kv::layout`; one for most models).
    pub block_tables: &'a [Vec<u32>],
    pub logits: LogitsWanted,
    /// A hybrid model's recurrent-state slot for this sequence (`KvStorage::conv_states`): its conv
    /// layers' last positions, carried from step to step, zeroed when `start_pos` is 0. None for a model
    /// without such layers.
    pub state: Option<u32>,
}

/// Activations of one forward step, kept between steps so their memory is reused.
#[derive(Default)]
pub struct Scratch {
    pub(crate) residual: Residual, // x: [n, d_model]
    pub(crate) xn: Vec<f32>,       // [n, d_model] normed input of a sub-block
    pub(crate) q: Vec<f32>,        // [n, q_dim]
    pub(crate) k: Vec<f32>,        // [n, kv_dim]
    pub(crate) v: Vec<f32>,        // [n, kv_dim]
    pub(crate) attn: Vec<f32>,     // [n, q_dim]
    pub(crate) proj: Vec<f32>,     // [n, d_model] sub-block output
    pub(crate) gate: Vec<f32>,     // [n, ffn_dim]
    pub(crate) up: Vec<f32>,       // [n, ffn_dim]
    pub(crate) act_q: Vec<u8>,     // quantized activations for matmul
    pub(crate) moe: moe::MoeScratch,
    logits: Vec<f32>,              // [n_logit_rows, vocab]
}

fn resize(buf: &mut Vec<f32>, len: usize) {
    buf.resize(len, 0.0);
}

/// How a model is loaded (the binary parses these once and passes them in).
#[derive(Clone, Debug)]
pub struct LoadOptions {
    pub numerics: Numerics,
    /// Write the last token's activations of every step here (`DumpDir`), for parity debugging.
    pub dump_dir: Option<std::path::PathBuf>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions { numerics: Numerics::default_for_cpu(), dump_dir: None }
    }
}

impl From<Numerics> for LoadOptions {
    fn from(numerics: Numerics) -> Self {
        LoadOptions { numerics, dump_dir: None }
    }
}

pub struct Model {
    pub config: ModelConfig,
    numerics: Numerics,
    file: GgufFile,
    weights: Weights,
    rope_global: Rope,
    rope_local: Rope,
    tracer: Option<Box<dyn Tracer>>,
}

impl Model {
    /// Loads with the default options (packed numerics where this CPU has its kernels).
    pub fn load(file: GgufFile) -> Result<Self> {
        Self::load_with(file, LoadOptions::default())
    }

    /// Loads with the given options; packed falls back to ggml where this CPU lacks the packed kernels
    /// (`numerics()` tells which it got).
    pub fn load_with(file: GgufFile, options: impl Into<LoadOptions>) -> Result<Self> {
        let options = options.into();
        let numerics = if options.numerics == Numerics::Packed && !crate::kernels::packed::kernels_available() { Numerics::Ggml } else { options.numerics };
        let config = ModelConfig::from_gguf(&file)?;
        let weights = load_weights(&file, &config, numerics)?;
        let mut rope_global = Rope::new(config.rope_style, config.rot_dim, config.rope_base);
        if let Some(factors) = &weights.rope_factors {
            rope_global = rope_global.with_factors(factors.clone());
        }
        let rope_local = Rope::new(config.rope_style, config.rot_dim, config.rope_base_local);
        let tracer = options.dump_dir.map(|d| Box::new(DumpDir(d)) as Box<dyn Tracer>);
        Ok(Model { config, numerics, file, weights, rope_global, rope_local, tracer })
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

    /// Bytes one decode token reads from memory at `depth` cells of context: every weight tensor as the
    /// file stores it (the token embedding table only where it is also the output matrix: otherwise one
    /// row is read; of a mixture of experts, the experts a token uses), and the keys and values each layer attends (a sliding-window layer its window).
    /// The ceiling on decode speed is the read bandwidth divided by this.
    pub fn decode_bytes_per_token(&self, depth: usize, dtypes: KvDtypes) -> u64 {
        let tensors = &self.file.header().tensors;
        let tied = !tensors.iter().any(|t| t.name == "output.weight");
        // a mixture of experts reads its chosen experts' rows only
        let read = |t: &crate::gguf::TensorInfo| match self.config.moe {
            Some(m) if t.name.contains("_exps.") => t.num_bytes / m.n_expert as u64 * m.n_used as u64,
            _ => t.num_bytes,
        };
        let weights: u64 = tensors.iter().filter(|t| tied || t.name != "token_embd.weight").map(read).sum();
        let c = &self.config;
        let per_layer_cell = (dtypes.k.bytes(c.kv_dim()) + dtypes.v.bytes(c.kv_dim())) as u64;
        let kv: u64 = (0..c.n_layers).filter(|&il| c.has_kv(il)).map(|il| c.layer_window(il).map_or(depth, |w| depth.min(w)) as u64 * per_layer_cell).sum();
        weights + kv
    }

    /// The KV layout of this model: with `hybrid`, its sliding-window layers in groups of their own
    /// (`kv::layout`); otherwise (or without such layers) one group.
    pub fn kv_layout(&self, hybrid: bool) -> KvLayout {
        let c = &self.config;
        if c.short_conv.is_some() {
            // (a convolution layer's state lives in `KvStorage::conv_states`, not in pages)
            KvLayout::attention_only(&(0..c.n_layers).map(|il| c.has_kv(il)).collect::<Vec<_>>())
        } else if hybrid {
            KvLayout::hybrid(&(0..c.n_layers).map(|il| c.layer_window(il)).collect::<Vec<_>>())
        } else {
            KvLayout::uniform(c.n_layers)
        }
    }

    /// An f16 KV storage shaped for this model.
    pub fn new_kv(&self, block_size: usize, num_blocks: usize) -> KvStorage {
        self.new_kv_with(KvDtypes::F16, block_size, num_blocks)
    }

    /// A KV storage of `dtypes` shaped for this model (`KvDtypes::check_shape` must accept it).
    pub fn new_kv_with(&self, dtypes: KvDtypes, block_size: usize, num_blocks: usize) -> KvStorage {
        self.new_kv_in(self.kv_layout(false), dtypes, block_size, num_blocks)
    }

    /// A KV storage of `layout`'s pages (`kv_layout`), `num_blocks` of them.
    pub fn new_kv_in(&self, layout: KvLayout, dtypes: KvDtypes, block_size: usize, num_blocks: usize) -> KvStorage {
        let c = &self.config;
        assert_eq!(layout.num_layers(), c.n_layers, "a layout of this model's layers");
        // The packed numerics' scores are chains over keys by dimension (`kernels::attention::by_dim`).
        let key_layout = if self.numerics == Numerics::Packed { KeyLayout::ByDim } else { KeyLayout::Rows };
        let mut kv = KvStorage::with_layout(KvShape { num_layers: layout.slots(), kv_dim: c.kv_dim(), head_dim: c.head_dim, block_size, num_blocks, dtypes, key_layout }, layout);
        if let Some(sc) = &c.short_conv {
            let layers = sc.is_conv.iter().filter(|&&conv| conv).count();
            kv.conv_states = crate::kv::ConvStates::new(layers, sc.state_len(c.d_model) / layers.max(1));
        }
        kv
    }

    /// Runs one step over all `seqs`; returns logits `[rows, vocab]`, one row per wanted logit in order.
    pub fn forward<'s>(&self, seqs: &[SeqInput], kv: &mut KvStorage, scratch: &'s mut Scratch) -> &'s [f32] {
        self.forward_at(seqs, &[], Attention::Full, kv, scratch)
    }

    /// `forward` where a sequence's tokens may sit at RoPE positions other than their cells, and its
    /// queries read what `attention` says. `positions[i]` (when given) holds one position per token of
    /// `seqs[i]`, whose cells still run from its `start_pos`: a sparse prefill (`engine::sparse`) keeps a
    /// prompt's chosen tokens in consecutive cells, each rotated for its place in the full prompt, so a
    /// kept token attends to the kept tokens before it, each at its own position. Under a window
    /// (`kv::window`), the block tables' entries it released (`NULL_BLOCK`) are never read, and it needs
    /// a one-group layout (a hybrid layout's sliding groups read their own window). Under sparse
    /// attention every query at depth reads its sinks, its recent blocks and the history blocks it
    /// picks (`kv::sparse`).
    pub fn forward_at<'s>(&self, seqs: &[SeqInput], positions: &[Option<&[usize]>], attention: Attention, kv: &mut KvStorage, scratch: &'s mut Scratch) -> &'s [f32] {
        self.run_layers(seqs, positions, attention, self.config.n_layers, self.tracer.as_deref(), kv, scratch);
        let c = &self.config;
        scratch.residual.settle(&scratch.proj);
        let rows = logit_rows(seqs);
        resize(&mut scratch.xn, rows.len() * c.d_model);
        for (out, &t) in scratch.xn.chunks_exact_mut(c.d_model).zip(&rows) {
            ops::rms_norm(&scratch.residual.x[t * c.d_model..(t + 1) * c.d_model], &self.weights.output_norm, c.norm_eps, out);
        }
        resize(&mut scratch.logits, rows.len() * c.vocab_size);
        self.weights.output.view(&self.file).matmul(&scratch.xn, &mut scratch.act_q, &mut scratch.logits);
        &scratch.logits
    }

    /// The first `layers` layers of a step (their keys and values written), no logits; `tracer` sees
    /// their activations. A sparse prefill's scoring pass (`engine::sparse::score`) runs this.
    pub fn forward_layers(&self, seqs: &[SeqInput], layers: usize, kv: &mut KvStorage, scratch: &mut Scratch, tracer: &dyn Tracer) {
        self.run_layers(seqs, &[], Attention::Full, layers.min(self.config.n_layers), Some(tracer), kv, scratch);
    }

    #[allow(clippy::too_many_arguments)]
    fn run_layers(&self, seqs: &[SeqInput], positions: &[Option<&[usize]>], attention: Attention, layers: usize, tracer: Option<&dyn Tracer>, kv: &mut KvStorage, scratch: &mut Scratch) {
        let layout = kv.layout().clone();
        let (window, sparse) = (attention.window(), attention.sparse());
        assert!(window.is_none() || layout.num_groups() == 1, "a KV window needs a one-group layout");
        if let Some(sparse) = sparse {
            kv.keep_sparse_state(sparse.budget_blocks(kv.shape.block_size));
        }
        let mut views = Vec::new();
        let positions: Vec<usize> = seqs
            .iter()
            .enumerate()
            .flat_map(|(i, s)| match positions.get(i).copied().flatten() {
                Some(p) => {
                    assert_eq!(p.len(), s.tokens.len(), "a position per token");
                    p.to_vec()
                }
                None => (s.start_pos..s.start_pos + s.tokens.len()).collect(),
            })
            .collect();
        let places: Vec<Vec<Place>> = (0..layout.num_groups()).map(|g| self.places(seqs, g, window, kv, &mut views)).collect();
        let queries: Vec<Vec<QueryPos>> = places
            .iter()
            .enumerate()
            .map(|(g, places)| places.iter().map(|&(i, v, pos)| QueryPos { block_table: v.map_or(&seqs[i].block_tables[g][..], |v| &views[v][..]), pos }).collect())
            .collect();
        debug_assert!(!positions.is_empty(), "a step has tokens");
        let c = &self.config;
        // (a hybrid model's conv layers read them; empty for the others)
        let (seq_of, states): (Vec<usize>, Vec<Option<u32>>) = match c.short_conv {
            Some(_) => (seqs.iter().enumerate().flat_map(|(i, s)| std::iter::repeat_n(i, s.tokens.len())).collect(), seqs.iter().map(|s| s.state).collect()),
            None => Default::default(),
        };
        self.embed(seqs, scratch);
        for il in 0..layers {
            let rope = if c.layer_window(il).is_some() { &self.rope_local } else { &self.rope_global };
            let (g, kv_layer) = layout.place(il);
            // sparse attention in full-attention layers (a sliding-window layer reads its window)
            let sparse = sparse.filter(|_| c.layer_window(il).is_none());
            let ctx = LayerCtx { cfg: c, file: &self.file, layer: il, kv_layer, rope, queries: &queries[g], positions: &positions, numerics: self.numerics, sparse, tracer, seq_of: &seq_of, states: &states };
            self.weights.layers.forward(&ctx, kv, scratch);
        }
    }

    /// Teacher forcing: the logits after every token of `tokens` (`[tokens.len(), vocab]`), computed in
    /// steps of `chunk` tokens over a KV storage of its own. For parity checks and perplexity; generation
    /// goes through the engine.
    pub fn logits_of(&self, tokens: &[u32], chunk: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(tokens.len() * self.config.vocab_size);
        self.for_each_logits(tokens, chunk, |row| out.extend_from_slice(row));
        out
    }

    /// `logits_of` without keeping them: `f` gets each position's logits (`[vocab]`) in order.
    pub fn for_each_logits(&self, tokens: &[u32], chunk: usize, f: impl FnMut(&[f32])) {
        self.for_each_logits_with(tokens, chunk, Attention::Full, f)
    }

    /// `for_each_logits` under a KV window (`kv::window`) or sparse attention (`kv::sparse`).
    pub fn for_each_logits_with(&self, tokens: &[u32], chunk: usize, attention: Attention, mut f: impl FnMut(&[f32])) {
        const BLOCK_SIZE: usize = 16;
        let chunk = chunk.max(1);
        let mut kv = self.new_kv(BLOCK_SIZE, tokens.len().div_ceil(BLOCK_SIZE).max(1));
        let tables = vec![(0..kv.shape.num_blocks as u32).collect::<Vec<u32>>()];
        let mut scratch = Scratch::default();
        for (i, part) in tokens.chunks(chunk).enumerate() {
            // one sequence: recurrent-state slot 0 of this storage
            let state = self.config.short_conv.as_ref().map(|_| 0);
            let input = SeqInput { tokens: part, start_pos: i * chunk, block_tables: &tables, logits: LogitsWanted::All, state };
            self.forward_at(&[input], &[], attention, &mut kv, &mut scratch).chunks_exact(self.config.vocab_size).for_each(&mut f);
        }
    }

    /// Each token's place for attention in layer group `group` (its block table and position in it, as a
    /// `Place`).
    /// It differs from its position in the sequence (RoPE's) only under a window that skips part of the
    /// sequence: the query then reads through a view (`KvWindow::view`, kept in `views`), one per block
    /// it starts in. The engine validated the token ids and the scheduler sized the block tables; here
    /// they are only asserted in debug builds (an out-of-range id or block would still stop at a bounds
    /// check, never read past a buffer).
    fn places(&self, seqs: &[SeqInput], group: usize, window: Option<KvWindow>, kv: &KvStorage, views: &mut Vec<Vec<u32>>) -> Vec<Place> {
        let bs = kv.shape.block_size;
        let mut places = Vec::new();
        for (i, s) in seqs.iter().enumerate() {
            let end = s.start_pos + s.tokens.len();
            let table = &s.block_tables[group];
            debug_assert!(s.tokens.iter().all(|&t| (t as usize) < self.config.vocab_size), "token ids within the vocabulary");
            debug_assert!(table.len() * bs >= end, "the block table holds {end} positions");
            debug_assert!(table.iter().all(|&b| (b as usize) < kv.shape.num_blocks || b == NULL_BLOCK), "blocks within the KV storage");
            for pos in s.start_pos..end {
                match window.and_then(|w| (!w.gap(pos, bs).is_empty()).then_some(w)) {
                    Some(w) => {
                        // queries whose gap ends in the same block share a view
                        let first_live = w.first_live(pos, bs);
                        let same = matches!(places.last(), Some(&(j, Some(_), _)) if j == i && w.first_live(pos - 1, bs) == first_live);
                        if !same {
                            views.push(w.view(table, pos, bs).expect("a gap").0);
                        }
                        places.push((i, Some(views.len() - 1), pos - w.gap(pos, bs).len()));
                    }
                    None => places.push((i, None, pos)),
                }
            }
        }
        places
    }

    /// Fills the residual stream with token embeddings (times the architecture's scale, if any).
    fn embed(&self, seqs: &[SeqInput], scratch: &mut Scratch) {
        let d = self.config.d_model;
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        scratch.residual.reset(tokens.len() * d);
        let table = self.weights.embed.view(&self.file);
        let row_bytes = table.dtype.row_bytes(d).expect("checked at load");
        for (out, &t) in scratch.residual.x.chunks_exact_mut(d).zip(&tokens) {
            dequantize_row(table.dtype, &table.bytes[t as usize * row_bytes..][..row_bytes], out);
        }
        if let Some(scale) = self.config.embed_scale {
            ops::scale_inplace(&mut scratch.residual.x, scale);
        }
    }
}

/// A token's place for attention: its sequence, the view it reads through (an index into the step's
/// views) or none (its block table), and its position in what it reads.
type Place = (usize, Option<usize>, usize);

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

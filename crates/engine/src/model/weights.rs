//! Locating and checking the weights of a model in its GGUF file. With ggml numerics the matrices stay
//! in the memory map (only their byte ranges are kept); with packed numerics each matrix of a packable
//! type is repacked into owned memory once (`quant::packed`) and its pages of the map are released.
//! Small vectors (norms, biases) are copied out as f32.

use super::block::LayerCtx;
use super::config::{Arch, ModelConfig};
use super::{gemma3, lfm2, llama, phi3, qwen2, qwen3, qwen3moe, Scratch};
use crate::kv::KvStorage;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kernels::matmul::QMatrix;
use crate::huge_buf::HugeBuf;
use crate::kernels::packed::{self, Numerics, PackedMatrix, PackedShape};
use crate::kernels::ggml::Line;
use crate::kernels::ggml::{dequantize_row, GgmlType};
use std::sync::Arc;

/// A weight matrix `[rows (out features), cols (in features)]` inside the file's bytes, and its packed
/// copy when the model runs with packed numerics.
#[derive(Clone)]
pub struct Linear {
    pub dtype: GgmlType,
    pub rows: usize,
    pub cols: usize,
    offset: usize,
    len: usize,
    packed: Option<Arc<PackedMatrix>>,
}

impl Linear {
    pub fn view<'a>(&'a self, file: &'a GgufFile) -> QMatrix<'a> {
        QMatrix { dtype: self.dtype, rows: self.rows, cols: self.cols, bytes: &file.raw()[self.offset..self.offset + self.len], packed: self.packed.as_deref() }
    }

    /// Packs this matrix (a packable type) into `out`, its pages of the map released as the packing
    /// reads past them.
    fn pack_into(&self, file: &GgufFile, out: &mut [Line]) -> PackedShape {
        let bytes = &file.raw()[self.offset..self.offset + self.len];
        let release = |r: std::ops::Range<usize>| file.release_range(self.offset + r.start, r.len());
        packed::pack_into(self.dtype, self.rows, self.cols, bytes, &release, out)
    }
}

/// Every layer's weights, in the layout of the model's architecture (qwen2's block is llama's).
pub(super) enum Layers {
    /// llama's block: llama, qwen2 (q/k/v biases), qwen3 (q/k norms), phi3 (fused matrices, split).
    Llama(Vec<llama::Layer>),
    Qwen3Moe(Vec<qwen3moe::Layer>),
    Gemma3(Vec<gemma3::Layer>),
    Lfm2(Vec<lfm2::Layer>),
}

impl Layers {
    fn load(ld: &Loader, cfg: &ModelConfig) -> Result<Layers> {
        let n = cfg.n_layers;
        Ok(match cfg.arch {
            Arch::Llama => Layers::Llama((0..n).map(|i| llama::Layer::load(ld, cfg, i)).collect::<Result<_>>()?),
            Arch::Qwen2 => Layers::Llama((0..n).map(|i| qwen2::load_layer(ld, cfg, i)).collect::<Result<_>>()?),
            Arch::Qwen3 => Layers::Llama((0..n).map(|i| qwen3::load_layer(ld, cfg, i)).collect::<Result<_>>()?),
            Arch::Phi3 => Layers::Llama((0..n).map(|i| phi3::load_layer(ld, cfg, i)).collect::<Result<_>>()?),
            Arch::Qwen3Moe => Layers::Qwen3Moe((0..n).map(|i| qwen3moe::Layer::load(ld, cfg, i)).collect::<Result<_>>()?),
            Arch::Gemma3 => Layers::Gemma3((0..n).map(|i| gemma3::Layer::load(ld, cfg, i)).collect::<Result<_>>()?),
            Arch::Lfm2 => Layers::Lfm2((0..n).map(|i| lfm2::Layer::load(ld, cfg, i)).collect::<Result<_>>()?),
        })
    }

    pub fn forward(&self, ctx: &LayerCtx, kv: &mut KvStorage, s: &mut Scratch) {
        match self {
            Layers::Llama(layers) => layers[ctx.layer].forward(ctx, kv, s),
            Layers::Qwen3Moe(layers) => layers[ctx.layer].forward(ctx, kv, s),
            Layers::Gemma3(layers) => layers[ctx.layer].forward(ctx, kv, s),
            Layers::Lfm2(layers) => layers[ctx.layer].forward(ctx, kv, s),
        }
    }

    fn matrices_mut(&mut self) -> Vec<&mut Linear> {
        match self {
            Layers::Llama(layers) => layers.iter_mut().flat_map(llama::Layer::matrices_mut).collect(),
            Layers::Qwen3Moe(layers) => layers.iter_mut().flat_map(qwen3moe::Layer::matrices_mut).collect(),
            Layers::Gemma3(layers) => layers.iter_mut().flat_map(gemma3::Layer::matrices_mut).collect(),
            Layers::Lfm2(layers) => layers.iter_mut().flat_map(lfm2::Layer::matrices_mut).collect(),
        }
    }
}

pub(super) struct Weights {
    /// RoPE frequency factors (`[rot_dim / 2]`), where the config names a tensor of them.
    pub rope_factors: Option<Vec<f32>>,
    pub embed: Linear,         // [vocab, d_model]
    pub output_norm: Vec<f32>, // [d_model]
    pub output: Linear,        // [vocab, d_model]; the embedding itself when tied
    pub layers: Layers,
}

/// Finds tensors by name and checks their shapes.
pub(super) struct Loader<'a> {
    file: &'a GgufFile,
}

impl Loader<'_> {
    pub fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear> {
        let info = self.file.tensor_info(name).ok_or_else(|| Error::Metadata(format!("missing tensor {name:?}")))?;
        if info.dims.len() != 2 || info.dims[0] as usize != cols || info.dims[1] as usize != rows {
            return Err(Error::Metadata(format!(
                "tensor {name:?} has shape {:?}, expected [{cols}, {rows}]",
                info.dims
            )));
        }
        if !info.dtype.has_vec_dot() {
            return Err(Error::Unsupported(format!("tensor {name:?} has type {} which has no matmul kernel", info.dtype.name())));
        }
        Ok(Linear { dtype: info.dtype, rows, cols, offset: info.file_offset as usize, len: info.num_bytes as usize, packed: None })
    }

    pub fn has(&self, name: &str) -> bool {
        self.file.tensor_info(name).is_some()
    }

    /// Rows `first..first + rows` of a `[total_rows, cols]` matrix, as a matrix of their own: a fused
    /// tensor's parts (phi3's qkv and gate_up). A row's dot is the same whichever matrix holds it.
    pub fn linear_rows(&self, name: &str, total_rows: usize, first: usize, rows: usize, cols: usize) -> Result<Linear> {
        let whole = self.linear(name, total_rows, cols)?;
        let row_bytes = whole.len / total_rows;
        Ok(Linear { rows, offset: whole.offset + first * row_bytes, len: rows * row_bytes, ..whole })
    }

    /// The `n` expert matrices `[rows, cols]` of a 3-d expert tensor (GGUF dims `[cols, rows, n]`).
    pub fn experts(&self, name: &str, n: usize, rows: usize, cols: usize) -> Result<Vec<Linear>> {
        let info = self.file.tensor_info(name).ok_or_else(|| Error::Metadata(format!("missing tensor {name:?}")))?;
        if info.dims[..] != [cols as u64, rows as u64, n as u64] {
            return Err(Error::Metadata(format!("tensor {name:?} has shape {:?}, expected [{cols}, {rows}, {n}]", info.dims)));
        }
        if !info.dtype.has_vec_dot() {
            return Err(Error::Unsupported(format!("tensor {name:?} has type {} which has no matmul kernel", info.dtype.name())));
        }
        let len = info.num_bytes as usize / n;
        Ok((0..n).map(|e| Linear { dtype: info.dtype, rows, cols, offset: info.file_offset as usize + e * len, len, packed: None }).collect())
    }

    pub fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.file.tensor(name)?;
        if t.dims.iter().product::<u64>() != len as u64 {
            return Err(Error::Metadata(format!("tensor {name:?} has shape {:?}, expected [{len}]", t.dims)));
        }
        let mut out = vec![0.0; len];
        dequantize_row(t.dtype, t.bytes, &mut out);
        Ok(out)
    }
}

pub(super) fn load_weights(file: &GgufFile, cfg: &ModelConfig, numerics: Numerics) -> Result<Weights> {
    let ld = Loader { file };
    let d = cfg.d_model;
    let embed = ld.linear("token_embd.weight", cfg.vocab_size, d)?;
    let output = match file.tensor_info("output.weight") {
        Some(_) => ld.linear("output.weight", cfg.vocab_size, d)?,
        None => embed.clone(),
    };
    let layers = Layers::load(&ld, cfg)?;
    let rope_factors = cfg.rope_freq_factors.map(|name| ld.vector(name, cfg.rot_dim / 2)).transpose()?;
    let weights = Weights { rope_factors, embed, output_norm: ld.vector(if cfg.arch == Arch::Lfm2 { "token_embd_norm.weight" } else { "output_norm.weight" }, d)?, output, layers };
    Ok(match numerics {
        Numerics::Ggml => weights,
        Numerics::Packed => pack_weights(file, weights),
    })
}

/// Packs every matrix (the embedding table is still looked up by row from the map), in parallel over
/// the matrices, releasing the map's pages as the packing passes them: the packed copies take about the
/// file's size, and the map's pages of them do not stay resident beside them. All packed matrices share
/// one arena that may live on 2 MiB pages (`HugeBuf`): a step reads every weight once, and on 4 KiB
/// pages that was a TLB miss every 4 KiB of the stream (most matrices of a small model are below the
/// size a buffer of their own would get huge pages for).
fn pack_weights(file: &GgufFile, mut w: Weights) -> Weights {
    let started = std::time::Instant::now();
    let mut all: Vec<&mut Linear> = w.layers.matrices_mut();
    all.push(&mut w.output);
    all.retain(|l| packed::packable(l.dtype));
    let shapes: Vec<PackedShape> = all.iter().map(|l| PackedShape::new(l.dtype, l.rows, l.cols)).collect();
    let mut arena = HugeBuf::<Line>::zeroed(shapes.iter().map(PackedShape::lines).sum());
    // Each matrix's lines, split off the arena in order.
    let mut firsts = Vec::with_capacity(shapes.len());
    let mut outs: Vec<&mut [Line]> = Vec::with_capacity(shapes.len());
    let (mut rest, mut first) = (&mut arena[..], 0);
    for shape in &shapes {
        let (mine, after) = std::mem::take(&mut rest).split_at_mut(shape.lines());
        outs.push(mine);
        firsts.push(first);
        first += shape.lines();
        rest = after;
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let jobs: Vec<std::sync::Mutex<(&Linear, &mut [Line])>> = all.iter().map(|l| &**l).zip(outs).map(std::sync::Mutex::new).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(job) = jobs.get(i) else { break };
                let mut job = job.lock().expect("one packer per matrix");
                let (lin, out) = &mut *job;
                lin.pack_into(file, out);
            });
        }
    });
    drop(jobs);
    let arena = Arc::new(arena);
    for ((lin, shape), first) in all.into_iter().zip(shapes).zip(firsts) {
        lin.packed = Some(Arc::new(PackedMatrix::in_arena(shape, arena.clone(), first)));
    }
    tracing::info!("packed {} MiB of weights in {} ms", (arena.len() * 64) >> 20, started.elapsed().as_millis());
    w
}

//! Locating and checking the weights of a model in its GGUF file. With ggml numerics the matrices stay
//! in the memory map (only their byte ranges are kept); with packed numerics each matrix of a packable
//! type is repacked into owned memory once (`quant::packed`) and its pages of the map are released.
//! Small vectors (norms, biases) are copied out as f32.

use super::config::ModelConfig;
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::matmul::QMatrix;
use crate::huge_buf::HugeBuf;
use crate::quant::packed::{self, Numerics, PackedMatrix, PackedShape};
use crate::quant::Line;
use crate::quant::{dequantize_row, GgmlType};
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

/// One decoder block. Optional parts exist only in some architectures.
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,   // [d_model]
    pub wq: Linear,            // [q_dim, d_model]
    pub wk: Linear,            // [kv_dim, d_model]
    pub wv: Linear,            // [kv_dim, d_model]
    pub wo: Linear,            // [d_model, q_dim]
    pub bq: Option<Vec<f32>>,  // [q_dim]   qwen2
    pub bk: Option<Vec<f32>>,  // [kv_dim]  qwen2
    pub bv: Option<Vec<f32>>,  // [kv_dim]  qwen2
    pub q_norm: Option<Vec<f32>>, // [head_dim] gemma3
    pub k_norm: Option<Vec<f32>>, // [head_dim] gemma3
    pub post_attn_norm: Option<Vec<f32>>, // [d_model] gemma3
    pub ffn_norm: Vec<f32>,    // [d_model]
    pub w_gate: Linear,        // [ffn_dim, d_model]
    pub w_up: Linear,          // [ffn_dim, d_model]
    pub w_down: Linear,        // [d_model, ffn_dim]
    pub post_ffn_norm: Option<Vec<f32>>, // [d_model] gemma3
}

pub struct Weights {
    pub embed: Linear,        // [vocab, d_model]
    pub output_norm: Vec<f32>, // [d_model]
    pub output: Linear,       // [vocab, d_model]; the embedding itself when tied
    pub layers: Vec<LayerWeights>,
}

struct Loader<'a> {
    file: &'a GgufFile,
}

impl Loader<'_> {
    fn linear(&self, name: &str, rows: usize, cols: usize) -> Result<Linear> {
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

    fn vector(&self, name: &str, len: usize) -> Result<Vec<f32>> {
        let t = self.file.tensor(name)?;
        if t.dims.iter().product::<u64>() != len as u64 {
            return Err(Error::Metadata(format!("tensor {name:?} has shape {:?}, expected [{len}]", t.dims)));
        }
        let mut out = vec![0.0; len];
        dequantize_row(t.dtype, t.bytes, &mut out);
        Ok(out)
    }

    fn optional_vector(&self, name: &str, len: usize) -> Result<Option<Vec<f32>>> {
        match self.file.tensor_info(name) {
            None => Ok(None),
            Some(_) => self.vector(name, len).map(Some),
        }
    }
}

pub fn load_weights(file: &GgufFile, cfg: &ModelConfig, numerics: Numerics) -> Result<Weights> {
    let ld = Loader { file };
    let (d, q, kv, ff) = (cfg.d_model, cfg.q_dim(), cfg.kv_dim(), cfg.ffn_dim);
    let embed = ld.linear("token_embd.weight", cfg.vocab_size, d)?;
    let output = match file.tensor_info("output.weight") {
        Some(_) => ld.linear("output.weight", cfg.vocab_size, d)?,
        None => embed.clone(),
    };
    let layers = (0..cfg.n_layers)
        .map(|i| {
            let n = |s: &str| format!("blk.{i}.{s}");
            Ok(LayerWeights {
                attn_norm: ld.vector(&n("attn_norm.weight"), d)?,
                wq: ld.linear(&n("attn_q.weight"), q, d)?,
                wk: ld.linear(&n("attn_k.weight"), kv, d)?,
                wv: ld.linear(&n("attn_v.weight"), kv, d)?,
                wo: ld.linear(&n("attn_output.weight"), d, q)?,
                bq: ld.optional_vector(&n("attn_q.bias"), q)?,
                bk: ld.optional_vector(&n("attn_k.bias"), kv)?,
                bv: ld.optional_vector(&n("attn_v.bias"), kv)?,
                q_norm: ld.optional_vector(&n("attn_q_norm.weight"), cfg.head_dim)?,
                k_norm: ld.optional_vector(&n("attn_k_norm.weight"), cfg.head_dim)?,
                post_attn_norm: ld.optional_vector(&n("post_attention_norm.weight"), d)?,
                ffn_norm: ld.vector(&n("ffn_norm.weight"), d)?,
                w_gate: ld.linear(&n("ffn_gate.weight"), ff, d)?,
                w_up: ld.linear(&n("ffn_up.weight"), ff, d)?,
                w_down: ld.linear(&n("ffn_down.weight"), d, ff)?,
                post_ffn_norm: ld.optional_vector(&n("post_ffw_norm.weight"), d)?,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let weights = Weights { embed, output_norm: ld.vector("output_norm.weight", d)?, output, layers };
    Ok(match numerics {
        Numerics::Ggml => weights,
        Numerics::Packed => pack_weights(file, weights),
    })
}

impl LayerWeights {
    fn matrices_mut(&mut self) -> [&mut Linear; 7] {
        [&mut self.wq, &mut self.wk, &mut self.wv, &mut self.wo, &mut self.w_gate, &mut self.w_up, &mut self.w_down]
    }
}

/// Packs every matrix (the embedding table is still looked up by row from the map), in parallel over
/// the matrices, releasing the map's pages as the packing passes them: the packed copies take about the
/// file's size, and the map's pages of them do not stay resident beside them. All packed matrices share
/// one arena that may live on 2 MiB pages (`HugeBuf`): a step reads every weight once, and on 4 KiB
/// pages that was a TLB miss every 4 KiB of the stream (most matrices of a small model are below the
/// size a buffer of their own would get huge pages for).
fn pack_weights(file: &GgufFile, mut w: Weights) -> Weights {
    let started = std::time::Instant::now();
    let mut all: Vec<&mut Linear> = w.layers.iter_mut().flat_map(|l| l.matrices_mut()).collect();
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

//! Hyper-parameters of a decoder-only transformer, read once from GGUF metadata and validated.

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::ops::RopeStyle;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Gemma3,
}

impl Arch {
    pub fn from_name(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "gemma3" => Ok(Arch::Gemma3),
            other => Err(Error::Unsupported(format!(
                "architecture {other:?} (supported: llama, qwen2, gemma3)"
            ))),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gemma3 => "gemma3",
        }
    }
}

#[derive(Clone, Debug)]
pub struct ModelConfig {
    pub arch: Arch,
    pub n_layers: usize,
    pub d_model: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_dim: usize,
    pub vocab_size: usize,
    pub context_length: usize,
    pub norm_eps: f32,
    pub rope_style: RopeStyle,
    pub rope_base: f32,
    /// RoPE base of sliding-window layers, where it differs (gemma3: 10,000).
    pub rope_base_local: f32,
    /// Dimensions rotated per head (llama.cpp's n_rot).
    pub rot_dim: usize,
    /// Sliding-window size of local layers, if the model has them.
    pub sliding_window: Option<usize>,
    /// Every `swa_period`-th layer (1-based) is global; the others use the window (gemma3: 6).
    pub swa_period: usize,
    /// Multiplies q·k before softmax.
    pub attn_scale: f32,
    /// Apply `attn_scale` to q itself before attention (gemma3, as llama.cpp does) rather than to q·k.
    /// The results differ: q is rounded to f16 for the q·k product, and a scaled q loses more bits.
    pub scale_q_first: bool,
}

impl ModelConfig {
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = Arch::from_name(file.get_str("general.architecture")?)?;
        let a = arch.name();
        let key = |k: &str| format!("{a}.{k}");
        let usize_key = |k: &str| file.get_u64(&key(k)).map(|v| v as usize);
        let n_heads = usize_key("attention.head_count")?;
        let d_model = usize_key("embedding_length")?;
        if n_heads == 0 || d_model == 0 {
            return Err(Error::Metadata("head_count and embedding_length must be positive".into()));
        }
        let n_kv_heads = usize_key("attention.head_count_kv").unwrap_or(n_heads);
        let head_dim = usize_key("attention.key_length").unwrap_or(d_model / n_heads);
        let vocab_size = match usize_key("vocab_size") {
            Ok(v) => v,
            Err(_) => file.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        let (rope_style, rope_base_local, sliding_window, swa_period, attn_scale) = match arch {
            Arch::Llama => (RopeStyle::Interleaved, 0.0, None, 1, 1.0 / (head_dim as f32).sqrt()),
            Arch::Qwen2 => (RopeStyle::Neox, 0.0, None, 1, 1.0 / (head_dim as f32).sqrt()),
            Arch::Gemma3 => {
                let window = usize_key("attention.sliding_window")?;
                (RopeStyle::Neox, 10_000.0, Some(window), 6, 1.0 / (head_dim as f32).sqrt())
            }
        };
        let cfg = ModelConfig {
            arch,
            n_layers: usize_key("block_count")?,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            ffn_dim: usize_key("feed_forward_length")?,
            vocab_size,
            context_length: usize_key("context_length")?,
            norm_eps: file.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            rope_style,
            rope_base: file.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0),
            rope_base_local,
            rot_dim: usize_key("rope.dimension_count").unwrap_or(head_dim),
            sliding_window,
            swa_period,
            attn_scale,
            scale_q_first: arch == Arch::Gemma3,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Metadata(m));
        if self.n_kv_heads == 0 || self.n_heads % self.n_kv_heads != 0 {
            return bad(format!("head_count {} is not a multiple of head_count_kv {}", self.n_heads, self.n_kv_heads));
        }
        if self.rot_dim > self.head_dim || self.rot_dim % 2 != 0 {
            return bad(format!("rope dimension {} does not fit head size {}", self.rot_dim, self.head_dim));
        }
        if self.n_layers == 0 || self.ffn_dim == 0 || self.vocab_size == 0 {
            return bad("block_count, feed_forward_length and vocab size must be positive".into());
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// KV-cache bytes one token takes: keys and values of every layer, f16.
    pub fn kv_f16_bytes_per_token(&self) -> usize {
        2 * self.n_layers * self.kv_dim() * 2
    }
    /// The sliding window of layer `il`, or None for a global layer.
    pub fn layer_window(&self, il: usize) -> Option<usize> {
        self.sliding_window.filter(|_| il % self.swa_period < self.swa_period - 1)
    }
}

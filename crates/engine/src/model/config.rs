//! Hyper-parameters of a decoder-only transformer, read once from GGUF metadata and validated. What all
//! architectures share is read here (`Meta::common`); each architecture's file sets what is its
//! own (RoPE layout, sliding windows, scales).

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::kernels::ops::RopeStyle;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen2,
    Qwen3,
    Qwen3Moe,
    Phi3,
    Gemma3,
    Lfm2,
}

impl Arch {
    pub fn from_name(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            "qwen3moe" => Ok(Arch::Qwen3Moe),
            "phi3" => Ok(Arch::Phi3),
            "gemma3" => Ok(Arch::Gemma3),
            "lfm2" => Ok(Arch::Lfm2),
            other => Err(Error::Unsupported(format!("architecture {other:?} (supported: llama, qwen2, qwen3, qwen3moe, phi3, gemma3, lfm2)"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Phi3 => "phi3",
            Arch::Gemma3 => "gemma3",
            Arch::Lfm2 => "lfm2",
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
    /// Multiplies the token embeddings (gemma3: sqrt(d_model)).
    pub embed_scale: Option<f32>,
    /// Per-pair RoPE frequency divisors, from a tensor of the file (`rope_freqs.weight`: Llama 3.x's
    /// long-context scaling; phi3's `rope_factors_short.weight`), `[rot_dim / 2]`.
    pub rope_freq_factors: Option<&'static str>,
    /// A mixture-of-experts feed-forward in every layer (qwen3moe).
    pub moe: Option<MoeConfig>,
    /// Gated short-convolution layers in place of attention in some layers (lfm2): a recurrent state
    /// per sequence (`kv::ConvStates`).
    pub short_conv: Option<ShortConv>,
    /// What the architecture can run (`model::capabilities`), declared by its own `config()`.
    pub capabilities: super::Capabilities,
}

/// Which layers are short convolutions, over how many positions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShortConv {
    /// Positions a convolution reads (its own and the `l_cache - 1` before it): lfm2's 3.
    pub l_cache: usize,
    /// Per layer: a convolution (true) or attention.
    pub is_conv: Vec<bool>,
}

impl ShortConv {
    /// f32 values of one sequence's state: per conv layer, `d_model` channels of `l_cache - 1`.
    pub fn state_len(&self, d_model: usize) -> usize {
        self.is_conv.iter().filter(|&&c| c).count() * d_model * (self.l_cache - 1)
    }

    /// Index among the conv layers of conv layer `il`.
    pub fn conv_index(&self, il: usize) -> usize {
        self.is_conv[..il].iter().filter(|&&c| c).count()
    }
}

/// A mixture-of-experts feed-forward: a router picks `n_used` of `n_expert` SwiGLU experts per token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    pub n_expert: usize,
    pub n_used: usize,
    /// Each expert's hidden size.
    pub ffn_dim: usize,
    /// The chosen experts' softmax weights are renormalised to sum to one (qwen3moe).
    pub norm_weights: bool,
}

impl ModelConfig {
    /// The configuration of the GGUF file's architecture.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let arch = Arch::from_name(file.get_str("general.architecture")?)?;
        let meta = Meta { file, arch };
        let cfg = match arch {
            Arch::Llama => super::llama::config(&meta)?,
            Arch::Qwen2 => super::qwen2::config(&meta)?,
            Arch::Qwen3 => super::qwen3::config(&meta)?,
            Arch::Qwen3Moe => super::qwen3moe::config(&meta)?,
            Arch::Phi3 => super::phi3::config(&meta)?,
            Arch::Gemma3 => super::gemma3::config(&meta)?,
            Arch::Lfm2 => super::lfm2::config(&meta)?,
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
        if let Some(m) = self.moe {
            if m.n_expert == 0 || m.n_used == 0 || m.n_used > m.n_expert || m.ffn_dim == 0 {
                return bad(format!("{} experts, {} used per token, of size {}: need 0 < used <= experts and a size", m.n_expert, m.n_used, m.ffn_dim));
            }
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// KV-cache bytes one token takes: keys and values of every layer that keeps them, f16.
    pub fn kv_f16_bytes_per_token(&self) -> usize {
        2 * self.kv_layers() * self.kv_dim() * 2
    }

    /// Whether layer `il` keeps keys and values (not a hybrid's recurrent layer).
    pub fn has_kv(&self, il: usize) -> bool {
        self.short_conv.as_ref().is_none_or(|sc| !sc.is_conv[il])
    }

    /// Layers that keep keys and values.
    pub fn kv_layers(&self) -> usize {
        (0..self.n_layers).filter(|&il| self.has_kv(il)).count()
    }

    /// The sliding window of layer `il`, or None for a global layer.
    pub fn layer_window(&self, il: usize) -> Option<usize> {
        self.sliding_window.filter(|_| il % self.swa_period < self.swa_period - 1)
    }
}

/// An architecture's metadata keys (`{arch}.{key}`), each missing required key a clear error.
pub(super) struct Meta<'a> {
    pub file: &'a GgufFile,
    pub arch: Arch,
}

impl Meta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch.name())
    }

    pub fn usize(&self, k: &str) -> Result<usize> {
        self.file.get_u64(&self.key(k)).map(|v| v as usize)
    }

    pub fn f32(&self, k: &str) -> Result<f32> {
        self.file.get_f32(&self.key(k))
    }

    pub fn str(&self, k: &str) -> Result<&str> {
        self.file.get_str(&self.key(k))
    }

    /// RoPE scaling a file asks for with `rope.scaling.type`: none is the only one computed as such
    /// here (Llama 3.x and phi3 scale through frequency-factor tensors instead, which carry no type);
    /// linear and YaRN are refused, not run unscaled.
    fn check_rope_scaling(&self) -> Result<()> {
        match self.str("rope.scaling.type") {
            Err(_) | Ok("none") => Ok(()),
            Ok(other) => Err(Error::Unsupported(format!("{} = {other:?} (RoPE scaling other than frequency-factor tensors)", self.key("rope.scaling.type")))),
        }
    }

    /// The fields every architecture has, with llama's conventions (interleaved RoPE, no windows,
    /// 1/sqrt(head_dim) on q·k); an architecture changes what differs.
    pub fn common(&self, rope_style: RopeStyle) -> Result<ModelConfig> {
        let n_heads = self.usize("attention.head_count")?;
        let d_model = self.usize("embedding_length")?;
        if n_heads == 0 || d_model == 0 {
            return Err(Error::Metadata("head_count and embedding_length must be positive".into()));
        }
        let head_dim = self.usize("attention.key_length").unwrap_or(d_model / n_heads);
        self.check_rope_scaling()?;
        if matches!(self.file.get(&self.key("attention.head_count_kv")), Some(v) if v.as_array().is_some()) && self.arch != Arch::Lfm2 {
            return Err(Error::Unsupported(format!("{} as a per-layer list (a hybrid layout {} does not have)", self.key("attention.head_count_kv"), self.arch.name())));
        }
        let vocab_size = match self.usize("vocab_size") {
            Ok(v) => v,
            Err(_) => self.file.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        Ok(ModelConfig {
            arch: self.arch,
            n_layers: self.usize("block_count")?,
            d_model,
            n_heads,
            n_kv_heads: self.usize("attention.head_count_kv").unwrap_or(n_heads),
            head_dim,
            ffn_dim: self.usize("feed_forward_length")?,
            vocab_size,
            context_length: self.usize("context_length")?,
            norm_eps: self.f32("attention.layer_norm_rms_epsilon")?,
            rope_style,
            rope_base: self.f32("rope.freq_base").unwrap_or(10_000.0),
            rope_base_local: 0.0,
            rot_dim: self.usize("rope.dimension_count").unwrap_or(head_dim),
            sliding_window: None,
            swa_period: 1,
            attn_scale: 1.0 / (head_dim as f32).sqrt(),
            scale_q_first: false,
            embed_scale: None,
            rope_freq_factors: None,
            moe: None,
            short_conv: None,
            capabilities: super::Capabilities::TRANSFORMER,
        })
    }
}

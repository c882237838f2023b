//! Element-wise and row-wise operations of the forward pass, on plain f32 slices.
//! Shapes are row-major: `[n_tokens, dim]` means token t's vector is `x[t*dim..(t+1)*dim]`.

use half::f16;

/// RMSNorm of every `dim`-long row of `x` into `out`: out = x / sqrt(mean(x²) + eps) * weight.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (row, out_row) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let scale = rms_scale(row, eps);
        for ((o, &v), &w) in out_row.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// RMSNorm in place (used for per-head q/k norms, where rows are heads).
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    for row in x.chunks_exact_mut(dim) {
        let scale = rms_scale(row, eps);
        for (v, &w) in row.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    }
}

fn rms_scale(row: &[f32], eps: f32) -> f32 {
    // ggml squares in f32 and sums in f64 (ggml_float), in order; do the same so rounding matches.
    let sum: f64 = row.iter().map(|&v| (v * v) as f64).sum();
    let mean = (sum / row.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

/// `acc += x`, element-wise (residual connections).
pub fn add_inplace(acc: &mut [f32], x: &[f32]) {
    acc.iter_mut().zip(x).for_each(|(a, &b)| *a += b);
}

/// Adds a bias vector to every row.
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_inplace(row, bias);
    }
}

pub fn scale_inplace(x: &mut [f32], s: f32) {
    x.iter_mut().for_each(|v| *v *= s);
}

/// GeGLU with the tanh approximation of GELU (Gemma): gate = gelu_tanh(gate) * up.
///
/// As ggml's CPU backend (GGML_GELU_FP16): the input is rounded to f16 and GELU is looked up in a table
/// of f16 results, exact outside (-10, 10). Computing it in f32 instead flips gemma3's greedy tokens
/// against llama.cpp noticeably often, so we reproduce the rounding.
pub fn gelu_mul(gate: &mut [f32], up: &[f32]) {
    let table = gelu_f16_table();
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = if x <= -10.0 {
            0.0
        } else if x >= 10.0 {
            x * u
        } else {
            table[f16::from_f32(x).to_bits() as usize].to_f32() * u
        };
    }
}

fn gelu_f32(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044715;
    // ggml's C is compiled with FMA contraction: `1.0f + GELU_COEF_A*x*x` becomes one fused multiply-add.
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (COEF_A * x).mul_add(x, 1.0)).tanh())
}

/// GELU of every f16 value, indexed by its bits.
fn gelu_f16_table() -> &'static [f16] {
    static TABLE: std::sync::OnceLock<Vec<f16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| (0..=u16::MAX).map(|bits| f16::from_f32(gelu_f32(f16::from_bits(bits).to_f32()))).collect())
}

/// How rotary embeddings pair up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): llama.cpp's LLAMA_ROPE_TYPE_NORM (llama; its converter permutes q/k).
    Interleaved,
    /// Halves (i, i + d/2): LLAMA_ROPE_TYPE_NEOX (qwen2, gemma3).
    Neox,
}

/// Precomputed inverse frequencies for one RoPE configuration.
#[derive(Clone, Debug)]
pub struct Rope {
    pub style: RopeStyle,
    theta_scale: f32,
    half: usize,
}

impl Rope {
    /// `rot_dim`: rotated dimensions per head (llama.cpp's n_rot), `base`: rope.freq_base.
    pub fn new(style: RopeStyle, rot_dim: usize, base: f32) -> Self {
        // theta_i = pos * base^(-2i/rot_dim)
        let theta_scale = base.powf(-2.0 / rot_dim as f32);
        Rope { style, theta_scale, half: rot_dim / 2 }
    }

    /// Rotates every head of one token's `[n_heads, head_dim]` vector in place for position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has FMA, checked just above.
            return unsafe { self.apply_fma(x, head_dim, pos) };
        }
        self.apply_any(x, head_dim, pos)
    }

    /// `apply` compiled with FMA, so `mul_add` is one instruction rather than a libm call (the same
    /// correctly rounded result; the calls showed in decode profiles).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "fma")]
    unsafe fn apply_fma(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        self.apply_any(x, head_dim, pos)
    }

    #[inline(always)]
    fn apply_any(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        let half = self.half;
        // ggml builds theta as a running product starting from the position (pos·s·s·…), not pos·s^i;
        // the rounding differs, so do the same.
        let mut sin_cos = Vec::with_capacity(half);
        let mut theta = pos as f32;
        for _ in 0..half {
            sin_cos.push(theta.sin_cos());
            theta *= self.theta_scale;
        }
        for head in x.chunks_exact_mut(head_dim) {
            for (i, &(sin, cos)) in sin_cos.iter().enumerate() {
                let (a, b) = match self.style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                // ggml's C is compiled with FMA contraction (GCC's default -ffp-contract=fast): match it.
                head[a] = x0.mul_add(cos, -(x1 * sin));
                head[b] = x0.mul_add(sin, x1 * cos);
            }
        }
    }
}

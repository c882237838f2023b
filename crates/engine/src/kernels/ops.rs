//! Element-wise and row-wise operations of the forward pass, on plain f32 slices.
//! Shapes are row-major: `[n_tokens, dim]` means token t's vector is `x[t*dim..(t+1)*dim]`.
//!
//! Over a prefill-sized batch they run in parallel parts of whole rows (`par_rows`): every row is
//! computed as it would be alone, so results do not depend on the split. Run serially, these passes
//! left the second core spinning for ~9% of Gemma-3's prefill once the matmuls got fast.

use half::f16;

/// Elements below which a row-wise pass stays on the calling thread (a parallel run costs a few µs).
const PAR_MIN_ELEMS: usize = 16 << 10;

/// A raw pointer for parts that each touch their own rows.
#[derive(Clone, Copy)]
struct RowsPtr(*mut f32);
// SAFETY: `par_rows` hands every part a disjoint row range.
unsafe impl Send for RowsPtr {}
unsafe impl Sync for RowsPtr {}

/// `f(first_row, out_rows, in_rows)` over `out` (rows of `dim`) and `input` (the same number of rows,
/// `in_dim` wide; `in_dim` 0 for none), in parallel parts of whole rows when the pass is big enough.
pub fn par_rows(out: &mut [f32], dim: usize, input: &[f32], in_dim: usize, f: &(dyn Fn(usize, &mut [f32], &[f32]) + Sync)) {
    let n = out.len() / dim;
    debug_assert_eq!(n * dim, out.len());
    debug_assert!(in_dim == 0 || input.len() >= n * in_dim);
    let pool = crate::pool::current();
    let parts = (out.len() / PAR_MIN_ELEMS).clamp(1, 2 * pool.threads()).min(n);
    if parts <= 1 {
        return f(0, out, &input[..n * in_dim]);
    }
    let ptr = RowsPtr(out.as_mut_ptr());
    pool.run(parts, &|p| {
        let ptr = ptr; // the whole wrapper (Sync), not its raw field
        let rows = p * n / parts..(p + 1) * n / parts;
        // SAFETY: parts have disjoint row ranges inside `out`, which outlives the run.
        let o = unsafe { std::slice::from_raw_parts_mut(ptr.0.add(rows.start * dim), rows.len() * dim) };
        f(rows.start, o, &input[rows.start * in_dim..rows.end * in_dim]);
    });
}

/// RMSNorm of every `dim`-long row of `x` into `out`: out = x / sqrt(mean(x²) + eps) * weight.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    par_rows(&mut out[..x.len()], dim, x, dim, &|_, out, x| rms_norm_here(x, weight, eps, out));
}

/// `rms_norm` on the calling thread (for a part of a parallel run, e.g. a matmul's `FillRows`).
pub fn rms_norm_here(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (rows, out_rows) in x.chunks(SCALE_ROWS * dim).zip(out.chunks_mut(SCALE_ROWS * dim)) {
        let scales = rms_scales(rows, dim, eps);
        for ((row, out_row), &scale) in rows.chunks_exact(dim).zip(out_rows.chunks_exact_mut(dim)).zip(&scales) {
            for ((o, &v), &w) in out_row.iter_mut().zip(row).zip(weight) {
                *o = v * scale * w;
            }
        }
    }
}

/// Rows of a `[n, dim]` buffer handed out by range to the parts of a parallel run (each part its own
/// rows), while the buffer itself stays borrowed by whoever made this.
#[derive(Clone, Copy)]
pub struct SharedRows {
    ptr: RowsPtr,
    len: usize,
    dim: usize,
}

impl SharedRows {
    pub fn new(buf: &mut [f32], dim: usize) -> Self {
        SharedRows { ptr: RowsPtr(buf.as_mut_ptr()), len: buf.len(), dim }
    }

    /// Rows `first..last`.
    ///
    /// # Safety
    /// No one else uses these rows while the slice lives, and the buffer outlives it.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn rows(&self, first: usize, last: usize) -> &mut [f32] {
        assert!(first <= last && last * self.dim <= self.len, "rows {first}..{last} of a buffer of {} rows", self.len / self.dim);
        // SAFETY: in bounds (checked); exclusive by the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.0.add(first * self.dim), (last - first) * self.dim) }
    }
}

/// RMSNorm in place (used for per-head q/k norms, where rows are heads).
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    par_rows(x, dim, &[], 0, &|_, x, _| rms_norm_inplace_here(x, weight, eps));
}

/// `rms_norm_inplace` on the calling thread.
pub fn rms_norm_inplace_here(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    for rows in x.chunks_mut(SCALE_ROWS * dim) {
        let scales = rms_scales(rows, dim, eps);
        for (row, &scale) in rows.chunks_exact_mut(dim).zip(&scales) {
            for (v, &w) in row.iter_mut().zip(weight) {
                *v = *v * scale * w;
            }
        }
    }
}

/// Rows whose RMS sums run side by side.
const SCALE_ROWS: usize = 4;

/// `1 / sqrt(mean(x²) + eps)` of each of the (up to SCALE_ROWS) `dim`-long rows of `rows`. ggml squares
/// in f32 and sums in f64 (ggml_float), in order; each row keeps that one chain (the same bits), but the
/// rows' chains are interleaved: a lone chain waits on every f64 addition (hundreds per row), and at
/// decode batches these sums were 1.6% of a step with the second core idle.
fn rms_scales(rows: &[f32], dim: usize, eps: f32) -> [f32; SCALE_ROWS] {
    let n = rows.len() / dim;
    debug_assert!(n <= SCALE_ROWS && n * dim == rows.len());
    let mut sums = [0f64; SCALE_ROWS];
    if n == SCALE_ROWS {
        let r: [&[f32]; SCALE_ROWS] = std::array::from_fn(|k| &rows[k * dim..(k + 1) * dim]);
        for i in 0..dim {
            for k in 0..SCALE_ROWS {
                sums[k] += (r[k][i] * r[k][i]) as f64;
            }
        }
    } else {
        for (sum, row) in sums.iter_mut().zip(rows.chunks_exact(dim)) {
            *sum = row.iter().map(|&v| (v * v) as f64).sum();
        }
    }
    sums.map(|sum| {
        let mean = (sum / dim as f64) as f32;
        1.0 / (mean + eps).sqrt()
    })
}
/// `acc += x`, element-wise (residual connections).
pub fn add_inplace(acc: &mut [f32], x: &[f32]) {
    par_rows(acc, 1, x, 1, &|_, acc, x| acc.iter_mut().zip(x).for_each(|(a, &b)| *a += b));
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
    par_rows(gate, 1, up, 1, &|_, gate, up| {
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::ggml::math::avx512_available() {
            // SAFETY: the CPU has AVX-512 F and F16C (checked by avx512_available).
            let done = unsafe { gelu_mul_avx512(gate, up) };
            return gelu_mul_scalar(&mut gate[done..], &up[done..]);
        }
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::ggml::math::avx2_available() {
            // SAFETY: the CPU has AVX2 and F16C (checked by avx2_available).
            let done = unsafe { gelu_mul_avx2(gate, up) };
            return gelu_mul_scalar(&mut gate[done..], &up[done..]);
        }
        gelu_mul_scalar(gate, up)
    });
}

fn gelu_mul_scalar(gate: &mut [f32], up: &[f32]) {
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

/// `gelu_mul_scalar` 16 lanes at a time: round to f16 (`vcvtps2ph`, nearest even as `half`), gather the
/// table's f16 results, convert back; the same selects at ±10. Returns the elements done.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,f16c")]
unsafe fn gelu_mul_avx512(gate: &mut [f32], up: &[f32]) -> usize {
    use std::arch::x86_64::*;
    let table = gelu_f16_table().as_ptr() as *const u8;
    let n = gate.len().min(up.len()) / 16 * 16;
    let (lo, hi) = (_mm512_set1_ps(-10.0), _mm512_set1_ps(10.0));
    for i in (0..n).step_by(16) {
        let g = gate.as_mut_ptr().add(i);
        let x = _mm512_loadu_ps(g);
        let u = _mm512_loadu_ps(up.as_ptr().add(i));
        let bits = _mm512_cvtepu16_epi32(_mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(x));
        // 32-bit gathers at 2·bits (the table has one spare entry at the end for the top half).
        let looked = _mm512_i32gather_epi32::<2>(bits, table as *const i32);
        let gelu = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(looked));
        let mut r = _mm512_mul_ps(gelu, u);
        r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, hi), _mm512_mul_ps(x, u));
        r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask::<_CMP_LE_OQ>(x, lo), _mm512_setzero_ps());
        _mm512_storeu_ps(g, r);
    }
    n
}

/// `gelu_mul_avx512` on 8 lanes (the scalar loop and its f16 conversions were 3.3% of Gemma-3's AVX2
/// prefill samples).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn gelu_mul_avx2(gate: &mut [f32], up: &[f32]) -> usize {
    use std::arch::x86_64::*;
    let table = gelu_f16_table().as_ptr() as *const i32;
    let n = gate.len().min(up.len()) / 8 * 8;
    let (lo, hi) = (_mm256_set1_ps(-10.0), _mm256_set1_ps(10.0));
    let low16 = _mm256_set1_epi32(0xFFFF);
    for i in (0..n).step_by(8) {
        let g = gate.as_mut_ptr().add(i);
        let x = _mm256_loadu_ps(g);
        let u = _mm256_loadu_ps(up.as_ptr().add(i));
        let bits = _mm256_cvtepu16_epi32(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x));
        // 32-bit gathers at 2·bits, of which the low half is the entry.
        let looked = _mm256_and_si256(_mm256_i32gather_epi32::<2>(table, bits), low16);
        let halves = _mm_packus_epi32(_mm256_castsi256_si128(looked), _mm256_extracti128_si256::<1>(looked));
        let mut r = _mm256_mul_ps(_mm256_cvtph_ps(halves), u);
        r = _mm256_blendv_ps(r, _mm256_mul_ps(x, u), _mm256_cmp_ps::<_CMP_GE_OQ>(x, hi));
        r = _mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LE_OQ>(x, lo));
        _mm256_storeu_ps(g, r);
    }
    n
}

fn gelu_f32(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const COEF_A: f32 = 0.044715;
    // ggml's C is compiled with FMA contraction: `1.0f + GELU_COEF_A*x*x` becomes one fused multiply-add.
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (COEF_A * x).mul_add(x, 1.0)).tanh())
}

/// GELU of every f16 value, indexed by its bits (plus one unused entry, so a 32-bit gather of the last
/// one stays inside).
fn gelu_f16_table() -> &'static [f16] {
    static TABLE: std::sync::OnceLock<Vec<f16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| (0..=u16::MAX).map(|bits| f16::from_f32(gelu_f32(f16::from_bits(bits).to_f32()))).chain([f16::ZERO]).collect())
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
    /// Divides each pair's angle (`[half]`): Llama 3.x's and phi3's frequency factors.
    factors: Option<Vec<f32>>,
}

impl Rope {
    /// `rot_dim`: rotated dimensions per head (llama.cpp's n_rot), `base`: rope.freq_base.
    pub fn new(style: RopeStyle, rot_dim: usize, base: f32) -> Self {
        // theta_i = pos * base^(-2i/rot_dim)
        let theta_scale = base.powf(-2.0 / rot_dim as f32);
        Rope { style, theta_scale, half: rot_dim / 2, factors: None }
    }

    /// This rotation with pair i's angle divided by `factors[i]` (ggml_rope_ext's freq_factors:
    /// theta_i / factors[i], the running product itself unchanged). `factors` has `rot_dim / 2` values.
    pub fn with_factors(mut self, factors: Vec<f32>) -> Self {
        assert_eq!(factors.len(), self.half, "a frequency factor per rotated pair");
        self.factors = Some(factors);
        self
    }

    /// Rotates every head of one token's `[n_heads, head_dim]` vector in place for position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        #[cfg(target_arch = "x86_64")]
        if crate::kernels::cpu::allows(crate::kernels::cpu::SimdLevel::Avx2) {
            // SAFETY: the CPU has FMA (the Avx2 level needs it), checked just above.
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
        for i in 0..half {
            sin_cos.push(match &self.factors {
                Some(f) => (theta / f[i]).sin_cos(),
                None => theta.sin_cos(),
            });
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector GeGLU gives the scalar one's bits on values around every branch and rounding case.
    #[test]
    fn gelu_mul_vector_equals_scalar() {
        let mut rng = crate::sampler::Rng::new(9);
        let mut x: Vec<f32> = (0..4096).map(|_| (rng.next_f64() as f32 - 0.5) * 30.0).collect();
        x.extend([-10.0, 10.0, -10.000001, 9.999999, 0.0, -0.0, 1e-8, -1e-8, 65504.0, 1e6, -1e6, 6.1e-5, 3.0e-8]);
        x.resize(x.len().next_multiple_of(16) + 5, 0.5); // and a tail
        let up: Vec<f32> = (0..x.len()).map(|i| 0.25 + i as f32 * 1e-3).collect();
        let mut want = x.clone();
        gelu_mul_scalar(&mut want, &up);
        let mut got = x.clone();
        gelu_mul(&mut got, &up);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "x = {} (index {i}): {g} vs {w}", x[i]);
        }
    }

    /// Interleaved RMS sums give each row the bits of ggml's one in-order f64 chain, for any row count.
    #[test]
    fn rms_norm_is_the_in_order_chain_per_row() {
        let dim = 576;
        let mut rng = crate::sampler::Rng::new(5);
        let weight: Vec<f32> = (0..dim).map(|_| rng.next_f64() as f32 + 0.5).collect();
        for n in [1usize, 3, 4, 7, 9] {
            let x: Vec<f32> = (0..n * dim).map(|_| (rng.next_f64() as f32 - 0.5) * 8.0).collect();
            let want: Vec<f32> = x
                .chunks_exact(dim)
                .flat_map(|row| {
                    let mut sum = 0f64;
                    for &v in row {
                        sum += (v * v) as f64;
                    }
                    let scale = 1.0 / ((sum / dim as f64) as f32 + 1e-5).sqrt();
                    row.iter().zip(&weight).map(move |(&v, &w)| v * scale * w).collect::<Vec<_>>()
                })
                .collect();
            let mut got = vec![0.0; n * dim];
            rms_norm(&x, &weight, 1e-5, &mut got);
            let mut inplace = x.clone();
            rms_norm_inplace(&mut inplace, &weight, 1e-5);
            for i in 0..n * dim {
                assert_eq!(got[i].to_bits(), want[i].to_bits(), "n={n} element {i}");
                assert_eq!(inplace[i].to_bits(), want[i].to_bits(), "in place, n={n} element {i}");
            }
        }
    }
}

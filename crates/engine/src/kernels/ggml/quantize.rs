//! Quantization of activation rows (what the matmul does to its input vector before `vec_dot`).
//!
//! `quantize_row` matches ggml's `quantize_row_*_ref` exactly. On x86 with AVX2, llama.cpp's CPU
//! backend does NOT use the reference for Q8_0/Q8_1 but `quantize_row_q8_0/q8_1` from
//! ggml-cpu/arch/x86/quants.c, which differs in two ways: the inverse scale is `127/amax` instead of
//! `1/(amax/127)` (can differ in the last bit), and rounding is `_mm256_round_ps(_MM_ROUND_NEAREST)`,
//! i.e. ties to even instead of `roundf`'s ties away from zero. `quantize_row_ggml_x86` reproduces
//! that path; pick it when comparing against a llama.cpp built for x86 with AVX2 or better.
//! Q8_K has no x86 variant in ggml (the reference is used everywhere), so both functions agree on it.

use super::blocks::*;
use super::GgmlType;

/// Quantize a row of activations to `t` (F32, F16, Q8_0, Q8_1 or Q8_K) with the numerics of ggml's
/// `quantize_row_*_ref`. `dst` must hold at least `t.row_bytes(src.len())` bytes.
pub fn quantize_row(t: GgmlType, src: &[f32], dst: &mut [u8]) {
    quantize(t, src, dst, Flavor::Reference)
}

/// Like `quantize_row`, but Q8_0 and Q8_1 follow ggml-cpu's x86 AVX2 code (see the module docs).
pub fn quantize_row_ggml_x86(t: GgmlType, src: &[f32], dst: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::allows(crate::kernels::cpu::SimdLevel::Avx2) {
        // SAFETY: the CPU has the features, checked just above.
        return unsafe { quantize_x86_avx2(t, src, dst) };
    }
    quantize(t, src, dst, Flavor::X86)
}

/// The same code compiled for AVX2 (which implies SSE4.1): rounding becomes one `roundps` instead of a
/// libm `rintf` call per element (a profile of prefill found the call worth keeping out; docs/speed.md).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn quantize_x86_avx2(t: GgmlType, src: &[f32], dst: &mut [u8]) {
    if matches!(t, GgmlType::Q8_0 | GgmlType::Q8_1) {
        let need = t.row_bytes(src.len()).unwrap_or_else(|| panic!("quantize_row {t}: {} is not a multiple of {QK}", src.len()));
        assert!(dst.len() >= need, "quantize_row {t}: dst has {} bytes, need {need}", dst.len());
        let with_sum = t == GgmlType::Q8_1;
        for (y, x) in dst[..need].chunks_exact_mut(t.block_bytes()).zip(src.chunks_exact(QK)) {
            q8_legacy_avx2(x, y, with_sum);
        }
        return;
    }
    quantize(t, src, dst, Flavor::X86)
}

/// `quantize_row_ggml_x86` for Q8_0 or Q8_1 that also writes each block's side entry of the packed
/// kernels (`sides[b]`: the scale and Q8_1's s as stored, rounded through f16, and the exact sum of the
/// stored codes) from the values it holds in registers, rather than reading the row back per block
/// (`ActSide::fill_token`, 3% of a decode batch's step with the quantization itself another 2%).
/// Returns false, touching nothing, where the CPU lacks AVX2/F16C or `t` is another type.
pub fn quantize_row_legacy_with_sides(t: GgmlType, src: &[f32], dst: &mut [u8], sides: &mut [crate::kernels::packed::acts::LSide]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if matches!(t, GgmlType::Q8_0 | GgmlType::Q8_1) && crate::kernels::cpu::allows(crate::kernels::cpu::SimdLevel::Avx2) {
        let need = t.row_bytes(src.len()).unwrap_or_else(|| panic!("quantize_row {t}: {} is not a multiple of {QK}", src.len()));
        assert!(dst.len() >= need && sides.len() >= src.len() / QK, "quantize_row {t}: buffers too small");
        let with_sum = t == GgmlType::Q8_1;
        for ((y, x), side) in dst[..need].chunks_exact_mut(t.block_bytes()).zip(src.chunks_exact(QK)).zip(sides.iter_mut()) {
            // SAFETY: the CPU has AVX2 and F16C, checked above.
            let (d, s, sum) = unsafe { q8_legacy_avx2(x, y, with_sum) };
            *side = crate::kernels::packed::acts::LSide::new(d, s, sum);
        }
        return true;
    }
    let _ = (t, src, dst, sides);
    false
}

/// `q8_legacy` (X86 flavor) in ggml's own AVX2 instructions (`quantize_row_q8_0/1`): the max of |x| by
/// `maxps` (8 lanes, then halves), x·(127/max) rounded to nearest even, converted and summed in i32.
/// The scalar loops did not vectorize (their max fold keeps NaN order) and showed in decode profiles.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn q8_legacy_avx2(x: &[f32], y: &mut [u8], with_sum: bool) -> (f32, f32, i32) {
    use std::arch::x86_64::*;
    assert!(x.len() >= QK && y.len() >= if with_sum { 36 } else { 34 });
    let p = x.as_ptr();
    let v: [__m256; 4] = std::array::from_fn(|k| _mm256_loadu_ps(p.add(8 * k)));
    let sign = _mm256_set1_ps(-0.0);
    let mut max_abs = _mm256_andnot_ps(sign, v[0]);
    for vk in &v[1..] {
        max_abs = _mm256_max_ps(max_abs, _mm256_andnot_ps(sign, *vk));
    }
    let mut max4 = _mm_max_ps(_mm256_extractf128_ps(max_abs, 1), _mm256_castps256_ps128(max_abs));
    max4 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
    max4 = _mm_max_ss(max4, _mm_movehdup_ps(max4));
    let max_scalar = _mm_cvtss_f32(max4);
    let d = max_scalar / 127.0;
    let id = if max_scalar != 0.0 { 127.0 / max_scalar } else { 0.0 };
    let mul = _mm256_set1_ps(id);
    let ints: [__m256i; 4] = std::array::from_fn(|k| _mm256_cvtps_epi32(_mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(v[k], mul))));
    let qoff = if with_sum { 4 } else { 2 };
    // f32 -> f16 bits rounding to nearest even (as `half`'s conversion), and back to f32 exactly.
    let to_f16 = |v: f32| _mm_extract_epi16::<0>(_mm_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(_mm_set_ss(v))) as u16;
    let from_f16 = |h: u16| _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)));
    let mut s_stored = 0.0;
    if with_sum {
        let s = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        let s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
        let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01))) as f32;
        let s_bits = to_f16(sum * d);
        y[2..4].copy_from_slice(&s_bits.to_le_bytes());
        s_stored = from_f16(s_bits);
    }
    // i32 -> i8 with saturation, then undo the lane interleaving of the packs.
    let i01 = _mm256_packs_epi32(ints[0], ints[1]);
    let i23 = _mm256_packs_epi32(ints[2], ints[3]);
    let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(i01, i23), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(y.as_mut_ptr().add(qoff) as *mut __m256i, bytes);
    let d_bits = to_f16(d);
    y[0..2].copy_from_slice(&d_bits.to_le_bytes());
    // The sum of the stored (saturated) codes: offset to unsigned, summed by `vpsadbw` against zero.
    let unsigned = _mm256_xor_si256(bytes, _mm256_set1_epi8(-128));
    let sad = _mm256_sad_epu8(unsigned, _mm256_setzero_si256());
    let sad = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
    let code_sum = (_mm_cvtsi128_si64(_mm_add_epi64(sad, _mm_unpackhi_epi64(sad, sad))) - 128 * QK as i64) as i32;
    (from_f16(d_bits), s_stored, code_sum)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Flavor {
    Reference,
    X86,
}

#[inline(always)]
fn quantize(t: GgmlType, src: &[f32], dst: &mut [u8], flavor: Flavor) {
    let n = src.len();
    let need = t
        .row_bytes(n)
        .unwrap_or_else(|| panic!("quantize_row {t}: {n} is not a multiple of {}", t.block_len()));
    assert!(
        dst.len() >= need,
        "quantize_row {t}: dst has {} bytes, need {need}",
        dst.len()
    );
    let dst = &mut dst[..need];
    match t {
        GgmlType::F32 => {
            for (d, x) in dst.chunks_exact_mut(4).zip(src) {
                d.copy_from_slice(&x.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (d, x) in dst.chunks_exact_mut(2).zip(src) {
                d.copy_from_slice(&f32_to_f16(*x).to_le_bytes());
            }
        }
        GgmlType::Q8_0 | GgmlType::Q8_1 => {
            let with_sum = t == GgmlType::Q8_1;
            for (y, x) in dst.chunks_exact_mut(t.block_bytes()).zip(src.chunks_exact(QK)) {
                q8_legacy(x, y, with_sum, flavor);
            }
        }
        GgmlType::Q8_K => {
            for (y, x) in dst.chunks_exact_mut(Q8_K_BYTES).zip(src.chunks_exact(QK_K)) {
                q8_k(x, y);
            }
        }
        _ => panic!("quantize_row: {t} is a weight type; only F32, F16, Q8_0, Q8_1, Q8_K are supported"),
    }
}

/// One Q8_0 / Q8_1 block: d = amax/127, q = round(x/d); Q8_1 also stores s = d * sum(q).
#[inline(always)]
fn q8_legacy(x: &[f32], y: &mut [u8], with_sum: bool, flavor: Flavor) {
    // ggml's MAX(a, b) is `a > b ? a : b`; mirror it (it matters only for NaN inputs).
    let amax = x.iter().fold(0.0f32, |m, v| if m > v.abs() { m } else { v.abs() });
    let d = amax / 127.0;
    let id = match flavor {
        Flavor::Reference => {
            if d != 0.0 {
                1.0 / d
            } else {
                0.0
            }
        }
        Flavor::X86 => {
            if amax != 0.0 {
                127.0 / amax
            } else {
                0.0
            }
        }
    };
    let qoff = if with_sum { 4 } else { 2 };
    let mut sum = 0i32;
    for (j, &v) in x.iter().enumerate() {
        let r = match flavor {
            Flavor::Reference => (v * id).round(),     // roundf: ties away from zero
            Flavor::X86 => (v * id).round_ties_even(), // _mm256_round_ps(_MM_ROUND_NEAREST)
        };
        let q = r as i8;
        sum += q as i32;
        y[qoff + j] = q as u8;
    }
    y[0..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    if with_sum {
        y[2..4].copy_from_slice(&f32_to_f16(sum as f32 * d).to_le_bytes());
    }
}

/// ggml's `nearest_int`: round to nearest, ties to even, via the 1.5*2^23 magic constant.
#[inline(always)]
fn nearest_int(fval: f32) -> i32 {
    let val = fval + 12_582_912.0;
    (val.to_bits() as i32 & 0x007f_ffff) - 0x0040_0000
}

/// One Q8_K block. The scale comes from the element with the largest magnitude *with its sign*
/// (iscale = -127/max), so d is negative when that element is positive; ggml does this on purpose.
#[inline(always)]
fn q8_k(x: &[f32], y: &mut [u8]) {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        // ggml writes d = 0 and zero quants (it leaves bsums untouched; zero is the sane choice and
        // cannot change a dot product since d = 0).
        y.fill(0);
        return;
    }
    let iscale = -127.0 / max;
    for j in 0..QK_K {
        let v = nearest_int(iscale * x[j]).min(127);
        y[Q8_K_QS + j] = v as i8 as u8;
    }
    for g in 0..QK_K / 16 {
        let s: i32 = y[Q8_K_QS + 16 * g..Q8_K_QS + 16 * g + 16]
            .iter()
            .map(|&q| q as i8 as i32)
            .sum();
        y[Q8_K_BSUMS + 2 * g..Q8_K_BSUMS + 2 * g + 2].copy_from_slice(&(s as i16).to_le_bytes());
    }
    y[0..4].copy_from_slice(&(1.0 / iscale).to_le_bytes());
}

//! Tests of the quant module. Deterministic: all randomness comes from a seeded xorshift.

mod dot;
mod fixtures;
mod known;

use super::blocks::*;
use super::*;

/// The levels this CPU has that bring `vec_dot` kernels of their own (at `AvxVnni` it runs AVX2's, so the
/// loops over levels would test those twice).
fn vec_dot_levels() -> Vec<SimdLevel> {
    available_levels().into_iter().filter(|l| *l != SimdLevel::AvxVnni).collect()
}

/// xorshift64* — small, seeded, good enough for test data.
pub(crate) struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    pub fn byte(&mut self) -> u8 {
        (self.next_u64() >> 56) as u8
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    /// Activation-like values: mostly small, with occasional outliers.
    pub fn activation(&mut self) -> f32 {
        let v = self.uniform();
        if self.byte() < 8 {
            v * 20.0
        } else {
            v
        }
    }
}

/// Byte offsets of the f16 scale fields of a weight block (d, and m/dmin where present).
pub(super) fn f16_fields(t: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match t {
        Q4_0 | Q5_0 | Q8_0 => &[0],
        Q4_1 | Q5_1 | Q4_K | Q5_K => &[0, 2],
        Q6_K => &[Q6_K_D],
        _ => &[],
    }
}

/// Random valid weights of type `t` for `n` elements: random quant bytes, small finite f16 scales.
pub(crate) fn random_weights(t: GgmlType, n: usize, rng: &mut Rng) -> Vec<u8> {
    let mut w: Vec<u8> = (0..t.row_bytes(n).unwrap()).map(|_| rng.byte()).collect();
    match t {
        GgmlType::F32 => {
            for c in w.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.uniform().to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in w.chunks_exact_mut(2) {
                c.copy_from_slice(&f32_to_f16(rng.uniform()).to_le_bytes());
            }
        }
        _ => {
            let scale = if t.block_len() == QK_K { 0.01 } else { 0.1 };
            for b in w.chunks_exact_mut(t.block_bytes()) {
                for &off in f16_fields(t) {
                    b[off..off + 2].copy_from_slice(&f32_to_f16(rng.uniform() * scale).to_le_bytes());
                }
            }
        }
    }
    w
}

pub(super) fn dequant(t: GgmlType, b: &[u8], n: usize) -> Vec<f32> {
    let mut v = vec![0f32; n];
    dequantize_row(t, b, &mut v);
    v
}

pub(super) fn quant(t: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut v = vec![0u8; activation_row_bytes(t, x.len())];
    quantize_row(t, x, &mut v);
    v
}

#[test]
fn type_table() {
    let sizes = [
        ("F32", 0, 1, 4),
        ("F16", 1, 1, 2),
        ("Q4_0", 2, 32, 18),
        ("Q4_1", 3, 32, 20),
        ("Q5_0", 6, 32, 22),
        ("Q5_1", 7, 32, 24),
        ("Q8_0", 8, 32, 34),
        ("Q8_1", 9, 32, 36),
        ("Q4_K", 12, 256, 144),
        ("Q5_K", 13, 256, 176),
        ("Q6_K", 14, 256, 210),
        ("Q8_K", 15, 256, 292),
    ];
    for (t, (name, id, bl, bb)) in GgmlType::ALL.into_iter().zip(sizes) {
        assert_eq!(
            (t.name(), t.ggml_id(), t.block_len(), t.block_bytes()),
            (name, id, bl, bb)
        );
        assert_eq!(GgmlType::from_ggml_id(id), Some(t));
    }
    for id in [4, 5, 10, 11, 16, 30, 1000] {
        assert_eq!(GgmlType::from_ggml_id(id), None);
    }
    assert_eq!(GgmlType::Q4_0.row_bytes(576), Some(18 * 18));
    assert_eq!(GgmlType::Q4_K.row_bytes(576), None);
    assert_eq!(GgmlType::Q6_K.row_bytes(4864), Some(19 * 210));
    assert_eq!(activation_row_bytes(GgmlType::Q8_K, 512), 2 * 292);
    assert_eq!(GgmlType::Q5_1.dot_activation_type(), GgmlType::Q8_1);
    assert_eq!(GgmlType::Q6_K.dot_activation_type(), GgmlType::Q8_K);
    assert_eq!(GgmlType::Q5_0.dot_activation_type(), GgmlType::Q8_0);
}

#[test]
fn levels() {
    let levels = available_levels();
    assert_eq!(levels[0], SimdLevel::Scalar);
    assert!(levels.contains(&simd_level()));
    eprintln!("available SIMD levels: {levels:?}, active: {:?}", simd_level());
}

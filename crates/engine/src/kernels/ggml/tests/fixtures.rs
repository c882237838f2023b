//! Cross-checks against independent implementations through committed fixtures:
//! - `testdata/fixtures.bin` (`make_fixtures.py`): gguf-py's numpy dequantization and quantization.
//! - `testdata/ggml_x86.bin` (`make_ggml_fixtures.py`): llama.cpp's own libggml-cpu.so (x86, AVX2+):
//!   its `quantize_row_q8_*` output and `ggml_vec_dot_*` results, which the SIMD levels must match
//!   bit for bit.
//!
//! Comparison is bit-exact: gguf-py evaluates the same f32 expressions in the same order as ggml's
//! C reference (e.g. `(d * sc) * q - dmin * m` for Q4_K, `(d * sc) * q` for Q6_K, `d * q + m` for
//! Q4_1) with numpy float32 arithmetic and no FMA contraction, and f16 -> f32 is exact, so there is
//! no reason for even a 1-ulp difference.

use super::*;

const FIXTURES: &[u8] = include_bytes!("../testdata/fixtures.bin");

struct Record<'a> {
    quantize: bool,
    t: GgmlType,
    bytes: &'a [u8],
    values: Vec<f32>,
}

fn records() -> Vec<Record<'static>> {
    let mut p = FIXTURES;
    let mut take = |k: usize| {
        let (a, b) = p.split_at(k);
        p = b;
        a
    };
    assert_eq!(take(4), b"RQFX");
    let word = |b: &[u8]| u32::from_le_bytes(b.try_into().unwrap());
    assert_eq!(word(take(4)), 1, "fixture version");
    let count = word(take(4));
    let out = (0..count)
        .map(|_| {
            let kind = take(1)[0];
            let t = GgmlType::from_ggml_id(word(take(4))).expect("fixture type");
            let n = word(take(4)) as usize;
            let nbytes = word(take(4)) as usize;
            let bytes = take(nbytes);
            let values = take(4 * n)
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            Record {
                quantize: kind == 1,
                t,
                bytes,
                values,
            }
        })
        .collect();
    assert!(p.is_empty(), "trailing fixture bytes");
    out
}

#[test]
fn dequantize_matches_gguf_py() {
    let mut seen = Vec::new();
    for r in records().iter().filter(|r| !r.quantize) {
        let got = dequant(r.t, r.bytes, r.values.len());
        for (i, (g, w)) in got.iter().zip(&r.values).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{} element {i}: {g} vs gguf-py {w}", r.t);
        }
        seen.push(r.t);
    }
    assert_eq!(seen.len(), 9, "fixture types: {seen:?}");
}

#[test]
fn quantize_matches_gguf_py() {
    let mut seen = 0;
    for r in records().iter().filter(|r| r.quantize) {
        let got = quant(r.t, &r.values);
        assert_eq!(got.len(), r.bytes.len(), "{}", r.t);
        let bad = got.iter().zip(r.bytes).position(|(a, b)| a != b);
        assert_eq!(bad, None, "{}: first differing byte", r.t);
        seen += 1;
    }
    assert_eq!(seen, 2);
}

const GGML_X86: &[u8] = include_bytes!("../testdata/ggml_x86.bin");

fn u32_at(b: &[u8], off: usize) -> usize {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap()) as usize
}

#[test]
fn matches_llama_cpp_x86_bit_for_bit() {
    assert_eq!(&GGML_X86[..4], b"RQGX");
    assert_eq!(u32_at(GGML_X86, 4), 2, "fixture version");
    let count = u32_at(GGML_X86, 8);
    let mut p = 12;
    for _ in 0..count {
        let t = GgmlType::from_ggml_id(u32_at(GGML_X86, p) as u32).expect("fixture type");
        let (n, wb, ab) = (
            u32_at(GGML_X86, p + 4),
            u32_at(GGML_X86, p + 8),
            u32_at(GGML_X86, p + 12),
        );
        let nx = u32_at(GGML_X86, p + 16);
        p += 20;
        let w = &GGML_X86[p..p + wb];
        p += wb;
        let x: Vec<f32> = GGML_X86[p..p + 4 * nx]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        p += 4 * nx;
        let xq = &GGML_X86[p..p + ab];
        p += ab;
        let want = f32::from_le_bytes(GGML_X86[p..p + 4].try_into().unwrap());
        p += 4;

        let at = t.dot_activation_type();
        if nx > 0 {
            let mut q = vec![0u8; ab];
            quantize_row_ggml_x86(at, &x, &mut q);
            assert_eq!(q, xq, "{at} activations of {t} n={n} differ from ggml's quantize_row");
        }
        for level in vec_dot_levels() {
            let got = vec_dot_kernel_at(level, t)(n, w, xq);
            if level == SimdLevel::Scalar {
                // ggml's generic order, not its x86 one: close, not necessarily equal
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{t} n={n} scalar: {got} vs {want}"
                );
            } else {
                assert_eq!(
                    got.to_bits(),
                    want.to_bits(),
                    "{t} n={n} {level:?}: {got} vs llama.cpp {want}"
                );
            }
        }
    }
    assert_eq!(p, GGML_X86.len());
    assert_eq!(count, 68);
}

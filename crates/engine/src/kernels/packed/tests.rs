use super::*;
use crate::kernels::ggml::tests::{random_weights, Rng};
use crate::kernels::ggml::{dequantize_row, quantize_row_ggml_x86};

const TYPES: [GgmlType; 6] = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q8_0, GgmlType::Q4_K, GgmlType::Q6_K];

/// Random weights and quantized activations for a matmul of `rows` × `cols` against `n` tokens.
fn case(t: GgmlType, rows: usize, cols: usize, n: usize, seed: u64) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
    let mut rng = Rng::new(seed);
    let w: Vec<u8> = (0..rows).flat_map(|_| random_weights(t, cols, &mut rng)).collect();
    let x: Vec<f32> = (0..n * cols).map(|_| rng.activation()).collect();
    let act = t.dot_activation_type();
    let ab = act.row_bytes(cols).unwrap();
    let mut xq = vec![0u8; n * ab];
    for (row, q) in x.chunks_exact(cols).zip(xq.chunks_exact_mut(ab)) {
        quantize_row_ggml_x86(act, row, q);
    }
    (w, xq, x)
}

fn side_of(t: GgmlType, cols: usize, n: usize, xq: &[u8]) -> ActSide {
    let act = t.dot_activation_type();
    let ab = act.row_bytes(cols).unwrap();
    let mut side = ActSide::default();
    side.shape(act, cols, n);
    let ptrs = side.ptrs();
    for t_ in 0..n {
        // SAFETY: shaped for n tokens; one writer.
        unsafe { ActSide::fill_token(act, side.blocks, ptrs, t_, &xq[t_ * ab..(t_ + 1) * ab]) };
    }
    side
}

/// The definition computes the dot it claims: close to the f64 dot of the dequantized weights and the
/// dequantized activations (catches a wrong offset, scale or element order in `reference`).
#[test]
fn reference_is_the_dot_of_the_dequantized_values() {
    for t in TYPES {
        let cols = 512;
        let (w, xq, _) = case(t, 3, cols, 2, 11);
        let act = t.dot_activation_type();
        let (wb, ab) = (t.row_bytes(cols).unwrap(), act.row_bytes(cols).unwrap());
        for r in 0..3 {
            for k in 0..2 {
                let (wr, ar) = (&w[r * wb..(r + 1) * wb], &xq[k * ab..(k + 1) * ab]);
                let (mut wf, mut af) = (vec![0.0; cols], vec![0.0; cols]);
                dequantize_row(t, wr, &mut wf);
                dequantize_row(act, ar, &mut af);
                let want: f64 = wf.iter().zip(&af).map(|(&a, &b)| a as f64 * b as f64).sum();
                let got = reference::dot(t, cols, wr, ar) as f64;
                let scale: f64 = wf.iter().zip(&af).map(|(&a, &b)| (a as f64 * b as f64).abs()).sum();
                // Q4_1's m·s term uses ggml's s, rounded to f16: allow for it.
                assert!((got - want).abs() <= 2e-3 * scale + 1e-6, "{t} row {r} token {k}: {got} vs {want} (scale {scale})");
            }
        }
    }
}

/// Every (row, token) of every tile size equals the definition bit for bit, including partial last
/// groups (37 rows: 5 in the last group; 45: 13, so AVX2's second half is partial) and every token
/// count a tile takes.
#[test]
fn kernels_equal_the_reference_bit_for_bit() {
    if !crate::kernels::cpu::tests::test_needs(crate::kernels::cpu::SimdLevel::Avx2, "packed kernels vs the definition") {
        return;
    }
    let (cols, n) = (768, 11);
    for (t, rows) in TYPES.iter().flat_map(|&t| [(t, 37), (t, 45)]) {
        let (w, xq, _) = case(t, rows, cols, n, 5);
        tiles_equal_the_reference(t, rows, cols, n, &w, &xq);
    }
}

/// Every weight code at its largest (Q8_0: −128) against activations that quantize to ±127 throughout:
/// the i16 partial sums of the AVX2 kernels are at their bound here (module docs of `avx2`), so an
/// overflow would show as a wrong bit.
#[test]
fn kernels_hold_saturated_codes() {
    if !crate::kernels::cpu::tests::test_needs(crate::kernels::cpu::SimdLevel::Avx2, "packed kernels at saturated codes") {
        return;
    }
    let (rows, cols, n) = (21, 512, 4);
    for t in TYPES {
        let (w, xq) = saturated(t, rows, cols, n);
        tiles_equal_the_reference(t, rows, cols, n, &w, &xq);
    }
}

/// Weights of `rows` × `cols` with every code at its largest (Q8_0: −128), and `n` tokens whose
/// activations quantize to ±127 throughout: all +1; all −1; and both again with one element a little
/// larger in magnitude and of the other sign (Q8_K scales by the signed extreme, so this is what gives
/// it +127 codes).
fn saturated(t: GgmlType, rows: usize, cols: usize, n: usize) -> (Vec<u8>, Vec<u8>) {
    let (mut w, _, _) = case(t, rows, cols, 0, 9);
    let (codes, fill) = match t {
        GgmlType::Q4_0 => (2..18, 0xFF),
        GgmlType::Q4_1 => (4..20, 0xFF),
        GgmlType::Q5_0 => (2..22, 0xFF),
        GgmlType::Q8_0 => (2..34, 0x80),
        GgmlType::Q4_K => (16..144, 0xFF),
        _ => (0..192, 0xFF),
    };
    for block in w.chunks_exact_mut(t.block_bytes()) {
        block[codes.clone()].fill(fill);
    }
    let x: Vec<f32> = (0..n)
        .flat_map(|k| {
            let sign = if k % 2 == 0 { 1.0 } else { -1.0 };
            (0..cols).map(move |i| if k % 4 >= 2 && i % 32 == 0 { -1.001 * sign } else { sign })
        })
        .collect();
    let act = t.dot_activation_type();
    let ab = act.row_bytes(cols).unwrap();
    let mut xq = vec![0u8; n * ab];
    for (row, q) in x.chunks_exact(cols).zip(xq.chunks_exact_mut(ab)) {
        quantize_row_ggml_x86(act, row, q);
    }
    (w, xq)
}

/// Runs every tile size over `n` tokens and checks each (row, token) against `reference::dot`.
fn tiles_equal_the_reference(t: GgmlType, rows: usize, cols: usize, n: usize, w: &[u8], xq: &[u8]) {
    let m = pack(t, rows, cols, w);
    let act = t.dot_activation_type();
    let ab = act.row_bytes(cols).unwrap();
    let side = side_of(t, cols, n, xq);
    let input = PackedInput { xq, row_bytes: ab, side: &side };
    let wb = t.row_bytes(cols).unwrap();
    for nt in 1..=tile_tokens(t) {
        let mut out = vec![f32::NAN; n * rows];
        for g in 0..m.groups {
            let mut t0 = 0;
            while t0 < n {
                let k = nt.min(n - t0);
                // SAFETY: kernels available; out is [n, rows], each (token, row) written once.
                unsafe { tile(&m, g, &input, t0, k, out.as_mut_ptr(), rows) };
                t0 += k;
            }
        }
        for tok in 0..n {
            for r in 0..rows {
                let want = reference::dot(t, cols, &w[r * wb..(r + 1) * wb], &xq[tok * ab..(tok + 1) * ab]);
                assert_eq!(out[tok * rows + r].to_bits(), want.to_bits(), "{t} tile {nt}: token {tok} row {r}: {} vs {want}", out[tok * rows + r]);
            }
        }
    }
}

/// The unpacked paths (`tiles_unpacked`: AVX2's for every type but Q8_0, AVX-VNNI's for the legacy 4-
/// and 5-bit types where the CPU has it) over every token range of up to 12 tokens, starting at 0 and
/// at 1, give `reference::dot`'s bits: tiles of 4 and every remainder, partial halves, random codes
/// and every code at its largest.
#[test]
fn unpacked_tiles_equal_the_reference_bit_for_bit() {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::kernels::cpu::SimdLevel::detected() < crate::kernels::ggml::SimdLevel::Avx2 {
            eprintln!("note: no AVX2 here; the unpacked tiles are not tested");
            return;
        }
        let (cols, n) = (768, 12);
        for t in TYPES.into_iter().filter(|&t| t != GgmlType::Q8_0) {
            for (rows, saturate) in [(37, false), (45, false), (21, true)] {
                let (w, xq) = if saturate {
                    saturated(t, rows, cols, n)
                } else {
                    let (w, xq, _) = case(t, rows, cols, n, 7);
                    (w, xq)
                };
                let m = pack(t, rows, cols, &w);
                let ab = t.dot_activation_type().row_bytes(cols).unwrap();
                let side = side_of(t, cols, n, &xq);
                let input = PackedInput { xq: &xq, row_bytes: ab, side: &side };
                let wb = t.row_bytes(cols).unwrap();
                for start in [0, 1] {
                    for len in 1..=n - start {
                        let vnni = crate::kernels::cpu::SimdLevel::AvxVnni.is_available() && matches!(t, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0);
                        for level in if vnni { &["avx2", "avxvnni"][..] } else { &["avx2"][..] } {
                            let mut out = vec![f32::NAN; n * rows];
                            for g in 0..m.groups {
                                // SAFETY: the level's CPU features are present; out is [n, rows], each (token, row)
                                // of the range written once.
                                unsafe {
                                    if *level == "avx2" {
                                        avx2::tiles_unpacked(&m, g, &input, start, start + len, out.as_mut_ptr(), rows)
                                    } else {
                                        avxvnni::tiles_unpacked(&m, g, &input, start, start + len, out.as_mut_ptr(), rows)
                                    }
                                };
                            }
                            for tok in start..start + len {
                                for r in 0..rows {
                                    let want = reference::dot(t, cols, &w[r * wb..(r + 1) * wb], &xq[tok * ab..(tok + 1) * ab]);
                                    let got = out[tok * rows + r];
                                    assert_eq!(got.to_bits(), want.to_bits(), "{level} {t} rows {rows} tokens {start}..{}: token {tok} row {r}: {got} vs {want}", start + len);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Packing keeps the file's size per row (Q4_K: 148 bytes per 256 instead of 144).
#[test]
fn packed_size_is_the_file_size() {
    for t in TYPES {
        let (rows, cols) = (64, 512);
        let w = vec![0u8; rows * t.row_bytes(cols).unwrap()];
        let m = pack(t, rows, cols, &w);
        let extra = if t == GgmlType::Q4_K { 4 * rows * cols / 256 } else { 0 };
        assert_eq!(m.bytes().len(), w.len() + extra, "{t}");
    }
}

/// Quantizing with the side entries in one pass gives the bytes of `quantize_row_ggml_x86` and the
/// entries `fill_token` reads back from them, for ordinary rows, an all-zero block, blocks whose codes
/// saturate at ±127 and values that round to f16 subnormals.
#[test]
fn quantizing_with_sides_is_quantizing_then_reading_the_sides() {
    use crate::kernels::ggml::quantize_row_legacy_with_sides;
    let cols = 256;
    let mut rng = Rng::new(5);
    let mut rows: Vec<Vec<f32>> = (0..4).map(|_| (0..cols).map(|_| rng.activation()).collect()).collect();
    let mut special: Vec<f32> = (0..cols).map(|i| (i as f32 - 128.0) * 1e-6).collect();
    special[..32].iter_mut().for_each(|v| *v = 0.0);
    special[32..64].iter_mut().enumerate().for_each(|(i, v)| *v = if i % 2 == 0 { 1e4 } else { -1e4 });
    special[64..96].iter_mut().for_each(|v| *v *= 1e-3);
    rows.push(special);
    for act in [GgmlType::Q8_0, GgmlType::Q8_1] {
        let ab = act.row_bytes(cols).unwrap();
        for (i, row) in rows.iter().enumerate() {
            let (mut want_q, mut got_q) = (vec![0u8; ab], vec![0u8; ab]);
            quantize_row_ggml_x86(act, row, &mut want_q);
            let want = side_of(if act == GgmlType::Q8_0 { GgmlType::Q8_0 } else { GgmlType::Q4_1 }, cols, 1, &want_q);
            let mut got = vec![acts::LSide::default(); cols / 32];
            if !quantize_row_legacy_with_sides(act, row, &mut got_q, &mut got) {
                eprintln!("note: no AVX2/F16C here; nothing to compare");
                return;
            }
            assert_eq!(got_q, want_q, "{act} row {i}: bytes");
            for (b, (g, w)) in got.iter().zip(&want.legacy).enumerate() {
                assert_eq!((g.d.to_bits(), g.s.to_bits(), g.sum), (w.d.to_bits(), w.s.to_bits(), w.sum), "{act} row {i} block {b}");
            }
        }
    }
}

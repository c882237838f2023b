//! vec_dot against dequantized f64 dot products, and every SIMD level against the scalar reference.

use super::*;

const WEIGHT_TYPES: [GgmlType; 10] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

/// Lengths covering every block-count residue of the SIMD loops (1..=7 blocks) and the model sizes.
fn lengths(t: GgmlType) -> &'static [usize] {
    match t.block_len() {
        1 => &[1, 7, 8, 31, 33, 64, 576, 1000],
        32 => &[32, 64, 96, 128, 160, 224, 576, 640, 896, 4864],
        _ => &[256, 512, 768, 1536, 2048, 4864],
    }
}

/// (exact dot of the dequantized rows in f64, sum |w*x|). For Q4_1/Q5_1 the kernel uses the
/// activation's stored `s = f16(d * sum q)` for the min term instead of the exact sum, so the
/// expected value does too.
fn expected(t: GgmlType, n: usize, w: &[u8], a: &[u8]) -> (f64, f64) {
    let wd = dequant(t, w, n);
    let at = t.dot_activation_type();
    let ad = dequant(at, a, n);
    let mut dot: f64 = wd.iter().zip(&ad).map(|(&p, &q)| p as f64 * q as f64).sum();
    let mag: f64 = wd.iter().zip(&ad).map(|(&p, &q)| (p as f64 * q as f64).abs()).sum();
    if at == GgmlType::Q8_1 {
        for (i, (wb, ab)) in w
            .chunks_exact(t.block_bytes())
            .zip(a.chunks_exact(Q8_1_BYTES))
            .enumerate()
        {
            let exact: f64 = ad[32 * i..32 * i + 32].iter().map(|&v| v as f64).sum();
            dot += rd_f16(wb, 2) as f64 * (rd_f16(ab, 2) as f64 - exact);
        }
    }
    (dot, mag)
}

fn check_type(t: GgmlType, seed: u64, make_x: impl Fn(&mut Rng, usize) -> f32) {
    let mut rng = Rng::new(seed);
    for &n in lengths(t) {
        for _ in 0..3 {
            let w = random_weights(t, n, &mut rng);
            let x: Vec<f32> = (0..n).map(|i| make_x(&mut rng, i)).collect();
            let a = quant(t.dot_activation_type(), &x);
            let (want, mag) = expected(t, n, &w, &a);
            let reference = vec_dot_kernel_at(SimdLevel::Scalar, t)(n, &w, &a);
            let tol = 1e-4 * mag + 1e-3;
            assert!(
                (reference as f64 - want).abs() <= tol,
                "{t} n={n}: scalar {reference} vs dequantized {want} (tol {tol})"
            );
            let mut simd = None;
            for level in vec_dot_levels() {
                let got = vec_dot_kernel_at(level, t)(n, &w, &a);
                // all SIMD levels follow ggml's x86 rounding sequence: bit-identical to each other
                if level >= SimdLevel::Avx2 {
                    let first = *simd.get_or_insert(got);
                    assert_eq!(got.to_bits(), first.to_bits(), "{t} n={n} {level:?} differs from AVX2");
                }
                let tol = 1e-5 * mag + 1e-6;
                assert!(
                    (got as f64 - reference as f64).abs() <= tol,
                    "{t} n={n} {level:?}: {got} vs scalar {reference} (tol {tol})"
                );
            }
            assert_eq!(vec_dot(t, n, &w, &a), vec_dot_kernel(t)(n, &w, &a));
        }
    }
}

#[test]
fn vec_dot_matches_dequantized_and_scalar() {
    for (k, t) in WEIGHT_TYPES.into_iter().enumerate() {
        check_type(t, 100 + k as u64, |r, _| r.activation());
    }
}

/// Worst cases for the i16 pair sums: all quant bits set and activations at +-127.
/// The F32 dot at vector speed (`dot_avx2`) is the AVX-512-order emulation (`dot_scalar`) bit for bit,
/// at every length residue of its 64-element step and past it.
#[test]
fn f32_dot_is_the_emulation_bit_for_bit() {
    if !crate::kernels::cpu::allows(SimdLevel::Avx2) {
        eprintln!("note: AVX2 capped or absent; the F32 vector dot is not tested");
        return;
    }
    let mut rng = Rng::new(77);
    for n in [1usize, 7, 63, 64, 65, 127, 128, 130, 576, 1000, 2048] {
        let w: Vec<f32> = (0..n).map(|_| rng.activation()).collect();
        let x: Vec<f32> = (0..n).map(|_| rng.activation()).collect();
        let (wb, xb) = (quant(GgmlType::F32, &w), quant(GgmlType::F32, &x));
        let want = vec_dot_kernel_at(SimdLevel::Scalar, GgmlType::F32)(n, &wb, &xb);
        let got = vec_dot_kernel_at(SimdLevel::Avx2, GgmlType::F32)(n, &wb, &xb);
        assert_eq!(got.to_bits(), want.to_bits(), "n={n}: {got} vs the emulation's {want}");
    }
}

#[test]
fn vec_dot_extremes() {
    for (k, t) in WEIGHT_TYPES.into_iter().enumerate() {
        for fill in [0xFFu8, 0x80, 0x00, 0x7F] {
            let n = lengths(t)[4];
            let mut w = random_weights(t, n, &mut Rng::new(7 + k as u64));
            let keep: Vec<usize> = f16_fields(t).to_vec();
            if t.block_len() > 1 {
                for b in w.chunks_exact_mut(t.block_bytes()) {
                    for (i, byte) in b.iter_mut().enumerate() {
                        if !keep.iter().any(|&o| i == o || i == o + 1) {
                            *byte = fill;
                        }
                    }
                }
            }
            for sign in [1.0f32, -1.0] {
                let x: Vec<f32> = (0..n).map(|i| if i % 3 == 0 { -sign } else { sign }).collect();
                let a = quant(t.dot_activation_type(), &x);
                let (want, mag) = expected(t, n, &w, &a);
                for level in vec_dot_levels() {
                    let got = vec_dot_kernel_at(level, t)(n, &w, &a) as f64;
                    assert!(
                        (got - want).abs() <= 1e-5 * mag + 1e-5,
                        "{t} fill {fill:#x} {level:?}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "not a multiple")]
fn vec_dot_rejects_partial_blocks() {
    let w = vec![0u8; 64];
    vec_dot(GgmlType::Q8_0, 48, &w, &w);
}

#[test]
#[should_panic(expected = "activation row has")]
fn vec_dot_rejects_short_activations() {
    let w = vec![0u8; 2 * Q4_0_BYTES];
    vec_dot(GgmlType::Q4_0, 64, &w, &[0u8; 40]);
}

/// Single-thread matrix-vector throughput per level, in GB/s of weight bytes, for a cache-hot
/// matrix (64 rows), an L2-sized one and one far bigger than L2. Run with
/// `cargo test --release -p reckon-engine quant::tests::dot::bench -- --ignored --nocapture`.
#[test]
#[ignore]
fn bench_vec_dot() {
    let cases = [
        (GgmlType::Q4_1, 576),
        (GgmlType::Q8_0, 576),
        (GgmlType::Q4_0, 896),
        (GgmlType::Q5_0, 576),
        (GgmlType::Q4_K, 1536),
        (GgmlType::Q5_K, 1536),
        (GgmlType::Q6_K, 1536),
        (GgmlType::F16, 576),
    ];
    for (t, n) in cases {
        for rows in [64usize, 1536, 49152] {
            let mut rng = Rng::new(1);
            let rb = t.row_bytes(n).unwrap();
            let w = random_weights(t, n * rows, &mut rng);
            let x: Vec<f32> = (0..n).map(|_| rng.activation()).collect();
            let a = quant(t.dot_activation_type(), &x);
            let mut line = format!("{:5} n={n:5} rows={rows:6} ({:6} KiB):", t.name(), rb * rows / 1024);
            for level in vec_dot_levels() {
                let f = vec_dot_kernel_at(level, t);
                let reps = (if level == SimdLevel::Scalar { 1 << 19 } else { 1 << 22 } / (rb * rows)).max(1);
                let (mut best, mut sink) = (f64::MAX, 0.0f32);
                for _ in 0..7 {
                    let start = std::time::Instant::now();
                    for _ in 0..reps {
                        for r in 0..rows {
                            sink += f(n, &w[r * rb..(r + 1) * rb], &a);
                        }
                    }
                    best = best.min(start.elapsed().as_secs_f64() / reps as f64);
                }
                std::hint::black_box(sink);
                line += &format!("  {}: {:5.1} GB/s", level.name(), (rb * rows) as f64 / best / 1e9);
            }
            eprintln!("{line}");
        }
    }
}

/// The multi-token kernels (K-quants on AVX-512, legacy types on AVX2) give exactly the one-row kernel's bits for every token.
#[test]
fn multi_token_kernels_equal_one_row_kernel() {
    let mut rng = Rng::new(77);
    for t in WEIGHT_TYPES {
        let Some(multi) = multi_dot_kernel(t, 4864) else { continue };
        let one = vec_dot_kernel(t);
        for &n in lengths(t) {
            let w = random_weights(t, n, &mut rng);
            let at = t.dot_activation_type();
            let stride = at.row_bytes(n).unwrap();
            let mut acts = Vec::new();
            let rows = 3 * MULTI; // several groups per call
            for _ in 0..rows {
                let x: Vec<f32> = (0..n).map(|_| rng.uniform() * 3.0).collect();
                acts.extend(quant(at, &x));
            }
            // three weight rows (the first one twice) against every token, in one call
            let w2 = random_weights(t, n, &mut rng);
            let ws: Vec<u8> = [&w[..], &w2[..], &w[..]].concat();
            let wb = t.row_bytes(n).unwrap();
            let mut got = vec![0.0f32; 3 * rows];
            multi(n, &ws, wb, 3, &acts, stride, &mut got);
            for (i, g) in got.iter().enumerate() {
                let (wr, r) = (i / rows, i % rows);
                let want = one(n, &ws[wr * wb..(wr + 1) * wb], &acts[r * stride..(r + 1) * stride]);
                assert_eq!(g.to_bits(), want.to_bits(), "{t} n={n} weight row {wr} token {r}: {g} vs {want}");
            }
        }
    }
}

/// `MULTI` random weight rows of `n` values, back to back, and the bytes of one row.
fn multi_rows(t: GgmlType, n: usize, rng: &mut Rng) -> (Vec<u8>, usize) {
    let w: Vec<u8> = (0..MULTI).flat_map(|_| random_weights(t, n, rng)).collect();
    (w, t.row_bytes(n).unwrap())
}

/// The multi-weight-row kernels give exactly the one-row kernel's bits for every row.
#[test]
fn multi_weight_row_kernels_equal_one_row_kernel() {
    let mut rng = Rng::new(78);
    for t in WEIGHT_TYPES {
        let Some(rows) = multi_row_kernel(t) else { continue };
        let one = vec_dot_kernel(t);
        for &n in lengths(t) {
            let (w, stride) = multi_rows(t, n, &mut rng);
            let x: Vec<f32> = (0..n).map(|_| rng.uniform() * 3.0).collect();
            let a = quant(t.dot_activation_type(), &x);
            let got = rows(n, &w, stride, &a);
            for (r, g) in got.iter().enumerate() {
                let want = one(n, &w[r * stride..(r + 1) * stride], &a);
                assert_eq!(g.to_bits(), want.to_bits(), "{t} n={n} row {r}: {g} vs {want}");
            }
        }
    }
}

/// The pair kernels (MULTI weight rows × 1-4 token pairs, decode batches) give exactly the one-row
/// kernel's bits for every (row, token): odd and even batches, a group that starts inside the batch.
#[test]
fn pair_kernels_equal_one_row_kernel() {
    let mut rng = Rng::new(80);
    let mut tested = 0;
    for t in WEIGHT_TYPES {
        let Some(pairs) = pair_dot_kernel(t, 4864) else { continue };
        tested += 1;
        let one = vec_dot_kernel(t);
        for &n in lengths(t) {
            let (w, stride) = multi_rows(t, n, &mut rng);
            let at = t.dot_activation_type();
            let plain = at.row_bytes(n).unwrap();
            for batch in [2, 3, 7, 8, 13] {
                let mut acts = Vec::new();
                for _ in 0..batch {
                    let x: Vec<f32> = (0..n).map(|_| rng.uniform() * 3.0).collect();
                    acts.extend(quant(at, &x));
                }
                let mut paired = PairActs::default();
                paired.build(t, n, &acts, plain, batch);
                let per_call = 2 * PAIRS_PER_CALL;
                for first in (0..paired.n_pairs).step_by(PAIRS_PER_CALL) {
                    let n_pairs = (paired.n_pairs - first).min(PAIRS_PER_CALL);
                    let mut got = [f32::NAN; MULTI * 2 * PAIRS_PER_CALL];
                    pairs(n, &w, stride, &paired, first, n_pairs, &mut got);
                    for r in 0..MULTI {
                        for k in 0..(2 * n_pairs).min(batch - 2 * first) {
                            let tok = 2 * first + k;
                            let want = one(n, &w[r * stride..(r + 1) * stride], &acts[tok * plain..(tok + 1) * plain]);
                            let g = got[r * per_call + k];
                            assert_eq!(g.to_bits(), want.to_bits(), "{t} n={n} batch {batch} row {r} token {tok}: {g} vs {want}");
                        }
                    }
                }
            }
        }
    }
    assert!(tested == 4 || simd_level() < SimdLevel::Avx512, "Q4_0, Q4_1, Q5_0 and Q8_0 have pair kernels on AVX-512");
}

//! What a second score order would buy on AVX2 before any numerics changes: one thread scores ROWS query
//! rows (head size 64) against KEYS f16 keys, 16 keys a chunk converted to f32 once, in two orders:
//! - `ggml`: today's order (both numerics; `attention::tiled_avx2::chunk_scores`): per key a 64-value dot
//!   in 8 lanes, 8 FMAs and 3 adds, then 8 keys' lanes summed by a shuffle network;
//! - `chain`: the chunk's keys stored dimension-major (`[64][16]`, an 8×8 transpose per block), and each
//!   score one FMA chain over the 64 dimensions, 8 keys a register, 6 rows a pass: no horizontal sum, and
//!   different roundings (it would be a second, documented numerics).
//!
//! `score_order_bench [ROWS] [KEYS] [REPS] [ROUNDS]`: the two alternate ROUNDS times; each prints the
//! median ns per (row, key) of REPS, and the ratio.
#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::time::Instant;

fn main() {
    let a: Vec<usize> = std::env::args().skip(1).map(|s| s.parse().expect("numbers")).collect();
    let rows = a.first().copied().unwrap_or(24);
    let keys = a.get(1).copied().unwrap_or(4096) / 16 * 16;
    let reps = a.get(2).copied().unwrap_or(20);
    let rounds = a.get(3).copied().unwrap_or(5);
    assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c"), "needs AVX2, FMA and F16C");
    let mut rng = reckon_engine::sampler::Rng::new(7);
    let k: Vec<half::f16> = (0..keys * 64).map(|_| half::f16::from_f32(rng.next_f64() as f32 - 0.5)).collect();
    let q: Vec<f32> = (0..rows * 64).map(|_| half::f16::from_f32(rng.next_f64() as f32 - 0.5).to_f32()).collect();
    let (mut out_g, mut out_c) = (vec![0f32; rows * keys], vec![0f32; rows * keys]);
    let mut buf = vec![0f32; 16 * 64];
    let time = |f: &mut dyn FnMut()| {
        let mut t: Vec<f64> = (0..reps + 1)
            .map(|_| {
                let s = Instant::now();
                f();
                s.elapsed().as_secs_f64()
            })
            .collect();
        t.remove(0);
        t.sort_by(f64::total_cmp);
        t[t.len() / 2] * 1e9 / (rows * keys) as f64
    };
    for round in 0..rounds {
        // SAFETY: AVX2, FMA and F16C were checked; the buffers have the sizes the kernels index.
        let g = time(&mut || unsafe { ggml(&k, &q, rows, keys, &mut buf, &mut out_g) });
        let c = time(&mut || unsafe { chain(&k, &q, rows, keys, &mut buf, &mut out_c) });
        let diff = out_g.iter().zip(&out_c).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        println!("round {round} rows {rows} keys {keys}: ggml order {g:.3} ns per row·key, one chain {c:.3}; ggml/chain {:.2}x; max |difference| {diff:.2e}", g / c);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn ggml(k: &[half::f16], q: &[f32], rows: usize, keys: usize, buf: &mut [f32], out: &mut [f32]) {
    for c0 in (0..keys).step_by(16) {
        for c in 0..16 {
            let src = k.as_ptr().add((c0 + c) * 64);
            for d in (0..64).step_by(8) {
                _mm256_storeu_ps(buf.as_mut_ptr().add(c * 64 + d), _mm256_cvtph_ps(_mm_loadu_si128(src.add(d) as *const __m128i)));
            }
        }
        for r in 0..rows {
            let qv: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(q.as_ptr().add(r * 64 + 8 * j)));
            for eight in 0..2 {
                let t: [__m256; 8] = std::array::from_fn(|c| {
                    let kp = buf.as_ptr().add((8 * eight + c) * 64);
                    let a = |j: usize| _mm256_loadu_ps(kp.add(8 * j));
                    let z = _mm256_setzero_ps();
                    let a04 = _mm256_fmadd_ps(a(4), qv[4], _mm256_fmadd_ps(a(0), qv[0], z));
                    let a26 = _mm256_fmadd_ps(a(6), qv[6], _mm256_fmadd_ps(a(2), qv[2], z));
                    let a15 = _mm256_fmadd_ps(a(5), qv[5], _mm256_fmadd_ps(a(1), qv[1], z));
                    let a37 = _mm256_fmadd_ps(a(7), qv[7], _mm256_fmadd_ps(a(3), qv[3], z));
                    _mm256_add_ps(_mm256_add_ps(a15, a37), _mm256_add_ps(a04, a26))
                });
                _mm256_storeu_ps(out.as_mut_ptr().add(r * keys + c0 + 8 * eight), reduce8(&t));
            }
        }
    }
}

/// Lane k of the result: the sum of t[k]'s lanes (the network of `ggml::math::avx2::reduce_8_rows`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn reduce8(t: &[__m256; 8]) -> __m256 {
    let x: [__m256; 4] = std::array::from_fn(|m| _mm256_add_ps(_mm256_permute2f128_ps::<0x31>(t[2 * m], t[2 * m + 1]), _mm256_permute2f128_ps::<0x20>(t[2 * m], t[2 * m + 1])));
    let y: [__m256; 2] = std::array::from_fn(|p| _mm256_add_ps(_mm256_shuffle_ps::<0x44>(x[2 * p], x[2 * p + 1]), _mm256_shuffle_ps::<0xEE>(x[2 * p], x[2 * p + 1])));
    let r = _mm256_add_ps(_mm256_shuffle_ps::<0x88>(y[0], y[1]), _mm256_shuffle_ps::<0xDD>(y[0], y[1]));
    _mm256_permutevar8x32_ps(r, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// 8 vectors (rows) to 8 vectors (columns): out[i] lane j = in[j] lane i.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    let t: [__m256; 8] = [
        _mm256_unpacklo_ps(r[0], r[1]),
        _mm256_unpackhi_ps(r[0], r[1]),
        _mm256_unpacklo_ps(r[2], r[3]),
        _mm256_unpackhi_ps(r[2], r[3]),
        _mm256_unpacklo_ps(r[4], r[5]),
        _mm256_unpackhi_ps(r[4], r[5]),
        _mm256_unpacklo_ps(r[6], r[7]),
        _mm256_unpackhi_ps(r[6], r[7]),
    ];
    let u: [__m256; 8] = [
        _mm256_shuffle_ps::<0x44>(t[0], t[2]),
        _mm256_shuffle_ps::<0xEE>(t[0], t[2]),
        _mm256_shuffle_ps::<0x44>(t[1], t[3]),
        _mm256_shuffle_ps::<0xEE>(t[1], t[3]),
        _mm256_shuffle_ps::<0x44>(t[4], t[6]),
        _mm256_shuffle_ps::<0xEE>(t[4], t[6]),
        _mm256_shuffle_ps::<0x44>(t[5], t[7]),
        _mm256_shuffle_ps::<0xEE>(t[5], t[7]),
    ];
    [
        _mm256_permute2f128_ps::<0x20>(u[0], u[4]),
        _mm256_permute2f128_ps::<0x20>(u[1], u[5]),
        _mm256_permute2f128_ps::<0x20>(u[2], u[6]),
        _mm256_permute2f128_ps::<0x20>(u[3], u[7]),
        _mm256_permute2f128_ps::<0x31>(u[0], u[4]),
        _mm256_permute2f128_ps::<0x31>(u[1], u[5]),
        _mm256_permute2f128_ps::<0x31>(u[2], u[6]),
        _mm256_permute2f128_ps::<0x31>(u[3], u[7]),
    ]
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chain(k: &[half::f16], q: &[f32], rows: usize, keys: usize, buf: &mut [f32], out: &mut [f32]) {
    for c0 in (0..keys).step_by(16) {
        // buf[d][c] = key c0 + c, dimension d
        for half in 0..2 {
            for d0 in (0..64).step_by(8) {
                let r: [__m256; 8] = std::array::from_fn(|c| _mm256_cvtph_ps(_mm_loadu_si128(k.as_ptr().add((c0 + 8 * half + c) * 64 + d0) as *const __m128i)));
                for (i, col) in transpose8(r).iter().enumerate() {
                    _mm256_storeu_ps(buf.as_mut_ptr().add((d0 + i) * 16 + 8 * half), *col);
                }
            }
        }
        let mut r0 = 0;
        while r0 < rows {
            match rows - r0 {
                1 => chain_rows::<1>(q, r0, keys, c0, buf, out),
                2 => chain_rows::<2>(q, r0, keys, c0, buf, out),
                3 => chain_rows::<3>(q, r0, keys, c0, buf, out),
                4 => chain_rows::<4>(q, r0, keys, c0, buf, out),
                5 => chain_rows::<5>(q, r0, keys, c0, buf, out),
                _ => chain_rows::<6>(q, r0, keys, c0, buf, out),
            }
            r0 += 6;
        }
    }
}

/// R rows × 16 keys: 2R sums, 2 key vectors and a broadcast q (15 of the 16 registers at R = 6).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chain_rows<const R: usize>(q: &[f32], r0: usize, keys: usize, c0: usize, buf: &[f32], out: &mut [f32]) {
    let mut s = [[_mm256_setzero_ps(); 2]; R];
    for d in 0..64 {
        let (k0, k1) = (_mm256_loadu_ps(buf.as_ptr().add(d * 16)), _mm256_loadu_ps(buf.as_ptr().add(d * 16 + 8)));
        for (r, s) in s.iter_mut().enumerate() {
            let qd = _mm256_broadcast_ss(&*q.as_ptr().add((r0 + r) * 64 + d));
            s[0] = _mm256_fmadd_ps(qd, k0, s[0]);
            s[1] = _mm256_fmadd_ps(qd, k1, s[1]);
        }
    }
    for (r, s) in s.iter().enumerate() {
        _mm256_storeu_ps(out.as_mut_ptr().add((r0 + r) * keys + c0), s[0]);
        _mm256_storeu_ps(out.as_mut_ptr().add((r0 + r) * keys + c0 + 8), s[1]);
    }
}

//! What a second score order would buy on AVX2 before any numerics changes: one thread scores ROWS query
//! rows (head size 64) against KEYS f16 keys, 16 keys a chunk converted to f32 once, in two orders:
//! - `ggml`: today's order (both numerics; `attention::tiled_avx2::chunk_scores`): per key a 64-value dot
//!   in 8 lanes, 8 FMAs and 3 adds, then 8 keys' lanes summed by a shuffle network;
//! - `chain`: the chunk's keys stored dimension-major (`[64][16]`, an 8×8 transpose per block), and each
//!   score one FMA chain over the 64 dimensions, 8 keys a register, 6 rows a pass: no horizontal sum, and
//!   different roundings (it would be a second, documented numerics).
//! - `stored`: the same chains as `chain`, the keys already stored dimension-major in the cache (each
//!   16-cell block `[64][16]` f16, as the quantized key formats already lay out their codes), so no
//!   transpose: up to 6 rows convert each dimension's 16 keys in registers, more rows convert the block
//!   into a `[64][16]` f32 buffer once. Its results are `chain`'s bits.
//!
//! With AVX-512 two more arms: `ggml512`, today's AVX-512 scores (at most 3 rows, a decode token's
//! group: `attention::tiled::chunk_scores_few_64`, keys in pairs from f16 registers and the 16-key
//! reduction tree run as they arrive; more rows: `chunk_scores_nv`, the chunk converted into an f32 key
//! buffer, then per row 16 keys' dots and `reduce_16_rows`) and `stored512`, the stored chains with 16
//! keys a register and q broadcast from memory (more than 3 rows: the block converted into a `[64][16]`
//! f32 buffer once, 8 rows a pass).
//!
//! `score_order_bench [ROWS] [KEYS] [REPS] [ROUNDS]`: the three alternate ROUNDS times; each prints the
//! median ns per (row, key) of REPS, and the ratios. 3 rows is a lone SmolLM2 token's GQA group (decode),
//! 24 and 56 are prefill tiles of SmolLM2 and Qwen2.5.
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
    // the cache's blocks of 16 cells, dimension-major: kt[(block * 64 + d) * 16 + c] = k[(16 block + c) * 64 + d]
    let mut kt = k.clone();
    for (i, v) in k.iter().enumerate() {
        let (cell, d) = (i / 64, i % 64);
        kt[((cell / 16) * 64 + d) * 16 + cell % 16] = *v;
    }
    let (mut out_g, mut out_c, mut out_s) = (vec![0f32; rows * keys], vec![0f32; rows * keys], vec![0f32; rows * keys]);
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
        reckon_lab::stats::median(&t) * 1e9 / (rows * keys) as f64
    };
    for round in 0..rounds {
        // SAFETY: AVX2, FMA and F16C were checked; the buffers have the sizes the kernels index.
        let g = time(&mut || unsafe { ggml(&k, &q, rows, keys, &mut buf, &mut out_g) });
        let c = time(&mut || unsafe { chain(&k, &q, rows, keys, &mut buf, &mut out_c) });
        let st = time(&mut || unsafe { stored(&kt, &q, rows, keys, &mut buf, &mut out_s) });
        let diff = out_g.iter().zip(&out_c).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(out_c.iter().zip(&out_s).all(|(x, y)| x.to_bits() == y.to_bits()), "stored keys give the chain's bits");
        println!(
            "round {round} rows {rows} keys {keys}: ggml order {g:.3} ns per row·key, one chain {c:.3}, stored dimension-major {st:.3}; ggml/chain {:.2}x, ggml/stored {:.2}x; max |difference| {diff:.2e}",
            g / c,
            g / st
        );
        if is_x86_feature_detected!("avx512f") {
            let mut out_5 = vec![0f32; rows * keys];
            // SAFETY: AVX-512 F was checked; as above.
            let g5 = time(&mut || unsafe { ggml512(&k, &q, rows, keys, &mut buf, &mut out_5) });
            let s5 = time(&mut || unsafe { stored512(&kt, &q, rows, keys, &mut buf, &mut out_s) });
            assert!(out_c.iter().zip(&out_s).all(|(x, y)| x.to_bits() == y.to_bits()), "AVX-512 stored chains give the chain's bits");
            println!("round {round} rows {rows} keys {keys}, AVX-512: ggml order {g5:.3} ns per row·key, stored dimension-major {s5:.3}; ggml/stored {:.2}x", g5 / s5);
        }
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
        chain_block(q, rows, keys, c0, buf, out);
    }
}

/// Every row's chains over one dimension-major block in `buf` (`[64][16]` f32), 6 rows a pass.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn chain_block(q: &[f32], rows: usize, keys: usize, c0: usize, buf: &[f32], out: &mut [f32]) {
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

/// `chain` over keys stored dimension-major (`kt`, blocks of `[64][16]` f16): no transpose.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn stored(kt: &[half::f16], q: &[f32], rows: usize, keys: usize, buf: &mut [f32], out: &mut [f32]) {
    for c0 in (0..keys).step_by(16) {
        let blk = kt.as_ptr().add(c0 * 64);
        if rows <= 6 {
            match rows {
                1 => stored_rows::<1>(q, keys, c0, blk, out),
                2 => stored_rows::<2>(q, keys, c0, blk, out),
                3 => stored_rows::<3>(q, keys, c0, blk, out),
                4 => stored_rows::<4>(q, keys, c0, blk, out),
                5 => stored_rows::<5>(q, keys, c0, blk, out),
                _ => stored_rows::<6>(q, keys, c0, blk, out),
            }
            continue;
        }
        for i in (0..64 * 16).step_by(8) {
            _mm256_storeu_ps(buf.as_mut_ptr().add(i), _mm256_cvtph_ps(_mm_loadu_si128(blk.add(i) as *const __m128i)));
        }
        chain_block(q, rows, keys, c0, buf, out);
    }
}

/// R (at most 6) rows × one stored block of 16 keys, each dimension's keys converted in registers.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn stored_rows<const R: usize>(q: &[f32], keys: usize, c0: usize, blk: *const half::f16, out: &mut [f32]) {
    let mut s = [[_mm256_setzero_ps(); 2]; R];
    for d in 0..64 {
        let k0 = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(d * 16) as *const __m128i));
        let k1 = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(d * 16 + 8) as *const __m128i));
        for (r, s) in s.iter_mut().enumerate() {
            let qd = _mm256_broadcast_ss(&*q.as_ptr().add(r * 64 + d));
            s[0] = _mm256_fmadd_ps(qd, k0, s[0]);
            s[1] = _mm256_fmadd_ps(qd, k1, s[1]);
        }
    }
    for (r, s) in s.iter().enumerate() {
        _mm256_storeu_ps(out.as_mut_ptr().add(r * keys + c0), s[0]);
        _mm256_storeu_ps(out.as_mut_ptr().add(r * keys + c0 + 8), s[1]);
    }
}

/// Today's AVX-512 few-row scores (head size 64, at most 3 rows), as `attention::tiled` has them.
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn ggml512(k: &[half::f16], q: &[f32], rows: usize, keys: usize, buf: &mut [f32], out: &mut [f32]) {
    match rows {
        1 => ggml512_rows::<1>(k, q, keys, out),
        2 => ggml512_rows::<2>(k, q, keys, out),
        3 => ggml512_rows::<3>(k, q, keys, out),
        _ => ggml512_tile(k, q, rows, keys, buf, out),
    }
}

/// Many rows: the chunk's 16 keys converted into `buf` (`[16][64]` f32) once, then per row the 16 dots
/// and the reduction network.
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn ggml512_tile(k: &[half::f16], q: &[f32], rows: usize, keys: usize, buf: &mut [f32], out: &mut [f32]) {
    for c0 in (0..keys).step_by(16) {
        for i in (0..16 * 64).step_by(16) {
            _mm512_storeu_ps(buf.as_mut_ptr().add(i), _mm512_cvtph_ps(_mm256_loadu_si256(k.as_ptr().add(c0 * 64 + i) as *const __m256i)));
        }
        for r in 0..rows {
            let qv: [__m512; 4] = std::array::from_fn(|j| _mm512_loadu_ps(q.as_ptr().add(r * 64 + 16 * j)));
            let mut v = [_mm512_setzero_ps(); 16];
            for (c, vc) in v.iter_mut().enumerate() {
                let pk = buf.as_ptr().add(c * 64);
                let kc = [_mm512_loadu_ps(pk), _mm512_loadu_ps(pk.add(16)), _mm512_loadu_ps(pk.add(32)), _mm512_loadu_ps(pk.add(48))];
                *vc = key_sum64(&kc, &qv);
            }
            _mm512_storeu_ps(out.as_mut_ptr().add(r * keys + c0), reduce16(&v));
        }
    }
}

/// Lane c of the result: the sum of v[c]'s lanes (`ggml::math::avx512::reduce_16_rows`' network).
#[inline(always)]
unsafe fn reduce16(v: &[__m512; 16]) -> __m512 {
    let x: [__m512; 8] = std::array::from_fn(|k| _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(v[2 * k], v[2 * k + 1]), _mm512_shuffle_f32x4::<0b11_10_11_10>(v[2 * k], v[2 * k + 1])));
    let y: [__m512; 4] = std::array::from_fn(|m| _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(x[2 * m], x[2 * m + 1]), _mm512_shuffle_f32x4::<0b11_01_11_01>(x[2 * m], x[2 * m + 1])));
    let z: [__m512; 2] = std::array::from_fn(|p| _mm512_add_ps(_mm512_shuffle_ps::<0x44>(y[2 * p], y[2 * p + 1]), _mm512_shuffle_ps::<0xEE>(y[2 * p], y[2 * p + 1])));
    let r = _mm512_add_ps(_mm512_shuffle_ps::<0x88>(z[0], z[1]), _mm512_shuffle_ps::<0xDD>(z[0], z[1]));
    _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r)
}

#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn ggml512_rows<const R: usize>(k: &[half::f16], q: &[f32], keys: usize, out: &mut [f32]) {
    let zero = _mm512_setzero_ps();
    let qv: [[__m512; 4]; R] = std::array::from_fn(|r| std::array::from_fn(|j| _mm512_loadu_ps(q.as_ptr().add(r * 64 + 16 * j))));
    for c0 in (0..keys).step_by(16) {
        let (mut xh, mut yh, mut zh, mut o) = ([zero; R], [zero; R], [zero; R], [zero; R]);
        for pair in 0..8 {
            let (ka, kb) = (key64(k, c0 + 2 * pair), key64(k, c0 + 2 * pair + 1));
            for r in 0..R {
                let (sa, sb) = (key_sum64(&ka, &qv[r]), key_sum64(&kb, &qv[r]));
                let x = _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(sa, sb), _mm512_shuffle_f32x4::<0b11_10_11_10>(sa, sb));
                if pair % 2 == 0 {
                    xh[r] = x;
                    continue;
                }
                let y = _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(xh[r], x), _mm512_shuffle_f32x4::<0b11_01_11_01>(xh[r], x));
                if pair % 4 == 1 {
                    yh[r] = y;
                    continue;
                }
                let z = _mm512_add_ps(_mm512_shuffle_ps::<0x44>(yh[r], y), _mm512_shuffle_ps::<0xEE>(yh[r], y));
                if pair == 3 {
                    zh[r] = z;
                } else {
                    let f = _mm512_add_ps(_mm512_shuffle_ps::<0x88>(zh[r], z), _mm512_shuffle_ps::<0xDD>(zh[r], z));
                    o[r] = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), f);
                }
            }
        }
        for (r, o) in o.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(r * keys + c0), *o);
        }
    }
}

/// Key `c` (64 values) as f32. Plain functions, no closures: a closure left out of line loses the
/// caller's AVX-512 features (as in `attention::tiled`).
#[inline(always)]
unsafe fn key64(k: &[half::f16], c: usize) -> [__m512; 4] {
    let src = k.as_ptr().add(c * 64) as *const __m256i;
    [_mm512_cvtph_ps(_mm256_loadu_si256(src)), _mm512_cvtph_ps(_mm256_loadu_si256(src.add(1))), _mm512_cvtph_ps(_mm256_loadu_si256(src.add(2))), _mm512_cvtph_ps(_mm256_loadu_si256(src.add(3)))]
}

/// ggml_vec_dot_f16's step for one key: `(a0 + a2) + (a1 + a3)`.
#[inline(always)]
unsafe fn key_sum64(k: &[__m512; 4], q: &[__m512; 4]) -> __m512 {
    let zero = _mm512_setzero_ps();
    let a02 = _mm512_fmadd_ps(k[2], q[2], _mm512_fmadd_ps(k[0], q[0], zero));
    let a13 = _mm512_fmadd_ps(k[3], q[3], _mm512_fmadd_ps(k[1], q[1], zero));
    _mm512_add_ps(a02, a13)
}

/// The stored chains on AVX-512: a block's dimension d is one 16-key register; q[r][d] broadcast.
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn stored512(kt: &[half::f16], q: &[f32], rows: usize, keys: usize, buf: &mut [f32], out: &mut [f32]) {
    match rows {
        1 => stored512_rows::<1>(kt, q, keys, out),
        2 => stored512_rows::<2>(kt, q, keys, out),
        3 => stored512_rows::<3>(kt, q, keys, out),
        _ => stored512_tile(kt, q, rows, keys, buf, out),
    }
}

/// Many rows: the block converted into `buf` (`[64][16]` f32) once, then 8 rows a pass.
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn stored512_tile(kt: &[half::f16], q: &[f32], rows: usize, keys: usize, buf: &mut [f32], out: &mut [f32]) {
    for c0 in (0..keys).step_by(16) {
        for i in (0..16 * 64).step_by(16) {
            _mm512_storeu_ps(buf.as_mut_ptr().add(i), _mm512_cvtph_ps(_mm256_loadu_si256(kt.as_ptr().add(c0 * 64 + i) as *const __m256i)));
        }
        let mut r0 = 0;
        while r0 < rows {
            match rows - r0 {
                1 => stored512_buf::<1>(q, r0, keys, c0, buf, out),
                2 => stored512_buf::<2>(q, r0, keys, c0, buf, out),
                3 => stored512_buf::<3>(q, r0, keys, c0, buf, out),
                4 => stored512_buf::<4>(q, r0, keys, c0, buf, out),
                5 => stored512_buf::<5>(q, r0, keys, c0, buf, out),
                6 => stored512_buf::<6>(q, r0, keys, c0, buf, out),
                7 => stored512_buf::<7>(q, r0, keys, c0, buf, out),
                _ => stored512_buf::<8>(q, r0, keys, c0, buf, out),
            }
            r0 += 8;
        }
    }
}

#[inline(always)]
unsafe fn stored512_buf<const R: usize>(q: &[f32], r0: usize, keys: usize, c0: usize, buf: &[f32], out: &mut [f32]) {
    let mut s = [_mm512_setzero_ps(); R];
    for d in 0..64 {
        let kd = _mm512_loadu_ps(buf.as_ptr().add(d * 16));
        for (r, s) in s.iter_mut().enumerate() {
            *s = _mm512_fmadd_ps(_mm512_set1_ps(*q.as_ptr().add((r0 + r) * 64 + d)), kd, *s);
        }
    }
    for (r, s) in s.iter().enumerate() {
        _mm512_storeu_ps(out.as_mut_ptr().add((r0 + r) * keys + c0), *s);
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn stored512_rows<const R: usize>(kt: &[half::f16], q: &[f32], keys: usize, out: &mut [f32]) {
    for c0 in (0..keys).step_by(16) {
        let blk = kt.as_ptr().add(c0 * 64);
        let mut s = [_mm512_setzero_ps(); R];
        for d in 0..64 {
            let kd = _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(d * 16) as *const __m256i));
            for (r, s) in s.iter_mut().enumerate() {
                *s = _mm512_fmadd_ps(_mm512_set1_ps(*q.as_ptr().add(r * 64 + d)), kd, *s);
            }
        }
        for (r, s) in s.iter().enumerate() {
            _mm512_storeu_ps(out.as_mut_ptr().add(r * keys + c0), *s);
        }
    }
}

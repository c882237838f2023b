//! AVX2 + FMA + F16C `vec_dot` kernels (x86-64-v3), the baseline SIMD level.
//!
//! The integer products use `vpmaddubsw` (u8 x i8 -> pairwise i16), then `vpmaddwd` with ones or with
//! the sub-block scales (-> i32). Nothing can saturate: the unsigned operand is at most 63 (or 128,
//! see `mul_sum_i8`) and activations are within +-127, so a pair is at most 2*128*127 = 32512.
//!
//! Bit-exact with llama.cpp on x86: every kernel reproduces the f32 arithmetic of ggml's x86 AVX2
//! `ggml_vec_dot_*` (ggml-cpu/arch/x86/quants.c, which llama.cpp also runs on AVX-512 machines):
//! the same 8 i32 lanes per block (lane k = elements 4k..4k+3 of each 32-element vector), one
//! 8-lane accumulator updated block by block with `fma(d, float(lane), acc)`, the same horizontal
//! sum, and the scalar side terms fused the way GCC compiles them (`summs += m * s` is an FMA; checked
//! against the disassembly of llama.cpp's libggml-cpu.so). The integer parts are exact anyway.

use std::arch::x86_64::*;

use super::blocks::*;
use super::x86_util::*;
use super::{check_dot_args, GgmlType, SimdLevel, VecDotFn};

/// The kernel for `t` at this level, if there is one. Panics if the CPU lacks the level: the
/// returned safe fns rely on it.
pub(super) fn kernel(t: GgmlType) -> Option<VecDotFn> {
    assert!(SimdLevel::Avx2.is_available());
    Some(match t {
        GgmlType::F32 => f32_f32,
        GgmlType::F16 => f16_f16,
        GgmlType::Q4_0 => q4_0_q8_0,
        GgmlType::Q4_1 => q4_1_q8_1,
        GgmlType::Q5_0 => q5_0_q8_0,
        GgmlType::Q5_1 => q5_1_q8_1,
        GgmlType::Q8_0 => q8_0_q8_0,
        GgmlType::Q4_K => q4_k_q8_k,
        GgmlType::Q5_K => q5_k_q8_k,
        GgmlType::Q6_K => q6_k_q8_k,
        GgmlType::Q8_1 | GgmlType::Q8_K => return None,
    })
}

/// Safe entry points: check the slices, then run the `unsafe` kernel.
macro_rules! safe_kernels {
    ($($name:ident => $t:ident, $imp:ident;)*) => {$(
        fn $name(n: usize, w: &[u8], a: &[u8]) -> f32 {
            check_dot_args(GgmlType::$t, n, w, a);
            // SAFETY: `vec_dot_kernel_at` hands this out only when AVX2, FMA and F16C are present,
            // and `check_dot_args` proved that all `n` elements of both rows are in bounds.
            unsafe { $imp(n, w.as_ptr(), a.as_ptr()) }
        }
    )*};
}

safe_kernels! {
    f32_f32 => F32, f32_impl;
    f16_f16 => F16, f16_impl;
    q4_0_q8_0 => Q4_0, q4_0_impl;
    q4_1_q8_1 => Q4_1, q4_1_impl;
    q5_0_q8_0 => Q5_0, q5_0_impl;
    q5_1_q8_1 => Q5_1, q5_1_impl;
    q8_0_q8_0 => Q8_0, q8_0_impl;
    q4_k_q8_k => Q4_K, q4_k_impl;
    q5_k_q8_k => Q5_K, q5_k_impl;
    q6_k_q8_k => Q6_K, q6_k_impl;
}

/// ggml_vec_dot_f32 in the AVX-512 order that `dot_scalar::f32_f32` emulates at every level (4
/// accumulators of 16 lanes, FMA, 64 elements a step, added 0+2, 1+3, then 0+1, `reduce_add_16`, the
/// tail one FMA at a time), each 16-lane accumulator held as two 8-lane registers: lane for lane the
/// same FMAs, so the same bits. The emulation read its bytes one f32 at a time and took 20% of a
/// 30B-A3B-shape decode step on its F32 routers (docs/speed.md).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f32_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    let (x, y) = (x as *const f32, y as *const f32);
    let whole = n / 64 * 64;
    // acc[2j + h]: lanes 8h..8h + 8 of accumulator j, i.e. elements 16j + 8h.. of each step of 64.
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut i = 0;
    while i < whole {
        for (k, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(i + 8 * k)), _mm256_loadu_ps(y.add(i + 8 * k)), *a);
        }
        i += 64;
    }
    let (a0, a1) = (_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[1], acc[5]));
    let (b0, b1) = (_mm256_add_ps(acc[2], acc[6]), _mm256_add_ps(acc[3], acc[7]));
    let mut lanes = [0.0f32; 16];
    _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(a0, b0));
    _mm256_storeu_ps(lanes.as_mut_ptr().add(8), _mm256_add_ps(a1, b1));
    let mut sum = super::math::reduce_add_16(&lanes);
    for i in whole..n {
        sum = (*x.add(i)).mul_add(*y.add(i), sum);
    }
    sum
}

/// 16 packed bytes -> 32 nibbles in element order: low nibbles (elements 0..16) in the low lane,
/// high nibbles (elements 16..32) in the high lane.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    // broadcast load + blend instead of an insert: keeps the single shuffle port free
    let v = _mm256_broadcastsi128_si256(load128(p));
    let v = _mm256_blend_epi32(v, _mm256_srli_epi16(v, 4), 0xF0);
    _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
}

/// Byte j = 0xFF if bit j of the little-endian u32 at `p` is set, else 0 (ggml's bytes_from_bits_32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bits_to_bytes32(p: *const u8) -> __m256i {
    let x = (p as *const u32).read_unaligned() as i32;
    let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x), shuf);
    // byte k of each 8-byte group: every bit set except bit k; OR gives all ones iff bit k was set
    let others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi64x(-1))
}

/// Unsigned x signed bytes -> 8 i32 sums of 4 products each.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mul_sum_u8_i8(x: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))
}

/// Signed x signed bytes -> 8 i32 sums of 4: |x| * (y with x's sign). |-128| = 0x80 is fine as
/// unsigned; y must not be -128 (quantized activations are within +-127).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn mul_sum_i8(x: __m256i, y: __m256i) -> __m256i {
    mul_sum_u8_i8(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x))
}

/// Loop over `nb` 32-element blocks; `$body` (using block index `$i`) yields (scale, f32 sums).
/// One accumulator, blocks in order: that is ggml's rounding sequence. (Two accumulators would hide
/// the FMA latency but change the result in the last bits.)
macro_rules! sum_blocks {
    ($nb:expr, |$i:ident| $body:expr) => {{
        let mut acc = _mm256_setzero_ps();
        for $i in 0..$nb {
            let (d, p) = $body;
            acc = _mm256_fmadd_ps(d, p, acc);
        }
        hsum_ps(acc)
    }};
}

/// Bytes ahead of the current super-block that the K-quant kernels prefetch: decode reads each weight row
/// once, and the hardware prefetcher alone left the kernels waiting on memory (as on AVX-512, see
/// `dot_avx512::PREFETCH_AHEAD`).
const PREFETCH_AHEAD: usize = 2048;

/// Prefetches the cache lines `PREFETCH_AHEAD` past the `bytes`-long block at `bx`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn prefetch_block(bx: *const u8, bytes: usize) {
    for off in (0..bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(bx.wrapping_add(PREFETCH_AHEAD + off) as *const i8);
    }
}

// ---- float types ----

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    let ld = |p: *const u8, i: usize| _mm256_cvtph_ps(load128(p.add(2 * i)));
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i + 32 <= n {
        for (k, a) in acc.iter_mut().enumerate() {
            *a = _mm256_fmadd_ps(ld(x, i + 8 * k), ld(y, i + 8 * k), *a);
        }
        i += 32;
    }
    while i + 8 <= n {
        acc[0] = _mm256_fmadd_ps(ld(x, i), ld(y, i), acc[0]);
        i += 8;
    }
    let mut s = hsum_ps(_mm256_add_ps(
        _mm256_add_ps(acc[0], acc[1]),
        _mm256_add_ps(acc[2], acc[3]),
    ));
    while i < n {
        s += f16_at(x.add(2 * i)) * f16_at(y.add(2 * i));
        i += 1;
    }
    s
}

// ---- legacy 32-element quants ----

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q8_0_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    sum_blocks!(n / QK, |i| {
        let (bx, by) = (x.add(i * Q8_0_BYTES), y.add(i * Q8_0_BYTES));
        (
            d_prod(bx, by),
            _mm256_cvtepi32_ps(mul_sum_i8(load256(bx.add(2)), load256(by.add(2)))),
        )
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_0_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    let eight = _mm256_set1_epi8(8);
    sum_blocks!(n / QK, |i| {
        let (bx, by) = (x.add(i * Q4_0_BYTES), y.add(i * Q8_0_BYTES));
        let qx = _mm256_sub_epi8(nibbles32(bx.add(2)), eight);
        (d_prod(bx, by), _mm256_cvtepi32_ps(mul_sum_i8(qx, load256(by.add(2)))))
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_1_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    let mut summs = _mm_setzero_ps();
    let s = sum_blocks!(n / QK, |i| {
        let (bx, by) = (x.add(i * Q4_1_BYTES), y.add(i * Q8_1_BYTES));
        let d = dm_prod(bx, by, &mut summs);
        (
            d,
            _mm256_cvtepi32_ps(mul_sum_u8_i8(nibbles32(bx.add(4)), load256(by.add(4)))),
        )
    });
    s + _mm_cvtss_f32(_mm_movehdup_ps(summs))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_0_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    let f0 = _mm256_set1_epi8(0xF0u8 as i8);
    sum_blocks!(n / QK, |i| {
        let (bx, by) = (x.add(i * Q5_0_BYTES), y.add(i * Q8_0_BYTES));
        let d = d_prod(bx, by);
        // (nibble | bit<<4) - 16 == nibble | (bit clear ? 0xF0 : 0) read as i8
        let hi = _mm256_andnot_si256(bits_to_bytes32(bx.add(2)), f0);
        let qx = _mm256_or_si256(nibbles32(bx.add(6)), hi);
        (d, _mm256_cvtepi32_ps(mul_sum_i8(qx, load256(by.add(2)))))
    })
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_1_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    let b4 = _mm256_set1_epi8(0x10);
    let mut summs = _mm_setzero_ps();
    let s = sum_blocks!(n / QK, |i| {
        let (bx, by) = (x.add(i * Q5_1_BYTES), y.add(i * Q8_1_BYTES));
        let d = dm_prod(bx, by, &mut summs);
        let hi = _mm256_and_si256(bits_to_bytes32(bx.add(4)), b4);
        let qx = _mm256_or_si256(nibbles32(bx.add(8)), hi);
        (d, _mm256_cvtepi32_ps(mul_sum_u8_i8(qx, load256(by.add(4)))))
    });
    s + _mm_cvtss_f32(_mm_movehdup_ps(summs))
}

// ---- K-quants ----

/// Broadcast i16 lane `k` of `v` (8 lanes) to all 16 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn splat_i16(v: __m256i, k: usize) -> __m256i {
    _mm256_shuffle_epi8(v, _mm256_set1_epi16((((2 * k + 1) << 8) | (2 * k)) as i16))
}

/// Shared by Q4_K and Q5_K (`q5`: add the 5th bit from the 32 qh bytes).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_k5_impl(n: usize, x: *const u8, y: *const u8, q5: bool) -> f32 {
    let (xbytes, qs_off) = if q5 {
        (Q5_K_BYTES, Q5_K_QS)
    } else {
        (Q4_K_BYTES, Q4_K_QS)
    };
    let m4 = _mm256_set1_epi8(0x0F);
    let b4 = _mm256_set1_epi8(0x10);
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    for i in 0..n / QK_K {
        let (bx, by) = (x.add(i * xbytes), y.add(i * Q8_K_BYTES));
        prefetch_block(bx, xbytes);
        // lanes [y.d * d, y.d * dmin]
        let dd = _mm_mul_ps(_mm_set1_ps(f32_at(by)), cvt_f16x2(rd32(bx)));
        let (sc, min_term) = k4_scales_and_min_term(bx, by);
        acc_m = min_update(acc_m, dd, min_term, q5);
        let scales = _mm256_set_m128i(sc, sc);
        let mut hbits = if q5 {
            load256(bx.add(Q5_K_QH))
        } else {
            _mm256_setzero_si256()
        };
        let mut sumi = _mm256_setzero_si256();
        for j in 0..4 {
            // 32 qs bytes: sub-block 2j in the low nibbles, 2j+1 in the high nibbles
            let qbits = load256(bx.add(qs_off + 32 * j));
            let mut ql = _mm256_and_si256(qbits, m4);
            let mut qh = _mm256_and_si256(_mm256_srli_epi16(qbits, 4), m4);
            if q5 {
                // bit 2j of qh[l] is the 5th bit of sub-block 2j, bit 2j+1 of sub-block 2j+1
                ql = _mm256_or_si256(ql, _mm256_and_si256(_mm256_slli_epi16(hbits, 4), b4));
                qh = _mm256_or_si256(qh, _mm256_and_si256(_mm256_slli_epi16(hbits, 3), b4));
                hbits = _mm256_srli_epi16(hbits, 2);
            }
            let yl = load256(by.add(Q8_K_QS + 64 * j));
            let yh = load256(by.add(Q8_K_QS + 64 * j + 32));
            let pl = _mm256_madd_epi16(splat_i16(scales, 2 * j), _mm256_maddubs_epi16(ql, yl));
            let ph = _mm256_madd_epi16(splat_i16(scales, 2 * j + 1), _mm256_maddubs_epi16(qh, yh));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
        }
        acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc) + min_finish(acc_m, q5)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    k4_k5_impl(n, x, y, false)
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_k_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    k4_k5_impl(n, x, y, true)
}

/// Q6_K: q is 6 bits unsigned; the -32 offset is applied once per block through the activation
/// group sums: sum sc*(q-32)*y = sum sc*q*y - 32 * sum_g sc[g]*bsums[g].
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_impl(n: usize, x: *const u8, y: *const u8) -> f32 {
    let m4 = _mm256_set1_epi8(0x0F);
    let m2 = _mm256_set1_epi8(0x03);
    let mut acc = _mm256_setzero_ps();
    for i in 0..n / QK_K {
        let (bx, by) = (x.add(i * Q6_K_BYTES), y.add(i * Q8_K_BYTES));
        prefetch_block(bx, Q6_K_BYTES);
        let d = f32_at(by) * f16_at(bx.add(Q6_K_D));
        let scales = load128(bx.add(Q6_K_SCALES));
        let offset = _mm256_madd_epi16(_mm256_cvtepi8_epi16(scales), load256(by.add(Q8_K_BSUMS)));
        let mut sumi = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(offset, 5));
        for h in 0..2 {
            let ql0 = load256(bx.add(64 * h));
            let ql1 = load256(bx.add(64 * h + 32));
            let qh = load256(bx.add(Q6_K_QH + 32 * h));
            let hi = |s: i32| _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(s)), m2), 4);
            let q = [
                _mm256_or_si256(_mm256_and_si256(ql0, m4), hi(0)),
                _mm256_or_si256(_mm256_and_si256(ql1, m4), hi(2)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), hi(4)),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), hi(6)),
            ];
            for (k, qk) in q.into_iter().enumerate() {
                let g = (8 * h + 2 * k) as i64;
                let pick = _mm_set_epi64x((g + 1) * 0x0101010101010101, g * 0x0101010101010101);
                let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick));
                let yk = load256(by.add(Q8_K_QS + 128 * h + 32 * k));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(sc, _mm256_maddubs_epi16(qk, yk)));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    hsum_ps(acc)
}

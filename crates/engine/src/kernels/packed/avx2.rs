//! The packed kernels on AVX2 (AMD Zen 2/3, Intel before AVX-512): each 16-row group in two halves of
//! 8 rows (one 256-bit register of results) × `NT` tokens. AVX2 has no `vpdpbusd`; `dp` makes the same
//! 32-bit lanes from `vpmaddubsw` (u8 × s8 pairs to i16) and `vpmaddwd` by ones (pairs to i32). That is
//! exact as long as no i16 pair sum saturates: the weight codes are at most 63 (Q6_K; 31 for Q5_0) and
//! the activation codes within ±127 (ggml's quantizers scale by 127 / amax), so 2 · 63 · 127 < 32767. Q8_0's codes go to 255 and would saturate, so its signed weights are used with
//! the sign moved onto the activations (|w| ≤ 128: 2 · 128 · 127 < 32767), as ggml's own AVX2 code does;
//! that gives `Σ w·y` directly, the same integer as the codes' `Σ q·y − 128·Σy`. So every result is the
//! AVX-512 kernels' and `reference::dot`'s, bit for bit (the unit tests run it under RECKON_SIMD=avx2).

use std::arch::x86_64::*;

use super::acts::LSide;
use super::layout::*;
use super::tile::*;
use super::{PackedInput, PackedMatrix};
use crate::kernels::ggml::GgmlType;

/// Most tokens per call for weights of type `t` (16 registers: the 8 weight vectors of a block and the
/// tokens' accumulators).
pub(super) fn tile_tokens(t: GgmlType) -> usize {
    match t {
        GgmlType::Q4_K | GgmlType::Q6_K => 2,
        _ => 4,
    }
}

/// See `packed::tile`.
///
/// # Safety
/// AVX2, FMA and F16C; `out` valid for the tile's writes; `x` holds tokens `t0..t0 + nt` of `m`'s
/// activation type.
pub(super) unsafe fn tile(m: &PackedMatrix, group: usize, x: &PackedInput, t0: usize, nt: usize, out: *mut f32, out_stride: usize) {
    let valid = (m.rows - group * GROUP).min(GROUP);
    let args = Tile { m, group, x, t0, out, out_stride, valid };
    for half in 0..valid.div_ceil(8) {
        macro_rules! by_nt {
            ($f:ident $(, $k:expr)?) => {
                match nt {
                    1 => $f::<$($k,)? 1>(&args, half),
                    2 => $f::<$($k,)? 2>(&args, half),
                    3 => $f::<$($k,)? 3>(&args, half),
                    _ => $f::<$($k,)? 4>(&args, half),
                }
            };
        }
        match m.dtype {
            GgmlType::Q4_0 => by_nt!(legacy, Q4_0),
            GgmlType::Q4_1 => by_nt!(legacy, Q4_1),
            GgmlType::Q5_0 => by_nt!(legacy, Q5_0),
            GgmlType::Q8_0 => by_nt!(legacy, Q8_0),
            GgmlType::Q4_K => by_nt!(q4_k),
            GgmlType::Q6_K => by_nt!(q6_k),
            other => unreachable!("{other} is not packed"),
        }
    }
}

impl Tile<'_> {
    /// Token t's 8 results of rows `8·half..`, those below `valid`.
    #[inline(always)]
    unsafe fn store8(&self, t: usize, half: usize, v: __m256) {
        let p = self.out_row(t).add(8 * half);
        let n = (self.valid - 8 * half).min(8);
        if n == 8 {
            _mm256_storeu_ps(p, v);
        } else {
            let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lanes), v);
        }
    }
}

/// `vpdpbusd` (u8 `a` × s8 `b`, 4 products per 32-bit lane, added to `acc`), exact while no pair sum
/// saturates i16 (see the module docs).
#[inline(always)]
unsafe fn dp(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)))
}

/// 4 activation codes at `p`, broadcast to every 32-bit lane.
#[inline(always)]
unsafe fn codes4(p: *const u8) -> __m256i {
    _mm256_set1_epi32((p as *const i32).read_unaligned())
}

/// 8 f16 at `p` as f32.
#[inline(always)]
unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// Bit i of `bits` as byte i: 0x10 if set, else 0 (ggml's `bytes_from_bits_32`, then the 5th bit).
#[inline(always)]
unsafe fn fifth_bits(bits: u32) -> __m256i {
    let shuffle = _mm256_set_epi64x(0x0303_0303_0303_0303, 0x0202_0202_0202_0202, 0x0101_0101_0101_0101, 0);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuffle);
    let set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe)), _mm256_set1_epi64x(-1));
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy<const KIND: u8, const NT: usize>(tl: &Tile, half: usize) {
    let m = tl.m;
    let (act_block, q_off) = if KIND == Q4_1 { (36, 4) } else { (34, 2) };
    // Q8_0 sums signed weights directly (module docs), so it needs no offset.
    let offset: i32 = match KIND {
        Q4_0 => 8,
        Q5_0 => 16,
        _ => 0,
    };
    let d_off = match KIND {
        Q4_0 => Q4_0_D,
        Q4_1 => Q4_1_D,
        Q5_0 => Q5_0_D,
        _ => Q8_0_D,
    };
    let (h, hd) = (32 * half, 16 * half);
    let nib = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); NT];
    let q: [*const u8; NT] = std::array::from_fn(|t| tl.act_row(t).add(q_off));
    let side: [*const LSide; NT] = std::array::from_fn(|t| tl.legacy_sides(t));
    let mut p = m.group_ptr(tl.group);
    for b in 0..m.blocks {
        if half == 0 {
            prefetch_ahead(p, m.block_bytes);
        }
        let dw = f16x8(p.add(d_off + hd));
        let mut w = [_mm256_setzero_si256(); 8];
        if KIND == Q8_0 {
            for (g, wg) in w.iter_mut().enumerate() {
                *wg = _mm256_xor_si256(_mm256_loadu_si256(p.add(64 * g + h) as *const __m256i), _mm256_set1_epi8(-128));
            }
        } else {
            for v in 0..4 {
                let x = _mm256_loadu_si256(p.add(64 * v + h) as *const __m256i);
                w[v] = _mm256_and_si256(x, nib);
                w[v + 4] = _mm256_and_si256(_mm256_srli_epi16::<4>(x), nib);
            }
            if KIND == Q5_0 {
                for (g, wg) in w.iter_mut().enumerate() {
                    let bits = ((p.add(Q5_0_QH + 8 * g) as *const u64).read_unaligned() >> (32 * half)) as u32;
                    *wg = _mm256_or_si256(*wg, fifth_bits(bits));
                }
            }
        }
        let mw = if KIND == Q4_1 { f16x8(p.add(Q4_1_M + hd)) } else { _mm256_setzero_ps() };
        unroll!(NT, |t| {
            let side = &*side[t].add(b);
            let q = q[t].add(b * act_block);
            let mut s = if offset == 0 { _mm256_setzero_si256() } else { _mm256_set1_epi32(-offset * side.sum) };
            for (g, wg) in w.iter().enumerate() {
                let y = codes4(q.add(4 * g));
                s = if KIND == Q8_0 { dp(s, _mm256_abs_epi8(*wg), _mm256_sign_epi8(y, *wg)) } else { dp(s, *wg, y) };
            }
            let d = _mm256_mul_ps(dw, _mm256_set1_ps(side.d));
            acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc[t]);
            if KIND == Q4_1 {
                acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(side.s), acc[t]);
            }
        });
        p = p.add(m.block_bytes);
    }
    for (t, a) in acc.iter().enumerate() {
        tl.store8(t, half, *a);
    }
}

/// Q4_K sub-block j's scales of the half's 8 rows, as i32 lanes.
#[inline(always)]
unsafe fn scales8(p: *const u8, j: usize, half: usize) -> __m256i {
    _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(Q4_K_SC + 16 * j + 8 * half) as *const __m128i))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k<const NT: usize>(tl: &Tile, half: usize) {
    let m = tl.m;
    let (h, hd) = (32 * half, 16 * half);
    let nib = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); NT];
    let mut p = m.group_ptr(tl.group);
    for b in 0..m.blocks {
        if half == 0 {
            prefetch_ahead(p, m.block_bytes);
        }
        let mut sums = [_mm256_setzero_si256(); NT];
        let qs: [*const u8; NT] = std::array::from_fn(|t| tl.k_quants(t, b));
        for c in 0..4 {
            let (sc_lo, sc_hi) = (scales8(p, 2 * c, half), scales8(p, 2 * c + 1, half));
            let mut lo = [_mm256_setzero_si256(); NT];
            let mut hi = [_mm256_setzero_si256(); NT];
            for g in 0..8 {
                let x = _mm256_loadu_si256(p.add(64 * (8 * c + g) + h) as *const __m256i);
                let (wl, wh) = (_mm256_and_si256(x, nib), _mm256_and_si256(_mm256_srli_epi16::<4>(x), nib));
                unroll!(NT, |t| {
                    let y = qs[t].add(64 * c + 4 * g);
                    lo[t] = dp(lo[t], wl, codes4(y));
                    hi[t] = dp(hi[t], wh, codes4(y.add(32)));
                });
            }
            unroll!(NT, |t| {
                sums[t] = _mm256_add_epi32(sums[t], _mm256_add_epi32(_mm256_mullo_epi32(lo[t], sc_lo), _mm256_mullo_epi32(hi[t], sc_hi)));
            });
        }
        let mins: [__m256i; 4] = std::array::from_fn(|i| _mm256_cvtepu8_epi16(_mm_loadu_si128(p.add(Q4_K_M + 32 * i + hd) as *const __m128i)));
        let (dw, dmw) = (f16x8(p.add(Q4_K_D + hd)), f16x8(p.add(Q4_K_DMIN + hd)));
        unroll!(NT, |t| {
            let side = tl.k_side(t, b);
            let pairs = side.sum32.as_ptr() as *const u8;
            let mut mm = _mm256_setzero_si256();
            for (i, mv) in mins.iter().enumerate() {
                mm = _mm256_add_epi32(mm, _mm256_madd_epi16(*mv, codes4(pairs.add(4 * i))));
            }
            let dy = _mm256_set1_ps(side.d);
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dy), _mm256_cvtepi32_ps(sums[t]), acc[t]);
            acc[t] = _mm256_fnmadd_ps(_mm256_mul_ps(dmw, dy), _mm256_cvtepi32_ps(mm), acc[t]);
        });
        p = p.add(m.block_bytes);
    }
    for (t, a) in acc.iter().enumerate() {
        tl.store8(t, half, *a);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k<const NT: usize>(tl: &Tile, half: usize) {
    let m = tl.m;
    let (h8, hd) = (32 * half, 16 * half);
    let nib = _mm256_set1_epi8(0x0F);
    let crumb = _mm256_set1_epi8(0x30);
    let mut acc = [_mm256_setzero_ps(); NT];
    let mut p = m.group_ptr(tl.group);
    for b in 0..m.blocks {
        if half == 0 {
            prefetch_ahead(p, m.block_bytes);
        }
        let mut sums = [_mm256_setzero_si256(); NT];
        let qs: [*const u8; NT] = std::array::from_fn(|t| tl.k_quants(t, b));
        for h in 0..2 {
            for cq in 0..2 {
                // Sub-blocks 8h + cq + 2s, s = 0..4: elements 128h + 32s + 16cq.. (see `layout`).
                let sub = |s: usize| 8 * h + 2 * s + cq;
                let mut part: [[__m256i; 4]; NT] = std::array::from_fn(|t| {
                    let side = tl.k_side(t, b);
                    std::array::from_fn(|s| _mm256_set1_epi32(side.neg32_sum16[sub(s)]))
                });
                for c in 4 * cq..4 * cq + 4 {
                    let v1 = _mm256_loadu_si256(p.add(64 * (16 * h + c) + h8) as *const __m256i);
                    let v2 = _mm256_loadu_si256(p.add(64 * (16 * h + c + 8) + h8) as *const __m256i);
                    let hh = _mm256_loadu_si256(p.add(Q6_K_QH + 64 * (8 * h + c) + h8) as *const __m256i);
                    let w = [
                        _mm256_or_si256(_mm256_and_si256(v1, nib), _mm256_and_si256(_mm256_slli_epi16::<4>(hh), crumb)),
                        _mm256_or_si256(_mm256_and_si256(v2, nib), _mm256_and_si256(_mm256_slli_epi16::<2>(hh), crumb)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(v1), nib), _mm256_and_si256(hh, crumb)),
                        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(v2), nib), _mm256_and_si256(_mm256_srli_epi16::<2>(hh), crumb)),
                    ];
                    unroll!(NT, |t| {
                        let y = qs[t].add(128 * h + 4 * c);
                        for s in 0..4 {
                            part[t][s] = dp(part[t][s], w[s], codes4(y.add(32 * s)));
                        }
                    });
                }
                let sc: [__m256i; 4] = std::array::from_fn(|s| _mm256_cvtepi8_epi32(_mm_loadl_epi64(p.add(Q6_K_SC + 16 * sub(s) + 8 * half) as *const __m128i)));
                unroll!(NT, |t| {
                    for s in 0..4 {
                        sums[t] = _mm256_add_epi32(sums[t], _mm256_mullo_epi32(part[t][s], sc[s]));
                    }
                });
            }
        }
        let dw = f16x8(p.add(Q6_K_D + hd));
        unroll!(NT, |t| {
            let dy = _mm256_set1_ps(tl.k_side(t, b).d);
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dy), _mm256_cvtepi32_ps(sums[t]), acc[t]);
        });
        p = p.add(m.block_bytes);
    }
    for (t, a) in acc.iter().enumerate() {
        tl.store8(t, half, *a);
    }
}

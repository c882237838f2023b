//! The packed kernels on AVX-VNNI (AVX2 plus a VEX-encoded `vpdpbusd` on 256-bit registers: Intel client
//! cores since Alder Lake, Xeons since Sapphire Rapids, AMD Zen 5). The AVX2 kernels' shape, each 16-row
//! group in two halves of 8 rows × `NT` tokens, with the AVX-512 kernels' integer dots: one `vpdpbusd`
//! per 8 rows × 4 codes and token, where AVX2 needs a `vpmaddubsw`, an i16 add and a share of a
//! widening, all on the same two ports. The K-quants' sub-block sums are i32 here and take their scales
//! by `vpmulld`, as on AVX-512. The integers are `reference::dot`'s, so the bits are too (the unit
//! tests run this file under RECKON_SIMD=avxvnni).

use std::arch::x86_64::*;

use super::acts::LSide;
use super::avx2::{codes4, f16x8, fifth_bits, q6_codes};
use super::layout::*;
use super::tile::*;
use super::{PackedInput, PackedMatrix};
use crate::kernels::ggml::GgmlType;

/// See `packed::tile`; as many tokens per call as on AVX2 (`avx2::tile_tokens`).
///
/// # Safety
/// AVX2, AVX-VNNI, FMA and F16C; `out` valid for the tile's writes; `x` holds tokens `t0..t0 + nt` of
/// `m`'s activation type.
pub(super) unsafe fn tile(m: &PackedMatrix, group: usize, x: &PackedInput, t0: usize, nt: usize, out: *mut f32, out_stride: usize) {
    let valid = (m.rows - group * GROUP).min(GROUP);
    let args = Tile { m, group, x, t0, out, out_stride, valid };
    macro_rules! by_nt {
        ($f:ident, $k:expr) => {
            match nt {
                1 => $f::<$k, 1>(&args),
                2 => $f::<$k, 2>(&args),
                3 => $f::<$k, 3>(&args),
                _ => $f::<$k, 4>(&args),
            }
        };
        ($f:ident; $half:expr) => {
            match nt {
                1 => $f::<1>(&args, $half),
                2 => $f::<2>(&args, $half),
                3 => $f::<3>(&args, $half),
                _ => $f::<4>(&args, $half),
            }
        };
    }
    match m.dtype {
        GgmlType::Q4_0 => by_nt!(legacy, Q4_0),
        GgmlType::Q4_1 => by_nt!(legacy, Q4_1),
        GgmlType::Q5_0 => by_nt!(legacy, Q5_0),
        GgmlType::Q8_0 => by_nt!(legacy, Q8_0),
        GgmlType::Q4_K => (0..valid.div_ceil(8)).for_each(|half| by_nt!(q4_k; half)),
        GgmlType::Q6_K => (0..valid.div_ceil(8)).for_each(|half| by_nt!(q6_k; half)),
        other => unreachable!("{other} is not packed"),
    }
}

/// `acc + Σ` of 4 u8 × s8 products per 32-bit lane (exact: no saturation, no i16 step).
#[inline(always)]
unsafe fn dp(acc: __m256i, a: __m256i, b: __m256i) -> __m256i {
    _mm256_dpbusd_avx_epi32(acc, a, b)
}

/// Sub-block j's 8 scales of the half's rows (u8 for Q4_K, i8 for Q6_K) as i32.
#[inline(always)]
unsafe fn scales32<const SIGNED: bool>(p: *const u8, j: usize, half: usize) -> __m256i {
    let s = _mm_loadl_epi64(p.add(16 * j + 8 * half) as *const __m128i);
    if SIGNED {
        _mm256_cvtepi8_epi32(s)
    } else {
        _mm256_cvtepu8_epi32(s)
    }
}

/// Q4_0, Q4_1, Q5_0 and Q8_0 (whose codes are `q + 128`, so its offset is 128, as on AVX-512), both
/// halves of the group in one pass: each broadcast of a token's 4 codes feeds two `vpdpbusd`: half the
/// broadcast loads of a pass per half (docs/speed.md: no gain measured beyond noise). One chain per
/// (half, token); a token alone gets a second pair (k-groups 4..8) so that `vpdpbusd`s stay in flight.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn legacy<const KIND: u8, const NT: usize>(tl: &Tile) {
    let m = tl.m;
    let (act_block, q_off) = if KIND == Q4_1 { (36, 4) } else { (34, 2) };
    let offset: i32 = match KIND {
        Q4_0 => 8,
        Q4_1 => 0,
        Q5_0 => 16,
        _ => 128,
    };
    let d_off = match KIND {
        Q4_0 => Q4_0_D,
        Q4_1 => Q4_1_D,
        Q5_0 => Q5_0_D,
        _ => Q8_0_D,
    };
    let nib = _mm256_set1_epi8(0x0F);
    let mut acc = [[_mm256_setzero_ps(); NT]; 2];
    let q: [*const u8; NT] = std::array::from_fn(|t| tl.act_row(t).add(q_off));
    let side: [*const LSide; NT] = std::array::from_fn(|t| tl.legacy_sides(t));
    let mut p = m.group_ptr(tl.group);
    for b in 0..m.blocks {
        prefetch_ahead::<PREFETCH_AHEAD_256>(p, m.block_bytes);
        // sums[h][t]: half h, token t (k-groups 0..4 when NT is 1, `more` the rest).
        let mut sums: [[__m256i; NT]; 2] = std::array::from_fn(|_| std::array::from_fn(|t| if offset == 0 { _mm256_setzero_si256() } else { _mm256_set1_epi32(-offset * (*side[t].add(b)).sum) }));
        let mut more = [_mm256_setzero_si256(); 2];
        let high = if KIND == Q5_0 { [0, 1].map(|h| _mm256_loadu_si256(p.add(Q5_0_QH + 32 * h) as *const __m256i)) } else { [_mm256_setzero_si256(); 2] };
        unroll!(4, |v| {
            // k-groups v (`wl`, codes at 4v) and v + 4 (`wh`, at 4v + 16) of both halves.
            let mut wl = [_mm256_setzero_si256(); 2];
            let mut wh = [_mm256_setzero_si256(); 2];
            for h in 0..2 {
                if KIND == Q8_0 {
                    wl[h] = _mm256_loadu_si256(p.add(64 * v + 32 * h) as *const __m256i);
                    wh[h] = _mm256_loadu_si256(p.add(64 * (v + 4) + 32 * h) as *const __m256i);
                } else {
                    let x = _mm256_loadu_si256(p.add(64 * v + 32 * h) as *const __m256i);
                    wl[h] = _mm256_and_si256(x, nib);
                    wh[h] = _mm256_and_si256(_mm256_srli_epi16::<4>(x), nib);
                    if KIND == Q5_0 {
                        wl[h] = _mm256_or_si256(wl[h], fifth_bits(high[h], v));
                        wh[h] = _mm256_or_si256(wh[h], fifth_bits(high[h], v + 4));
                    }
                }
            }
            unroll!(NT, |t| {
                let y = q[t].add(b * act_block + 4 * v);
                let (yl, yh) = (codes4(y), codes4(y.add(16)));
                for h in 0..2 {
                    sums[h][t] = dp(sums[h][t], wl[h], yl);
                    if NT == 1 {
                        more[h] = dp(more[h], wh[h], yh);
                    } else {
                        sums[h][t] = dp(sums[h][t], wh[h], yh);
                    }
                }
            });
        });
        for h in 0..2 {
            let dw = f16x8(p.add(d_off + 16 * h));
            let mw = if KIND == Q4_1 { f16x8(p.add(Q4_1_M + 16 * h)) } else { _mm256_setzero_ps() };
            unroll!(NT, |t| {
                let side = &*side[t].add(b);
                let s = if NT == 1 { _mm256_add_epi32(sums[h][t], more[h]) } else { sums[h][t] };
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(side.d));
                acc[h][t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc[h][t]);
                if KIND == Q4_1 {
                    acc[h][t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(side.s), acc[h][t]);
                }
            });
        }
        p = p.add(m.block_bytes);
    }
    for h in 0..tl.valid.div_ceil(8) {
        for (t, a) in acc[h].iter().enumerate() {
            tl.store8(t, h, *a);
        }
    }
}

/// Q4_K: each sub-block's dot in i32 (at most 32 · 15 · 128), times its scale by `vpmulld`.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn q4_k<const NT: usize>(tl: &Tile, half: usize) {
    let m = tl.m;
    let (h, hd) = (32 * half, 16 * half);
    let nib = _mm256_set1_epi8(0x0F);
    let mut acc = [_mm256_setzero_ps(); NT];
    let mut p = m.group_ptr(tl.group);
    for b in 0..m.blocks {
        if half == 0 {
            prefetch_ahead::<PREFETCH_AHEAD_256>(p, m.block_bytes);
        }
        let mut sums = [_mm256_setzero_si256(); NT];
        let qs: [*const u8; NT] = std::array::from_fn(|t| tl.k_quants(t, b));
        for c in 0..4 {
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
            let (sc_lo, sc_hi) = (scales32::<false>(p.add(Q4_K_SC), 2 * c, half), scales32::<false>(p.add(Q4_K_SC), 2 * c + 1, half));
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
                mm = _mm256_dpwssd_avx_epi32(mm, *mv, codes4(pairs.add(4 * i)));
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

/// Q6_K: each sub-block's dot in i32, started at −32 · Σy (the codes' offset, from the activation side
/// table), times its signed scale by `vpmulld`, as on AVX-512.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn q6_k<const NT: usize>(tl: &Tile, half: usize) {
    let m = tl.m;
    let hd = 16 * half;
    let mut acc = [_mm256_setzero_ps(); NT];
    let mut p = m.group_ptr(tl.group);
    for b in 0..m.blocks {
        if half == 0 {
            prefetch_ahead::<PREFETCH_AHEAD_256>(p, m.block_bytes);
        }
        let mut sums = [_mm256_setzero_si256(); NT];
        let qs: [*const u8; NT] = std::array::from_fn(|t| tl.k_quants(t, b));
        for h in 0..2 {
            for cq in 0..2 {
                // Sub-blocks 8h + cq + 2s, s = 0..4: elements 128h + 32s + 16cq.. (see `layout`).
                unroll!(4, |s| {
                    let sub = 8 * h + 2 * s + cq;
                    let mut part: [__m256i; NT] = std::array::from_fn(|t| _mm256_set1_epi32(tl.k_side(t, b).neg32_sum16[sub]));
                    for c in 4 * cq..4 * cq + 4 {
                        let w = q6_codes(p, h, c, s, half);
                        unroll!(NT, |t| {
                            part[t] = dp(part[t], w, codes4(qs[t].add(128 * h + 4 * c + 32 * s)));
                        });
                    }
                    let sc = scales32::<true>(p.add(Q6_K_SC), sub, half);
                    unroll!(NT, |t| {
                        sums[t] = _mm256_add_epi32(sums[t], _mm256_mullo_epi32(part[t], sc));
                    });
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

/// Whether `tiles_unpacked` takes `tokens` tokens of weights of type `t`: the legacy 4- and 5-bit types,
/// from as many tokens as on AVX2. The K-quants keep `tile`: with `vpdpbusd` a tile's share of their
/// unpacking is smaller than the i16 sums and widenings the AVX2 kernels over unpacked codes need.
pub(super) fn unpacks(t: GgmlType, tokens: usize) -> bool {
    matches!(t, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0) && super::avx2::unpacks(t, tokens)
}

/// `tile` for tokens `t0..t1` of group `group` (`unpacks`) over the group's codes unpacked once, in the
/// AVX2 kernels' buffer (`avx2::tiles_unpacked`): per block and token 8 `vpdpbusd` and the f32 steps,
/// where a tile unpacked 8 rows' 32 codes (Q5_0: 35 instructions) for its 4 tokens. Same integers,
/// same bits.
///
/// # Safety
/// As `tile`, for every token of `t0..t1`.
pub(super) unsafe fn tiles_unpacked(m: &PackedMatrix, group: usize, x: &PackedInput, t0: usize, t1: usize, out: *mut f32, out_stride: usize) {
    super::avx2::tiles_unpacked_by(m, group, x, t0, t1, out, out_stride, legacy_unpacked_any)
}

/// `legacy_unpacked` for the tile's type and `nt` tokens.
unsafe fn legacy_unpacked_any(tl: &Tile, half: usize, nt: usize, w: *const __m256i) {
    macro_rules! by_nt {
        ($k:expr) => {
            match nt {
                1 => legacy_unpacked::<$k, 1>(tl, half, w),
                2 => legacy_unpacked::<$k, 2>(tl, half, w),
                3 => legacy_unpacked::<$k, 3>(tl, half, w),
                _ => legacy_unpacked::<$k, 4>(tl, half, w),
            }
        };
    }
    match tl.m.dtype {
        GgmlType::Q4_0 => by_nt!(Q4_0),
        GgmlType::Q4_1 => by_nt!(Q4_1),
        GgmlType::Q5_0 => by_nt!(Q5_0),
        other => unreachable!("{other} is not unpacked on AVX-VNNI"),
    }
}

/// Q4_0, Q4_1, Q5_0 over the half's unpacked codes at `w` (`avx2::unpacked_vectors`' layout: 8
/// k-groups of codes, `d`, Q4_1's `m`): each token's sum starts at −offset·Σy, as in `legacy`.
#[target_feature(enable = "avx2,fma,f16c,avxvnni")]
unsafe fn legacy_unpacked<const KIND: u8, const NT: usize>(tl: &Tile, half: usize, w: *const __m256i) {
    let m = tl.m;
    let (act_block, q_off) = if KIND == Q4_1 { (36, 4) } else { (34, 2) };
    let offset: i32 = match KIND {
        Q4_0 => 8,
        Q5_0 => 16,
        _ => 0,
    };
    let q: [*const u8; NT] = std::array::from_fn(|t| tl.act_row(t).add(q_off));
    let side: [*const LSide; NT] = std::array::from_fn(|t| tl.legacy_sides(t));
    let mut acc = [_mm256_setzero_ps(); NT];
    for b in 0..m.blocks {
        let wb = w.add(b * super::avx2::UNPACKED_VECTORS);
        let mut s: [__m256i; NT] = std::array::from_fn(|t| if offset == 0 { _mm256_setzero_si256() } else { _mm256_set1_epi32(-offset * (*side[t].add(b)).sum) });
        unroll!(8, |g| {
            let wg = _mm256_load_si256(wb.add(g));
            unroll!(NT, |t| {
                s[t] = dp(s[t], wg, codes4(q[t].add(b * act_block + 4 * g)));
            });
        });
        let dw = _mm256_load_ps(wb.add(8) as *const f32);
        unroll!(NT, |t| {
            let side = &*side[t].add(b);
            let d = _mm256_mul_ps(dw, _mm256_set1_ps(side.d));
            acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s[t]), acc[t]);
            if KIND == Q4_1 {
                acc[t] = _mm256_fmadd_ps(_mm256_load_ps(wb.add(9) as *const f32), _mm256_set1_ps(side.s), acc[t]);
            }
        });
    }
    for (t, a) in acc.iter().enumerate() {
        tl.store8(t, half, *a);
    }
}

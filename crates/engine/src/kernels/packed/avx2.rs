//! The packed kernels on AVX2 (AMD Zen 2/3, Intel before AVX-512): each 16-row group in two halves of 8
//! rows (one 256-bit register of results) × `NT` tokens, both halves of a group-block before the next.
//! (Half 0 over all the blocks and then half 1 left DRAM idle during the second pass, which read the
//! group from L2: a 66 MB Q4_K matmul read 21-26 GB/s that way and 35-39 GB/s in one pass on Zen 4, and
//! the 3B shape decoded 17% faster; bench/results/size-decode-avx2-zen4-20261207.) AVX2 has no `vpdpbusd`; `vpmaddubsw` (u8 × s8
//! pairs to i16) and `vpmaddwd` (i16 pairs to i32) make the same 32-bit lanes. That is exact as long as
//! no i16 sum overflows: the activation codes are within ±127 (ggml's quantizers scale by 127 / amax;
//! the bounds below would hold at −128 too), so a `vpmaddubsw` pair is at most 2 · 31 · 128 for 5-bit
//! codes and 2 · 63 · 128 for Q6_K's. The kernels add as many `vpmaddubsw` results in i16 as that bound
//! allows before widening (8 for 4-bit codes, 4 for 5-bit, 2 for 6-bit; the K-quants widen with
//! `vpmaddwd` by their sub-block scales), so the widenings, which use the same two ports as the
//! multiplies, are 1/8 to 1/2 of them rather than one each. Q8_0's codes go to 255 and would saturate,
//! so its signed weights are used with the sign moved onto the activations (|w| ≤ 128: 2 · 128 · 127 <
//! 32767; this one needs the codes' ±127), as ggml's own AVX2 code does, one widening per k-group; that
//! gives `Σ w·y` directly, the same integer as the codes' `Σ q·y − 128·Σy`. So every result is the
//! AVX-512 kernels' and `reference::dot`'s, bit for bit (the unit tests run it under RECKON_SIMD=avx2,
//! with every code at its largest too).

use std::arch::x86_64::*;
use std::ops::Range;

use super::acts::LSide;
use super::layout::*;
use super::tile::*;
use super::{PackedInput, PackedMatrix};
use crate::kernels::ggml::GgmlType;

/// Most tokens per call for weights of type `t`: 4 for every type (16 registers hold the tokens' i16
/// and i32 sums and the unpacked weights; 6 tokens of Q4_1, or 3 of Q4_K, were no faster).
pub(super) fn tile_tokens(_t: GgmlType) -> usize {
    4
}

/// See `packed::tile`.
///
/// # Safety
/// AVX2, FMA and F16C; `out` valid for the tile's writes; `x` holds tokens `t0..t0 + nt` of `m`'s
/// activation type.
pub(super) unsafe fn tile(m: &PackedMatrix, group: usize, x: &PackedInput, t0: usize, nt: usize, out: *mut f32, out_stride: usize) {
    let valid = (m.rows - group * GROUP).min(GROUP);
    let args = Tile { m, group, x, t0, out, out_stride, valid };
    // Both halves of a group-block before the next: the second reads it from L1, and the prefetches
    // ahead keep one even stream.
    let halves = 0..valid.div_ceil(8);
    if m.dtype == GgmlType::Q8_0 {
        match nt {
            1 => legacy_q8_0::<1>(&args, halves),
            2 => legacy_q8_0::<2>(&args, halves),
            3 => legacy_q8_0::<3>(&args, halves),
            _ => legacy_q8_0::<4>(&args, halves),
        }
    } else {
        run::<false>(&args, halves, nt, std::ptr::null());
    }
}

/// The kernel of `tl`'s type for `nt` tokens and the halves in `halves`: over the packed group-blocks,
/// both halves of each (`U` false; `w` unused), or over one half's unpacked codes at `w` (`U` true,
/// `halves` that one; `tiles_unpacked`).
#[inline(always)]
unsafe fn run<const U: bool>(tl: &Tile, halves: Range<usize>, nt: usize, w: *const __m256i) {
    macro_rules! by_nt {
        ($f:ident $(, $k:expr)?) => {
            match nt {
                1 => $f::<$($k,)? 1, U>(tl, halves, w),
                2 => $f::<$($k,)? 2, U>(tl, halves, w),
                3 => $f::<$($k,)? 3, U>(tl, halves, w),
                _ => $f::<$($k,)? 4, U>(tl, halves, w),
            }
        };
    }
    match tl.m.dtype {
        GgmlType::Q4_0 => by_nt!(legacy, Q4_0),
        GgmlType::Q4_1 => by_nt!(legacy, Q4_1),
        GgmlType::Q5_0 => by_nt!(legacy, Q5_0),
        GgmlType::Q4_K => by_nt!(q4_k),
        GgmlType::Q6_K => by_nt!(q6_k),
        other => unreachable!("{other} has no such kernel"),
    }
}

impl Tile<'_> {
    /// Token t's 8 results of rows `8·half..`, those below `valid`.
    #[inline(always)]
    pub(super) unsafe fn store8(&self, t: usize, half: usize, v: __m256) {
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
pub(super) unsafe fn codes4(p: *const u8) -> __m256i {
    _mm256_set1_epi32((p as *const i32).read_unaligned())
}

/// 8 f16 at `p` as f32.
#[inline(always)]
pub(super) unsafe fn f16x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
}

/// `vpmaddubsw`: u8 `a` × s8 `b`, adjacent products summed to i16 (exact while no pair saturates).
#[inline(always)]
unsafe fn mul16(a: __m256i, b: __m256i) -> __m256i {
    _mm256_maddubs_epi16(a, b)
}

/// The i16 pair sums widened to one i32 per 4 codes (`vpmaddwd` by ones).
#[inline(always)]
unsafe fn widen(s16: __m256i) -> __m256i {
    _mm256_madd_epi16(s16, _mm256_set1_epi16(1))
}

/// Bit `g` of every byte of `high` (the Q5_0 layout's qh vector) at bit 4, as 0x10 or 0 per byte. The
/// 16-bit shifts never carry a bit across a byte boundary into bit 4: at most 4 places, within a byte.
#[inline(always)]
pub(super) unsafe fn fifth_bits(high: __m256i, g: usize) -> __m256i {
    let at4 = match g {
        0 => _mm256_slli_epi16::<4>(high),
        1 => _mm256_slli_epi16::<3>(high),
        2 => _mm256_slli_epi16::<2>(high),
        3 => _mm256_slli_epi16::<1>(high),
        4 => high,
        5 => _mm256_srli_epi16::<1>(high),
        6 => _mm256_srli_epi16::<2>(high),
        _ => _mm256_srli_epi16::<3>(high),
    };
    _mm256_and_si256(at4, _mm256_set1_epi8(0x10))
}

/// Q4_0, Q4_1, Q5_0: the 4-bit (5-bit) codes are at most 15 (31), so up to 8 (4) `vpmaddubsw` results
/// add up in i16 without overflow (16 products of at most 15 · 128, or 8 of 31 · 128, stay under
/// 2^15) and one `vpmaddwd` widens them: 8 (4) k-groups cost 8 multiplies and 1 (2) widenings instead of
/// 8 and 8. The integer is the same, so are the bits. The codes and scales are unpacked here from the
/// group-block (`U` false) or read from `w` (`U` true, `unpack`'s layout).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy<const KIND: u8, const NT: usize, const U: bool>(tl: &Tile, halves: Range<usize>, w: *const __m256i) {
    let m = tl.m;
    let (act_block, q_off) = if KIND == Q4_1 { (36, 4) } else { (34, 2) };
    let q: [*const u8; NT] = std::array::from_fn(|t| tl.act_row(t).add(q_off));
    let side: [*const LSide; NT] = std::array::from_fn(|t| tl.legacy_sides(t));
    let mut accs = [[_mm256_setzero_ps(); NT]; 2];
    let mut p = m.group_ptr(tl.group);
    for b in 0..m.blocks {
        let wb = w.wrapping_add(b * UNPACKED_VECTORS);
        if !U {
            prefetch_ahead::<PREFETCH_AHEAD_256>(p, m.block_bytes);
        }
        for half in halves.clone() {
            let acc = &mut accs[half & 1];
            // Per token, the i32 sum of the 8 k-groups: Q4 one i16 sum of all 8, Q5_0 two of 4 (0..4, 4..8).
            let mut s = [_mm256_setzero_si256(); NT];
            if U {
                // A k-group at a time: one i16 sum live per token, so 4 tokens' sums and accumulators stay
                // in registers.
                let parts = if KIND == Q5_0 { 2 } else { 1 };
                for part in 0..parts {
                    let mut s16 = [_mm256_setzero_si256(); NT];
                    for g in 8 / parts * part..8 / parts * (part + 1) {
                        let wg = _mm256_load_si256(wb.add(g));
                        unroll!(NT, |t| {
                            s16[t] = _mm256_add_epi16(s16[t], mul16(wg, codes4(q[t].add(b * act_block + 4 * g))));
                        });
                    }
                    unroll!(NT, |t| {
                        s[t] = _mm256_add_epi32(s[t], widen(s16[t]));
                    });
                }
            } else {
                // A packed vector at a time (k-groups v and v + 4 from one load): two chains of adds.
                let high = if KIND == Q5_0 { _mm256_loadu_si256(p.add(Q5_0_QH + 32 * half) as *const __m256i) } else { _mm256_setzero_si256() };
                let mut lo = [_mm256_setzero_si256(); NT];
                let mut hi = [_mm256_setzero_si256(); NT];
                unroll!(4, |v| {
                    let (wl, wh) = legacy_codes::<KIND>(p, high, v, half);
                    unroll!(NT, |t| {
                        let y = q[t].add(b * act_block + 4 * v);
                        let (pl, ph) = (mul16(wl, codes4(y)), mul16(wh, codes4(y.add(16))));
                        if KIND == Q5_0 {
                            lo[t] = _mm256_add_epi16(lo[t], pl);
                            hi[t] = _mm256_add_epi16(hi[t], ph);
                        } else {
                            lo[t] = _mm256_add_epi16(lo[t], _mm256_add_epi16(pl, ph));
                        }
                    });
                });
                unroll!(NT, |t| {
                    s[t] = widen(lo[t]);
                    if KIND == Q5_0 {
                        s[t] = _mm256_add_epi32(s[t], widen(hi[t]));
                    }
                });
            }
            let dw = if U { _mm256_load_ps(wb.add(8) as *const f32) } else { f16x8(p.add(legacy_d::<KIND>() + 16 * half)) };
            let mw = match (KIND == Q4_1, U) {
                (false, _) => _mm256_setzero_ps(),
                (true, true) => _mm256_load_ps(wb.add(9) as *const f32),
                (true, false) => f16x8(p.add(Q4_1_M + 16 * half)),
            };
            unroll!(NT, |t| {
                let side = &*side[t].add(b);
                let mut st = s[t];
                // −offset·Σy, the offset a power of two.
                if KIND == Q4_0 {
                    st = _mm256_sub_epi32(st, _mm256_slli_epi32::<3>(_mm256_set1_epi32(side.sum)));
                } else if KIND == Q5_0 {
                    st = _mm256_sub_epi32(st, _mm256_slli_epi32::<4>(_mm256_set1_epi32(side.sum)));
                }
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(side.d));
                acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(st), acc[t]);
                if KIND == Q4_1 {
                    acc[t] = _mm256_fmadd_ps(mw, _mm256_set1_ps(side.s), acc[t]);
                }
            });
        }
        p = p.add(m.block_bytes);
    }
    for half in halves {
        for (t, a) in accs[half & 1].iter().enumerate() {
            tl.store8(t, half, *a);
        }
    }
}

/// Offset of `d` in a Q4_0, Q4_1 or Q5_0 group-block.
#[inline(always)]
fn legacy_d<const KIND: u8>() -> usize {
    match KIND {
        Q4_0 => Q4_0_D,
        Q4_1 => Q4_1_D,
        _ => Q5_0_D,
    }
}

/// The half's codes of k-groups v (low nibbles) and v + 4 (high) in the Q4_0/Q4_1/Q5_0 group-block at
/// `p`, one byte a code; Q5_0's fifth bits come from `high` (the half's qh vector).
#[inline(always)]
unsafe fn legacy_codes<const KIND: u8>(p: *const u8, high: __m256i, v: usize, half: usize) -> (__m256i, __m256i) {
    let nib = _mm256_set1_epi8(0x0F);
    let x = _mm256_loadu_si256(p.add(64 * v + 32 * half) as *const __m256i);
    let mut wl = _mm256_and_si256(x, nib);
    let mut wh = _mm256_and_si256(_mm256_srli_epi16::<4>(x), nib);
    if KIND == Q5_0 {
        wl = _mm256_or_si256(wl, fifth_bits(high, v));
        wh = _mm256_or_si256(wh, fifth_bits(high, v + 4));
    }
    (wl, wh)
}

/// Q8_0: signed weights up to 128 in magnitude, so no two `vpmaddubsw` results may add in i16; each
/// k-group is widened on its own (module docs for the sign trick).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_q8_0<const NT: usize>(tl: &Tile, halves: Range<usize>) {
    let m = tl.m;
    let mut accs = [[_mm256_setzero_ps(); NT]; 2];
    let q: [*const u8; NT] = std::array::from_fn(|t| tl.act_row(t).add(2));
    let side: [*const LSide; NT] = std::array::from_fn(|t| tl.legacy_sides(t));
    let mut p = m.group_ptr(tl.group);
    for b in 0..m.blocks {
        prefetch_ahead::<PREFETCH_AHEAD_256>(p, m.block_bytes);
        for half in halves.clone() {
            let (acc, h, hd) = (&mut accs[half & 1], 32 * half, 16 * half);
            let dw = f16x8(p.add(Q8_0_D + hd));
            let w: [__m256i; 8] = std::array::from_fn(|g| _mm256_xor_si256(_mm256_loadu_si256(p.add(64 * g + h) as *const __m256i), _mm256_set1_epi8(-128)));
            unroll!(NT, |t| {
                let side = &*side[t].add(b);
                let q = q[t].add(b * 34);
                let mut s = _mm256_setzero_si256();
                for (g, wg) in w.iter().enumerate() {
                    s = dp(s, _mm256_abs_epi8(*wg), _mm256_sign_epi8(codes4(q.add(4 * g)), *wg));
                }
                let d = _mm256_mul_ps(dw, _mm256_set1_ps(side.d));
                acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc[t]);
            });
        }
        p = p.add(m.block_bytes);
    }
    for half in halves {
        for (t, a) in accs[half & 1].iter().enumerate() {
            tl.store8(t, half, *a);
        }
    }
}

/// Q4_K sub-block j's scales of the half's 8 rows, each twice as i16 (a row's 32-bit lane holds two
/// i16 sums, and `vpmaddwd` by this multiplies both by the row's scale and adds them).
#[inline(always)]
unsafe fn scales8(p: *const u8, j: usize, half: usize) -> __m256i {
    let s = _mm_loadl_epi64(p.add(Q4_K_SC + 16 * j + 8 * half) as *const __m128i);
    _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s, s))
}

/// A sub-block's 8 k-groups of 4-bit codes add up in i16 (16 products of at most 15 · 128 per i16,
/// under 2^15), and one `vpmaddwd` by the scales widens and scales them: per 32 codes and token, 8
/// multiplies and 1 widening instead of 8 and 8 plus a `vpmulld`. Same integers, same bits. Codes,
/// scales and mins from the group-block (`U` false) or from `w` (`U` true, `unpack`'s layout).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k<const NT: usize, const U: bool>(tl: &Tile, halves: Range<usize>, w: *const __m256i) {
    let m = tl.m;
    let mut accs = [[_mm256_setzero_ps(); NT]; 2];
    let mut p = m.group_ptr(tl.group);
    for b in 0..m.blocks {
        let wb = w.wrapping_add(b * Q4_K_UNPACKED);
        if !U {
            prefetch_ahead::<PREFETCH_AHEAD_256>(p, m.block_bytes);
        }
        for half in halves.clone() {
            let acc = &mut accs[half & 1];
            let hd = 16 * half;
            let mut sums = [_mm256_setzero_si256(); NT];
            let qs: [*const u8; NT] = std::array::from_fn(|t| tl.k_quants(t, b));
            if U {
                // A sub-block at a time: one i16 sum live per token.
                for sb in 0..8 {
                    let mut part = [_mm256_setzero_si256(); NT];
                    for g in 0..8 {
                        let wg = _mm256_load_si256(wb.add(8 * sb + g));
                        unroll!(NT, |t| {
                            part[t] = _mm256_add_epi16(part[t], mul16(wg, codes4(qs[t].add(32 * sb + 4 * g))));
                        });
                    }
                    let sc = _mm256_load_si256(wb.add(64 + sb));
                    unroll!(NT, |t| {
                        sums[t] = _mm256_add_epi32(sums[t], _mm256_madd_epi16(part[t], sc));
                    });
                }
            } else {
                // A packed vector at a time: sub-blocks 2c (low nibbles) and 2c + 1 (high) together.
                for c in 0..4 {
                    let mut lo = [_mm256_setzero_si256(); NT];
                    let mut hi = [_mm256_setzero_si256(); NT];
                    for g in 0..8 {
                        let (wl, wh) = q4_k_codes(p, c, g, half);
                        unroll!(NT, |t| {
                            let y = qs[t].add(64 * c + 4 * g);
                            lo[t] = _mm256_add_epi16(lo[t], mul16(wl, codes4(y)));
                            hi[t] = _mm256_add_epi16(hi[t], mul16(wh, codes4(y.add(32))));
                        });
                    }
                    let (sc_lo, sc_hi) = (scales8(p, 2 * c, half), scales8(p, 2 * c + 1, half));
                    unroll!(NT, |t| {
                        sums[t] = _mm256_add_epi32(sums[t], _mm256_add_epi32(_mm256_madd_epi16(lo[t], sc_lo), _mm256_madd_epi16(hi[t], sc_hi)));
                    });
                }
            }
            let mins: [__m256i; 4] = std::array::from_fn(|i| if U { _mm256_load_si256(wb.add(72 + i)) } else { q4_k_mins(p, i, half) });
            let (dw, dmw) = if U { (_mm256_load_ps(wb.add(76) as *const f32), _mm256_load_ps(wb.add(77) as *const f32)) } else { (f16x8(p.add(Q4_K_D + hd)), f16x8(p.add(Q4_K_DMIN + hd))) };
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
        }
        p = p.add(m.block_bytes);
    }
    for half in halves {
        for (t, a) in accs[half & 1].iter().enumerate() {
            tl.store8(t, half, *a);
        }
    }
}

/// The half's codes of vector 8c + g of the Q4_K group-block at `p`: sub-block 2c (low nibbles) and
/// 2c + 1 (high), k-group g, one byte a code.
#[inline(always)]
unsafe fn q4_k_codes(p: *const u8, c: usize, g: usize, half: usize) -> (__m256i, __m256i) {
    let nib = _mm256_set1_epi8(0x0F);
    let x = _mm256_loadu_si256(p.add(64 * (8 * c + g) + 32 * half) as *const __m256i);
    (_mm256_and_si256(x, nib), _mm256_and_si256(_mm256_srli_epi16::<4>(x), nib))
}

/// Min pair i (sub-blocks 2i, 2i + 1) of the half's 8 rows as i16.
#[inline(always)]
unsafe fn q4_k_mins(p: *const u8, i: usize, half: usize) -> __m256i {
    _mm256_cvtepu8_epi16(_mm_loadu_si128(p.add(Q4_K_M + 32 * i + 16 * half) as *const __m128i))
}

/// Q6_K sub-block j's signed scales of the half's 8 rows, each twice as i16 (see `scales8`).
#[inline(always)]
unsafe fn q6_scales_dup(p: *const u8, j: usize, half: usize) -> __m256i {
    let s = _mm_loadl_epi64(p.add(Q6_K_SC + 16 * j + 8 * half) as *const __m128i);
    _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s, s))
}

/// Q6_K: the 6-bit codes (0..=63) of elements `128h + 32s + 4c..+4` (c < 8) of the half's 8 rows in
/// the group-block at `p`, as 32 bytes (8 rows × 4 codes): ql vector `16h + c + 8(s & 1)`, its low
/// nibbles for s < 2 and high ones above, with bits 2s..2s+2 of qh vector `8h + c` on top (`layout`).
/// One copy for the AVX2 and AVX-VNNI kernels, which differ only in how they multiply.
#[inline(always)]
pub(super) unsafe fn q6_codes(p: *const u8, h: usize, c: usize, s: usize, half: usize) -> __m256i {
    let (nib, crumb) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let v = _mm256_loadu_si256(p.add(64 * (16 * h + c + 8 * (s & 1)) + 32 * half) as *const __m256i);
    let hh = _mm256_loadu_si256(p.add(Q6_K_QH + 64 * (8 * h + c) + 32 * half) as *const __m256i);
    let low = if s < 2 { _mm256_and_si256(v, nib) } else { _mm256_and_si256(_mm256_srli_epi16::<4>(v), nib) };
    let top = match s {
        0 => _mm256_slli_epi16::<4>(hh),
        1 => _mm256_slli_epi16::<2>(hh),
        2 => hh,
        _ => _mm256_srli_epi16::<2>(hh),
    };
    _mm256_or_si256(low, _mm256_and_si256(top, crumb))
}

/// Q6_K scale pair i (sub-blocks 2i, 2i + 1) of the half's 8 rows, as the i16 pairs `vpmaddwd` takes.
#[inline(always)]
unsafe fn q6_scale_pair(p: *const u8, i: usize, half: usize) -> __m256i {
    let (a, c) = (_mm_loadl_epi64(p.add(Q6_K_SC + 16 * (2 * i) + 8 * half) as *const __m128i), _mm_loadl_epi64(p.add(Q6_K_SC + 16 * (2 * i + 1) + 8 * half) as *const __m128i));
    _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, c))
}

/// Q6_K: the codes are at most 63, so two k-groups' `vpmaddubsw` results add up in i16 (8 products of
/// at most 63 · 128 per i16, under 2^15), and `vpmaddwd` by the sub-block's scales widens and scales
/// them. The codes' offset 32 is applied once per super-block instead of per sub-block: −32 · Σⱼ
/// scale[j] · Σy[j], from the activation block's own sums of 16 (`vpmaddwd` of scale pairs by sum
/// pairs). The integer is the one `reference::dot` forms, so the bits are too. Codes and scales from
/// the group-block (`U` false) or from `w` (`U` true, `unpack`'s layout).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k<const NT: usize, const U: bool>(tl: &Tile, halves: Range<usize>, w: *const __m256i) {
    let m = tl.m;
    let mut accs = [[_mm256_setzero_ps(); NT]; 2];
    let mut p = m.group_ptr(tl.group);
    for b in 0..m.blocks {
        let wb = w.wrapping_add(b * Q6_K_UNPACKED);
        if !U {
            prefetch_ahead::<PREFETCH_AHEAD_256>(p, m.block_bytes);
        }
        for half in halves.clone() {
            let acc = &mut accs[half & 1];
            let mut sums = [_mm256_setzero_si256(); NT];
            let qs: [*const u8; NT] = std::array::from_fn(|t| tl.k_quants(t, b));
            for h in 0..2 {
                for cq in 0..2 {
                    // Sub-blocks 8h + cq + 2s, s = 0..4: elements 128h + 32s + 16cq.. (see `layout`).
                    unroll!(4, |s| {
                        for cp in 0..2 {
                            let mut part = [_mm256_setzero_si256(); NT];
                            for c in 4 * cq + 2 * cp..4 * cq + 2 * cp + 2 {
                                let wv = if U { _mm256_load_si256(wb.add(32 * h + 4 * c + s)) } else { q6_codes(p, h, c, s, half) };
                                unroll!(NT, |t| {
                                    part[t] = _mm256_add_epi16(part[t], mul16(wv, codes4(qs[t].add(128 * h + 4 * c + 32 * s))));
                                });
                            }
                            let j = 8 * h + 2 * s + cq;
                            let sc = if U { _mm256_load_si256(wb.add(64 + j)) } else { q6_scales_dup(p, j, half) };
                            unroll!(NT, |t| {
                                sums[t] = _mm256_add_epi32(sums[t], _mm256_madd_epi16(part[t], sc));
                            });
                        }
                    });
                }
            }
            let pairs: [__m256i; 8] = std::array::from_fn(|i| if U { _mm256_load_si256(wb.add(80 + i)) } else { q6_scale_pair(p, i, half) });
            let dw = if U { _mm256_load_ps(wb.add(88) as *const f32) } else { f16x8(p.add(Q6_K_D + 16 * half)) };
            unroll!(NT, |t| {
                // The activation block's 16 i16 sums of 16 follow its 256 codes.
                let bsums = qs[t].add(256);
                let mut off = _mm256_setzero_si256();
                for (i, pr) in pairs.iter().enumerate() {
                    off = _mm256_add_epi32(off, _mm256_madd_epi16(*pr, codes4(bsums.add(4 * i))));
                }
                let s = _mm256_sub_epi32(sums[t], _mm256_slli_epi32::<5>(off));
                let dy = _mm256_set1_ps(tl.k_side(t, b).d);
                acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dy), _mm256_cvtepi32_ps(s), acc[t]);
            });
        }
        p = p.add(m.block_bytes);
    }
    for half in halves {
        for (t, a) in accs[half & 1].iter().enumerate() {
            tl.store8(t, half, *a);
        }
    }
}

/// Token ranges at least this long run `tiles_unpacked` (the group's codes unpacked once, then read by
/// every tile) rather than `tile` after `tile` (which unpacks a block's codes for each tile of 4
/// tokens); below it, the unpacking would cost more than it saves.
const UNPACK_MIN_TOKENS: usize = 8;

/// Whether `tiles_unpacked` takes `tokens` tokens of weights of type `t` (Q8_0's codes are bytes
/// already).
pub(super) fn unpacks(t: GgmlType, tokens: usize) -> bool {
    match t {
        GgmlType::Q8_0 => false,
        // A 4-bit code costs a tile one or two instructions to unpack, so the buffer's stores and loads
        // pay for themselves over more tokens (at 8: Q4_1 0.92x, Q4_K 0.93x).
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q4_K => tokens >= 2 * UNPACK_MIN_TOKENS,
        _ => tokens >= UNPACK_MIN_TOKENS,
    }
}

/// 256-bit vectors per group-block and half in the unpacked buffer (each vector of codes is 8 rows × 4
/// codes, u8, the `vpmaddubsw` operand):
/// - Q4_0, Q4_1, Q5_0: the 8 k-groups' codes, `d` as f32, (Q4_1) `m` as f32;
/// - Q4_K: 64 vectors of codes (`8s + g`: sub-block s, k-group g), the 8 sub-blocks' scales as
///   `scales8` gives them, the 4 min pairs, `d` and `dmin` as f32;
/// - Q6_K: 64 vectors of codes (`32h + 4c + s`, as `q6_codes(h, c, s)`), the 16 sub-blocks' scales as
///   `q6_scales_dup` gives them, the 8 scale pairs of the offset term, `d` as f32.
fn unpacked_vectors(t: GgmlType) -> usize {
    match t {
        GgmlType::Q4_K => Q4_K_UNPACKED,
        GgmlType::Q6_K => Q6_K_UNPACKED,
        _ => UNPACKED_VECTORS,
    }
}
pub(super) const UNPACKED_VECTORS: usize = 10;
const Q4_K_UNPACKED: usize = 64 + 8 + 4 + 2;
const Q6_K_UNPACKED: usize = 64 + 16 + 8 + 1;

thread_local! {
    /// The current group's unpacked codes, `[half][block][unpacked_vectors]` (Q5_0 at 896 columns:
    /// 8.75 KiB a half, so it stays in L1 while the tiles read it).
    static UNPACKED: std::cell::RefCell<Vec<__m256i>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `tile` for tokens `t0..t1` of group `group` (`unpacks`): the group's codes are unpacked once, to one
/// byte a code (Q5_0's fifth bit and Q6_K's crumbs put on), with the scales widened and converted, and
/// every tile of 4 tokens reads them from there. Per block and token that leaves the multiplies, their
/// i16 sums, the widenings and the f32 steps: for Q5_0 about 22 instructions instead of 31 (unpacking
/// 8 rows' 32 codes takes 35, and a tile shared them among only 4 tokens). The same kernels, reading
/// their codes from elsewhere, so the same bits.
///
/// # Safety
/// As `tile`, for every token of `t0..t1`.
pub(super) unsafe fn tiles_unpacked(m: &PackedMatrix, group: usize, x: &PackedInput, t0: usize, t1: usize, out: *mut f32, out_stride: usize) {
    tiles_unpacked_by(m, group, x, t0, t1, out, out_stride, run_unpacked)
}

/// `run` over one half's unpacked codes at `w`.
unsafe fn run_unpacked(tl: &Tile, half: usize, nt: usize, w: *const __m256i) {
    run::<true>(tl, half..half + 1, nt, w)
}

/// A kernel over unpacked codes: `(tile, half, tokens, the half's codes)`.
pub(super) type UnpackedKernel = unsafe fn(&Tile, usize, usize, *const __m256i);

/// `tiles_unpacked` with another instruction set's `kernel` over the same buffer (`avxvnni`).
///
/// # Safety
/// As `tile`, for every token of `t0..t1`; `kernel` runs on this CPU.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn tiles_unpacked_by(m: &PackedMatrix, group: usize, x: &PackedInput, t0: usize, t1: usize, out: *mut f32, out_stride: usize, kernel: UnpackedKernel) {
    UNPACKED.with_borrow_mut(|buf| {
        let per_block = unpacked_vectors(m.dtype);
        buf.resize(2 * m.blocks * per_block, _mm256_setzero_si256());
        unpack(m, group, buf.as_mut_ptr());
        let valid = (m.rows - group * GROUP).min(GROUP);
        for half in 0..valid.div_ceil(8) {
            let w = buf.as_ptr().add(half * m.blocks * per_block);
            let mut t = t0;
            while t < t1 {
                let nt = 4.min(t1 - t);
                kernel(&Tile { m, group, x, t0: t, out, out_stride, valid }, half, nt, w);
                t += nt;
            }
        }
    });
}

/// Group `group`'s codes and scales into `w` (`unpacked_vectors`' layout, `[half][block]`), computed by
/// the same helpers the kernels use on the packed bytes.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack(m: &PackedMatrix, group: usize, w: *mut __m256i) {
    let per_block = unpacked_vectors(m.dtype);
    let mut p = m.group_ptr(group);
    for b in 0..m.blocks {
        prefetch_ahead::<PREFETCH_AHEAD_256>(p, m.block_bytes);
        for half in 0..2 {
            let o = w.add((half * m.blocks + b) * per_block);
            let put = |i: usize, v: __m256i| _mm256_store_si256(o.add(i), v);
            let put_f32 = |i: usize, v: __m256| _mm256_store_ps(o.add(i) as *mut f32, v);
            match m.dtype {
                GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 => {
                    let high = if m.dtype == GgmlType::Q5_0 { _mm256_loadu_si256(p.add(Q5_0_QH + 32 * half) as *const __m256i) } else { _mm256_setzero_si256() };
                    for v in 0..4 {
                        let (wl, wh) = if m.dtype == GgmlType::Q5_0 { legacy_codes::<Q5_0>(p, high, v, half) } else { legacy_codes::<Q4_0>(p, high, v, half) };
                        put(v, wl);
                        put(v + 4, wh);
                    }
                    let d = match m.dtype {
                        GgmlType::Q4_0 => legacy_d::<Q4_0>(),
                        GgmlType::Q4_1 => legacy_d::<Q4_1>(),
                        _ => legacy_d::<Q5_0>(),
                    };
                    put_f32(8, f16x8(p.add(d + 16 * half)));
                    if m.dtype == GgmlType::Q4_1 {
                        put_f32(9, f16x8(p.add(Q4_1_M + 16 * half)));
                    }
                }
                GgmlType::Q4_K => {
                    for c in 0..4 {
                        for g in 0..8 {
                            let (wl, wh) = q4_k_codes(p, c, g, half);
                            put(8 * (2 * c) + g, wl);
                            put(8 * (2 * c + 1) + g, wh);
                        }
                    }
                    (0..8).for_each(|j| put(64 + j, scales8(p, j, half)));
                    (0..4).for_each(|i| put(72 + i, q4_k_mins(p, i, half)));
                    put_f32(76, f16x8(p.add(Q4_K_D + 16 * half)));
                    put_f32(77, f16x8(p.add(Q4_K_DMIN + 16 * half)));
                }
                GgmlType::Q6_K => {
                    for h in 0..2 {
                        for c in 0..8 {
                            (0..4).for_each(|s| put(32 * h + 4 * c + s, q6_codes(p, h, c, s, half)));
                        }
                    }
                    (0..16).for_each(|j| put(64 + j, q6_scales_dup(p, j, half)));
                    (0..8).for_each(|i| put(80 + i, q6_scale_pair(p, i, half)));
                    put_f32(88, f16x8(p.add(Q6_K_D + 16 * half)));
                }
                other => unreachable!("{other} is not unpacked"),
            }
        }
        p = p.add(m.block_bytes);
    }
}

//! The packed kernels on AVX-512 VNNI: 16 weight rows (one group, one 512-bit register of results) ×
//! `NT` tokens per call. Per block and token: `vpdpbusd` of each weight vector with the token's 4 codes
//! broadcast (integer, exact), then one conversion and one FMA for all 16 rows. The weight vectors are
//! unpacked once per block for all `NT` tokens. Same bits as `reference::dot` (tests).

use std::arch::x86_64::*;

use super::acts::LSide;
use super::layout::*;
use super::tile::*;
use super::{PackedInput, PackedMatrix};
use crate::kernels::ggml::GgmlType;

/// See `packed::tile`.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, FMA and F16C; `out` valid for the tile's writes; `x` holds tokens
/// `t0..t0 + nt` of `m`'s activation type.
pub(super) unsafe fn tile(m: &PackedMatrix, group: usize, x: &PackedInput, t0: usize, nt: usize, out: *mut f32, out_stride: usize) {
    let valid = (m.rows - group * GROUP).min(GROUP);
    let args = Tile { m, group, x, t0, out, out_stride, valid };
    macro_rules! by_nt {
        ($f:ident $(, $k:expr)?) => {
            match nt {
                1 => $f::<$($k,)? 1>(&args),
                2 => $f::<$($k,)? 2>(&args),
                3 => $f::<$($k,)? 3>(&args),
                4 => $f::<$($k,)? 4>(&args),
                5 => $f::<$($k,)? 5>(&args),
                6 => $f::<$($k,)? 6>(&args),
                7 => $f::<$($k,)? 7>(&args),
                _ => $f::<$($k,)? 8>(&args),
            }
        };
    }
    macro_rules! by_nt4 {
        ($f:ident) => {
            match nt {
                1 => $f::<1>(&args),
                2 => $f::<2>(&args),
                3 => $f::<3>(&args),
                _ => $f::<4>(&args),
            }
        };
    }
    match m.dtype {
        GgmlType::Q4_0 => by_nt!(legacy, Q4_0),
        GgmlType::Q4_1 => by_nt!(legacy, Q4_1),
        GgmlType::Q5_0 => by_nt!(legacy, Q5_0),
        GgmlType::Q8_0 => by_nt!(legacy, Q8_0),
        GgmlType::Q4_K => by_nt4!(q4_k),
        GgmlType::Q6_K => by_nt4!(q6_k),
        other => unreachable!("{other} is not packed"),
    }
}

impl Tile<'_> {
    #[inline(always)]
    unsafe fn store(&self, t: usize, v: __m512) {
        let p = self.out_row(t);
        if self.valid == GROUP {
            _mm512_storeu_ps(p, v);
        } else {
            _mm512_mask_storeu_ps(p, ((1u32 << self.valid) - 1) as u16, v);
        }
    }
}

/// 4 activation codes at `p`, broadcast to every 32-bit lane.
#[inline(always)]
unsafe fn codes4(p: *const u8) -> __m512i {
    _mm512_set1_epi32((p as *const i32).read_unaligned())
}

/// 16 f16 at `p` as f32.
#[inline(always)]
unsafe fn f16x16(p: *const u8) -> __m512 {
    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma,f16c")]
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
    let nib = _mm512_set1_epi8(0x0F);
    let sixteen = _mm512_set1_epi8(0x10);
    let mut acc = [_mm512_setzero_ps(); NT];
    // Each token's quants of block b at q[t] + b·act_block, its side entry at side[t] + b.
    let q: [*const u8; NT] = std::array::from_fn(|t| tl.act_row(t).add(q_off));
    let side: [*const LSide; NT] = std::array::from_fn(|t| tl.legacy_sides(t));
    let mut p = m.group_ptr(tl.group);
    for b in 0..m.blocks {
        prefetch_ahead::<PREFETCH_AHEAD>(p, m.block_bytes);
        let dw = f16x16(p.add(d_off));
        let mut w = [_mm512_setzero_si512(); 8];
        if KIND == Q8_0 {
            for (g, wg) in w.iter_mut().enumerate() {
                *wg = _mm512_loadu_si512(p.add(64 * g) as *const __m512i);
            }
        } else {
            for v in 0..4 {
                let x = _mm512_loadu_si512(p.add(64 * v) as *const __m512i);
                w[v] = _mm512_and_si512(x, nib);
                w[v + 4] = _mm512_and_si512(_mm512_srli_epi16::<4>(x), nib);
            }
            if KIND == Q5_0 {
                let high = _mm512_loadu_si512(p.add(Q5_0_QH) as *const __m512i);
                for (g, wg) in w.iter_mut().enumerate() {
                    let k = _mm512_test_epi8_mask(high, _mm512_set1_epi8(1 << g));
                    *wg = _mm512_mask_add_epi8(*wg, k, *wg, sixteen);
                }
            }
        }
        let mw = if KIND == Q4_1 { f16x16(p.add(Q4_1_M)) } else { _mm512_setzero_ps() };
        // The integer dots of all tokens first, k-group outer: the tokens' chains interleave in program
        // order, so the scheduler always has independent vpdpbusd at hand (integer sums: any order is
        // the same result).
        let mut sums = [_mm512_setzero_si512(); NT];
        if NT >= 3 {
            unroll!(NT, |t| {
                if offset != 0 {
                    sums[t] = _mm512_set1_epi32(-offset * (*side[t].add(b)).sum);
                }
            });
            for (g, wg) in w.iter().enumerate() {
                unroll!(NT, |t| {
                    sums[t] = _mm512_dpbusd_epi32(sums[t], *wg, codes4(q[t].add(b * act_block + 4 * g)));
                });
            }
        }
        unroll!(NT, |t| {
            let side = &*side[t].add(b);
            let q = q[t].add(b * act_block);
            let start = if offset == 0 { _mm512_setzero_si512() } else { _mm512_set1_epi32(-offset * side.sum) };
            let sum = if NT < 3 {
                // Two chains: one token alone would otherwise wait on 8 dependent vpdpbusd.
                let (mut even, mut odd) = (start, _mm512_setzero_si512());
                for g in (0..8).step_by(2) {
                    even = _mm512_dpbusd_epi32(even, w[g], codes4(q.add(4 * g)));
                    odd = _mm512_dpbusd_epi32(odd, w[g + 1], codes4(q.add(4 * g + 4)));
                }
                _mm512_add_epi32(even, odd)
            } else {
                sums[t]
            };
            let d = _mm512_mul_ps(dw, _mm512_set1_ps(side.d));
            acc[t] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sum), acc[t]);
            if KIND == Q4_1 {
                acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(side.s), acc[t]);
            }
        });
        p = p.add(m.block_bytes);
    }
    for (t, a) in acc.iter().enumerate() {
        tl.store(t, *a);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma,f16c")]
unsafe fn q4_k<const NT: usize>(tl: &Tile) {
    let m = tl.m;
    let nib = _mm512_set1_epi8(0x0F);
    let mut acc = [_mm512_setzero_ps(); NT];
    let mut p = m.group_ptr(tl.group);
    for b in 0..m.blocks {
        prefetch_ahead::<PREFETCH_AHEAD>(p, m.block_bytes);
        let mut sums = [_mm512_setzero_si512(); NT];
        let qs: [*const u8; NT] = std::array::from_fn(|t| tl.k_quants(t, b));
        for c in 0..4 {
            let sc_lo = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(Q4_K_SC + 16 * (2 * c)) as *const __m128i));
            let sc_hi = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(Q4_K_SC + 16 * (2 * c + 1)) as *const __m128i));
            let mut lo = [_mm512_setzero_si512(); NT];
            let mut hi = [_mm512_setzero_si512(); NT];
            for g in 0..8 {
                let x = _mm512_loadu_si512(p.add(64 * (8 * c + g)) as *const __m512i);
                let (wl, wh) = (_mm512_and_si512(x, nib), _mm512_and_si512(_mm512_srli_epi16::<4>(x), nib));
                unroll!(NT, |t| {
                    let y = qs[t].add(64 * c + 4 * g);
                    lo[t] = _mm512_dpbusd_epi32(lo[t], wl, codes4(y));
                    hi[t] = _mm512_dpbusd_epi32(hi[t], wh, codes4(y.add(32)));
                });
            }
            unroll!(NT, |t| {
                sums[t] = _mm512_add_epi32(sums[t], _mm512_add_epi32(_mm512_mullo_epi32(lo[t], sc_lo), _mm512_mullo_epi32(hi[t], sc_hi)));
            });
        }
        let mins: [__m512i; 4] = std::array::from_fn(|i| _mm512_cvtepu8_epi16(_mm256_loadu_si256(p.add(Q4_K_M + 32 * i) as *const __m256i)));
        let (dw, dmw) = (f16x16(p.add(Q4_K_D)), f16x16(p.add(Q4_K_DMIN)));
        unroll!(NT, |t| {
            let side = tl.k_side(t, b);
            let pairs = side.sum32.as_ptr() as *const u8;
            let mut mm = _mm512_setzero_si512();
            for (i, mv) in mins.iter().enumerate() {
                mm = _mm512_dpwssd_epi32(mm, *mv, codes4(pairs.add(4 * i)));
            }
            let dy = _mm512_set1_ps(side.d);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dy), _mm512_cvtepi32_ps(sums[t]), acc[t]);
            acc[t] = _mm512_fnmadd_ps(_mm512_mul_ps(dmw, dy), _mm512_cvtepi32_ps(mm), acc[t]);
        });
        p = p.add(m.block_bytes);
    }
    for (t, a) in acc.iter().enumerate() {
        tl.store(t, *a);
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma,f16c")]
unsafe fn q6_k<const NT: usize>(tl: &Tile) {
    let m = tl.m;
    let nib = _mm512_set1_epi8(0x0F);
    let crumb = _mm512_set1_epi8(0x30);
    let mut acc = [_mm512_setzero_ps(); NT];
    let mut p = m.group_ptr(tl.group);
    for b in 0..m.blocks {
        prefetch_ahead::<PREFETCH_AHEAD>(p, m.block_bytes);
        let mut sums = [_mm512_setzero_si512(); NT];
        let qs: [*const u8; NT] = std::array::from_fn(|t| tl.k_quants(t, b));
        for h in 0..2 {
            for cq in 0..2 {
                // Sub-blocks 8h + cq + 2s, s = 0..4: elements 128h + 32s + 16cq.. (see `layout`).
                let sub = |s: usize| 8 * h + 2 * s + cq;
                // Plain loops, not `array::from_fn`: its closure has no AVX-512 target feature, so it
                // was compiled out of line and returned its vectors through memory (6% of a batch-8
                // decode step on the 3B shape, perf). Taking one sub-block at a time instead (fewer
                // live sums, the weight vector rebuilt from L1) measured slower: 27.8 -> 37.7 ns per
                // row-token at 4 tokens (matmul_bench q6_k 1024 3072 4, one thread).
                let mut part = [[_mm512_setzero_si512(); 4]; NT];
                unroll!(NT, |t| {
                    let side = tl.k_side(t, b);
                    for s in 0..4 {
                        part[t][s] = _mm512_set1_epi32(side.neg32_sum16[sub(s)]);
                    }
                });
                for c in 4 * cq..4 * cq + 4 {
                    let v1 = _mm512_loadu_si512(p.add(64 * (16 * h + c)) as *const __m512i);
                    let v2 = _mm512_loadu_si512(p.add(64 * (16 * h + c + 8)) as *const __m512i);
                    let hh = _mm512_loadu_si512(p.add(Q6_K_QH + 64 * (8 * h + c)) as *const __m512i);
                    let w = [
                        _mm512_or_si512(_mm512_and_si512(v1, nib), _mm512_and_si512(_mm512_slli_epi16::<4>(hh), crumb)),
                        _mm512_or_si512(_mm512_and_si512(v2, nib), _mm512_and_si512(_mm512_slli_epi16::<2>(hh), crumb)),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(v1), nib), _mm512_and_si512(hh, crumb)),
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(v2), nib), _mm512_and_si512(_mm512_srli_epi16::<2>(hh), crumb)),
                    ];
                    unroll!(NT, |t| {
                        let y = qs[t].add(128 * h + 4 * c);
                        for s in 0..4 {
                            part[t][s] = _mm512_dpbusd_epi32(part[t][s], w[s], codes4(y.add(32 * s)));
                        }
                    });
                }
                let sc: [__m512i; 4] = std::array::from_fn(|s| _mm512_cvtepi8_epi32(_mm_loadu_si128(p.add(Q6_K_SC + 16 * sub(s)) as *const __m128i)));
                unroll!(NT, |t| {
                    for s in 0..4 {
                        sums[t] = _mm512_add_epi32(sums[t], _mm512_mullo_epi32(part[t][s], sc[s]));
                    }
                });
            }
        }
        let dw = f16x16(p.add(Q6_K_D));
        unroll!(NT, |t| {
            let dy = _mm512_set1_ps(tl.k_side(t, b).d);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dy), _mm512_cvtepi32_ps(sums[t]), acc[t]);
        });
        p = p.add(m.block_bytes);
    }
    for (t, a) in acc.iter().enumerate() {
        tl.store(t, *a);
    }
}

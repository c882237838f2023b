//! AVX2 kernels for several dots at once (CPUs without AVX-512): the legacy types (Q4_0, Q4_1, Q5_0, Q8_0)
//! as `R` weight rows × `T` activation rows per call — `MULTI` rows × 1 token for decode, 1 row × `MULTI`
//! tokens for batches. The one-row kernel (`dot_avx2`) is one FMA chain per dot, so it waits on the FMA
//! latency at every block; here `R·T` chains interleave, the weight block is unpacked once for the `T`
//! tokens and the activation block loaded once for the `R` rows. Each dot runs exactly the one-row
//! kernel's arithmetic (same i32 lanes, `fma(dx·dy, lanes, acc)` block after block, the same horizontal
//! sum and, for Q4_1, the same `summs` FMA chain), so every result is bit-identical to it (tested).

use std::arch::x86_64::*;

use super::blocks::*;
use super::x86_util::*;
/// Bytes ahead of the current weight block that the decode kernel prefetches.
const PREFETCH_AHEAD: usize = 2048;

use super::{check_dot_args, GgmlType, MultiDotFn, MultiRowFn, SimdLevel, MULTI};

const K_Q4_0: u8 = 0;
const K_Q4_1: u8 = 1;
const K_Q5_0: u8 = 2;
const K_Q8_0: u8 = 3;

/// Bytes of one weight block of kind `K`.
const fn weight_bytes(k: u8) -> usize {
    match k {
        K_Q4_0 => Q4_0_BYTES,
        K_Q4_1 => Q4_1_BYTES,
        K_Q5_0 => Q5_0_BYTES,
        _ => Q8_0_BYTES,
    }
}

/// The multi-token kernel (weight rows × `MULTI`-token groups) for `t`: the legacy types here, the
/// K-quants in `dot_avx2_multi_k`.
pub(super) fn tokens_kernel(t: GgmlType) -> Option<MultiDotFn> {
    assert!(SimdLevel::Avx2.is_available());
    Some(match t {
        GgmlType::Q4_0 => q4_0_tokens,
        GgmlType::Q4_1 => q4_1_tokens,
        GgmlType::Q5_0 => q5_0_tokens,
        GgmlType::Q8_0 => q8_0_tokens,
        GgmlType::Q4_K => super::dot_avx2_multi_k::q4_k_multi,
        GgmlType::Q6_K => super::dot_avx2_multi_k::q6_k_multi,
        _ => return None,
    })
}

/// The multi-row kernel (`MULTI` weight rows × one token) for `t`.
pub(super) fn rows_kernel(t: GgmlType) -> Option<MultiRowFn> {
    assert!(SimdLevel::Avx2.is_available());
    Some(match t {
        GgmlType::Q4_0 => q4_0_rows,
        GgmlType::Q4_1 => q4_1_rows,
        GgmlType::Q5_0 => q5_0_rows,
        GgmlType::Q8_0 => q8_0_rows,
        _ => return None,
    })
}

macro_rules! safe_kernels {
    ($($tokens:ident, $rows:ident => $t:ident, $k:ident;)*) => {$(
        fn $tokens(n: usize, ws: &[u8], w_stride: usize, n_rows: usize, a: &[u8], stride: usize, out: &mut [f32]) {
            tokens::<$k>(GgmlType::$t, n, ws, w_stride, n_rows, a, stride, out)
        }

        fn $rows(n: usize, w: &[u8], stride: usize, a: &[u8]) -> [f32; MULTI] {
            let rows: [&[u8]; MULTI] = std::array::from_fn(|r| &w[(r * stride).min(w.len())..]);
            for row in rows {
                check_dot_args(GgmlType::$t, n, row, a);
            }
            // SAFETY: handed out only when AVX2, FMA and F16C are present; `check_dot_args` proved the
            // weight rows and the activation row in bounds.
            unsafe { tile_rows::<$k>(n / QK, rows.map(|r| r.as_ptr()), a.as_ptr()) }
        }
    )*};
}

safe_kernels! {
    q4_0_tokens, q4_0_rows => Q4_0, K_Q4_0;
    q4_1_tokens, q4_1_rows => Q4_1, K_Q4_1;
    q5_0_tokens, q5_0_rows => Q5_0, K_Q5_0;
    q8_0_tokens, q8_0_rows => Q8_0, K_Q8_0;
}

/// Tokens per group of the multi-token kernel where the batch allows (else `MULTI`): the weight block is
/// unpacked once for them.
const GROUP: usize = 8;

/// `MultiDotFn` for the legacy kind `K` (type `t`): groups of `GROUP` tokens, then one of `MULTI`.
#[allow(clippy::too_many_arguments)]
fn tokens<const K: u8>(t: GgmlType, n: usize, ws: &[u8], w_stride: usize, n_rows: usize, a: &[u8], stride: usize, out: &mut [f32]) {
    assert!(n_rows > 0 && out.len() % (n_rows * MULTI) == 0, "multi dot: output is not rows × whole groups of {MULTI}");
    let k = out.len() / n_rows;
    let rows: Vec<&[u8]> = (0..n_rows).map(|r| &ws[(r * w_stride).min(ws.len())..]).collect();
    for w in &rows {
        check_dot_args(t, n, w, a);
    }
    for t0 in 0..k {
        check_dot_args(t, n, rows[0], &a[(t0 * stride).min(a.len())..]);
    }
    let mut t0 = 0;
    while t0 < k {
        if k - t0 >= GROUP {
            group::<K, GROUP>(n / QK, &rows, a, stride, t0, k, out);
            t0 += GROUP;
        } else {
            group::<K, MULTI>(n / QK, &rows, a, stride, t0, k, out);
            t0 += MULTI;
        }
    }
}

/// Tokens `t0..t0 + T` against every row: `out[r * k + t0 + t]`. The caller checked every row in bounds.
fn group<const K: u8, const T: usize>(nb: usize, rows: &[&[u8]], a: &[u8], stride: usize, t0: usize, k: usize, out: &mut [f32]) {
    let acts: [*const u8; T] = std::array::from_fn(|t| a[(t0 + t) * stride..].as_ptr());
    SCALES.with_borrow_mut(|table| {
        table.resize(nb, BlockScales::default());
        // SAFETY: the kernels run only where AVX2, FMA and F16C are present (`tokens_kernel`); the
        // caller checked every weight and activation row for nb blocks; the table has nb entries.
        unsafe { fill_scales::<K, T>(nb, acts, table) };
        for (r, w) in rows.iter().enumerate() {
            // SAFETY: as above.
            let res = unsafe { tile_scaled::<K, T>(nb, w.as_ptr(), acts, table) };
            out[r * k + t0..][..T].copy_from_slice(&res);
        }
    });
}

/// The scales of one block of up to `GROUP` tokens' activations, converted once for all the weight rows
/// of a call: each token's `d`, then (Q8_1) its `s`.
#[derive(Clone, Copy, Default)]
#[repr(C, align(32))]
struct BlockScales {
    d: [f32; GROUP],
    s: [f32; GROUP],
}

thread_local! {
    static SCALES: std::cell::RefCell<Vec<BlockScales>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `table[b]` = the scales of block `b` of the `T` activation rows `acts` (T a multiple of 4).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fill_scales<const K: u8, const T: usize>(nb: usize, acts: [*const u8; T], table: &mut [BlockScales]) {
    let ab = if K == K_Q4_1 { Q8_1_BYTES } else { Q8_0_BYTES };
    for (b, sc) in table.iter_mut().enumerate().take(nb) {
        for h in 0..T / 4 {
            let at = |off: usize| -> [*const u8; 4] { [acts[4 * h].add(off), acts[4 * h + 1].add(off), acts[4 * h + 2].add(off), acts[4 * h + 3].add(off)] };
            _mm_store_ps(sc.d.as_mut_ptr().add(4 * h), f16x4_at(at(b * ab)));
            if K == K_Q4_1 {
                _mm_store_ps(sc.s.as_mut_ptr().add(4 * h), f16x4_at(at(b * ab + 2)));
            }
        }
    }
}

/// Eight lanes of the f16 at `p`, as f32 (a 16-bit broadcast from memory: no dependency on any register).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_x8(p: *const u8) -> __m256 {
    _mm256_cvtph_ps(_mm_set1_epi16(rd16(p) as i16))
}

/// One weight row (`nb` blocks of kind `K`) · the `T` activation rows `a`, whose block scales are in
/// `table`: each exactly `dot_avx2`'s one-row result. Per block: the row's `d` (and Q4_1's `m`) broadcast
/// once, the quants unpacked once; per token the one-row kernel's five operations.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_scaled<const K: u8, const T: usize>(nb: usize, w: *const u8, a: [*const u8; T], table: &[BlockScales]) -> [f32; T] {
    let (wb, ab, qoff) = (weight_bytes(K), if K == K_Q4_1 { Q8_1_BYTES } else { Q8_0_BYTES }, if K == K_Q4_1 { 4 } else { 2 });
    debug_assert!(table.len() >= nb && T <= GROUP);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    let mut summs = _mm256_setzero_ps(); // Q4_1: lane t = Σ m_x·s_y of token t (lanes past T unused)
    for (i, sc) in table.iter().enumerate().take(nb) {
        let bx = w.add(i * wb);
        let dx = f16_x8(bx);
        if K == K_Q4_1 {
            summs = _mm256_fmadd_ps(f16_x8(bx.add(2)), _mm256_load_ps(sc.s.as_ptr()), summs);
        }
        let qx = weight_quants::<K>(bx);
        let ux = if K == K_Q4_1 { qx } else { _mm256_sign_epi8(qx, qx) };
        for (t, acc_t) in acc.iter_mut().enumerate() {
            let qy = load256(a[t].add(i * ab + qoff));
            let sy8 = if K == K_Q4_1 { qy } else { _mm256_sign_epi8(qy, qx) };
            let lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(ux, sy8), ones));
            *acc_t = _mm256_fmadd_ps(_mm256_mul_ps(dx, _mm256_broadcast_ss(&sc.d[t])), lanes, *acc_t);
        }
    }
    let mut m = [0.0f32; GROUP];
    _mm256_storeu_ps(m.as_mut_ptr(), summs);
    let mut out = [0.0f32; T];
    for t in 0..T {
        out[t] = if K == K_Q4_1 { hsum_ps(acc[t]) + m[t] } else { hsum_ps(acc[t]) };
    }
    out
}

/// Weight block `bx`'s 32 quants as bytes: signed (Q4_0, Q5_0, Q8_0; as `dot_avx2`) or, for Q4_1, the
/// unsigned nibbles.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weight_quants<const K: u8>(bx: *const u8) -> __m256i {
    match K {
        K_Q4_0 => _mm256_sub_epi8(nibbles32(bx.add(2)), _mm256_set1_epi8(8)),
        K_Q4_1 => nibbles32(bx.add(4)),
        // (nibble | bit<<4) - 16 == nibble | (bit clear ? 0xF0 : 0) read as i8
        K_Q5_0 => _mm256_or_si256(nibbles32(bx.add(6)), _mm256_andnot_si256(bits_to_bytes32(bx.add(2)), _mm256_set1_epi8(0xF0u8 as i8))),
        _ => load256(bx.add(2)),
    }
}

/// 16 packed bytes -> 32 nibbles in element order (`dot_avx2::nibbles32`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    let v = _mm256_broadcastsi128_si256(load128(p));
    let v = _mm256_blend_epi32(v, _mm256_srli_epi16(v, 4), 0xF0);
    _mm256_and_si256(v, _mm256_set1_epi8(0x0F))
}

/// `dot_avx2::bits_to_bytes32`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bits_to_bytes32(p: *const u8) -> __m256i {
    let x = (p as *const u32).read_unaligned() as i32;
    let shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(x), shuf);
    let others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);
    _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi64x(-1))
}

/// Four f16 scales as f32 lanes, lane `k` the one at `p[k]`: gathered into one u64 in general
/// registers and moved in with `vmovq`. (A lone 16-bit load became `vpinsrw` into a loop
/// accumulator's register, which chained every block to the previous block's FMA; see `x86_util`.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16x4_at(p: [*const u8; 4]) -> __m128 {
    let mut bits = 0u64;
    for (k, q) in p.into_iter().enumerate() {
        bits |= (rd16(q) as u64) << (16 * k);
    }
    cvt_f16x4(bits)
}

/// `MULTI` weight rows (`w[r]`, `nb` blocks of kind `K`) · one activation row `a` (Q8_0, or Q8_1 for
/// Q4_1): each exactly `dot_avx2`'s one-row result. Scales are broadcast from memory (`vpbroadcastw`,
/// which depends on no register) and converted: `dx·dy` is the one-row kernel's f32 product in every
/// lane, Q4_1's `summs` an FMA chain per row in lane 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_rows<const K: u8>(nb: usize, w: [*const u8; MULTI], a: *const u8) -> [f32; MULTI] {
    let (wb, ab, qoff) = (weight_bytes(K), if K == K_Q4_1 { Q8_1_BYTES } else { Q8_0_BYTES }, if K == K_Q4_1 { 4 } else { 2 });
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); MULTI];
    let mut summs = [_mm_setzero_ps(); MULTI];
    for i in 0..nb {
        let by = a.add(i * ab);
        let dy = f16_x8(by);
        let sy = if K == K_Q4_1 { _mm256_castps256_ps128(f16_x8(by.add(2))) } else { _mm_setzero_ps() };
        let qy = load256(by.add(qoff));
        for r in 0..MULTI {
            let bx = w[r].add(i * wb);
            // Decode streams the weight rows one after another, a few hundred bytes each: too short a
            // stream for the hardware prefetcher (as on AVX-512, see `dot_avx512::PREFETCH_AHEAD`).
            _mm_prefetch::<_MM_HINT_T0>(bx.add(PREFETCH_AHEAD) as *const i8);
            let qx = weight_quants::<K>(bx);
            let lanes = if K == K_Q4_1 {
                summs[r] = _mm_fmadd_ps(_mm256_castps256_ps128(f16_x8(bx.add(2))), sy, summs[r]);
                _mm256_maddubs_epi16(qx, qy)
            } else {
                _mm256_maddubs_epi16(_mm256_sign_epi8(qx, qx), _mm256_sign_epi8(qy, qx))
            };
            let lanes = _mm256_cvtepi32_ps(_mm256_madd_epi16(lanes, ones));
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(f16_x8(bx), dy), lanes, acc[r]);
        }
    }
    let mut out = [0.0f32; MULTI];
    for r in 0..MULTI {
        out[r] = if K == K_Q4_1 { hsum_ps(acc[r]) + _mm_cvtss_f32(summs[r]) } else { hsum_ps(acc[r]) };
    }
    out
}

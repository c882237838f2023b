//! AVX-512 versions of the ggml routines in `super`: the same instructions in the same order as ggml's
//! AVX-512 build, so the results are bit-identical to the scalar emulations (which the tests check) and
//! to llama.cpp, at vector speed.

use std::arch::x86_64::*;

/// Whether this CPU runs the functions below.
pub fn available() -> bool {
    let f = crate::kernels::cpu::CpuFeatures::get();
    f.avx512f && f.avx512dq && f.fma && f.f16c
}

/// ggml_v_expf (vec.h, AVX-512).
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn v_expf(x: __m512) -> __m512 {
    let r = _mm512_set1_ps(f32::from_bits(0x4b40_0000));
    let z = _mm512_fmadd_ps(x, _mm512_set1_ps(f32::from_bits(0x3fb8_aa3b)), r);
    let n = _mm512_sub_ps(z, r);
    let b = _mm512_fnmadd_ps(
        n,
        _mm512_set1_ps(f32::from_bits(0x35bf_be8e)),
        _mm512_fnmadd_ps(n, _mm512_set1_ps(f32::from_bits(0x3f31_7200)), x),
    );
    let d = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(_mm512_abs_ps(n), _mm512_set1_ps(192.0));
    let u = _mm512_mul_ps(b, b);
    let j = _mm512_fmadd_ps(
        _mm512_fmadd_ps(
            _mm512_fmadd_ps(_mm512_set1_ps(f32::from_bits(0x3c07_2010)), b, _mm512_set1_ps(f32::from_bits(0x3d2b_9f17))),
            u,
            _mm512_fmadd_ps(_mm512_set1_ps(f32::from_bits(0x3e2a_af33)), b, _mm512_set1_ps(f32::from_bits(0x3eff_fedb))),
        ),
        u,
        _mm512_fmadd_ps(_mm512_set1_ps(f32::from_bits(0x3f7f_fff6)), b, _mm512_set1_ps(1.0)),
    );
    let res = _mm512_scalef_ps(j, n);
    if d == 0 {
        return res;
    }
    let zero = _mm512_setzero_ps();
    let alt = _mm512_mask_blend_ps(_mm512_cmp_ps_mask::<_CMP_LE_OQ>(n, zero), _mm512_set1_ps(f32::INFINITY), zero);
    _mm512_mask_blend_ps(d, res, alt)
}

/// GCC's `_mm512_reduce_add_ps`: 256-bit halves added, then 128-bit halves, then {2,3,0,1}, then lanes 0+1.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
pub(super) unsafe fn reduce_add(v: __m512) -> f32 {
    let hi = _mm512_extractf32x8_ps::<1>(v);
    let lo = _mm512_castps512_ps256(v);
    let t3 = _mm256_add_ps(hi, lo);
    let t6 = _mm_add_ps(_mm256_extractf128_ps::<1>(t3), _mm256_castps256_ps128(t3));
    let t8 = _mm_add_ps(t6, _mm_shuffle_ps::<0b01_00_11_10>(t6, t6));
    _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps::<0b01_01_01_01>(t8, t8))
}

/// ggml_vec_swiglu_f32's vector part: y = x / (1 + v_expf(-x)) · g over whole 16-lane vectors; returns
/// how many elements it did.
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
pub unsafe fn swiglu(x: &mut [f32], g: &[f32]) -> usize {
    let n = x.len().min(g.len()) / 16 * 16;
    let one = _mm512_set1_ps(1.0);
    for i in (0..n).step_by(16) {
        let xv = _mm512_loadu_ps(x.as_ptr().add(i));
        let gv = _mm512_loadu_ps(g.as_ptr().add(i));
        let e = v_expf(_mm512_sub_ps(_mm512_setzero_ps(), xv));
        let silu = _mm512_div_ps(xv, _mm512_add_ps(one, e));
        _mm512_storeu_ps(x.as_mut_ptr().add(i), _mm512_mul_ps(silu, gv));
    }
    n
}

/// ggml_soft_max over the cells `first_cell..first_cell + scores.len()` of a 16-aligned row whose other
/// cells are masked (exp = 0): see `super::soft_max`.
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
pub unsafe fn soft_max(scores: &mut [f32], first_cell: usize) {
    let len = scores.len();
    let mut maxv = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i + 16 <= len {
        maxv = _mm512_max_ps(maxv, _mm512_loadu_ps(scores.as_ptr().add(i)));
        i += 16;
    }
    let mut max = _mm512_reduce_max_ps(maxv);
    for &s in &scores[i..] {
        max = max.max(s);
    }
    let maxv = _mm512_set1_ps(max);
    let mut sum = 0.0f64;
    let start = first_cell % 16; // lane of the first score in its vector
    let mut base = -(start as isize); // score index of lane 0 of the current vector
    while base < len as isize {
        // Lanes whose score index is in 0..len.
        let lo = (-base).max(0) as u32;
        let hi = ((len as isize - base).min(16)) as u32;
        let mask: __mmask16 = ((1u32 << hi) - 1) as u16 & !(((1u32 << lo) - 1) as u16);
        let p = scores.as_mut_ptr().offset(base);
        let x = _mm512_mask_loadu_ps(_mm512_set1_ps(f32::NEG_INFINITY), mask, p);
        let e = v_expf(_mm512_sub_ps(x, maxv));
        _mm512_mask_storeu_ps(p, mask, e);
        sum += reduce_add(e) as f64;
        base += 16;
    }
    let inv = _mm512_set1_ps((1.0 / sum) as f32);
    let mut i = 0;
    while i + 16 <= len {
        let p = scores.as_mut_ptr().add(i);
        _mm512_storeu_ps(p, _mm512_mul_ps(_mm512_loadu_ps(p), inv));
        i += 16;
    }
    let inv = (1.0 / sum) as f32;
    scores[i..].iter_mut().for_each(|v| *v *= inv);
}

/// ggml_vec_dot_f16 (AVX-512): see `super::dot_f16`.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
pub unsafe fn dot_f16(x: &[half::f16], y: &[half::f16]) -> f32 {
    let n = x.len().min(y.len());
    let full = n / 64 * 64;
    let mut acc = [_mm512_setzero_ps(); 4];
    let (px, py) = (x.as_ptr() as *const __m256i, y.as_ptr() as *const __m256i);
    for step in (0..full / 16).step_by(4) {
        for (j, a) in acc.iter_mut().enumerate() {
            let ax = _mm512_cvtph_ps(_mm256_loadu_si256(px.add(step + j)));
            let ay = _mm512_cvtph_ps(_mm256_loadu_si256(py.add(step + j)));
            *a = _mm512_fmadd_ps(ax, ay, *a);
        }
    }
    let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
    let mut sum = reduce_add(v) as f64;
    for (a, b) in x[full..n].iter().zip(&y[full..n]) {
        sum += (a.to_f32() * b.to_f32()) as f64;
    }
    sum as f32
}

/// row += w·v over whole 16-element vectors (v converted from f16), with FMA as ggml_vec_dot_f16 does.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
pub unsafe fn fma_row(row: &mut [f32], w: f32, v: &[half::f16]) {
    let n = row.len().min(v.len()) / 16 * 16;
    let wv = _mm512_set1_ps(w);
    let pv = v.as_ptr() as *const __m256i;
    for i in (0..n).step_by(16) {
        let p = row.as_mut_ptr().add(i);
        let x = _mm512_cvtph_ps(_mm256_loadu_si256(pv.add(i / 16)));
        _mm512_storeu_ps(p, _mm512_fmadd_ps(wv, x, _mm512_loadu_ps(p)));
    }
}

/// `super::dot_f16` with the second vector already converted to f32 (exactly: every f16 is an f32): the
/// same products and sums, without converting the query again for every key.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
pub unsafe fn dot_f16_f32(x: &[half::f16], y: &[f32]) -> f32 {
    let n = x.len().min(y.len());
    let full = n / 64 * 64;
    let mut acc = [_mm512_setzero_ps(); 4];
    let px = x.as_ptr() as *const __m256i;
    for step in (0..full / 16).step_by(4) {
        for (j, a) in acc.iter_mut().enumerate() {
            let ax = _mm512_cvtph_ps(_mm256_loadu_si256(px.add(step + j)));
            let ay = _mm512_loadu_ps(y.as_ptr().add(16 * (step + j)));
            *a = _mm512_fmadd_ps(ax, ay, *a);
        }
    }
    let v = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
    let mut sum = reduce_add(v) as f64;
    for (a, &b) in x[full..n].iter().zip(&y[full..n]) {
        sum += (a.to_f32() * b) as f64;
    }
    sum as f32
}

/// The lanes of `super::LaneAcc` filled lane by lane: lane `l` (cells `c ≡ l mod 64`, ascending) keeps its
/// row of `hd <= 256` sums in registers, so each cell costs a load, a conversion and an FMA per 16 values,
/// with no accumulator traffic. Same per-lane order as adding the cells one by one. `rows`: `[64, hd]`;
/// returns the mask of lanes written (the others are untouched).
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
pub unsafe fn accumulate_lanes(rows: &mut [f32], hd: usize, first_cell: usize, w: &[f32], values: &[half::f16], offsets: &[usize]) -> u64 {
    debug_assert!(hd % 16 == 0 && hd <= 256 && rows.len() >= 64 * hd);
    // A compile-time register count keeps the accumulators in registers (with a run-time count the
    // compiler spilled them to the stack: perf showed the stores).
    match hd / 16 {
        4 => accumulate_lanes_nv::<4>(rows, first_cell, w, values, offsets),
        8 => accumulate_lanes_nv::<8>(rows, first_cell, w, values, offsets),
        16 => accumulate_lanes_nv::<16>(rows, first_cell, w, values, offsets),
        nv => {
            let mut touched = 0;
            // Other head sizes: one 16-value slice of every row at a time.
            for k in 0..nv {
                touched |= accumulate_lanes_slice(rows, hd, k, first_cell, w, values, offsets);
            }
            touched
        }
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn accumulate_lanes_nv<const NV: usize>(rows: &mut [f32], first_cell: usize, w: &[f32], values: &[half::f16], offsets: &[usize]) -> u64 {
    let hd = NV * 16;
    let mut touched = 0u64;
    for lane in 0..64usize {
        // the first cell index i (into w/offsets) whose cell is in this lane
        let first = (lane + 64 - first_cell % 64) % 64;
        if first >= w.len() {
            continue;
        }
        let mut acc = [_mm512_setzero_ps(); NV];
        let mut i = first;
        while i < w.len() {
            let wv = _mm512_set1_ps(w[i]);
            let pv = values.as_ptr().add(offsets[i]) as *const __m256i;
            for (k, a) in acc.iter_mut().enumerate() {
                *a = _mm512_fmadd_ps(wv, _mm512_cvtph_ps(_mm256_loadu_si256(pv.add(k))), *a);
            }
            i += 64;
        }
        let row = rows.as_mut_ptr().add(lane * hd);
        for (k, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(row.add(16 * k), *a);
        }
        touched |= 1 << lane;
    }
    touched
}

/// `super::reduce_lane_rows` for `hd` a multiple of 16: the same additions, 16 dimensions at a time in
/// registers (the scalar loops compile to 4-wide SSE at the baseline target). `rows` is only read.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
pub unsafe fn reduce_lane_rows(rows: &[f32], hd: usize, out: &mut [f32]) {
    debug_assert!(hd % 16 == 0 && rows.len() >= 64 * hd && out.len() >= hd);
    let row = |lane: usize, d: usize| _mm512_loadu_ps(rows.as_ptr().add(lane * hd + d));
    for d in (0..hd).step_by(16) {
        // v[l] = (lane l + lane 32+l) + (lane 16+l + lane 48+l), then 16 -> 8 -> 4, then (0+2) + (1+3).
        let mut v: [__m512; 16] = std::array::from_fn(|l| _mm512_add_ps(_mm512_add_ps(row(l, d), row(32 + l, d)), _mm512_add_ps(row(16 + l, d), row(48 + l, d))));
        for width in [8, 4] {
            for l in 0..width {
                v[l] = _mm512_add_ps(v[l], v[l + width]);
            }
        }
        _mm512_storeu_ps(out.as_mut_ptr().add(d), _mm512_add_ps(_mm512_add_ps(v[0], v[2]), _mm512_add_ps(v[1], v[3])));
    }
}

/// `accumulate_lanes` for values `16k..16k+16` of every row only.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
unsafe fn accumulate_lanes_slice(rows: &mut [f32], hd: usize, k: usize, first_cell: usize, w: &[f32], values: &[half::f16], offsets: &[usize]) -> u64 {
    let mut touched = 0u64;
    for lane in 0..64usize {
        let first = (lane + 64 - first_cell % 64) % 64;
        if first >= w.len() {
            continue;
        }
        let mut acc = _mm512_setzero_ps();
        let mut i = first;
        while i < w.len() {
            let pv = values.as_ptr().add(offsets[i] + 16 * k) as *const __m256i;
            acc = _mm512_fmadd_ps(_mm512_set1_ps(w[i]), _mm512_cvtph_ps(_mm256_loadu_si256(pv)), acc);
            i += 64;
        }
        _mm512_storeu_ps(rows.as_mut_ptr().add(lane * hd + 16 * k), acc);
        touched |= 1 << lane;
    }
    touched
}

/// `dot_f16_f32` for 16 keys at once (`keys[offsets[c]..][..hd]`, `hd` a multiple of 64): each key's four
/// 16-lane accumulators and their pairwise sum are as in the one-key routine; the 16 final
/// `_mm512_reduce_add_ps` trees run together through a transpose network that adds exactly the same pairs
/// (halves, quarters, {2,3,0,1}, lanes 0+1), instead of ~9 shuffles and adds per key.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
pub unsafe fn dot_f16_f32_x16(keys: &[half::f16], offsets: &[usize], q: &[f32], out: &mut [f32]) {
    let hd = q.len();
    debug_assert!(hd % 64 == 0 && offsets.len() >= 16 && out.len() >= 16);
    let mut v = [_mm512_setzero_ps(); 16];
    for (c, vc) in v.iter_mut().enumerate() {
        let pk = keys.as_ptr().add(offsets[c]) as *const __m256i;
        let mut acc = [_mm512_setzero_ps(); 4];
        for step in (0..hd / 16).step_by(4) {
            for (j, a) in acc.iter_mut().enumerate() {
                let ax = _mm512_cvtph_ps(_mm256_loadu_si256(pk.add(step + j)));
                *a = _mm512_fmadd_ps(ax, _mm512_loadu_ps(q.as_ptr().add(16 * (step + j))), *a);
            }
        }
        *vc = _mm512_add_ps(_mm512_add_ps(acc[0], acc[2]), _mm512_add_ps(acc[1], acc[3]));
    }
    _mm512_storeu_ps(out.as_mut_ptr(), reduce_16_rows(&v));
}

/// `_mm512_reduce_add_ps` of each of 16 vectors (after the `(a0 + a2) + (a1 + a3)` step), all at once:
/// lane `c` of the result is `v[c]`'s sum. A transpose network that adds exactly the pairs of the
/// one-vector tree (halves, quarters, {2,3,0,1}, lanes 0+1), instead of ~9 shuffles and adds per vector.
#[inline]
#[target_feature(enable = "avx512f,avx512dq,fma,f16c")]
pub(crate) unsafe fn reduce_16_rows(v: &[__m512; 16]) -> __m512 {
    let x: [__m512; 8] = std::array::from_fn(|k| reduce_pair_16(v[2 * k], v[2 * k + 1]));
    let y: [__m512; 4] = std::array::from_fn(|m| reduce_pair_8(x[2 * m], x[2 * m + 1]));
    let z: [__m512; 2] = std::array::from_fn(|p| reduce_pair_4(y[2 * p], y[2 * p + 1]));
    reduce_finish(z[0], z[1])
}

// The levels of `reduce_16_rows`, each combining two neighbours of the level below, so a caller can
// run the tree as its keys arrive (`attention::tiled`'s few-row scores).

/// 16 lanes -> 8: `[lo(a) + hi(a) | lo(b) + hi(b)]` for keys a = 2k, b = 2k + 1.
#[inline(always)]
pub(crate) unsafe fn reduce_pair_16(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_f32x4::<0b01_00_01_00>(a, b), _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b))
}

/// 8 -> 4: quarter c of the result = key 4m + c's `t[0..4] + t[4..8]`.
#[inline(always)]
pub(crate) unsafe fn reduce_pair_8(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_f32x4::<0b10_00_10_00>(a, b), _mm512_shuffle_f32x4::<0b11_01_11_01>(a, b))
}

/// 4 -> 2 ({2,3,0,1}): quarter q = keys 8p + q and 8p + 4 + q: `(u0 + u2, u1 + u3)`.
#[inline(always)]
pub(crate) unsafe fn reduce_pair_4(a: __m512, b: __m512) -> __m512 {
    _mm512_add_ps(_mm512_shuffle_ps::<0x44>(a, b), _mm512_shuffle_ps::<0xEE>(a, b))
}

/// 2 -> 1 (lanes 0 + 1), then keys back in order (lane 4q + k held key 4k + q).
#[inline(always)]
pub(crate) unsafe fn reduce_finish(z0: __m512, z1: __m512) -> __m512 {
    let r = _mm512_add_ps(_mm512_shuffle_ps::<0x88>(z0, z1), _mm512_shuffle_ps::<0xDD>(z0, z1));
    let idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    _mm512_permutexvar_ps(idx, r)
}

//! Scalar re-implementations of the vectorised approximations ggml's CPU backend uses, lane for lane, so
//! that reckon's activations round exactly as llama.cpp's (the models amplify last-bit differences into
//! flipped greedy tokens). Each function documents the ggml routine it reproduces. On AVX-512 CPUs the
//! `avx512` module runs the same instructions as ggml's AVX-512 build; elsewhere the scalar emulation here
//! gives the same bits, slower.

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx512;

/// Whether the AVX-512 versions run here (callers may compile their loops for the same features so the
/// routines inline). A SIMD cap of avx2 (`cpu::set_simd_cap`) turns them off as it does the AVX-512 quant kernels, so the AVX2
/// paths of AVX2-only CPUs can be run and tested on an AVX-512 machine.
#[cfg(target_arch = "x86_64")]
pub fn avx512_available() -> bool {
    use_avx512()
}

#[cfg(target_arch = "x86_64")]
fn use_avx512() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| avx512::available() && crate::kernels::cpu::simd_cap() >= crate::kernels::cpu::SimdLevel::Avx512)
}

/// Whether the AVX2 versions run here (x86 CPUs without AVX-512, e.g. AMD Zen 2/3): same bits as the
/// AVX-512 ones.
#[cfg(target_arch = "x86_64")]
pub fn avx2_available() -> bool {
    use_avx2()
}

#[cfg(target_arch = "x86_64")]
fn use_avx2() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| avx2::available() && crate::kernels::cpu::allows(crate::kernels::cpu::SimdLevel::Avx2))
}

/// ggml_v_expf (vec.h, AVX-512/AVX2 variant, after ARM's optimized-routines expf): a degree-5
/// polynomial on the reduced argument and a scale by 2^n. Max error ~1.5 ulp vs the true exp.
#[inline(always)]
fn v_expf(x: f32) -> f32 {
    let c = |bits: u32| f32::from_bits(bits);
    let r = c(0x4b40_0000); // 0x1.8p23: adding it rounds to an integer
    let z = x.mul_add(c(0x3fb8_aa3b), r); // x·log2(e) + r
    let n = z - r;
    let b = (-n).mul_add(c(0x35bf_be8e), (-n).mul_add(c(0x3f31_7200), x)); // x - n·ln2 (hi, lo)
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    let u = b * b;
    let j = c(0x3c07_2010).mul_add(b, c(0x3d2b_9f17)).mul_add(
        u,
        c(0x3e2a_af33).mul_add(b, c(0x3eff_fedb)),
    );
    let j = j.mul_add(u, c(0x3f7f_fff6).mul_add(b, 1.0));
    // _mm512_scalef_ps(j, n) = j·2^n with one rounding: exact in f64 (|n| <= 192), then rounded once.
    (j as f64 * f64::from_bits(((n as i64 + 1023) as u64) << 52)) as f32
}

/// ggml_vec_swiglu_f32: y = silu(x)·g, 16 lanes at a time with ggml_v_silu (x / (1 + v_expf(-x))), the
/// tail with libm's expf.
pub fn swiglu(x: &mut [f32], g: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if use_avx512() {
        // SAFETY: the CPU has the features avx512::available checks.
        let done = unsafe { avx512::swiglu(x, g) };
        return swiglu_tail(&mut x[done..], &g[done..]);
    }
    #[cfg(target_arch = "x86_64")]
    if use_avx2() {
        // SAFETY: the CPU has the features avx2::available checks.
        let done = unsafe { avx2::swiglu(x, g) };
        return swiglu_tail(&mut x[done..], &g[done..]);
    }
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::allows(crate::kernels::cpu::SimdLevel::Avx2) {
        // SAFETY: the CPU has FMA (the Avx2 level needs it), checked just above.
        return unsafe { swiglu_fma(x, g) };
    }
    swiglu_generic(x, g)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn swiglu_fma(x: &mut [f32], g: &[f32]) {
    swiglu_generic(x, g)
}

/// The elements past the last whole 16-lane vector, with libm's expf as ggml.
fn swiglu_tail(x: &mut [f32], g: &[f32]) {
    for (v, &gv) in x.iter_mut().zip(g) {
        *v = *v / (1.0 + (-*v).exp()) * gv;
    }
}

#[inline(always)]
fn swiglu_generic(x: &mut [f32], g: &[f32]) {
    let simd_len = x.len() / 16 * 16;
    for (v, &gv) in x[..simd_len].iter_mut().zip(g) {
        *v = *v / (1.0 + v_expf(0.0 - *v)) * gv;
    }
    for (v, &gv) in x[simd_len..].iter_mut().zip(&g[simd_len..]) {
        *v = *v / (1.0 + (-*v).exp()) * gv;
    }
}

/// ggml_soft_max (ops.cpp + ggml_vec_soft_max_f32) over one query's scores, in place.
///
/// `scores[i]` belongs to KV cell `first_cell + i`; ggml runs over all cells of the cache view with masked
/// ones at -inf (exp = 0), 16 cells a vector: each vector's exps are summed in `_mm512_reduce_add_ps`'s
/// tree order, the vector sums in f64. Cell alignment matters, hence `first_cell`.
pub fn soft_max(scores: &mut [f32], first_cell: usize) {
    #[cfg(target_arch = "x86_64")]
    if use_avx512() {
        // SAFETY: the CPU has the features avx512::available checks.
        return unsafe { avx512::soft_max(scores, first_cell) };
    }
    #[cfg(target_arch = "x86_64")]
    if use_avx2() {
        // SAFETY: the CPU has the features avx2::available checks.
        return unsafe { avx2::soft_max(scores, first_cell) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::allows(crate::kernels::cpu::SimdLevel::Avx2) {
        // SAFETY: the CPU has FMA (the Avx2 level needs it), checked just above.
        return unsafe { soft_max_fma(scores, first_cell) };
    }
    soft_max_generic(scores, first_cell)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn soft_max_fma(scores: &mut [f32], first_cell: usize) {
    soft_max_generic(scores, first_cell)
}

#[inline(always)]
fn soft_max_generic(scores: &mut [f32], first_cell: usize) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    let mut lanes = [0.0f32; 16];
    let mut cell = first_cell / 16 * 16;
    let end = first_cell + scores.len();
    while cell < end {
        for (l, lane) in lanes.iter_mut().enumerate() {
            let c = cell + l;
            *lane = if c >= first_cell && c < end {
                let e = v_expf(scores[c - first_cell] - max);
                scores[c - first_cell] = e;
                e
            } else {
                0.0
            };
        }
        sum += reduce_add_16(&lanes) as f64;
        cell += 16;
    }
    let inv = (1.0 / sum) as f32;
    scores.iter_mut().for_each(|v| *v *= inv);
}

/// ggml_soft_max over one whole row (ggml_vec_soft_max_f32 as built for AVX-512), in place: each whole
/// 16-lane vector's exps (ggml_v_expf) summed in `_mm512_reduce_add_ps`'s order, the tail past the last
/// whole vector with libm's expf, every partial sum added in f64, then scaled by 1/sum. A MoE router's
/// probabilities (qwen3moe: 128 experts a row; the synthetic files' 8 are all tail).
pub fn soft_max_row(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    let whole = x.len() / 16 * 16;
    for chunk in x[..whole].chunks_exact_mut(16) {
        let mut lanes = [0.0f32; 16];
        for (lane, v) in lanes.iter_mut().zip(chunk.iter_mut()) {
            *v = v_expf(*v - max);
            *lane = *v;
        }
        sum += reduce_add_16(&lanes) as f64;
    }
    for v in &mut x[whole..] {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// ggml_vec_dot_f16 (vec.cpp, AVX-512): products accumulated with FMA into 4 vectors of 16 lanes, 64
/// elements a step, the 4 vectors added pairwise (0+2, 1+3, then 0+1), reduced with
/// `_mm512_reduce_add_ps`, and any tail past a multiple of 64 added in f64.
/// Scores of 16 keys `keys[offsets[c]..][..y.len()]` against `y` (with `y32` its f32 conversion), each
/// exactly `dot_f16_f32`; returns false (and does nothing) where no batched routine applies.
#[inline(always)]
pub fn dot_f16_f32_x16(keys: &[half::f16], offsets: &[usize], y32: &[f32], out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if use_avx512() && y32.len() % 64 == 0 && offsets.len() >= 16 && out.len() >= 16 {
        assert!(offsets[..16].iter().all(|&o| o + y32.len() <= keys.len()), "key row out of range");
        // SAFETY: the CPU has the features avx512::available checks; every key row is in range (above).
        unsafe { avx512::dot_f16_f32_x16(keys, offsets, y32, out) };
        return true;
    }
    #[cfg(target_arch = "x86_64")]
    if use_avx2() && y32.len() % 64 == 0 && offsets.len() >= 16 && out.len() >= 16 {
        assert!(offsets[..16].iter().all(|&o| o + y32.len() <= keys.len()), "key row out of range");
        // SAFETY: the CPU has the features avx2::available checks; every key row is in range (above).
        unsafe { avx2::dot_f16_f32_x16(keys, offsets, y32, out) };
        return true;
    }
    let _ = (keys, offsets, y32, out);
    false
}

/// `dot_f16(x, y)` where `y32` holds `y` converted to f32 (the query, converted once for all keys).
#[inline(always)]
pub fn dot_f16_f32(x: &[half::f16], y: &[half::f16], y32: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if use_avx512() {
        // SAFETY: the CPU has the features avx512::available checks.
        return unsafe { avx512::dot_f16_f32(x, y32) };
    }
    #[cfg(target_arch = "x86_64")]
    if use_avx2() {
        // SAFETY: the CPU has the features avx2::available checks.
        return unsafe { avx2::dot_f16_f32(x, y32) };
    }
    let _ = y32;
    dot_f16(x, y)
}

#[inline(always)]
pub fn dot_f16(x: &[half::f16], y: &[half::f16]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if use_avx512() {
        // SAFETY: the CPU has the features avx512::available checks.
        return unsafe { avx512::dot_f16(x, y) };
    }
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::cpu::allows(crate::kernels::cpu::SimdLevel::Avx2) {
        // SAFETY: the CPU has FMA and F16C (the Avx2 level needs them), checked just above.
        return unsafe { dot_f16_fma(x, y) };
    }
    dot_f16_generic(x, y)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma,f16c")]
unsafe fn dot_f16_fma(x: &[half::f16], y: &[half::f16]) -> f32 {
    dot_f16_generic(x, y)
}

#[inline(always)]
fn dot_f16_generic(x: &[half::f16], y: &[half::f16]) -> f32 {
    let mut acc = [[0.0f32; 16]; 4];
    let full = x.len() / 64 * 64;
    for (xs, ys) in x[..full].chunks_exact(64).zip(y.chunks_exact(64)) {
        for (k, (a, b)) in xs.iter().zip(ys).enumerate() {
            let lane = &mut acc[k / 16][k % 16];
            *lane = a.to_f32().mul_add(b.to_f32(), *lane);
        }
    }
    let mut sum = reduce_4x16(&acc) as f64;
    for (a, b) in x[full..].iter().zip(&y[full..]) {
        sum += (a.to_f32() * b.to_f32()) as f64;
    }
    sum as f32
}

/// The weighted sum over values `out[d] = Σ_cells f16(prob)·V_cell[d]` as ggml computes it: one
/// ggml_vec_dot_f16 per output dimension `d` over the KV cells, so cell `c` lands in accumulator lane
/// `c % 64` (vector `(c % 64) / 16`, lane `c % 16`) and the lanes are reduced in ggml's order at the end.
///
/// Stored lane-major, `rows: [64, hd]`, so that adding one cell is a contiguous fused multiply-add over
/// the head dimension. Lanes no cell touched hold zero, as ggml's masked cells contribute `0·V = 0`.
#[derive(Default)]
pub struct LaneAcc {
    hd: usize,
    rows: Vec<f32>,
    /// Bit `lane` is set once that lane's row has been zeroed for this sum.
    touched: u64,
}

impl LaneAcc {
    /// Starts a new sum over vectors of `hd` elements.
    pub fn reset(&mut self, hd: usize) {
        self.hd = hd;
        self.rows.resize(64 * hd, 0.0);
        self.touched = 0;
    }

    /// Adds `w·v` (v in f16) into the lane of KV cell `cell`.
    #[inline(always)]
    pub fn add(&mut self, cell: usize, w: f32, v: &[half::f16]) {
        let lane = cell % 64;
        let row = &mut self.rows[lane * self.hd..(lane + 1) * self.hd];
        if self.touched & (1 << lane) == 0 {
            row.fill(0.0);
            self.touched |= 1 << lane;
        }
        #[cfg(target_arch = "x86_64")]
        if use_avx512() && self.hd % 16 == 0 {
            // SAFETY: the CPU has the features avx512::available checks; lengths are hd, a multiple of 16.
            return unsafe { avx512::fma_row(row, w, v) };
        }
        #[cfg(target_arch = "x86_64")]
        if use_avx2() && self.hd % 16 == 0 {
            // SAFETY: the CPU has the features avx2::available checks; lengths are hd, a multiple of 16.
            return unsafe { avx2::fma_row(row, w, v) };
        }
        for (a, x) in row.iter_mut().zip(v) {
            *a = w.mul_add(x.to_f32(), *a);
        }
    }

    /// Adds cells `first_cell, first_cell + 1, ...` with weights `w[i]` and value rows
    /// `values[offsets[i]..][..hd]`: the same sums as calling `add` for each in order (every lane sees its
    /// cells in the same order), faster on AVX-512 where each lane's sums stay in registers.
    pub fn add_cells(&mut self, first_cell: usize, w: &[f32], values: &[half::f16], offsets: &[usize]) {
        #[cfg(target_arch = "x86_64")]
        if use_avx512() && self.hd % 16 == 0 && self.hd <= 256 && self.touched == 0 {
            // SAFETY: the CPU has the features avx512::available checks; hd and rows were checked above
            // (`reset` sized rows to 64·hd), every offset is a row of `values` (indexing checked below).
            assert!(offsets.iter().all(|&o| o + self.hd <= values.len()) && offsets.len() >= w.len());
            self.touched = unsafe { avx512::accumulate_lanes(&mut self.rows, self.hd, first_cell, w, values, offsets) };
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if use_avx2() && self.hd % 64 == 0 && self.touched == 0 {
            // SAFETY: as above, for the features avx2::available checks (`reset` sized rows to 64·hd).
            assert!(offsets.iter().all(|&o| o + self.hd <= values.len()) && offsets.len() >= w.len());
            self.touched = unsafe { avx2::accumulate_lanes(&mut self.rows, self.hd, first_cell, w, values, offsets) };
            return;
        }
        for (i, (&wi, &o)) in w.iter().zip(offsets).enumerate() {
            self.add(first_cell + i, wi, &values[o..o + self.hd]);
        }
    }

    /// Reduces the 64 lanes of every dimension in ggml's order (GGML_F32x16_REDUCE): vectors 0+2 and 1+3,
    /// then their sum, then the 16 lanes as `_mm512_reduce_add_ps`.
    pub fn reduce(&mut self, out: &mut [f32]) {
        let hd = self.hd;
        for lane in 0..64 {
            if self.touched & (1 << lane) == 0 {
                self.rows[lane * hd..(lane + 1) * hd].fill(0.0);
            }
        }
        reduce_lane_rows(&mut self.rows, hd, out);
    }
}

/// `LaneAcc::reduce` of lane sums held elsewhere: `rows` is `[64, hd]` (overwritten), `out` gets `hd`.
pub fn reduce_lane_rows(rows: &mut [f32], hd: usize, out: &mut [f32]) {
    assert!(rows.len() >= 64 * hd && out.len() >= hd, "lane rows are not [64, hd]");
    #[cfg(target_arch = "x86_64")]
    if use_avx512() && hd % 16 == 0 {
        // SAFETY: the CPU has the features avx512::available checks; the lengths were asserted above.
        return unsafe { avx512::reduce_lane_rows(rows, hd, out) };
    }
    #[cfg(target_arch = "x86_64")]
    if use_avx2() && hd % 8 == 0 {
        // SAFETY: the CPU has the features avx2::available checks; the lengths were asserted above.
        return unsafe { avx2::reduce_lane_rows(rows, hd, out) };
    }
    let r = |lane: usize| lane * hd;
    // v[l] = (vec0 + vec2)[l] + (vec1 + vec3)[l], written over lane l's row of vector 0.
    for l in 0..16 {
        for d in 0..hd {
            let v02 = rows[r(l) + d] + rows[r(32 + l) + d];
            let v13 = rows[r(16 + l) + d] + rows[r(48 + l) + d];
            rows[r(l) + d] = v02 + v13;
        }
    }
    // 16 -> 8 -> 4 lanes, then (0+2) + (1+3).
    for width in [8, 4] {
        for l in 0..width {
            for d in 0..hd {
                rows[r(l) + d] += rows[r(l + width) + d];
            }
        }
    }
    for (d, o) in out.iter_mut().enumerate().take(hd) {
        let c0 = rows[r(0) + d] + rows[r(2) + d];
        let c1 = rows[r(1) + d] + rows[r(3) + d];
        *o = c0 + c1;
    }
}

/// Rounds every value to the nearest f16 and back (ties to even, as `half::f16::from_f32`): the f16
/// queries and probabilities of ggml's attention, kept in f32.
#[inline(always)]
pub fn round_through_f16(x: &mut [f32]) {
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if use_avx2() {
        // SAFETY: the CPU has the features avx2::available checks.
        done = unsafe { avx2::round_through_f16(x) };
    }
    for v in &mut x[done..] {
        *v = half::f16::from_f32(*v).to_f32();
    }
}

/// GGML_F32x16_REDUCE over 4 accumulators: 0+=2, 1+=3, 0+=1, then the 16-lane reduce.
#[inline(always)]
pub(crate) fn reduce_4x16(acc: &[[f32; 16]; 4]) -> f32 {
    let v02: [f32; 16] = std::array::from_fn(|l| acc[0][l] + acc[2][l]);
    let v13: [f32; 16] = std::array::from_fn(|l| acc[1][l] + acc[3][l]);
    let v: [f32; 16] = std::array::from_fn(|l| v02[l] + v13[l]);
    reduce_add_16(&v)
}

/// GCC's `_mm512_reduce_add_ps`: halves added pairwise, 16 → 8 → 4 → 2 → 1.
#[inline(always)]
pub(crate) fn reduce_add_16(l: &[f32; 16]) -> f32 {
    let a: [f32; 8] = std::array::from_fn(|i| l[i] + l[i + 8]);
    let b: [f32; 4] = std::array::from_fn(|i| a[i] + a[i + 4]);
    let (c0, c1) = (b[0] + b[2], b[1] + b[3]);
    c0 + c1
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v_expf_is_close_to_exp() {
        // The normal range of f32 results; below ~-87 the result is subnormal and the relative error grows.
        for i in -1600..1600 {
            let x = i as f32 * 0.05;
            let (got, want) = (v_expf(x), (x as f64).exp());
            assert!(((got as f64 - want) / want).abs() < 4e-7, "x={x}: {got} vs {want}");
        }
        assert_eq!(v_expf(-200.0), 0.0);
        assert_eq!(v_expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(v_expf(200.0), f32::INFINITY);
    }

    #[test]
    fn soft_max_sums_to_one_at_any_alignment() {
        for first in [0, 3, 16, 29] {
            let mut s: Vec<f32> = (0..40).map(|i| (i as f32 * 0.37).sin() * 4.0).collect();
            soft_max(&mut s, first);
            let total: f32 = s.iter().sum();
            assert!((total - 1.0).abs() < 1e-5, "{total}");
            assert!(s.iter().all(|&p| p > 0.0));
        }
    }

    #[test]
    fn dot_f16_matches_f64() {
        use half::f16;
        for n in [64usize, 100, 256] {
            let x: Vec<f16> = (0..n).map(|i| f16::from_f32((i as f32 * 0.71).sin())).collect();
            let y: Vec<f16> = (0..n).map(|i| f16::from_f32((i as f32 * 0.13).cos())).collect();
            let want: f64 = x.iter().zip(&y).map(|(a, b)| a.to_f64() * b.to_f64()).sum();
            assert!((dot_f16(&x, &y) as f64 - want).abs() < 1e-4, "n={n}");
        }
    }

    #[test]
    fn swiglu_matches_silu() {
        let mut x: Vec<f32> = (0..37).map(|i| i as f32 * 0.3 - 5.0).collect();
        let g = vec![2.0; 37];
        let want: Vec<f32> = x.iter().map(|&v| v / (1.0 + (-v).exp()) * 2.0).collect();
        swiglu(&mut x, &g);
        for (a, b) in x.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
        }
    }

    /// The AVX-512 routines must give the scalar emulation's bits exactly (both reproduce ggml).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_equals_scalar_emulation() {
        use half::f16;
        if !avx512::available() {
            eprintln!("note: no AVX-512 here; nothing to compare");
            return;
        }
        let vals = |n: usize, seed: f32| -> Vec<f32> { (0..n).map(|i| ((i as f32 + seed) * 0.7373).sin() * 9.0 - 1.0).collect() };
        for n in [1usize, 15, 16, 17, 64, 100, 263, 600] {
            let g = vals(n, 3.0);
            let (mut a, mut b) = (vals(n, 0.0), vals(n, 0.0));
            // SAFETY: available() was checked above.
            let done = unsafe { avx512::swiglu(&mut a, &g) };
            swiglu_generic(&mut b, &g);
            assert_eq!(a[..done].iter().map(|x| x.to_bits()).collect::<Vec<_>>(), b[..done].iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "swiglu n={n}");
            for first in [0usize, 1, 7, 15, 16, 33] {
                let (mut a, mut b) = (vals(n, 1.0), vals(n, 1.0));
                unsafe { avx512::soft_max(&mut a, first) };
                soft_max_generic(&mut b, first);
                assert_eq!(a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), b.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "soft_max n={n} first={first}");
            }
            let x: Vec<f16> = vals(n, 2.0).iter().map(|&v| f16::from_f32(v)).collect();
            let y: Vec<f16> = vals(n, 5.0).iter().map(|&v| f16::from_f32(v * 0.1)).collect();
            assert_eq!(unsafe { avx512::dot_f16(&x, &y) }.to_bits(), dot_f16_generic(&x, &y).to_bits(), "dot_f16 n={n}");
        }
    }

    /// The AVX2 routines must give the scalar emulation's bits exactly (AVX-512 numerics on 8-lane registers).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_equals_scalar_emulation() {
        use half::f16;
        if !avx2::available() {
            eprintln!("note: no AVX2 here; nothing to compare");
            return;
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let vals = |n: usize, seed: f32, amp: f32| -> Vec<f32> { (0..n).map(|i| ((i as f32 + seed) * 0.7373).sin() * amp - 1.0).collect() };
        // amplitude 120 drives v_expf into the subnormal, overflow and cut-off ranges (scalef's slow path)
        for amp in [9.0f32, 120.0] {
            for n in [1usize, 15, 16, 17, 64, 100, 263, 600] {
                let g = vals(n, 3.0, amp);
                let (mut a, mut b) = (vals(n, 0.0, amp), vals(n, 0.0, amp));
                // SAFETY: available() was checked above.
                let done = unsafe { avx2::swiglu(&mut a, &g) };
                swiglu_generic(&mut b, &g);
                assert_eq!(bits(&a[..done]), bits(&b[..done]), "swiglu n={n} amp={amp}");
                for first in [0usize, 1, 7, 15, 16, 33] {
                    let (mut a, mut b) = (vals(n, 1.0, amp), vals(n, 1.0, amp));
                    unsafe { avx2::soft_max(&mut a, first) };
                    soft_max_generic(&mut b, first);
                    assert_eq!(bits(&a), bits(&b), "soft_max n={n} first={first} amp={amp}");
                }
                let x: Vec<f16> = vals(n, 2.0, amp).iter().map(|&v| f16::from_f32(v)).collect();
                let y: Vec<f32> = vals(n, 5.0, amp).iter().map(|&v| f16::from_f32(v * 0.1).to_f32()).collect();
                let y16: Vec<f16> = y.iter().map(|&v| f16::from_f32(v)).collect();
                assert_eq!(unsafe { avx2::dot_f16_f32(&x, &y) }.to_bits(), dot_f16_generic(&x, &y16).to_bits(), "dot_f16 n={n}");
                let mut r = vals(n, 4.0, amp * 1000.0);
                let want: Vec<f32> = r.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
                round_through_f16(&mut r);
                assert_eq!(bits(&r), bits(&want), "round_through_f16 n={n}");
            }
        }
        for hd in [64usize, 256] {
            let rows: Vec<f32> = vals(64 * hd, 0.5, 3.0);
            let (mut want, mut got) = (vec![0.0; hd], vec![0.0; hd]);
            let mut scratch = rows.clone();
            let mut lanes = [[0.0f32; 16]; 4];
            for d in 0..hd {
                for (l, lane) in lanes.iter_mut().flatten().enumerate() {
                    *lane = scratch[l * hd + d];
                }
                want[d] = reduce_4x16(&lanes);
            }
            unsafe { avx2::reduce_lane_rows(&rows, hd, &mut got) };
            scratch.copy_from_slice(&rows);
            assert_eq!(bits(&got), bits(&want), "reduce_lane_rows hd={hd}");
        }
    }

    /// The batched value sums and the pre-converted-query dot give exactly the per-cell bits.
    #[test]
    fn lane_acc_add_cells_equals_add_and_dot_f16_f32_equals_dot_f16() {
        use half::f16;
        for (hd, n, first) in [(64usize, 5usize, 0usize), (64, 200, 37), (256, 130, 64), (48, 70, 3)] {
            let values: Vec<f16> = (0..n * hd + 7).map(|i| f16::from_f32(((i as f32) * 0.37).sin())).collect();
            let offsets: Vec<usize> = (0..n).map(|i| ((i * 13) % n) * hd).collect();
            let w: Vec<f32> = (0..n).map(|i| f16::from_f32(((i as f32) * 0.11).cos().abs() / n as f32).to_f32()).collect();
            let (mut a, mut b) = (LaneAcc::default(), LaneAcc::default());
            a.reset(hd);
            b.reset(hd);
            a.add_cells(first, &w, &values, &offsets);
            for i in 0..n {
                b.add(first + i, w[i], &values[offsets[i]..offsets[i] + hd]);
            }
            let (mut oa, mut ob) = (vec![0.0; hd], vec![0.0; hd]);
            a.reduce(&mut oa);
            b.reduce(&mut ob);
            assert_eq!(oa.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), ob.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), "hd={hd} n={n}");
            let q: Vec<f16> = (0..hd).map(|i| f16::from_f32((i as f32 * 0.7).cos())).collect();
            let q32: Vec<f32> = q.iter().map(|x| x.to_f32()).collect();
            let k = &values[offsets[1]..offsets[1] + hd];
            assert_eq!(dot_f16_f32(k, &q, &q32).to_bits(), dot_f16(k, &q).to_bits(), "hd={hd}");
        }
    }

    /// The 16-key batched dot gives each key's one-at-a-time bits.
    #[test]
    fn dot_f16_x16_equals_dot_f16() {
        use half::f16;
        for hd in [64usize, 128, 256] {
            let keys: Vec<f16> = (0..40 * hd).map(|i| f16::from_f32(((i as f32) * 0.913).sin() * 3.0)).collect();
            let q: Vec<f16> = (0..hd).map(|i| f16::from_f32(((i as f32) * 0.29).cos())).collect();
            let q32: Vec<f32> = q.iter().map(|x| x.to_f32()).collect();
            let offsets: Vec<usize> = (0..16).map(|c| ((c * 7 + 3) % 40) * hd).collect();
            let mut out = [0.0f32; 16];
            if !dot_f16_f32_x16(&keys, &offsets, &q32, &mut out) {
                eprintln!("note: no batched dot on this CPU");
                return;
            }
            for (c, &o) in offsets.iter().enumerate() {
                assert_eq!(out[c].to_bits(), dot_f16(&keys[o..o + hd], &q).to_bits(), "hd={hd} key {c}");
            }
        }
    }
}

//! Packed weights and their integer kernels: reckon's own matmul numerics.
//!
//! ggml's `vec_dot` numerics (the `quant` kernels beside this module) fix, for every (row, token), an
//! 8-lane f32 accumulator fed block after block: per 32 weights an int→f32 conversion, a scale multiply
//! and an FMA on 8 lanes. Those f32 operations are three quarters of the work of a batched matmul, and no
//! kernel that keeps ggml's bits can avoid them (docs/speed.md). This module defines numerics that
//! can, and are just as deterministic:
//!
//! - every block's integer dot `S = Σ q·y − o·Σy` is exact (q the weight's unsigned code, o its offset:
//!   8 for Q4_0, 16 for Q5_0, 128 for Q8_0; K-quants apply their sub-block scales in integers too);
//! - a (row, token) result is one f32 chain over the blocks in order: `acc = fma(d_w·d_y, S, acc)` (plus
//!   `fma(m_w, s_y, acc)` for Q4_1, `fma(−dmin_w·d_y, M, acc)` for Q4_K), from 0.
//!
//! Integer sums can be formed in any order, so the kernels are free to tile: 16 weight rows × several
//! tokens per call, `vpdpbusd` with the token's 4 activation bytes broadcast, one f32 FMA per 16 (row,
//! token) pairs per block. Each (row, token) still sees the same operations in the same order whatever the
//! batch, the tile, the thread count or the CPU (`reference::dot` is the definition, in plain Rust; the
//! SIMD kernels are tested bit-equal to it), so outputs stay batch-invariant. They are not bit-identical
//! to llama.cpp's logits (a different f32 summation), only as close as two correct f32 orders are;
//! `Numerics::Ggml` keeps the ggml kernels for that.
//!
//! Kernels: AVX-512 VNNI (`avx512`), AVX-VNNI (`avxvnni`: `vpdpbusd` on 256-bit registers) and AVX2
//! (`avx2`, the same integers from `vpmaddubsw`/`vpmaddwd`).
//!
//! Weights are repacked once at load (`pack`): groups of 16 rows, each block of the group stored as
//! contiguous 64-byte vectors of `[16 rows × 4 codes]`, the layout `vpdpbusd` consumes, with the same
//! bytes per row as the GGUF file (Q4_K: 148 instead of 144). A group's blocks follow one another, so
//! decode reads each weight matrix as one sequential stream.

mod layout;
pub mod reference;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod avxvnni;
#[cfg(target_arch = "x86_64")]
mod tile;
pub mod acts;
#[cfg(test)]
mod tests;

pub use acts::{ActSide, KSide};
pub use layout::{pack, pack_into, pack_releasing, PackedMatrix, PackedShape, GROUP};

use crate::kernels::ggml::GgmlType;

/// Which arithmetic the matmuls use; fixed per loaded model, so a process is self-consistent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Numerics {
    /// Packed weights and integer kernels (this module): fast, batch-invariant, the same bits on every
    /// CPU that has the kernels.
    Packed,
    /// ggml's `vec_dot` numerics: logits bit-identical to llama.cpp's per-row CPU path.
    Ggml,
}

impl Numerics {
    /// Packed where this CPU has the packed kernels (AVX-512 VNNI or AVX2), else ggml.
    pub fn default_for_cpu() -> Numerics {
        if kernels_available() {
            Numerics::Packed
        } else {
            Numerics::Ggml
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Numerics::Packed => "packed",
            Numerics::Ggml => "ggml",
        }
    }
}

/// Whether the packed kernels run on this CPU (AVX-512 VNNI, or AVX2 with FMA and F16C; capped by
/// `cpu::set_simd_cap` like the others).
pub fn kernels_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::kernels::ggml::simd_level() >= crate::kernels::ggml::SimdLevel::Avx2
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Whether weights of type `t` can be packed (the others keep the ggml kernels in either numerics).
pub fn packable(t: GgmlType) -> bool {
    matches!(t, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::Q4_K | GgmlType::Q6_K)
}

/// Most tokens one kernel call handles for weights of type `t` (its accumulators live in registers).
pub fn tile_tokens(t: GgmlType) -> usize {
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::ggml::simd_level() < crate::kernels::ggml::SimdLevel::Avx512 {
        return avx2::tile_tokens(t);
    }
    match t {
        GgmlType::Q4_K | GgmlType::Q6_K => 4,
        _ => 8,
    }
}

/// The activations of one matmul as the packed kernels read them: the ggml-quantized rows (`xq`, the
/// weight type's `dot_activation_type`, one row per token) and the per-block side table `side`.
pub struct PackedInput<'a> {
    pub xq: &'a [u8],
    pub row_bytes: usize,
    pub side: &'a ActSide,
}

/// `out[(t0 + i) * out_stride + r]` for the rows of group `group` (those below `m.rows`) and tokens
/// `t0..t0 + nt` (`nt <= tile_tokens(m.dtype)`).
///
/// # Safety
/// `kernels_available()`; `out` must be valid for those writes and no other thread may write them
/// (`out` itself may point before the buffer, where token 0's row would be).
pub unsafe fn tile(m: &PackedMatrix, group: usize, x: &PackedInput, t0: usize, nt: usize, out: *mut f32, out_stride: usize) {
    debug_assert!(nt >= 1 && nt <= tile_tokens(m.dtype));
    #[cfg(target_arch = "x86_64")]
    match crate::kernels::ggml::simd_level() {
        crate::kernels::ggml::SimdLevel::Avx512 => avx512::tile(m, group, x, t0, nt, out, out_stride),
        crate::kernels::ggml::SimdLevel::AvxVnni => avxvnni::tile(m, group, x, t0, nt, out, out_stride),
        _ => avx2::tile(m, group, x, t0, nt, out, out_stride),
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (m, group, x, t0, nt, out, out_stride);
        unreachable!("no packed kernels on this architecture");
    }
}

/// `tile` over tokens `t0..t1` (as many as there are) of group `group`, in tiles of `tile_tokens`;
/// where many tokens share a group, the AVX2 and AVX-VNNI kernels unpack its codes once for all of them
/// (`avx2::tiles_unpacked`, `avxvnni::tiles_unpacked`). The same bits either way.
///
/// # Safety
/// As `tile`, for every token of `t0..t1`.
pub unsafe fn tiles(m: &PackedMatrix, group: usize, x: &PackedInput, t0: usize, t1: usize, out: *mut f32, out_stride: usize) {
    #[cfg(target_arch = "x86_64")]
    match crate::kernels::ggml::simd_level() {
        crate::kernels::ggml::SimdLevel::Avx2 if avx2::unpacks(m.dtype, t1 - t0) => return avx2::tiles_unpacked(m, group, x, t0, t1, out, out_stride),
        crate::kernels::ggml::SimdLevel::AvxVnni if avxvnni::unpacks(m.dtype, t1 - t0) => return avxvnni::tiles_unpacked(m, group, x, t0, t1, out, out_stride),
        _ => {}
    }
    let n = tile_tokens(m.dtype);
    let mut t = t0;
    while t < t1 {
        let k = n.min(t1 - t);
        tile(m, group, x, t, k, out, out_stride);
        t += k;
    }
}

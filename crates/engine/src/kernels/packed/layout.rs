//! The packed weight layout and the packer that builds it from GGUF rows.
//!
//! Rows are taken `GROUP` (16) at a time; a matrix is `[group][block]` of *group-blocks*, each holding
//! one block (32 elements; K-quants 256) of the group's 16 rows. In a group-block, a *vector* is 64 bytes
//! `[16 rows × 4 codes]`: byte `4r + j` is row r's code for element `4g + j` of a 4-element k-group g, so
//! one `vpdpbusd` against a token's 4 activation bytes broadcast gives the 16 rows' partial dots. 4-bit
//! codes share a vector: low nibbles one k-group, high nibbles another (the pairs ggml's own bytes
//! pair, so packing is a transpose of 4-byte chunks). Scales are f16 in `[16 rows]` arrays. Rows past
//! `rows` in the last group are zero (zero scales, zero codes) and never stored.
//!
//! Group-block layouts (byte offsets):
//!   Q4_0  qs 4 vectors (k-group v low, v+4 high) @0 | d [16 f16] @256                       288 B
//!   Q4_1  qs @0 | d @256 | m [16 f16] @288                                                  320 B
//!   Q5_0  qs @0 | qh 1 vector @256 (bit g of byte 4r+j = 5th bit of row r, element 4g+j: one shift and
//!         one mask move k-group g's bits under its codes, on AVX2 as on AVX-512) | d @320            352 B
//!   Q8_0  8 vectors of codes `q ^ 0x80` (k-group g) @0 | d @512                             544 B
//!   Q4_K  32 vectors @0 (vector 8c+g: low nibbles sub-block 2c, high 2c+1, k-group g) | d @2048 |
//!         dmin @2080 | scales [8 sub-blocks][16 rows] u8 @2112 | mins [4 pairs][16 rows][2] u8 @2240  2368 B
//!   Q6_K  ql 32 vectors @0 (vector 16h+c: row bytes ql[64h+4c..]) | qh 16 vectors @2048 (vector 8h+c:
//!         row bytes qh[32h+4c..]) | scales [16][16 rows] i8 @3072 | d @3328                  3360 B

use crate::kernels::ggml::{blocks, GgmlType, Line};
use crate::huge_buf::HugeBuf;
use std::sync::Arc;
use super::reference::{legacy_codes, q4_k_codes, q6_k_codes};

/// Weight rows per group.
pub const GROUP: usize = 16;

pub(super) const Q4_0_D: usize = 256;
pub(super) const Q4_1_D: usize = 256;
pub(super) const Q4_1_M: usize = 288;
pub(super) const Q5_0_QH: usize = 256;
pub(super) const Q5_0_D: usize = 320;
pub(super) const Q8_0_D: usize = 512;
pub(super) const Q4_K_D: usize = 2048;
pub(super) const Q4_K_DMIN: usize = 2080;
pub(super) const Q4_K_SC: usize = 2112;
pub(super) const Q4_K_M: usize = 2240;
pub(super) const Q6_K_QH: usize = 2048;
pub(super) const Q6_K_SC: usize = 3072;
pub(super) const Q6_K_D: usize = 3328;

/// Bytes of one group-block of type `t`.
pub fn group_block_bytes(t: GgmlType) -> usize {
    match t {
        GgmlType::Q4_0 => 288,
        GgmlType::Q4_1 => 320,
        GgmlType::Q5_0 => 352,
        GgmlType::Q8_0 => 544,
        GgmlType::Q4_K => 2368,
        GgmlType::Q6_K => 3360,
        other => panic!("{other} cannot be packed"),
    }
}

/// A weight matrix in the packed layout (its `PackedShape`, which it derefs to), its (64-byte aligned)
/// bytes in memory of its own or in a range of an arena shared with the model's other matrices
/// (`pack_into`, `in_arena`).
pub struct PackedMatrix {
    shape: PackedShape,
    data: Store,
}

enum Store {
    Own(Vec<Line>),
    /// Lines `first..` of a shared arena.
    Arena(Arc<HugeBuf<Line>>, usize),
}

/// A packed matrix but for where its bytes are.
#[derive(Clone, Copy, Debug)]
pub struct PackedShape {
    pub dtype: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub groups: usize,
    /// Blocks per row (`cols / dtype.block_len()`).
    pub blocks: usize,
    /// Bytes per group-block.
    pub block_bytes: usize,
}

impl std::ops::Deref for PackedMatrix {
    type Target = PackedShape;
    fn deref(&self) -> &PackedShape {
        &self.shape
    }
}

impl PackedShape {
    pub fn new(t: GgmlType, rows: usize, cols: usize) -> Self {
        PackedShape { dtype: t, rows, cols, groups: rows.div_ceil(GROUP), blocks: cols / t.block_len(), block_bytes: group_block_bytes(t) }
    }

    /// 64-byte lines the packed matrix takes.
    pub fn lines(&self) -> usize {
        (self.groups * self.blocks * self.block_bytes).div_ceil(64)
    }
}

impl PackedMatrix {
    /// The matrix `shape` packed (by `pack_into`) into `arena` from line `first` on.
    pub fn in_arena(shape: PackedShape, arena: Arc<HugeBuf<Line>>, first: usize) -> PackedMatrix {
        assert!(first + shape.lines() <= arena.len(), "packed matrix outside its arena");
        PackedMatrix { shape, data: Store::Arena(arena, first) }
    }

    fn lines(&self) -> &[Line] {
        match &self.data {
            Store::Own(v) => v,
            Store::Arena(a, first) => &a[*first..],
        }
    }

    /// The first byte of group `g`'s first group-block.
    #[inline]
    pub fn group_ptr(&self, g: usize) -> *const u8 {
        debug_assert!(g < self.groups);
        // SAFETY: inside the matrix's lines (groups × blocks × block_bytes bytes).
        unsafe { (self.lines().as_ptr() as *const u8).add(g * self.blocks * self.block_bytes) }
    }

    /// All bytes (for prefetching and size reports).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: `Line` is plain bytes, and the matrix's lines hold this many.
        unsafe { std::slice::from_raw_parts(self.lines().as_ptr() as *const u8, self.groups * self.blocks * self.block_bytes) }
    }
}

/// Packs `rows` GGUF rows of `cols` elements of type `t` (`bytes`, row-major).
pub fn pack(t: GgmlType, rows: usize, cols: usize, bytes: &[u8]) -> PackedMatrix {
    pack_releasing(t, rows, cols, bytes, &|_| {})
}

/// `pack`, calling `done(range)` with each range of `bytes` it has finished reading (a few MiB at a
/// time), so the caller can let the pages of a memory map go while the rest is packed.
pub fn pack_releasing(t: GgmlType, rows: usize, cols: usize, bytes: &[u8], done: &dyn Fn(std::ops::Range<usize>)) -> PackedMatrix {
    let shape = PackedShape::new(t, rows, cols);
    let mut data = vec![Line([0; 64]); shape.lines()];
    pack_into(t, rows, cols, bytes, done, &mut data);
    PackedMatrix { shape, data: Store::Own(data) }
}

/// `pack_releasing` into `out` (`PackedShape::lines` zeroed lines, e.g. a range of an arena).
pub fn pack_into(t: GgmlType, rows: usize, cols: usize, bytes: &[u8], done: &dyn Fn(std::ops::Range<usize>), out: &mut [Line]) -> PackedShape {
    assert!(rows > 0 && cols > 0, "pack {t}: an empty matrix ({rows} x {cols})");
    let row_bytes = t.row_bytes(cols).expect("cols a whole number of blocks");
    assert!(bytes.len() >= rows * row_bytes, "pack {t}: {} bytes for {rows} rows of {row_bytes}", bytes.len());
    let shape = PackedShape::new(t, rows, cols);
    let (groups, blocks, gbb) = (shape.groups, shape.blocks, shape.block_bytes);
    assert_eq!(out.len(), shape.lines(), "pack {t}: output lines");
    let total = groups * blocks * gbb;
    // SAFETY: `Line` is plain bytes; `total` fits in `out`.
    let out = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, total) };
    let zero_block = vec![0u8; t.block_bytes()];
    let groups_per_release = ((4 << 20) / (GROUP * row_bytes)).max(1);
    for (g, group_out) in out.chunks_exact_mut(blocks * gbb).enumerate() {
        if g % groups_per_release == 0 && g > 0 {
            done((g - groups_per_release) * GROUP * row_bytes..g * GROUP * row_bytes);
        }
        for (b, dst) in group_out.chunks_exact_mut(gbb).enumerate() {
            let src: [&[u8]; GROUP] = std::array::from_fn(|r| {
                let row = g * GROUP + r;
                if row < rows {
                    &bytes[row * row_bytes + b * t.block_bytes()..][..t.block_bytes()]
                } else {
                    &zero_block[..]
                }
            });
            pack_group_block(t, &src, dst);
        }
    }
    let last = (groups - 1) / groups_per_release * groups_per_release;
    done(last * GROUP * row_bytes..rows * row_bytes);
    shape
}

/// Row r's 4 codes at `codes[4·kgroup..]` into vector byte 4r.
fn put4(vector: &mut [u8], r: usize, four: [u8; 4]) {
    vector[4 * r..4 * r + 4].copy_from_slice(&four);
}

fn pack_group_block(t: GgmlType, src: &[&[u8]; GROUP], dst: &mut [u8]) {
    let f16_array = |dst: &mut [u8], off: usize| {
        for (r, s) in src.iter().enumerate() {
            dst[2 * r..2 * r + 2].copy_from_slice(&s[off..off + 2]);
        }
    };
    match t {
        GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0 => {
            for (r, s) in src.iter().enumerate() {
                let (q, _) = legacy_codes(t, s);
                if t == GgmlType::Q8_0 {
                    for g in 0..8 {
                        put4(&mut dst[64 * g..], r, q[4 * g..4 * g + 4].try_into().expect("4 codes"));
                    }
                } else {
                    for v in 0..4 {
                        let four = std::array::from_fn(|j| (q[4 * v + j] & 0x0F) | (q[16 + 4 * v + j] & 0x0F) << 4);
                        put4(&mut dst[64 * v..], r, four);
                    }
                }
                if t == GgmlType::Q5_0 {
                    for g in 0..8 {
                        for j in 0..4 {
                            dst[Q5_0_QH + 4 * r + j] |= ((q[4 * g + j] >> 4) & 1) << g;
                        }
                    }
                }
            }
            let d_off = match t {
                GgmlType::Q4_0 => Q4_0_D,
                GgmlType::Q4_1 => Q4_1_D,
                GgmlType::Q5_0 => Q5_0_D,
                _ => Q8_0_D,
            };
            f16_array(&mut dst[d_off..], 0);
            if t == GgmlType::Q4_1 {
                f16_array(&mut dst[Q4_1_M..], 2);
            }
        }
        GgmlType::Q4_K => {
            for (r, s) in src.iter().enumerate() {
                let (q, sc, m) = q4_k_codes(s);
                for c in 0..4 {
                    for g in 0..8 {
                        let four = std::array::from_fn(|j| q[64 * c + 4 * g + j] | q[64 * c + 32 + 4 * g + j] << 4);
                        put4(&mut dst[64 * (8 * c + g)..], r, four);
                    }
                }
                for j in 0..8 {
                    dst[Q4_K_SC + 16 * j + r] = sc[j];
                }
                for i in 0..4 {
                    dst[Q4_K_M + 32 * i + 2 * r] = m[2 * i];
                    dst[Q4_K_M + 32 * i + 2 * r + 1] = m[2 * i + 1];
                }
            }
            f16_array(&mut dst[Q4_K_D..], 0);
            f16_array(&mut dst[Q4_K_DMIN..], 2);
        }
        GgmlType::Q6_K => {
            for (r, s) in src.iter().enumerate() {
                for h in 0..2 {
                    for c in 0..16 {
                        let o = 64 * h + 4 * c;
                        put4(&mut dst[64 * (16 * h + c)..], r, s[o..o + 4].try_into().expect("4 bytes"));
                    }
                    for c in 0..8 {
                        let o = Q6_K_QH_GGML + 32 * h + 4 * c;
                        put4(&mut dst[Q6_K_QH + 64 * (8 * h + c)..], r, s[o..o + 4].try_into().expect("4 bytes"));
                    }
                }
                let (_, sc) = q6_k_codes(s);
                for (j, &v) in sc.iter().enumerate() {
                    dst[Q6_K_SC + 16 * j + r] = v as u8;
                }
            }
            f16_array(&mut dst[Q6_K_D..], Q6_K_D_GGML);
        }
        other => panic!("{other} cannot be packed"),
    }
}

// The ggml Q6_K field offsets, named apart from the packed ones above.
const Q6_K_QH_GGML: usize = blocks::Q6_K_QH;
const Q6_K_D_GGML: usize = blocks::Q6_K_D;

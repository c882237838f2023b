//! Quantized KV cells (`--kv-dtype q8_0|q4_0`): the formats, how a token's keys and values are written
//! into them, and their exact values (the reference the attention kernels are tested against).
//!
//! Values are quantized in blocks of 32 along the head dimension with ggml's rules (`quantize_row_q8_0`,
//! `quantize_row_q4_0` reference versions): q8_0 stores `d = amax / 127` as f16 and `round(x / d)` in
//! [-127, 127]; q4_0 stores `d = max / -8` (max: the value of largest magnitude, with its sign) as f16
//! and a nibble `n` in [0, 15] for `n - 8`. A value is `f16(d) · q` exactly: a 7-bit integer times an
//! 11-bit mantissa fits in f32's 24 bits.
//!
//! Layout: unlike ggml's row of blocks, a layer's cells are stored per (KV block, KV head) region, so the
//! attention of one head reads one contiguous run of memory per block and finds 16 cells' data side by
//! side (the score kernels put 16 cells in the 16 lanes of a vector and need no horizontal sums):
//! ```text
//! layer: [num_blocks][n_kv_heads] regions of `bs` cells of one head (hd values each)
//! keys   q8_0: quants [hd/4][bs][4] i8         (4 dims of 16 cells = 64 bytes, one AVX-512 vector)
//!        q4_0: quants [hd/8][bs][4] u8         (byte (m, c, i): low nibble dim 8m+i, high dim 8m+4+i)
//! values q8_0: quants [bs][hd] i8              (a cell's row, read in dimension order)
//!        q4_0: quants [bs][hd/2] u8            (per 32 dims: byte i low nibble dim i, high dim 16+i)
//! both:        scales [hd/32][bs] f16          (then 16 cells' scales of one block are one f16 vector)
//! ```

use half::f16;

/// How KV cells are stored.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvDtype {
    #[default]
    F16,
    Q8_0,
    Q4_0,
}

impl KvDtype {
    pub const ALL: [KvDtype; 3] = [KvDtype::F16, KvDtype::Q8_0, KvDtype::Q4_0];

    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::Q8_0 => "q8_0",
            KvDtype::Q4_0 => "q4_0",
        }
    }

    pub fn from_name(name: &str) -> Option<KvDtype> {
        KvDtype::ALL.into_iter().find(|d| d.name() == name)
    }

    pub fn is_quantized(self) -> bool {
        self != KvDtype::F16
    }

    /// Bytes of `n` values (`n` a multiple of 32 for the quantized types), scales included.
    pub fn bytes(self, n: usize) -> usize {
        match self {
            KvDtype::F16 => 2 * n,
            KvDtype::Q8_0 => n + 2 * (n / 32),
            KvDtype::Q4_0 => n / 2 + 2 * (n / 32),
        }
    }

    /// Bytes of one cell's quants (without the scales) of a head of `hd` values.
    pub(crate) fn quant_bytes(self, hd: usize) -> usize {
        match self {
            KvDtype::F16 => 2 * hd,
            KvDtype::Q8_0 => hd,
            KvDtype::Q4_0 => hd / 2,
        }
    }
}

/// The storage of keys and of values (llama.cpp's `-ctk` / `-ctv`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct KvDtypes {
    pub k: KvDtype,
    pub v: KvDtype,
}

impl KvDtypes {
    pub const F16: KvDtypes = KvDtypes { k: KvDtype::F16, v: KvDtype::F16 };

    /// `q8_0` (keys and values) or `q8_0,q4_0` (keys, values).
    pub fn parse(spec: &str) -> Result<KvDtypes, String> {
        let one = |s: &str| KvDtype::from_name(s.trim()).ok_or_else(|| format!("unknown KV dtype '{}' (f16, q8_0, q4_0)", s.trim()));
        let dtypes = match spec.split_once(',') {
            Some((k, v)) => KvDtypes { k: one(k)?, v: one(v)? },
            None => {
                let d = one(spec)?;
                KvDtypes { k: d, v: d }
            }
        };
        if dtypes.k.is_quantized() != dtypes.v.is_quantized() {
            return Err(format!("KV dtypes {}: f16 keys with quantized values (or the reverse) are not supported; quantize both or neither", dtypes.name()));
        }
        Ok(dtypes)
    }

    /// `q8_0`, or `q8_0,q4_0` when keys and values differ.
    pub fn name(&self) -> String {
        if self.k == self.v { self.k.name().to_string() } else { format!("{},{}", self.k.name(), self.v.name()) }
    }

    pub fn is_quantized(&self) -> bool {
        self.k.is_quantized()
    }

    /// KV bytes of one token over `num_layers` layers of `kv_dim` keys and values.
    pub fn bytes_per_token(&self, num_layers: usize, kv_dim: usize) -> usize {
        num_layers * (self.k.bytes(kv_dim) + self.v.bytes(kv_dim))
    }

    /// Part of the disk tier's file key: keys' type in the low byte, values' in the next.
    pub fn code(&self) -> u32 {
        let c = |d: KvDtype| KvDtype::ALL.iter().position(|&x| x == d).expect("listed") as u32;
        c(self.k) | c(self.v) << 8
    }

    /// The dtypes of a `code`, if it is one.
    pub fn from_code(code: u32) -> Option<KvDtypes> {
        let d = |c: u32| KvDtype::ALL.get(c as usize).copied();
        Some(KvDtypes { k: d(code & 0xFF)?, v: d(code >> 8)? })
    }

    /// Whether quantized cells fit these heads and blocks: 32-value scale blocks, 16-cell vectors.
    pub fn check_shape(&self, head_dim: usize, block_size: usize) -> Result<(), String> {
        if self.is_quantized() && (head_dim % 32 != 0 || block_size % 16 != 0) {
            return Err(format!("KV dtype {} needs a head size divisible by 32 (this model: {head_dim}) and a block size divisible by 16 (--block-size {block_size})", self.name()));
        }
        Ok(())
    }
}

/// ggml's q8_0 of 32 values: the scale as f16 and the quants.
pub fn quantize_q8_0(x: &[f32]) -> (f16, [i8; 32]) {
    debug_assert_eq!(x.len(), 32);
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0i8; 32];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * id).round() as i8;
    }
    (f16::from_f32(d), q)
}

/// ggml's q4_0 of 32 values: the scale as f16 and the nibbles (value = `(n - 8) · d`).
pub fn quantize_q4_0(x: &[f32]) -> (f16, [u8; 32]) {
    debug_assert_eq!(x.len(), 32);
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut n = [0u8; 32];
    for (n, &v) in n.iter_mut().zip(x) {
        *n = ((v * id + 8.5) as i8).min(15) as u8;
    }
    (f16::from_f32(d), n)
}

/// Where one (block, KV head) region's parts are, for heads of `hd` values and blocks of `bs` cells.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Region {
    pub dtype: KvDtype,
    pub hd: usize,
    pub bs: usize,
}

impl Region {
    pub fn bytes(&self) -> usize {
        self.bs * self.dtype.bytes(self.hd)
    }

    /// Byte offset of the scales (`[hd/32][bs]` f16) in the region.
    pub fn scales_at(&self) -> usize {
        self.bs * self.dtype.quant_bytes(self.hd)
    }

    /// Writes one cell's `hd` keys (`keys`) or values into the region at `region`, cell `c`.
    ///
    /// # Safety
    /// `region` points at `self.bytes()` writable bytes; only cell `c`'s bytes are written (through the
    /// pointer: other threads may write other cells of the region meanwhile).
    pub unsafe fn write(&self, region: *mut u8, c: usize, x: &[f32], keys: bool) {
        let (hd, bs, at) = (self.hd, self.bs, self.scales_at());
        for b in 0..hd / 32 {
            let xb = &x[32 * b..32 * b + 32];
            let d = match self.dtype {
                KvDtype::Q8_0 => {
                    let (d, q) = quantize_q8_0(xb);
                    for (i, &q) in q.iter().enumerate() {
                        let dim = 32 * b + i;
                        let idx = if keys { (dim / 4 * bs + c) * 4 + dim % 4 } else { c * hd + dim };
                        *region.add(idx) = q as u8;
                    }
                    d
                }
                KvDtype::Q4_0 => {
                    let (d, n) = quantize_q4_0(xb);
                    for (i, &n) in n.iter().enumerate() {
                        let dim = 32 * b + i;
                        let (idx, high) = if keys { ((dim / 8 * bs + c) * 4 + dim % 4, dim % 8 >= 4) } else { (c * hd / 2 + 16 * b + i % 16, i >= 16) };
                        let byte = region.add(idx);
                        *byte = if high { (*byte & 0x0F) | n << 4 } else { (*byte & 0xF0) | n };
                    }
                    d
                }
                KvDtype::F16 => unreachable!("f16 cells are not regions"),
            };
            std::ptr::copy_nonoverlapping(d.to_bits().to_le_bytes().as_ptr(), region.add(at + 2 * (b * bs + c)), 2);
        }
    }

    /// Cell `c`'s quants as integers (`[hd]`) and its scales as f32 (`[hd/32]`): the exact values are
    /// `q[i] · d[i / 32]`.
    pub fn read(&self, region: &[u8], c: usize, keys: bool, q: &mut [i32], d: &mut [f32]) {
        let (hd, bs, at) = (self.hd, self.bs, self.scales_at());
        for (dim, q) in q.iter_mut().enumerate().take(hd) {
            *q = match self.dtype {
                KvDtype::Q8_0 => region[if keys { (dim / 4 * bs + c) * 4 + dim % 4 } else { c * hd + dim }] as i8 as i32,
                KvDtype::Q4_0 => {
                    let (b, i) = (dim / 32, dim % 32);
                    let (idx, high) = if keys { ((dim / 8 * bs + c) * 4 + dim % 4, dim % 8 >= 4) } else { (c * hd / 2 + 16 * b + i % 16, i >= 16) };
                    let byte = region[idx];
                    (if high { byte >> 4 } else { byte & 0x0F }) as i32 - 8
                }
                KvDtype::F16 => unreachable!("f16 cells are not regions"),
            };
        }
        for (b, d) in d.iter_mut().enumerate().take(hd / 32) {
            *d = f16::from_bits(u16::from_le_bytes([region[at + 2 * (b * bs + c)], region[at + 2 * (b * bs + c) + 1]])).to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_read_back_what_was_written_within_the_quantization_step() {
        for dtype in [KvDtype::Q8_0, KvDtype::Q4_0] {
            for keys in [true, false] {
                let r = Region { dtype, hd: 64, bs: 16 };
                let mut region = vec![0u8; r.bytes()];
                let cells: Vec<Vec<f32>> = (0..16).map(|c| (0..64).map(|i| ((c * 64 + i) as f32 * 0.37).sin() * (1.0 + c as f32)).collect()).collect();
                for (c, x) in cells.iter().enumerate().rev() {
                    // SAFETY: the buffer holds the region.
                    unsafe { r.write(region.as_mut_ptr(), c, x, keys) };
                }
                let (mut q, mut d) = (vec![0; 64], vec![0.0; 2]);
                for (c, x) in cells.iter().enumerate() {
                    r.read(&region, c, keys, &mut q, &mut d);
                    for (i, &v) in x.iter().enumerate() {
                        let step = d[i / 32].abs();
                        let got = q[i] as f32 * d[i / 32];
                        // half a step (q4_0: a whole one at the clamped end, 8 levels up, 7 down), plus
                        // the scale's rounding to f16 times the largest quant
                        let steps = if dtype == KvDtype::Q8_0 { 0.5 } else { 1.0 };
                        assert!((got - v).abs() <= step * (steps + 128.0 / 2048.0) + 1e-6, "{dtype:?} keys {keys} cell {c} dim {i}: {got} vs {v}");
                    }
                }
            }
        }
    }

    #[test]
    fn dtypes_parse_and_refuse_mixed_f16() {
        assert_eq!(KvDtypes::parse("q8_0").unwrap(), KvDtypes { k: KvDtype::Q8_0, v: KvDtype::Q8_0 });
        assert_eq!(KvDtypes::parse("q8_0,q4_0").unwrap().name(), "q8_0,q4_0");
        assert!(KvDtypes::parse("q8_0,f16").is_err());
        assert!(KvDtypes::parse("q5_1").is_err());
        assert_eq!(KvDtypes::F16.bytes_per_token(30, 192), 30 * 2 * 384);
        assert_eq!(KvDtypes::parse("q8_0").unwrap().bytes_per_token(1, 64), 2 * 68);
    }
}

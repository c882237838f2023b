//! Parsing a GGUF file (v2/v3): header, metadata, tensor infos, aligned data section.
//!
//! Every length, count, offset and size read from the file is checked against the bytes that are actually
//! there before it is used, so a truncated or corrupted file becomes an `Error::Gguf` naming the problem.

use super::value::Value;
use crate::error::{Error, Result};
use crate::kernels::ggml::GgmlType;

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
const MAX_DIMS: u32 = 4;
/// Nesting depth for arrays of arrays; GGUF files in the wild use at most 1.
const MAX_ARRAY_DEPTH: u32 = 4;

/// Where one tensor's bytes are, and what they hold. `dims[0]` is the innermost (row) length, as in ggml.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub dtype: GgmlType,
    /// Offset of the first byte, relative to the start of the file.
    pub file_offset: u64,
    pub num_bytes: u64,
}

impl TensorInfo {
    pub fn num_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// The parsed header of a GGUF file: everything but the tensor data.
#[derive(Clone, Debug)]
pub struct Header {
    pub version: u32,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    pub data_offset: u64,
}

fn bad(msg: impl Into<String>) -> Error {
    Error::Gguf(msg.into())
}

/// A bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        let remaining = (self.bytes.len() - self.pos) as u64;
        if n > remaining {
            return Err(bad(format!(
                "truncated: {what} needs {n} bytes at offset {} but only {remaining} remain",
                self.pos
            )));
        }
        let out = &self.bytes[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        Ok(self.take(N as u64, what)?.try_into().expect("take returned N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn remaining(&self) -> u64 {
        (self.bytes.len() - self.pos) as u64
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let raw = self.take(len, what)?;
        String::from_utf8(raw.to_vec()).map_err(|_| bad(format!("{what} is not valid UTF-8")))
    }

    fn value(&mut self, type_id: u32, key: &str, depth: u32) -> Result<Value> {
        Ok(match type_id {
            0 => Value::U8(u8::from_le_bytes(self.array(key)?)),
            1 => Value::I8(i8::from_le_bytes(self.array(key)?)),
            2 => Value::U16(u16::from_le_bytes(self.array(key)?)),
            3 => Value::I16(i16::from_le_bytes(self.array(key)?)),
            4 => Value::U32(self.u32(key)?),
            5 => Value::I32(i32::from_le_bytes(self.array(key)?)),
            6 => Value::F32(f32::from_le_bytes(self.array(key)?)),
            7 => match u8::from_le_bytes(self.array(key)?) {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(bad(format!("metadata {key:?}: bool byte {b} is neither 0 nor 1"))),
            },
            8 => Value::String(self.string(key)?),
            9 => self.array_value(key, depth)?,
            10 => Value::U64(self.u64(key)?),
            11 => Value::I64(i64::from_le_bytes(self.array(key)?)),
            12 => Value::F64(f64::from_le_bytes(self.array(key)?)),
            t => return Err(bad(format!("metadata {key:?}: unknown value type {t}"))),
        })
    }

    fn array_value(&mut self, key: &str, depth: u32) -> Result<Value> {
        if depth >= MAX_ARRAY_DEPTH {
            return Err(bad(format!("metadata {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH}")));
        }
        let elem_type = self.u32(key)?;
        let len = self.u64(key)?;
        // Every element takes at least one byte: refuse counts the file cannot hold before allocating.
        if len > self.remaining() {
            return Err(bad(format!("metadata {key:?}: array of {len} items is longer than the file")));
        }
        let mut items = Vec::with_capacity(len as usize);
        for _ in 0..len {
            items.push(self.value(elem_type, key, depth + 1)?);
        }
        Ok(Value::Array(items))
    }
}

/// Parse the header of a GGUF file held in `bytes` (usually a memory map of the whole file).
pub fn parse_header(bytes: &[u8]) -> Result<Header> {
    let mut cur = Cursor { bytes, pos: 0 };
    let magic = cur.take(4, "magic").map_err(|_| bad("file is shorter than the 4-byte GGUF magic"))?;
    if magic != MAGIC {
        return Err(bad(format!("wrong magic {magic:02x?}: not a GGUF file")));
    }
    let version = cur.u32("version")?;
    if !(2..=3).contains(&version) {
        return Err(bad(format!("unsupported GGUF version {version} (supported: 2, 3)")));
    }
    let num_tensors = cur.u64("tensor count")?;
    let num_kv = cur.u64("metadata count")?;
    if num_tensors > cur.remaining() || num_kv > cur.remaining() {
        return Err(bad(format!("header claims {num_tensors} tensors and {num_kv} metadata entries, more than the file holds")));
    }
    let mut metadata = Vec::with_capacity(num_kv as usize);
    for i in 0..num_kv {
        let key = cur.string(&format!("metadata key #{i}"))?;
        let type_id = cur.u32(&key)?;
        let value = cur.value(type_id, &key, 0)?;
        metadata.push((key, value));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 16 => a,
            _ => return Err(bad(format!("general.alignment {v:?} is not a power of two"))),
        },
    };
    let mut raw_tensors = Vec::with_capacity(num_tensors as usize);
    for i in 0..num_tensors {
        raw_tensors.push(read_tensor_info(&mut cur, i)?);
    }
    let data_offset = (cur.pos as u64).div_ceil(alignment) * alignment;
    let data_len = (bytes.len() as u64).saturating_sub(data_offset);
    let tensors = raw_tensors
        .into_iter()
        .map(|(info, rel)| place_tensor(info, rel, alignment, data_offset, data_len))
        .collect::<Result<Vec<_>>>()?;
    Ok(Header { version, metadata, tensors, alignment, data_offset })
}

/// Reads one tensor info; returns it with `file_offset` still relative to the data section.
fn read_tensor_info(cur: &mut Cursor, index: u64) -> Result<(TensorInfo, u64)> {
    let name = cur.string(&format!("tensor #{index} name"))?;
    let n_dims = cur.u32(&name)?;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(bad(format!("tensor {name:?}: {n_dims} dimensions (1..={MAX_DIMS} supported)")));
    }
    let dims = (0..n_dims).map(|_| cur.u64(&name)).collect::<Result<Vec<_>>>()?;
    let type_id = cur.u32(&name)?;
    let dtype = GgmlType::from_ggml_id(type_id)
        .ok_or_else(|| bad(format!("tensor {name:?}: unsupported tensor type id {type_id}")))?;
    let rel_offset = cur.u64(&name)?;
    let num_bytes = tensor_bytes(&name, &dims, dtype)?;
    Ok((TensorInfo { name, dims, dtype, file_offset: 0, num_bytes }, rel_offset))
}

fn tensor_bytes(name: &str, dims: &[u64], dtype: GgmlType) -> Result<u64> {
    let overflow = || bad(format!("tensor {name:?}: shape {dims:?} overflows"));
    let row_len = dims[0];
    if row_len == 0 || dims.iter().any(|&d| d == 0) {
        return Err(bad(format!("tensor {name:?}: empty dimension in shape {dims:?}")));
    }
    let block = dtype.block_len() as u64;
    if row_len % block != 0 {
        return Err(bad(format!(
            "tensor {name:?}: row length {row_len} is not a multiple of the {} block size {block}",
            dtype.name()
        )));
    }
    let row_bytes = (row_len / block).checked_mul(dtype.block_bytes() as u64).ok_or_else(overflow)?;
    dims[1..].iter().try_fold(row_bytes, |acc, &d| acc.checked_mul(d)).ok_or_else(overflow)
}

fn place_tensor(mut info: TensorInfo, rel: u64, alignment: u64, data_offset: u64, data_len: u64) -> Result<TensorInfo> {
    if rel % alignment != 0 {
        return Err(bad(format!("tensor {:?}: offset {rel} is not aligned to {alignment}", info.name)));
    }
    let end = rel.checked_add(info.num_bytes);
    if end.is_none_or(|e| e > data_len) {
        return Err(bad(format!(
            "tensor {:?}: data [{rel}, +{}) lies past the end of the file (data section is {data_len} bytes; truncated file?)",
            info.name, info.num_bytes
        )));
    }
    info.file_offset = data_offset + rel;
    Ok(info)
}

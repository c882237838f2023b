//! Writing GGUF v3 images. Tests use it to build tiny random models and deliberately broken files.

use super::value::Value;
use crate::kernels::ggml::GgmlType;

const ALIGNMENT: usize = 32;

struct PendingTensor {
    name: String,
    dtype: GgmlType,
    dims: Vec<u64>,
    bytes: Vec<u8>,
}

/// Accumulates metadata and tensors, then lays them out as a GGUF v3 file.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn meta(&mut self, key: &str, value: Value) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Adds a tensor; `dims[0]` is the row length, `bytes` its stored data in `dtype`'s layout.
    pub fn tensor(&mut self, name: &str, dtype: GgmlType, dims: &[u64], bytes: Vec<u8>) -> &mut Self {
        self.tensors.push(PendingTensor { name: name.to_string(), dtype, dims: dims.to_vec(), bytes });
        self
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(b"GGUF");
        put_u32(&mut out, 3);
        put_u64(&mut out, self.tensors.len() as u64);
        put_u64(&mut out, self.metadata.len() as u64);
        for (key, value) in &self.metadata {
            put_str(&mut out, key);
            put_u32(&mut out, type_id(value));
            put_value(&mut out, value);
        }
        let mut offset = 0usize;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            put_u32(&mut out, t.dims.len() as u32);
            t.dims.iter().for_each(|&d| put_u64(&mut out, d));
            put_u32(&mut out, t.dtype.ggml_id());
            put_u64(&mut out, offset as u64);
            offset = (offset + t.bytes.len()).div_ceil(ALIGNMENT) * ALIGNMENT;
        }
        pad_to_alignment(&mut out);
        for t in &self.tensors {
            out.extend_from_slice(&t.bytes);
            pad_to_alignment(&mut out);
        }
        out
    }
}

fn pad_to_alignment(out: &mut Vec<u8>) {
    out.resize(out.len().div_ceil(ALIGNMENT) * ALIGNMENT, 0);
}

fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

fn type_id(v: &Value) -> u32 {
    match v {
        Value::U8(_) => 0,
        Value::I8(_) => 1,
        Value::U16(_) => 2,
        Value::I16(_) => 3,
        Value::U32(_) => 4,
        Value::I32(_) => 5,
        Value::F32(_) => 6,
        Value::Bool(_) => 7,
        Value::String(_) => 8,
        Value::Array(_) => 9,
        Value::U64(_) => 10,
        Value::I64(_) => 11,
        Value::F64(_) => 12,
    }
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => put_u32(out, *x),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, s),
        Value::U64(x) => put_u64(out, *x),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Array(items) => {
            // An empty array's element type is irrelevant; use u8.
            put_u32(out, items.first().map(type_id).unwrap_or(0));
            put_u64(out, items.len() as u64);
            items.iter().for_each(|i| put_value(out, i));
        }
    }
}

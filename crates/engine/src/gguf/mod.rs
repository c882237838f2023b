//! GGUF model files: a bounds-checked reader over a memory map, typed metadata access, and a writer used by
//! tests to make tiny models.

mod reader;
mod value;
pub mod writer;

pub use reader::{parse_header, Header, TensorInfo};
pub use value::Value;

use crate::error::{Error, Result};
use crate::kernels::ggml::GgmlType;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// The bytes behind a model: a read-only memory map of the file, or an owned buffer (tests).
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

/// An opened GGUF file. Tensor data stays in the memory map; nothing is copied at open.
pub struct GgufFile {
    path: PathBuf,
    bytes: Bytes,
    header: Header,
    index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
}

/// A borrowed view of one tensor's stored bytes.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub dtype: GgmlType,
    /// ggml order: `dims[0]` is the row length.
    pub dims: &'a [u64],
    pub bytes: &'a [u8],
}

impl TensorView<'_> {
    pub fn row_len(&self) -> usize {
        self.dims[0] as usize
    }
    pub fn num_rows(&self) -> usize {
        self.dims[1..].iter().product::<u64>() as usize
    }
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = std::fs::File::open(&path).map_err(|source| Error::Open { path: path.clone(), source })?;
        // SAFETY: the map is read-only; a file truncated underneath us by another process is outside what
        // any mmap-based reader (llama.cpp included) can defend against.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|source| Error::Open { path: path.clone(), source })?;
        Self::from_bytes_inner(path, Bytes::Mapped(map))
    }

    /// Parse a GGUF image held in memory (tests, fuzzing).
    pub fn from_vec(bytes: Vec<u8>) -> Result<Self> {
        Self::from_bytes_inner(PathBuf::from("<memory>"), Bytes::Owned(bytes))
    }

    fn from_bytes_inner(path: PathBuf, bytes: Bytes) -> Result<Self> {
        let header = parse_header(match &bytes {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        })?;
        let index = header.metadata.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect();
        let tensor_index = header.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(GgufFile { path, bytes, header, index, tensor_index })
    }

    /// Tells the OS that bytes `offset..offset + len` of the map will not be read again soon (their
    /// packed copy is used instead), so their pages leave this process's resident memory. Reading them
    /// later still works: they come back from the file.
    pub fn release_range(&self, offset: usize, len: usize) {
        if let Bytes::Mapped(m) = &self.bytes {
            // SAFETY: a read-only file mapping; after MADV_DONTNEED its pages are re-read from the file
            // on the next access, so no reader can observe a difference.
            let _ = unsafe { m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len) };
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn header(&self) -> &Header {
        &self.header
    }
    pub fn file_size(&self) -> u64 {
        self.raw().len() as u64
    }
    /// The whole file's bytes (tensor infos hold offsets into it).
    pub fn raw(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.header.metadata[i].1)
    }

    fn required(&self, key: &str) -> Result<&Value> {
        self.get(key).ok_or_else(|| Error::Metadata(format!("missing key {key:?}")))
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.required(key)?.as_str().ok_or_else(|| Error::Metadata(format!("{key:?} is not a string")))
    }

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.required(key)?.as_u64().ok_or_else(|| Error::Metadata(format!("{key:?} is not an unsigned integer")))
    }

    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.required(key)?.as_f32().ok_or_else(|| Error::Metadata(format!("{key:?} is not a number")))
    }

    pub fn get_bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.get(key) {
            None => Ok(default),
            Some(v) => v.as_bool().ok_or_else(|| Error::Metadata(format!("{key:?} is not a bool"))),
        }
    }

    /// An array of strings (e.g. `tokenizer.ggml.tokens`).
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let arr = self.required(key)?.as_array().ok_or_else(|| Error::Metadata(format!("{key:?} is not an array")))?;
        arr.iter()
            .map(|v| v.as_str().ok_or_else(|| Error::Metadata(format!("{key:?} holds a non-string"))))
            .collect()
    }

    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        let arr = self.required(key)?.as_array().ok_or_else(|| Error::Metadata(format!("{key:?} is not an array")))?;
        arr.iter()
            .map(|v| v.as_f32().ok_or_else(|| Error::Metadata(format!("{key:?} holds a non-number"))))
            .collect()
    }

    pub fn get_i64_array(&self, key: &str) -> Result<Vec<i64>> {
        let arr = self.required(key)?.as_array().ok_or_else(|| Error::Metadata(format!("{key:?} is not an array")))?;
        arr.iter()
            .map(|v| v.as_i64().ok_or_else(|| Error::Metadata(format!("{key:?} holds a non-integer"))))
            .collect()
    }

    pub fn tensor_info(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.header.tensors[i])
    }

    pub fn tensor(&self, name: &str) -> Result<TensorView<'_>> {
        let info = self.tensor_info(name).ok_or_else(|| Error::Metadata(format!("missing tensor {name:?}")))?;
        // Bounds were checked at parse time.
        let start = info.file_offset as usize;
        let bytes = &self.raw()[start..start + info.num_bytes as usize];
        Ok(TensorView { dtype: info.dtype, dims: &info.dims, bytes })
    }
}

//! reckon's engine: GGUF models, quantized kernels, tokenizers, sampling and (later) the scheduler.
//! No HTTP here: the engine takes token ids in and emits token events out.

pub mod attention;
pub mod debug_dump;
pub mod engine;
pub mod error;
pub mod ggml_math;
pub mod gguf;
pub mod huge_buf;
pub mod kv;
pub mod matmul;
pub mod model;
pub mod pool;
pub mod ops;
pub mod quant;
pub mod registry;
pub mod session;
pub mod sampler;
pub mod scheduler;
pub mod template;
pub mod tokenizer;

pub use error::{Error, Result};

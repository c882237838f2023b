//! reckon's engine: GGUF models, their kernels, the paged KV cache with prefix caching, the scheduler,
//! sampling and tokenizers. No HTTP here: the engine takes validated requests in (token ids) and emits
//! token events out.

pub mod engine;
pub mod error;
pub mod gguf;
pub mod grammar;
pub mod huge_buf;
pub mod kernels;
pub mod kv;
pub mod model;
pub mod pool;
pub mod registry;
pub mod sampler;
pub mod template;
pub mod tokenizer;

pub use error::{Error, Result};

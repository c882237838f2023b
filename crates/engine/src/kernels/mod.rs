//! The arithmetic: everything that touches weights, activations or the KV cells' numbers.
//!
//! - `cpu`: what this CPU can do, detected once, and the process's cap on it.
//! - `ggml`: ggml's tensor types, their dequantization and quantized dot products, and the element-wise
//!   math (`ggml::math`) bit for bit as llama.cpp's CPU backend computes them: the ggml numerics.
//! - `packed`: reckon's own numerics: weights repacked at load for integer kernels, defined by
//!   `packed::reference`.
//! - `matmul`: a weight matrix times a batch of activation rows, in either numerics, over the pool.
//! - `attention`: paged attention over the KV storage.
//! - `ops`: row operations (norms, RoPE, activations) in ggml's order.

pub mod attention;
pub mod cpu;
pub mod ggml;
pub mod matmul;
pub mod ops;
pub mod packed;

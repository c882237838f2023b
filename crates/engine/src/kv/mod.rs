//! The KV cache: where every request's keys and values live, and which of them a later request may reuse.
//!
//! - `storage`: the tensors, `[layer][block][slot][kv_dim]` f16 (the packed numerics' keys by dimension)
//!   or quantized by head (`quant`); the model reads and writes them.
//! - `block_pool` (+ `free_queue`): which block ids are free, held, or cached under a prefix key. Ids only.
//! - `manager`: a request's blocks: prefix-cache lookup at admission, allocation as it grows, caching of
//!   its full blocks, release. Ids only, so every decision is tested without a model.
//! - `layout`: layer groups sharing one pool of pages, a table each (sliding-window layers keep their
//!   window only).
//! - `window`: a StreamingLLM window (sinks and recent positions), whose dead blocks are released.
//! - `sparse`: block-sparse attention over a sequence's history (which blocks a query reads; ids only).
//! - `disk_tier` (+ `offload`): blocks evicted from memory kept as files, and read back for a later hit.

mod block_pool;
pub mod disk_tier;
mod free_queue;
pub mod layout;
mod manager;
pub mod offload;
pub mod quant;
mod storage;
pub mod sparse;
pub mod window;

pub use block_pool::{sha256_block_hash, BlockHash, BlockHasher, BlockPool, EvictedBlock};
pub use disk_tier::{kv_numerics_version, DiskTierConfig, KvFormat, KV_NUMERICS_VERSION};
pub use layout::KvLayout;
pub use manager::{Admission, KvCacheManager, PrefixCacheStats, PrefixProbe, RequestBlocks};
pub use quant::{KvDtype, KvDtypes};
pub use storage::{by_dim_index, key_group, KeyLayout, KvShape, KvStorage, LayerWriter, QuantLayer};
pub use sparse::SparseAttention;
pub use window::{KvWindow, NULL_BLOCK};

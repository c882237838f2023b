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
//! - `events`: which keys the cache stores and drops, for a cluster's router.

mod block_pool;
pub mod conv_state;
pub mod disk_tier;
pub mod events;
mod free_queue;
pub mod layout;
mod manager;
pub mod offload;
pub mod quant;
mod storage;
pub mod sparse;
mod sparse_state;
pub mod window;

pub use conv_state::ConvStates;
pub use block_pool::{sha256_block_hash, BlockHash, BlockHasher, BlockPool, EvictedBlock, NO_STATE};
pub use events::{KvEvent, KvEventSink, Medium};
pub use disk_tier::{kv_numerics_version, DiskTierConfig, KvFormat, KV_NUMERICS_VERSION};
pub use layout::KvLayout;
pub use manager::{Admission, KvCacheManager, PrefixCacheStats, PrefixProbe, RequestBlocks};
pub use quant::{KvDtype, KvDtypes};
pub use storage::{by_dim_index, key_group, KeyLayout, KvShape, KvStorage, LayerWriter, QuantLayer};
pub use sparse::SparseAttention;
pub use window::{KvWindow, NULL_BLOCK};

/// What each query of a full-attention layer reads (a sliding-window layer reads its own window
/// whatever this says): every position before it, a StreamingLLM window of them (`window`), or its
/// recent blocks and the history blocks it picks (`sparse`). One value, so the two cannot be combined.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum Attention {
    #[default]
    Full,
    Window(KvWindow),
    Sparse(SparseAttention),
}

impl Attention {
    /// From the configuration's two options (`--kv-window`, `--sparse-attention`); `None` if both are set.
    pub fn of(window: Option<KvWindow>, sparse: Option<SparseAttention>) -> Option<Attention> {
        match (window, sparse) {
            (None, None) => Some(Attention::Full),
            (Some(w), None) => Some(Attention::Window(w)),
            (None, Some(s)) => Some(Attention::Sparse(s)),
            (Some(_), Some(_)) => None,
        }
    }

    pub fn window(self) -> Option<KvWindow> {
        match self {
            Attention::Window(w) => Some(w),
            _ => None,
        }
    }

    pub fn sparse(self) -> Option<SparseAttention> {
        match self {
            Attention::Sparse(s) => Some(s),
            _ => None,
        }
    }
}

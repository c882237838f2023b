//! KV-cache events: which prefix-cache keys a server holds, as they come and go, for a cluster's router
//! to route by (vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`). The pool and the disk tier
//! record them (keys and token ids only); the engine hands each step's to a sink, and the server puts
//! them on the wire (`reckon_server::kv_events`).
//!
//! An event describes a key, not a block id: `BlockStored` when a medium first holds a block under the
//! key, `BlockRemoved` when it holds none any more (two requests that computed the same prefix at once
//! hold two blocks under one key; the key leaves with the second).

use super::BlockHash;
use std::sync::Arc;

/// Where a cached block lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Medium {
    /// The KV blocks the model reads (host memory: reckon runs on CPUs).
    Memory,
    /// The prefix cache's disk tier (`kv::disk_tier`).
    Disk,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvEvent {
    /// A full block was cached under `hash`, chained from `parent` (`None`: a sequence's first block),
    /// holding `tokens` (`block_size` of them).
    BlockStored { hash: BlockHash, parent: Option<BlockHash>, tokens: Box<[u32]>, medium: Medium },
    /// No block is cached under `hash` in `medium` any more.
    BlockRemoved { hash: BlockHash, medium: Medium },
    /// Every cached block of the medium was dropped.
    AllBlocksCleared,
}

/// Receives the events of one engine step (or one disk-tier write), in order. Called from the engine
/// thread and the disk writer: it must only queue them.
pub type KvEventSink = Arc<dyn Fn(Vec<KvEvent>) + Send + Sync>;

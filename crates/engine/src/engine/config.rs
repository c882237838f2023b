//! What an engine is started with: the KV cache's size and numerics, the step's budgets, and which
//! features run (speculation, sparse prefill, sparse attention, windows, slow-state fallback).

use super::{slow, sparse, spec};
use crate::kv::offload::DiskOffload;
use crate::kv::{kv_numerics_version, Attention, DiskTierConfig, KvDtypes, KvFormat, KvLayout, KvStorage, KvWindow, SparseAttention};
use crate::model::{Model, ModelConfig};

#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks (fixed at start-up from the memory budget).
    pub num_blocks: usize,
    /// Token budget of one step.
    pub max_batch_tokens: usize,
    /// Prefill tokens of a step that also decodes (`SchedulerConfig::max_prefill_tokens_while_decoding`).
    pub max_prefill_tokens_while_decoding: usize,
    /// Requests running at once.
    pub max_running: usize,
    /// Requests waiting at most; more are refused (`RequestError::QueueFull`).
    pub max_waiting: usize,
    /// Longest sequence, prompt and output together.
    pub max_model_len: usize,
    /// Reuse the KV blocks of earlier requests' common prefixes.
    pub prefix_caching: bool,
    /// Park the thread pool's workers after each forward pass (see `Engine::execute`).
    pub rest_pool_between_steps: bool,
    /// How keys and values are stored (`--kv-dtype`); `KvDtypes::check_shape` must accept the model's
    /// head size and `block_size`.
    pub kv_dtypes: KvDtypes,
    /// A StreamingLLM window (`--kv-window`, `--kv-sinks`): every sequence keeps its sinks and its last
    /// positions only (`kv::window`).
    pub kv_window: Option<KvWindow>,
    /// Block-sparse attention over each query's history (`--sparse-attention`, `kv::sparse`); f16 KV,
    /// no window.
    pub sparse_attention: Option<SparseAttention>,
    /// Sliding-window layers (Gemma-3's) in layer groups of their own, which keep their window's blocks
    /// only (`kv::layout`). In effect only without `kv_window` and without a disk tier
    /// (`EngineConfig::kv_layout`).
    pub hybrid_kv: bool,
    /// Speculative decoding with the n-gram proposer for every request without a grammar (`engine::spec`);
    /// `None`: only requests that bring a prediction speculate (with the default configuration).
    pub spec: Option<spec::SpecConfig>,
    /// Sparse prefill of long prompts (`engine::sparse`), scored by the model's own first layers.
    pub spec_prefill: Option<sparse::SparsePrefillConfig>,
    /// Slow-state detection and its fallback (`engine::slow`).
    pub slow_state: slow::SlowStateConfig,
    /// A hybrid recurrent model's state snapshot interval in blocks (`--state-snapshot-every`): every
    /// N-th block of a sequence keeps the state after it, so prefix-cache hits come in steps of N
    /// blocks and the snapshots take 1/N of a snapshot per block (`kv::conv_state`).
    pub state_snapshot_every: usize,
}

impl EngineConfig {
    /// The KV layout this configuration gets for `model` (with a disk tier: `disk_tier`): hybrid where
    /// asked and possible, else one group. `num_blocks` counts its pages.
    pub fn kv_layout(&self, model: &Model, disk_tier: bool) -> KvLayout {
        model.kv_layout(self.hybrid_kv && self.kv_window.is_none() && !(disk_tier && self.prefix_caching) && !self.has_draft_model())
    }

    /// What full-attention layers' queries read (`Engine::new` refuses a window with sparse attention).
    pub fn attention(&self) -> Attention {
        Attention::of(self.kv_window, self.sparse_attention).expect("a KV window is not combined with sparse attention")
    }

    /// The prefix cache's disk tier in `disk` for `model`'s keys and values as `kv` stores them (none
    /// without prefix caching); fails if the directory cannot be used.
    pub fn open_disk_tier(&self, model: &Model, kv: &KvStorage, disk: Option<DiskTierConfig>) -> std::io::Result<Option<DiskOffload>> {
        let Some(d) = disk.filter(|_| self.prefix_caching) else { return Ok(None) };
        let format = KvFormat {
            model: model.fingerprint(),
            num_layers: kv.shape.num_layers as u32,
            kv_dim: kv.shape.kv_dim as u32,
            block_size: self.block_size as u32,
            dtype: self.kv_dtypes.code(),
            // KV computed under sparse attention is another KV: its files are never served to dense
            // attention or another configuration
            version: kv_numerics_version(model.numerics()) ^ self.sparse_attention.map_or(0, |s| s.code() << 8),
            // (implied by the model's fingerprint: not in the file's header)
            state_len: kv.conv_states.snapshot_len() as u64,
        };
        DiskOffload::open(&d, format, self.kv_window).map(Some)
    }

    /// State snapshot slots of a hybrid recurrent model's pool: one per `state_snapshot_every` blocks.
    pub fn state_snapshot_slots(&self) -> usize {
        self.num_blocks.div_ceil(self.state_snapshot_every.max(1))
    }

    /// Refuses a configuration that asks `model` for a feature its architecture lacks
    /// (`ModelConfig::capabilities`), naming the feature and why.
    pub fn check_capabilities(&self, model: &ModelConfig) -> Result<(), String> {
        use crate::model::Feature;
        let caps = &model.capabilities;
        let wanted = [
            (self.spec.is_some(), Feature::Speculation),
            (self.spec_prefill.is_some(), Feature::SparsePrefill),
            (self.sparse_attention.is_some(), Feature::SparseAttention),
            (self.kv_window.is_some(), Feature::KvWindow),
        ];
        if let Some((_, m)) = caps.refuse(&wanted) {
            return Err(m);
        }
        if caps.state_snapshots && self.state_snapshot_every == 0 {
            return Err("state snapshots are taken every N blocks, N at least 1".into());
        }
        Ok(())
    }

    /// Speculation with a draft model (`SpecConfig::draft`): its keys and values share the target's
    /// block ids, so the layout is one group.
    pub fn has_draft_model(&self) -> bool {
        self.spec.is_some_and(|s| s.draft)
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            num_blocks: 1024,
            max_batch_tokens: 512,
            max_prefill_tokens_while_decoding: usize::MAX,
            max_running: 64,
            max_waiting: 256,
            max_model_len: 4096,
            prefix_caching: true,
            rest_pool_between_steps: true,
            kv_dtypes: KvDtypes::F16,
            kv_window: None,
            sparse_attention: None,
            hybrid_kv: false,
            spec: None,
            spec_prefill: None,
            slow_state: Default::default(),
            state_snapshot_every: 1,
        }
    }
}

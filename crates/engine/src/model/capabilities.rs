//! What an architecture can run. Each architecture's file declares its own (`config()` sets
//! `ModelConfig::capabilities`); it is checked once per place an option enters: the engine's
//! configuration at start-up (`EngineConfig::check_capabilities`, from `Engine::new`) and each request's
//! options in validation (`engine::validate`, through `Limits::capabilities`). What a model cannot run
//! is refused there with the option's name, never run wrong and never dropped in silence.

/// The features whose correctness depends on the architecture. KV dtypes are not here: every
/// architecture stores its keys and values alike, and `KvDtypes::check_shape` checks the head size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// Speculative decoding of any kind (n-gram, a draft model, a request's `prediction`): the model's
    /// per-sequence state must roll back over rejected guesses. The paged KV does (rejected positions
    /// are overwritten); a recurrent state that has already absorbed them does not.
    pub speculation: bool,
    /// Sparse prefill (`engine::sparse`): the prompt is thinned to its highest-scoring positions, and
    /// the scoring pass runs the model's first layers over the whole prompt.
    pub sparse_prefill: bool,
    /// Block-sparse attention over each query's history (`kv::sparse`).
    pub sparse_attention: bool,
    /// A StreamingLLM window over every sequence's keys and values (`kv::window`).
    pub kv_window: bool,
    /// A recurrent state kept at block ends for the prefix cache (`kv::conv_state`): the engine must
    /// snapshot it (`EngineConfig::state_snapshot_every` at least 1).
    pub state_snapshots: bool,
    /// Input other than text (images, audio): none of reckon's architectures reads any yet.
    pub images: bool,
    /// Why the features marked false are missing, for the refusal's text: names the architecture
    /// ("lfm2 has ...").
    pub limitation: &'static str,
}

impl Capabilities {
    /// A decoder-only transformer over the paged KV: every KV feature, text only.
    pub const TRANSFORMER: Capabilities = Capabilities {
        speculation: true,
        sparse_prefill: true,
        sparse_attention: true,
        kv_window: true,
        state_snapshots: false,
        images: false,
        limitation: "its architecture reads text only",
    };

    /// The first feature of `wanted` (whether it is asked for, and which) that this model lacks, and
    /// the refusal's text: the feature and the reason.
    pub fn refuse(&self, wanted: &[(bool, Feature)]) -> Option<(Feature, String)> {
        let &(_, f) = wanted.iter().find(|(asked, f)| *asked && !self.supports(*f))?;
        Some((f, format!("{} is not available for this model: {}", f.name(), self.limitation)))
    }

    pub fn supports(&self, f: Feature) -> bool {
        match f {
            Feature::Speculation | Feature::Prediction => self.speculation,
            Feature::SparsePrefill => self.sparse_prefill,
            Feature::SparseAttention => self.sparse_attention,
            Feature::KvWindow => self.kv_window,
            Feature::Images => self.images,
        }
    }
}

/// A feature an engine option or a request may ask for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Feature {
    Speculation,
    /// A request's `prediction` (speculation over the client's guess).
    Prediction,
    SparsePrefill,
    SparseAttention,
    KvWindow,
    Images,
}

impl Feature {
    pub fn name(self) -> &'static str {
        match self {
            Feature::Speculation => "speculative decoding",
            Feature::Prediction => "a prediction (speculative decoding over the client's guess)",
            Feature::SparsePrefill => "sparse prefill",
            Feature::SparseAttention => "sparse attention",
            Feature::KvWindow => "a KV window",
            Feature::Images => "image input",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_names_the_first_missing_feature_and_why() {
        let recurrent = Capabilities { speculation: false, sparse_prefill: false, limitation: "it has recurrent layers", ..Capabilities::TRANSFORMER };
        assert_eq!(recurrent.refuse(&[(false, Feature::Speculation), (true, Feature::KvWindow)]), None);
        let (f, m) = recurrent.refuse(&[(true, Feature::KvWindow), (true, Feature::Prediction)]).unwrap();
        assert_eq!(f, Feature::Prediction);
        assert_eq!(m, "a prediction (speculative decoding over the client's guess) is not available for this model: it has recurrent layers");
        assert!(Capabilities::TRANSFORMER.refuse(&[(true, Feature::Speculation), (true, Feature::SparsePrefill)]).is_none());
        assert!(Capabilities::TRANSFORMER.refuse(&[(true, Feature::Images)]).is_some());
    }
}

//! Every check a generation request gets, in one place (TGI's validation): an API turns its wire request
//! into `GenerateParams`, `EngineHandle::submit` checks them against the engine's limits, and only a
//! `ValidatedRequest` reaches the engine. A refusal is a `RequestError` naming the field at fault, which
//! the server maps to its API's status, `param` and message in one function. Below this point the
//! engine's own consistency checks are `debug_assert!`s.

use crate::model::{Capabilities, Feature};
use crate::sampler::SamplingParams;

/// A generation as an API asks for it, before any check.
#[derive(Clone, Debug)]
pub struct GenerateParams {
    /// Token ids (the API applies the chat template and tokenizes).
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Generated tokens at most; `None`: as many as the context leaves. A larger value is clamped to
    /// what the context leaves (agents ask for 32,000 whatever the model).
    pub max_new_tokens: Option<usize>,
    /// Strings that end the generation; the text before the first one is returned.
    pub stop: Vec<String>,
    /// Tokens that end the generation besides the model's end-of-generation tokens.
    pub stop_token_ids: Vec<u32>,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// Return the chosen token's log-probability and this many alternatives per token.
    pub logprobs: Option<usize>,
    /// Share prefix-cache blocks only with requests carrying the same salt (vLLM's `cache_salt`).
    pub cache_salt: Option<String>,
    /// A compiled grammar the answer must match (structured output, forced tool arguments).
    pub constraint: Option<crate::grammar::Constraint>,
    /// The client's guess of the output, as tokens (OpenAI's `prediction`): the n-gram proposer of
    /// speculative decoding also searches it (`engine::spec`).
    pub prediction: Vec<u32>,
    /// Sparse prefill for this request (`engine::sparse`), over the engine's setting; `None`: the engine's.
    pub spec_prefill: Option<super::sparse::SpecPrefillChoice>,
    /// A cap on the tokens spent reasoning (`engine::reasoning`); such a request does not speculate.
    pub reasoning_budget: Option<super::reasoning::ReasoningBudget>,
}

impl GenerateParams {
    pub fn greedy(prompt: Vec<u32>, max_new_tokens: usize) -> Self {
        GenerateParams {
            prompt,
            sampling: SamplingParams::greedy(),
            max_new_tokens: Some(max_new_tokens),
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            cache_salt: None,
            constraint: None,
            prediction: Vec::new(),
            spec_prefill: None,
            reasoning_budget: None,
        }
    }
}

/// What the engine can take; fixed at start-up.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Longest sequence, prompt and output together.
    pub max_model_len: usize,
    pub vocab_size: usize,
    /// Tokens the whole KV cache holds (blocks × block size).
    pub kv_cache_tokens: usize,
    pub block_size: usize,
    /// How many blocks a sequence holds.
    pub held: HeldBlocks,
    /// What the model's architecture can run (`model::capabilities`): a request's option that needs
    /// more is refused here, naming the option.
    pub capabilities: Capabilities,
}

/// The blocks a sequence holds at once: in each of `full_groups` layer groups one per `block_size`
/// positions; in each of `capped_groups` (a KV window's, or a hybrid layout's sliding groups) at most
/// `cap` (`KvWindow::max_blocks`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldBlocks {
    pub full_groups: usize,
    pub capped_groups: usize,
    pub cap: usize,
}

impl HeldBlocks {
    /// One group of every layer, no window.
    pub const ONE_GROUP: HeldBlocks = HeldBlocks { full_groups: 1, capped_groups: 0, cap: 0 };

    /// Blocks held by a sequence of `len` positions.
    pub fn blocks(&self, len: usize, block_size: usize) -> usize {
        let all = len.div_ceil(block_size);
        self.full_groups * all + self.capped_groups * all.min(self.cap)
    }
}

/// Most stop strings a request may give (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;
/// Most alternatives per token a request may ask log-probabilities for (OpenAI's chat limit).
pub const MAX_LOGPROBS: usize = 20;

/// The request field a refusal is about; each API names it its own way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Field {
    Prompt,
    MaxTokens,
    Stop,
    StopTokenIds,
    Temperature,
    TopP,
    TopK,
    MinP,
    RepetitionPenalty,
    PresencePenalty,
    FrequencyPenalty,
    Logprobs,
    CacheSalt,
    SpecPrefill,
    Prediction,
    ReasoningBudget,
}

/// Why a request was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RequestError {
    /// A value no engine with these limits could serve; `message` states the limit and the given value.
    #[error("{message}")]
    Invalid { field: Field, message: String },
    /// The waiting queue is full; the client should retry later.
    #[error("{waiting} requests are already waiting (the limit); retry shortly")]
    QueueFull { waiting: usize },
    /// The server is draining before it stops.
    #[error("the server is shutting down and takes no new requests")]
    ShuttingDown,
    #[error("the engine has stopped")]
    Stopped,
    /// The engine failed (`EngineHandle::failure` says why): nothing is served until a restart.
    #[error("{0}")]
    Failed(String),
}

impl RequestError {
    fn invalid(field: Field, message: String) -> Self {
        RequestError::Invalid { field, message }
    }
}

/// Checked against the engine's limits; only `validate` makes one.
#[derive(Clone, Debug)]
pub struct ValidatedRequest(GenerateParams);

impl ValidatedRequest {
    pub fn prompt_len(&self) -> usize {
        self.0.prompt.len()
    }

    /// Generated tokens allowed, clamped to what the context leaves.
    pub fn max_new_tokens(&self) -> usize {
        self.0.max_new_tokens.expect("set by validate")
    }

    pub fn cache_salt(&self) -> Option<&str> {
        self.0.cache_salt.as_deref()
    }

    pub(crate) fn into_params(self) -> GenerateParams {
        self.0
    }

    #[cfg(test)]
    pub(crate) fn unchecked(params: GenerateParams) -> Self {
        ValidatedRequest(params)
    }
}

/// Checks `p` against `limits`; sets `max_new_tokens` to what it may generate.
pub fn validate(mut p: GenerateParams, limits: &Limits) -> Result<ValidatedRequest, RequestError> {
    let (n, max_len) = (p.prompt.len(), limits.max_model_len);
    let prompt = |m: String| Err(RequestError::invalid(Field::Prompt, m));
    if n == 0 {
        return prompt("the prompt is empty".into());
    }
    if n >= max_len {
        return prompt(format!("this model's maximum context length is {max_len} tokens; the prompt has {n} tokens"));
    }
    if let Some(&bad) = p.prompt.iter().find(|&&t| t as usize >= limits.vocab_size) {
        return prompt(format!("token id {bad} is outside the vocabulary ({} tokens)", limits.vocab_size));
    }
    // The prompt and one generated token must fit the whole KV cache (the scheduler's admission test);
    // under a window or in sliding layer groups, the blocks a sequence holds at once.
    let blocks = limits.held.blocks(n + 1, limits.block_size);
    if blocks * limits.block_size > limits.kv_cache_tokens {
        return prompt(format!("the prompt has {n} tokens; the KV cache holds {} tokens in all (raise --kv-memory)", limits.kv_cache_tokens));
    }
    let room = max_len - n;
    p.max_new_tokens = match p.max_new_tokens {
        Some(0) => return Err(RequestError::invalid(Field::MaxTokens, "max_tokens must be at least 1. Given: 0".into())),
        Some(m) => Some(m.min(room)),
        None => Some(room),
    };
    if p.stop.len() > MAX_STOP_STRINGS {
        return Err(RequestError::invalid(Field::Stop, format!("at most {MAX_STOP_STRINGS} stop sequences are allowed. Given: {}", p.stop.len())));
    }
    if let Some(&bad) = p.stop_token_ids.iter().find(|&&t| t as usize >= limits.vocab_size) {
        return Err(RequestError::invalid(Field::StopTokenIds, format!("stop token id {bad} is outside the vocabulary ({} tokens)", limits.vocab_size)));
    }
    if let Some(k) = p.logprobs.filter(|&k| k > MAX_LOGPROBS) {
        return Err(RequestError::invalid(Field::Logprobs, format!("at most {MAX_LOGPROBS} log-probability alternatives per token. Given: {k}")));
    }
    if p.cache_salt.as_deref() == Some("") {
        return Err(RequestError::invalid(Field::CacheSalt, "cache_salt must not be empty".into()));
    }
    if let Some(super::sparse::SpecPrefillChoice::Keep(k)) = p.spec_prefill {
        if !(k > 0.0 && k <= 1.0) {
            return Err(RequestError::invalid(Field::SpecPrefill, format!("spec_prefill keep must be in (0, 1]. Given: {k}")));
        }
    }
    if p.reasoning_budget.as_ref().is_some_and(|b| b.close.is_empty() || b.open.is_empty()) {
        return Err(RequestError::invalid(Field::ReasoningBudget, "a reasoning budget needs the tokens that open and close the reasoning block".into()));
    }
    // what the architecture cannot run (a recurrent state that is not rolled back) is refused here, once
    let wanted = [
        (!p.prediction.is_empty(), Feature::Prediction),
        (matches!(p.spec_prefill, Some(super::sparse::SpecPrefillChoice::Keep(_))), Feature::SparsePrefill),
    ];
    if let Some((f, m)) = limits.capabilities.refuse(&wanted) {
        let field = if f == Feature::Prediction { Field::Prediction } else { Field::SpecPrefill };
        return Err(RequestError::invalid(field, m));
    }
    check_sampling(&p.sampling)?;
    Ok(ValidatedRequest(p))
}

/// Rejects values that would make sampling undefined, naming the parameter, the limit and the value.
fn check_sampling(s: &SamplingParams) -> Result<(), RequestError> {
    let check = |ok: bool, field: Field, m: String| if ok { Ok(()) } else { Err(RequestError::invalid(field, m)) };
    check(s.temperature.is_finite() && s.temperature >= 0.0, Field::Temperature, format!("temperature must be >= 0. Given: {}", s.temperature))?;
    check(s.top_p > 0.0 && s.top_p <= 1.0, Field::TopP, format!("top_p must be in (0, 1]. Given: {}", s.top_p))?;
    check((0.0..=1.0).contains(&s.min_p), Field::MinP, format!("min_p must be in [0, 1]. Given: {}", s.min_p))?;
    let rp = s.repetition_penalty;
    check(rp.is_finite() && rp > 0.0, Field::RepetitionPenalty, format!("repetition_penalty must be > 0. Given: {rp}"))?;
    check((-2.0..=2.0).contains(&s.presence_penalty), Field::PresencePenalty, format!("presence_penalty must be in [-2, 2]. Given: {}", s.presence_penalty))?;
    check((-2.0..=2.0).contains(&s.frequency_penalty), Field::FrequencyPenalty, format!("frequency_penalty must be in [-2, 2]. Given: {}", s.frequency_penalty))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits { max_model_len: 64, vocab_size: 100, kv_cache_tokens: 48, block_size: 16, held: HeldBlocks::ONE_GROUP, capabilities: Capabilities::TRANSFORMER };

    fn field_of(p: GenerateParams) -> Field {
        match validate(p, &LIMITS) {
            Err(RequestError::Invalid { field, .. }) => field,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn each_refusal_names_its_field() {
        let ok = || GenerateParams::greedy(vec![1, 2, 3], 10);
        assert_eq!(field_of(GenerateParams { prompt: vec![], ..ok() }), Field::Prompt);
        assert_eq!(field_of(GenerateParams { prompt: vec![1; 64], ..ok() }), Field::Prompt);
        assert_eq!(field_of(GenerateParams { prompt: vec![100], ..ok() }), Field::Prompt);
        assert_eq!(field_of(GenerateParams { prompt: vec![1; 48], ..ok() }), Field::Prompt, "48 + 1 tokens need 4 blocks of the 3");
        assert_eq!(field_of(GenerateParams { max_new_tokens: Some(0), ..ok() }), Field::MaxTokens);
        assert_eq!(field_of(GenerateParams { stop: vec!["a".into(); 5], ..ok() }), Field::Stop);
        assert_eq!(field_of(GenerateParams { stop_token_ids: vec![100], ..ok() }), Field::StopTokenIds);
        assert_eq!(field_of(GenerateParams { logprobs: Some(21), ..ok() }), Field::Logprobs);
        assert_eq!(field_of(GenerateParams { cache_salt: Some(String::new()), ..ok() }), Field::CacheSalt);
        let sampling = |s: SamplingParams| GenerateParams { sampling: s, ..ok() };
        assert_eq!(field_of(sampling(SamplingParams { temperature: -1.0, ..SamplingParams::greedy() })), Field::Temperature);
        assert_eq!(field_of(sampling(SamplingParams { top_p: 0.0, ..SamplingParams::greedy() })), Field::TopP);
        assert_eq!(field_of(sampling(SamplingParams { min_p: 2.0, ..SamplingParams::greedy() })), Field::MinP);
        assert_eq!(field_of(sampling(SamplingParams { repetition_penalty: f32::NAN, ..SamplingParams::greedy() })), Field::RepetitionPenalty);
        assert_eq!(field_of(sampling(SamplingParams { presence_penalty: 3.0, ..SamplingParams::greedy() })), Field::PresencePenalty);
        assert_eq!(field_of(sampling(SamplingParams { frequency_penalty: -3.0, ..SamplingParams::greedy() })), Field::FrequencyPenalty);
    }

    #[test]
    fn what_the_architecture_cannot_run_is_refused_naming_the_option() {
        let recurrent = Limits { capabilities: Capabilities { speculation: false, sparse_prefill: false, limitation: "recurrent", ..Capabilities::TRANSFORMER }, ..LIMITS };
        let ok = || GenerateParams::greedy(vec![1, 2, 3], 10);
        let refused = |p: GenerateParams| match validate(p, &recurrent) {
            Err(RequestError::Invalid { field, message }) => (field, message),
            other => panic!("expected a refusal, got {other:?}"),
        };
        let (field, message) = refused(GenerateParams { prediction: vec![5, 6], ..ok() });
        assert_eq!(field, Field::Prediction);
        assert!(message.contains("prediction") && message.ends_with("recurrent"), "{message}");
        let keep = Some(crate::engine::sparse::SpecPrefillChoice::Keep(0.5));
        assert_eq!(refused(GenerateParams { spec_prefill: keep, ..ok() }).0, Field::SpecPrefill);
        // turning a feature off is always allowed, and the same requests pass a transformer
        assert!(validate(GenerateParams { spec_prefill: Some(crate::engine::sparse::SpecPrefillChoice::Off), ..ok() }, &recurrent).is_ok());
        assert!(validate(GenerateParams { prediction: vec![5, 6], spec_prefill: keep, ..ok() }, &LIMITS).is_ok());
    }

    #[test]
    fn max_tokens_is_clamped_to_the_context() {
        let v = validate(GenerateParams::greedy(vec![1; 10], 32_000), &LIMITS).unwrap();
        assert_eq!(v.max_new_tokens(), 54);
        let v = validate(GenerateParams { max_new_tokens: None, ..GenerateParams::greedy(vec![1; 10], 1) }, &LIMITS).unwrap();
        assert_eq!(v.max_new_tokens(), 54);
        let v = validate(GenerateParams::greedy(vec![1; 10], 5), &LIMITS).unwrap();
        assert_eq!(v.max_new_tokens(), 5);
    }
}

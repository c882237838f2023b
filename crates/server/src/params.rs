//! The generation parameters chat and text completions share, with OpenAI's names and defaults, turned
//! into the engine's `GenerateParams` (which the engine validates).

use crate::error::ApiError;
use crate::AppState;
use reckon_engine::engine::GenerateParams;
use reckon_engine::sampler::SamplingParams;
use serde::Deserialize;
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Debug, Deserialize)]
pub struct CommonParams {
    pub model: String,
    #[serde(default)]
    pub stream: bool,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub n: Option<usize>,
    pub stop: Option<Stop>,
    pub stream_options: Option<StreamOptions>,
    /// vLLM's and llama-server's extension: keep generating past end-of-generation tokens (benchmarks).
    #[serde(default)]
    pub ignore_eos: bool,
    /// vLLM's extension: requests share prefix-cache blocks only with requests of the same salt (so a
    /// tenant cannot learn another's prompts from cache-hit timing).
    pub cache_salt: Option<String>,
    /// OpenAI's predicted output (`{"type": "content", "content": "..."}`, or content parts of type
    /// `text`): the client's guess of the answer, which speculative decoding checks in bulk.
    pub prediction: Option<serde_json::Value>,
    /// reckon's own extensions (`reckon_extension`).
    pub reckon: Option<serde_json::Value>,
}

/// reckon's extension object, the same on every API: `{"spec_prefill": false}` (no sparse prefill for
/// this request) or `{"spec_prefill": {"keep": 0.3}}` (this keep ratio; docs/spec-prefill.md). Anything
/// else is refused.
pub fn reckon_extension(v: Option<&serde_json::Value>) -> Result<Option<reckon_engine::engine::sparse::SpecPrefillChoice>, ApiError> {
    use reckon_engine::engine::sparse::SpecPrefillChoice;
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok(None) };
    let obj = v.as_object().ok_or_else(|| ApiError::invalid("reckon must be an object", Some("reckon")))?;
    if let Some(k) = obj.keys().find(|k| *k != "spec_prefill") {
        return Err(ApiError::invalid(format!("reckon.{k}: unknown field (known: spec_prefill)"), Some("reckon")));
    }
    let bad = || ApiError::invalid("reckon.spec_prefill must be false or {\"keep\": a number in (0, 1]}", Some("reckon.spec_prefill"));
    match obj.get("spec_prefill") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::Bool(false)) => Ok(Some(SpecPrefillChoice::Off)),
        Some(serde_json::Value::Object(o)) if o.len() == 1 => Ok(Some(SpecPrefillChoice::Keep(o.get("keep").and_then(|k| k.as_f64()).ok_or_else(bad)?))),
        Some(_) => Err(bad()),
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

impl CommonParams {
    /// The engine's parameters for an already tokenized prompt. The engine validates them (prompt,
    /// limits, sampling ranges); here only what is OpenAI's own: the model name, `n`, and the temperature
    /// range.
    pub fn to_params(&self, state: &AppState, prompt: Vec<u32>) -> Result<GenerateParams, ApiError> {
        if !state.serves(&self.model) {
            return Err(state.unknown_model(&self.model));
        }
        if self.n.unwrap_or(1) != 1 {
            return Err(ApiError::invalid(format!("only n = 1 is supported. Given: {}", self.n.unwrap_or(1)), Some("n")));
        }
        Ok(GenerateParams {
            prompt,
            sampling: self.sampling()?,
            max_new_tokens: self.max_completion_tokens.or(self.max_tokens),
            stop: self.stops(),
            stop_token_ids: Vec::new(),
            ignore_eos: self.ignore_eos,
            logprobs: None,
            cache_salt: self.cache_salt.clone(),
            constraint: None,
            prediction: self.prediction_tokens(state)?,
            spec_prefill: reckon_extension(self.reckon.as_ref())?,
        })
    }

    /// The prediction's text as tokens (no BOS), or none.
    fn prediction_tokens(&self, state: &AppState) -> Result<Vec<u32>, ApiError> {
        let Some(p) = self.prediction.as_ref().filter(|p| !p.is_null()) else { return Ok(Vec::new()) };
        let bad = || ApiError::invalid("prediction must be {\"type\": \"content\", \"content\": a string or text parts}", Some("prediction"));
        if p.get("type").and_then(|t| t.as_str()) != Some("content") {
            return Err(bad());
        }
        let text = match p.get("content") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(serde_json::Value::Array(parts)) => {
                let texts: Option<Vec<&str>> = parts.iter().map(|part| (part.get("type")?.as_str()? == "text").then(|| part.get("text")?.as_str()).flatten()).collect();
                texts.ok_or_else(bad)?.concat()
            }
            _ => return Err(bad()),
        };
        state.tokenizer.encode(&text, false, false).map_err(|e| ApiError::invalid(e.to_string(), Some("prediction")))
    }

    fn sampling(&self) -> Result<SamplingParams, ApiError> {
        if let Some(t) = self.temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(ApiError::invalid(format!("temperature must be between 0 and 2. Given: {t}"), Some("temperature")));
            }
        }
        // OpenAI's defaults: temperature 1, top_p 1, no top-k or min-p, no repetition penalty.
        Ok(SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_k: 0,
            top_p: self.top_p.unwrap_or(1.0),
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            penalty_last_n: 0,
            seed: self.seed.unwrap_or_else(clock_seed),
        })
    }

    fn stops(&self) -> Vec<String> {
        match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        }
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options.as_ref().is_some_and(|o| o.include_usage)
    }
}

pub fn clock_seed() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

pub fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

//! The generation parameters chat and text completions share, with OpenAI's names (and vLLM's and
//! llama-server's sampling extensions), turned into the engine's `GenerateParams` (which the engine
//! validates). A sampling field a request omits takes the server's default (`SamplingDefaults`), not
//! OpenAI's temperature 1 with no cuts: that made a small model's first answer near gibberish.

use crate::error::ApiError;
use crate::AppState;
use reckon_engine::engine::GenerateParams;
use reckon_engine::grammar::Grammar;
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
    /// vLLM's and llama-server's sampling extensions: -1 or 0 disables top-k.
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    /// vLLM's name; llama-server's `repeat_penalty` is taken too.
    #[serde(alias = "repeat_penalty")]
    pub repetition_penalty: Option<f32>,
    /// llama-server's: the tokens the penalties look back over; -1 is all of them, 0 turns them off.
    pub repeat_last_n: Option<i64>,
    /// vLLM's: token ids that end the answer (as an end-of-generation token does).
    pub stop_token_ids: Option<Vec<u32>>,
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
    /// Every other field, checked against the API's known fields (`fields`): a sampling field reckon
    /// has no sampler for, or a field no one has decided on, is refused rather than ignored.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

/// What a request that omits a sampling field gets: `reckon serve`'s flags over the model file's
/// recommendation (`general.sampling.*`) over llama.cpp's defaults, the same values `reckon run` uses;
/// and the seed of a request without one (`--seed`, else the clock).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingDefaults {
    pub params: SamplingParams,
    pub seed: Option<u64>,
}

/// A request's sampling fields, each API's by its own names; what it omits comes from `SamplingDefaults`.
#[derive(Clone, Debug, Default)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_k: Option<i64>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// llama-server's `repeat_last_n`: -1 all, 0 penalties off.
    pub repeat_last_n: Option<i64>,
    pub seed: Option<u64>,
}

impl SamplingFields {
    /// The engine's sampling parameters (the engine checks their ranges).
    pub fn resolve(&self, defaults: &SamplingDefaults) -> SamplingParams {
        let d = &defaults.params;
        let mut p = SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.map_or(d.top_k, |k| k.max(0) as usize),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            penalty_last_n: match self.repeat_last_n {
                None => d.penalty_last_n,
                Some(n) => n.max(0) as usize,
            },
            seed: self.seed.or(defaults.seed).unwrap_or_else(clock_seed),
        };
        if self.repeat_last_n == Some(0) {
            // llama-server: penalties over no tokens are no penalties
            (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) = (1.0, 0.0, 0.0);
        }
        p
    }
}

/// vLLM's structured output (`structured_outputs`: `json`, `json_object`, `regex`, `choice`, `grammar`)
/// and its older `guided_*` fields, and llama-server's `json_schema`, as one grammar for llguidance,
/// with the field it came from (for errors). `grammar` is llguidance's Lark dialect (what vLLM's
/// guidance backend takes; a GBNF grammar is refused by the compiler with its error). More than one
/// source is a 400: which one would win is not the client's guess to make.
pub fn structured_outputs(other: &serde_json::Map<String, serde_json::Value>) -> Result<Option<(Grammar, &'static str)>, ApiError> {
    use serde_json::Value;
    const FIELDS: [&str; 6] = ["structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "json_schema"];
    let given: Vec<(&'static str, &Value)> = FIELDS.iter().filter_map(|&f| other.get(f).filter(|v| !v.is_null()).map(|v| (f, v))).collect();
    let (field, value) = match given.as_slice() {
        [] => return Ok(None),
        [one] => *one,
        many => return Err(ApiError::invalid(format!("give one structured-output field, not {}", many.iter().map(|(f, _)| *f).collect::<Vec<_>>().join(" and ")), Some(many[1].0))),
    };
    let (kind, spec) = match field {
        "structured_outputs" => {
            let obj = value.as_object().ok_or_else(|| ApiError::invalid("structured_outputs must be an object: {\"json\" | \"json_object\" | \"regex\" | \"choice\" | \"grammar\": ...}", Some(field)))?;
            let set: Vec<(&String, &Value)> = obj.iter().filter(|(_, v)| !v.is_null() && **v != Value::Bool(false)).collect();
            match set.as_slice() {
                [(k, v)] => (k.as_str(), *v),
                [] => return Ok(None),
                _ => return Err(ApiError::invalid(format!("structured_outputs: give one of json, json_object, regex, choice, grammar. Given: {}", set.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(", ")), Some(field))),
            }
        }
        "guided_json" | "json_schema" => ("json", value),
        f => (&f["guided_".len()..], value),
    };
    let bad = |m: &str| ApiError::invalid(format!("{field}: {m}"), Some(field));
    let grammar = match (kind, spec) {
        ("json", Value::String(s)) => Grammar::JsonSchema(serde_json::from_str(s).map_err(|e| bad(&format!("the schema is not JSON: {e}")))?),
        ("json", v @ (Value::Object(_) | Value::Bool(_))) => Grammar::JsonSchema(v.clone()),
        ("json_object", Value::Bool(true)) => Grammar::JsonSchema(serde_json::json!({"type": "object"})),
        ("regex", Value::String(r)) => Grammar::Lark(format!("start: /{}/", r.replace('/', "\\/"))),
        ("choice", Value::Array(options)) if !options.is_empty() => {
            let options: Option<Vec<String>> = options.iter().map(|o| o.as_str().map(|s| Value::from(s).to_string())).collect();
            Grammar::Lark(format!("start: {}", options.ok_or_else(|| bad("choice must be a list of strings"))?.join(" | ")))
        }
        ("grammar", Value::String(g)) => Grammar::Lark(g.clone()),
        ("json" | "json_object" | "regex" | "choice" | "grammar", _) => return Err(bad(&format!("{kind}: not a valid value"))),
        (other, _) => return Err(bad(&format!("'{other}' is not supported (json, json_object, regex, choice, grammar)"))),
    };
    Ok(Some((grammar, field)))
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
        crate::fields::check(crate::fields::Api::OpenAi, &self.other)?;
        Ok(GenerateParams {
            prompt,
            sampling: self.sampling(&state.sampling)?,
            max_new_tokens: self.max_completion_tokens.or(self.max_tokens),
            stop: self.stops(),
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos,
            logprobs: None,
            cache_salt: self.cache_salt.clone(),
            constraint: None,
            prediction: self.prediction_tokens(state)?,
            spec_prefill: reckon_extension(self.reckon.as_ref())?,
            reasoning_budget: None,
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

    fn sampling(&self, defaults: &SamplingDefaults) -> Result<SamplingParams, ApiError> {
        if let Some(t) = self.temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(ApiError::invalid(format!("temperature must be between 0 and 2. Given: {t}"), Some("temperature")));
            }
        }
        let fields = SamplingFields {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed,
        };
        Ok(fields.resolve(defaults))
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

//! The top-level request fields each API knows, in one place: a field is read (the request structs in
//! chat.rs, params.rs, responses.rs and messages.rs), accepted with no effect (listed here with why),
//! or accepted only at its neutral value (listed here with what reckon has instead). Any other field is a
//! 400 naming it: the next field a client starts to send is refused until someone decides what it
//! means here, rather than dropped in silence. The lists include every field the pinned agents send
//! (Codex CLI 0.171.0 on Responses, Claude Code 2.1.332 on Messages; captured from their requests) and
//! the ones their code can send in other situations.

use crate::error::ApiError;
use serde_json::{Map, Value};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// Chat and text completions (their extra fields are OpenAI's, vLLM's and llama-server's).
    OpenAi,
    Responses,
    Messages,
}

/// The values a field may take when reckon has no use for it.
#[derive(Clone, Copy, Debug)]
enum Neutral {
    /// null, false, an empty array, object or string, or one of these numbers.
    Falsy(&'static [f64]),
    /// null or true (a switch that is on by default).
    Truthy,
    /// null or this string.
    Exactly(&'static str),
    /// null or `["text"]`.
    TextOnly,
}

/// Fields taken only at their neutral value, with what reckon has instead.
const OPENAI_NEUTRAL: &[(&str, Neutral, &str)] = &[
    ("logit_bias", Neutral::Falsy(&[]), "no logit bias"),
    ("typical_p", Neutral::Falsy(&[1.0]), "no typical sampling"),
    ("tfs_z", Neutral::Falsy(&[1.0]), "no tail-free sampling"),
    ("mirostat", Neutral::Falsy(&[0.0]), "no mirostat"),
    ("dry_multiplier", Neutral::Falsy(&[0.0]), "no DRY penalty"),
    ("xtc_probability", Neutral::Falsy(&[0.0]), "no XTC sampler"),
    ("top_n_sigma", Neutral::Falsy(&[-1.0, 0.0]), "no top-n-sigma"),
    ("dynatemp_range", Neutral::Falsy(&[0.0]), "no dynamic temperature"),
    ("min_tokens", Neutral::Falsy(&[0.0]), "no min_tokens"),
    ("use_beam_search", Neutral::Falsy(&[0.0]), "no beam search"),
    ("best_of", Neutral::Falsy(&[1.0]), "no best_of"),
    ("length_penalty", Neutral::Falsy(&[1.0]), "no beam search (length_penalty)"),
    ("bad_words", Neutral::Falsy(&[]), "no bad_words"),
    ("allowed_token_ids", Neutral::Falsy(&[]), "no allowed_token_ids"),
    ("samplers", Neutral::Falsy(&[]), "a fixed sampler order (penalties, top-k, top-p, min-p, temperature)"),
    ("grammar", Neutral::Falsy(&[]), "no GBNF grammars: structured_outputs.grammar takes llguidance's Lark, response_format a JSON schema"),
    ("echo", Neutral::Falsy(&[]), "no echo of the prompt in the answer"),
    ("suffix", Neutral::Falsy(&[]), "no fill-in-the-middle suffix"),
    ("functions", Neutral::Falsy(&[]), "tools (functions is their legacy form)"),
    ("function_call", Neutral::Falsy(&[]), "tool_choice (function_call is its legacy form)"),
    ("web_search_options", Neutral::Falsy(&[]), "no web search"),
    ("audio", Neutral::Falsy(&[]), "no audio output"),
    ("modalities", Neutral::TextOnly, "text output only"),
    ("verbosity", Neutral::Exactly("medium"), "no verbosity control"),
    ("skip_special_tokens", Neutral::Truthy, "special tokens always left out of the text"),
    ("spaces_between_special_tokens", Neutral::Truthy, "the tokenizer's own spacing"),
    ("add_generation_prompt", Neutral::Truthy, "the generation prompt always added"),
    ("continue_final_message", Neutral::Falsy(&[]), "a new assistant turn (no continuing the last one)"),
    ("include_stop_str_in_output", Neutral::Falsy(&[]), "the stop string left out of the answer"),
    ("return_tokens_as_token_ids", Neutral::Falsy(&[]), "tokens as text in logprobs"),
    ("truncate_prompt_tokens", Neutral::Falsy(&[]), "no prompt truncation (a long prompt is a 400)"),
    ("chat_template", Neutral::Falsy(&[]), "the model file's chat template"),
    ("documents", Neutral::Falsy(&[]), "no documents for the template"),
];

/// Fields accepted with no effect, and why that is right here.
const OPENAI_NO_EFFECT: &[(&str, &str)] = &[
    ("user", "an end-user id for a provider's abuse monitoring"),
    ("metadata", "tags for stored completions, which reckon does not keep"),
    ("store", "reckon keeps no completions"),
    ("service_tier", "one tier"),
    ("prompt_cache_key", "the prefix cache is automatic (a cluster router may route on it)"),
    ("prompt_cache_retention", "the prefix cache keeps blocks until memory (or the disk tier) needs them"),
    ("safety_identifier", "an end-user id for a provider's abuse monitoring"),
    ("request_id", "vLLM's request id for its logs"),
    ("priority", "vLLM's scheduling priority: reckon schedules first come, first served"),
    ("reasoning_effort", "passed to the chat template as `reasoning_effort` (templates that read it use it)"),
];

const RESPONSES_NEUTRAL: &[(&str, Neutral, &str)] = &[
    ("background", Neutral::Falsy(&[]), "answers in the foreground only"),
    ("truncation", Neutral::Exactly("disabled"), "no truncation (a long input is a 400)"),
    ("max_tool_calls", Neutral::Falsy(&[]), "no limit on tool calls"),
    ("top_logprobs", Neutral::Falsy(&[0.0]), "no log-probabilities on the Responses API"),
    ("conversation", Neutral::Falsy(&[]), "previous_response_id for multi-turn state"),
    ("prompt", Neutral::Falsy(&[]), "no stored prompt templates"),
];

const RESPONSES_NO_EFFECT: &[(&str, &str)] = &[
    ("include", "no encrypted reasoning or other extra output to include"),
    ("reasoning", "no reasoning-effort control; reasoning models answer with their own reasoning"),
    ("prompt_cache_key", "the prefix cache is automatic (a cluster router may route on it)"),
    ("prompt_cache_options", "the prefix cache is automatic"),
    ("prompt_cache_retention", "the prefix cache keeps blocks until memory (or the disk tier) needs them"),
    ("client_metadata", "the client's own ids (Codex's turn and thread)"),
    ("service_tier", "one tier"),
    ("user", "an end-user id for a provider's abuse monitoring"),
    ("safety_identifier", "an end-user id for a provider's abuse monitoring"),
    ("stream_options", "the stream's events are always the same"),
];

const MESSAGES_NEUTRAL: &[(&str, Neutral, &str)] = &[
    ("container", Neutral::Falsy(&[]), "no code-execution containers"),
    ("mcp_servers", Neutral::Falsy(&[]), "no MCP connector (a client runs its own MCP servers)"),
];

const MESSAGES_NO_EFFECT: &[(&str, &str)] = &[
    ("metadata", "the client's user id"),
    ("context_management", "no server-side context editing: the history is used as sent"),
    ("service_tier", "one tier"),
    ("cache_control", "the prefix cache is automatic"),
    ("context_hint", "no server-side context editing"),
    ("safeguards", "Claude Code's own settings for Anthropic's servers"),
    ("fallbacks", "one model"),
    ("program_use_case_id", "Claude Code's billing tag"),
    ("tags", "Claude Code's billing tags"),
    ("speed", "one speed"),
    ("thread", "Claude Code's thread id"),
    ("diagnostics", "Claude Code's diagnostics"),
    ("data_flow", "Claude Code's data-flow tag"),
    ("inference_geo", "one place"),
];

/// Checks the fields a request struct did not read (`other`) against `api`'s lists.
pub fn check(api: Api, other: &Map<String, Value>) -> Result<(), ApiError> {
    let (neutral, no_effect, structured): (&[(&str, Neutral, &str)], &[(&str, &str)], &[&str]) = match api {
        Api::OpenAi => (OPENAI_NEUTRAL, OPENAI_NO_EFFECT, &["structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "json_schema"]),
        Api::Responses => (RESPONSES_NEUTRAL, RESPONSES_NO_EFFECT, &[]),
        Api::Messages => (MESSAGES_NEUTRAL, MESSAGES_NO_EFFECT, &[]),
    };
    for (name, v) in other {
        if no_effect.iter().any(|(n, _)| n == name) || structured.contains(&name.as_str()) {
            continue;
        }
        let Some(&(_, rule, instead)) = neutral.iter().find(|(n, ..)| n == name) else {
            return Err(ApiError::invalid(format!("unknown field '{name}': this server does not take it (docs/serving.md lists the fields each API takes)"), Some(name)));
        };
        let inert = match (rule, v) {
            (_, Value::Null) => true,
            (Neutral::Falsy(nums), v) => match v {
                Value::Bool(false) => true,
                Value::Array(a) => a.is_empty(),
                Value::Object(o) => o.is_empty(),
                Value::String(s) => s.is_empty(),
                Value::Number(n) => n.as_f64().is_some_and(|x| nums.contains(&x)),
                _ => false,
            },
            (Neutral::Truthy, v) => *v == Value::Bool(true),
            (Neutral::Exactly(s), v) => v.as_str() == Some(s),
            (Neutral::TextOnly, v) => *v == serde_json::json!(["text"]),
        };
        if !inert {
            let accepted = match rule {
                Neutral::Falsy([]) => "null, false or empty".to_string(),
                Neutral::Falsy(n) => n.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(" or "),
                Neutral::Truthy => "null or true".into(),
                Neutral::Exactly(s) => format!("null or \"{s}\""),
                Neutral::TextOnly => "null or [\"text\"]".into(),
            };
            return Err(ApiError::invalid(format!("{name} is not supported: reckon has {instead}. Given: {v}; accepted only as {accepted}"), Some(name)));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn known_fields_pass_and_others_are_named() {
        assert!(check(Api::OpenAi, &map(json!({"user": "u", "store": true, "skip_special_tokens": true, "modalities": ["text"], "typical_p": 1.0, "echo": false}))).is_ok());
        for (bad, param) in [(json!({"typical_p": 0.5}), "typical_p"), (json!({"skip_special_tokens": false}), "skip_special_tokens"), (json!({"modalities": ["text", "audio"]}), "modalities"), (json!({"frobnicate": 1}), "frobnicate")] {
            assert_eq!(check(Api::OpenAi, &map(bad)).unwrap_err().param.as_deref(), Some(param));
        }
        assert!(check(Api::Responses, &map(json!({"include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"}, "truncation": "disabled", "client_metadata": {}}))).is_ok());
        assert_eq!(check(Api::Responses, &map(json!({"truncation": "auto"}))).unwrap_err().param.as_deref(), Some("truncation"));
        assert!(check(Api::Messages, &map(json!({"metadata": {}, "context_management": {"edits": []}, "mcp_servers": []}))).is_ok());
        assert_eq!(check(Api::Messages, &map(json!({"echo": true}))).unwrap_err().param.as_deref(), Some("echo"));
    }

    /// The top-level fields the pinned agents send, as captured from their requests (the ones the
    /// request structs read are left out: they never reach `other`), and the ones their code sends in
    /// other situations: all accepted.
    #[test]
    fn the_pinned_agents_fields_are_known() {
        // Codex CLI 0.171.0: always, then with service_tier / effort / verbosity configured
        let codex = json!({"include": ["reasoning.encrypted_content"], "reasoning": {"effort": "high", "summary": "auto"}, "prompt_cache_key": "01a2", "client_metadata": {"turn_id": "t"},
                           "service_tier": "flex", "prompt_cache_options": {}, "stream_options": {}});
        assert!(check(Api::Responses, &map(codex)).is_ok());
        // Claude Code 2.1.332: always, then in other requests
        let claude = json!({"metadata": {"user_id": "{}"}, "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                            "context_hint": {"enabled": true}, "cache_control": {"type": "ephemeral"}, "safeguards": {}, "fallbacks": [], "program_use_case_id": "x",
                            "tags": [], "speed": "fast", "thread": "t", "diagnostics": {"previous_message_id": "m"}, "data_flow": "d"});
        assert!(check(Api::Messages, &map(claude)).is_ok());
    }
}

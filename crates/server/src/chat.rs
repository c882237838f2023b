//! `POST /v1/chat/completions` and `POST /v1/completions`: the request bodies, the chat template or the
//! raw prompt, then `respond::generate`.

use crate::error::ApiError;
use crate::params::CommonParams;
use crate::respond::{generate, Api};
use crate::AppState;
use axum::response::Response;
use reckon_engine::template::ChatMessage;
use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Vec<Message>,
    /// Return each token's log-probability (and `top_logprobs` alternatives).
    #[serde(default)]
    logprobs: bool,
    top_logprobs: Option<usize>,
    #[serde(flatten)]
    params: CommonParams,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: Content,
}

/// A message's content: a string, or a list of parts of which the text ones are used.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Value>),
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    prompt: Prompt,
    logprobs: Option<usize>,
    #[serde(flatten)]
    params: CommonParams,
}

/// A text prompt, or token ids.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// The request, or a 400 whose `param` names the field at fault: the first that does not parse on its own
/// beside the least a request needs (`skeleton`), else the missing one.
fn parse<T: serde::de::DeserializeOwned>(body: &[u8], skeleton: Value) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| {
        let message = e.to_string();
        let wrong = match serde_json::from_slice(body) {
            Ok(Value::Object(fields)) => fields.into_iter().find_map(|(k, v)| {
                let mut alone = skeleton.clone();
                alone[k.as_str()] = v;
                serde_json::from_value::<T>(alone).is_err().then_some(k)
            }),
            _ => None,
        };
        let missing = message.strip_prefix("missing field `").and_then(|m| m.split('`').next()).map(str::to_string);
        ApiError::invalid(format!("invalid request body: {message}"), wrong.or(missing).as_deref())
    })
}

fn chat_messages(messages: &[Message]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages must not be empty", Some("messages")));
    }
    messages
        .iter()
        .map(|m| {
            if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant") {
                return Err(ApiError::invalid(format!("unsupported role '{}': use system, user or assistant", m.role), Some("messages")));
            }
            let text = match &m.content {
                Content::Text(t) => t.clone(),
                Content::Parts(parts) => parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).collect::<Vec<_>>().join(""),
            };
            let role = if m.role == "developer" { "system" } else { m.role.as_str() };
            Ok(ChatMessage::new(role, &text))
        })
        .collect()
}

pub async fn chat_completions(state: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req: ChatRequest = parse(body, serde_json::json!({"model": "", "messages": []}))?;
    let text = state.template.render(&chat_messages(&req.messages)?, true).map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    let prompt = state.tokenizer.encode(&text, true, true).map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    let mut params = req.params.to_params(state, prompt)?;
    params.logprobs = match (req.logprobs, req.top_logprobs) {
        (false, Some(_)) => return Err(ApiError::invalid("top_logprobs needs logprobs: true", Some("top_logprobs"))),
        (true, k) => Some(k.unwrap_or(0)),
        (false, None) => None,
    };
    generate(state, Api::Chat, &req.params, params).await
}

pub async fn completions(state: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse(body, serde_json::json!({"model": "", "prompt": ""}))?;
    // Legacy completions: `logprobs` is the number of alternatives (0-5), as OpenAI.
    if let Some(k) = req.logprobs.filter(|&k| k > 5) {
        return Err(ApiError::invalid(format!("logprobs must be between 0 and 5. Given: {k}"), Some("logprobs")));
    }
    let prompt = match &req.prompt {
        // As llama-server: the model's BOS if it wants one; special tokens in the text are parsed.
        Prompt::Text(t) => state.tokenizer.encode(t, true, true).map_err(|e| ApiError::invalid(e.to_string(), Some("prompt")))?,
        Prompt::Tokens(ids) => ids.clone(),
    };
    let mut params = req.params.to_params(state, prompt)?;
    params.logprobs = req.logprobs;
    generate(state, Api::Completion, &req.params, params).await
}

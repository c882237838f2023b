//! `POST /v1/chat/completions`: validation (OpenAI's parameter names and limits), the chat template, then
//! the engine's token events as one JSON response or as server-sent events.

use crate::error::ApiError;
use crate::stop::{StopMatcher, StopOutcome};
use crate::AppState;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use reckon_engine::engine::{Event, FinishReason, GenerateRequest, Usage};
use reckon_engine::sampler::SamplingParams;
use reckon_engine::template::ChatMessage;
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedReceiver;

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Message>,
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
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Content,
}

/// A message's content: a string, or a list of parts of which the text ones are used.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Value>),
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

/// Tokens generated when the request does not say (as vLLM: up to the context).
const DEFAULT_MAX_TOKENS: usize = usize::MAX;

impl ChatRequest {
    fn messages(&self) -> Result<Vec<ChatMessage>, ApiError> {
        if self.messages.is_empty() {
            return Err(ApiError::invalid("messages must not be empty", Some("messages")));
        }
        self.messages
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

    fn sampling(&self) -> Result<SamplingParams, ApiError> {
        // OpenAI's defaults: temperature 1, top_p 1, no top-k or min-p.
        let p = SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_k: 0,
            top_p: self.top_p.unwrap_or(1.0),
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            penalty_last_n: 0,
            seed: self.seed.unwrap_or_else(clock_seed),
        };
        if let Some(t) = self.temperature {
            if !(0.0..=2.0).contains(&t) {
                return Err(ApiError::invalid(format!("temperature must be between 0 and 2; got {t}"), Some("temperature")));
            }
        }
        p.validate().map_err(|e| ApiError::invalid(e.to_string(), None))?;
        Ok(p)
    }

    fn stops(&self) -> Result<Vec<String>, ApiError> {
        let stops = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stops.len() > 4 {
            return Err(ApiError::invalid(format!("at most 4 stop sequences are allowed; got {}", stops.len()), Some("stop")));
        }
        Ok(stops)
    }
}

fn clock_seed() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub async fn chat_completions(state: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req: ChatRequest = serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("invalid request body: {e}"), None))?;
    if req.model != state.model_id {
        return Err(ApiError::not_found(format!("the model '{}' does not exist; this server serves '{}'", req.model, state.model_id), Some("model"), "model_not_found"));
    }
    if req.n.unwrap_or(1) != 1 {
        return Err(ApiError::invalid("only n = 1 is supported", Some("n")));
    }
    let max_tokens = req.max_completion_tokens.or(req.max_tokens).unwrap_or(DEFAULT_MAX_TOKENS);
    if max_tokens == 0 {
        return Err(ApiError::invalid("max_tokens must be at least 1", Some("max_tokens")));
    }
    let text = state.template.render(&req.messages()?, true).map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    let prompt = state.tokenizer.encode(&text, true, true).map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    let max_len = state.engine.config().max_model_len;
    if prompt.len() >= max_len {
        return Err(ApiError::invalid(
            format!("this model's maximum context length is {max_len} tokens; the messages have {} tokens", prompt.len()),
            Some("messages"),
        ));
    }
    let gen = GenerateRequest {
        prompt,
        sampling: req.sampling()?,
        max_new_tokens: max_tokens,
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        logprobs: None,
    };
    let stops = StopMatcher::new(req.stops()?);
    let (id, events) = state.engine.submit(gen)?;
    let meta = Meta { id: format!("chatcmpl-{id}"), created: unix_now(), model: state.model_id.clone() };
    if req.stream {
        let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
        Ok(stream(state.clone(), id, events, stops, meta, include_usage).into_response())
    } else {
        Ok(Json(collect(state, id, events, stops, &meta).await?).into_response())
    }
}

struct Meta {
    id: String,
    created: u64,
    model: String,
}

fn finish_str(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop | FinishReason::Abort => "stop",
        FinishReason::Length => "length",
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
    })
}

/// The whole answer as one response.
async fn collect(state: &AppState, id: u64, mut events: UnboundedReceiver<Event>, mut stops: StopMatcher, meta: &Meta) -> Result<Value, ApiError> {
    let mut text = String::new();
    let mut stopped_by_string = false;
    while let Some(ev) = events.recv().await {
        match ev {
            Event::Token { text: delta, .. } if !stopped_by_string => match stops.push(&delta) {
                StopOutcome::Continue(t) => text.push_str(&t),
                StopOutcome::Stopped(t) => {
                    text.push_str(&t);
                    stopped_by_string = true;
                    state.engine.abort(id);
                }
            },
            Event::Token { .. } => {}
            Event::Finished { reason, usage, .. } => {
                let reason = if stopped_by_string {
                    "stop"
                } else {
                    text.push_str(&stops.finish());
                    finish_str(reason)
                };
                return Ok(json!({
                    "id": meta.id, "object": "chat.completion", "created": meta.created, "model": meta.model,
                    "choices": [{ "index": 0, "message": { "role": "assistant", "content": text }, "finish_reason": reason, "logprobs": null }],
                    "usage": usage_json(&usage),
                }));
            }
            Event::Error(e) => return Err(ApiError::internal(e)),
        }
    }
    Err(ApiError::internal("the engine stopped before the request finished"))
}

/// Server-sent events: a role chunk, content chunks as text is decoded, a finish chunk, optionally a
/// usage chunk, then `[DONE]`. A failure midway is sent as an error event and ends the stream. Dropping
/// the stream (client gone) drops the receiver, which the engine treats as an abort.
fn stream(state: AppState, id: u64, mut events: UnboundedReceiver<Event>, mut stops: StopMatcher, meta: Meta, include_usage: bool) -> impl IntoResponse {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<SseEvent, Infallible>>(16);
    tokio::spawn(async move {
        let chunk = |delta: Value, finish: Option<&str>| {
            json!({
                "id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
                "choices": [{ "index": 0, "delta": delta, "finish_reason": finish, "logprobs": null }],
            })
        };
        let send = |v: Value| {
            let tx = tx.clone();
            async move { tx.send(Ok(SseEvent::default().data(v.to_string()))).await.is_ok() }
        };
        if !send(chunk(json!({"role": "assistant", "content": ""}), None)).await {
            return state.engine.abort(id);
        }
        let mut stopped_by_string = false;
        while let Some(ev) = events.recv().await {
            match ev {
                Event::Token { text, .. } if !stopped_by_string => {
                    let (out, stop) = match stops.push(&text) {
                        StopOutcome::Continue(t) => (t, false),
                        StopOutcome::Stopped(t) => (t, true),
                    };
                    if !out.is_empty() && !send(chunk(json!({ "content": out }), None)).await {
                        return state.engine.abort(id);
                    }
                    if stop {
                        stopped_by_string = true;
                        state.engine.abort(id);
                    }
                }
                Event::Token { .. } => {}
                Event::Finished { reason, usage, .. } => {
                    let reason = if stopped_by_string { "stop" } else { finish_str(reason) };
                    let rest = if stopped_by_string { String::new() } else { stops.finish() };
                    if !rest.is_empty() {
                        send(chunk(json!({ "content": rest }), None)).await;
                    }
                    send(chunk(json!({}), Some(reason))).await;
                    if include_usage {
                        send(json!({
                            "id": meta.id, "object": "chat.completion.chunk", "created": meta.created, "model": meta.model,
                            "choices": [], "usage": usage_json(&usage),
                        }))
                        .await;
                    }
                    let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
                    return;
                }
                Event::Error(e) => {
                    send(ApiError::internal(e).body()).await;
                    return;
                }
            }
        }
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).keep_alive(KeepAlive::default())
}

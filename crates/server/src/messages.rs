//! Anthropic's Messages API: `POST /v1/messages` (streamed and not) and `POST /v1/messages/count_tokens`.
//! The request becomes the same conversation, tools and `GenerateParams` as a chat completion; the
//! engine's text goes through the same `OutputParser`, shaped here as content blocks (`text`,
//! `thinking`, `tool_use`) and Anthropic's stream events. Errors have Anthropic's shape.
//!
//! What Claude Code sends that needs care: a `{"role": "system"}` message inside `messages`; the
//! `x-anthropic-billing-header: ...` line it puts first in the system prompt, whose hash changes with
//! every request (it would make every prompt differ from its first tokens and defeat the prefix cache:
//! it is dropped); `max_tokens: 32000` whatever the model (clamped to what the context leaves, by the
//! engine's validation); `context_management`, `metadata` (accepted); `thinking` (its budget caps the
//! reasoning: `engine::reasoning`). `output_config.format`
//! (a JSON schema) is enforced by the grammar, as chat's `response_format`.

use crate::error::ApiError;
use crate::output::{Delta, OutputParser, ParseOptions};
use crate::params::SamplingFields;
use crate::tools::{self, Tool, ToolChoice, ToolSet};
use crate::AppState;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use reckon_engine::engine::{Event, FinishReason, GenerateParams, Usage};
use reckon_engine::template::ChatMessage;
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use crate::metrics::Metered;

#[derive(Debug, Deserialize)]
struct MessagesRequest {
    model: String,
    /// Required by Anthropic for /v1/messages; count_tokens has none.
    max_tokens: Option<usize>,
    messages: Vec<Message>,
    system: Option<Content>,
    #[serde(default)]
    stop_sequences: Vec<String>,
    #[serde(default)]
    stream: bool,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    #[serde(default)]
    tools: Vec<AnthropicTool>,
    tool_choice: Option<AnthropicToolChoice>,
    /// `{"format": {"type": "json_schema", "schema": {...}}, "effort": ...}`: structured output.
    output_config: Option<Value>,
    /// reckon's extensions (`params::reckon_extension`).
    reckon: Option<Value>,
    /// `{"type": "enabled", "budget_tokens": N}` caps the reasoning (`engine::reasoning`); `{"type":
    /// "disabled"}` turns it off where the template has a switch (Qwen3's `enable_thinking`).
    thinking: Option<Value>,
    /// The fields not read above, checked against the API's known fields (`fields`).
    #[serde(flatten)]
    other: serde_json::Map<String, Value>,
}

/// What `thinking` asks: `Some(budget)` for enabled (with its budget), `None` for absent, adaptive or
/// disabled; and whether it is disabled.
fn thinking(req: &MessagesRequest) -> Result<(Option<usize>, bool), ApiError> {
    let Some(t) = req.thinking.as_ref().filter(|t| !t.is_null()) else { return Ok((None, false)) };
    let bad = |m: &str| ApiError::invalid(format!("thinking: {m}"), Some("thinking"));
    match t.get("type").and_then(Value::as_str) {
        Some("enabled") => {
            let budget = t.get("budget_tokens").and_then(Value::as_u64).ok_or_else(|| bad("enabled needs budget_tokens, a whole number"))?;
            if req.max_tokens.is_some_and(|m| budget as usize >= m) {
                return Err(ApiError::invalid(format!("thinking.budget_tokens must be less than max_tokens. Given: {budget} and {}", req.max_tokens.unwrap_or(0)), Some("thinking.budget_tokens")));
            }
            Ok((Some(budget as usize), false))
        }
        Some("disabled") => Ok((None, true)),
        Some("adaptive") => Ok((None, false)),
        _ => Err(bad("type must be enabled, disabled or adaptive")),
    }
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: Content,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block {
    Text { text: String },
    Thinking { thinking: String },
    RedactedThinking {},
    ToolUse { name: String, #[serde(default)] input: Value },
    ToolResult { tool_use_id: String, #[serde(default)] content: Option<Content>, #[serde(default)] is_error: bool },
    /// Refused (`ApiError::media`): these models read text only.
    Image {},
    Document {},
    /// Server tool calls and results (`server_tool_use`, `web_search_tool_result`): Anthropic's
    /// servers ran them; the text around them stands.
    #[serde(other)]
    Other,
}

#[derive(Debug, Deserialize)]
struct AnthropicTool {
    /// Absent or "custom" for a client tool; Anthropic's server tools (`web_search_...`, `bash_...`)
    /// have a versioned type and no schema.
    #[serde(rename = "type")]
    kind: Option<String>,
    name: String,
    description: Option<String>,
    input_schema: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct AnthropicToolChoice {
    #[serde(rename = "type")]
    kind: String,
    name: Option<String>,
    #[serde(default)]
    disable_parallel_tool_use: bool,
}

impl Content {
    /// The text of a string or of its text blocks; an image or a document is a 400.
    fn text(&self) -> Result<String, ApiError> {
        match self {
            Content::Text(t) => Ok(t.clone()),
            Content::Blocks(blocks) => {
                let mut texts = Vec::new();
                for b in blocks {
                    match b {
                        Block::Text { text } => texts.push(text.as_str()),
                        b => media(b)?,
                    }
                }
                Ok(texts.join("\n"))
            }
        }
    }
}

/// A 400 for an image or document block (`ApiError::media`); nothing for the blocks skipped on purpose.
fn media(b: &Block) -> Result<(), ApiError> {
    match b {
        Block::Image {} => Err(ApiError::media("image", "messages")),
        Block::Document {} => Err(ApiError::media("document", "messages")),
        _ => Ok(()),
    }
}

/// Claude Code's per-request billing line, dropped from the system prompt (see the module comment).
fn strip_volatile(system: &str) -> String {
    system.lines().filter(|l| !l.starts_with("x-anthropic-billing-header:")).collect::<Vec<_>>().join("\n").trim_start().to_string()
}

/// The conversation as chat templates read it.
fn conversation(req: &MessagesRequest) -> Result<Vec<ChatMessage>, ApiError> {
    if req.messages.is_empty() {
        return Err(ApiError::invalid("messages: at least one message is required", Some("messages")));
    }
    let mut system: Vec<String> = req.system.iter().map(|s| s.text().map(|t| strip_volatile(&t))).filter(|s| !matches!(s, Ok(t) if t.is_empty())).collect::<Result<_, _>>()?;
    let mut out: Vec<ChatMessage> = Vec::new();
    for m in &req.messages {
        let blocks: Vec<&Block> = match &m.content {
            Content::Text(t) => {
                match m.role.as_str() {
                    // Claude Code sends system text inside messages too: it joins the system prompt
                    "system" if out.is_empty() => system.push(strip_volatile(t)),
                    "user" | "assistant" | "system" => out.push(ChatMessage::new(&m.role, t)),
                    other => return Err(ApiError::invalid(format!("messages: unexpected role '{other}': use user or assistant"), Some("messages"))),
                }
                continue;
            }
            Content::Blocks(b) => b.iter().collect(),
        };
        match m.role.as_str() {
            "user" | "system" => {
                let mut text = Vec::new();
                for b in blocks {
                    match b {
                        Block::Text { text: t } => text.push(t.as_str()),
                        Block::ToolResult { tool_use_id, content, is_error } => {
                            let body = content.as_ref().map(Content::text).transpose()?.unwrap_or_default();
                            let mut msg = ChatMessage::new("tool", &if *is_error { format!("Error: {body}") } else { body });
                            msg.tool_call_id = Some(tool_use_id.clone());
                            out.push(msg);
                        }
                        b => media(b)?,
                    }
                }
                if !text.is_empty() {
                    let joined = text.join("\n");
                    if m.role == "system" && out.is_empty() {
                        system.push(strip_volatile(&joined));
                    } else {
                        out.push(ChatMessage::new(&m.role, &joined));
                    }
                }
            }
            "assistant" => {
                let mut msg = ChatMessage::new("assistant", "");
                for b in blocks {
                    match b {
                        Block::Text { text } => msg.content.push_str(text),
                        Block::Thinking { thinking } => msg.reasoning_content = Some(thinking.clone()),
                        Block::ToolUse { name, input, .. } => msg.tool_calls.push(tools::template_call(name, &input.to_string())),
                        _ => {}
                    }
                }
                out.push(msg);
            }
            other => return Err(ApiError::invalid(format!("messages: unexpected role '{other}': use user or assistant"), Some("messages"))),
        }
    }
    if !system.is_empty() {
        out.insert(0, ChatMessage::new("system", &system.join("\n\n")));
    }
    Ok(out)
}

fn tool_set(req: &MessagesRequest) -> Result<ToolSet, ApiError> {
    let mut set = ToolSet::default();
    for t in &req.tools {
        match t.kind.as_deref() {
            None | Some("custom") => set.tools.push(Tool {
                model_name: t.name.clone(),
                namespace: None,
                name: t.name.clone(),
                description: t.description.clone(),
                parameters: t.input_schema.clone().unwrap_or_else(|| json!({"type": "object", "properties": {}})),
            }),
            Some(kind) => tracing::warn!("messages: Anthropic's server tool '{}' ({kind}) is not available here; ignored", t.name),
        }
    }
    if let Some(c) = &req.tool_choice {
        set.choice = match (c.kind.as_str(), &c.name) {
            ("auto", _) => ToolChoice::Auto,
            ("any", _) => ToolChoice::Required,
            ("none", _) => ToolChoice::None,
            ("tool", Some(name)) => ToolChoice::Named(name.clone()),
            ("tool", None) => return Err(ApiError::invalid("tool_choice: type 'tool' needs a name", Some("tool_choice"))),
            (other, _) => return Err(ApiError::invalid(format!("tool_choice: unknown type '{other}': use auto, any, tool or none"), Some("tool_choice"))),
        };
        set.parallel = !c.disable_parallel_tool_use;
    }
    set.check("tool_choice")?;
    Ok(set)
}

/// The request's prompt: token ids, and the forced start of the answer (a required tool call).
/// The request's prompt: token ids, the forced start of the answer (a required tool call), and what to
/// parse the answer for.
fn prompt(state: &AppState, req: &MessagesRequest, tools: &ToolSet) -> Result<(Vec<u32>, Option<String>, crate::output::ParseOptions, String), ApiError> {
    // thinking disabled: the template's switch, where it has one (Qwen3's); a template without one
    // has no reasoning to turn off
    let mut kwargs = serde_json::Map::new();
    if thinking(req)?.1 {
        kwargs.insert("enable_thinking".into(), Value::Bool(false));
    }
    let (text, prefill) = tools::prompt_text(state, conversation(req)?, tools, &kwargs, "messages")?;
    let ids = state.tokenizer.encode(&text, true, true).map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    let parse = tools::parse_options(&state.template, tools, &text);
    Ok((ids, prefill, parse, text))
}

fn parse_request(state: &AppState, body: &[u8]) -> Result<MessagesRequest, ApiError> {
    let req: MessagesRequest = crate::chat::parse(body, json!({"model": "", "messages": []}))?;
    crate::fields::check(crate::fields::Api::Messages, &req.other)?;
    if !state.serves(&req.model) {
        return Err(state.unknown_model(&req.model));
    }
    Ok(req)
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens, as a message request would count them (all of
/// it off the async workers).
pub fn count_tokens(state: &AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req = parse_request(state, body)?;
    let tools = tool_set(&req)?;
    let (ids, ..) = prompt(state, &req, &tools)?;
    Ok(Json(json!({ "input_tokens": ids.len() })).into_response())
}

/// A Messages request made ready for the engine.
pub struct Ready {
    params: GenerateParams,
    parse: ParseOptions,
    prefill: Option<String>,
    model: String,
    prompt_len: usize,
    parallel: bool,
    stream: bool,
}

/// `POST /v1/messages` up to the engine: parsing, the template, tokenizing and the grammar (run off the
/// async workers, `lib::off_workers`).
pub fn prepare(state: &AppState, body: &[u8]) -> Result<Ready, ApiError> {
    let req = parse_request(state, body)?;
    let max_tokens = req.max_tokens.ok_or_else(|| ApiError::invalid("max_tokens: field required", Some("max_tokens")))?;
    if let Some(t) = req.temperature.filter(|t| !(0.0..=1.0).contains(t)) {
        return Err(ApiError::invalid(format!("temperature: must be between 0 and 1. Given: {t}"), Some("temperature")));
    }
    let tools = tool_set(&req)?;
    let (ids, prefill, parse, text) = prompt(state, &req, &tools)?;
    let prompt_len = ids.len();
    tools::log_request(state, "messages", &text, prompt_len, &tools);
    let format = crate::chat::response_format(req.output_config.as_ref().and_then(|c| c.get("format")).filter(|f| !f.is_null()))
        .map_err(|e| ApiError { param: Some("output_config".into()), ..e })?;
    let constraint = state.answer_constraint(&tools, format.as_ref(), "output_config")?;
    // the budget holds where the template writes reasoning; elsewhere nothing is spent reasoning
    let reasoning_budget = match thinking(&req)?.0 {
        Some(tokens) if parse.reasoning => {
            let ids = |text: &str| state.tokenizer.encode(text, false, true).map_err(|e| ApiError::invalid(e.to_string(), Some("thinking")));
            Some(reckon_engine::engine::ReasoningBudget { tokens, open: ids("<think>")?, close: ids("</think>\n\n")?, starts_inside: parse.starts_in_reasoning })
        }
        _ => None,
    };
    let params = GenerateParams {
        prompt: ids,
        // what the request omits comes from the server's defaults (Anthropic's own, temperature 1
        // with no cuts, is far from what a small model needs)
        sampling: SamplingFields { temperature: req.temperature, top_k: req.top_k.map(|k| k as i64), top_p: req.top_p, ..Default::default() }.resolve(&state.sampling),
        max_new_tokens: Some(max_tokens),
        stop: req.stop_sequences.clone(),
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        logprobs: None,
        cache_salt: None,
        constraint,
        prediction: Vec::new(),
        spec_prefill: crate::params::reckon_extension(req.reckon.as_ref())?,
        reasoning_budget,
    };
    Ok(Ready { params, parse, prefill, model: req.model, prompt_len, parallel: tools.parallel, stream: req.stream })
}

/// `POST /v1/messages`: submits a prepared request and answers in Anthropic's shape.
pub async fn messages(state: &AppState, ready: Ready) -> Result<Response, ApiError> {
    let Ready { params, parse, prefill, model, prompt_len, parallel, stream: streamed } = ready;
    let (id, events) = state.engine.submit(params).map_err(|e| ApiError::from_request(e, crate::error::Wire::Messages))?;
    let events = Metered::new(events, &state.metrics);
    let mut parser = OutputParser::new(parse);
    let first = prefill.map(|p| parser.push(&p)).unwrap_or_default();
    let answer = Answer { state: state.clone(), id, model, prompt_len, parallel };
    if streamed {
        Ok(stream(answer, parser, first, events).into_response())
    } else {
        collect(answer, parser, first, events).await.map(|v| Json(v).into_response())
    }
}

/// One request's answer.
struct Answer {
    state: AppState,
    id: u64,
    model: String,
    prompt_len: usize,
    parallel: bool,
}

impl Answer {
    fn message_id(&self) -> String {
        format!("msg_{:024x}", self.id)
    }

    fn usage(&self, u: &Usage) -> Value {
        // Anthropic counts cached prompt tokens apart from input_tokens
        json!({
            "input_tokens": u.prompt_tokens - u.cached_tokens,
            "output_tokens": u.completion_tokens,
            "cache_read_input_tokens": u.cached_tokens,
            "cache_creation_input_tokens": 0,
        })
    }

    fn stop_reason(reason: FinishReason, stop: &Option<String>, called: bool) -> (&'static str, Value) {
        match reason {
            _ if called && reason != FinishReason::Length => ("tool_use", Value::Null),
            FinishReason::Stop if stop.is_some() => ("stop_sequence", json!(stop)),
            FinishReason::Length => ("max_tokens", Value::Null),
            FinishReason::Stop | FinishReason::Abort => ("end_turn", Value::Null),
        }
    }
}

fn tool_id(request: u64, index: usize) -> String {
    format!("toolu_{request:x}_{index}")
}

/// A call's arguments as the object `tool_use.input` must be.
fn input_object(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v @ Value::Object(_)) => v,
        _ => {
            tracing::warn!("messages: a tool call's arguments are not a JSON object ({} bytes)", arguments.len());
            json!({})
        }
    }
}

/// The content blocks of a whole answer, in the order the stream opens them (`Blocks`' rule: a new
/// block whenever the kind of delta changes), so the two answers agree.
fn content_of(deltas: Vec<Delta>, request: u64, parallel: bool) -> Vec<Value> {
    let mut content: Vec<Value> = Vec::new();
    let mut open: Open = Open::None;
    let mut args: Vec<String> = Vec::new(); // per tool_use block in `content`, its argument text
    let mut arg_of_block: Vec<Option<usize>> = Vec::new();
    for d in deltas {
        match d {
            Delta::Text(t) => {
                if open != Open::Text {
                    content.push(json!({ "type": "text", "text": "" }));
                    arg_of_block.push(None);
                    open = Open::Text;
                }
                let last = content.last_mut().expect("just opened");
                last["text"] = json!(format!("{}{t}", last["text"].as_str().unwrap_or("")));
            }
            Delta::Reasoning(t) => {
                if open != Open::Thinking {
                    content.push(json!({ "type": "thinking", "thinking": "", "signature": "" }));
                    arg_of_block.push(None);
                    open = Open::Thinking;
                }
                let last = content.last_mut().expect("just opened");
                last["thinking"] = json!(format!("{}{t}", last["thinking"].as_str().unwrap_or("")));
            }
            Delta::CallStart { index, name } => {
                if !parallel && index > 0 {
                    open = Open::None;
                    continue;
                }
                content.push(json!({ "type": "tool_use", "id": tool_id(request, index), "name": name, "input": {} }));
                arg_of_block.push(Some(args.len()));
                args.push(String::new());
                open = Open::Tool(index);
            }
            Delta::CallArgs { index, text } => {
                if open == Open::Tool(index) {
                    args.last_mut().expect("a call is open").push_str(&text);
                }
            }
        }
    }
    for (block, arg) in content.iter_mut().zip(arg_of_block) {
        if let Some(i) = arg {
            block["input"] = input_object(&args[i]);
        }
    }
    if content.is_empty() {
        content.push(json!({ "type": "text", "text": "" }));
    }
    content
}

async fn collect(a: Answer, mut parser: OutputParser, first: Vec<Delta>, mut events: Metered) -> Result<Value, ApiError> {
    let mut deltas = first;
    while let Some(ev) = events.recv().await {
        match ev {
            Event::Token { text, .. } => deltas.extend(parser.push(&text)),
            Event::Finished { reason, usage, stop, .. } => {
                deltas.extend(parser.finish());
                let content = content_of(deltas, a.id, a.parallel);
                let called = content.iter().any(|b| b["type"] == "tool_use");
                let (stop_reason, stop_sequence) = Answer::stop_reason(reason, &stop, called);
                return Ok(json!({
                    "id": a.message_id(), "type": "message", "role": "assistant", "model": a.model,
                    "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": a.usage(&usage),
                }));
            }
            Event::Error(e) => return Err(ApiError::internal(e)),
        }
    }
    Err(ApiError::engine_stopped())
}

/// The content block open in a stream.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Text,
    Thinking,
    Tool(usize),
}

/// Stream writer: opens and closes content blocks as the deltas change kind.
struct Blocks {
    request: u64,
    /// Parallel tool calls allowed; otherwise calls after the first are left out.
    parallel: bool,
    open: Open,
    /// Index of the open (or last) content block.
    index: usize,
    started: bool,
}

impl Blocks {
    /// The events for one delta.
    fn events(&mut self, d: Delta) -> Vec<(&'static str, Value)> {
        let mut out = Vec::new();
        let (want, start, delta) = match d {
            Delta::Text(t) => (Open::Text, json!({ "type": "text", "text": "" }), Some(json!({ "type": "text_delta", "text": t }))),
            Delta::Reasoning(t) => (Open::Thinking, json!({ "type": "thinking", "thinking": "", "signature": "" }), Some(json!({ "type": "thinking_delta", "thinking": t }))),
            Delta::CallStart { index, name } => {
                if !self.parallel && index > 0 {
                    return out;
                }
                (Open::Tool(index), json!({ "type": "tool_use", "id": tool_id(self.request, index), "name": name, "input": {} }), None)
            }
            Delta::CallArgs { index, text } => {
                if self.open != Open::Tool(index) {
                    return out; // a call left out (parallel calls off)
                }
                (Open::Tool(index), Value::Null, Some(json!({ "type": "input_json_delta", "partial_json": text })))
            }
        };
        if self.open != want {
            out.extend(self.close());
            if self.started {
                self.index += 1;
            }
            self.started = true;
            self.open = want;
            out.push(("content_block_start", json!({ "type": "content_block_start", "index": self.index, "content_block": start })));
        }
        if let Some(delta) = delta {
            out.push(("content_block_delta", json!({ "type": "content_block_delta", "index": self.index, "delta": delta })));
        }
        out
    }

    fn close(&mut self) -> Option<(&'static str, Value)> {
        if self.open == Open::None {
            return None;
        }
        self.open = Open::None;
        Some(("content_block_stop", json!({ "type": "content_block_stop", "index": self.index })))
    }
}

/// Anthropic's event stream: `message_start`, `ping`, content blocks (`content_block_start`,
/// `content_block_delta`, `content_block_stop`), `message_delta` with the stop reason and usage,
/// `message_stop`. A failure midway is an `error` event.
fn stream(a: Answer, mut parser: OutputParser, first: Vec<Delta>, mut events: Metered) -> impl IntoResponse {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<SseEvent, Infallible>>(16);
    tokio::spawn(async move {
        let send = |name: &'static str, v: Value| {
            let tx = tx.clone();
            async move { tx.send(Ok(SseEvent::default().event(name).data(v.to_string()))).await.is_ok() }
        };
        let start = json!({ "type": "message_start", "message": {
            "id": a.message_id(), "type": "message", "role": "assistant", "model": a.model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": { "input_tokens": a.prompt_len, "output_tokens": 0, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0 } } });
        if !send("message_start", start).await || !send("ping", json!({ "type": "ping" })).await {
            return a.state.engine.abort(a.id);
        }
        let mut blocks = Blocks { request: a.id, parallel: a.parallel, open: Open::None, index: 0, started: false };
        let mut pending = first;
        while let Some(ev) = events.recv().await {
            match ev {
                Event::Token { text, .. } => {
                    pending.extend(parser.push(&text));
                    for d in std::mem::take(&mut pending) {
                        for (name, v) in blocks.events(d) {
                            if !send(name, v).await {
                                return a.state.engine.abort(a.id);
                            }
                        }
                    }
                }
                Event::Finished { reason, usage, stop, .. } => {
                    pending.extend(parser.finish());
                    let mut out: Vec<(&'static str, Value)> = pending.drain(..).flat_map(|d| blocks.events(d)).collect();
                    if !blocks.started {
                        // an empty answer is still one (empty) text block
                        out.push(("content_block_start", json!({ "type": "content_block_start", "index": 0, "content_block": { "type": "text", "text": "" } })));
                        blocks.open = Open::Text;
                    }
                    out.extend(blocks.close());
                    let called = !parser.calls().is_empty();
                    let (stop_reason, stop_sequence) = Answer::stop_reason(reason, &stop, called);
                    out.push(("message_delta", json!({ "type": "message_delta", "delta": { "stop_reason": stop_reason, "stop_sequence": stop_sequence }, "usage": a.usage(&usage) })));
                    out.push(("message_stop", json!({ "type": "message_stop" })));
                    for (name, v) in out {
                        send(name, v).await;
                    }
                    return;
                }
                Event::Error(e) => {
                    send("error", ApiError::internal(e).anthropic_body()).await;
                    return;
                }
            }
        }
        send("error", ApiError::engine_stopped().anthropic_body()).await;
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).keep_alive(KeepAlive::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(v: Value) -> MessagesRequest {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn claude_code_system_and_tool_turns() {
        let req = request(json!({
            "model": "m", "max_tokens": 32000,
            "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=8a7f;"}, {"type": "text", "text": "You are Claude Code."}],
            "messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": [{"type": "text", "text": "List files", "cache_control": {"type": "ephemeral"}}]},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "ls", "signature": "s"}, {"type": "text", "text": "Sure."},
                    {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "a.rs"}]},
                    {"type": "tool_result", "tool_use_id": "toolu_2", "content": "denied", "is_error": true}, {"type": "server_tool_use", "id": "s", "name": "web_search"}]},
            ],
            "thinking": {"type": "enabled", "budget_tokens": 1024}, "context_management": {}, "output_config": {}, "metadata": {"user_id": "u"},
        }));
        let conv = conversation(&req).unwrap();
        assert_eq!(conv[0], ChatMessage::new("system", "You are Claude Code.\n\nBe terse."));
        assert_eq!(conv[1], ChatMessage::new("user", "List files"));
        assert_eq!(conv[2].content, "Sure.");
        assert_eq!(conv[2].reasoning_content.as_deref(), Some("ls"));
        assert_eq!(conv[2].tool_calls, vec![json!({"type": "function", "function": {"name": "Bash", "arguments": {"command": "ls"}}})]);
        assert_eq!((conv[3].role.as_str(), conv[3].content.as_str(), conv[3].tool_call_id.as_deref()), ("tool", "a.rs", Some("toolu_1")));
        assert_eq!(conv[4].content, "Error: denied");
        assert_eq!(conv.len(), 5);
    }

    #[test]
    fn images_and_documents_are_refused_not_dropped() {
        for (block, kind) in [(json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}), "image"), (json!({"type": "document", "source": {}}), "document")] {
            let in_user = request(json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, block.clone()]}]}));
            let in_tool = request(json!({"model": "m", "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [block.clone()]}]}]}));
            let in_system = request(json!({"model": "m", "system": [block], "messages": [{"role": "user", "content": "Hi"}]}));
            for req in [in_user, in_tool, in_system] {
                let e = conversation(&req).err().expect("refused");
                assert_eq!(e.param.as_deref(), Some("messages"));
                assert!(e.message.contains(kind) && e.message.contains("text only"), "{}", e.message);
            }
        }
    }

    #[test]
    fn tool_choice_and_server_tools() {
        let req = request(json!({"model": "m", "messages": [],
            "tools": [{"name": "Read", "input_schema": {"type": "object"}}, {"type": "web_search_20250305", "name": "web_search"}],
            "tool_choice": {"type": "tool", "name": "Read", "disable_parallel_tool_use": true}}));
        let set = tool_set(&req).unwrap();
        assert_eq!(set.tools.len(), 1, "the server tool is ignored");
        assert_eq!((set.choice.clone(), set.parallel), (ToolChoice::Named("Read".into()), false));
        let req = request(json!({"model": "m", "messages": [], "tools": [], "tool_choice": {"type": "any"}}));
        assert!(tool_set(&req).is_err(), "any without tools");
    }

    #[test]
    fn whole_answer_blocks_follow_the_stream() {
        let deltas = vec![
            Delta::Text("A".into()),
            Delta::CallStart { index: 0, name: "f".into() },
            Delta::CallArgs { index: 0, text: "{\"x\": ".into() },
            Delta::CallArgs { index: 0, text: "1}".into() },
            Delta::Text("B".into()),
            Delta::CallStart { index: 1, name: "g".into() },
            Delta::CallArgs { index: 1, text: "{}".into() },
        ];
        let c = content_of(deltas.clone(), 9, true);
        let kinds: Vec<&str> = c.iter().map(|b| b["type"].as_str().unwrap()).collect();
        assert_eq!(kinds, ["text", "tool_use", "text", "tool_use"]);
        assert_eq!(c[1]["input"], json!({"x": 1}));
        assert_eq!(c[3]["id"], "toolu_9_1");
        let c = content_of(deltas, 9, false);
        assert_eq!(c.iter().filter(|b| b["type"] == "tool_use").count(), 1, "parallel calls off");
        assert_eq!(content_of(vec![], 1, true), vec![json!({"type": "text", "text": ""})]);
    }

    #[test]
    fn stream_blocks_open_and_close_by_kind() {
        let mut b = Blocks { request: 1, parallel: false, open: Open::None, index: 0, started: false };
        let mut kinds = |d: Option<Delta>| {
            let evs = match d {
                Some(d) => b.events(d),
                None => b.close().into_iter().collect(),
            };
            evs.into_iter().map(|(n, v)| format!("{n}:{}", v["index"])).collect::<Vec<_>>()
        };
        assert_eq!(kinds(Some(Delta::Reasoning("hm".into()))), ["content_block_start:0", "content_block_delta:0"]);
        assert_eq!(kinds(Some(Delta::Text("Hi".into()))), ["content_block_stop:0", "content_block_start:1", "content_block_delta:1"]);
        assert_eq!(kinds(Some(Delta::Text(" there".into()))), ["content_block_delta:1"]);
        assert_eq!(kinds(Some(Delta::CallStart { index: 0, name: "f".into() })), ["content_block_stop:1", "content_block_start:2"]);
        assert_eq!(kinds(Some(Delta::CallArgs { index: 0, text: "{}".into() })), ["content_block_delta:2"]);
        // parallel calls off: the second call is left out
        assert!(kinds(Some(Delta::CallStart { index: 1, name: "g".into() })).is_empty());
        assert!(kinds(Some(Delta::CallArgs { index: 1, text: "{}".into() })).is_empty());
        assert_eq!(kinds(None), ["content_block_stop:2"]);
    }
}

//! OpenAI's Responses API: `POST /v1/responses` (streamed and not), `GET`/`DELETE /v1/responses/{id}`.
//! Input items become the same conversation and tools as a chat completion; the engine's text goes
//! through the same `OutputParser`, shaped here as output items (`reasoning`, `message`,
//! `function_call`) and the Responses event stream. One `Items` writer serves both the stream and the
//! whole answer, so the two cannot differ.
//!
//! What Codex sends that needs care: each MCP server's tools as one `{"type": "namespace", "name":
//! "mcp__files", "tools": [...]}` entry (the model sees `mcp__files__read_file`; the call goes back
//! with `namespace` and `name` apart, as they came in); `custom` and `web_search` tools (no such tools
//! here: ignored with a warning, not a 400); `store: false`, `include`, `reasoning`,
//! `prompt_cache_key`, `client_metadata`, `text`, `parallel_tool_calls` (accepted).

use crate::error::ApiError;
use crate::output::{Delta, OutputParser, ParseOptions};
use crate::params::{clock_seed, unix_now, SamplingFields};
use crate::tools::{self, Tool, ToolChoice, ToolSet};
use crate::AppState;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use reckon_engine::engine::{Event, FinishReason, GenerateParams, Usage};
use reckon_engine::template::ChatMessage;
use serde::Deserialize;
use serde_json::{json, Value};
use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::sync::Mutex;
use crate::metrics::Metered;

/// Responses kept for `previous_response_id` and `GET` (oldest dropped first).
pub const STORE_CAPACITY: usize = 1024;

/// The responses stored with `store: true`: the conversation each one ended (for
/// `previous_response_id`) and its JSON (for `GET`).
#[derive(Default)]
pub struct ResponseStore {
    inner: Mutex<StoreInner>,
}

#[derive(Default)]
struct StoreInner {
    map: HashMap<String, Stored>,
    order: VecDeque<String>,
}

#[derive(Clone)]
struct Stored {
    /// The conversation without the instructions (they are not carried over, as OpenAI's), ending with
    /// this response's output.
    conversation: Vec<ChatMessage>,
    json: Value,
}

impl ResponseStore {
    fn put(&self, id: String, stored: Stored) {
        let mut s = self.inner.lock().expect("store lock");
        if s.map.insert(id.clone(), stored).is_none() {
            s.order.push_back(id);
        }
        while s.order.len() > STORE_CAPACITY {
            let old = s.order.pop_front().expect("not empty");
            s.map.remove(&old);
        }
    }

    fn get(&self, id: &str) -> Option<Stored> {
        self.inner.lock().expect("store lock").map.get(id).cloned()
    }

    fn delete(&self, id: &str) -> bool {
        let mut s = self.inner.lock().expect("store lock");
        s.order.retain(|k| k != id);
        s.map.remove(id).is_some()
    }
}

#[derive(Debug, Deserialize)]
struct ResponsesRequest {
    model: String,
    input: Input,
    instructions: Option<String>,
    #[serde(default)]
    tools: Vec<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    max_output_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    #[serde(default)]
    stream: bool,
    store: Option<bool>,
    previous_response_id: Option<String>,
    #[serde(default)]
    metadata: Value,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}}`.
    text: Option<Value>,
    /// reckon's extensions (`params::reckon_extension`).
    reckon: Option<Value>,
    /// The fields not read above, checked against the API's known fields (`fields`).
    #[serde(flatten)]
    other: serde_json::Map<String, Value>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<Value>),
}

/// The text of a message's content: a string, or its text parts (`input_text`, `output_text`, `text`,
/// `refusal`); an image, audio or file part is a 400 (`ApiError::media`).
fn content_text(v: &Value) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::new();
            for p in parts {
                match str_field(p, "type") {
                    Some(kind @ ("input_image" | "input_file" | "input_audio" | "image" | "file")) => return Err(ApiError::media(kind, "input")),
                    _ => texts.extend(p.get("text").or(p.get("refusal")).and_then(Value::as_str)),
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Ok(String::new()),
    }
}

fn str_field<'a>(item: &'a Value, key: &str) -> Option<&'a str> {
    item.get(key).and_then(Value::as_str)
}

/// Input items as chat messages: messages, a function call (joined to the assistant turn before it)
/// and its output (a tool message); reasoning and items for tools not here are skipped.
fn items_to_messages(items: &[Value], out: &mut Vec<ChatMessage>) -> Result<(), ApiError> {
    for item in items {
        let kind = str_field(item, "type").unwrap_or("message");
        match kind {
            "message" => {
                let role = str_field(item, "role").ok_or_else(|| ApiError::invalid("a message item needs a role", Some("input")))?;
                let role = match role {
                    "developer" | "system" => "system",
                    "user" | "assistant" => role,
                    other => return Err(ApiError::invalid(format!("unsupported role '{other}' in input"), Some("input"))),
                };
                let text = content_text(item.get("content").unwrap_or(&Value::Null))?;
                out.push(ChatMessage::new(role, &text));
            }
            "function_call" => {
                let name = str_field(item, "name").ok_or_else(|| ApiError::invalid("a function_call item needs a name", Some("input")))?;
                let model_name = tools::namespaced(str_field(item, "namespace"), name);
                let call = tools::template_call(&model_name, str_field(item, "arguments").unwrap_or("{}"));
                match out.last_mut() {
                    Some(last) if last.role == "assistant" => last.tool_calls.push(call),
                    _ => {
                        let mut m = ChatMessage::new("assistant", "");
                        m.tool_calls.push(call);
                        out.push(m);
                    }
                }
            }
            "function_call_output" => {
                let output = content_text(item.get("output").unwrap_or(&Value::Null))?;
                let mut m = ChatMessage::new("tool", &output);
                m.tool_call_id = str_field(item, "call_id").map(str::to_string);
                out.push(m);
            }
            "reasoning" => {}
            other => tracing::warn!("responses: input item of type '{other}' is not supported here; skipped"),
        }
    }
    Ok(())
}

/// `tools`: functions, and namespaces of functions; other tool types are ignored with a warning.
fn tool_set(req: &ResponsesRequest) -> Result<ToolSet, ApiError> {
    let function = |t: &Value, namespace: Option<&str>| -> Result<Tool, ApiError> {
        let name = str_field(t, "name").ok_or_else(|| ApiError::invalid("a function tool needs a name", Some("tools")))?;
        Ok(Tool {
            model_name: tools::namespaced(namespace, name),
            namespace: namespace.map(str::to_string),
            name: name.to_string(),
            description: str_field(t, "description").map(str::to_string),
            parameters: t.get("parameters").filter(|v| !v.is_null()).cloned().unwrap_or_else(|| json!({"type": "object", "properties": {}})),
        })
    };
    let mut set = ToolSet::default();
    for t in &req.tools {
        match str_field(t, "type") {
            Some("function") => set.tools.push(function(t, None)?),
            Some("namespace") => {
                let ns = str_field(t, "name").ok_or_else(|| ApiError::invalid("a namespace tool needs a name", Some("tools")))?;
                for inner in t.get("tools").and_then(Value::as_array).into_iter().flatten() {
                    match str_field(inner, "type") {
                        Some("function") | None => set.tools.push(function(inner, Some(ns))?),
                        Some(other) => tracing::warn!("responses: tool type '{other}' in namespace '{ns}' is not supported here; ignored"),
                    }
                }
            }
            other => tracing::warn!("responses: tool type '{}' is not supported here; ignored", other.unwrap_or("?")),
        }
    }
    set.choice = match &req.tool_choice {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => ToolChoice::from_openai(s)?,
        Some(v) => match str_field(v, "name") {
            Some(name) => ToolChoice::Named(match str_field(v, "namespace") {
                Some(ns) => tools::namespaced(Some(ns), name),
                None => unqualified_choice(&set, name)?,
            }),
            None => return Err(ApiError::invalid("tool_choice must be a string or {\"type\": \"function\", \"name\": ...}", Some("tool_choice"))),
        },
    };
    set.parallel = req.parallel_tool_calls.unwrap_or(true);
    set.check("tool_choice")?;
    Ok(set)
}

/// The model name of the tool a `tool_choice` names without a namespace: a top-level function (or the
/// full model name) of that name, else the one namespaced function whose own name it is. A name that
/// several namespaces share is ambiguous; a name no tool has is left for `ToolSet::check` to refuse.
fn unqualified_choice(set: &ToolSet, name: &str) -> Result<String, ApiError> {
    if set.find(name).is_some() {
        return Ok(name.to_string());
    }
    let matches: Vec<&Tool> = set.tools.iter().filter(|t| t.namespace.is_some() && t.name == name).collect();
    match matches[..] {
        [one] => Ok(one.model_name.clone()),
        [] => Ok(name.to_string()),
        _ => {
            let namespaces: Vec<&str> = matches.iter().filter_map(|t| t.namespace.as_deref()).collect();
            Err(ApiError::invalid(format!("tool_choice names '{name}', which the namespaces {} all have: give its namespace", namespaces.join(", ")), Some("tool_choice")))
        }
    }
}

/// A Responses request made ready for the engine: the request, how to read its answer, and the run
/// that answers it (its engine id is set at submission).
pub struct Ready {
    params: GenerateParams,
    parse: ParseOptions,
    prefill: Option<String>,
    run: Run,
    stream: bool,
}

/// `POST /v1/responses` up to the engine: parsing, the stored conversation, the template, tokenizing and
/// the grammar (run off the async workers, `lib::off_workers`).
pub fn prepare(state: &AppState, body: &[u8]) -> Result<Ready, ApiError> {
    let req: ResponsesRequest = crate::chat::parse(body, json!({"model": "", "input": ""}))?;
    crate::fields::check(crate::fields::Api::Responses, &req.other)?;
    if !state.serves(&req.model) {
        return Err(state.unknown_model(&req.model));
    }
    if let Some(t) = req.temperature.filter(|t| !(0.0..=2.0).contains(t)) {
        return Err(ApiError::invalid(format!("temperature must be between 0 and 2. Given: {t}"), Some("temperature")));
    }
    // the conversation: the previous response's, then this input
    let mut conversation = match &req.previous_response_id {
        Some(id) => state.responses.get(id).ok_or_else(|| ApiError::not_found(format!("no stored response '{id}'"), Some("previous_response_id"), "previous_response_not_found"))?.conversation,
        None => Vec::new(),
    };
    match &req.input {
        Input::Text(t) => conversation.push(ChatMessage::new("user", t)),
        Input::Items(items) => items_to_messages(items, &mut conversation)?,
    }
    if conversation.is_empty() {
        return Err(ApiError::invalid("input must not be empty", Some("input")));
    }
    let tools = tool_set(&req)?;
    let mut messages = conversation.clone();
    // instructions, and leading system items, make one system message
    let mut system: Vec<String> = req.instructions.iter().cloned().collect();
    while messages.first().is_some_and(|m| m.role == "system") {
        system.push(messages.remove(0).content);
    }
    if !system.is_empty() {
        messages.insert(0, ChatMessage::new("system", &system.join("\n\n")));
    }
    let (text, prefill) = tools::prompt_text(state, messages, &tools, &Default::default(), "input")?;
    let prompt = state.tokenizer.encode(&text, true, true).map_err(|e| ApiError::invalid(e.to_string(), Some("input")))?;
    tools::log_request(state, "responses", &text, prompt.len(), &tools);
    let format = crate::chat::response_format(req.text.as_ref().and_then(|t| t.get("format")))?;
    let constraint = state.answer_constraint(&tools, format.as_ref(), "text")?;
    let params = GenerateParams {
        prompt,
        sampling: SamplingFields { temperature: req.temperature, top_p: req.top_p, ..Default::default() }.resolve(&state.sampling),
        max_new_tokens: req.max_output_tokens,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        logprobs: None,
        cache_salt: None,
        constraint,
        prediction: Vec::new(),
        spec_prefill: crate::params::reckon_extension(req.reckon.as_ref())?,
        reasoning_budget: None,
    };
    let parse = tools::parse_options(&state.template, &tools, &text);
    let (temperature, top_p) = (params.sampling.temperature, params.sampling.top_p);
    let run = Run {
        state: state.clone(),
        id: 0,
        response_id: String::new(),
        created_at: unix_now(),
        store: req.store.unwrap_or(true),
        conversation,
        envelope: json!({
            "model": req.model, "instructions": req.instructions, "tools": req.tools,
            "tool_choice": req.tool_choice.clone().unwrap_or(json!("auto")), "parallel_tool_calls": tools.parallel,
            "previous_response_id": req.previous_response_id, "max_output_tokens": req.max_output_tokens,
            "temperature": temperature, "top_p": top_p,
            "store": req.store.unwrap_or(true), "metadata": if req.metadata.is_null() { json!({}) } else { req.metadata.clone() },
            "text": req.text.clone().unwrap_or(json!({"format": {"type": "text"}})), "truncation": "disabled",
        }),
        tools,
    };
    Ok(Ready { params, parse, prefill, run, stream: req.stream })
}

/// `POST /v1/responses`: submits a prepared request and answers as a response object or its events.
pub async fn create(state: &AppState, ready: Ready) -> Result<Response, ApiError> {
    let Ready { params, parse, prefill, mut run, stream: streamed } = ready;
    let (id, events) = state.engine.submit(params).map_err(|e| ApiError::from_request(e, crate::error::Wire::Responses))?;
    let events = Metered::new(events, &state.metrics);
    run.id = id;
    run.response_id = format!("resp_{id:x}{:012x}", clock_seed() & 0xffff_ffff_ffff);
    let mut parser = OutputParser::new(parse);
    let first = prefill.map(|p| parser.push(&p)).unwrap_or_default();
    if streamed {
        Ok(stream(run, parser, first, events).into_response())
    } else {
        collect(run, parser, first, events).await.map(|v| Json(v).into_response())
    }
}

/// `GET /v1/responses/{id}`.
pub fn get(state: &AppState, id: &str) -> Result<Response, ApiError> {
    match state.responses.get(id) {
        Some(s) => Ok(Json(s.json).into_response()),
        None => Err(ApiError::not_found(format!("no stored response '{id}'"), None, "response_not_found")),
    }
}

/// `DELETE /v1/responses/{id}`.
pub fn delete(state: &AppState, id: &str) -> Result<Response, ApiError> {
    if state.responses.delete(id) {
        Ok(Json(json!({ "id": id, "object": "response", "deleted": true })).into_response())
    } else {
        Err(ApiError::not_found(format!("no stored response '{id}'"), None, "response_not_found"))
    }
}

/// One request's answer.
struct Run {
    state: AppState,
    id: u64,
    response_id: String,
    created_at: u64,
    store: bool,
    conversation: Vec<ChatMessage>,
    /// The request's settings, echoed in every response object.
    envelope: Value,
    tools: ToolSet,
}

impl Run {
    /// The response object: in progress (no output yet), or done with its output and usage.
    fn response(&self, status: &str, output: &[Value], usage: Option<&Usage>, incomplete: Option<&str>) -> Value {
        let mut v = json!({
            "id": self.response_id, "object": "response", "created_at": self.created_at, "status": status,
            "error": null, "incomplete_details": incomplete.map(|r| json!({ "reason": r })), "output": output,
            "usage": usage.map(|u| json!({
                "input_tokens": u.prompt_tokens,
                "input_tokens_details": { "cached_tokens": u.cached_tokens },
                "output_tokens": u.completion_tokens,
                "output_tokens_details": { "reasoning_tokens": 0 },
                "total_tokens": u.prompt_tokens + u.completion_tokens,
            })),
        });
        v.as_object_mut().unwrap().extend(self.envelope.as_object().unwrap().clone());
        v
    }

    /// Stores the finished response (unless `store: false`).
    fn keep(&self, items: &Items, json: &Value) {
        if !self.store {
            return;
        }
        let mut conversation = self.conversation.clone();
        let mut answer = ChatMessage::new("assistant", &items.text);
        for item in &items.output {
            if item["type"] == "function_call" {
                let name = tools::namespaced(item["namespace"].as_str(), item["name"].as_str().unwrap_or(""));
                answer.tool_calls.push(tools::template_call(&name, item["arguments"].as_str().unwrap_or("{}")));
            }
        }
        conversation.push(answer);
        self.state.responses.put(self.response_id.clone(), Stored { conversation, json: json.clone() });
    }
}

/// What is open in the output.
enum Open {
    None,
    Message { id: String, text: String },
    Reasoning { id: String, text: String },
    Call { index: usize, item: Value },
}

/// Turns parsed deltas into output items and the events that build them.
struct Items {
    request: u64,
    open: Open,
    output: Vec<Value>,
    /// All message text, for the stored conversation.
    text: String,
    parallel: bool,
    /// Tools by model name: a call's namespace and name.
    tools: ToolSet,
}

impl Items {
    fn output_index(&self) -> usize {
        self.output.len()
    }

    fn events(&mut self, d: Delta) -> Vec<Value> {
        let mut ev = Vec::new();
        match d {
            Delta::Text(t) => {
                if !matches!(self.open, Open::Message { .. }) {
                    ev.extend(self.close());
                    let id = format!("msg_{:x}_{}", self.request, self.output.len());
                    let oi = self.output_index();
                    ev.push(json!({ "type": "response.output_item.added", "output_index": oi,
                        "item": { "type": "message", "id": id, "status": "in_progress", "role": "assistant", "content": [] } }));
                    ev.push(json!({ "type": "response.content_part.added", "item_id": id, "output_index": oi, "content_index": 0,
                        "part": { "type": "output_text", "text": "", "annotations": [] } }));
                    self.open = Open::Message { id, text: String::new() };
                }
                let oi = self.output_index();
                let Open::Message { id, text } = &mut self.open else { unreachable!() };
                text.push_str(&t);
                self.text.push_str(&t);
                ev.push(json!({ "type": "response.output_text.delta", "item_id": id, "output_index": oi, "content_index": 0, "delta": t, "logprobs": [] }));
            }
            Delta::Reasoning(t) => {
                if !matches!(self.open, Open::Reasoning { .. }) {
                    ev.extend(self.close());
                    let id = format!("rs_{:x}_{}", self.request, self.output.len());
                    ev.push(json!({ "type": "response.output_item.added", "output_index": self.output_index(),
                        "item": { "type": "reasoning", "id": id, "summary": [] } }));
                    self.open = Open::Reasoning { id, text: String::new() };
                }
                let oi = self.output_index();
                let Open::Reasoning { id, text } = &mut self.open else { unreachable!() };
                text.push_str(&t);
                ev.push(json!({ "type": "response.reasoning_text.delta", "item_id": id, "output_index": oi, "content_index": 0, "delta": t }));
            }
            Delta::CallStart { index, name } => {
                ev.extend(self.close());
                if !self.parallel && index > 0 {
                    return ev;
                }
                let (namespace, short) = match self.tools.find(&name) {
                    Some(t) => (t.namespace.clone(), t.name.clone()),
                    None => (None, name.clone()),
                };
                let mut item = json!({ "type": "function_call", "id": format!("fc_{:x}_{index}", self.request), "call_id": tools::call_id(self.request, index),
                    "name": short, "arguments": "", "status": "in_progress" });
                if let Some(ns) = namespace {
                    item["namespace"] = json!(ns);
                }
                ev.push(json!({ "type": "response.output_item.added", "output_index": self.output_index(), "item": item }));
                self.open = Open::Call { index, item };
            }
            Delta::CallArgs { index, text } => {
                let oi = self.output_index();
                if let Open::Call { index: open, item } = &mut self.open {
                    if *open == index {
                        let args = format!("{}{text}", item["arguments"].as_str().unwrap_or(""));
                        item["arguments"] = json!(args);
                        ev.push(json!({ "type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": oi, "delta": text }));
                    }
                }
            }
        }
        ev
    }

    /// Closes the open item: its done events, and the item joins the output.
    fn close(&mut self) -> Vec<Value> {
        let oi = self.output_index();
        let (ev, item) = match std::mem::replace(&mut self.open, Open::None) {
            Open::None => return Vec::new(),
            Open::Message { id, text } => {
                let part = json!({ "type": "output_text", "text": text, "annotations": [], "logprobs": [] });
                let item = json!({ "type": "message", "id": id, "status": "completed", "role": "assistant", "content": [part] });
                (vec![
                    json!({ "type": "response.output_text.done", "item_id": id, "output_index": oi, "content_index": 0, "text": text, "logprobs": [] }),
                    json!({ "type": "response.content_part.done", "item_id": id, "output_index": oi, "content_index": 0, "part": part }),
                ], item)
            }
            Open::Reasoning { id, text } => {
                let item = json!({ "type": "reasoning", "id": id, "summary": [], "content": [{ "type": "reasoning_text", "text": text }] });
                (vec![json!({ "type": "response.reasoning_text.done", "item_id": id, "output_index": oi, "content_index": 0, "text": text })], item)
            }
            Open::Call { mut item, .. } => {
                item["status"] = json!("completed");
                let done = json!({ "type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": oi,
                    "name": item["name"], "arguments": item["arguments"] });
                (vec![done], item)
            }
        };
        let mut ev = ev;
        ev.push(json!({ "type": "response.output_item.done", "output_index": oi, "item": item }));
        self.output.push(item);
        ev
    }
}

/// The end of a response: the events that close it, and the final response object.
fn finish(run: &Run, items: &mut Items, reason: FinishReason, usage: &Usage) -> (Vec<Value>, Value) {
    let mut ev = items.close();
    // cut by the token limit, even inside a call (whose arguments are then unfinished)
    let incomplete = (reason == FinishReason::Length).then_some("max_output_tokens");
    let status = if incomplete.is_some() { "incomplete" } else { "completed" };
    let response = run.response(status, &items.output, Some(usage), incomplete);
    run.keep(items, &response);
    let kind = if incomplete.is_some() { "response.incomplete" } else { "response.completed" };
    ev.push(json!({ "type": kind, "response": response }));
    (ev, response)
}

async fn collect(run: Run, mut parser: OutputParser, first: Vec<Delta>, mut events: Metered) -> Result<Value, ApiError> {
    let mut items = Items { request: run.id, open: Open::None, output: Vec::new(), text: String::new(), parallel: run.tools.parallel, tools: run.tools.clone() };
    for d in first {
        items.events(d);
    }
    while let Some(ev) = events.recv().await {
        match ev {
            Event::Token { text, .. } => {
                for d in parser.push(&text) {
                    items.events(d);
                }
            }
            Event::Finished { reason, usage, .. } => {
                for d in parser.finish() {
                    items.events(d);
                }
                return Ok(finish(&run, &mut items, reason, &usage).1);
            }
            Event::Error(e) => return Err(ApiError::internal(e)),
        }
    }
    Err(ApiError::engine_stopped())
}

/// The event stream: `response.created`, `response.in_progress`, the items' events, then
/// `response.completed` (or `response.incomplete` at the token limit, `response.failed` on an error),
/// each with its `sequence_number`.
fn stream(run: Run, mut parser: OutputParser, first: Vec<Delta>, mut events: Metered) -> impl IntoResponse {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<SseEvent, Infallible>>(16);
    tokio::spawn(async move {
        let mut seq = 0u64;
        let mut send = |mut v: Value| {
            v["sequence_number"] = json!(seq);
            seq += 1;
            let name = v["type"].as_str().unwrap_or("message").to_string();
            let tx = tx.clone();
            async move { tx.send(Ok(SseEvent::default().event(name).data(v.to_string()))).await.is_ok() }
        };
        let start = run.response("in_progress", &[], None, None);
        if !send(json!({ "type": "response.created", "response": start })).await || !send(json!({ "type": "response.in_progress", "response": start })).await {
            return run.state.engine.abort(run.id);
        }
        let mut items = Items { request: run.id, open: Open::None, output: Vec::new(), text: String::new(), parallel: run.tools.parallel, tools: run.tools.clone() };
        let mut pending = first;
        while let Some(ev) = events.recv().await {
            match ev {
                Event::Token { text, .. } => {
                    pending.extend(parser.push(&text));
                    for d in std::mem::take(&mut pending) {
                        for v in items.events(d) {
                            if !send(v).await {
                                return run.state.engine.abort(run.id);
                            }
                        }
                    }
                }
                Event::Finished { reason, usage, .. } => {
                    pending.extend(parser.finish());
                    let mut out: Vec<Value> = pending.drain(..).flat_map(|d| items.events(d)).collect();
                    out.extend(finish(&run, &mut items, reason, &usage).0);
                    for v in out {
                        send(v).await;
                    }
                    return;
                }
                Event::Error(e) => {
                    let mut failed = run.response("failed", &items.output, None, None);
                    failed["error"] = json!({ "code": "server_error", "message": e });
                    send(json!({ "type": "response.failed", "response": failed })).await;
                    return;
                }
            }
        }
        let mut failed = run.response("failed", &items.output, None, None);
        failed["error"] = json!({ "code": "server_error", "message": ApiError::engine_stopped().message });
        send(json!({ "type": "response.failed", "response": failed })).await;
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).keep_alive(KeepAlive::default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(v: Value) -> ResponsesRequest {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_tool_choice_without_its_namespace_names_the_one_function_of_that_name() {
        let tools = json!([
            {"type": "function", "name": "shell"},
            {"type": "namespace", "name": "mcp__files__", "tools": [{"type": "function", "name": "read_file"}, {"type": "function", "name": "list"}]},
            {"type": "namespace", "name": "mcp__git__", "tools": [{"type": "function", "name": "list"}, {"type": "function", "name": "shell"}]},
        ]);
        let choice = |c: Value| tool_set(&request(json!({"model": "m", "input": "hi", "tools": tools, "tool_choice": c})));
        // unique across namespaces: accepted as that namespace's function
        assert_eq!(choice(json!({"type": "function", "name": "read_file"})).unwrap().choice, ToolChoice::Named("mcp__files__read_file".into()));
        // a top-level function of the name wins over a namespaced one
        assert_eq!(choice(json!({"type": "function", "name": "shell"})).unwrap().choice, ToolChoice::Named("shell".into()));
        // the full model name, and the name with its namespace, still work
        assert_eq!(choice(json!({"type": "function", "name": "mcp__git__list"})).unwrap().choice, ToolChoice::Named("mcp__git__list".into()));
        assert_eq!(choice(json!({"type": "function", "name": "list", "namespace": "mcp__git__"})).unwrap().choice, ToolChoice::Named("mcp__git__list".into()));
        // in two namespaces: ambiguous, and the error says where
        let e = choice(json!({"type": "function", "name": "list"})).unwrap_err();
        assert!(e.message.contains("mcp__files__, mcp__git__") && e.param.as_deref() == Some("tool_choice"), "{}", e.message);
        // in none: not in tools
        assert!(choice(json!({"type": "function", "name": "nope"})).unwrap_err().message.contains("not in tools"));
    }

    #[test]
    fn codex_tools_namespace_round_trips() {
        let req = request(json!({"model": "m", "input": "hi", "tools": [
            {"type": "function", "name": "shell", "parameters": {"type": "object"}},
            {"type": "namespace", "name": "mcp__files__", "description": "files", "tools": [
                {"type": "function", "name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]},
            {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
            {"type": "web_search"},
        ], "tool_choice": {"type": "function", "name": "read_file", "namespace": "mcp__files__"}}));
        let set = tool_set(&req).unwrap();
        assert_eq!(set.tools.iter().map(|t| t.model_name.as_str()).collect::<Vec<_>>(), ["shell", "mcp__files__read_file"]);
        // Codex 0.171 names the namespace without the trailing separator: the model sees the same name
        let codex = request(json!({"model": "m", "input": "hi", "tools": [{"type": "namespace", "name": "mcp__files", "tools": [{"type": "function", "name": "read_file"}]}]}));
        let t = &tool_set(&codex).unwrap().tools[0];
        assert_eq!((t.model_name.as_str(), t.namespace.as_deref(), t.name.as_str()), ("mcp__files__read_file", Some("mcp__files"), "read_file"));
        assert_eq!(set.choice, ToolChoice::Named("mcp__files__read_file".into()));
        let mut items = Items { request: 7, open: Open::None, output: Vec::new(), text: String::new(), parallel: true, tools: set };
        let mut ev = items.events(Delta::Text("Reading.".into()));
        ev.extend(items.events(Delta::CallStart { index: 0, name: "mcp__files__read_file".into() }));
        ev.extend(items.events(Delta::CallArgs { index: 0, text: "{\"path\": ".into() }));
        ev.extend(items.events(Delta::CallArgs { index: 0, text: "\"a.rs\"}".into() }));
        ev.extend(items.close());
        let types: Vec<&str> = ev.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(types, [
            "response.output_item.added", "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.content_part.done", "response.output_item.done",
            "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.delta",
            "response.function_call_arguments.done", "response.output_item.done",
        ]);
        let call = &items.output[1];
        assert_eq!((call["namespace"].as_str(), call["name"].as_str()), (Some("mcp__files__"), Some("read_file")));
        assert_eq!(call["arguments"], "{\"path\": \"a.rs\"}");
        assert_eq!(call["status"], "completed");
        assert_eq!(ev.last().unwrap()["item"], *call, "output_item.done carries the whole item");
        assert_eq!(items.output[0]["content"][0]["text"], "Reading.");
    }

    #[test]
    fn input_items_become_the_conversation() {
        let items = json!([
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
            {"role": "user", "content": "Read a.rs"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "xyz"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
            {"type": "function_call", "call_id": "call_1", "namespace": "mcp__files__", "name": "read_file", "arguments": "{\"path\":\"a.rs\"}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "fn main() {}"},
            {"type": "custom_tool_call_output", "call_id": "x", "output": "?"},
        ]);
        let mut out = Vec::new();
        items_to_messages(items.as_array().unwrap(), &mut out).unwrap();
        assert_eq!(out.iter().map(|m| m.role.as_str()).collect::<Vec<_>>(), ["system", "user", "assistant", "tool"]);
        assert_eq!(out[2].content, "Sure.");
        assert_eq!(out[2].tool_calls, vec![json!({"type": "function", "function": {"name": "mcp__files__read_file", "arguments": {"path": "a.rs"}}})]);
        assert_eq!((out[3].content.as_str(), out[3].tool_call_id.as_deref()), ("fn main() {}", Some("call_1")));
    }

    #[test]
    fn the_store_is_bounded() {
        let store = ResponseStore::default();
        for i in 0..STORE_CAPACITY + 5 {
            store.put(format!("r{i}"), Stored { conversation: vec![], json: json!(i) });
        }
        assert!(store.get("r0").is_none());
        assert!(store.get(&format!("r{}", STORE_CAPACITY + 4)).is_some());
        assert!(store.delete("r10"));
        assert!(!store.delete("r10"));
    }
}

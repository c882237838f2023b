//! The engine's token events as an OpenAI response: one JSON body, or server-sent events. Chat and text
//! completions differ only in the shapes (`Api`).

use crate::error::ApiError;
use crate::output::{Delta, OutputParser, ParseOptions};
use crate::params::{unix_now, CommonParams};
use crate::tools::call_id;
use crate::AppState;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use reckon_engine::engine::{Event, FinishReason, GenerateParams, TokenLogprobs, Usage};
use serde_json::{json, Value};
use std::convert::Infallible;
use crate::metrics::Metered;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completion,
}

/// How to read the generated text: what the parser looks for, and the start of the answer that the
/// prompt already holds.
#[derive(Clone, Debug, Default)]
pub struct Prepared {
    pub parse: ParseOptions,
    /// Text of the answer the prompt ends with (a forced tool call's start); the parser reads it first.
    pub prefill: Option<String>,
    /// More than one tool call per answer (`parallel_tool_calls`); otherwise only the first is returned.
    pub parallel_calls: bool,
}

/// A chat or text completion request made ready for the engine (off the async workers: `chat::prepare_*`).
pub struct Ready {
    pub api: Api,
    pub stream: bool,
    pub include_usage: bool,
    pub request: GenerateParams,
    pub prepared: Prepared,
}

impl Ready {
    pub fn new(api: Api, params: &CommonParams, request: GenerateParams, prepared: Prepared) -> Ready {
        Ready { api, stream: params.stream, include_usage: params.include_usage(), request, prepared }
    }
}

/// Submits the request and answers in the shape its API and `stream` ask for.
pub async fn generate(state: &AppState, ready: Ready) -> Result<Response, ApiError> {
    let Ready { api, stream: streamed, include_usage, request, prepared } = ready;
    let (id, events) = state.engine.submit(request).map_err(|e| ApiError::from_request(e, api))?;
    let events = Metered::new(events, &state.metrics);
    let (run, shape) = Run::new(state, api, id, prepared);
    if streamed {
        Ok(stream(run, events, shape, include_usage).into_response())
    } else {
        Ok(Json(collect(run, events, &shape).await?).into_response())
    }
}

/// The server-sent events answer to an engine request's events (public for the tests, which feed it
/// events of their own, failures included).
pub fn stream_events(
    state: &AppState,
    api: Api,
    request_id: u64,
    events: tokio::sync::mpsc::UnboundedReceiver<Event>,
    include_usage: bool,
) -> Response {
    let events = Metered::new(events, &state.metrics);
    let (run, shape) = Run::new(state, api, request_id, Prepared::default());
    stream(run, events, shape, include_usage).into_response()
}

/// The response envelope of one request.
struct Shape {
    api: Api,
    id: String,
    created: u64,
    model: String,
}

impl Shape {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.api, chunk) {
            (Api::Chat, false) => "chat.completion",
            (Api::Chat, true) => "chat.completion.chunk",
            (Api::Completion, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({ "id": self.id, "object": self.object(chunk), "created": self.created, "model": self.model, "choices": choices })
    }

    fn full(&self, run: &Run, reason: &str, usage: &Usage, logprobs: Value) -> Value {
        let text = run.parser.text();
        let choice = match self.api {
            Api::Chat => {
                let calls = run.calls();
                let mut message = json!({ "role": "assistant", "content": if text.is_empty() && !calls.is_empty() { Value::Null } else { json!(text) } });
                if !run.parser.reasoning().is_empty() {
                    message["reasoning_content"] = json!(run.parser.reasoning());
                }
                if !calls.is_empty() {
                    message["tool_calls"] = calls
                        .iter()
                        .enumerate()
                        .map(|(i, c)| json!({ "id": call_id(run.id, i), "type": "function", "function": { "name": c.name, "arguments": c.arguments } }))
                        .collect();
                }
                json!({ "index": 0, "message": message, "finish_reason": reason, "logprobs": logprobs })
            }
            Api::Completion => json!({ "index": 0, "text": text, "finish_reason": reason, "logprobs": logprobs }),
        };
        let mut v = self.envelope(false, json!([choice]));
        v["usage"] = usage_json(usage);
        v
    }

    /// A streamed chunk: a delta (chat: `{"role": "assistant", "content": ""}` first, then content,
    /// reasoning or tool-call pieces; completions: text) and/or a finish reason.
    fn chunk(&self, delta: Value, finish: Option<&str>, logprobs: Value) -> Value {
        let choice = match self.api {
            Api::Chat => json!({ "index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs }),
            Api::Completion => {
                let text = delta.get("content").and_then(Value::as_str).unwrap_or("");
                json!({ "index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs })
            }
        };
        self.envelope(true, json!([choice]))
    }

    /// A chat delta for one parsed piece; `None` for a piece this answer leaves out.
    fn delta(&self, run: &Run, d: Delta) -> Option<Value> {
        if !run.prepared.parallel_calls {
            if let Delta::CallStart { index, .. } | Delta::CallArgs { index, .. } = &d {
                if *index > 0 {
                    return None;
                }
            }
        }
        Some(match d {
            Delta::Text(t) => json!({ "content": t }),
            Delta::Reasoning(t) => json!({ "reasoning_content": t }),
            Delta::CallStart { index, name } => json!({ "tool_calls": [{
                "index": index, "id": call_id(run.id, index), "type": "function", "function": { "name": name, "arguments": "" } }] }),
            Delta::CallArgs { index, text } => json!({ "tool_calls": [{ "index": index, "function": { "arguments": text } }] }),
        })
    }

    fn usage_chunk(&self, usage: &Usage) -> Value {
        let mut v = self.envelope(true, json!([]));
        v["usage"] = usage_json(usage);
        v
    }
}

/// The API's finish reason; an answer that ends with tool calls finishes with `tool_calls`.
fn finish_str(r: FinishReason, called: bool) -> &'static str {
    match r {
        FinishReason::Stop if called => "tool_calls",
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        // only a client that went away is aborted, and it reads nothing more
        FinishReason::Abort => "abort",
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
        // speculative decoding's guesses kept and rejected (OpenAI names them for predicted outputs)
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "accepted_prediction_tokens": u.accepted_prediction_tokens,
            "rejected_prediction_tokens": u.rejected_prediction_tokens,
        },
    })
}

/// One request's answer as it is generated.
struct Run {
    state: AppState,
    api: Api,
    id: u64,
    prepared: Prepared,
    parser: OutputParser,
    /// Characters of generated text before the current token (text completions' `text_offset`).
    chars_before: usize,
    /// Log-probability entries not yet sent.
    logprobs: Vec<LogprobEntry>,
}

/// One token's log-probability and its alternatives, before it is shaped for an API.
struct LogprobEntry {
    token: Alternative,
    top: Vec<Alternative>,
    /// Where the token's text starts in the generated text, in characters.
    text_offset: usize,
}

struct Alternative {
    bytes: Vec<u8>,
    logprob: f32,
}

impl Alternative {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.bytes).into_owned()
    }

    /// Chat's `{token, logprob, bytes}`.
    fn chat_json(&self) -> Value {
        json!({ "token": self.text(), "logprob": self.logprob, "bytes": self.bytes })
    }
}

/// Chat's `logprobs`: `{"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}`.
fn chat_logprobs(entries: &[LogprobEntry]) -> Value {
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let mut v = e.token.chat_json();
            v["top_logprobs"] = e.top.iter().map(Alternative::chat_json).collect();
            v
        })
        .collect();
    json!({ "content": content })
}

/// Text completions' (legacy) `logprobs`: parallel lists of tokens, their log-probabilities, the
/// alternatives as `{token: logprob}` maps, and each token's character offset in the text.
fn completion_logprobs(entries: &[LogprobEntry]) -> Value {
    let top: Vec<Value> = entries
        .iter()
        .map(|e| Value::Object(e.top.iter().map(|a| (a.text(), json!(a.logprob))).collect()))
        .collect();
    json!({
        "tokens": entries.iter().map(|e| e.token.text()).collect::<Vec<_>>(),
        "token_logprobs": entries.iter().map(|e| e.token.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
        "text_offset": entries.iter().map(|e| e.text_offset).collect::<Vec<_>>(),
    })
}

impl Run {
    fn new(state: &AppState, api: Api, id: u64, prepared: Prepared) -> (Run, Shape) {
        let prefix = if api == Api::Chat { "chatcmpl" } else { "cmpl" };
        let shape = Shape { api, id: format!("{prefix}-{id}"), created: unix_now(), model: state.model_id.clone() };
        let parser = OutputParser::new(prepared.parse.clone());
        let run = Run { state: state.clone(), api, id, prepared, parser, chars_before: 0, logprobs: Vec::new() };
        (run, shape)
    }

    /// The parsed pieces of the next text (the prefilled start of the answer before the first).
    fn parse(&mut self, text: &str) -> Vec<Delta> {
        let mut out = match self.prepared.prefill.take() {
            Some(p) => self.parser.push(&p),
            None => Vec::new(),
        };
        out.extend(self.parser.push(text));
        out
    }

    fn finish_parse(&mut self) -> Vec<Delta> {
        let mut out = self.parse("");
        out.extend(self.parser.finish());
        out
    }

    /// The answer's tool calls (only the first unless parallel calls were allowed).
    fn calls(&self) -> &[crate::output::Call] {
        let calls = self.parser.calls();
        if self.prepared.parallel_calls { calls } else { &calls[..calls.len().min(1)] }
    }

    /// Records a token's log-probabilities (if asked); returns the text to pass on.
    fn on_token(&mut self, id: u32, text: String, lp: Option<TokenLogprobs>) -> String {
        if let Some(lp) = lp {
            let alt = |id: u32, logprob: f32| Alternative { bytes: self.state.tokenizer.token_bytes(id, false), logprob };
            let top = lp.top.iter().map(|&(t, l)| alt(t, l)).collect();
            let token = alt(id, lp.logprob);
            // offsets count the tokens' own text (text held back for a stop string arrives later)
            let chars = String::from_utf8_lossy(&token.bytes).chars().count();
            self.logprobs.push(LogprobEntry { token, top, text_offset: self.chars_before });
            self.chars_before += chars;
        }
        text
    }

    /// The entries collected since the last call, as a choice's `logprobs` (null if none were asked).
    fn take_logprobs(&mut self) -> Value {
        if self.logprobs.is_empty() {
            return Value::Null;
        }
        let entries = std::mem::take(&mut self.logprobs);
        match self.api {
            Api::Chat => chat_logprobs(&entries),
            Api::Completion => completion_logprobs(&entries),
        }
    }
}

/// The whole answer as one response.
async fn collect(mut run: Run, mut events: Metered, shape: &Shape) -> Result<Value, ApiError> {
    while let Some(ev) = events.recv().await {
        match ev {
            Event::Token { id, text: delta, logprobs } => {
                let text = run.on_token(id, delta, logprobs);
                run.parse(&text);
            }
            Event::Finished { reason, usage, .. } => {
                run.finish_parse();
                let reason = finish_str(reason, !run.calls().is_empty());
                let logprobs = run.take_logprobs();
                return Ok(shape.full(&run, reason, &usage, logprobs));
            }
            Event::Error(e) => return Err(ApiError::internal(e)),
        }
    }
    Err(ApiError::engine_stopped())
}

/// Server-sent events: text chunks as it is decoded, a finish chunk, optionally a usage chunk, then
/// `[DONE]`. A failure midway is sent as an error event (`data: {"error": {...}}`, OpenAI's shape) and
/// ends the stream without `[DONE]`. A client that goes away
/// drops the stream; the request is aborted at its next token.
fn stream(mut run: Run, mut events: Metered, shape: Shape, include_usage: bool) -> impl IntoResponse {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<SseEvent, Infallible>>(16);
    tokio::spawn(async move {
        let send = |v: Value| {
            let tx = tx.clone();
            async move { tx.send(Ok(SseEvent::default().data(v.to_string()))).await.is_ok() }
        };
        if shape.api == Api::Chat && !send(shape.chunk(json!({ "role": "assistant", "content": "" }), None, Value::Null)).await {
            return run.state.engine.abort(run.id);
        }
        while let Some(ev) = events.recv().await {
            match ev {
                Event::Token { id, text, logprobs } => {
                    let text = run.on_token(id, text, logprobs);
                    for delta in run.parse(&text) {
                        let Some(delta) = shape.delta(&run, delta) else { continue };
                        if !send(shape.chunk(delta, None, run.take_logprobs())).await {
                            return run.state.engine.abort(run.id);
                        }
                    }
                }
                Event::Finished { reason, usage, .. } => {
                    for delta in run.finish_parse() {
                        if let Some(delta) = shape.delta(&run, delta) {
                            send(shape.chunk(delta, None, Value::Null)).await;
                        }
                    }
                    let reason = finish_str(reason, !run.calls().is_empty());
                    send(shape.chunk(json!({}), Some(reason), run.take_logprobs())).await;
                    if include_usage {
                        send(shape.usage_chunk(&usage)).await;
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
        // The engine dropped the request without a last event (it stopped): say so rather than end
        // the stream as if it were complete.
        send(ApiError::engine_stopped().body()).await;
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).keep_alive(KeepAlive::default())
}

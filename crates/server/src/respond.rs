//! The engine's token events as an OpenAI response: one JSON body, or server-sent events. Chat and text
//! completions differ only in the shapes (`Api`).

use crate::error::ApiError;
use crate::params::{unix_now, CommonParams};
use crate::stop::{StopMatcher, StopOutcome};
use crate::AppState;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use reckon_engine::engine::{Event, FinishReason, GenerateRequest, TokenLogprobs, Usage};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Chat,
    Completion,
}

/// Submits the request and answers in the shape `api` and `params.stream` ask for.
pub async fn generate(state: &AppState, api: Api, params: &CommonParams, req: GenerateRequest) -> Result<Response, ApiError> {
    let stops = StopMatcher::new(params.stops()?);
    let (id, events) = state.engine.submit(req)?;
    let prefix = if api == Api::Chat { "chatcmpl" } else { "cmpl" };
    let shape = Shape { api, id: format!("{prefix}-{id}"), created: unix_now(), model: state.model_id.clone() };
    let run = Run { state: state.clone(), id, stops, stopped_by_string: false, logprobs: Vec::new() };
    if params.stream {
        Ok(stream(run, events, shape, params.include_usage()).into_response())
    } else {
        Ok(Json(collect(run, events, &shape).await?).into_response())
    }
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

    fn full(&self, text: String, reason: &str, usage: &Usage, logprobs: Value) -> Value {
        let choice = match self.api {
            Api::Chat => json!({ "index": 0, "message": { "role": "assistant", "content": text }, "finish_reason": reason, "logprobs": logprobs }),
            Api::Completion => json!({ "index": 0, "text": text, "finish_reason": reason, "logprobs": null }),
        };
        let mut v = self.envelope(false, json!([choice]));
        v["usage"] = usage_json(usage);
        v
    }

    /// A streamed chunk: text (the first chat chunk also names the role) and/or a finish reason.
    fn chunk(&self, text: Option<&str>, first: bool, finish: Option<&str>, logprobs: Value) -> Value {
        let choice = match self.api {
            Api::Chat => {
                let delta = match (text, first) {
                    (Some(t), true) => json!({ "role": "assistant", "content": t }),
                    (Some(t), false) => json!({ "content": t }),
                    (None, _) => json!({}),
                };
                json!({ "index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs })
            }
            Api::Completion => json!({ "index": 0, "text": text.unwrap_or(""), "finish_reason": finish, "logprobs": null }),
        };
        self.envelope(true, json!([choice]))
    }

    fn usage_chunk(&self, usage: &Usage) -> Value {
        let mut v = self.envelope(true, json!([]));
        v["usage"] = usage_json(usage);
        v
    }
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

/// One request's text as it is generated, with stop strings applied.
struct Run {
    state: AppState,
    id: u64,
    stops: StopMatcher,
    stopped_by_string: bool,
    /// Chat-format log-probability entries not yet sent.
    logprobs: Vec<Value>,
}

impl Run {
    /// The text to pass on for a token; a stop string aborts the generation.
    fn on_token(&mut self, id: u32, delta: &str, lp: Option<TokenLogprobs>) -> String {
        if self.stopped_by_string {
            return String::new();
        }
        if let Some(lp) = lp {
            let entry = |id: u32, logprob: f32| {
                let bytes = self.state.tokenizer.token_bytes(id, false);
                json!({ "token": String::from_utf8_lossy(&bytes), "logprob": logprob, "bytes": bytes })
            };
            let mut e = entry(id, lp.logprob);
            e["top_logprobs"] = lp.top.iter().map(|&(t, l)| entry(t, l)).collect();
            self.logprobs.push(e);
        }
        match self.stops.push(delta) {
            StopOutcome::Continue(t) => t,
            StopOutcome::Stopped(t) => {
                self.stopped_by_string = true;
                self.state.engine.abort(self.id);
                t
            }
        }
    }

    /// The entries collected since the last call, as a choice's `logprobs` (null if none were asked).
    fn take_logprobs(&mut self) -> Value {
        if self.logprobs.is_empty() {
            Value::Null
        } else {
            json!({ "content": std::mem::take(&mut self.logprobs) })
        }
    }

    /// The held-back text and the finish reason at the end.
    fn on_finish(&mut self, reason: FinishReason) -> (String, &'static str) {
        if self.stopped_by_string {
            (String::new(), "stop")
        } else {
            (self.stops.finish(), finish_str(reason))
        }
    }
}

/// The whole answer as one response.
async fn collect(mut run: Run, mut events: UnboundedReceiver<Event>, shape: &Shape) -> Result<Value, ApiError> {
    let mut text = String::new();
    while let Some(ev) = events.recv().await {
        match ev {
            Event::Token { id, text: delta, logprobs } => text.push_str(&run.on_token(id, &delta, logprobs)),
            Event::Finished { reason, usage, timings } => {
                run.state.metrics.finished(&timings);
                let (rest, reason) = run.on_finish(reason);
                text.push_str(&rest);
                return Ok(shape.full(text, reason, &usage, run.take_logprobs()));
            }
            Event::Error(e) => return Err(ApiError::internal(e)),
        }
    }
    Err(ApiError::internal("the engine stopped before the request finished"))
}

/// Server-sent events: text chunks as it is decoded, a finish chunk, optionally a usage chunk, then
/// `[DONE]`. A failure midway is sent as an error event and ends the stream. A client that goes away
/// drops the stream; the request is aborted at its next token.
fn stream(mut run: Run, mut events: UnboundedReceiver<Event>, shape: Shape, include_usage: bool) -> impl IntoResponse {
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<SseEvent, Infallible>>(16);
    tokio::spawn(async move {
        let send = |v: Value| {
            let tx = tx.clone();
            async move { tx.send(Ok(SseEvent::default().data(v.to_string()))).await.is_ok() }
        };
        if shape.api == Api::Chat && !send(shape.chunk(Some(""), true, None, Value::Null)).await {
            return run.state.engine.abort(run.id);
        }
        let mut last_token: Option<Instant> = None;
        while let Some(ev) = events.recv().await {
            match ev {
                Event::Token { id, text, logprobs } => {
                    let now = Instant::now();
                    if let Some(prev) = last_token.replace(now) {
                        run.state.metrics.inter_token(now - prev);
                    }
                    let out = run.on_token(id, &text, logprobs);
                    if !out.is_empty() && !send(shape.chunk(Some(&out), false, None, run.take_logprobs())).await {
                        return run.state.engine.abort(run.id);
                    }
                }
                Event::Finished { reason, usage, timings } => {
                    run.state.metrics.finished(&timings);
                    let (rest, reason) = run.on_finish(reason);
                    if !rest.is_empty() {
                        send(shape.chunk(Some(&rest), false, None, run.take_logprobs())).await;
                    }
                    send(shape.chunk(None, false, Some(reason), run.take_logprobs())).await;
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
    });
    Sse::new(tokio_stream::wrappers::ReceiverStream::new(rx)).keep_alive(KeepAlive::default())
}

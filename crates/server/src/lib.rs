//! reckon's HTTP server: OpenAI-compatible endpoints over the engine. HTTP -> validation -> engine handle;
//! the engine's token events come back as JSON or server-sent events.

pub mod front;
pub mod kv_events;
mod chat;
mod error;
mod fields;
mod messages;
mod metrics;
mod output;
mod params;
mod respond;
mod responses;
mod tools;

pub use params::SamplingDefaults;
pub use error::ApiError;
pub use metrics::Metrics;
pub use respond::{stream_events, Api};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use reckon_engine::engine::EngineHandle;
use reckon_engine::template::ChatTemplate;
use reckon_engine::tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::future::IntoFuture;
use std::sync::Arc;

/// What every handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
    /// The name clients pass as `model`, and the one answers name.
    pub model_id: String,
    /// Other names accepted as `model` (`--served-model-name`, `--alias`): clients that insist on their
    /// own model id (an agent's background "haiku" slot) are served by the one model.
    pub aliases: Vec<String>,
    /// With keys, API requests must carry one: `Authorization: Bearer KEY` or `x-api-key: KEY`
    /// (`/health` and `/metrics` excepted). Compared in constant time.
    pub api_keys: Vec<String>,
    /// Counts a request may carry besides its size (`max_body_bytes`).
    pub limits: RequestLimits,
    /// Log each request's prompt text (off: the log has lengths and tool names, never a prompt).
    pub log_prompts: bool,
    pub metrics: Arc<Metrics>,
    /// Responses kept for the Responses API's `previous_response_id` and `GET /v1/responses/{id}`.
    pub responses: Arc<responses::ResponseStore>,
    /// Compiles grammars for constrained decoding; built at the first constrained request.
    pub grammar: Arc<std::sync::OnceLock<Result<reckon_engine::grammar::GrammarCompiler, String>>>,
    /// Largest request body accepted; larger ones get 413 in OpenAI's error shape.
    pub max_body_bytes: usize,
    /// What a request gets for a sampling field it omits (every API alike).
    pub sampling: params::SamplingDefaults,
    /// What the router-facing endpoints (`/server_info`, `/model_info`) say about the model.
    pub model_card: ModelCard,
    /// The KV-cache event publisher's counters, when events are published (`/metrics`).
    pub kv_events: Option<Arc<kv_events::KvEventStats>>,
}

/// The model as the router-facing endpoints describe it.
#[derive(Clone, Debug, Default)]
pub struct ModelCard {
    /// The GGUF file served.
    pub path: String,
    /// `general.architecture` (llama, qwen2, ...).
    pub architecture: String,
    pub vocab_size: usize,
}

/// The largest counts a request may carry; each is a 400 in the API's own error shape, naming the field.
/// Far above what agents send (Claude Code and Codex send tens of tools and hundreds of messages), low
/// enough that a hostile request cannot make the template renderer and tokenizer work for minutes.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RequestLimits {
    pub max_messages: usize,
    pub max_tools: usize,
}

impl Default for RequestLimits {
    fn default() -> Self {
        RequestLimits { max_messages: 10_000, max_tools: 1_024 }
    }
}

/// `AppState::max_body_bytes` unless told otherwise: agents' requests carry long histories and tool
/// schemas (hundreds of KiB), far below this.
pub const DEFAULT_MAX_BODY_BYTES: usize = 32 << 20;

pub fn router(state: AppState) -> Router {
    let limit = state.max_body_bytes;
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(|State(state): State<AppState>| async move { ([(axum::http::header::CONTENT_TYPE, metrics::CONTENT_TYPE)], metrics::render(&state)) }))
        .route("/v1/models", get(models))
        // what routers in front of workers read (SGLang's router: server and model info, load; vLLM's
        // and SGLang's cache reset)
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .route("/get_load", get(get_load))
        .route("/flush_cache", post(reset_prefix_cache).get(reset_prefix_cache))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(create_response))
        .route("/v1/responses/{id}", get(get_response).delete(delete_response))
        .route("/v1/messages", post(anthropic_messages))
        .route("/v1/messages/count_tokens", post(anthropic_count_tokens))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// How long the HTTP side has, once the engine failed, to answer what was in flight (the error events,
/// the ends of open streams) before `serve` returns anyway.
pub const FAILED_ENGINE_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Serves `router` on `listener` until `stop` resolves (a signal; it should shut the engine down) or the
/// engine fails. Then new connections are refused, and what is open finishes: after a failure every
/// request in flight has had its error event in its API's shape (`EngineHandle::failure`), and at most
/// `FAILED_ENGINE_GRACE` later this returns the failure, for the process to exit non-zero so that its
/// supervisor starts a new one (vLLM's engine-core death does the same). `Ok(None)`: a normal stop.
pub async fn serve<L: axum::serve::Listener>(listener: L, router: Router, engine: EngineHandle, stop: impl std::future::Future<Output = ()> + Send + 'static) -> std::io::Result<Option<String>>
where
    L::Addr: std::fmt::Debug,
{
    let failed = engine.clone();
    let shutdown = async move {
        tokio::select! {
            _ = stop => {}
            why = failed.failed() => tracing::error!("stopping the server: {why}"),
        }
    };
    let server = axum::serve(listener, router).with_graceful_shutdown(shutdown);
    let failed = engine.clone();
    let grace = async move {
        failed.failed().await;
        tokio::time::sleep(FAILED_ENGINE_GRACE).await;
    };
    tokio::select! {
        served = server.into_future() => served?,
        _ = grace => tracing::warn!("connections still open {} s after the engine failed are dropped", FAILED_ENGINE_GRACE.as_secs()),
    }
    Ok(engine.failure())
}

/// "ok"; 503 once a shutdown has started, so a load balancer's readiness probe stops sending traffic
/// that would be refused, and 503 with why once the engine failed, so a liveness probe restarts it.
async fn health(State(state): State<AppState>) -> Response {
    if let Some(why) = state.engine.failure() {
        return (axum::http::StatusCode::SERVICE_UNAVAILABLE, why).into_response();
    }
    if state.engine.is_draining() {
        return (axum::http::StatusCode::SERVICE_UNAVAILABLE, "draining").into_response();
    }
    // still 200 in a slow state (the server works, slower): the detail is for people and dashboards
    let s = state.engine.stats();
    if s.slow_state.load(std::sync::atomic::Ordering::Relaxed) {
        let since = s.slow_state_since_ms.load(std::sync::atomic::Ordering::Relaxed);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
        return format!("ok (slow state for {:.1} s: steps run on the engine thread alone)", now.saturating_sub(since) as f64 / 1e3).into_response();
    }
    "ok".into_response()
}

/// With `--api-key`: `Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic). Every key is
/// compared, each in constant time, so the answer's timing says nothing about how much of a key matched
/// or which key was close.
fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    if state.api_keys.is_empty() {
        return Ok(());
    }
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let given = header("authorization").and_then(|v| v.strip_prefix("Bearer ")).or_else(|| header("x-api-key")).unwrap_or("");
    let mut ok = subtle::Choice::from(0);
    for key in &state.api_keys {
        ok |= key_matches(key, given);
    }
    if bool::from(ok) {
        Ok(())
    } else {
        Err(ApiError::unauthorized())
    }
}

/// Whether `given` is `key`, in a time that depends only on the key's length: every byte of the key is
/// compared (with 0 past the end of `given`) and the lengths' equality is folded in; no early return.
fn key_matches(key: &str, given: &str) -> subtle::Choice {
    use subtle::ConstantTimeEq;
    let (k, g) = (key.as_bytes(), given.as_bytes());
    let mut eq = (k.len() as u64).ct_eq(&(g.len() as u64));
    for (i, &b) in k.iter().enumerate() {
        eq &= b.ct_eq(g.get(i).unwrap_or(&0));
    }
    eq
}

impl AppState {
    /// Whether `name` is a name this server answers to.
    pub fn serves(&self, name: &str) -> bool {
        name == self.model_id || self.aliases.iter().any(|a| a == name)
    }

    /// A constraint for `grammar`, or a 400 naming `param` if it does not compile.
    pub fn constraint(&self, grammar: &reckon_engine::grammar::Grammar, param: &str) -> Result<reckon_engine::grammar::Constraint, ApiError> {
        let compiler = self.grammar.get_or_init(|| {
            reckon_engine::grammar::GrammarCompiler::new(self.tokenizer.clone(), self.engine.limits().vocab_size)
        });
        let compiler = compiler.as_ref().map_err(|e| ApiError::invalid(format!("constrained decoding is not available for this model: {e}"), Some(param)))?;
        compiler.compile(grammar).map_err(|e| ApiError::invalid(format!("{param}: {e}"), Some(param)))
    }

    /// The grammar an answer is held to: a forced tool call's (named or `required`), else the response
    /// format's (`format_param` names the field for errors), else none.
    pub(crate) fn answer_constraint(&self, tools: &tools::ToolSet, format: Option<&reckon_engine::grammar::Grammar>, format_param: &str) -> Result<Option<reckon_engine::grammar::Constraint>, ApiError> {
        match (tools.grammar(), format) {
            (Some(g), _) => self.constraint(&g, "tools").map(Some),
            (None, Some(g)) => self.constraint(g, format_param).map(Some),
            (None, None) => Ok(None),
        }
    }

    /// The 404 for a model name this server does not answer to.
    pub fn unknown_model(&self, name: &str) -> ApiError {
        let msg = format!("the model '{name}' does not exist; this server serves '{}'", self.model_id);
        ApiError::not_found(msg, Some("model"), "model_not_found")
    }
}

async fn models(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&state, &headers) {
        return e.into_response();
    }
    let max_model_len = state.engine.config().max_model_len;
    let data: Vec<_> = std::iter::once(&state.model_id)
        .chain(&state.aliases)
        .map(|id| json!({ "id": id, "object": "model", "created": 0, "owned_by": "reckon", "max_model_len": max_model_len, "sampling_defaults": sampling_json(&state.sampling) }))
        .collect();
    Json(json!({ "object": "list", "data": data })).into_response()
}

/// The server's configuration as SGLang's `/server_info` names it (its router reads the model name from
/// it), with reckon's own under `reckon`.
async fn server_info(State(state): State<AppState>) -> Json<Value> {
    let c = state.engine.config();
    Json(json!({
        "served_model_name": state.model_id,
        "model_path": state.model_card.path,
        "context_length": c.max_model_len,
        "max_running_requests": c.max_running,
        "max_queued_requests": c.max_waiting,
        "max_total_num_tokens": c.num_blocks * c.block_size,
        "page_size": c.block_size,
        "kv_cache_dtype": c.kv_dtypes.name(),
        "disable_radix_cache": !c.prefix_caching,
        "chunked_prefill_size": c.max_batch_tokens,
        "tp_size": 1,
        "dp_size": 1,
        "version": env!("CARGO_PKG_VERSION"),
        "reckon": { "engine": "reckon", "architecture": state.model_card.architecture, "aliases": state.aliases },
    }))
}

/// The model as SGLang's `/model_info` describes it. `tokenizer_path` is null: the tokenizer is inside
/// the GGUF file, which a router cannot load.
async fn model_info(State(state): State<AppState>) -> Json<Value> {
    Json(json!({
        "model_path": state.model_card.path,
        "tokenizer_path": null,
        "is_generation": true,
        "served_model_name": state.model_id,
        "max_context_length": state.engine.config().max_model_len,
        "vocab_size": state.model_card.vocab_size,
        "model_type": state.model_card.architecture,
        "architectures": [state.model_card.architecture],
        "weight_version": "default",
        "preferred_sampling_params": null,
    }))
}

/// Load as SGLang's `/get_load` reports it per data-parallel rank (its router's power-of-two policy):
/// requests running and waiting, and the tokens their KV blocks hold.
async fn get_load(State(state): State<AppState>) -> Json<Value> {
    use std::sync::atomic::Ordering::Relaxed;
    let s = state.engine.stats();
    let (running, waiting) = (s.running.load(Relaxed), s.waiting.load(Relaxed));
    let used_blocks = s.blocks_used.load(Relaxed);
    Json(json!([{ "dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": used_blocks * state.engine.config().block_size }]))
}

/// Drops the prefix cache in memory (vLLM's `/reset_prefix_cache`, SGLang's `/flush_cache`): 200 when
/// it was, 400 while requests hold blocks (as SGLang answers). Needs the API key when there are keys.
async fn reset_prefix_cache(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&state, &headers) {
        return e.into_response();
    }
    let engine = state.engine.clone();
    match tokio::task::spawn_blocking(move || engine.reset_prefix_cache()).await {
        Ok(true) => "Cache flushed.\n".into_response(),
        _ => (axum::http::StatusCode::BAD_REQUEST, "Cache not flushed: requests are running.\n").into_response(),
    }
}

/// The sampling a request gets for fields it omits, by the OpenAI extension names (`/v1/models`).
fn sampling_json(d: &params::SamplingDefaults) -> Value {
    let p = &d.params;
    json!({ "temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, "repetition_penalty": p.repetition_penalty,
            "presence_penalty": p.presence_penalty, "frequency_penalty": p.frequency_penalty, "repeat_last_n": if p.penalty_last_n == 0 { -1 } else { p.penalty_last_n as i64 }, "seed": d.seed })
}

/// Refusals that need no look at the request, checked before its prompt is built: a shutdown (503) or
/// a full queue (429 with `Retry-After`). Under a flood the refused requests then cost the async
/// workers no parsing, template rendering or tokenizing. The engine checks both again at submit.
fn admit(state: &AppState) -> Result<(), ApiError> {
    use reckon_engine::engine::RequestError;
    if state.engine.is_draining() {
        return Err(ApiError::from_request(RequestError::ShuttingDown, error::Wire::Chat));
    }
    match state.engine.queue_full() {
        Some(waiting) => Err(ApiError::from_request(RequestError::QueueFull { waiting }, error::Wire::Chat)),
        None => Ok(()),
    }
}

/// The body of a request that generates (`body_of`: authorized, within the size limit), once admitted
/// (`admit`); nothing of it is parsed yet.
fn generation_body(state: &AppState, headers: &HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    let body = body_of(state, headers, body)?;
    admit(state)?;
    Ok(body)
}

/// The request body, or the error that says why there is none (a body over the limit: 413).
fn body_of(state: &AppState, headers: &HeaderMap, body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    authorize(state, headers)?;
    body.map_err(|e| match e.status() {
        axum::http::StatusCode::PAYLOAD_TOO_LARGE => ApiError::too_large(state.max_body_bytes),
        _ => ApiError::invalid(format!("cannot read the request body: {e}"), None),
    })
}

/// Runs `prepare` on tokio's blocking pool: parsing a body, rendering the chat template, tokenizing and
/// compiling a grammar grow with the request (a 30 MB prompt takes seconds), and on an async worker they
/// would hold up every other connection that worker serves.
async fn off_workers<T: Send + 'static>(state: &AppState, body: Bytes, prepare: fn(&AppState, &[u8]) -> Result<T, ApiError>) -> Result<T, ApiError> {
    let state = state.clone();
    match tokio::task::spawn_blocking(move || prepare(&state, &body)).await {
        Ok(prepared) => prepared,
        Err(e) => Err(ApiError::internal(format!("preparing the request failed: {e}"))),
    }
}

/// Chat and text completions: the body, made ready by `prepare` off the async workers, then answered.
async fn openai_generate(state: &AppState, headers: &HeaderMap, body: Result<Bytes, BytesRejection>, prepare: fn(&AppState, &[u8]) -> Result<respond::Ready, ApiError>) -> Response {
    let answer = match generation_body(state, headers, body) {
        Ok(body) => match off_workers(state, body, prepare).await {
            Ok(ready) => respond::generate(state, ready).await,
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    };
    answer.unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(State(state): State<AppState>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    openai_generate(&state, &headers, body, chat::prepare_chat).await
}

async fn completions(State(state): State<AppState>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    openai_generate(&state, &headers, body, chat::prepare_completions).await
}

/// Anthropic's endpoints answer errors in Anthropic's shape.
async fn anthropic_messages(State(state): State<AppState>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let answer = match generation_body(&state, &headers, body) {
        Ok(body) => match off_workers(&state, body, messages::prepare).await {
            Ok(ready) => messages::messages(&state, ready).await,
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    };
    answer.unwrap_or_else(ApiError::into_anthropic_response)
}

async fn anthropic_count_tokens(State(state): State<AppState>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let answer = match body_of(&state, &headers, body) {
        Ok(body) => off_workers(&state, body, messages::count_tokens).await,
        Err(e) => Err(e),
    };
    answer.unwrap_or_else(ApiError::into_anthropic_response)
}

async fn create_response(State(state): State<AppState>, headers: HeaderMap, body: Result<Bytes, BytesRejection>) -> Response {
    let answer = match generation_body(&state, &headers, body) {
        Ok(body) => match off_workers(&state, body, responses::prepare).await {
            Ok(ready) => responses::create(&state, ready).await,
            Err(e) => Err(e),
        },
        Err(e) => Err(e),
    };
    answer.unwrap_or_else(IntoResponse::into_response)
}

async fn get_response(State(state): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    authorize(&state, &headers).and_then(|_| responses::get(&state, &id)).unwrap_or_else(IntoResponse::into_response)
}

async fn delete_response(State(state): State<AppState>, headers: HeaderMap, Path(id): Path<String>) -> Response {
    authorize(&state, &headers).and_then(|_| responses::delete(&state, &id)).unwrap_or_else(IntoResponse::into_response)
}

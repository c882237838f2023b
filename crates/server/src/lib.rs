//! reckon's HTTP server: OpenAI-compatible endpoints over the engine. HTTP -> validation -> engine handle;
//! the engine's token events come back as JSON or server-sent events.

mod chat;
mod error;
mod metrics;
mod params;
mod respond;
mod stop;

pub use error::ApiError;
pub use metrics::Metrics;
pub use respond::{stream_events, Api};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use reckon_engine::engine::EngineHandle;
use reckon_engine::template::ChatTemplate;
use reckon_engine::tokenizer::Tokenizer;
use serde_json::json;
use std::sync::Arc;

/// What every handler needs; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub engine: EngineHandle,
    pub tokenizer: Arc<Tokenizer>,
    pub template: Arc<ChatTemplate>,
    /// The name clients pass as `model`.
    pub model_id: String,
    /// With a key, requests must carry `Authorization: Bearer KEY` (`/health` and `/metrics` excepted).
    pub api_key: Option<String>,
    pub metrics: Arc<Metrics>,
}

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/metrics", get(|State(state): State<AppState>| async move { metrics::render(&state) }))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .with_state(state)
}

fn authorize(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &state.api_key else { return Ok(()) };
    let given = headers.get("authorization").and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    if given == Some(key.as_str()) {
        Ok(())
    } else {
        Err(ApiError::unauthorized())
    }
}

async fn models(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if let Err(e) = authorize(&state, &headers) {
        return e.into_response();
    }
    Json(json!({
        "object": "list",
        "data": [{ "id": state.model_id, "object": "model", "created": 0, "owned_by": "reckon",
                   "max_model_len": state.engine.config().max_model_len }],
    }))
    .into_response()
}

async fn chat_completions(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(e) = authorize(&state, &headers) {
        return e.into_response();
    }
    chat::chat_completions(&state, &body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(state): State<AppState>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(e) = authorize(&state, &headers) {
        return e.into_response();
    }
    chat::completions(&state, &body).await.unwrap_or_else(IntoResponse::into_response)
}

//! Errors as OpenAI shapes them: `{"error": {"message", "type", "param", "code"}}` with the HTTP status a
//! client library maps to its exception classes. The engine's refusals are mapped in one function
//! (`ApiError::from_request`); the server's own (authentication, the body, the model name) are made here.

use crate::Api;

/// The API a request came in on, which decides what its fields are called.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    Chat,
    Completion,
    Responses,
    Messages,
}

impl From<Api> for Wire {
    fn from(api: Api) -> Wire {
        match api {
            Api::Chat => Wire::Chat,
            Api::Completion => Wire::Completion,
        }
    }
}
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use reckon_engine::engine::{Field, RequestError};
use serde_json::json;

/// Seconds a client is told to wait after a 429 (the queue drains in seconds at these model sizes).
const RETRY_AFTER_SECONDS: u64 = 1;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, ...
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// `Retry-After` seconds (429 answers).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "invalid_request_error", param: param.map(str::to_string), code: None, retry_after: None }
    }

    pub fn not_found(message: impl Into<String>, param: Option<&str>, code: &'static str) -> Self {
        ApiError { status: StatusCode::NOT_FOUND, code: Some(code), ..Self::invalid(message, param) }
    }

    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            kind: "authentication_error",
            code: Some("invalid_api_key"),
            ..Self::invalid("missing or wrong API key: send 'Authorization: Bearer KEY' or 'x-api-key: KEY'", None)
        }
    }

    /// A body over the server's size limit.
    pub fn too_large(limit: usize) -> Self {
        ApiError { status: StatusCode::PAYLOAD_TOO_LARGE, code: Some("request_too_large"), ..Self::invalid(format!("the request body is larger than {limit} bytes"), None) }
    }

    /// A content part no model here reads (an image, audio, a file): refused, never dropped, so a client
    /// does not get an answer about a picture the model never saw.
    pub fn media(kind: &str, param: &str) -> Self {
        Self::invalid(format!("{param}: a content part of type '{kind}': this model takes text only"), Some(param))
    }

    /// The engine dropped a request without its last event (it stopped).
    pub fn engine_stopped() -> Self {
        Self::internal("the engine stopped before the request finished")
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, kind: "server_error", ..Self::invalid(message, None) }
    }

    /// The engine's refusal, for a request of `api` (which names the fields).
    pub fn from_request(e: RequestError, api: impl Into<Wire>) -> Self {
        let api = api.into();
        let message = e.to_string();
        match e {
            RequestError::Invalid { field, .. } => Self::invalid(message, Some(param_name(field, api))),
            RequestError::QueueFull { .. } => ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                kind: "rate_limit_error",
                code: Some("queue_full"),
                retry_after: Some(RETRY_AFTER_SECONDS),
                ..Self::invalid(message, None)
            },
            RequestError::ShuttingDown | RequestError::Stopped | RequestError::Failed(_) => {
                ApiError { status: StatusCode::SERVICE_UNAVAILABLE, kind: "server_error", code: Some("unavailable"), ..Self::invalid(message, None) }
            }
        }
    }

    /// Anthropic's error type for this error.
    pub fn anthropic_type(&self) -> &'static str {
        match self.status.as_u16() {
            400 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 | 529 => "overloaded_error",
            _ => "api_error",
        }
    }

    /// Anthropic's shape: `{"type": "error", "error": {"type", "message"}}` (also a stream's `error` event).
    /// Anthropic's errors have no `param`: the field at fault leads the message, as Anthropic's own
    /// ("max_tokens: Field required").
    pub fn anthropic_body(&self) -> serde_json::Value {
        let message = match &self.param {
            Some(p) if !self.message.starts_with(p.as_str()) => format!("{p}: {}", self.message),
            _ => self.message.clone(),
        };
        json!({ "type": "error", "error": { "type": self.anthropic_type(), "message": message } })
    }

    /// The answer in Anthropic's shape, with the same status (and `Retry-After`).
    pub fn into_anthropic_response(self) -> Response {
        let mut response = (self.status, Json(self.anthropic_body())).into_response();
        if let Some(s) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, s.into());
        }
        response
    }

    /// The `error` object, also sent as a server-sent event when a stream fails midway.
    pub fn body(&self) -> serde_json::Value {
        json!({ "error": { "message": self.message, "type": self.kind, "param": self.param, "code": self.code } })
    }
}

/// What each API calls an engine field.
fn param_name(field: Field, api: Wire) -> &'static str {
    match field {
        Field::Prompt => match api {
            Wire::Chat | Wire::Messages => "messages",
            Wire::Completion => "prompt",
            Wire::Responses => "input",
        },
        Field::MaxTokens if api == Wire::Responses => "max_output_tokens",
        Field::MaxTokens => "max_tokens",
        Field::Stop if api == Wire::Messages => "stop_sequences",
        Field::Stop => "stop",
        Field::StopTokenIds => "stop_token_ids",
        Field::Temperature => "temperature",
        Field::TopP => "top_p",
        Field::TopK => "top_k",
        Field::MinP => "min_p",
        Field::RepetitionPenalty => "repetition_penalty",
        Field::PresencePenalty => "presence_penalty",
        Field::FrequencyPenalty => "frequency_penalty",
        Field::Logprobs => match api {
            Wire::Completion => "logprobs",
            _ => "top_logprobs",
        },
        Field::CacheSalt => "cache_salt",
        Field::SpecPrefill => "reckon.spec_prefill",
        Field::Prediction => "prediction",
        Field::ReasoningBudget => "thinking.budget_tokens",
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            response.headers_mut().insert(header::RETRY_AFTER, s.into());
        }
        response
    }
}

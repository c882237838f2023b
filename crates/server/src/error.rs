//! Errors as OpenAI shapes them: `{"error": {"message", "type", "param", "code"}}` with the HTTP status a
//! client library maps to its exception classes.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use reckon_engine::engine::SubmitError;
use serde_json::json;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `authentication_error`, ...
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    pub fn invalid(message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), kind: "invalid_request_error", param: param.map(str::to_string), code: None }
    }

    pub fn not_found(message: impl Into<String>, param: Option<&str>, code: &'static str) -> Self {
        ApiError { status: StatusCode::NOT_FOUND, code: Some(code), ..Self::invalid(message, param) }
    }

    pub fn unauthorized() -> Self {
        ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "missing or wrong API key: send 'Authorization: Bearer KEY'".into(),
            kind: "authentication_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn internal(message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::INTERNAL_SERVER_ERROR, message: message.into(), kind: "server_error", param: None, code: None }
    }

    /// The `error` object, also sent as a server-sent event when a stream fails midway.
    pub fn body(&self) -> serde_json::Value {
        json!({ "error": { "message": self.message, "type": self.kind, "param": self.param, "code": self.code } })
    }
}

impl ApiError {
    /// The engine's refusal; `prompt_param` names the field the prompt came from (`messages`, `prompt`).
    pub fn from_submit(e: SubmitError, prompt_param: &str) -> Self {
        match e {
            SubmitError::QueueFull { .. } => ApiError { status: StatusCode::TOO_MANY_REQUESTS, kind: "rate_limit_error", code: Some("queue_full"), ..Self::invalid(e.to_string(), None) },
            SubmitError::Prompt(m) => Self::invalid(m, Some(prompt_param)),
            SubmitError::NoNewTokens => Self::invalid(e.to_string(), Some("max_tokens")),
            SubmitError::Sampling(m) => Self::invalid(m, None),
            SubmitError::Stopped => ApiError { status: StatusCode::SERVICE_UNAVAILABLE, ..Self::internal(e.to_string()) },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}

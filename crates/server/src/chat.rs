//! `POST /v1/chat/completions` and `POST /v1/completions`: the request bodies, the chat template or the
//! raw prompt, then `respond::generate`.

use crate::error::ApiError;
use crate::params::CommonParams;
use crate::respond::{Api, Prepared, Ready};
use crate::tools::{self, Tool, ToolChoice, ToolSet};
use crate::AppState;
use reckon_engine::grammar::Grammar;
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
    #[serde(default)]
    tools: Vec<ChatTool>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    response_format: Option<Value>,
    /// Extra variables for the chat template (vLLM's, SGLang's and llama-server's name): Qwen3's
    /// `enable_thinking`, for one.
    #[serde(default)]
    chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    #[serde(flatten)]
    params: CommonParams,
}

#[derive(Debug, Deserialize)]
struct ChatTool {
    #[serde(rename = "type")]
    kind: String,
    function: Option<FunctionDef>,
}

#[derive(Debug, Deserialize)]
struct FunctionDef {
    name: String,
    description: Option<String>,
    parameters: Option<Value>,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    /// Absent or null on an assistant message that only calls tools.
    #[serde(default)]
    content: Option<Content>,
    #[serde(default)]
    tool_calls: Vec<WireCall>,
    tool_call_id: Option<String>,
    name: Option<String>,
    reasoning_content: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireCall {
    function: WireFunction,
}

#[derive(Debug, Deserialize)]
struct WireFunction {
    name: String,
    /// A JSON text (OpenAI's shape); some clients send the object itself.
    #[serde(default)]
    arguments: Value,
}

/// A message's content: a string, or a list of parts, which must be text (`{"type": "text", "text"}`).
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
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8], skeleton: Value) -> Result<T, ApiError> {
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

/// The text of content parts; an image, audio or file part is a 400 (`ApiError::media`), as is a part
/// of a type OpenAI does not define.
fn parts_text(parts: &[Value]) -> Result<String, ApiError> {
    let mut text = String::new();
    for p in parts {
        match p.get("type").and_then(Value::as_str) {
            Some("text") | None => text.push_str(p.get("text").and_then(Value::as_str).ok_or_else(|| ApiError::invalid("a text content part needs 'text'", Some("messages")))?),
            Some(kind @ ("image_url" | "input_audio" | "file" | "audio_url" | "video_url" | "image")) => return Err(ApiError::media(kind, "messages")),
            Some(other) => return Err(ApiError::invalid(format!("unsupported content part type '{other}': use 'text'"), Some("messages"))),
        }
    }
    Ok(text)
}

fn chat_messages(messages: &[Message]) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid("messages must not be empty", Some("messages")));
    }
    messages
        .iter()
        .map(|m| {
            if !matches!(m.role.as_str(), "system" | "developer" | "user" | "assistant" | "tool") {
                return Err(ApiError::invalid(format!("unsupported role '{}': use system, user, assistant or tool", m.role), Some("messages")));
            }
            let text = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => parts_text(parts)?,
            };
            if m.content.is_none() && !(m.role == "assistant" && !m.tool_calls.is_empty()) {
                return Err(ApiError::invalid(format!("a '{}' message needs content", m.role), Some("messages")));
            }
            let role = if m.role == "developer" { "system" } else { m.role.as_str() };
            let mut msg = ChatMessage::new(role, &text);
            msg.tool_calls = m
                .tool_calls
                .iter()
                .map(|c| {
                    let args = match &c.function.arguments {
                        Value::String(s) => s.clone(),
                        Value::Null => "{}".to_string(),
                        other => other.to_string(),
                    };
                    tools::template_call(&c.function.name, &args)
                })
                .collect();
            msg.tool_call_id = m.tool_call_id.clone();
            msg.name = m.name.clone();
            msg.reasoning_content = m.reasoning_content.clone();
            Ok(msg)
        })
        .collect()
}

/// `response_format`: `text` (none), `json_object` (any JSON object) or `json_schema` (`{"json_schema":
/// {"name", "schema", "strict"}}`, enforced whether or not `strict` is set).
pub fn response_format(format: Option<&Value>) -> Result<Option<Grammar>, ApiError> {
    let Some(format) = format else { return Ok(None) };
    let bad = |m: &str| ApiError::invalid(m.to_string(), Some("response_format"));
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::JsonSchema(serde_json::json!({"type": "object"})))),
        Some("json_schema") => {
            // chat nests it under "json_schema"; Responses' text.format has the fields inline
            let spec = format.get("json_schema").unwrap_or(format);
            match spec.get("schema") {
                Some(schema) if schema.is_object() || schema.is_boolean() => Ok(Some(Grammar::JsonSchema(schema.clone()))),
                _ => Err(bad("response_format json_schema needs a 'schema' object")),
            }
        }
        Some(other) => Err(bad(&format!("response_format type must be 'text', 'json_object' or 'json_schema'. Given: '{other}'"))),
        None => Err(bad("response_format needs a 'type'")),
    }
}

/// `tools`, `tool_choice` and `parallel_tool_calls` of a chat request.
fn tool_set(req: &ChatRequest) -> Result<ToolSet, ApiError> {
    let mut tools = Vec::new();
    for t in &req.tools {
        match (t.kind.as_str(), &t.function) {
            ("function", Some(f)) => tools.push(Tool {
                model_name: f.name.clone(),
                namespace: None,
                name: f.name.clone(),
                description: f.description.clone(),
                parameters: f.parameters.clone().unwrap_or_else(|| serde_json::json!({"type": "object", "properties": {}})),
            }),
            ("function", None) => return Err(ApiError::invalid("a function tool needs 'function'", Some("tools"))),
            (other, _) => return Err(ApiError::invalid(format!("unsupported tool type '{other}': use 'function'"), Some("tools"))),
        }
    }
    let choice = match &req.tool_choice {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => ToolChoice::from_openai(s)?,
        Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
            Some(name) => ToolChoice::Named(name.to_string()),
            None => return Err(ApiError::invalid("tool_choice must be a string or {\"type\": \"function\", \"function\": {\"name\": ...}}", Some("tool_choice"))),
        },
    };
    let set = ToolSet { tools, choice, parallel: req.parallel_tool_calls.unwrap_or(true) };
    set.check("tool_choice")?;
    Ok(set)
}

/// `POST /v1/chat/completions` up to the engine: parsing, the chat template, tokenizing and the grammar
/// (work that grows with the request: run off the async workers, `lib::off_workers`).
pub fn prepare_chat(state: &AppState, body: &[u8]) -> Result<Ready, ApiError> {
    let req: ChatRequest = parse(body, serde_json::json!({"model": "", "messages": []}))?;
    let (format, format_param) = match (response_format(req.response_format.as_ref())?, crate::params::structured_outputs(&req.params.other)?) {
        (Some(_), Some((_, field))) => return Err(ApiError::invalid(format!("give response_format or {field}, not both"), Some(field))),
        (Some(f), None) => (Some(f), "response_format"),
        (None, Some((g, field))) => (Some(g), field),
        (None, None) => (None, "response_format"),
    };
    let tools = tool_set(&req)?;
    let mut kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    // OpenAI's reasoning_effort, for the templates that read it (gpt-oss's), unless the kwargs set it
    if let Some(effort) = req.params.other.get("reasoning_effort").filter(|v| v.is_string()) {
        kwargs.entry("reasoning_effort").or_insert_with(|| effort.clone());
    }
    let (text, prefill) = tools::prompt_text(state, chat_messages(&req.messages)?, &tools, &kwargs, "messages")?;
    let prompt = state.tokenizer.encode(&text, true, true).map_err(|e| ApiError::invalid(e.to_string(), Some("messages")))?;
    tools::log_request(state, "chat", &text, prompt.len(), &tools);
    let mut params = req.params.to_params(state, prompt)?;
    params.logprobs = match (req.logprobs, req.top_logprobs) {
        (false, Some(_)) => return Err(ApiError::invalid("top_logprobs needs logprobs: true", Some("top_logprobs"))),
        (true, k) => Some(k.unwrap_or(0)),
        (false, None) => None,
    };
    params.constraint = state.answer_constraint(&tools, format.as_ref(), format_param)?;
    let prepared = Prepared { parse: tools::parse_options(&state.template, &tools, &text), prefill, parallel_calls: tools.parallel };
    Ok(Ready::new(Api::Chat, &req.params, params, prepared))
}

/// `POST /v1/completions` up to the engine (as `prepare_chat`).
pub fn prepare_completions(state: &AppState, body: &[u8]) -> Result<Ready, ApiError> {
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
    if state.log_prompts {
        tracing::info!(api = "completions", prompt_tokens = prompt.len(), "prompt: {:?}", match &req.prompt {
            Prompt::Text(t) => t.as_str(),
            Prompt::Tokens(_) => "(token ids)",
        });
    }
    let mut params = req.params.to_params(state, prompt)?;
    params.logprobs = req.logprobs;
    if let Some((grammar, field)) = crate::params::structured_outputs(&req.params.other)? {
        params.constraint = Some(state.constraint(&grammar, field)?);
    }
    Ok(Ready::new(Api::Completion, &req.params, params, Prepared::default()))
}

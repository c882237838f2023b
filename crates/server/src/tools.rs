//! Tools as every API offers them, turned into the prompt the model reads and the parser's options.
//!
//! The model sees each tool as a function named by one string. Codex groups an MCP server's tools in a
//! namespace (`{"type": "namespace", "name": "mcp__files__", "tools": [...]}`); such a tool is shown to
//! the model as `mcp__files__read_file` and a call to that name goes back as namespace `mcp__files__`
//! and name `read_file`, as it came in.
//!
//! A template that renders tools itself (Qwen2.5's) gets them as `tools`; for one that does not, the tool
//! definitions and the Hermes call format go into the system message, calls in the history become
//! `<tool_call>` text and tool results `<tool_response>` user turns (the same convention, so the parser
//! reads both alike).
//!
//! `tool_choice` `required` or a named tool is enforced by starting the answer for the model: the prompt
//! ends with `<tool_call>\n{"name": "` (or the whole `{"name": "NAME", "arguments": `), so it can only go
//! on with a call.

use crate::error::ApiError;
use crate::AppState;
use crate::output::ParseOptions;
use reckon_engine::grammar::{with_json_options, Grammar};
use reckon_engine::template::{ChatMessage, ChatTemplate};
use serde_json::{json, Value};

/// One function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    /// The name the model sees and writes: `namespace` + `name`.
    pub model_name: String,
    pub namespace: Option<String>,
    pub name: String,
    pub description: Option<String>,
    /// JSON Schema of the arguments.
    pub parameters: Value,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    None,
    Required,
    /// This tool (its model name).
    Named(String),
}

#[derive(Clone, Debug, PartialEq)]
pub struct ToolSet {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// More than one call per answer allowed (`parallel_tool_calls`, default true).
    pub parallel: bool,
}

impl Default for ToolSet {
    fn default() -> Self {
        ToolSet { tools: Vec::new(), choice: ToolChoice::Auto, parallel: true }
    }
}

impl ToolChoice {
    /// OpenAI's string form (chat and Responses): `auto`, `none` or `required`.
    pub fn from_openai(mode: &str) -> Result<ToolChoice, ApiError> {
        match mode {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            other => Err(ApiError::invalid(format!("tool_choice must be 'auto', 'none', 'required' or a function. Given: '{other}'"), Some("tool_choice"))),
        }
    }
}

impl ToolSet {
    /// Whether the model is offered tools at all.
    pub fn active(&self) -> bool {
        !self.tools.is_empty() && self.choice != ToolChoice::None
    }

    /// The tool the model calls by `model_name`, if it is one offered.
    pub fn find(&self, model_name: &str) -> Option<&Tool> {
        self.tools.iter().find(|t| t.model_name == model_name)
    }

    /// Checks `choice` against the tools: a named tool must be offered, and a choice other than `none`
    /// needs tools.
    pub fn check(&self, param: &str) -> Result<(), ApiError> {
        match &self.choice {
            ToolChoice::Named(name) if self.find(name).is_none() => {
                Err(ApiError::invalid(format!("tool_choice names the tool '{name}', which is not in tools"), Some(param)))
            }
            ToolChoice::Required | ToolChoice::Named(_) if self.tools.is_empty() => {
                Err(ApiError::invalid("tool_choice requires a tool call but no tools were given", Some(param)))
            }
            _ => Ok(()),
        }
    }

    /// Tools as Hugging Face templates read them.
    fn template_json(&self) -> Vec<Value> {
        self.tools
            .iter()
            .map(|t| {
                let mut f = json!({ "name": t.model_name });
                if let Some(d) = &t.description {
                    f["description"] = json!(d);
                }
                f["parameters"] = t.parameters.clone();
                json!({ "type": "function", "function": f })
            })
            .collect()
    }

    /// The grammar a required or named call's remaining text must match (after `prefill`): the
    /// arguments valid under the tool's schema, then the call object's closing brace; then the answer
    /// ends. `None` when no call is forced.
    pub fn grammar(&self) -> Option<Grammar> {
        let args = |t: &Tool| format!("%json {}", with_json_options(&t.parameters));
        let lit = |s: &str| Value::from(s).to_string();
        match &self.choice {
            ToolChoice::Named(name) => self.find(name).map(|t| Grammar::Lark(format!("start: {} {}\n", args(t), lit("}")))),
            ToolChoice::Required if !self.tools.is_empty() => {
                let alternatives: Vec<String> = self
                    .tools
                    .iter()
                    .map(|t| {
                        // the rest of `{"name": "` : the name as a JSON string without its opening quote
                        let quoted = Value::from(t.model_name.as_str()).to_string();
                        format!("{} {} {}", lit(&format!("{}, \"arguments\": ", &quoted[1..])), args(t), lit("}"))
                    })
                    .collect();
                Some(Grammar::Lark(format!("start: {}\n", alternatives.join("\n     | "))))
            }
            _ => None,
        }
    }

    /// The start of the answer the prompt ends with, when a call is required.
    pub fn prefill(&self) -> Option<String> {
        match &self.choice {
            ToolChoice::Required if !self.tools.is_empty() => Some("<tool_call>\n{\"name\": \"".into()),
            ToolChoice::Named(name) => Some(format!("<tool_call>\n{{\"name\": {}, \"arguments\": ", Value::from(name.as_str()))),
            _ => None,
        }
    }
}

/// What the parser looks for in the answer to `prompt_text`: the offered tools, and `<think>` reasoning
/// if the template emits it (the answer starts inside it when the generation prompt opens the tag).
pub fn parse_options(template: &ChatTemplate, tools: &ToolSet, prompt_text: &str) -> ParseOptions {
    let reasoning = template.emits_reasoning();
    ParseOptions {
        tools: if tools.active() { tools.tools.iter().map(|t| t.model_name.clone()).collect() } else { Vec::new() },
        reasoning,
        starts_in_reasoning: reasoning && prompt_text.trim_end().ends_with("<think>"),
    }
}

/// One line per request in the server's log: its API, prompt length, and the tools the model was shown
/// (so an operator sees that an agent's tools, an MCP namespace's included, reached the prompt). The
/// prompt's text only with `--log-prompts`: a log is read by more people than the requests were meant for.
pub fn log_request(state: &AppState, api: &str, prompt_text: &str, prompt_tokens: usize, tools: &ToolSet) {
    let names: Vec<&str> = if tools.active() { tools.tools.iter().map(|t| t.model_name.as_str()).collect() } else { Vec::new() };
    tracing::info!(api, prompt_tokens, tool_choice = ?tools.choice, "request with {} tools {names:?}", names.len());
    if state.log_prompts {
        tracing::info!(api, "prompt: {prompt_text:?}");
    }
}

/// Template variables a request may not set through `chat_template_kwargs`: the ones the server sets.
const RESERVED_KWARGS: [&str; 5] = ["messages", "tools", "add_generation_prompt", "bos_token", "eos_token"];

/// The prompt text of a conversation, after the request limits on its message and tool counts (a 400
/// naming `param` or `tools`); template errors are 400s naming `param`. `kwargs`: the request's extra
/// template variables (`chat_template_kwargs`).
pub fn prompt_text(state: &AppState, messages: Vec<ChatMessage>, tools: &ToolSet, kwargs: &serde_json::Map<String, Value>, param: &str) -> Result<(String, Option<String>), ApiError> {
    if let Some(k) = kwargs.keys().find(|k| RESERVED_KWARGS.contains(&k.as_str())) {
        return Err(ApiError::invalid(format!("chat_template_kwargs: {k:?} is set by the server (from the request's own fields)"), Some("chat_template_kwargs")));
    }
    let limits = state.limits;
    if messages.len() > limits.max_messages {
        return Err(ApiError::invalid(format!("{param}: at most {} messages are allowed. Given: {}", limits.max_messages, messages.len()), Some(param)));
    }
    if tools.tools.len() > limits.max_tools {
        return Err(ApiError::invalid(format!("tools: at most {} tools are allowed. Given: {}", limits.max_tools, tools.tools.len()), Some("tools")));
    }
    render_prompt(&state.template, messages, tools, kwargs).map_err(|e| ApiError::invalid(e.to_string(), Some(param)))
}

/// A call the model made, with the id the API gives it.
pub fn call_id(request_id: u64, index: usize) -> String {
    format!("call_{request_id:x}_{index}")
}

/// A call's arguments as templates want them: the JSON object the text holds (or the text itself).
pub fn arguments_value(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|_| Value::String(text.to_string()))
}

/// The name the model sees for tool `name` of a namespace: MCP's `mcp__server__tool` convention, the
/// separator added unless the namespace ends with one (`mcp__files` and `mcp__files__` both give
/// `mcp__files__read_file`).
pub fn namespaced(namespace: Option<&str>, name: &str) -> String {
    match namespace {
        None | Some("") => name.to_string(),
        Some(ns) if ns.ends_with(['_', '.', '/', ':']) => format!("{ns}{name}"),
        Some(ns) => format!("{ns}__{name}"),
    }
}

/// The history as an assistant message with calls renders them (`tool_calls` in Hugging Face's shape).
pub fn template_call(name: &str, arguments: &str) -> Value {
    json!({ "type": "function", "function": { "name": name, "arguments": arguments_value(arguments) } })
}

/// The prompt text for `messages` with `tools`, ending where the model's answer begins (with the forced
/// start of a call when one is required; the same text is the parser's first input).
pub fn render_prompt(template: &ChatTemplate, messages: Vec<ChatMessage>, tools: &ToolSet, kwargs: &serde_json::Map<String, Value>) -> Result<(String, Option<String>), reckon_engine::Error> {
    let prefill = if tools.active() { tools.prefill() } else { None };
    let mut text = if !tools.active() {
        if template.supports_tools() {
            // the template renders calls and results in the history itself
            template.render_with_kwargs(&messages, &[], true, kwargs)?
        } else {
            template.render_with_kwargs(&flatten_tool_turns(messages), &[], true, kwargs)?
        }
    } else if template.supports_tools() {
        template.render_with_kwargs(&messages, &tools.template_json(), true, kwargs)?
    } else {
        template.render_with_kwargs(&fallback_messages(messages, tools), &[], true, kwargs)?
    };
    if let Some(p) = &prefill {
        text.push_str(p);
    }
    Ok((text, prefill))
}

/// Text a template without tool support can render: calls as `<tool_call>` text, results as user turns.
fn flatten_tool_turns(messages: Vec<ChatMessage>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len());
    for m in messages {
        match m.role.as_str() {
            "assistant" if !m.tool_calls.is_empty() => {
                let mut content = m.content.clone();
                for call in &m.tool_calls {
                    let f = call.get("function").unwrap_or(call);
                    let call = json!({ "name": f.get("name").cloned().unwrap_or_default(), "arguments": f.get("arguments").cloned().unwrap_or(json!({})) });
                    if !content.is_empty() {
                        content.push('\n');
                    }
                    content.push_str(&format!("<tool_call>\n{call}\n</tool_call>"));
                }
                out.push(ChatMessage::new("assistant", &content));
            }
            "tool" => {
                let text = format!("<tool_response>\n{}\n</tool_response>", m.content);
                // consecutive results share one user turn, as Qwen's template does
                match out.last_mut() {
                    Some(last) if last.role == "user" && last.content.ends_with("</tool_response>") => {
                        last.content.push('\n');
                        last.content.push_str(&text);
                    }
                    _ => out.push(ChatMessage::new("user", &text)),
                }
            }
            _ => out.push(m),
        }
    }
    out
}

/// The instructions a template without tool support gets in its system message (Hermes' wording, which
/// Qwen2.5 also uses).
fn fallback_messages(messages: Vec<ChatMessage>, tools: &ToolSet) -> Vec<ChatMessage> {
    let mut block = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for t in tools.template_json() {
        block.push('\n');
        block.push_str(&t.to_string());
    }
    block.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within \
         <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    let mut messages = flatten_tool_turns(messages);
    match messages.first_mut() {
        Some(first) if first.role == "system" => first.content = format!("{}\n\n{block}", first.content),
        _ => messages.insert(0, ChatMessage::new("system", &block)),
    }
    messages
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str) -> Tool {
        Tool { model_name: name.into(), namespace: None, name: name.into(), description: Some("d".into()), parameters: json!({"type": "object"}) }
    }

    #[test]
    fn prefill_forces_a_call() {
        let set = ToolSet { tools: vec![tool("f")], choice: ToolChoice::Named("f".into()), parallel: true };
        assert_eq!(set.prefill().unwrap(), "<tool_call>\n{\"name\": \"f\", \"arguments\": ");
        let set = ToolSet { choice: ToolChoice::Required, ..set };
        assert_eq!(set.prefill().unwrap(), "<tool_call>\n{\"name\": \"");
        let set = ToolSet { choice: ToolChoice::None, ..set };
        assert!(!set.active());
    }

    #[test]
    fn choice_is_checked() {
        let set = ToolSet { tools: vec![tool("f")], choice: ToolChoice::Named("g".into()), parallel: true };
        assert!(set.check("tool_choice").is_err());
        let set = ToolSet { tools: vec![], choice: ToolChoice::Required, parallel: true };
        assert!(set.check("tool_choice").is_err());
    }

    #[test]
    fn fallback_puts_tools_in_the_system_message_and_calls_in_text() {
        let tmpl = ChatTemplate::new(
            "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}".into(),
            "",
            "",
        )
        .unwrap();
        assert!(!tmpl.supports_tools());
        let set = ToolSet { tools: vec![tool("f")], ..Default::default() };
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls = vec![template_call("f", "{\"x\": 1}")];
        let mut result = ChatMessage::new("tool", "42");
        result.tool_call_id = Some("call_1".into());
        let (text, prefill) = render_prompt(&tmpl, vec![ChatMessage::new("user", "hi"), call, result], &set, &Default::default()).unwrap();
        assert!(prefill.is_none());
        assert!(text.starts_with("[system]# Tools"), "{text}");
        assert!(text.contains("{\"type\":\"function\",\"function\":{\"name\":\"f\",\"description\":\"d\",\"parameters\":{\"type\":\"object\"}}}"), "{text}");
        assert!(text.contains("[assistant]<tool_call>\n{\"name\":\"f\",\"arguments\":{\"x\":1}}\n</tool_call>[user]<tool_response>\n42\n</tool_response>[assistant]"), "{text}");
    }
}

//! Chat templates: the GGUF's `tokenizer.chat_template` (Jinja) rendered with minijinja, with Python
//! string methods (`.strip()`, `.startswith()`, …) that Hugging Face templates rely on.

use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use minijinja::{Environment, ErrorKind, Value};
use serde::{Deserialize, Serialize};

/// Used when a gemma3 GGUF carries no template (the 270M file does not): Gemma's turn format, with a
/// system message folded into the first user turn as Gemma's own template does. BOS comes from the
/// tokenizer's add_bos, not from the template.
const GEMMA_FALLBACK: &str = "{%- if messages and messages[0]['role'] == 'system' -%}\
{%- set prefix = messages[0]['content'] + '\n\n' -%}{%- set msgs = messages[1:] -%}\
{%- else -%}{%- set prefix = '' -%}{%- set msgs = messages -%}{%- endif -%}\
{%- for m in msgs -%}\
{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' + (prefix if loop.first else '') }}\
{{- m['content'] | trim }}{{ '<end_of_turn>\n' }}\
{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}";

/// ChatML, for models that carry no template and are not gemma.
const CHATML_FALLBACK: &str = "{%- for m in messages -%}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endfor -%}\
{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}";

/// One message as chat templates read it (Hugging Face's convention): `role` and `content`, and for tool
/// use the assistant's `tool_calls` (`[{"type": "function", "function": {"name", "arguments": {...}}}]`,
/// arguments as an object) and a tool result's `tool_call_id`/`name`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The assistant's reasoning, for templates that render it (`<think>` models).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage { role: role.to_string(), content: content.to_string(), ..Default::default() }
    }
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    /// The template source, for `reckon info`.
    pub source: String,
}

/// Template instructions one render may run. A model file's template is code: one that loops for long
/// (nested `range`s) would otherwise hold a request's handler for minutes. Real templates run a few
/// dozen instructions per message, so the largest request the server admits (10,000 messages) stays
/// far below this; a string's length costs nothing here, only the template's own steps.
pub const TEMPLATE_FUEL: u64 = 50_000_000;

impl ChatTemplate {
    /// The GGUF's template, or a fallback chosen by architecture.
    pub fn from_gguf(file: &GgufFile, bos_token: &str, eos_token: &str) -> Result<Self> {
        let source = match file.get("tokenizer.chat_template").and_then(|v| v.as_str()) {
            Some(s) => s.to_string(),
            None if file.get_str("general.architecture").ok() == Some("gemma3") => GEMMA_FALLBACK.to_string(),
            None => CHATML_FALLBACK.to_string(),
        };
        Self::new(source, bos_token, eos_token)
    }

    pub fn new(source: String, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_fuel(Some(TEMPLATE_FUEL));
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> std::result::Result<Value, minijinja::Error> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", |fmt: String| -> String { strftime_now(&fmt) });
        // Python's json.dumps, as the templates were written against: keys in their given order, ", " and
        // ": " separators, non-ASCII unescaped. (minijinja's own tojson is compact and HTML-escapes.)
        env.add_filter("tojson", |v: Value, kwargs: minijinja::value::Kwargs| -> std::result::Result<Value, minijinja::Error> {
            let indent: Option<usize> = kwargs.get("indent")?;
            let _: Option<bool> = kwargs.get("ensure_ascii")?;
            kwargs.assert_all_used()?;
            let json = serde_json::to_value(&v).map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
            let mut out = String::new();
            python_json(&json, indent, 0, &mut out);
            Ok(Value::from_safe_string(out))
        });
        env.add_template_owned("chat", source.clone())
            .map_err(|e| Error::Template(format!("cannot parse the model's chat template: {e}")))?;
        Ok(ChatTemplate { env, bos_token: bos_token.to_string(), eos_token: eos_token.to_string(), source })
    }

    /// Renders a conversation; with `add_generation_prompt` the text ends where the assistant's reply begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// `render` with tool definitions (`[{"type": "function", "function": {"name", "description",
    /// "parameters"}}]`), which the template places itself; none given, `tools` is undefined.
    pub fn render_with_tools(&self, messages: &[ChatMessage], tools: &[serde_json::Value], add_generation_prompt: bool) -> Result<String> {
        self.render_with_kwargs(messages, tools, add_generation_prompt, &serde_json::Map::new())
    }

    /// `render_with_tools` with extra template variables (`chat_template_kwargs`, as vLLM and SGLang take
    /// them: Qwen3's `enable_thinking`). They cannot replace the variables this sets.
    pub fn render_with_kwargs(&self, messages: &[ChatMessage], tools: &[serde_json::Value], add_generation_prompt: bool, kwargs: &serde_json::Map<String, serde_json::Value>) -> Result<String> {
        let tmpl = self.env.get_template("chat").expect("added in new");
        let ctx = minijinja::context! {
            messages => messages,
            tools => (!tools.is_empty()).then_some(tools),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            ..minijinja::Value::from_serialize(kwargs)
        };
        tmpl.render(ctx).map_err(|e| Error::Template(format!("rendering failed: {e}")))
    }

    /// Whether the model writes its reasoning in `<think>…</think>` (its template mentions the tag): the
    /// server then splits that text out as reasoning.
    pub fn emits_reasoning(&self) -> bool {
        self.source.contains("<think>")
    }

    /// Whether the template renders tool definitions itself (it reads `tools`); otherwise the server puts
    /// them into the system message.
    pub fn supports_tools(&self) -> bool {
        self.source.contains("tools")
    }
}

/// `v` as Python's `json.dumps(v, ensure_ascii=False, indent=indent)` writes it.
fn python_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::to_string(k).expect("a string serializes"));
                out.push_str(": ");
                python_json(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&serde_json::to_string(other).expect("a JSON value serializes")),
    }
}

/// Today's date in the few strftime forms chat templates use (e.g. "%d %b %Y"), UTC.
fn strftime_now(fmt: &str) -> String {
    const MONTHS: [&str; 12] = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November", "December"];
    let days = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs() / 86_400).unwrap_or(0) as i64;
    let (y, m, d) = civil_from_days(days);
    fmt.replace("%Y", &y.to_string())
        .replace("%m", &format!("{m:02}"))
        .replace("%d", &format!("{d:02}"))
        .replace("%B", MONTHS[m as usize - 1])
        .replace("%b", &MONTHS[m as usize - 1][..3])
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian calendar.
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (era * 400 + yoe + if m <= 2 { 1 } else { 0 }, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_methods_and_generation_prompt() {
        let t = ChatTemplate::new(
            "{% for m in messages %}[{{ m.role.upper() }}]{{ m.content.strip() }}{% endfor %}{% if add_generation_prompt %}[A]{% endif %}".into(),
            "<s>",
            "</s>",
        )
        .unwrap();
        let msgs = [ChatMessage::new("user", "  hi  ")];
        assert_eq!(t.render(&msgs, true).unwrap(), "[USER]hi[A]");
        assert_eq!(t.render(&msgs, false).unwrap(), "[USER]hi");
    }

    /// The expected strings are llama.cpp's own rendering of these messages with its built-in "gemma"
    /// template (`llama_chat_apply_template`, llama-cpp-python 0.3.36), not a copy of ours.
    #[test]
    fn gemma_fallback_renders_as_llama_cpp() {
        let t = ChatTemplate::new(GEMMA_FALLBACK.into(), "<bos>", "<eos>").unwrap();
        let msgs = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi"), ChatMessage::new("assistant", "Hello"), ChatMessage::new("user", "Bye")];
        assert_eq!(
            t.render(&msgs, true).unwrap(),
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
        let msgs = [ChatMessage::new("user", "  padded  "), ChatMessage::new("assistant", " x ")];
        assert_eq!(t.render(&msgs, false).unwrap(), "<start_of_turn>user\npadded<end_of_turn>\n<start_of_turn>model\nx<end_of_turn>\n");
    }

    #[test]
    fn tojson_writes_as_python() {
        let t = ChatTemplate::new("{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}".into(), "", "").unwrap();
        let tools = [serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {"z": 1, "a": [1, "é"]}}})];
        let out = t.render_with_tools(&[], &tools, false).unwrap();
        assert_eq!(
            out,
            "[{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"z\": 1, \"a\": [1, \"é\"]}}}]|{\n  \"type\": \"function\",\n  \"function\": {\n    \"name\": \"f\",\n    \"parameters\": {\n      \"z\": 1,\n      \"a\": [\n        1,\n        \"é\"\n      ]\n    }\n  }\n}"
        );
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}".into(), "", "").unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("no system role"), "{e}");
    }

    /// A template that would run ~10^10 loop steps (minijinja caps one `range` at 100,000, not two
    /// nested) ends with an error once its fuel is spent; the largest conversation the server admits
    /// (10,000 messages) renders well within the fuel.
    #[test]
    fn a_runaway_template_runs_out_of_fuel_and_a_long_conversation_does_not() {
        let t = ChatTemplate::new("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}".into(), "", "").unwrap();
        let e = t.render(&[], false).unwrap_err().to_string();
        assert!(e.contains("fuel"), "{e}");
        let chatml = ChatTemplate::new(CHATML_FALLBACK.into(), "", "").unwrap();
        let msgs: Vec<ChatMessage> = (0..10_000).map(|i| ChatMessage::new(if i % 2 == 0 { "user" } else { "assistant" }, "a few words")).collect();
        assert!(chatml.render(&msgs, true).unwrap().len() > 10_000 * 11);
    }

    #[test]
    fn civil_dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_787), (2026, 11, 30));
    }
}

//! The model's generated text split into what the APIs return: plain text, reasoning, and tool calls.
//! Every API feeds the engine's token text through one `OutputParser` and shapes its `Delta`s: chat's
//! `delta.tool_calls`, Responses' `function_call` items, Messages' `tool_use` blocks.
//!
//! Tool calls are written the Qwen/Hermes way, which the fallback prompt for templates without tools
//! also asks for:
//!   <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>
//! Llama 3.x's templates ask for the JSON alone, `{"name": ..., "parameters": {...}}`, sometimes after
//! `<|python_tag|>`; small coder models often drop the tags and answer with the JSON alone, bare or in a
//! ```json fence;
//! an answer that starts that way is held back and, if it parses as one call or a list of calls to the
//! offered tools, returned as calls (else as the text it was).
//!
//! Streaming: a call's name is sent once, as soon as `{"name": "...", "arguments": ` has been read; the
//! arguments follow as the raw text the model wrote, never re-serialised (re-serialising partial JSON is
//! how streaming parsers have dropped characters), less the call object's closing brace, which is held
//! back until the closing tag shows which brace it is.

use serde_json::Value;

const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
/// Llama 3.x's marker before a tool call it writes as JSON (where the tokenizer's text keeps it).
const PYTHON_TAG: &str = "<|python_tag|>";
const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";

/// A piece of the answer, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Delta {
    Text(String),
    Reasoning(String),
    /// Call `index` begins (its name, once).
    CallStart { index: usize, name: String },
    /// More of call `index`'s arguments (raw JSON text; all of a call's pieces join to its arguments).
    CallArgs { index: usize, text: String },
}

/// One parsed call: the name the model wrote and its arguments as JSON text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    pub name: String,
    pub arguments: String,
}

/// What the parser looks for.
#[derive(Clone, Debug, Default)]
pub struct ParseOptions {
    /// Names of the tools offered; empty: no tool calls are parsed (tools absent or `tool_choice: none`).
    pub tools: Vec<String>,
    /// The template emits `<think>…</think>` reasoning: split it out.
    pub reasoning: bool,
    /// The answer begins inside a reasoning block (templates whose generation prompt opens `<think>`).
    pub starts_in_reasoning: bool,
}

#[derive(Debug)]
enum Mode {
    /// Nothing but whitespace yet: the answer may be a bare JSON call or open with `<think>`.
    Start,
    Text,
    Reasoning,
    /// Inside `<tool_call>` for call `index`: `buf` holds the call's text so far, `header` the name and
    /// where the arguments start once read, `emitted` the bytes of the arguments sent.
    Call { index: usize, buf: String, header: Option<(String, usize)>, emitted: usize },
    /// A bare or fenced JSON answer, held back until the end.
    Bare,
    /// Just after a call: whitespace here is not text.
    AfterCall,
}

pub struct OutputParser {
    opts: ParseOptions,
    mode: Mode,
    /// Text received but not yet classified (a possible tag prefix, leading whitespace).
    pending: String,
    calls: Vec<Call>,
    /// Text sent (outside calls and reasoning), to build a non-streamed answer.
    text: String,
    reasoning: String,
}

impl OutputParser {
    pub fn new(opts: ParseOptions) -> Self {
        let mode = if opts.reasoning && opts.starts_in_reasoning {
            Mode::Reasoning
        } else if opts.reasoning || !opts.tools.is_empty() {
            Mode::Start
        } else {
            Mode::Text
        };
        OutputParser { opts, mode, pending: String::new(), calls: Vec::new(), text: String::new(), reasoning: String::new() }
    }

    fn tools_on(&self) -> bool {
        !self.opts.tools.is_empty()
    }

    /// The deltas that `text` (the next piece of generated text) completes.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        while self.step(&mut out, false) {}
        self.record(&out);
        out
    }

    /// The end of the generation: whatever was held back, as text or calls.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        while self.step(&mut out, true) {}
        self.record(&out);
        out
    }

    pub fn calls(&self) -> &[Call] {
        &self.calls
    }

    /// The text outside calls and reasoning.
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn reasoning(&self) -> &str {
        &self.reasoning
    }

    fn record(&mut self, out: &[Delta]) {
        for d in out {
            match d {
                Delta::Text(t) => self.text.push_str(t),
                Delta::Reasoning(t) => self.reasoning.push_str(t),
                Delta::CallStart { name, .. } => self.calls.push(Call { name: name.clone(), arguments: String::new() }),
                Delta::CallArgs { index, text } => self.calls[*index].arguments.push_str(text),
            }
        }
    }

    /// The next call's index, counting calls started in `out` but not yet recorded.
    fn next_index(&self, out: &[Delta]) -> usize {
        self.calls.len() + out.iter().filter(|d| matches!(d, Delta::CallStart { .. })).count()
    }

    /// Makes what progress `pending` allows; true if it should be called again.
    fn step(&mut self, out: &mut Vec<Delta>, end: bool) -> bool {
        match &mut self.mode {
            Mode::Start => {
                let trimmed = self.pending.trim_start();
                if trimmed.is_empty() {
                    if end {
                        // only whitespace: it is the answer
                        push_text(out, std::mem::take(&mut self.pending));
                    }
                    return false;
                }
                if self.opts.reasoning && (THINK_OPEN.starts_with(trimmed) || trimmed.starts_with(THINK_OPEN)) {
                    if !trimmed.starts_with(THINK_OPEN) {
                        if end {
                            self.mode = Mode::Text;
                            return true;
                        }
                        return false;
                    }
                    let rest = trimmed[THINK_OPEN.len()..].to_string();
                    self.pending = rest;
                    self.mode = Mode::Reasoning;
                    return true;
                }
                if self.tools_on() && (PYTHON_TAG.starts_with(trimmed) || trimmed.starts_with(PYTHON_TAG)) {
                    if !trimmed.starts_with(PYTHON_TAG) {
                        if end {
                            self.mode = Mode::Text;
                            return true;
                        }
                        return false;
                    }
                    self.pending = trimmed[PYTHON_TAG.len()..].trim_start().to_string();
                    self.mode = Mode::Bare;
                    return true;
                }
                // leading whitespace (before a call, after reasoning) is not part of the answer
                let first = trimmed.chars().next().expect("not empty");
                self.pending = trimmed.to_string();
                self.mode = if self.tools_on() && (first == '{' || first == '[' || first == '`') { Mode::Bare } else { Mode::Text };
                true
            }
            Mode::Reasoning => {
                if let Some(at) = self.pending.find(THINK_CLOSE) {
                    let reasoning: String = self.pending[..at].to_string();
                    let rest = self.pending[at + THINK_CLOSE.len()..].trim_start().to_string();
                    if !reasoning.is_empty() {
                        out.push(Delta::Reasoning(reasoning));
                    }
                    self.pending = rest;
                    self.mode = Mode::Start;
                    return true;
                }
                let keep = if end { 0 } else { partial_suffix(&self.pending, THINK_CLOSE) };
                let send: String = self.pending.drain(..self.pending.len() - keep).collect();
                if !send.is_empty() {
                    out.push(Delta::Reasoning(send));
                }
                false
            }
            Mode::Text => {
                if self.tools_on() {
                    if let Some(at) = self.pending.find(CALL_OPEN) {
                        let before: String = self.pending[..at].to_string();
                        let rest = self.pending[at + CALL_OPEN.len()..].to_string();
                        push_text(out, before);
                        self.pending = String::new();
                        let index = self.next_index(out);
                        self.mode = Mode::Call { index, buf: rest, header: None, emitted: 0 };
                        return true;
                    }
                }
                let keep = if end || !self.tools_on() { 0 } else { partial_suffix(&self.pending, CALL_OPEN) };
                let send: String = self.pending.drain(..self.pending.len() - keep).collect();
                push_text(out, send);
                false
            }
            Mode::Call { .. } => self.step_call(out, end),
            Mode::AfterCall => {
                let trimmed = self.pending.trim_start();
                if trimmed.is_empty() {
                    self.pending.clear();
                    return false;
                }
                self.pending = trimmed.to_string();
                self.mode = Mode::Text;
                true
            }
            Mode::Bare => {
                if !end {
                    return false;
                }
                let text = std::mem::take(&mut self.pending);
                match bare_calls(&text, &self.opts.tools) {
                    Some(calls) => {
                        for call in calls {
                            let index = self.next_index(out);
                            out.push(Delta::CallStart { index, name: call.name });
                            out.push(Delta::CallArgs { index, text: call.arguments });
                        }
                        self.mode = Mode::Text;
                        false
                    }
                    None => {
                        // not JSON calls: text, read again for tagged calls in it
                        self.pending = text;
                        self.mode = Mode::Text;
                        true
                    }
                }
            }
        }
    }

    fn step_call(&mut self, out: &mut Vec<Delta>, end: bool) -> bool {
        let Mode::Call { index, buf, header, emitted } = &mut self.mode else { unreachable!() };
        let index = *index;
        // the new text joins the call's own buffer
        buf.push_str(&std::mem::take(&mut self.pending));
        if header.is_none() {
            if let Some((name, args_at)) = call_header(buf) {
                // arguments written as a JSON string are decoded at the end, not streamed
                if !buf[args_at..].trim_start().starts_with('"') || buf[args_at..].trim_start().is_empty() {
                    out.push(Delta::CallStart { index, name: name.clone() });
                    *header = Some((name, args_at));
                }
            }
        }
        // the closing tag is looked for after the arguments' start (a tag inside the name cannot close)
        let from = header.as_ref().map_or(0, |(_, at)| *at);
        let close = buf[from..].find(CALL_CLOSE).map(|i| i + from);
        if close.is_none() && !end {
            if let Some((_, args_at)) = header {
                let args = &buf[*args_at..];
                let cut = args_end(args, false);
                if cut > *emitted && args.is_char_boundary(cut) && args.is_char_boundary(*emitted) {
                    out.push(Delta::CallArgs { index, text: args[*emitted..cut].to_string() });
                    *emitted = cut;
                }
            }
            return false;
        }
        // the call is complete (its closing tag, or the end of the generation)
        let body_end = close.unwrap_or(buf.len());
        let after = close.map(|c| buf[c + CALL_CLOSE.len()..].to_string()).unwrap_or_default();
        let body = buf[..body_end].to_string();
        let mut called = true;
        match header.take() {
            Some((_, args_at)) => {
                let args = &body[args_at..];
                let cut = args_end(args, true);
                if cut > *emitted {
                    out.push(Delta::CallArgs { index, text: args[*emitted..cut].to_string() });
                }
            }
            None => match parse_call(&body) {
                Some(call) => {
                    out.push(Delta::CallStart { index, name: call.name });
                    out.push(Delta::CallArgs { index, text: call.arguments });
                }
                // not a call after all: the model's text, tags included
                None => {
                    called = false;
                    push_text(out, format!("{CALL_OPEN}{body}{}", if close.is_some() { CALL_CLOSE } else { "" }));
                }
            },
        }
        self.pending = after;
        self.mode = if called { Mode::AfterCall } else { Mode::Text };
        !self.pending.is_empty()
    }
}

fn push_text(out: &mut Vec<Delta>, text: String) {
    if !text.is_empty() {
        out.push(Delta::Text(text));
    }
}

/// Length of the longest suffix of `s` that is a proper prefix of `tag` (text that may begin it).
fn partial_suffix(s: &str, tag: &str) -> usize {
    (1..tag.len().min(s.len() + 1)).rev().find(|&n| s.is_char_boundary(s.len() - n) && tag.starts_with(&s[s.len() - n..])).unwrap_or(0)
}

/// `{"name": "NAME", "arguments": ` at the start of a call: the name and where the arguments begin.
fn call_header(buf: &str) -> Option<(String, usize)> {
    let mut rest = buf.trim_start().strip_prefix('{')?.trim_start();
    rest = rest.strip_prefix("\"name\"")?.trim_start().strip_prefix(':')?.trim_start();
    let (name, len) = json_string_prefix(rest)?;
    rest = rest[len..].trim_start().strip_prefix(',')?.trim_start();
    rest = rest.strip_prefix("\"arguments\"").or_else(|| rest.strip_prefix("\"parameters\""))?.trim_start().strip_prefix(':')?;
    let rest = rest.trim_start();
    if rest.is_empty() {
        return None; // wait for the first character of the arguments
    }
    Some((name, buf.len() - rest.len()))
}

/// A complete JSON string at the start of `s`: its value and its length in `s`.
fn json_string_prefix(s: &str) -> Option<(String, usize)> {
    let bytes = s.as_bytes();
    if bytes.first() != Some(&b'"') {
        return None;
    }
    let mut i = 1;
    while i < bytes.len() {
        match bytes[i] {
            b'\\' => i += 2,
            b'"' => return serde_json::from_str(&s[..=i]).ok().map(|v: String| (v, i + 1)),
            _ => i += 1,
        }
    }
    None
}

/// Where the arguments end in `args` (the text after `"arguments": `): before the call object's closing
/// brace and any whitespace around it. Mid-stream (`complete` false) a suffix that may still turn out to
/// be that brace, whitespace or the start of the closing tag is held back.
fn args_end(args: &str, complete: bool) -> usize {
    let mut s = args;
    if !complete {
        s = &s[..s.len() - partial_suffix(s, CALL_CLOSE)];
    }
    s = s.trim_end();
    if let Some(t) = s.strip_suffix('}') {
        s = t.trim_end();
    }
    s.len()
}

/// A whole call object, `{"name": ..., "arguments": ...}` (arguments an object or a JSON string).
fn parse_call(body: &str) -> Option<Call> {
    call_of(&serde_json::from_str::<Value>(body.trim()).ok()?)
}

fn call_of(v: &Value) -> Option<Call> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = v.get("arguments").or_else(|| v.get("parameters")).cloned().unwrap_or(Value::Object(Default::default()));
    let arguments = match args {
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(Call { name, arguments })
}

/// An untagged answer that is one call or a list of calls to offered tools, bare or in a ```json fence.
fn bare_calls(text: &str, tools: &[String]) -> Option<Vec<Call>> {
    let mut t = text.trim();
    if let Some(fenced) = t.strip_prefix("```") {
        let fenced = fenced.strip_prefix("json").unwrap_or(fenced);
        t = fenced.trim().strip_suffix("```")?.trim();
    }
    // one call, a list of calls, or calls one after another (one per line, as small models write them)
    let mut calls = Vec::new();
    for v in serde_json::Deserializer::from_str(t).into_iter::<Value>() {
        match v.ok()? {
            Value::Array(items) => calls.extend(items.iter().map(call_of).collect::<Option<Vec<_>>>()?),
            v => calls.push(call_of(&v)?),
        }
    }
    (!calls.is_empty() && calls.iter().all(|c| tools.contains(&c.name))).then_some(calls)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(tools: &[&str]) -> ParseOptions {
        ParseOptions { tools: tools.iter().map(|s| s.to_string()).collect(), ..Default::default() }
    }

    /// Feeds `text` in pieces of `n` characters; returns the deltas and the parser.
    fn feed(o: ParseOptions, text: &str, n: usize) -> (Vec<Delta>, OutputParser) {
        let mut p = OutputParser::new(o);
        let chars: Vec<char> = text.chars().collect();
        let mut out = Vec::new();
        for piece in chars.chunks(n) {
            out.extend(p.push(&piece.iter().collect::<String>()));
        }
        out.extend(p.finish());
        (out, p)
    }

    const QWEN_CALL: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"n\": {\"a\": 1}}}\n</tool_call>";

    #[test]
    fn tagged_call_in_any_split() {
        for n in 1..12 {
            let (out, p) = feed(opts(&["get_weather"]), QWEN_CALL, n);
            assert_eq!(p.calls(), &[Call { name: "get_weather".into(), arguments: "{\"city\": \"Paris\", \"n\": {\"a\": 1}}".into() }], "split {n}");
            assert_eq!(p.text(), "", "split {n}");
            let starts = out.iter().filter(|d| matches!(d, Delta::CallStart { .. })).count();
            assert_eq!(starts, 1);
            if n == 1 {
                // streamed: the arguments came in more than one piece
                assert!(out.iter().filter(|d| matches!(d, Delta::CallArgs { .. })).count() > 5);
            }
        }
    }

    #[test]
    fn text_then_two_calls() {
        let text = format!("Let me check.\n{QWEN_CALL}\n<tool_call>\n{{\"name\": \"f\", \"arguments\": {{}}}}\n</tool_call>");
        for n in [1, 3, 100] {
            let (_, p) = feed(opts(&["get_weather", "f"]), &text, n);
            assert_eq!(p.text(), "Let me check.\n");
            assert_eq!(p.calls().len(), 2);
            assert_eq!(p.calls()[1], Call { name: "f".into(), arguments: "{}".into() });
        }
    }

    #[test]
    fn no_tools_means_plain_text() {
        let (out, p) = feed(opts(&[]), QWEN_CALL, 2);
        assert!(p.calls().is_empty());
        assert_eq!(p.text(), QWEN_CALL);
        assert!(out.iter().all(|d| matches!(d, Delta::Text(_))));
    }

    #[test]
    fn bare_and_fenced_json() {
        for text in [
            "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}",
            "```json\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n```",
            "  [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]",
            "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}",
            "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}",
        ] {
            let (_, p) = feed(opts(&["get_weather"]), text, 4);
            assert_eq!(p.calls(), &[Call { name: "get_weather".into(), arguments: "{\"city\":\"Rome\"}".into() }], "{text}");
        }
        let (_, p) = feed(opts(&["f"]), "{\"name\": \"f\", \"arguments\": {}}\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n", 3);
        assert_eq!(p.calls().len(), 2, "calls one per line");
        // an answer that starts like JSON but holds a tagged call: the call is still found
        let (_, p) = feed(opts(&["f"]), "`ls` lists files. <tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", 4);
        assert_eq!((p.text(), p.calls().len()), ("`ls` lists files. ", 1));
        // JSON that is not a call to an offered tool stays text
        let (_, p) = feed(opts(&["get_weather"]), "{\"answer\": 42}", 3);
        assert!(p.calls().is_empty());
        assert_eq!(p.text(), "{\"answer\": 42}");
    }

    #[test]
    fn string_arguments_and_unclosed_call() {
        let (_, p) = feed(opts(&["f"]), "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"x\\\": 1}\"}</tool_call>", 5);
        assert_eq!(p.calls(), &[Call { name: "f".into(), arguments: "{\"x\": 1}".into() }]);
        // the generation ended (a stop token) before the closing tag
        let (_, p) = feed(opts(&["f"]), "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": [1, 2]}}\n", 2);
        assert_eq!(p.calls(), &[Call { name: "f".into(), arguments: "{\"x\": [1, 2]}".into() }]);
    }

    #[test]
    fn a_tag_that_is_not_a_call_stays_text() {
        let text = "use <tool_call>not json</tool_call> here";
        let (_, p) = feed(opts(&["f"]), text, 3);
        assert!(p.calls().is_empty());
        assert_eq!(p.text(), text);
        // a held-back tag prefix that does not complete is sent at the end
        let (_, p) = feed(opts(&["f"]), "a <tool_c", 1);
        assert_eq!(p.text(), "a <tool_c");
    }

    #[test]
    fn reasoning_is_split_out() {
        let o = ParseOptions { reasoning: true, ..opts(&["f"]) };
        for n in [1, 4, 50] {
            let (_, p) = feed(o.clone(), "<think>\nhmm, f.\n</think>\n\nAnswer.", n);
            assert_eq!(p.reasoning(), "\nhmm, f.\n");
            assert_eq!(p.text(), "Answer.");
        }
        let o = ParseOptions { starts_in_reasoning: true, ..o };
        let (_, p) = feed(o, "plan</think>ok", 2);
        assert_eq!((p.reasoning(), p.text()), ("plan", "ok"));
    }

    #[test]
    fn multibyte_text_is_never_split() {
        let text = "héllo wörld → ünïcode <tool_call>{\"name\": \"f\", \"arguments\": {\"q\": \"日本語\"}}</tool_call>";
        for n in 1..6 {
            let (_, p) = feed(opts(&["f"]), text, n);
            assert_eq!(p.text(), "héllo wörld → ünïcode ");
            assert_eq!(p.calls()[0].arguments, "{\"q\": \"日本語\"}");
        }
    }
}

//! Tool calls over raw HTTP on the tiny random model (ChatML template without tools: the fallback
//! prompt). Its text is noise, so what is tested is the protocol: a named `tool_choice` always yields
//! that call (the prompt starts it), streamed and not alike; the tools reach the prompt; bad `tools` and
//! `tool_choice` are 400s naming the field. Never skipped; real models answer in tests/clients.

#[path = "../../engine/tests/common/mod.rs"]
mod common;
mod support;

use serde_json::{json, Value};
use support::*;

/// (A bounded schema: random weights would otherwise write one endless string.)
fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"], "additionalProperties": false}}})
}

#[test]
fn a_named_tool_choice_is_always_that_call() {
    let addr = tiny_server(config(2048, 16, 64));
    let forced = json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    let a = post(addr, "/v1/chat/completions", &tiny_chat("Weather in Paris?", 40, forced.clone()));
    assert_eq!(a.status, 200, "{}", a.body);
    let a = a.json();
    let msg = &a["choices"][0]["message"];
    let calls = msg["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1, "{a}");
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(msg["content"], Value::Null, "nothing but the call");
    // random weights, yet the arguments are JSON under the tool's schema: the grammar allowed nothing
    // else, then only end-of-generation, which ends the answer even under ignore_eos
    let args = calls[0]["function"]["arguments"].as_str().unwrap().to_string();
    let parsed: Value = serde_json::from_str(&args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(parsed.is_object(), "{args}");
    assert_eq!(a["choices"][0]["finish_reason"], "tool_calls");
    // the fallback prompt put the tool into the system message: the prompt is longer than without
    let plain = post(addr, "/v1/chat/completions", &tiny_chat("Weather in Paris?", 1, json!({}))).json();
    assert!(a["usage"]["prompt_tokens"].as_u64().unwrap() > plain["usage"]["prompt_tokens"].as_u64().unwrap() + 50);

    // streamed: the name once, the arguments in pieces that join to the same text
    let mut stream = forced.clone();
    stream["stream"] = json!(true);
    let s = post(addr, "/v1/chat/completions", &tiny_chat("Weather in Paris?", 40, stream));
    let (chunks, done) = sse_chunks(&s);
    assert!(done, "{}", s.body);
    let pieces: Vec<&Value> = chunks.iter().flat_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array().into_iter().flatten()).collect();
    assert_eq!(pieces.iter().filter(|p| p["function"]["name"].is_string()).count(), 1, "{chunks:?}");
    assert_eq!(pieces[0]["function"]["name"], "get_weather");
    assert!(pieces[0]["id"].as_str().unwrap().starts_with("call_"));
    assert!(pieces.iter().all(|p| p["index"] == 0));
    let joined: String = pieces.iter().filter_map(|p| p["function"]["arguments"].as_str()).collect();
    assert_eq!(joined, args);
    assert_eq!(streamed_finish(&chunks).as_deref(), Some("tool_calls"));
}

#[test]
fn tool_history_is_accepted() {
    let addr = tiny_server(config(2048, 16, 64));
    let body = json!({
        "model": TINY, "max_tokens": 2, "temperature": 0, "tools": [weather()],
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    });
    let a = post(addr, "/v1/chat/completions", &body);
    assert_eq!(a.status, 200, "{}", a.body);
}

#[test]
fn bad_tools_are_400s() {
    let addr = tiny_server(config(2048, 16, 64));
    let cases = [
        (json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}), "tool_choice", "nope"),
        (json!({"tool_choice": "required"}), "tool_choice", "no tools"),
        (json!({"tools": [weather()], "tool_choice": "sometimes"}), "tool_choice", "sometimes"),
        (json!({"tools": [{"type": "retrieval"}]}), "tools", "retrieval"),
        (json!({"response_format": {"type": "xml"}}), "response_format", "xml"),
        (json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}), "response_format", "schema"),
        (json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "many"}}}}), "response_format", "response_format"),
    ];
    for (extra, param, message) in cases {
        let a = post(addr, "/v1/chat/completions", &tiny_chat("hi", 2, extra));
        assert_error(&a, 400, "invalid_request_error", Some(param), message);
    }
    // an assistant message without content needs tool calls
    let body = json!({"model": TINY, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]});
    assert_error(&post(addr, "/v1/chat/completions", &body), 400, "invalid_request_error", Some("messages"), "needs content");
}

/// Structured output on random weights: whatever the model, the answer parses and fits the schema.
#[test]
fn response_format_is_enforced() {
    let addr = tiny_server(config(2048, 16, 64));
    let schema = json!({"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
                        "required": ["name", "age", "tags"], "additionalProperties": false});
    for (format, stream) in [(json!({"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": true}}), false),
                             (json!({"type": "json_schema", "json_schema": {"name": "p", "schema": schema, "strict": true}}), true)] {
        // without ignore_eos: the answer ends when the value does
        let mut body = chat_body(TINY, "Describe a person.", json!({"max_tokens": 200, "response_format": format, "stream": stream}));
        body["temperature"] = json!(1.0);
        body["seed"] = json!(7);
        let a = post(addr, "/v1/chat/completions", &body);
        assert_eq!(a.status, 200, "{}", a.body);
        let text = if stream { streamed_text(&sse_chunks(&a).0) } else { a.json()["choices"][0]["message"]["content"].as_str().unwrap().to_string() };
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        if !stream {
            assert_eq!(a.json()["choices"][0]["finish_reason"], "stop", "the answer ends with the value");
        }
        assert!(v.is_object(), "{text}");
        if format["type"] == "json_schema" {
            assert!(v["name"].as_str().unwrap().chars().count() <= 8, "{text}");
            assert!((0..=150).contains(&v["age"].as_i64().unwrap()), "{text}");
            assert!(v["tags"].as_array().unwrap().iter().all(|t| t == "a" || t == "b"), "{text}");
            assert_eq!(v.as_object().unwrap().len(), 3, "{text}");
        }
    }
}

/// `json_object` on random weights: valid JSON so far at every cut, an object once it ends.
#[test]
fn json_object_is_an_object() {
    let addr = tiny_server(config(2048, 16, 64));
    let body = chat_body(TINY, "Give JSON.", json!({"max_tokens": 300, "response_format": {"type": "json_object"}}));
    let a = post(addr, "/v1/chat/completions", &body).json();
    let text = a["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.starts_with('{'), "{text}");
    if a["choices"][0]["finish_reason"] == "stop" {
        assert!(serde_json::from_str::<Value>(text).unwrap().is_object(), "{text}");
    }
}

/// vLLM's `structured_outputs` (and its older `guided_*` fields, llama-server's `json_schema`) hold the
/// answer to the grammar on chat and text completions alike; two sources at once, or a kind reckon has
/// not, are a 400 naming the field.
#[test]
fn structured_outputs_are_enforced_on_chat_and_completions() {
    let addr = tiny_server(config(2048, 16, 64));
    let answer = |path: &str, extra: Value| {
        let mut body = if path.ends_with("chat/completions") { chat_body(TINY, "Answer.", json!({"max_tokens": 40})) } else { json!({"model": TINY, "prompt": "Answer.", "max_tokens": 40}) };
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body["temperature"] = json!(1.0);
        body["seed"] = json!(3);
        let a = post(addr, path, &body);
        assert_eq!(a.status, 200, "{extra}: {}", a.body);
        let c = &a.json()["choices"][0];
        c["message"]["content"].as_str().or(c["text"].as_str()).unwrap().to_string()
    };
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let yes_no = answer(path, json!({"structured_outputs": {"choice": ["yes", "no \"maybe\""]}}));
        assert!(yes_no == "yes" || yes_no == "no \"maybe\"", "{path}: {yes_no:?}");
        let digits = answer(path, json!({"structured_outputs": {"regex": "[0-9]{3}/x"}}));
        assert!(digits.len() == 5 && digits[..3].chars().all(|c| c.is_ascii_digit()) && digits.ends_with("/x"), "{path}: {digits:?}");
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": false});
        for extra in [json!({"structured_outputs": {"json": schema}}), json!({"guided_json": schema.to_string()}), json!({"json_schema": schema})] {
            let mut e = extra.clone();
            e["max_tokens"] = json!(60);
            let text = answer(path, e);
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} {extra}: {text:?}: {e}"));
            assert!(v["n"].is_number() && !text.contains('.') && v.as_object().unwrap().len() == 1, "{text}");
        }
        let choice = answer(path, json!({"guided_choice": ["left", "right"]}));
        assert!(choice == "left" || choice == "right", "{choice:?}");
    }
    for (extra, param) in [
        (json!({"structured_outputs": {"structural_tag": "{}"}}), "structured_outputs"),
        (json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}), "structured_outputs"),
        (json!({"structured_outputs": {"choice": []}}), "structured_outputs"),
        (json!({"guided_regex": "a", "guided_choice": ["b"]}), "guided_choice"),
        (json!({"structured_outputs": {"json": {"type": "object"}}, "response_format": {"type": "json_object"}}), "structured_outputs"),
        (json!({"structured_outputs": {"grammar": "start: ???"}}), "structured_outputs"),
    ] {
        let mut body = chat_body(TINY, "Answer.", json!({"max_tokens": 4}));
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let a = post(addr, "/v1/chat/completions", &body);
        assert_eq!(a.status, 400, "{extra}: {}", a.body);
        assert_eq!(a.json()["error"]["param"], param, "{extra}: {}", a.body);
    }
}

//! Tool calls over raw HTTP on the tiny random model (ChatML template without tools: the fallback
//! prompt). Its text is noise, so what is tested is the protocol: a named `tool_choice` always yields
//! that call (the prompt starts it), streamed and not alike; the tools reach the prompt; bad `tools` and
//! `tool_choice` are 400s naming the field. Never skipped; real models answer in tests/clients.

#[path = "../../engine/tests/common/mod.rs"]
mod common;
mod support;

use serde_json::{json, Value};
use support::*;

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
}

#[test]
fn a_named_tool_choice_is_always_that_call() {
    let addr = tiny_server(config(2048, 16, 64));
    let forced = json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    let a = post(addr, "/v1/chat/completions", &tiny_chat("Weather in Paris?", 12, forced.clone()));
    assert_eq!(a.status, 200, "{}", a.body);
    let a = a.json();
    let msg = &a["choices"][0]["message"];
    let calls = msg["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1, "{a}");
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(msg["content"], Value::Null, "nothing but the call");
    // the tiny model rambles to max_tokens: the arguments are whatever it wrote, as raw text
    let args = calls[0]["function"]["arguments"].as_str().unwrap().to_string();
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    // the fallback prompt put the tool into the system message: the prompt is longer than without
    let plain = post(addr, "/v1/chat/completions", &tiny_chat("Weather in Paris?", 1, json!({}))).json();
    assert!(a["usage"]["prompt_tokens"].as_u64().unwrap() > plain["usage"]["prompt_tokens"].as_u64().unwrap() + 50);

    // streamed: the name once, the arguments in pieces that join to the same text
    let mut stream = forced.clone();
    stream["stream"] = json!(true);
    let s = post(addr, "/v1/chat/completions", &tiny_chat("Weather in Paris?", 12, stream));
    let (chunks, done) = sse_chunks(&s);
    assert!(done, "{}", s.body);
    let pieces: Vec<&Value> = chunks.iter().flat_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array().into_iter().flatten()).collect();
    assert_eq!(pieces.iter().filter(|p| p["function"]["name"].is_string()).count(), 1, "{chunks:?}");
    assert_eq!(pieces[0]["function"]["name"], "get_weather");
    assert!(pieces[0]["id"].as_str().unwrap().starts_with("call_"));
    assert!(pieces.iter().all(|p| p["index"] == 0));
    let joined: String = pieces.iter().filter_map(|p| p["function"]["arguments"].as_str()).collect();
    assert_eq!(joined, args);
    assert_eq!(streamed_finish(&chunks).as_deref(), Some("length"));
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
        (json!({"response_format": {"type": "json_object"}}), "response_format", "not supported"),
    ];
    for (extra, param, message) in cases {
        let a = post(addr, "/v1/chat/completions", &tiny_chat("hi", 2, extra));
        assert_error(&a, 400, "invalid_request_error", Some(param), message);
    }
    // an assistant message without content needs tool calls
    let body = json!({"model": TINY, "messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]});
    assert_error(&post(addr, "/v1/chat/completions", &body), 400, "invalid_request_error", Some("messages"), "needs content");
}

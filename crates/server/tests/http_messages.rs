//! Anthropic's Messages API over raw HTTP on the tiny random model: the message and its stream (the
//! exact event sequence, the same text both ways), a forced `tool_use`, count_tokens against usage, and
//! errors in Anthropic's shape. Never skipped; the SDK tests on a real model are in tests/clients.

#[path = "../../engine/tests/common/mod.rs"]
mod common;
mod support;

use serde_json::{json, Value};
use support::*;

const MESSAGES: &str = "/v1/messages?beta=true";

fn body(extra: Value) -> Value {
    let mut b = json!({"model": TINY, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "Hi there"}]});
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    b
}

/// The named events of a stream and their data.
fn events(a: &Answer) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut name = String::new();
    for line in a.body.lines() {
        if let Some(n) = line.strip_prefix("event: ") {
            name = n.to_string();
        } else if let Some(d) = line.strip_prefix("data: ") {
            out.push((name.clone(), serde_json::from_str(d).unwrap()));
        }
    }
    out
}

#[test]
fn message_and_its_stream() {
    let addr = tiny_server(config(2048, 16, 64));
    let a = post(addr, MESSAGES, &body(json!({})));
    assert_eq!(a.status, 200, "{}", a.body);
    let m = a.json();
    assert_eq!((m["type"].as_str(), m["role"].as_str(), m["model"].as_str()), (Some("message"), Some("assistant"), Some(TINY)));
    assert_eq!(m["content"][0]["type"], "text");
    let text = m["content"][0]["text"].as_str().unwrap().to_string();
    let u = &m["usage"];
    let counted = post(addr, "/v1/messages/count_tokens", &body(json!({}))).json()["input_tokens"].as_u64().unwrap();
    assert_eq!(u["input_tokens"].as_u64().unwrap() + u["cache_read_input_tokens"].as_u64().unwrap(), counted);

    let s = post(addr, MESSAGES, &body(json!({"stream": true})));
    assert!(s.header("content-type").is_some_and(|t| t.starts_with("text/event-stream")));
    let evs = events(&s);
    let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names[..3], ["message_start", "ping", "content_block_start"], "{names:?}");
    assert_eq!(names[names.len() - 3..], ["content_block_stop", "message_delta", "message_stop"]);
    assert!(names[3..names.len() - 3].iter().all(|n| *n == "content_block_delta"));
    assert!(evs.iter().all(|(n, d)| d["type"] == n.as_str()), "each event's data names its type");
    let streamed: String = evs.iter().filter_map(|(_, d)| d["delta"]["text"].as_str()).collect();
    assert_eq!(streamed, text);
    let delta = &evs[evs.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], m["stop_reason"]);
    assert_eq!(delta["usage"]["output_tokens"], m["usage"]["output_tokens"]);
}

#[test]
fn forced_tool_use() {
    let addr = tiny_server(config(2048, 16, 64));
    let tools = json!({"tools": [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
                       "tool_choice": {"type": "tool", "name": "get_weather"}});
    let m = post(addr, MESSAGES, &body(tools.clone())).json();
    let uses: Vec<&Value> = m["content"].as_array().unwrap().iter().filter(|b| b["type"] == "tool_use").collect();
    assert_eq!(uses.len(), 1, "{m}");
    assert_eq!(uses[0]["name"], "get_weather");
    assert!(uses[0]["input"].is_object(), "input is always an object: {m}");
    assert!(uses[0]["id"].as_str().unwrap().starts_with("toolu_"));
    let mut stream = tools;
    stream["stream"] = json!(true);
    let evs = events(&post(addr, MESSAGES, &body(stream)));
    let start = evs.iter().find(|(n, d)| n == "content_block_start" && d["content_block"]["type"] == "tool_use").expect("a tool_use block");
    assert_eq!(start.1["content_block"]["name"], "get_weather");
    assert_eq!(start.1["content_block"]["input"], json!({}));
}

#[test]
fn errors_have_anthropics_shape() {
    let addr = tiny_server(config(2048, 16, 64));
    let check = |a: Answer, status: u16, kind: &str, says: &str| {
        assert_eq!(a.status, status, "{}", a.body);
        let v = a.json();
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], kind, "{v}");
        assert!(v["error"]["message"].as_str().unwrap().contains(says), "{v}");
    };
    let mut no_max = body(json!({}));
    no_max.as_object_mut().unwrap().remove("max_tokens");
    check(post(addr, MESSAGES, &no_max), 400, "invalid_request_error", "max_tokens");
    check(post(addr, MESSAGES, &body(json!({"model": "nope"}))), 404, "not_found_error", "nope");
    check(post(addr, MESSAGES, &body(json!({"messages": []}))), 400, "invalid_request_error", "at least one message");
    check(post(addr, MESSAGES, &body(json!({"temperature": 1.5}))), 400, "invalid_request_error", "temperature");
    check(post(addr, MESSAGES, &body(json!({"tool_choice": {"type": "any"}}))), 400, "invalid_request_error", "no tools");
    check(request(addr, "POST", MESSAGES, &[], "{not json"), 400, "invalid_request_error", "invalid request body");
    // reckon's extension, validated in Anthropic's shape too
    check(post(addr, MESSAGES, &body(json!({"reckon": {"spec_prefill": {"keep": 2}}}))), 400, "invalid_request_error", "spec_prefill");
    assert_eq!(post(addr, MESSAGES, &body(json!({"reckon": {"spec_prefill": false}}))).status, 200);
    // max_tokens beyond the context is clamped, not refused (Claude Code sends 32000)
    assert_eq!(post(addr, MESSAGES, &body(json!({"max_tokens": 32000, "stop_sequences": ["\n\n\n\n"]}))).status, 200);
}

/// Structured output (`output_config.format`) on random weights: the text parses and fits the schema.
#[test]
fn output_config_format_is_enforced() {
    let addr = tiny_server(config(2048, 16, 64));
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["ok", "n"], "additionalProperties": false});
    let m = post(addr, MESSAGES, &body(json!({"max_tokens": 60, "temperature": 1.0, "output_config": {"format": {"type": "json_schema", "schema": schema}}}))).json();
    let text = m["content"][0]["text"].as_str().unwrap();
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(v["ok"].is_boolean() && (0..=9).contains(&v["n"].as_i64().unwrap()), "{text}");
    assert_eq!(m["stop_reason"], "end_turn");
    let bad = post(addr, MESSAGES, &body(json!({"output_config": {"format": {"type": "json_schema"}}})));
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["type"], "invalid_request_error");
}

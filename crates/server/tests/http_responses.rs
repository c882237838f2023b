//! The Responses API over raw HTTP on the tiny random model: the response and its event stream (the same
//! output both ways, sequence numbers, the closing `response.completed`/`incomplete`), a forced call
//! into a namespace tool group coming back with `namespace` and `name` apart, the store (`GET`,
//! `DELETE`, `previous_response_id`, `store: false`), and 4xx answers. Never skipped.

#[path = "../../engine/tests/common/mod.rs"]
mod common;
mod support;

use serde_json::{json, Value};
use support::*;

fn body(extra: Value) -> Value {
    let mut b = json!({"model": TINY, "input": "Hi there", "max_output_tokens": 6, "temperature": 0});
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    b
}

fn stream_events(a: &Answer) -> Vec<Value> {
    a.body.lines().filter_map(|l| l.strip_prefix("data: ")).map(|d| serde_json::from_str(d).unwrap()).collect()
}

#[test]
fn response_and_its_stream() {
    let addr = tiny_server(config(2048, 16, 64));
    let r = post(addr, "/v1/responses", &body(json!({"instructions": "Be brief."})));
    assert_eq!(r.status, 200, "{}", r.body);
    let r = r.json();
    assert_eq!(r["object"], "response");
    assert!(r["id"].as_str().unwrap().starts_with("resp_"));
    assert_eq!(r["instructions"], "Be brief.");
    let status = r["status"].as_str().unwrap().to_string();
    assert!(status == "completed" || status == "incomplete", "{r}");
    assert_eq!(r["output"][0]["type"], "message");
    let text = r["output"][0]["content"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(r["usage"]["total_tokens"].as_u64(), Some(r["usage"]["input_tokens"].as_u64().unwrap() + r["usage"]["output_tokens"].as_u64().unwrap()));

    let s = post(addr, "/v1/responses", &body(json!({"instructions": "Be brief.", "stream": true})));
    let evs = stream_events(&s);
    let types: Vec<&str> = evs.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(types[..2], ["response.created", "response.in_progress"]);
    assert_eq!(*types.last().unwrap(), format!("response.{status}"));
    assert!(evs.iter().enumerate().all(|(i, e)| e["sequence_number"] == i), "sequence numbers count from 0");
    let deltas: String = evs.iter().filter(|e| e["type"] == "response.output_text.delta").map(|e| e["delta"].as_str().unwrap()).collect();
    assert_eq!(deltas, text);
    let last = &evs.last().unwrap()["response"];
    assert_eq!(last["output"][0]["content"], r["output"][0]["content"], "the closing event carries the whole output");
    assert_eq!(last["usage"]["output_tokens"], r["usage"]["output_tokens"]);
}

#[test]
fn forced_namespace_call() {
    let addr = tiny_server(config(2048, 16, 64));
    let tools = json!({
        "tools": [{"type": "namespace", "name": "mcp__files__", "tools": [{"type": "function", "name": "read_file", "parameters": {"type": "object"}}]},
                  {"type": "custom", "name": "apply_patch"}, {"type": "web_search"}],
        "tool_choice": {"type": "function", "name": "read_file", "namespace": "mcp__files__"},
    });
    let r = post(addr, "/v1/responses", &body(tools.clone())).json();
    let call = &r["output"][0];
    assert_eq!(call["type"], "function_call", "{r}");
    assert_eq!((call["namespace"].as_str(), call["name"].as_str()), (Some("mcp__files__"), Some("read_file")));
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"));
    let mut stream = tools;
    stream["stream"] = json!(true);
    let evs = stream_events(&post(addr, "/v1/responses", &body(stream)));
    let done: Vec<&Value> = evs.iter().filter(|e| e["type"] == "response.output_item.done").collect();
    assert_eq!(done.len(), 1);
    assert_eq!((done[0]["item"]["namespace"].as_str(), done[0]["item"]["name"].as_str()), (Some("mcp__files__"), Some("read_file")));
    let args: String = evs.iter().filter(|e| e["type"] == "response.function_call_arguments.delta").map(|e| e["delta"].as_str().unwrap()).collect();
    assert_eq!(args, done[0]["item"]["arguments"].as_str().unwrap());
}

#[test]
fn the_store() {
    let addr = tiny_server(config(2048, 16, 64));
    let first = post(addr, "/v1/responses", &body(json!({}))).json();
    let id = first["id"].as_str().unwrap();
    assert_eq!(get(addr, &format!("/v1/responses/{id}")).json()["id"], id);
    let second = post(addr, "/v1/responses", &body(json!({"previous_response_id": id, "input": "again"}))).json();
    assert!(second["usage"]["input_tokens"].as_u64() > first["usage"]["input_tokens"].as_u64(), "the first turn is in the prompt");
    assert_eq!(request(addr, "DELETE", &format!("/v1/responses/{id}"), &[], "").json()["deleted"], true);
    assert_error(&get(addr, &format!("/v1/responses/{id}")), 404, "invalid_request_error", None, id);
    let gone = post(addr, "/v1/responses", &body(json!({"previous_response_id": id})));
    assert_error(&gone, 404, "invalid_request_error", Some("previous_response_id"), id);
    let unstored = post(addr, "/v1/responses", &body(json!({"store": false}))).json();
    assert_eq!(get(addr, &format!("/v1/responses/{}", unstored["id"].as_str().unwrap())).status, 404);
}

#[test]
fn bad_requests() {
    let addr = tiny_server(config(2048, 16, 64));
    assert_error(&post(addr, "/v1/responses", &body(json!({"input": []}))), 400, "invalid_request_error", Some("input"), "must not be empty");
    assert_error(&post(addr, "/v1/responses", &body(json!({"max_output_tokens": 0}))), 400, "invalid_request_error", Some("max_output_tokens"), "at least 1");
    assert_error(&post(addr, "/v1/responses", &body(json!({"tool_choice": "required"}))), 400, "invalid_request_error", Some("tool_choice"), "no tools");
    assert_error(&post(addr, "/v1/responses", &body(json!({"model": "nope"}))), 404, "invalid_request_error", Some("model"), "nope");
}

//! Refusals in OpenAI's error shape (`{"error": {"message", "type", "param", "code"}}`), on the tiny
//! model: authentication, bodies that are not JSON or have the wrong types, messages that are missing,
//! empty or have an unknown role, the engine's limits (each naming its `param` and the limit), token
//! ids outside the vocabulary, and a body over the size limit (413, JSON, not axum's plain text).

#[path = "../../engine/tests/common/mod.rs"]
mod common;
mod support;

use serde_json::{json, Value};
use support::*;

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";

fn completion(extra: Value) -> Value {
    let mut body = json!({ "model": TINY, "prompt": "Hi", "temperature": 0, "max_tokens": 2 });
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

#[test]
fn authentication_model_and_context() {
    let mut state = tiny_state(config(64, 16, 64));
    state.api_keys = vec!["sekrit".into(), "other-key".into()];
    let addr = serve(state);
    let auth = [("Authorization", "Bearer sekrit")];
    let body = tiny_chat("Hi", 4, json!({})).to_string();
    let a = request(addr, "POST", CHAT, &[], &body);
    let e = assert_error(&a, 401, "authentication_error", None, "API key");
    assert_eq!(e["error"]["code"], "invalid_api_key");
    assert_error(&request(addr, "POST", CHAT, &[("Authorization", "Bearer wrong")], &body), 401, "authentication_error", None, "API key");
    assert_error(&request(addr, "POST", COMPLETIONS, &[], &completion(json!({})).to_string()), 401, "authentication_error", None, "API key");
    assert_eq!(request(addr, "GET", "/v1/models", &[], "").status, 401);
    // any of the keys, as a bearer token or Anthropic's header; a key's prefix or extension is not one
    assert_eq!(request(addr, "GET", "/v1/models", &[("Authorization", "Bearer other-key")], "").status, 200);
    assert_eq!(request(addr, "GET", "/v1/models", &[("x-api-key", "sekrit")], "").status, 200);
    for wrong in ["Bearer sekri", "Bearer sekritt", "Bearer ", "sekrit"] {
        assert_eq!(request(addr, "GET", "/v1/models", &[("Authorization", wrong)], "").status, 401, "{wrong}");
    }
    // health and metrics need no key
    assert_eq!(request(addr, "GET", "/health", &[], "").status, 200);
    assert_eq!(request(addr, "GET", "/metrics", &[], "").status, 200);

    assert_error(&request(addr, "POST", CHAT, &auth, "{not json"), 400, "invalid_request_error", None, "invalid request body");
    assert_error(&request(addr, "POST", CHAT, &auth, ""), 400, "invalid_request_error", None, "invalid request body");
    let e = assert_error(&request(addr, "POST", CHAT, &auth, &tiny_chat("Hi", 4, json!({"model": "gpt-4"})).to_string()), 404, "invalid_request_error", Some("model"), "gpt-4");
    assert_eq!(e["error"]["code"], "model_not_found");
    assert_error(&request(addr, "POST", CHAT, &auth, &tiny_chat("Hi", 4, json!({"n": 2})).to_string()), 400, "invalid_request_error", Some("n"), "n = 1");
    assert_error(&request(addr, "POST", CHAT, &auth, &tiny_chat("Hi", 4, json!({"temperature": 3})).to_string()), 400, "invalid_request_error", Some("temperature"), "between 0 and 2");
    let long = "cache ".repeat(100);
    let a = request(addr, "POST", CHAT, &auth, &tiny_chat(&long, 4, json!({})).to_string());
    assert_error(&a, 400, "invalid_request_error", Some("messages"), "maximum context length is 64 tokens");
    let a = request(addr, "POST", COMPLETIONS, &auth, &completion(json!({"prompt": long})).to_string());
    assert_error(&a, 400, "invalid_request_error", Some("prompt"), "maximum context length is 64 tokens");
    let a = request(addr, "POST", CHAT, &auth, &tiny_chat("Hi", 4, json!({})).to_string());
    assert_eq!(a.status, 200, "{}", a.body);
}

/// Values of the wrong JSON type are refused as invalid requests (never a 422 or a plain-text body) whose
/// `param` names the field, and the message says what was expected.
#[test]
fn wrong_json_types_are_400_naming_the_field() {
    let addr = tiny_server(config(256, 16, 64));
    for (path, body, param, expected) in [
        (CHAT, tiny_chat("Hi", 4, json!({"messages": "hi"})), Some("messages"), "expected a sequence"),
        (CHAT, tiny_chat("Hi", 4, json!({"max_tokens": "ten"})), Some("max_tokens"), "expected usize"),
        (CHAT, tiny_chat("Hi", 4, json!({"max_tokens": -1})), Some("max_tokens"), "expected usize"),
        (CHAT, tiny_chat("Hi", 4, json!({"temperature": "hot"})), Some("temperature"), "expected f32"),
        (CHAT, tiny_chat("Hi", 4, json!({"stream": "yes"})), Some("stream"), "expected a boolean"),
        (CHAT, tiny_chat("Hi", 4, json!({"stop": 5})), Some("stop"), "did not match any variant"),
        (CHAT, tiny_chat("Hi", 4, json!({"model": 7})), Some("model"), "expected a string"),
        (CHAT, tiny_chat("Hi", 4, json!({"logprobs": "yes", "top_logprobs": "3"})), Some("logprobs"), "expected a boolean"),
        (CHAT, tiny_chat("Hi", 4, json!({"messages": [{"role": "user", "content": 5}]})), Some("messages"), "did not match any variant"),
        (CHAT, json!(["not", "an", "object"]), None, "expected"),
        (COMPLETIONS, completion(json!({"prompt": {"text": "Hi"}})), Some("prompt"), "did not match any variant"),
        (COMPLETIONS, completion(json!({"prompt": [1, -2]})), Some("prompt"), "did not match any variant"),
        (COMPLETIONS, completion(json!({"logprobs": true})), Some("logprobs"), "expected usize"),
    ] {
        let a = post(addr, path, &body);
        let v = assert_error(&a, 400, "invalid_request_error", param, "invalid request body");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(expected), "{body}: {message:?} does not say {expected:?}");
    }
}

#[test]
fn messages_missing_empty_or_with_an_unknown_role() {
    let addr = tiny_server(config(256, 16, 64));
    let no_messages = json!({ "model": TINY, "max_tokens": 2 });
    assert_error(&post(addr, CHAT, &no_messages), 400, "invalid_request_error", Some("messages"), "missing field `messages`");
    let no_model = json!({ "messages": [{"role": "user", "content": "Hi"}] });
    assert_error(&post(addr, CHAT, &no_model), 400, "invalid_request_error", Some("model"), "missing field `model`");
    assert_error(&post(addr, CHAT, &tiny_chat("Hi", 2, json!({"messages": []}))), 400, "invalid_request_error", Some("messages"), "must not be empty");
    let body = tiny_chat("Hi", 4, json!({"messages": [{"role": "user"}]}));
    assert_error(&post(addr, CHAT, &body), 400, "invalid_request_error", Some("messages"), "a 'user' message needs content");
    for role in ["wizard", ""] {
        let body = tiny_chat("Hi", 2, json!({"messages": [{"role": role, "content": "Hi"}]}));
        assert_error(&post(addr, CHAT, &body), 400, "invalid_request_error", Some("messages"), &format!("unsupported role '{role}'"));
    }
    // "developer" is OpenAI's newer name for "system"
    let body = tiny_chat("Hi", 2, json!({"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}));
    assert_eq!(post(addr, CHAT, &body).status, 200);
    assert_error(&post(addr, COMPLETIONS, &json!({ "model": TINY })), 400, "invalid_request_error", Some("prompt"), "missing field `prompt`");
}

/// The engine's limits, each refused with its API's `param` name and a message that states the limit.
#[test]
fn limits_name_their_param() {
    let addr = tiny_server(config(256, 16, 64));
    let five = json!(["a", "b", "c", "d", "e"]);
    for (path, body, param, says) in [
        (CHAT, tiny_chat("Hi", 0, json!({})), "max_tokens", "at least 1"),
        (CHAT, tiny_chat("Hi", 4, json!({"max_tokens": null, "max_completion_tokens": 0})), "max_tokens", "at least 1"),
        (COMPLETIONS, completion(json!({"max_tokens": 0})), "max_tokens", "at least 1"),
        (CHAT, tiny_chat("Hi", 4, json!({"stop": five})), "stop", "at most 4 stop sequences"),
        (COMPLETIONS, completion(json!({"stop": five})), "stop", "at most 4 stop sequences"),
        (CHAT, tiny_chat("Hi", 4, json!({"logprobs": true, "top_logprobs": 21})), "top_logprobs", "at most 20"),
        (CHAT, tiny_chat("Hi", 4, json!({"top_logprobs": 2})), "top_logprobs", "needs logprobs"),
        (COMPLETIONS, completion(json!({"logprobs": 6})), "logprobs", "between 0 and 5"),
        (CHAT, tiny_chat("Hi", 4, json!({"top_p": 0})), "top_p", "(0, 1]"),
        (CHAT, tiny_chat("Hi", 4, json!({"presence_penalty": 3})), "presence_penalty", "[-2, 2]"),
        (CHAT, tiny_chat("Hi", 4, json!({"frequency_penalty": -2.5})), "frequency_penalty", "[-2, 2]"),
        (CHAT, tiny_chat("Hi", 4, json!({"temperature": -0.5})), "temperature", "between 0 and 2"),
        (CHAT, tiny_chat("Hi", 4, json!({"cache_salt": ""})), "cache_salt", "must not be empty"),
        (COMPLETIONS, completion(json!({"prompt": [1, 2, 263]})), "prompt", "token id 263 is outside the vocabulary (263 tokens)"),
        (COMPLETIONS, completion(json!({"prompt": [4_000_000_000u32]})), "prompt", "outside the vocabulary (263 tokens)"),
        (COMPLETIONS, completion(json!({"prompt": []})), "prompt", "the prompt is empty"),
        (COMPLETIONS, completion(json!({"prompt": ""})), "prompt", "the prompt is empty"),
    ] {
        let a = post(addr, path, &body);
        assert_error(&a, 400, "invalid_request_error", Some(param), says);
    }
    // four stop strings are fine, and one as a plain string
    assert_eq!(post(addr, CHAT, &tiny_chat("Hi", 2, json!({"stop": ["a", "b", "c", "d"]}))).status, 200);
    assert_eq!(post(addr, COMPLETIONS, &completion(json!({"stop": "a"}))).status, 200);
    // nothing refused was left in the engine
    let m = wait_for_metrics(addr, TINY, "an idle engine", Metrics::idle);
    assert_eq!(m.value("reckon_request_success_total"), 2.0, "{}", m.text);
}

/// The request limits on counts: too many messages or tools is a 400 naming the field, in each API's
/// own shape; at the limit, the request is served.
#[test]
fn too_many_messages_or_tools_are_400_in_each_apis_shape() {
    let mut state = tiny_state(config(256, 16, 64));
    state.limits = reckon_server::RequestLimits { max_messages: 3, max_tools: 2 };
    let addr = serve(state);
    let msgs = |n: usize| (0..n).map(|i| json!({"role": if i % 2 == 0 { "user" } else { "assistant" }, "content": "a"})).collect::<Vec<_>>();
    let tool = |name: &str| json!({"type": "function", "function": {"name": name, "parameters": {"type": "object"}}});
    assert_eq!(post(addr, CHAT, &tiny_chat("", 2, json!({"messages": msgs(3)}))).status, 200);
    assert_error(&post(addr, CHAT, &tiny_chat("", 2, json!({"messages": msgs(5)}))), 400, "invalid_request_error", Some("messages"), "at most 3 messages");
    let tools3 = json!({"tools": [tool("a"), tool("b"), tool("c")]});
    assert_error(&post(addr, CHAT, &tiny_chat("Hi", 2, tools3)), 400, "invalid_request_error", Some("tools"), "at most 2 tools");
    // Anthropic's Messages API: its error shape
    let a = post(addr, "/v1/messages", &json!({"model": TINY, "max_tokens": 2, "messages": msgs(5)}));
    assert_eq!(a.status, 400, "{}", a.body);
    let v: Value = serde_json::from_str(&a.body).unwrap();
    assert_eq!((v["type"].as_str(), v["error"]["type"].as_str()), (Some("error"), Some("invalid_request_error")), "{}", a.body);
    assert!(v["error"]["message"].as_str().unwrap().contains("at most 3 messages"), "{}", a.body);
    // the Responses API counts input items
    let items: Vec<Value> = (0..5).map(|_| json!({"role": "user", "content": "a"})).collect();
    assert_error(&post(addr, "/v1/responses", &json!({"model": TINY, "max_output_tokens": 2, "input": items})), 400, "invalid_request_error", Some("input"), "at most 3 messages");
}

/// A body over `max_body_bytes` is 413 with OpenAI's error JSON (not axum's plain-text rejection), on
/// both completion routes; one under the limit is served.
#[test]
fn an_oversized_body_is_413_in_openai_shape() {
    let mut state = tiny_state(config(256, 16, 64));
    state.max_body_bytes = 1024;
    let addr = serve(state);
    let big = tiny_chat(&"x".repeat(4000), 2, json!({}));
    for (path, body) in [(CHAT, big.clone()), (COMPLETIONS, completion(json!({"prompt": "y".repeat(4000)})))] {
        let a = post(addr, path, &body);
        let e = assert_error(&a, 413, "invalid_request_error", None, "larger than 1024 bytes");
        assert_eq!(e["error"]["code"], "request_too_large");
    }
    // a chunked body (no Content-Length) over the limit too
    let chunk = "x".repeat(4000);
    let mut s = connect(addr);
    let raw = format!("POST {CHAT} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n{:x}\r\n{chunk}\r\n0\r\n\r\n", chunk.len());
    std::io::Write::write_all(&mut s, raw.as_bytes()).unwrap();
    assert_error(&read_answer(s), 413, "invalid_request_error", None, "larger than 1024 bytes");
    // a body at the limit is read
    let small = tiny_chat("Hi", 2, json!({}));
    assert_eq!(post(addr, CHAT, &small).status, 200);
    let mut padded = small.to_string();
    padded.insert_str(1, &" ".repeat(1024 - padded.len()));
    assert_eq!(padded.len(), 1024);
    assert_eq!(request(addr, "POST", CHAT, &[], &padded).status, 200);
    padded.insert(1, ' ');
    assert_eq!(request(addr, "POST", CHAT, &[], &padded).status, 413);
}

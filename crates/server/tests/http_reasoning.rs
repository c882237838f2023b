//! Reasoning models: a template whose generation prompt opens `<think>` (as Qwen3's and DeepSeek-R1's
//! do). On the tiny random model, which never closes the tag, the whole answer is reasoning, and each API
//! returns it in its own place: chat's `reasoning_content` (streamed as deltas), a Responses `reasoning`
//! item, a Messages `thinking` block. A template that renders a `<think>` it did not open is read the
//! same way. Never skipped.

#[path = "../../engine/tests/common/mod.rs"]
mod common;
mod support;

use reckon_engine::template::ChatTemplate;
use serde_json::{json, Value};
use std::sync::Arc;
use support::*;

const THINKING_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}";

fn thinking_server() -> std::net::SocketAddr {
    let mut state = tiny_state(config(2048, 16, 64));
    state.template = Arc::new(ChatTemplate::new(THINKING_TEMPLATE.into(), "", "").unwrap());
    serve(state)
}

#[test]
fn chat_returns_reasoning_content() {
    let addr = thinking_server();
    let a = post(addr, "/v1/chat/completions", &tiny_chat("Think.", 12, json!({}))).json();
    let msg = &a["choices"][0]["message"];
    let reasoning = msg["reasoning_content"].as_str().expect("reasoning_content").to_string();
    assert!(!reasoning.is_empty(), "{a}");
    assert_eq!(msg["content"], "", "{a}");
    let s = post(addr, "/v1/chat/completions", &tiny_chat("Think.", 12, json!({"stream": true})));
    let (chunks, done) = sse_chunks(&s);
    assert!(done);
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["reasoning_content"].as_str()).collect();
    assert_eq!(streamed, reasoning);
    assert_eq!(streamed_text(&chunks), "");
}

#[test]
fn responses_and_messages_return_reasoning() {
    let addr = thinking_server();
    let r = post(addr, "/v1/responses", &json!({"model": TINY, "input": "Think.", "max_output_tokens": 8, "temperature": 0})).json();
    assert_eq!(r["output"][0]["type"], "reasoning", "{r}");
    assert!(!r["output"][0]["content"][0]["text"].as_str().unwrap().is_empty());
    let m = post(addr, "/v1/messages", &json!({"model": TINY, "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": "Think."}]})).json();
    assert_eq!(m["content"][0]["type"], "thinking", "{m}");
    assert!(!m["content"][0]["thinking"].as_str().unwrap().is_empty());
    // streamed Messages: a thinking block with thinking_delta pieces
    let s = post(addr, "/v1/messages", &json!({"model": TINY, "max_tokens": 8, "temperature": 0, "stream": true, "messages": [{"role": "user", "content": "Think."}]}));
    let datas: Vec<Value> = s.body.lines().filter_map(|l| l.strip_prefix("data: ")).map(|d| serde_json::from_str(d).unwrap()).collect();
    assert!(datas.iter().any(|d| d["content_block"]["type"] == "thinking"), "{}", s.body);
    assert!(datas.iter().any(|d| d["delta"]["type"] == "thinking_delta"), "{}", s.body);
}

/// Qwen3's switch, as its template reads it: `enable_thinking` false closes an empty `<think>` block in
/// the generation prompt.
const SWITCH_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}";

#[test]
fn chat_template_kwargs_reach_the_template() {
    let mut state = tiny_state(config(2048, 16, 64));
    state.template = Arc::new(ChatTemplate::new(SWITCH_TEMPLATE.into(), "", "").unwrap());
    let addr = serve(state);
    let thinking = post(addr, "/v1/chat/completions", &tiny_chat("Think.", 8, json!({}))).json();
    assert!(!thinking["choices"][0]["message"]["reasoning_content"].as_str().unwrap_or("").is_empty(), "{thinking}");
    let off = post(addr, "/v1/chat/completions", &tiny_chat("Think.", 8, json!({"chat_template_kwargs": {"enable_thinking": false}}))).json();
    let msg = &off["choices"][0]["message"];
    assert!(msg["reasoning_content"].as_str().unwrap_or("").is_empty(), "{off}");
    assert!(!msg["content"].as_str().unwrap().is_empty(), "{off}");
    // the variables the server sets are not the request's to replace
    let bad = post(addr, "/v1/chat/completions", &tiny_chat("Think.", 8, json!({"chat_template_kwargs": {"add_generation_prompt": false}})));
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert_eq!(bad.json()["error"]["param"], "chat_template_kwargs");
}

/// Anthropic's `thinking.budget_tokens` caps the reasoning: the tiny model never closes `<think>` by
/// itself, so with a budget the block ends after that many tokens (its text is what the same tokens
/// give unbudgeted; the closing tokens are forced) and the answer goes on as text. `disabled` turns reasoning off through the
/// template's switch; a budget not below max_tokens is a 400 naming it.
#[test]
fn messages_thinking_budget_closes_the_block_and_the_answer_begins() {
    let addr = thinking_server();
    let ask = |extra: Value| {
        let mut body = json!({"model": TINY, "max_tokens": 24, "temperature": 0, "messages": [{"role": "user", "content": "Think."}]});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        post(addr, "/v1/messages", &body)
    };
    // unbudgeted, the model reasons for 5 tokens and ends (its end-of-generation token)
    let free = ask(json!({})).json();
    assert_eq!((free["content"].as_array().unwrap().len(), free["usage"]["output_tokens"].as_u64()), (1, Some(5)), "{free}");
    let two = ask(json!({"max_tokens": 2})).json();
    let capped = ask(json!({"thinking": {"type": "enabled", "budget_tokens": 2}})).json();
    let blocks = capped["content"].as_array().unwrap();
    assert_eq!(blocks[0]["type"], "thinking", "{capped}");
    assert_eq!(blocks[0]["thinking"].as_str().unwrap().trim_end(), two["content"][0]["thinking"].as_str().unwrap().trim_end(), "{capped}");
    // 2 tokens of reasoning, then `</think>` and two newlines (9 byte tokens) forced, then the answer
    assert!(capped["usage"]["output_tokens"].as_u64().unwrap() >= 11, "{capped}");
    assert!(blocks.iter().skip(1).all(|b| b["type"] == "text"), "{capped}");
    // streamed alike
    let s = ask(json!({"thinking": {"type": "enabled", "budget_tokens": 2}, "stream": true}));
    let datas: Vec<Value> = s.body.lines().filter_map(|l| l.strip_prefix("data: ")).map(|d| serde_json::from_str(d).unwrap()).collect();
    let streamed: String = datas.iter().filter_map(|d| d["delta"]["thinking"].as_str()).collect();
    assert_eq!(streamed.trim_end(), two["content"][0]["thinking"].as_str().unwrap().trim_end(), "{}", s.body);
    let bad = ask(json!({"thinking": {"type": "enabled", "budget_tokens": 24}}));
    assert_eq!(bad.status, 400, "{}", bad.body);
    assert!(bad.json()["error"]["message"].as_str().unwrap().contains("budget_tokens"), "{}", bad.body);
    let bad = ask(json!({"thinking": {"type": "sometimes"}}));
    assert_eq!(bad.status, 400, "{}", bad.body);
}

#[test]
fn messages_thinking_disabled_uses_the_templates_switch() {
    let mut state = tiny_state(config(2048, 16, 64));
    state.template = Arc::new(ChatTemplate::new(SWITCH_TEMPLATE.into(), "", "").unwrap());
    let addr = serve(state);
    let body = |thinking: Value| json!({"model": TINY, "max_tokens": 8, "temperature": 0, "thinking": thinking, "messages": [{"role": "user", "content": "Think."}]});
    let on = post(addr, "/v1/messages", &body(json!({"type": "enabled", "budget_tokens": 4}))).json();
    assert_eq!(on["content"][0]["type"], "thinking", "{on}");
    let off = post(addr, "/v1/messages", &body(json!({"type": "disabled"}))).json();
    assert!(off["content"].as_array().unwrap().iter().all(|b| b["type"] == "text"), "{off}");
}

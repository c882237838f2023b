//! What needs real text, on the real default model (SmolLM2): greedy text streamed and not is the same
//! readable text, a stop string cuts real words, log-probability tokens spell the text, and text
//! completions' legacy log-probabilities. Everything else is tested on the tiny model (http_api.rs,
//! http_errors.rs, http_lifecycle.rs). Skipped when the model is not fetched, unless
//! RECKON_REQUIRE_MODELS=1.

#[path = "../../engine/tests/common/mod.rs"]
mod common;
mod support;

use serde_json::{json, Value};
use support::*;

const MODEL: &str = "smollm2-135m";

/// The greedy haiku runs past 16 tokens (22 since 41677a0's scores, then end of generation), so these
/// requests end at their length.
fn ask(extra: Value) -> Value {
    let mut body = chat_body(MODEL, "Write a haiku about caches.", json!({"max_tokens": 16}));
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

fn chat(addr: std::net::SocketAddr, body: Value) -> Value {
    let a = post(addr, "/v1/chat/completions", &body);
    assert_eq!(a.status, 200, "{}", a.body);
    a.json()
}

#[test]
fn real_text_streamed_and_not_stop_strings_and_logprobs() {
    let Some(state) = real_state(config(2048, 16, 64)) else { return };
    let addr = serve(state);

    let a = chat(addr, ask(json!({})));
    let text = a["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(text.split_whitespace().count() >= 4, "{text:?}");
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    assert_eq!(a["usage"]["completion_tokens"], 16);
    assert_eq!(chat(addr, ask(json!({})))["choices"][0]["message"]["content"], text.as_str(), "greedy is deterministic");

    // streamed: the same text, chunk by chunk
    let s = post(addr, "/v1/chat/completions", &ask(json!({"stream": true, "stream_options": {"include_usage": true}})));
    let (chunks, done) = sse_chunks(&s);
    assert!(done, "{}", s.body);
    assert_eq!(streamed_text(&chunks), text);
    assert_eq!(streamed_finish(&chunks).as_deref(), Some("length"));
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 16);

    // a stop string (a real word) cuts the text before it, never leaking part of it
    let word = text.split_whitespace().nth(2).unwrap().to_string();
    let s = chat(addr, ask(json!({"stop": [word.clone()]})));
    let cut = s["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(cut, &text[..text.find(&word).unwrap()]);
    assert_eq!(s["choices"][0]["finish_reason"], "stop");
    let st = post(addr, "/v1/chat/completions", &ask(json!({"stop": word, "stream": true})));
    let (chunks, done) = sse_chunks(&st);
    assert!(done);
    assert_eq!(streamed_text(&chunks), cut);
    assert_eq!(streamed_finish(&chunks).as_deref(), Some("stop"));

    // log-probabilities: greedy picks the top alternative; the tokens spell the text
    let l = chat(addr, ask(json!({"logprobs": true, "top_logprobs": 3, "max_tokens": 6})));
    let entries = l["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(entries.len(), 6);
    for e in entries {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!((&e["token"], &e["logprob"]), (&top[0]["token"], &top[0]["logprob"]), "{e}");
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
    }
    let spelled: String = entries.iter().map(|e| e["token"].as_str().unwrap()).collect();
    assert_eq!(spelled, l["choices"][0]["message"]["content"].as_str().unwrap());

    // text completions: the raw prompt, streamed and not, the same greedy text
    let body = json!({ "model": MODEL, "prompt": "The capital of France is", "temperature": 0, "max_tokens": 8 });
    let c = post(addr, "/v1/completions", &body);
    assert_eq!(c.status, 200, "{}", c.body);
    let c = c.json();
    let full = c["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(full.contains("Paris"), "{full:?}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (chunks, _) = sse_chunks(&post(addr, "/v1/completions", &streamed));
    assert_eq!(streamed_text(&chunks), full);

    // text completions' (legacy) log-probabilities: parallel lists, offsets into the text
    let mut with_lp = body.clone();
    with_lp["logprobs"] = json!(2);
    let c = post(addr, "/v1/completions", &with_lp).json();
    let lp = &c["choices"][0]["logprobs"];
    let tokens: Vec<&str> = lp["tokens"].as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!((tokens.len(), tokens.concat()), (8, full.clone()), "{lp}");
    assert_eq!(lp["text_offset"][0], 0);
    assert_eq!(lp["text_offset"][1].as_u64().unwrap() as usize, tokens[0].chars().count());
    for i in 0..8 {
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert_eq!(top.len(), 2);
        assert!(top.values().all(|v| v.as_f64().unwrap() <= lp["token_logprobs"][i].as_f64().unwrap()), "{top:?}");
        assert_eq!(top.get(tokens[i]), Some(&lp["token_logprobs"][i]), "greedy picks the top alternative");
    }

    let m = wait_for_metrics(addr, MODEL, "an idle engine", Metrics::idle);
    assert_eq!(m.value("reckon_request_aborted_total"), 0.0, "{}", m.text);
    assert_eq!(m.value("reckon_request_success_total"), 9.0, "{}", m.text);
}

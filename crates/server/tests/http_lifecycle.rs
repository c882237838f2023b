//! How requests end, on the tiny model, without relying on the engine being slower or faster than the
//! test: a client that hangs up is aborted and its blocks freed (its request could run for seconds, so
//! only the hang-up can end it), a stop string ends a request as a success, a full queue answers 429
//! with `Retry-After` (the queue is filled by a request held running and one held waiting), and a
//! failure midway through a stream ends it with an error event.

#[path = "../../engine/tests/common/mod.rs"]
mod common;
mod support;

use reckon_engine::engine::{Event, FinishReason};
use reckon_server::{stream_events, Api};
use serde_json::{json, Value};
use support::*;

const CHAT: &str = "/v1/chat/completions";

/// A streamed request that would generate until the context is full (tens of thousands of tokens).
fn endless(content: &str) -> Value {
    tiny_chat(content, 1_000_000, json!({"stream": true}))
}

#[test]
fn a_client_that_hangs_up_is_aborted_and_its_blocks_freed() {
    let addr = tiny_server(config(TINY_CONTEXT, 16, 64));
    let mut s = OpenStream::start(addr, CHAT, &endless("Tell me everything."));
    s.read_events(4);
    let m = Metrics::read(addr, TINY);
    assert_eq!(m.value("vllm:num_requests_running"), 1.0, "{}", m.text);
    assert!(m.value("vllm:kv_cache_usage_perc") > 0.0);
    s.hang_up();
    let m = wait_for_metrics(addr, TINY, "the abort", |m| m.value("reckon_request_aborted_total") == 1.0 && m.idle());
    assert_eq!(m.value("reckon_request_success_total"), 0.0, "{}", m.text);
    assert_eq!(m.value("reckon_kv_blocks_free"), config(TINY_CONTEXT, 16, 64).num_blocks as f64);
    let generated = m.value("reckon_generation_tokens_total");
    assert!(generated < (TINY_CONTEXT / 2) as f64, "aborted only after {generated} tokens");
    // the server still serves
    let a = post(addr, CHAT, &tiny_chat("Hi", 3, json!({})));
    assert_eq!(a.status, 200, "{}", a.body);
}

/// Load: 24 concurrent streaming clients, a third of which hang up after a few chunks of a request that
/// only their hanging up can end. Every other one gets its whole answer, and afterwards nothing is
/// running, every KV block is free, and each request is counted once: 16 successes, 8 aborts.
#[test]
fn concurrent_streams_with_disconnects() {
    let addr = tiny_server(config(TINY_CONTEXT, 32, 64));
    let max_tokens = 24;
    let clients: Vec<_> = (0..24)
        .map(|i| {
            std::thread::spawn(move || {
                let prompt = format!("Tell me fact number {i} about caches.");
                if i % 3 == 0 {
                    let mut s = OpenStream::start(addr, CHAT, &endless(&prompt));
                    s.read_events(3);
                    s.hang_up();
                    return None;
                }
                let body = tiny_chat(&prompt, max_tokens, json!({"stream": true, "stream_options": {"include_usage": true}}));
                let a = post(addr, CHAT, &body);
                assert_eq!(a.status, 200);
                let (chunks, done) = sse_chunks(&a);
                assert!(done, "client {i}: {}", a.body);
                let used = chunks.last().unwrap()["usage"]["completion_tokens"].as_u64().unwrap();
                Some((streamed_finish(&chunks).unwrap(), used))
            })
        })
        .collect();
    let results: Vec<_> = clients.into_iter().filter_map(|c| c.join().unwrap()).collect();
    assert_eq!(results.len(), 16);
    assert!(results.iter().all(|(finish, used)| finish == "length" && *used == max_tokens as u64), "{results:?}");
    let m = wait_for_metrics(addr, TINY, "all requests to end", |m| m.value("reckon_request_aborted_total") == 8.0 && m.idle());
    assert_eq!(m.value("reckon_request_success_total"), 16.0, "{}", m.text);
}

/// A stop string ends the request with finish_reason "stop" and the text before it (never part of it),
/// streamed and not; the engine counts it as a success, not an abort, and its blocks are free at once.
/// The tiny model's text is known only after a first request: a substring of it is the stop string.
#[test]
fn a_stop_string_ends_the_request_as_a_success() {
    let addr = tiny_server(config(2048, 16, 64));
    let prompt = "Write a haiku about caches.";
    let full = post(addr, CHAT, &tiny_chat(prompt, 32, json!({}))).json();
    let text = full["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let chars: Vec<char> = text.chars().collect();
    assert!(chars.len() >= 8, "{text:?}");
    // two characters from the middle; the answer is what comes before their first occurrence
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let cut = &text[..text.find(&stop).unwrap()];

    let s = post(addr, CHAT, &tiny_chat(prompt, 32, json!({"stop": [stop.clone(), "never in the text \u{0}"]})));
    assert_eq!(s.status, 200, "{}", s.body);
    let s = s.json();
    assert_eq!(s["choices"][0]["message"]["content"].as_str(), Some(cut), "stop {stop:?} in {text:?}");
    assert_eq!(s["choices"][0]["finish_reason"], "stop");
    let used = s["usage"]["completion_tokens"].as_u64().unwrap();
    assert!(used < 32, "{s}");
    // the engine publishes its figures after the step that sent the reply: wait for them, blocks included
    wait_for_metrics(addr, TINY, "the stopped request's blocks to be free", |m| m.idle());

    let st = post(addr, CHAT, &tiny_chat(prompt, 32, json!({"stop": stop.clone(), "stream": true, "stream_options": {"include_usage": true}})));
    let (chunks, done) = sse_chunks(&st);
    assert!(done, "{}", st.body);
    assert_eq!(streamed_text(&chunks), cut);
    assert_eq!(streamed_finish(&chunks).as_deref(), Some("stop"));
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"].as_u64(), Some(used));

    // the same on text completions
    let c = post(addr, "/v1/completions", &json!({ "model": TINY, "prompt": prompt, "temperature": 0, "max_tokens": 32, "ignore_eos": true })).json();
    let ctext = c["choices"][0]["text"].as_str().unwrap().to_string();
    let cchars: Vec<char> = ctext.chars().collect();
    let cstop: String = cchars[cchars.len() / 2..cchars.len() / 2 + 2].iter().collect();
    let c = post(addr, "/v1/completions", &json!({ "model": TINY, "prompt": prompt, "temperature": 0, "max_tokens": 32, "ignore_eos": true, "stop": cstop })).json();
    assert_eq!(c["choices"][0]["text"].as_str(), Some(&ctext[..ctext.find(&cstop).unwrap()]));
    assert_eq!(c["choices"][0]["finish_reason"], "stop");

    let m = wait_for_metrics(addr, TINY, "an idle engine", Metrics::idle);
    assert_eq!(m.value("reckon_request_success_total"), 5.0, "{}", m.text);
    assert_eq!(m.value("reckon_request_aborted_total"), 0.0, "a stop string is not an abort:\n{}", m.text);
    assert_eq!(m.value("reckon_request_failed_total"), 0.0, "{}", m.text);
}

/// One request running (max_running 1) and one waiting (max_waiting 1): the next is refused with 429,
/// OpenAI's rate-limit error and a `Retry-After` header, on both routes; once the running one ends the
/// waiting one is served.
#[test]
fn a_full_queue_is_429_with_retry_after() {
    let addr = tiny_server(config(TINY_CONTEXT, 1, 1));
    let mut running = OpenStream::start(addr, CHAT, &endless("Hold the engine."));
    running.read_events(2);
    wait_for_metrics(addr, TINY, "one running request", |m| m.value("vllm:num_requests_running") == 1.0);
    let waiting = std::thread::spawn(move || post(addr, CHAT, &tiny_chat("Wait your turn.", 4, json!({}))));
    wait_for_metrics(addr, TINY, "one waiting request", |m| m.value("vllm:num_requests_waiting") == 1.0);

    for (path, body) in [
        (CHAT, tiny_chat("Too many.", 4, json!({}))),
        (CHAT, tiny_chat("Too many.", 4, json!({"stream": true}))),
        ("/v1/completions", json!({ "model": TINY, "prompt": "Too many.", "max_tokens": 4 })),
    ] {
        let a = post(addr, path, &body);
        let e = assert_error(&a, 429, "rate_limit_error", None, "already waiting");
        assert_eq!(e["error"]["code"], "queue_full");
        assert_eq!(a.header("retry-after"), Some("1"), "{}", a.head);
    }

    running.hang_up();
    let w = waiting.join().unwrap();
    assert_eq!(w.status, 200, "{}", w.body);
    assert_eq!(w.json()["choices"][0]["finish_reason"], "length");
    let m = wait_for_metrics(addr, TINY, "an idle engine", Metrics::idle);
    assert_eq!((m.value("reckon_request_success_total"), m.value("reckon_request_aborted_total")), (1.0, 1.0), "{}", m.text);
}

/// A failure midway through a stream: the text so far, then one OpenAI-shaped error event, and the
/// stream ends (no `[DONE]`, no hang). Also when the engine drops a request without a last event.
#[test]
fn a_failure_midway_ends_the_stream_with_an_error_event() {
    let state = tiny_state(config(256, 4, 4));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let sse = |events: Vec<Event>, close_early: bool| {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for e in events {
            tx.send(e).unwrap();
        }
        let keep = (!close_early).then_some(tx);
        let body = rt.block_on(async {
            let response = stream_events(&state, Api::Chat, 7, rx, true);
            let bytes = tokio::time::timeout(std::time::Duration::from_secs(60), axum::body::to_bytes(response.into_body(), usize::MAX));
            bytes.await.expect("the stream ends").unwrap()
        });
        drop(keep);
        sse_data(std::str::from_utf8(&body).unwrap())
    };
    let token = |text: &str| Event::Token { id: 1, text: text.into(), logprobs: None };

    let events = sse(vec![token("Hel"), token("lo"), Event::Error("model step failed: injected".into()), token("never sent")], false);
    assert_eq!(events.len(), 4, "{events:?}"); // role chunk, two text chunks, the error
    let last: Value = serde_json::from_str(&events[3]).unwrap();
    assert_eq!(last["error"]["message"], "model step failed: injected");
    assert_eq!(last["error"]["type"], "server_error", "{last}");
    let text: String = events[..3].iter().filter_map(|e| serde_json::from_str::<Value>(e).ok()?["choices"][0]["delta"]["content"].as_str().map(str::to_string)).collect();
    assert_eq!(text, "Hello");

    let events = sse(vec![token("Hi")], true);
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert!(last["error"]["message"].as_str().unwrap().contains("engine stopped"), "{events:?}");
    assert!(!events.iter().any(|e| e == "[DONE]"));

    // and a request that does finish still ends with usage and [DONE]
    let usage = reckon_engine::engine::Usage { prompt_tokens: 3, completion_tokens: 1, ..Default::default() };
    let events = sse(vec![token("Hi"), Event::Finished { reason: FinishReason::Length, usage, timings: Default::default(), stop: None }], false);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
}

/// Large requests are parsed, rendered and tokenized off the async workers: while three 24 MB prompts
/// are being tokenized (seconds each), another connection is answered at once. On the two async
/// workers, the three held both, and the small request waited for a large one to finish.
#[test]
fn large_requests_do_not_stall_other_connections() {
    use std::time::Instant;
    let addr = tiny_server(config(2048, 16, 64));
    let text = "caches hold what was computed before; ".repeat(24 << 20 >> 6);
    let big = json!({"model": TINY, "messages": [{"role": "user", "content": text}], "max_tokens": 1}).to_string();
    let start = Instant::now();
    let large: Vec<_> = (0..3)
        .map(|_| {
            let big = big.clone();
            std::thread::spawn(move || {
                let a = request(addr, "POST", CHAT, &[], &big);
                (a.status, start.elapsed())
            })
        })
        .collect();
    // the bodies arrive and their tokenizing starts
    std::thread::sleep(std::time::Duration::from_millis(300));
    let small = post(addr, CHAT, &tiny_chat("hi", 2, json!({})));
    let small_done = start.elapsed();
    assert_eq!(small.status, 200, "{}", small.body);
    let large: Vec<_> = large.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(large.iter().all(|(status, _)| *status == 400), "the large prompts exceed the context: {large:?}");
    let first_large = large.iter().map(|l| l.1).min().unwrap();
    assert!(small_done < first_large, "the small request ({small_done:?}) waited for a large one ({first_large:?})");
}

//! The HTTP API over raw HTTP on a loopback port, with the real default model (SmolLM2): chat and text
//! completions streamed and not (same greedy text both ways), stop strings, usage, metrics, and the
//! OpenAI-shaped errors.
//! Skipped when the model is not fetched, unless RECKON_REQUIRE_MODELS=1.

use reckon_engine::engine::{spawn, EngineConfig};
use reckon_engine::gguf::GgufFile;
use reckon_engine::model::Model;
use reckon_engine::registry::known_model_path;
use reckon_engine::template::ChatTemplate;
use reckon_engine::tokenizer::Tokenizer;
use reckon_engine::engine::{Event, FinishReason};
use reckon_server::{router, stream_events, Api, AppState};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;

/// Starts a server on a free loopback port; None if the model is not fetched.
fn start(api_key: Option<&str>, max_model_len: usize) -> Option<SocketAddr> {
    start_with(api_key, EngineConfig { block_size: 16, num_blocks: 256, max_batch_tokens: 256, max_running: 16, max_waiting: 64, max_model_len, prefix_caching: true, max_prefill_tokens_while_decoding: usize::MAX })
}

fn start_with(api_key: Option<&str>, config: EngineConfig) -> Option<SocketAddr> {
    let state = app_state(api_key, config)?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(listener, router(state)).await.unwrap();
        });
    });
    Some(rx.recv().unwrap())
}

/// The real model behind an engine; None if it is not fetched.
fn app_state(api_key: Option<&str>, config: EngineConfig) -> Option<AppState> {
    let path = known_model_path("smollm2-135m").expect("known model");
    if !path.exists() {
        assert!(std::env::var("RECKON_REQUIRE_MODELS").is_err(), "{} is missing and RECKON_REQUIRE_MODELS is set", path.display());
        eprintln!("note: {} not found; skipping (scripts/fetch-models smollm2-135m)", path.display());
        return None;
    }
    let file = GgufFile::open(&path).unwrap();
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let text = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or("").to_string();
    let template = Arc::new(ChatTemplate::from_gguf(&file, &text(tokenizer.bos_id()), &text(tokenizer.eos_id())).unwrap());
    let model = Arc::new(Model::load(file).unwrap());
    let engine = spawn(model, tokenizer.clone(), config);
    Some(AppState { engine, tokenizer, template, model_id: "smollm2-135m".into(), api_key: api_key.map(str::to_string), metrics: Default::default() })
}

/// One HTTP/1.1 request; returns (status, body).
fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let body = if head.to_ascii_lowercase().contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.to_string() };
    (status, body)
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n").unwrap();
        let n = usize::from_str_radix(size.trim(), 16).unwrap();
        if n == 0 {
            return out;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
}

fn chat(addr: SocketAddr, body: Value) -> (u16, Value) {
    let (status, text) = request(addr, "POST", "/v1/chat/completions", &[], &body.to_string());
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

fn ask(extra: Value) -> Value {
    let mut body = json!({ "model": "smollm2-135m", "messages": [{"role": "user", "content": "Write a haiku about caches."}], "temperature": 0, "max_tokens": 24 });
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

#[test]
fn chat_completions_streamed_and_not() {
    let Some(addr) = start(None, 2048) else { return };
    assert_eq!(request(addr, "GET", "/health", &[], ""), (200, "ok".to_string()));
    let (status, models) = request(addr, "GET", "/v1/models", &[], "");
    assert_eq!(status, 200);
    assert!(models.contains("\"id\":\"smollm2-135m\""), "{models}");

    let (status, a) = chat(addr, ask(json!({})));
    assert_eq!(status, 200, "{a}");
    let text = a["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(!text.is_empty());
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    assert_eq!(a["usage"]["completion_tokens"], 24);
    assert_eq!(a["usage"]["total_tokens"], a["usage"]["prompt_tokens"].as_u64().unwrap() + 24);
    assert_eq!(chat(addr, ask(json!({}))).1["choices"][0]["message"]["content"], text.as_str(), "greedy is deterministic");

    // streamed: the same text, chunk by chunk, then the finish chunk, usage and [DONE]
    let (status, sse) = request(addr, "POST", "/v1/chat/completions", &[], &ask(json!({"stream": true, "stream_options": {"include_usage": true}})).to_string());
    assert_eq!(status, 200);
    let events: Vec<&str> = sse.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
    assert_eq!(events.last(), Some(&"[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(streamed, text);
    assert!(chunks.iter().any(|c| c["choices"][0]["finish_reason"] == "length"));
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 24);

    // a stop string cuts the text before it, never leaking part of it
    let word = text.split_whitespace().nth(2).unwrap().to_string();
    let (_, s) = chat(addr, ask(json!({"stop": [word.clone()]})));
    let cut = s["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(cut, &text[..text.find(&word).unwrap()]);
    assert_eq!(s["choices"][0]["finish_reason"], "stop");

    // log-probabilities: greedy picks the top alternative; the tokens spell the text
    let (status, l) = chat(addr, ask(json!({"logprobs": true, "top_logprobs": 3, "max_tokens": 6})));
    assert_eq!(status, 200, "{l}");
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
    assert_eq!(chat(addr, ask(json!({"logprobs": true, "top_logprobs": 21}))).0, 400);

    // text completions: the raw prompt, streamed and not, the same greedy text
    let body = json!({ "model": "smollm2-135m", "prompt": "The capital of France is", "temperature": 0, "max_tokens": 8 });
    let (status, c) = request(addr, "POST", "/v1/completions", &[], &body.to_string());
    assert_eq!(status, 200, "{c}");
    let c: Value = serde_json::from_str(&c).unwrap();
    assert_eq!((c["object"].as_str(), c["usage"]["completion_tokens"].as_u64()), (Some("text_completion"), Some(8)));
    let full = c["choices"][0]["text"].as_str().unwrap().to_string();
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, sse) = request(addr, "POST", "/v1/completions", &[], &streamed.to_string());
    let pieces: String = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"].as_str().unwrap_or("").to_string())
        .collect();
    assert_eq!(pieces, full);

    // text completions' (legacy) log-probabilities: parallel lists, offsets into the text
    let mut with_lp = body.clone();
    with_lp["logprobs"] = json!(2);
    let (_, c) = request(addr, "POST", "/v1/completions", &[], &with_lp.to_string());
    let c: Value = serde_json::from_str(&c).unwrap();
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
    with_lp["logprobs"] = json!(6);
    assert_eq!(request(addr, "POST", "/v1/completions", &[], &with_lp.to_string()).0, 400);

    // metrics: the gateway's names, our histograms, and every block free once all requests are done
    let mut metrics = String::new();
    for _ in 0..100 {
        metrics = request(addr, "GET", "/metrics", &[], "").1;
        if metrics.contains("vllm:kv_cache_usage_perc{model_name=\"smollm2-135m\"} 0\n") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    for line in [
        "vllm:num_requests_waiting{model_name=\"smollm2-135m\"} 0",
        "vllm:num_requests_running{model_name=\"smollm2-135m\"} 0",
        "vllm:kv_cache_usage_perc{model_name=\"smollm2-135m\"} 0",
        "vllm:cache_config_info{model_name=\"smollm2-135m\",block_size=\"16\",num_gpu_blocks=\"256\"} 1",
        "reckon_time_to_first_token_seconds_count 8",
        "reckon_request_success_total{model_name=\"smollm2-135m\"} 7",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }
}

#[test]
fn errors_have_openai_shape() {
    let Some(addr) = start(Some("sekrit"), 64) else { return };
    let auth = [("Authorization", "Bearer sekrit")];
    let post = |body: &str, headers: &[(&str, &str)]| {
        let (status, text) = request(addr, "POST", "/v1/chat/completions", headers, body);
        (status, serde_json::from_str::<Value>(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
    };
    let (status, e) = post(&ask(json!({})).to_string(), &[]);
    assert_eq!((status, e["error"]["type"].as_str()), (401, Some("authentication_error")));
    let (status, e) = post("{not json", &auth);
    assert_eq!((status, e["error"]["type"].as_str()), (400, Some("invalid_request_error")));
    let (status, e) = post(&ask(json!({"model": "gpt-4"})).to_string(), &auth);
    assert_eq!((status, e["error"]["code"].as_str(), e["error"]["param"].as_str()), (404, Some("model_not_found"), Some("model")));
    let (status, e) = post(&ask(json!({"n": 2})).to_string(), &auth);
    assert_eq!((status, e["error"]["param"].as_str()), (400, Some("n")));
    let (status, e) = post(&ask(json!({"temperature": 3})).to_string(), &auth);
    assert_eq!((status, e["error"]["param"].as_str()), (400, Some("temperature")));
    let long = "cache ".repeat(100);
    let (status, e) = post(&ask(json!({"messages": [{"role": "user", "content": long}]})).to_string(), &auth);
    assert_eq!(status, 400);
    assert!(e["error"]["message"].as_str().unwrap().contains("maximum context length is 64 tokens"), "{e}");
    let (status, _) = post(&ask(json!({"max_tokens": 4})).to_string(), &auth);
    assert_eq!(status, 200);
}

/// Load: 32 concurrent streaming clients, a third of which hang up after a few chunks. Every other one
/// gets its whole answer (the token count its finish reason implies), and afterwards nothing is running
/// and every KV block is free.
#[test]
fn concurrent_streams_with_disconnects() {
    let Some(addr) = start(None, 2048) else { return };
    let max_tokens = 24;
    let clients: Vec<_> = (0..32)
        .map(|i| {
            std::thread::spawn(move || {
                let prompt = format!("Tell me fact number {i} about caches.");
                let body = json!({ "model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                                   "max_tokens": max_tokens, "stream": true, "stream_options": {"include_usage": true} });
                if i % 3 == 0 {
                    hang_up_after_chunks(addr, &body.to_string(), 3);
                    return None;
                }
                let (status, sse) = request(addr, "POST", "/v1/chat/completions", &[], &body.to_string());
                assert_eq!(status, 200);
                let data: Vec<&str> = sse.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
                assert_eq!(data.last(), Some(&"[DONE]"), "client {i}: {sse}");
                let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
                let finish = chunks.iter().find_map(|c| c["choices"][0]["finish_reason"].as_str().map(str::to_string)).unwrap();
                let used = chunks.last().unwrap()["usage"]["completion_tokens"].as_u64().unwrap();
                Some((finish, used))
            })
        })
        .collect();
    let results: Vec<_> = clients.into_iter().filter_map(|c| c.join().unwrap()).collect();
    assert_eq!(results.len(), 21);
    for (finish, used) in &results {
        match finish.as_str() {
            "length" => assert_eq!(*used, max_tokens),
            "stop" => assert!(*used >= 1 && *used <= max_tokens),
            other => panic!("finish reason {other}"),
        }
    }
    let idle = "vllm:kv_cache_usage_perc{model_name=\"smollm2-135m\"} 0\n";
    let mut metrics = String::new();
    for _ in 0..250 {
        metrics = request(addr, "GET", "/metrics", &[], "").1;
        if metrics.contains(idle) && metrics.contains("vllm:num_requests_running{model_name=\"smollm2-135m\"} 0\n") {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(metrics.contains(idle), "blocks still in use after the load:\n{metrics}");
    assert!(metrics.contains("vllm:num_requests_waiting{model_name=\"smollm2-135m\"} 0\n"), "{metrics}");
    // The hung-up clients are aborted unless they happened to finish first; every request is one or the other.
    let counter = |name: &str| -> u64 {
        let prefix = format!("{name}{{model_name=\"smollm2-135m\"}} ");
        metrics.lines().find_map(|l| l.strip_prefix(prefix.as_str())).unwrap().parse().unwrap()
    };
    let (ok, aborted) = (counter("reckon_request_success_total"), counter("reckon_request_aborted_total"));
    assert_eq!(ok + aborted, 32, "{metrics}");
    assert!(aborted >= 1, "no hung-up client was noticed:\n{metrics}");
}

/// Sends a streaming request, reads until `n` SSE data lines arrived, then closes the connection.
fn hang_up_after_chunks(addr: SocketAddr, body: &str, n: usize) {
    let mut s = TcpStream::connect(addr).unwrap();
    let req = format!("POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len());
    s.write_all(req.as_bytes()).unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    while String::from_utf8_lossy(&seen).matches("data: ").count() < n {
        let k = s.read(&mut buf).unwrap();
        assert!(k > 0, "the stream ended early");
        seen.extend_from_slice(&buf[..k]);
    }
    drop(s);
}

/// A full waiting queue answers 429 with OpenAI's rate-limit error, and the queued requests still finish.
#[test]
fn a_full_queue_is_429() {
    let config = EngineConfig { block_size: 16, num_blocks: 256, max_batch_tokens: 256, max_running: 1, max_waiting: 1, max_model_len: 2048, prefix_caching: true, max_prefill_tokens_while_decoding: usize::MAX };
    let Some(addr) = start_with(None, config) else { return };
    let body = ask(json!({"max_tokens": 40})).to_string();
    let clients: Vec<_> = (0..6)
        .map(|_| {
            let body = body.clone();
            std::thread::spawn(move || request(addr, "POST", "/v1/chat/completions", &[], &body))
        })
        .collect();
    let answers: Vec<(u16, String)> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    let refused: Vec<&String> = answers.iter().filter(|(s, _)| *s == 429).map(|(_, b)| b).collect();
    assert!(!refused.is_empty(), "no request was refused: {answers:?}");
    let e: Value = serde_json::from_str(refused[0]).unwrap();
    assert_eq!((e["error"]["type"].as_str(), e["error"]["code"].as_str()), (Some("rate_limit_error"), Some("queue_full")));
    assert!(answers.iter().all(|(s, _)| *s == 200 || *s == 429), "{answers:?}");
    assert!(answers.iter().any(|(s, _)| *s == 200));
}

/// A failure midway through a stream: the text so far, then one OpenAI-shaped error event, and the
/// stream ends (no `[DONE]`, no hang). Also when the engine drops a request without a last event.
#[test]
fn a_failure_midway_ends_the_stream_with_an_error_event() {
    let config = EngineConfig { block_size: 16, num_blocks: 16, max_batch_tokens: 64, max_running: 4, max_waiting: 4, max_model_len: 256, prefix_caching: true, max_prefill_tokens_while_decoding: usize::MAX };
    let Some(state) = app_state(None, config) else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let sse = |events: Vec<Event>, close_early: bool| {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for e in events {
            tx.send(e).unwrap();
        }
        let keep = (!close_early).then_some(tx);
        let body = rt.block_on(async {
            let response = stream_events(&state, Api::Chat, 7, rx, Vec::new(), true);
            let bytes = tokio::time::timeout(std::time::Duration::from_secs(10), axum::body::to_bytes(response.into_body(), usize::MAX));
            bytes.await.expect("the stream ends").unwrap()
        });
        drop(keep);
        let body = String::from_utf8(body.to_vec()).unwrap();
        body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect::<Vec<_>>()
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

    // and a request that does finish still ends with usage and [DONE]
    let usage = reckon_engine::engine::Usage { prompt_tokens: 3, completion_tokens: 1, cached_tokens: 0 };
    let events = sse(vec![token("Hi"), Event::Finished { reason: FinishReason::Length, usage, timings: Default::default() }], false);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
}

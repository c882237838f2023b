//! What the HTTP tests share: a server on a loopback port over the tiny random model (with a real
//! byte-level BPE tokenizer and a ChatML template, written by `common::tiny_chat_model`) or over SmolLM2,
//! raw HTTP/1.1 requests with read/write timeouts (a hang fails the test instead of blocking CI),
//! server-sent events, and `/metrics` polling.
#![allow(dead_code)]

use crate::common::{tiny_chat_model, TinySpec};
use reckon_engine::engine::{spawn, EngineConfig};
use reckon_engine::gguf::GgufFile;
use reckon_engine::kernels::ggml::GgmlType;
use reckon_engine::model::Model;
use reckon_engine::template::ChatTemplate;
use reckon_engine::tokenizer::Tokenizer;
use reckon_server::{router, AppState, DEFAULT_MAX_BODY_BYTES};
use serde_json::{json, Value};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The tiny model's name on the wire.
pub const TINY: &str = "tiny";
/// The tiny model's context: long enough that a request with a large `max_tokens` runs for seconds
/// (hung-up clients are noticed long before it could finish).
pub const TINY_CONTEXT: usize = 32_768;
/// How long any one socket read or write may block.
pub const IO_TIMEOUT: Duration = Duration::from_secs(60);

/// The tiny model's GGUF image (a llama with a 263-token vocabulary).
pub fn tiny_gguf() -> Vec<u8> {
    tiny_chat_model(&TinySpec::llama(GgmlType::Q8_0), 7, TINY_CONTEXT as u32)
}

/// An engine configuration: 16-token blocks, enough of them for one whole context and then some.
pub fn config(max_model_len: usize, max_running: usize, max_waiting: usize) -> EngineConfig {
    EngineConfig {
        block_size: 16,
        num_blocks: TINY_CONTEXT / 16 + 512,
        max_batch_tokens: 256,
        max_prefill_tokens_while_decoding: usize::MAX,
        max_running,
        max_waiting,
        max_model_len,
        prefix_caching: true,
        rest_pool_between_steps: true,
        kv_dtypes: Default::default(),
        kv_window: None,
        sparse_attention: None,
        hybrid_kv: false,
        spec: None,
        spec_prefill: None,
        slow_state: Default::default(),
        state_snapshot_every: 1,
    }
}

/// An engine over `file`. The forward pass runs on the engine thread alone (a one-thread pool; results do
/// not depend on the thread count): on a loaded 2-core CI host a pool worker that is not scheduled makes
/// the engine thread spin-wait for it step after step (the tiny model's tokens took ~90 ms, not ~0.5 ms).
fn state_of(file: GgufFile, model_id: &str, config: EngineConfig) -> AppState {
    state_with_detokenizer(file, model_id, config, |t| t)
}

/// `state_of`, with the engine's detokenizer made by `detok` from the tokenizer (a test's fault hook).
pub fn state_with_detokenizer(file: GgufFile, model_id: &str, config: EngineConfig, detok: impl FnOnce(Arc<Tokenizer>) -> Arc<dyn reckon_engine::engine::Detokenizer>) -> AppState {
    reckon_engine::pool::init_global(1);
    let tokenizer = Arc::new(Tokenizer::from_gguf(&file).unwrap());
    let text = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or("").to_string();
    let template = Arc::new(ChatTemplate::from_gguf(&file, &text(tokenizer.bos_id()), &text(tokenizer.eos_id())).unwrap());
    let model = Arc::new(Model::load(file).unwrap());
    assert_eq!(model.config.vocab_size, tokenizer.vocab_size(), "the model's vocabulary is the tokenizer's");
    let engine = spawn(model, detok(tokenizer.clone()), config);
    AppState { engine, tokenizer, template, model_id: model_id.into(), aliases: Vec::new(), responses: Default::default(), grammar: Default::default(), api_keys: Vec::new(), limits: Default::default(), log_prompts: false, metrics: Default::default(), max_body_bytes: DEFAULT_MAX_BODY_BYTES, sampling: Default::default(), model_card: Default::default(), kv_events: None }
}

/// The tiny model behind an engine with `config`.
pub fn tiny_state(config: EngineConfig) -> AppState {
    state_of(GgufFile::from_vec(tiny_gguf()).unwrap(), TINY, config)
}

/// SmolLM2 behind an engine; None (with a note) if it is not fetched, unless RECKON_REQUIRE_MODELS is set.
pub fn real_state(config: EngineConfig) -> Option<AppState> {
    Some(state_of(crate::common::open_real_model("smollm2-135m")?, "smollm2-135m", config))
}

/// A synthetic test model (scripts/make-test-models: `lfm2-tiny`, `qwen3-tiny`, ...) behind an engine;
/// None (with a note) if it was not generated, unless RECKON_REQUIRE_MODELS is set.
pub fn test_model_state(name: &str, config: EngineConfig) -> Option<AppState> {
    Some(state_of(crate::common::open_test_model(name)?, name, config))
}

/// Serves `state` on a free loopback port (on its own runtime thread, for the rest of the test process).
pub fn serve(state: AppState) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            axum::serve(listener, router(state)).await.unwrap();
        });
    });
    rx.recv_timeout(IO_TIMEOUT).expect("the server started")
}

/// A server over the tiny model with `config`.
pub fn tiny_server(config: EngineConfig) -> SocketAddr {
    serve(tiny_state(config))
}

/// One HTTP answer: the status, the header block (lower-cased) and the body (de-chunked).
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub head: String,
    pub body: String,
}

impl Answer {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        let prefix = format!("{}:", name.to_ascii_lowercase());
        self.head.lines().find_map(|l| l.strip_prefix(prefix.as_str())).map(str::trim)
    }

    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {} {}", self.status, self.body))
    }

    /// The `data:` payloads of a server-sent events body.
    pub fn events(&self) -> Vec<String> {
        sse_data(&self.body)
    }
}

pub fn sse_data(body: &str) -> Vec<String> {
    body.lines().filter_map(|l| l.strip_prefix("data: ")).map(str::to_string).collect()
}

/// A connected socket whose reads and writes time out.
pub fn connect(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect_timeout(&addr, IO_TIMEOUT).unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    s.set_read_timeout(Some(IO_TIMEOUT)).unwrap();
    s.set_write_timeout(Some(IO_TIMEOUT)).unwrap();
    s
}

/// The bytes of one HTTP/1.1 request (`Connection: close`, so the answer ends at EOF).
pub fn request_bytes(method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> String {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    req
}

/// Reads an answer to EOF and splits it.
pub fn read_answer(mut s: TcpStream) -> Answer {
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap_or_else(|e| panic!("reading the answer: {e} (so far: {})", String::from_utf8_lossy(&raw)));
    parse_answer(&String::from_utf8(raw).unwrap())
}

pub fn parse_answer(raw: &str) -> Answer {
    let (head, rest) = raw.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no header block in {raw:?}"));
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    let head = head.to_ascii_lowercase();
    let body = if head.contains("transfer-encoding: chunked") { dechunk(rest) } else { rest.to_string() };
    Answer { status, head, body }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n").unwrap_or_else(|| panic!("truncated chunked body: {s:?}"));
        let n = usize::from_str_radix(size.trim(), 16).unwrap();
        if n == 0 {
            return out;
        }
        out.push_str(&rest[..n]);
        s = &rest[n + 2..];
    }
}

/// One request, answered in full.
pub fn request(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> Answer {
    let mut s = connect(addr);
    s.write_all(request_bytes(method, path, headers, body).as_bytes()).unwrap();
    read_answer(s)
}

pub fn get(addr: SocketAddr, path: &str) -> Answer {
    request(addr, "GET", path, &[], "")
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Answer {
    request(addr, "POST", path, &[], &body.to_string())
}

/// A chat request for `model`: one user message, greedy, `extra` merged in.
pub fn chat_body(model: &str, content: &str, extra: Value) -> Value {
    let mut body = json!({ "model": model, "messages": [{"role": "user", "content": content}], "temperature": 0 });
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// A greedy chat request to the tiny model that runs to its length limit (end-of-generation ignored).
pub fn tiny_chat(content: &str, max_tokens: usize, extra: Value) -> Value {
    let mut body = chat_body(TINY, content, json!({ "max_tokens": max_tokens, "ignore_eos": true }));
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// A streamed answer: the chunks (JSON) before `[DONE]`, and whether `[DONE]` came.
pub fn sse_chunks(answer: &Answer) -> (Vec<Value>, bool) {
    let mut events = answer.events();
    let done = events.last().map(String::as_str) == Some("[DONE]");
    if done {
        events.pop();
    }
    (events.iter().map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}"))).collect(), done)
}

/// A chat stream's text: its deltas' contents joined.
pub fn streamed_text(chunks: &[Value]) -> String {
    chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str().or(c["choices"][0]["text"].as_str())).collect()
}

/// The finish reason a stream's chunks carry.
pub fn streamed_finish(chunks: &[Value]) -> Option<String> {
    chunks.iter().find_map(|c| c["choices"][0]["finish_reason"].as_str().map(str::to_string))
}

/// A streaming request whose answer is read piece by piece; dropping it hangs up.
pub struct OpenStream {
    socket: TcpStream,
    seen: Vec<u8>,
}

impl OpenStream {
    pub fn start(addr: SocketAddr, path: &str, body: &Value) -> OpenStream {
        let mut socket = connect(addr);
        socket.write_all(request_bytes("POST", path, &[], &body.to_string()).as_bytes()).unwrap();
        OpenStream { socket, seen: Vec::new() }
    }

    /// Reads until at least `n` server-sent `data:` events have arrived in all; returns the raw bytes so far.
    pub fn read_events(&mut self, n: usize) -> String {
        let mut buf = [0u8; 4096];
        while String::from_utf8_lossy(&self.seen).matches("data: ").count() < n {
            let k = self.socket.read(&mut buf).unwrap_or_else(|e| panic!("reading the stream: {e}"));
            assert!(k > 0, "the stream ended after {:?}", String::from_utf8_lossy(&self.seen));
            self.seen.extend_from_slice(&buf[..k]);
        }
        String::from_utf8_lossy(&self.seen).into_owned()
    }

    /// Reads the rest of the answer (to EOF).
    pub fn finish(mut self) -> Answer {
        self.socket.read_to_end(&mut self.seen).unwrap_or_else(|e| panic!("reading the stream: {e} (so far: {})", String::from_utf8_lossy(&self.seen)));
        parse_answer(&String::from_utf8(self.seen).unwrap())
    }

    /// Closes the connection mid-answer.
    pub fn hang_up(self) {
        let _ = self.socket.shutdown(std::net::Shutdown::Both);
    }
}

/// The `/metrics` text.
pub fn metrics(addr: SocketAddr) -> String {
    let a = get(addr, "/metrics");
    assert_eq!(a.status, 200);
    a.body
}

/// A sample of `/metrics`, read by name (the model label is matched, other labels not).
pub struct Metrics {
    pub text: String,
    model: String,
}

impl Metrics {
    pub fn read(addr: SocketAddr, model: &str) -> Metrics {
        Metrics { text: metrics(addr), model: model.into() }
    }

    pub fn value(&self, name: &str) -> f64 {
        let prefix = format!("{name}{{model_name=\"{}\"}} ", self.model);
        let line = self.text.lines().find_map(|l| l.strip_prefix(prefix.as_str()));
        line.unwrap_or_else(|| panic!("no {name} in\n{}", self.text)).parse().unwrap()
    }

    /// Nothing waiting or running, and every KV block free.
    pub fn idle(&self) -> bool {
        self.value("vllm:num_requests_waiting") == 0.0 && self.value("vllm:num_requests_running") == 0.0 && self.value("vllm:kv_cache_usage_perc") == 0.0
    }
}

/// Polls `/metrics` until `ok` holds (at most a minute); returns that sample, or fails saying `what`.
pub fn wait_for_metrics(addr: SocketAddr, model: &str, what: &str, ok: impl Fn(&Metrics) -> bool) -> Metrics {
    let start = Instant::now();
    loop {
        let m = Metrics::read(addr, model);
        if ok(&m) {
            return m;
        }
        assert!(start.elapsed() < IO_TIMEOUT, "waited a minute for {what}:\n{}", m.text);
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Asserts the OpenAI error shape: `{"error": {"message", "type", "param", "code"}}` with these values.
pub fn assert_error(a: &Answer, status: u16, kind: &str, param: Option<&str>, message_has: &str) -> Value {
    assert_eq!(a.status, status, "{}", a.body);
    assert!(a.header("content-type").is_some_and(|t| t.starts_with("application/json")), "not JSON: {}", a.head);
    let v = a.json();
    let e = &v["error"];
    assert_eq!(e["type"].as_str(), Some(kind), "{v}");
    assert_eq!(e["param"].as_str(), param, "{v}");
    assert!(e.get("code").is_some(), "no code field: {v}");
    let message = e["message"].as_str().unwrap_or_else(|| panic!("no message: {v}"));
    assert!(message.contains(message_has), "message {message:?} does not mention {message_has:?}");
    v
}

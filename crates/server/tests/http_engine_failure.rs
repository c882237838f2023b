//! A failed engine says so (issue: "a dead engine that says so"). The fault is injected by the test
//! alone: the engine's detokenizer is the test's, and panics when told to, on the engine thread in the
//! middle of a step; nothing in the server or the engine carries a hook. Then every request in flight
//! ends with an error in its API's shape (a stream's error event, a 500 body), `/health`
//! answers 503 within a second, new requests get 503, and `reckon_server::serve` returns the failure (the
//! binary exits non-zero on it) within its grace period.

#[path = "../../engine/tests/common/mod.rs"]
mod common;
mod support;

use reckon_engine::engine::Detokenizer;
use reckon_engine::gguf::GgufFile;
use reckon_engine::tokenizer::Tokenizer;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::*;

/// The tokenizer, until `armed`: then the next token's text panics.
struct FaultyDetokenizer {
    inner: Arc<Tokenizer>,
    armed: Arc<AtomicBool>,
}

impl Detokenizer for FaultyDetokenizer {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        assert!(!self.armed.load(Ordering::Relaxed), "injected fault: the detokenizer panics");
        Detokenizer::token_bytes(&*self.inner, id)
    }

    fn is_end_of_generation(&self, id: u32) -> bool {
        self.inner.is_end_of_generation(id)
    }
}

#[test]
fn a_failed_engine_fails_what_is_in_flight_turns_health_to_503_and_ends_the_server() {
    let armed = Arc::new(AtomicBool::new(false));
    let fault = armed.clone();
    let state = state_with_detokenizer(GgufFile::from_vec(tiny_gguf()).unwrap(), TINY, config(TINY_CONTEXT, 16, 64), move |t| Arc::new(FaultyDetokenizer { inner: t, armed: fault }));
    let engine = state.engine.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let (addr_tx, addr_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let ended = rt.block_on(async move {
            // as `reckon serve` does: the front thread answers /health probes, also while the workers stop
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            addr_tx.send(listener.local_addr().unwrap()).unwrap();
            let (engine, router) = (state.engine.clone(), reckon_server::router(state));
            let incoming = reckon_server::front::spawn(listener, router.clone()).unwrap();
            reckon_server::serve(incoming, router, engine, std::future::pending()).await
        });
        tx.send(ended).unwrap();
    });
    let addr = addr_rx.recv_timeout(IO_TIMEOUT).unwrap();
    assert_eq!(get(addr, "/health").status, 200);

    // two requests that only the fault can end: a chat stream and a completion answered whole
    let mut stream = OpenStream::start(addr, "/v1/chat/completions", &tiny_chat("Tell me everything.", 1_000_000, json!({"stream": true})));
    stream.read_events(3);
    let messages = std::thread::spawn(move || {
        let body = json!({"model": TINY, "max_tokens": 1_000_000, "prompt": "And everything else.", "ignore_eos": true});
        post(addr, "/v1/completions", &body)
    });
    // (the second request is running once two are)
    let deadline = Instant::now() + IO_TIMEOUT;
    while Metrics::read(addr, TINY).value("vllm:num_requests_running") < 2.0 {
        if messages.is_finished() || Instant::now() > deadline {
            let m = messages.join().unwrap();
            panic!("the second request never ran: {} {}", m.status, m.body);
        }
        std::thread::sleep(Duration::from_millis(20));
    }

    armed.store(true, Ordering::Relaxed);
    let failed_at = Instant::now();
    // /health turns to 503 at once (polled: the failure is a step away)
    loop {
        let h = get(addr, "/health");
        if h.status == 503 {
            assert!(h.body.contains("the engine failed") && h.body.contains("injected fault"), "{}", h.body);
            break;
        }
        assert!(failed_at.elapsed() < Duration::from_secs(1), "/health still answers {} {:?} a second after the fault", h.status, h.body);
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(engine.failure().is_some_and(|w| w.contains("injected fault")));

    // the stream ends with an error event in OpenAI's shape, never a normal finish
    let answer = stream.finish();
    let events = answer.events();
    let last: Value = serde_json::from_str(events.last().expect("events")).unwrap_or_else(|e| panic!("{e}: {events:?}"));
    assert_eq!(last["error"]["type"], "server_error", "{last}");
    assert!(last["error"]["message"].as_str().unwrap().contains("the engine failed"), "{last}");
    assert!(!events.iter().any(|e| e.contains("\"finish_reason\":\"stop\"") || e.contains("\"finish_reason\":\"length\"")), "{events:?}");
    // the completion gets a 500 in OpenAI's shape
    let m = messages.join().unwrap();
    assert_eq!(m.status, 500, "{}", m.body);
    assert_eq!(m.json()["error"]["type"], "server_error", "{}", m.body);
    assert!(m.json()["error"]["message"].as_str().unwrap().contains("the engine failed"), "{}", m.body);

    // a submit now is refused as failed (the server refuses it 503; the HTTP side may already be gone)
    let refused = engine.submit(reckon_engine::engine::GenerateParams::greedy(vec![1, 2, 3], 4)).err().expect("refused");
    assert!(matches!(refused, reckon_engine::engine::RequestError::Failed(_)), "{refused:?}");

    // and the server ends with the failure, for the binary to exit non-zero
    let ended = rx.recv_timeout(reckon_server::FAILED_ENGINE_GRACE + IO_TIMEOUT).expect("serve returned");
    let why = ended.expect("no I/O error").expect("serve returns the failure");
    assert!(why.contains("injected fault"), "{why}");
}

//! `reckon serve` stopping on a signal, end to end on the real binary over the tiny random model (a
//! GGUF written to a temp dir; nothing to fetch, never skipped). While it drains, new requests get 503 in
//! OpenAI's shape; with a drain timeout the running streams end normally (`length`, `[DONE]`); with none
//! they end with an error event (never a normal finish); either way the process exits 0.
//!
//! Nothing depends on how fast the engine is: the stream that keeps the server draining asks for the
//! whole 32k context, so only its client hanging up (or the drain timeout) ends it.

#[path = "../crates/engine/tests/common/mod.rs"]
mod common;
#[path = "../crates/server/tests/support/mod.rs"]
mod support;

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};
use support::{assert_error, post, sse_chunks, streamed_finish, OpenStream, IO_TIMEOUT, TINY_CONTEXT};

const CHAT: &str = "/v1/chat/completions";

/// A running `reckon serve` and its stderr, line by line.
struct Server {
    child: Child,
    addr: SocketAddr,
    model: String,
    stderr: Receiver<String>,
    /// Every stderr line read so far (for failure messages).
    log: Vec<String>,
    dir: PathBuf,
}

impl Server {
    fn start(name: &str, drain_timeout: &str) -> Server {
        let dir = std::env::temp_dir().join(format!("reckon-serve-shutdown-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tiny.gguf");
        std::fs::write(&path, support::tiny_gguf()).unwrap();
        let model = path.to_str().unwrap().to_string();
        let ctx = TINY_CONTEXT.to_string();
        let args = ["serve", "-m", &model, "--port", "0", "-t", "1", "--kv-memory", "40000", "-c", &ctx, "--drain-timeout", drain_timeout];
        let mut child = Command::new(env!("CARGO_BIN_EXE_reckon")).args(args).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let (tx, stderr) = channel();
        let pipe = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut server = Server { child, addr: "127.0.0.1:1".parse().unwrap(), model, stderr, log: Vec::new(), dir };
        let line = server.wait_for_line("reckon serving");
        let addr = line.split("http://").nth(1).and_then(|s| s.split_whitespace().next()).unwrap_or_else(|| panic!("no address in {line:?}"));
        server.addr = addr.parse().unwrap();
        server
    }

    /// Waits (at most a minute) for a stderr line containing `text`.
    fn wait_for_line(&mut self, text: &str) -> String {
        let deadline = Instant::now() + IO_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.stderr.recv_timeout(left) {
                Ok(line) => {
                    self.log.push(line.clone());
                    if line.contains(text) {
                        return line;
                    }
                }
                Err(e) => panic!("no stderr line with {text:?} ({e}); the server said:\n{}", self.log.join("\n")),
            }
        }
    }

    fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid
        assert_eq!(unsafe { libc::kill(self.child.id() as libc::pid_t, signal) }, 0, "kill({signal}): {}", std::io::Error::last_os_error());
    }

    /// Waits (at most a minute) for the process to exit.
    fn wait_exit(&mut self) -> ExitStatus {
        let deadline = Instant::now() + IO_TIMEOUT;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "the server did not exit within a minute");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn chat(&self, max_tokens: usize, extra: Value) -> Value {
        let mut body = json!({ "model": self.model, "messages": [{"role": "user", "content": "Tell me about caches."}],
                               "temperature": 0, "max_tokens": max_tokens, "ignore_eos": true });
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    }

    /// A streamed request only its client (or the drain timeout) can end: it asks for the whole context.
    fn endless(&self) -> OpenStream {
        let mut s = OpenStream::start(self.addr, CHAT, &self.chat(1_000_000, json!({"stream": true})));
        s.read_events(2);
        s
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// SIGTERM with `--drain-timeout 30`: new requests get 503 (OpenAI's shape, `server_error`) while a
/// running stream goes on to its normal end (`length`, usage, `[DONE]`); once the last running request
/// is gone (its client hangs up) the process exits 0 without waiting out the timeout.
#[test]
fn sigterm_lets_running_streams_finish_and_refuses_new_requests() {
    let mut server = Server::start("drain", "30");
    let holder = server.endless();
    let mut finishing = OpenStream::start(server.addr, CHAT, &server.chat(200, json!({"stream": true, "stream_options": {"include_usage": true}})));
    finishing.read_events(2);

    let signalled = Instant::now();
    server.signal(libc::SIGTERM);
    server.wait_for_line("reckon: stopping");
    // The line comes just before the engine starts refusing: a request may still get in (and is served).
    loop {
        let a = post(server.addr, CHAT, &server.chat(1, json!({})));
        if a.status == 503 {
            break;
        }
        assert_eq!(a.status, 200, "{}", a.body);
        assert!(signalled.elapsed() < IO_TIMEOUT, "no 503 a minute after SIGTERM");
    }
    // `holder` keeps the engine draining: whatever the timing, these arrive while it does
    for (path, body) in [
        (CHAT, server.chat(4, json!({}))),
        (CHAT, server.chat(4, json!({"stream": true}))),
        ("/v1/completions", json!({ "model": server.model, "prompt": "Hi", "max_tokens": 4 })),
    ] {
        let a = post(server.addr, path, &body);
        let e = assert_error(&a, 503, "server_error", None, "shutting down");
        assert_eq!(e["error"]["code"], "unavailable", "{e}");
    }

    let done = finishing.finish();
    assert_eq!(done.status, 200);
    let (chunks, finished) = sse_chunks(&done);
    assert!(finished, "the running stream ends with [DONE]: {}", done.body);
    assert_eq!(streamed_finish(&chunks).as_deref(), Some("length"), "{}", done.body);
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 200);
    assert!(server.child.try_wait().unwrap().is_none(), "the server exited while a request was still running");

    holder.hang_up();
    let status = server.wait_exit();
    assert!(status.success(), "exit status {status}; the server said:\n{}", server.log.join("\n"));
    assert!(signalled.elapsed() < Duration::from_secs(25), "the server waited out the drain timeout with nothing running");
}

/// SIGTERM (and SIGINT) with `--drain-timeout 0`: a running stream ends at once with an error event
/// (`data: {"error": ...}`, `server_error`), no finish reason and no `[DONE]`; the process exits 0.
#[test]
fn a_signal_without_drain_time_ends_running_streams_with_an_error_event() {
    for signal in [libc::SIGTERM, libc::SIGINT] {
        let mut server = Server::start(&format!("nodrain-{signal}"), "0");
        let stream = server.endless();
        let (addr, body) = (server.addr, server.chat(1_000_000, json!({})));
        let whole = std::thread::spawn(move || post(addr, CHAT, &body));
        let running = format!("vllm:num_requests_running{{model_name=\"{}\"}} 2", server.model);
        let deadline = Instant::now() + IO_TIMEOUT;
        while !support::metrics(server.addr).lines().any(|l| l == running) {
            assert!(Instant::now() < deadline, "the second request never ran");
            std::thread::sleep(Duration::from_millis(10));
        }
        server.signal(signal);
        // a non-streamed request cut short is a server error, in OpenAI's shape
        let a = whole.join().unwrap();
        assert_error(&a, 500, "server_error", None, "shut down");
        let a = stream.finish();
        assert_eq!(a.status, 200);
        let events = a.events();
        assert!(!events.iter().any(|e| e == "[DONE]"), "signal {signal}: a cut-short stream has no [DONE]: {}", a.body);
        let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
        assert_eq!(last["error"]["type"], "server_error", "signal {signal}: {last}");
        assert!(last["error"]["message"].as_str().unwrap().contains("shut down"), "{last}");
        for e in &events[..events.len() - 1] {
            let chunk: Value = serde_json::from_str(e).unwrap();
            assert!(chunk["choices"][0]["finish_reason"].is_null(), "signal {signal}: a cut-short stream has no finish reason: {chunk}");
        }
        let status = server.wait_exit();
        assert!(status.success(), "signal {signal}: exit status {status}; the server said:\n{}", server.log.join("\n"));
    }
}

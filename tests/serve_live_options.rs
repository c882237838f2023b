//! The option matrix's short live run (the matrix itself is crates/server/tests/option_matrix.rs, in
//! process): `reckon serve` on the synthetic LFM2 file, the real binary, given the requests that used to
//! kill its engine (a partly right prediction, a per-request sparse prefill) and the other options
//! once: each is a 400 naming the option or a 200, and afterwards /health is 200, a plain request gets
//! the same greedy answer as before, and SIGTERM still ends the process with 0. Skipped (with a note)
//! without scripts/make-test-models' files, unless RECKON_REQUIRE_MODELS=1.

#[path = "../crates/engine/tests/common/mod.rs"]
mod common;
#[path = "../crates/server/tests/support/mod.rs"]
mod support;

use serde_json::{json, Value};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::{get, post};

#[test]
fn lfm2_served_takes_every_option_and_stays_up() {
    if common::open_test_model("lfm2-tiny").is_none() {
        return;
    }
    let dir = std::env::var_os("RECKON_TEST_MODELS").map(std::path::PathBuf::from).unwrap_or_else(|| std::path::PathBuf::from(std::env::var_os("HOME").unwrap()).join(".cache/reckon/test-models"));
    let model = dir.join("lfm2-tiny.gguf");
    let mut child = Command::new(env!("CARGO_BIN_EXE_reckon"))
        .args(["serve", "-m", model.to_str().unwrap(), "--port", "0", "-t", "1", "-c", "2048", "--served-model-name", "lfm2"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
    let addr = loop {
        let line = lines.next().expect("the server printed its address").unwrap();
        if let Some(rest) = line.split("http://").nth(1).filter(|_| line.contains("reckon serving")) {
            break rest.split_whitespace().next().unwrap().parse().unwrap();
        }
    };
    std::thread::spawn(move || lines.for_each(drop));
    let completion = |extra: Value| {
        let mut body = json!({"model": "lfm2", "prompt": "The cache keeps the blocks of", "max_tokens": 6, "temperature": 0});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        post(addr, "/v1/completions", &body)
    };
    let plain = completion(json!({})).json()["choices"][0]["text"].as_str().unwrap().to_string();
    let half: String = plain.chars().take(plain.chars().count() / 2).collect();
    for (extra, refused) in [
        (json!({"prediction": {"type": "content", "content": format!("{half} and more")}}), Some("prediction")),
        (json!({"reckon": {"spec_prefill": {"keep": 0.3}}}), Some("reckon.spec_prefill")),
        (json!({"n": 2}), Some("n")),
        (json!({"echo": true}), Some("echo")),
        (json!({"max_tokens": 0}), Some("max_tokens")),
        (json!({"logprobs": 2, "seed": 4, "cache_salt": "t", "reckon": {"spec_prefill": false}}), None),
        (json!({"structured_outputs": {"choice": ["yes", "no"]}}), None),
    ] {
        let a = completion(extra.clone());
        match refused {
            Some(param) => {
                assert_eq!(a.status, 400, "{extra}: {}", a.body);
                assert_eq!(a.json()["error"]["param"], param, "{extra}: {}", a.body);
            }
            None => assert_eq!(a.status, 200, "{extra}: {}", a.body),
        }
    }
    assert_eq!(get(addr, "/health").status, 200);
    assert_eq!(completion(json!({})).json()["choices"][0]["text"], plain.as_str());
    // SAFETY: kill(2) on our own child's pid
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "no exit after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
}

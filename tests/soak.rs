//! The soak of issue 22 in CI: `reckon lab soak` on the real binary, over the tiny random model (a GGUF
//! written to a temp dir; nothing to fetch, never skipped). 64 clients for 2 minutes (RECKON_SOAK_MINUTES
//! changes it): the four APIs, streamed or not, a third hung up mid-stream, stop strings, seeds, prompts
//! up to and past the context; a KV cache far smaller than the clients' prompts together, so preemption
//! runs all the time. Then a flood of 1,000 requests at once (only 200s and 429s with Retry-After,
//! `/health` within 100 ms), and a SIGTERM while streams run (each ends whole or with an error event, new
//! requests get 503, exit 0). The lab checks the server's account too: every KV block free once idle, no
//! panic in its log; this test asserts the lab's verdict and prints its table.

#[path = "../crates/engine/tests/common/mod.rs"]
mod common;
#[path = "../crates/server/tests/support/mod.rs"]
mod support;

use std::process::Command;

#[test]
fn soak_flood_and_shutdown_under_load() {
    let minutes = std::env::var("RECKON_SOAK_MINUTES").unwrap_or_else(|_| "2".into());
    let dir = std::env::temp_dir().join(format!("reckon-soak-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("tiny.gguf");
    std::fs::write(&model, support::tiny_gguf()).unwrap();
    let out = dir.join("out");
    let serve = ["-t", "1", "-c", "2048", "--kv-memory", "8192", "--max-waiting", "256", "--drain-timeout", "20"];
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_reckon"));
    cmd.args(["lab", "soak", "-m", model.to_str().unwrap(), "--clients", "64", "--minutes", &minutes, "--max-prompt-words", "600", "--flood", "1000", "--shutdown", "--out", out.to_str().unwrap()]);
    for a in serve {
        cmd.arg(format!("--serve-arg={a}"));
    }
    let run = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    println!("{stdout}");
    let report = std::fs::read_to_string(out.join("report.json")).unwrap_or_default();
    assert!(run.status.success(), "the soak failed:\n{stdout}\n{}\nreport: {report}", stderr.chars().rev().take(4000).collect::<String>().chars().rev().collect::<String>());
    let v: serde_json::Value = serde_json::from_str(&report).unwrap();
    assert_eq!(v["passed"], true);
    // it did exercise what it claims: many requests, each kind of ending, preemption-level KV pressure
    let outcomes = &v["soak"]["outcomes"];
    assert!(v["soak"]["requests"].as_u64().unwrap() >= 500, "{report}");
    for k in ["Complete", "CleanError", "HungUp"] {
        assert!(outcomes[k].as_u64().unwrap_or(0) > 0, "no request ended {k}: {report}");
    }
    assert!(v["flood"]["by_status"]["429"].as_u64().unwrap_or(0) > 0, "the flood met no full queue: {report}");
    // the signal came while streams ran: requests sent during the drain got 503
    assert!(v["shutdown"]["late"].as_array().unwrap().iter().any(|l| l[0] == 503), "no request met the drain: {report}");
    let _ = std::fs::remove_dir_all(&dir);
}

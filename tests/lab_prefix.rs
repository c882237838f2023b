//! `reckon lab prefix` end to end on the default model, at a small size: it writes the raw records, the
//! table and the plot, the cache-on arm reuses the earlier turns, replies match across arms, and with a
//! timestamp first the report names the low hits and where the prompts differ. Skipped (with a note)
//! when SmolLM2 is not fetched, unless RECKON_REQUIRE_MODELS=1.

mod common;

use std::path::Path;
use std::process::Command;

/// Runs a 3-turn session; returns the printed report and the raw records.
fn lab(out: &Path, extra: &[&str]) -> (String, Vec<serde_json::Value>) {
    let _ = std::fs::remove_dir_all(out);
    let args = ["lab", "prefix", "--turns", "3", "--prefix-tokens", "120", "--turn-tokens", "20-30", "--max-tokens", "4", "-r", "1"];
    let run = Command::new(env!("CARGO_BIN_EXE_reckon")).args(args).args(extra).arg("--out").arg(out).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    assert!(run.status.success(), "{}\n{}", stdout, String::from_utf8_lossy(&run.stderr));
    let raw = std::fs::read_to_string(out.join("records.jsonl")).unwrap();
    let records = raw.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(std::fs::read_to_string(out.join("ttft.svg")).unwrap().starts_with("<svg"));
    assert!(out.join("table.md").exists() && out.join("command.txt").exists());
    assert!(stdout.contains("replies identical with the cache on and off (greedy): yes"), "{stdout}");
    (stdout, records)
}

#[test]
fn lab_prefix_replays_a_small_session() {
    if !common::default_model_fetched() {
        return;
    }
    let out = std::env::temp_dir().join(format!("reckon-lab-prefix-{}", std::process::id()));
    let (_, records) = lab(&out, &[]);
    assert_eq!(records.len(), 6, "3 turns, cache on and off");
    for r in &records {
        let reused = r["prefix_cache"].as_bool().unwrap() && r["turn"].as_u64().unwrap() > 0;
        let (cached, prompt) = (r["cached_tokens"].as_u64().unwrap(), r["prompt_tokens"].as_u64().unwrap());
        assert_eq!(cached > prompt / 2, reused, "{r}");
    }
    let (report, _) = lab(&out, &["--timestamp"]);
    assert!(report.contains("low cache hits (2 requests"), "{report}");
    assert!(report.contains("comes '1Z.") && report.contains("where an earlier request had '0Z."), "{report}");
    std::fs::remove_dir_all(&out).unwrap();
}

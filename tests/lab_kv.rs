//! `reckon lab kv-quant` end to end on the default model, at a small size: every (pass, depth, arm, test)
//! is recorded plus the drift check, the table and plot are written, and the quality columns compare each
//! arm with f16 (q8_0 keeps f16's top-1 wherever f16 is not near a tie). Skipped (with a note) when
//! SmolLM2 is not fetched, unless RECKON_REQUIRE_MODELS=1.

mod common;

use std::process::Command;

#[test]
fn lab_kv_quant_measures_every_arm() {
    if !common::default_model_fetched() {
        return;
    }
    let out = std::env::temp_dir().join(format!("reckon-lab-kv-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(&out).unwrap();
    let text = out.join("text.txt");
    let para = "The engine keeps every running request's keys and values in blocks of sixteen tokens. When memory runs short, the newest request is preempted and its blocks return to the pool; it resumes later from its prompt. ";
    std::fs::write(&text, para.repeat(12)).unwrap();
    let args = ["lab", "kv-quant", "--arms", "f16,q8_0,q4_0", "--depths", "0,64", "-r", "2", "-n", "4", "-p", "16", "--quality-tokens", "300", "--needle-tokens", "200", "--price-per-hour", "0.1"];
    let run = Command::new(env!("CARGO_BIN_EXE_reckon")).args(args).arg("--text").arg(&text).arg("--out").arg(&out).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout).to_string();
    assert!(run.status.success(), "{}\n{}", stdout, String::from_utf8_lossy(&run.stderr));
    let records: Vec<serde_json::Value> = std::fs::read_to_string(out.join("records.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(records.len(), 2 * 2 * 3 * 2 + 2, "passes x depths x arms x (tg, pp), then the drift check's tg and pp");
    // each record timed the tokens asked (-n 4 decoded, -p 16 prefilled) at a rate a 135M model can have
    // on a CPU: finite, above 1 token/s and below a million
    for r in &records {
        let want = if r["test"] == "tg" { 4 } else { 16 };
        assert_eq!(r["tokens"].as_u64(), Some(want), "{r}");
        let tps = r["tokens_per_s"].as_f64().unwrap();
        assert!(tps.is_finite() && (1.0..1e6).contains(&tps), "{r}");
    }
    for arm in ["f16", "q8_0", "q4_0"] {
        for depth in [0, 64] {
            let n = records.iter().filter(|r| r["kv_dtype"] == arm && r["depth"] == depth && !r["drift_check"].as_bool().unwrap()).count();
            assert_eq!(n, 2 * 2, "{arm} at depth {depth}: tg and pp in each of 2 passes");
        }
    }
    assert_eq!(records.iter().filter(|r| r["drift_check"].as_bool().unwrap()).count(), 2);
    let quality: Vec<serde_json::Value> = std::fs::read_to_string(out.join("quality.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(quality.iter().map(|q| q["kv_dtype"].as_str().unwrap()).collect::<Vec<_>>(), ["f16", "q8_0", "q4_0"]);
    assert_eq!(quality[0]["top1_agreement"].as_f64().unwrap(), 1.0);
    let q8 = &quality[1];
    assert_eq!(q8["clear_agree"], q8["clear_positions"], "q8_0 flips a clear top-1: {q8}");
    assert!(q8["mean_kl"].as_f64().unwrap() < quality[2]["mean_kl"].as_f64().unwrap(), "q4_0 is further from f16 than q8_0");
    let recall = std::fs::read_to_string(out.join("recall.jsonl")).unwrap();
    assert_eq!(recall.lines().count(), 3 * 5, "5 needles per arm: {recall}");
    assert!(stdout.contains("Needle recall at") && stdout.contains("| q4_0 | "), "{stdout}");
    assert!(std::fs::read_to_string(out.join("speed.svg")).unwrap().starts_with("<svg"));
    let csv = std::fs::read_to_string(out.join("speed.csv")).unwrap();
    assert_eq!(csv.lines().count(), 1 + 2 * 2 * 3, "{csv}");
    assert!(stdout.contains("| tg | 64 | q8_0 |") && stdout.contains("$ / M tokens") && stdout.contains("Drift check"), "{stdout}");
    assert!(std::fs::read_to_string(out.join("command.txt")).unwrap().contains("commit:"));
    std::fs::remove_dir_all(&out).unwrap();
}

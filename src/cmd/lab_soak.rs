//! `reckon lab soak`: the soak, the flood and a shutdown under load (crates/lab/src/soak.rs) against a
//! `reckon serve` it starts (or any OpenAI-compatible URL), then the server's own account: KV blocks all
//! free again, RSS growth, no panic in its log, a clean exit on SIGTERM.

use anyhow::{Context, Result};
use clap::Args;
use reckon_lab::http::{self, Endpoint, Read};
use reckon_lab::soak::{self, Outcome, SoakSpec};
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Args)]
pub struct SoakArgs {
    /// Start `reckon serve -m MODEL` on a free loopback port (its log, RSS and exit are checked too).
    #[arg(short = 'm', long)]
    pub model: Option<String>,
    /// One more argument for that `reckon serve` (repeatable).
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    pub serve_args: Vec<String>,
    /// Or soak a running server (only what its API and /metrics show is checked).
    #[arg(long)]
    pub url: Option<String>,
    /// Concurrent clients.
    #[arg(long, default_value_t = 64)]
    pub clients: usize,
    /// How long the soak runs, in minutes (fractions allowed).
    #[arg(long, default_value_t = 2.0)]
    pub minutes: f64,
    /// Longest prompt in words (default: the server's context, from /v1/models; longer prompts than the
    /// context must be refused cleanly).
    #[arg(long)]
    pub max_prompt_words: Option<usize>,
    /// Requests ask for 1 to this many tokens.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// After the soak: this many streamed requests at once (0: none); only 200s and 429s with
    /// Retry-After may come back, and /health must answer within --health-ms throughout.
    #[arg(long, default_value_t = 1000)]
    pub flood: usize,
    #[arg(long, default_value_t = 100.0)]
    pub health_ms: f64,
    /// With -m, at the end: SIGTERM while streams run; they must end whole or with an error event, new
    /// requests must get 503, and the server must exit 0.
    #[arg(long)]
    pub shutdown: bool,
    #[arg(long)]
    pub api_key: Option<String>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// A request that takes longer is a failure (a hang).
    #[arg(long, default_value_t = 300.0)]
    pub timeout_s: f64,
    /// Where to write requests.jsonl, report.json, table.md and command.txt (default bench/out/soak-<time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

fn rss_kib(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()
}

async fn get(ep: &Endpoint, path: &str, key: Option<&str>) -> Option<(u16, String)> {
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    let a = http::send(ep, "GET", path, &headers, None, Duration::from_secs(10), Read::All).await.ok()?;
    Some((a.status, String::from_utf8_lossy(&a.body()).into_owned()))
}

pub fn run(args: SoakArgs) -> Result<()> {
    anyhow::ensure!(args.clients >= 1 && args.minutes > 0.0 && args.minutes.is_finite(), "--clients and --minutes must be positive");
    anyhow::ensure!(args.model.is_some() != args.url.is_some(), "give -m MODEL (start a server) or --url URL (a running one), not both");
    anyhow::ensure!(!args.shutdown || args.model.is_some(), "--shutdown needs -m (a server this command started)");
    let out = super::lab::out_dir(&args.out, "soak")?;
    let (mut child, url) = match &args.model {
        Some(m) => {
            let server = super::server_process::ServerProcess::start(m, &args.serve_args, &out.join("reckon-serve.log"))?;
            let url = server.url.clone();
            (Some(server), url)
        }
        None => {
            let url = args.url.clone().unwrap_or_default();
            super::server_process::wait_ready(&url, super::server_process::READY_TIMEOUT, None)?;
            (None, url)
        }
    };
    let pid = child.as_ref().map(|c| c.pid());
    let endpoint = Endpoint::parse(&url).map_err(|e| anyhow::anyhow!(e))?;
    let key = args.api_key.as_deref();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (_, models) = rt.block_on(get(&endpoint, "/v1/models", key)).context("GET /v1/models")?;
    let models: serde_json::Value = serde_json::from_str(&models).context("/v1/models: not JSON")?;
    let model = models["data"][0]["id"].as_str().context("/v1/models lists no model")?.to_string();
    let max_prompt_words = args.max_prompt_words.or(models["data"][0]["max_model_len"].as_u64().map(|n| n as usize)).unwrap_or(2048);
    let spec = SoakSpec { endpoint: endpoint.clone(), model: model.clone(), clients: args.clients, duration: Duration::from_secs_f64(args.minutes * 60.0), max_prompt_words, max_tokens: args.max_tokens, api_key: args.api_key.clone(), seed: args.seed, timeout: Duration::from_secs_f64(args.timeout_s) };
    // one request first, so the RSS baseline has the model paged in and the buffers of a step allocated
    let (warm, body) = soak::draw(&spec, usize::MAX >> 8, 0);
    rt.block_on(soak::send(&spec, warm, body));
    let rss_start = pid.and_then(rss_kib);
    // RSS every 2 s: the KV pool's pages are touched over the first minutes (growth that is no leak), so
    // the growth that counts is from a quarter of the soak to its end
    let sampling = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let sampler = pid.map(|pid| {
        let go = sampling.clone();
        std::thread::spawn(move || {
            let (t0, mut samples) = (Instant::now(), Vec::new());
            while go.load(std::sync::atomic::Ordering::Relaxed) {
                if let Some(kib) = rss_kib(pid) {
                    samples.push((t0.elapsed().as_secs_f64(), kib));
                }
                std::thread::sleep(Duration::from_secs(2));
            }
            samples
        })
    });
    eprintln!("soak: {} clients for {:.1} min against {} ({model}), prompts up to {max_prompt_words} words", args.clients, args.minutes, endpoint.url(""));
    let mut raw = std::fs::File::create(out.join("requests.jsonl"))?;
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    let writer = std::thread::spawn(move || {
        for line in rx {
            let _ = writeln!(raw, "{line}");
        }
    });
    let started = Instant::now();
    let mut last_print = Instant::now();
    let report = rt.block_on(soak::run(&spec, move |r| {
        let _ = tx.send(serde_json::to_string(r).unwrap_or_default());
        if r.outcome == Outcome::Failed {
            eprintln!("FAILED: client {} #{} {} stream={} -> {:?}", r.client, r.seq, r.api.name(), r.stream, r.detail);
        }
        if last_print.elapsed() > Duration::from_secs(15) {
            last_print = Instant::now();
            eprintln!("  {:.0} s ...", started.elapsed().as_secs_f64());
        }
    }));
    let _ = writer.join();
    let mut checks: Vec<(String, bool)> = Vec::new();
    checks.push((format!("every request ended whole, with a clean error, or hung up by its client: {} failed of {}", report.failed, report.requests), report.failed == 0));
    checks.push((format!("/health answered every probe during the soak (slowest {:.1} ms)", report.health_max_ms), report.health_failures == 0));

    // the engine idle again: every KV block free (reckon's metrics; other servers: skipped)
    let idle_deadline = Instant::now() + Duration::from_secs(30);
    let kv = loop {
        let text = rt.block_on(get(&endpoint, "/metrics", key)).map(|(_, t)| t).unwrap_or_default();
        let running = soak::metric(&text, "vllm:num_requests_running").unwrap_or(0.0) + soak::metric(&text, "vllm:num_requests_waiting").unwrap_or(0.0);
        let kv = soak::metric(&text, "reckon_kv_blocks_free").zip(soak::total_blocks(&text));
        if kv.is_none_or(|(free, total)| free == total && running == 0.0) || Instant::now() > idle_deadline {
            break kv;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    if let Some((free, total)) = kv {
        checks.push((format!("no KV block leaked: {free} of {total} free once idle"), free == total));
    }
    sampling.store(false, std::sync::atomic::Ordering::Relaxed);
    let samples = sampler.and_then(|h| h.join().ok()).unwrap_or_default();
    let rss_end = pid.and_then(rss_kib);
    let quarter = samples.iter().find(|(t, _)| *t >= spec.duration.as_secs_f64() / 4.0).map(|&(_, k)| k);
    let rss = rss_start.zip(rss_end).map(|(a, b)| {
        let q = quarter.unwrap_or(a);
        json!({"start_kib": a, "quarter_kib": q, "end_kib": b, "growth_kib": b as i64 - a as i64, "growth_pct": (b as f64 / a as f64 - 1.0) * 100.0, "growth_after_quarter_pct": (b as f64 / q as f64 - 1.0) * 100.0, "samples": samples})
    });

    let flood = (args.flood > 0).then(|| {
        eprintln!("flood: {} streamed requests at once", args.flood);
        rt.block_on(soak::flood(&endpoint, &model, args.flood, 16, Duration::from_secs_f64(args.timeout_s), key))
    });
    if let Some(f) = &flood {
        let others: usize = f.by_status.iter().filter(|(s, _)| **s != 200 && **s != 429).map(|(_, n)| n).sum();
        let n429 = f.by_status.get(&429).copied().unwrap_or(0);
        checks.push((format!("flood of {}: only 200s and 429s ({:?}), no failure ({:?})", f.sent, f.by_status, f.failures), others == 0 && f.failures.is_empty()));
        checks.push((format!("every 429 carried Retry-After ({} of {n429})", f.retry_after), f.retry_after == n429));
        checks.push((format!("/health within {} ms throughout the flood: slowest {:.1} ms of {} probes, {} failed", args.health_ms, f.health_max_ms, f.health_probes, f.health_failures), f.health_max_ms <= args.health_ms && f.health_failures == 0));
    }

    let mut shutdown = None;
    if let (true, Some(c)) = (args.shutdown, child.as_mut()) {
        // streams running when the signal comes: answers up to the context (no max_tokens), so they are
        // mid-stream 1.3 s later even on a fast model (1,024 tokens each were done by then on the tiny
        // model once its attention got faster)
        let burst_spec = spec.clone();
        let server: &super::server_process::ServerProcess = c;
        let result = rt.block_on(async {
            let mut tasks = tokio::task::JoinSet::new();
            for i in 0..args.clients.min(32) {
                let (s, model) = (burst_spec.clone(), model.clone());
                tasks.spawn(async move {
                    let body = json!({"model": model, "messages": [{"role": "user", "content": format!("{i}. Write a long story about a river.")}], "temperature": 0, "stream": true, "ignore_eos": true});
                    let req = soak::SoakRequest { client: i, seq: 0, api: soak::SoakApi::Chat, stream: true, hang_up_after: None, stop: false, seeded: false, prompt_words: 8, max_tokens: 0, outcome: Outcome::Failed, status: 0, detail: None, ms: 0.0 };
                    soak::send(&s, req, body).await
                });
            }
            tokio::time::sleep(Duration::from_millis(1000)).await;
            let _ = server.signal(libc::SIGTERM);
            tokio::time::sleep(Duration::from_millis(300)).await;
            // new requests while draining: 503 (or, once it has exited, no connection)
            let mut late = Vec::new();
            for i in 0..5 {
                let body = json!({"model": model, "messages": [{"role": "user", "content": format!("late {i}")}], "max_tokens": 4});
                let req = soak::SoakRequest { client: 1000 + i, seq: 0, api: soak::SoakApi::Chat, stream: false, hang_up_after: None, stop: false, seeded: false, prompt_words: 2, max_tokens: 4, outcome: Outcome::Failed, status: 0, detail: None, ms: 0.0 };
                late.push(soak::send(&burst_spec, req, body).await);
            }
            let mut running = Vec::new();
            while let Some(r) = tasks.join_next().await {
                if let Ok(r) = r {
                    running.push(r);
                }
            }
            (running, late)
        });
        let (running, late) = result;
        let exit = {
            let t = Instant::now();
            loop {
                if let Some(st) = c.try_wait() {
                    break Some(st);
                }
                if t.elapsed() > Duration::from_secs(60) {
                    break None;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        };
        let whole = running.iter().filter(|r| r.outcome == Outcome::Complete).count();
        let clean = running.iter().filter(|r| r.outcome == Outcome::CleanError).count();
        let late_ok = late.iter().all(|r| (r.outcome == Outcome::CleanError && r.status == 503) || r.detail.as_deref() == Some("connect"));
        checks.push((format!("shutdown under load: {} streams ended whole, {} with an error event, {} otherwise", whole, clean, running.len() - whole - clean), whole + clean == running.len()));
        checks.push((format!("requests after SIGTERM: {:?}", late.iter().map(|r| if r.status > 0 { r.status.to_string() } else { r.detail.clone().unwrap_or_default() }).collect::<Vec<_>>()), late_ok));
        checks.push((format!("the server exited 0 after SIGTERM ({exit:?})"), exit.is_some_and(|s| s.success())));
        shutdown = Some(json!({"streams": running.len(), "whole": whole, "error_event": clean, "late": late.iter().map(|r| (r.status, r.detail.clone())).collect::<Vec<_>>(), "exit": format!("{exit:?}")}));
    }
    drop(child);
    if args.model.is_some() {
        let log = std::fs::read_to_string(out.join("reckon-serve.log")).unwrap_or_default();
        let panics = log.lines().filter(|l| l.contains("panicked")).count();
        checks.push((format!("no panic in the server's log ({panics})"), panics == 0));
    }
    let passed = checks.iter().all(|(_, ok)| *ok);
    let summary = json!({"soak": report, "kv_blocks": kv.map(|(f, t)| json!({"free": f, "total": t})), "rss": rss, "flood": flood, "shutdown": shutdown, "checks": checks.iter().map(|(c, ok)| json!({"check": c, "ok": ok})).collect::<Vec<_>>(), "passed": passed});
    std::fs::write(out.join("report.json"), serde_json::to_string_pretty(&summary)?)?;
    let mut table = format!("lab soak: {} clients, {:.1} min, {} requests ({:.1}/s), prompts up to {max_prompt_words} words, up to {} tokens\n\n", args.clients, args.minutes, report.requests, report.requests as f64 / report.duration_s.max(1e-9), args.max_tokens);
    table.push_str("| API | complete | clean error | hung up | failed |\n|---|---|---|---|---|\n");
    for (api, o) in &report.by_api {
        let n = |k: &str| o.get(k).copied().unwrap_or(0);
        table.push_str(&format!("| {api} | {} | {} | {} | {} |\n", n("Complete"), n("CleanError"), n("HungUp"), n("Failed")));
    }
    table.push_str(&format!("\nclean errors by status (0: an error event in a stream): {:?}\n", report.clean_errors_by_status));
    if let Some(r) = &rss {
        table.push_str(&format!("RSS: {} KiB after the first request, {} KiB a quarter into the soak, {} KiB at its end ({:+.1}% from the quarter; the KV pool's pages are touched over the first minutes)\n", r["start_kib"], r["quarter_kib"], r["end_kib"], r["growth_after_quarter_pct"].as_f64().unwrap_or(0.0)));
    }
    table.push_str("\n| check | result |\n|---|---|\n");
    for (c, ok) in &checks {
        table.push_str(&format!("| {c} | {} |\n", if *ok { "ok" } else { "FAILED" }));
    }
    std::fs::write(out.join("table.md"), &table)?;
    println!("{table}\nraw requests and report: {}", out.display());
    anyhow::ensure!(passed, "the soak found failures (see {})", out.join("report.json").display());
    Ok(())
}

//! `reckon lab serve`: the load generator (crates/lab/src/serve.rs) against OpenAI-compatible URLs, or
//! against a `reckon serve` it starts itself.

use super::server_process::{wait_ready, ServerProcess, READY_TIMEOUT};
use anyhow::{Context, Result};
use clap::Args;
use reckon_lab::http::Endpoint;
use reckon_lab::serve::{self, Api, Load, Prompts, ServeSpec, Target};
use std::io::Write;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Args)]
pub struct ServeLabArgs {
    /// A server to measure, `NAME=http://host:port` or just the URL (repeatable; they alternate at every
    /// level, and the first is the one the others are compared with).
    #[arg(long = "url", value_name = "[NAME=]URL")]
    pub urls: Vec<String>,
    /// Also start `reckon serve -m MODEL` on a free loopback port and measure it first, as "reckon".
    #[arg(short = 'm', long)]
    pub model: Option<String>,
    /// One more argument for that `reckon serve` (repeatable: --serve-arg=--max-running --serve-arg=16).
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    pub serve_args: Vec<String>,
    /// The `model` sent to every target (default: the first id each target's /v1/models lists).
    #[arg(long)]
    pub model_name: Option<String>,
    /// Closed loop: concurrent clients per level, comma-separated.
    #[arg(short = 'c', long, default_value = "1,2,4,8,16")]
    pub concurrency: String,
    /// Open loop instead: arrivals at these rates (requests/s), comma-separated.
    #[arg(long)]
    pub rate: Option<String>,
    /// With --rate: `poisson` (exponential gaps, from a seeded generator) or `constant` (evenly spaced).
    #[arg(long, default_value = "poisson")]
    pub arrivals: String,
    /// Requests per level (default: 4 per client, at least 16; for a rate, 20 s of arrivals, at least 16).
    #[arg(long, default_value_t = 0)]
    pub requests: usize,
    /// Stop sending a level's requests after this many seconds (those in flight finish).
    #[arg(long)]
    pub duration_s: Option<f64>,
    /// Interleaved passes (the targets' order reversed from level to level and pass to pass).
    #[arg(short = 'r', long, default_value_t = 3)]
    pub passes: usize,
    /// Requests sent to each target, one at a time, before measuring.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Prompt length in words (about one token each); every prompt is distinct from its first token.
    #[arg(long, default_value_t = 100)]
    pub prompt_words: usize,
    /// Output tokens per request (forced with ignore_eos).
    #[arg(short = 'n', long, default_value_t = 128)]
    pub output_tokens: usize,
    /// Prompts from a file of real conversations (ShareGPT JSON or JSON lines, or {"prompt", "output_tokens"}
    /// lines) instead of fixed ones; output lengths from the replies.
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// With --dataset: the longest output asked for.
    #[arg(long, default_value_t = 512)]
    pub max_output_tokens: usize,
    /// The API: completions or chat.
    #[arg(long, default_value = "completions")]
    pub api: String,
    /// Let answers end at the model's end of text (lengths then differ between servers).
    #[arg(long)]
    pub no_ignore_eos: bool,
    #[arg(long)]
    pub api_key: Option<String>,
    /// A request that takes longer counts as a timeout.
    #[arg(long, default_value_t = 600.0)]
    pub timeout_s: f64,
    /// Goodput: requests that got their first token within this many ms...
    #[arg(long)]
    pub slo_ttft_ms: Option<f64>,
    /// ...and their later tokens within this many ms each on average (TPOT).
    #[arg(long)]
    pub slo_tpot_ms: Option<f64>,
    /// What the machine costs per hour, in dollars: the tables add $ per million output tokens.
    #[arg(long)]
    pub price_per_hour: Option<f64>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Where to write requests.jsonl, levels.jsonl, table.md, throughput.svg, latency.svg and command.txt
    /// (default bench/out/serve-<time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(args: ServeLabArgs) -> Result<()> {
    anyhow::ensure!(args.passes >= 1, "--passes must be at least 1");
    anyhow::ensure!(!args.urls.is_empty() || args.model.is_some(), "nothing to measure: give --url URL (repeatable) or -m MODEL");
    anyhow::ensure!(args.timeout_s > 0.0 && args.timeout_s.is_finite(), "--timeout-s must be positive");
    let api = match args.api.as_str() {
        "completions" => Api::Completions,
        "chat" => Api::Chat,
        other => anyhow::bail!("--api {other}: expected completions or chat"),
    };
    let loads: Vec<Load> = match &args.rate {
        Some(r) => super::lab::list(r, "--rate", |s| {
            let v: f64 = s.parse().with_context(|| format!("--rate: '{s}' is not a number"))?;
            anyhow::ensure!(v > 0.0 && v.is_finite(), "--rate: {s} is not a positive rate");
            Ok(Load::Rate(v))
        })?,
        None => super::lab::list(&args.concurrency, "-c", |s| {
            let c: usize = s.parse().with_context(|| format!("-c: '{s}' is not a number"))?;
            anyhow::ensure!(c >= 1, "-c: at least 1 client");
            Ok(Load::Concurrency(c))
        })?,
    };
    let prompts = match &args.dataset {
        Some(p) => {
            let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            Prompts::Dataset(serve::read_dataset(&text, args.max_output_tokens).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?)
        }
        None => {
            anyhow::ensure!(args.prompt_words >= 1 && args.output_tokens >= 1, "--prompt-words and --output-tokens must be at least 1");
            Prompts::Fixed { prompt_words: args.prompt_words, output_tokens: args.output_tokens }
        }
    };
    let out = super::lab::out_dir(&args.out, "serve")?;
    let mut child = None;
    let mut named: Vec<(String, String)> = Vec::new();
    if let Some(m) = &args.model {
        let server = ServerProcess::start(m, &args.serve_args, &out.join("reckon-serve.log"))?;
        named.push(("reckon".into(), server.url.clone()));
        child = Some(server);
    }
    for u in &args.urls {
        let (name, url) = match u.split_once('=') {
            Some((n, url)) if !n.contains("://") => (n.to_string(), url.to_string()),
            _ => (u.trim_start_matches("http://").to_string(), u.clone()),
        };
        named.push((name, url));
    }
    let mut targets = Vec::new();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    for (name, url) in named {
        let endpoint = Endpoint::parse(&url).map_err(|e| anyhow::anyhow!("--url {e}"))?;
        if child.as_ref().is_none_or(|c| c.url != url) {
            wait_ready(&url, READY_TIMEOUT, None).with_context(|| format!("--url {name}"))?;
        }
        let model = match &args.model_name {
            Some(m) => m.clone(),
            None => rt.block_on(serve::served_model(&endpoint, args.api_key.as_deref())).map_err(|e| anyhow::anyhow!(e))?,
        };
        eprintln!("{name}: {} serving {model}", endpoint.url(""));
        targets.push(Target { name, endpoint, model });
    }
    drop(rt);
    let spec = ServeSpec {
        targets,
        loads,
        requests: args.requests,
        passes: args.passes,
        warmup: args.warmup,
        prompts,
        api,
        ignore_eos: !args.no_ignore_eos,
        api_key: args.api_key.clone(),
        timeout: Duration::from_secs_f64(args.timeout_s),
        slo_ttft_ms: args.slo_ttft_ms,
        slo_tpot_ms: args.slo_tpot_ms,
        price_per_hour: args.price_per_hour,
        seed: args.seed,
        duration: args.duration_s.map(Duration::from_secs_f64),
        constant_arrivals: match args.arrivals.as_str() {
            "poisson" => false,
            "constant" => true,
            other => anyhow::bail!("--arrivals {other}: expected poisson or constant"),
        },
    };
    let mut raw = std::fs::File::create(out.join("requests.jsonl"))?;
    let mut lv = std::fs::File::create(out.join("levels.jsonl"))?;
    let levels = serve::run(&spec, |l, reqs| {
        for r in reqs {
            let _ = writeln!(raw, "{}", serde_json::to_string(r).unwrap_or_default());
        }
        let _ = writeln!(lv, "{}", serde_json::to_string(l).unwrap_or_default());
        let errors = if l.errors.is_empty() { String::new() } else { format!(", errors {:?}", l.errors) };
        eprintln!("pass {} {:>14} {:>12}: {:7.1} output tok/s, {:5.2} req/s, TTFT p50 {:6.0} ms p99 {:6.0} ms, ITL p99 {:6.1} ms{errors}", l.pass + 1, l.target, l.load.label(), l.output_tokens_per_s, l.requests_per_s, l.ttft_ms.p50, l.ttft_ms.p99, l.itl_ms.p99);
    })?;
    drop(child);
    let rows = serve::rows(&levels);
    let what = match &spec.prompts {
        Prompts::Fixed { prompt_words, output_tokens } => format!("{prompt_words}-word prompts, {output_tokens} output tokens"),
        Prompts::Dataset(d) => format!("{} prompts from {}", d.len(), args.dataset.as_ref().map(|p| p.display().to_string()).unwrap_or_default()),
    };
    let slo = match (args.slo_ttft_ms, args.slo_tpot_ms) {
        (None, None) => String::new(),
        (a, b) => format!(", SLO{}{}", a.map_or(String::new(), |v| format!(" TTFT <= {v} ms")), b.map_or(String::new(), |v| format!(" TPOT <= {v} ms"))),
    };
    let price = args.price_per_hour.map_or(String::new(), |p| format!(", ${p}/hour"));
    let title = format!("lab serve: {what}, streamed /v1/{}, {} passes{slo}{price}", if api == Api::Chat { "chat/completions" } else { "completions" }, args.passes);
    let table = serve::markdown(&rows);
    std::fs::write(out.join("table.md"), format!("{title}\n\n{table}"))?;
    serve::plot(&rows, &title, &out)?;
    println!("{title}\n\n{table}\nraw requests, levels, table and plots: {}", out.display());
    Ok(())
}

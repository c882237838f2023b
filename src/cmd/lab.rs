//! `reckon lab ...`: experiments that show what an optimization costs and buys, on this machine.

use crate::cmd::common::{load, KvArgs, ModelArgs};
use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use reckon_lab::prefix::{self, report, PrefixSpec};
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args)]
pub struct LabArgs {
    #[command(subcommand)]
    pub command: LabCommand,
}

#[derive(Subcommand)]
pub enum LabCommand {
    /// Replay an agent session (a long system prompt with tools, then many turns that resend the whole
    /// history) with the prefix cache on and off: per turn, prompt tokens, tokens reused, tokens
    /// prefilled and time to first token.
    Prefix(PrefixArgs),
    /// KV-cache quantization against f16, in the same run: decode and prefill speed at several depths
    /// (interleaved passes), KV memory, and teacher-forced agreement with f16 over a text.
    KvQuant(KvQuantArgs),
    /// What long context costs: decode and prefill speed, step time and KV memory against depth (up to the
    /// model's context) for each KV dtype, beside the bound that the read bandwidth (measured in the same
    /// run) puts on decode. `kv-quant` with deeper default depths, no quality pass, and the bound.
    KvTax(KvQuantArgs),
    /// What a rotating KV window (--kv-window, --kv-sinks) saves and loses: needle recall against prompt
    /// length for full KV and each window, the KV memory each holds, and perplexity past the window
    /// with and without the sinks; with --sparse-attention N, sparse attention is one more arm.
    Eviction(EvictionArgs),
    /// What a sparse prefill (--spec-prefill-keep) saves in time to first token and loses in needle
    /// recall, per haystack length and keep ratio, against a full prefill in the same passes.
    SpecPrefill(SpecPrefillArgs),
    /// What speculative decoding (--spec ngram) buys per workload (code edit, quotes, JSON extraction,
    /// free chat) and draft length k, against no speculation in the same passes: decode tok/s, the
    /// guesses kept, and whether the output stayed the same.
    Spec(SpecArgs),
    /// Load against OpenAI-compatible servers (reckon, llama-server, vLLM: --url, or -m to start reckon):
    /// closed-loop concurrency sweeps or Poisson arrivals, fixed or real-conversation prompts; TTFT, ITL,
    /// TPOT and end-to-end percentiles, throughput, goodput under an SLO, errors by kind, $/M tokens.
    Serve(super::lab_serve::ServeLabArgs),
    /// Many clients misbehaving for a bounded time (mixed APIs, streamed or not, hang-ups, stop strings,
    /// seeds, prompts up to and past the context), then a flood of requests at once and a SIGTERM under
    /// load: every request must end whole or with a clean error, no KV block may leak, /health must stay
    /// fast, the log must hold no panic.
    Soak(super::lab_soak::SoakArgs),
    /// Replicas behind a real router (sglang-router from PyPI): `lab prefix`'s multi-session agent
    /// workload under round-robin, the router's cache-aware policy and a picker fed by the replicas'
    /// KV-cache events (prefix-cache hit rate, TTFT, throughput); with --failover, a replica killed and
    /// one drained mid-run, counting what clients saw.
    Cluster(super::lab_cluster::ClusterArgs),
    /// What an optimization costs in answers: HumanEval's 164 problems asked greedily through the chat
    /// API of one server per arm (KV dtypes, a window, sparse attention, sparse prefill on long prompts,
    /// speculation, the ggml numerics, llama-server via --url), every answer run against its tests in a
    /// sandbox; pass@1 with 95% intervals, and per arm the problems gained and lost against its baseline
    /// with McNemar's exact test.
    Quality(super::lab_quality::QualityArgs),
    /// One page of every leg found in DIR (and two levels of subdirectories): the machines and builds,
    /// then per leg its command, table and plots. Writes DIR/report.md, and with --html DIR/report.html
    /// (self-contained: plots inline as SVG).
    Report(ReportArgs),
}

#[derive(Args)]
pub struct ReportArgs {
    pub dir: PathBuf,
    /// Also write report.html.
    #[arg(long)]
    pub html: bool,
    /// The page's title (default: the directory's name).
    #[arg(long)]
    pub title: Option<String>,
}

#[derive(Args)]
pub struct SpecArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Draft lengths besides 0 (no speculation, always measured), comma-separated.
    #[arg(long, default_value = "2,4,8")]
    pub ks: String,
    /// Workloads, comma-separated: code_edit, quote, json, chat.
    #[arg(long, default_value = "code_edit,quote,json,chat")]
    pub workloads: String,
    /// Also the controller (`--spec auto`) with at most this many guesses per step (0: not measured);
    /// with --draft it also uses the draft model.
    #[arg(long, default_value_t = 8)]
    pub auto_k: usize,
    /// A draft model of the same vocabulary (a name from `reckon models` or a path): its arms draft
    /// --draft-ks tokens per step.
    #[arg(long, value_name = "MODEL")]
    pub draft: Option<String>,
    /// The draft model's draft lengths, comma-separated.
    #[arg(long, default_value = "2,4")]
    pub draft_ks: String,
    /// Concurrent copies of each request, comma-separated.
    #[arg(long, default_value = "1")]
    pub streams: String,
    /// Interleaved passes (k order reversed every other pass).
    #[arg(short = 'r', long, default_value_t = 5)]
    pub passes: usize,
    /// Output tokens per request.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// The workloads' seed.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Where to write records.jsonl, table.md, speedup.svg and command.txt (default bench/out/spec-<time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[derive(Args)]
pub struct EvictionArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Haystack lengths in tokens, comma-separated.
    #[arg(long, default_value = "512,1024,2048,4096")]
    pub lengths: String,
    /// Window sizes (N of --kv-window), comma-separated; full KV is always measured too.
    #[arg(long, default_value = "256,512,1024")]
    pub windows: String,
    /// Sinks of every window (--kv-sinks).
    #[arg(long, default_value_t = 4)]
    pub sinks: usize,
    /// Needles per haystack, at evenly spaced depths.
    #[arg(long, default_value_t = 5)]
    pub needles: usize,
    /// Seed of the haystacks and the needles' numbers.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Reply tokens at most.
    #[arg(long, default_value_t = 12)]
    pub max_tokens: usize,
    /// The text teacher-forced for the fluency table (cut to --fluency-tokens).
    #[arg(long, default_value = "/usr/share/common-licenses/GPL-3")]
    pub text: PathBuf,
    /// Tokens of the fluency text (0: no fluency table).
    #[arg(long, default_value_t = 4096)]
    pub fluency_tokens: usize,
    /// Where to write recall.jsonl, fluency.jsonl, table.md, recall.svg and command.txt (default
    /// bench/out/eviction-<time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[derive(Args)]
pub struct SpecPrefillArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Haystack lengths in tokens, comma-separated.
    #[arg(long, default_value = "2048,4096,8192")]
    pub lengths: String,
    /// Keep ratios, comma-separated; the full prefill (1.0) is always measured.
    #[arg(long, default_value = "0.5,0.3,0.2,0.1")]
    pub keeps: String,
    /// Needles per haystack, at evenly spaced depths.
    #[arg(long, default_value_t = 5)]
    pub needles: usize,
    /// Layers of the scoring pass (the scorer's first layers).
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// The scoring model, of the same vocabulary (default: the model itself).
    #[arg(long, value_name = "MODEL")]
    pub scorer: Option<String>,
    /// Instead of the TTFT arms: the scoring's ranking quality with the scorer's first N layers, for
    /// each N listed (one pass of the deepest per prompt), and each pooling; writes rank.jsonl, rank.md.
    #[arg(long, value_name = "N,N,..")]
    pub rank_layers: Option<String>,
    /// Also the QA set: as many generated facts of five kinds (colour, city, pet, job, instrument) as
    /// --needles, each asked in its own request.
    #[arg(long)]
    pub qa: bool,
    /// Instead of the needles: the append-heavy agent session, full prefill vs sparse vs sparse with
    /// idle recovery (keep: the first of --keeps); writes session.jsonl, probes.jsonl, slices.jsonl,
    /// session.md.
    #[arg(long)]
    pub session: bool,
    /// Session: turns.
    #[arg(long, default_value_t = 4)]
    pub turns: usize,
    /// Session: system prompt (tool schemas) tokens.
    #[arg(long, default_value_t = 1024)]
    pub system_tokens: usize,
    /// Session: the first user turn's tokens (a file the agent was given).
    #[arg(long, default_value_t = 4096)]
    pub first_tokens: usize,
    /// Session: later turns' tokens, MIN-MAX.
    #[arg(long, default_value = "300-600")]
    pub turn_tokens: String,
    /// Session: the client's think time between turns (the engine is idle then), milliseconds.
    #[arg(long, default_value_t = 30000)]
    pub think_ms: u64,
    /// Session: short probe requests during each think time (recovery's added latency).
    #[arg(long, default_value_t = 4)]
    pub probes: usize,
    /// Session: the sparse arms thin a new suffix of at least this many tokens.
    #[arg(long, default_value_t = 4096)]
    pub min_tokens: usize,
    /// Session: recovery's slice, tokens per step.
    #[arg(long, default_value_t = 128)]
    pub recover_slice: usize,
    /// Interleaved passes (arm order reversed every other pass).
    #[arg(short = 'r', long, default_value_t = 3)]
    pub passes: usize,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Reply tokens at most (the session's replies: at least 32).
    #[arg(long, default_value_t = 12)]
    pub max_tokens: usize,
    /// Where to write records.jsonl, table.md, spec-prefill.svg and command.txt (default
    /// bench/out/spec-prefill-<time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[derive(Args)]
pub struct KvQuantArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The arms, comma-separated: `f16` first (the baseline), then KV dtypes (`q8_0`, `q4_0`, or `K/V`
    /// pairs written with a slash: `q8_0/q4_0`).
    #[arg(long, default_value = "f16,q8_0,q4_0")]
    pub arms: String,
    /// Context depths, comma-separated (multiples of 16). Default: kv-quant 0,1024,2048,4096; kv-tax
    /// also 8192 and the model's context, less room for the tests, where the model has it.
    #[arg(long)]
    pub depths: Option<String>,
    /// Interleaved passes (arm order reversed every other pass); figures are medians over them.
    #[arg(short = 'r', long, default_value_t = 5)]
    pub passes: usize,
    /// Tokens decoded per measurement (0: no decode test).
    #[arg(short = 'n', long, default_value_t = 64)]
    pub n_gen: usize,
    /// Tokens prefilled per measurement, after the depth (0: no prefill test).
    #[arg(short = 'p', long, default_value_t = 512)]
    pub n_prompt: usize,
    /// The text teacher-forced for the quality columns (cut to --quality-tokens).
    #[arg(long, default_value = "/usr/share/common-licenses/GPL-3")]
    pub text: PathBuf,
    /// Positions of the quality measure (0: none). Default: kv-quant 4096, kv-tax 0.
    #[arg(long)]
    pub quality_tokens: Option<usize>,
    /// Needle recall of each arm (`reckon lab eviction`'s haystack, 5 facts) at this many tokens (0:
    /// none). Default: kv-quant 2048, kv-tax 0.
    #[arg(long)]
    pub needle_tokens: Option<usize>,
    /// Measure the read bandwidth after the passes and show each decode's bound and fraction of it
    /// (always on for kv-tax).
    #[arg(long)]
    pub bandwidth: bool,
    /// An instance's price per hour: adds $ per million tokens to each speed.
    #[arg(long)]
    pub price_per_hour: Option<f64>,
    /// llama.cpp's KV types as a second implementation inside the same passes (f16, f16 with flash
    /// attention, K-only q8_0, q8_0 and q4_0 with flash attention), through bench/kv-quant-llamacpp run
    /// by this Python (default: the venv bench/setup-llamacpp makes). Each pass runs reckon's arms and
    /// then llama.cpp's, the order reversed on odd passes.
    #[arg(long, value_name = "PYTHON", num_args = 0..=1, default_missing_value = "/opt/llamacpp-venv/bin/python")]
    pub llamacpp: Option<PathBuf>,
    /// reckon at a second SIMD level inside the same passes (`avx2`: an AVX-512 machine's AVX2 paths). The
    /// level is fixed per process, so a second `reckon lab kv-quant` process measures the same arms
    /// (named `avx2 f16`, `avx2 q8_0`, ..., each against its own f16), the order reversed on odd passes.
    #[arg(long, value_enum, value_name = "LEVEL")]
    pub second_simd: Option<super::common::SimdArg>,
    /// Measure speed passes on request: `pass N` lines in, one JSON line of records out (the second
    /// process of --second-simd).
    #[arg(long, hide = true)]
    pub serve_passes: bool,
    /// Where to write records.jsonl, quality.jsonl, table.md, speed.csv, speed.svg and command.txt
    /// (default bench/out/kv-quant-<time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

#[derive(Args)]
pub struct PrefixArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, default_value_t = 20)]
    pub turns: usize,
    /// Conversations sharing the system prompt, turns interleaved.
    #[arg(long, default_value_t = 1)]
    pub sessions: usize,
    /// System prompt (with tool schemas) size in tokens.
    #[arg(long, default_value_t = 1500)]
    pub prefix_tokens: usize,
    /// User message size range in tokens, MIN-MAX.
    #[arg(long, default_value = "150-300")]
    pub turn_tokens: String,
    /// Reply tokens at most per turn (greedy; replies go back into the history).
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Interleaved passes of both arms (cache on/off, then off/on, ...); TTFT is the median.
    #[arg(short = 'r', long, default_value_t = 3)]
    pub passes: usize,
    /// Start the system prompt with the current turn's time (defeats the cache, on purpose).
    #[arg(long)]
    pub timestamp: bool,
    /// The engine of each arm.
    #[command(flatten)]
    pub kv: KvArgs,
    /// Where to write records.jsonl, table.md, ttft.svg and command.txt (default bench/out/prefix-<time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(args: LabArgs) -> Result<()> {
    match args.command {
        LabCommand::Prefix(a) => run_prefix(a),
        LabCommand::KvQuant(a) => run_kv_quant(a, false),
        LabCommand::KvTax(a) => run_kv_quant(a, true),
        LabCommand::Eviction(a) => run_eviction(a),
        LabCommand::SpecPrefill(a) => run_spec_prefill(a),
        LabCommand::Spec(a) => run_spec(a),
        LabCommand::Serve(a) => super::lab_serve::run(a),
        LabCommand::Soak(a) => super::lab_soak::run(a),
        LabCommand::Cluster(a) => super::lab_cluster::run(a),
        LabCommand::Quality(a) => super::lab_quality::run(a),
        LabCommand::Report(a) => {
            let title = a.title.clone().unwrap_or_else(|| format!("reckon lab: {}", a.dir.canonicalize().unwrap_or(a.dir.clone()).file_name().map_or("report".into(), |n| n.to_string_lossy().into_owned())));
            for p in reckon_lab::report::write(&a.dir, &title, a.html)? {
                println!("{}", p.display());
            }
            Ok(())
        }
    }
}

fn run_spec_prefill(args: SpecPrefillArgs) -> Result<()> {
    use reckon_lab::spec_prefill;
    anyhow::ensure!(args.needles >= 1 && args.passes >= 1 && args.layers >= 1, "--needles, --passes and --layers must be at least 1");
    let number = |flag: &'static str| move |s: &str| s.parse::<usize>().with_context(|| format!("{flag}: '{s}' is not a number"));
    let lengths = list(&args.lengths, "--lengths", number("--lengths"))?;
    let keeps = list(&args.keeps, "--keeps", |s| {
        let k: f64 = s.parse().with_context(|| format!("--keeps: '{s}' is not a number"))?;
        anyhow::ensure!(k > 0.0 && k <= 1.0, "--keeps: {k} is not in (0, 1]");
        Ok(k)
    })?;
    let loaded = load(&args.model)?;
    anyhow::ensure!(loaded.draft.is_none(), "this lab runs without a draft model");
    let scorer = match &args.scorer {
        Some(name) => Some(Arc::new(super::common::load_draft(name, &loaded.tokenizer, &args.model)?)),
        None => None,
    };
    let out = out_dir(&args.out, "spec-prefill")?;
    let scoring = reckon_engine::engine::sparse::SparsePrefillConfig { layers: args.layers, ..Default::default() };
    let lab = spec_prefill::SpecPrefillLabSpec { lengths, keeps, needles: args.needles, passes: args.passes, seed: args.seed, max_tokens: args.max_tokens, scoring, scorer, qa: args.qa };
    let (model, tokenizer) = (Arc::new(loaded.model), Arc::new(loaded.tokenizer));
    if args.session {
        let (lo, hi) = args.turn_tokens.split_once('-').with_context(|| format!("--turn-tokens '{}': MIN-MAX", args.turn_tokens))?;
        let turn_tokens = (number("--turn-tokens")(lo)?, number("--turn-tokens")(hi)?);
        anyhow::ensure!(turn_tokens.0 >= 1 && turn_tokens.0 <= turn_tokens.1 && args.turns >= 1, "--turn-tokens MIN-MAX with 1 <= MIN <= MAX, --turns at least 1");
        let sparse = reckon_engine::engine::sparse::SparsePrefillConfig { keep: lab.keeps[0], min_tokens: args.min_tokens, recover_slice: args.recover_slice.max(1), ..scoring };
        let spec = spec_prefill::SessionSpec {
            turns: args.turns,
            system_tokens: args.system_tokens,
            first_tokens: args.first_tokens,
            turn_tokens,
            think_ms: args.think_ms,
            probes: args.probes,
            max_tokens: args.max_tokens.max(32),
            passes: args.passes,
            sparse,
            scorer: lab.scorer.clone(),
        };
        let mut raw = std::fs::File::create(out.join("session.jsonl"))?;
        let run = spec_prefill::session(&model, &tokenizer, &loaded.template, &spec, |r| {
            let _ = writeln!(raw, "{}", serde_json::to_string(r).unwrap_or_default());
            eprintln!("pass {} {:>7} turn {}: {:>5} tokens, cached {:>5}, dropped {:>5}, debt {:>5}: TTFT {:>7.0} ms, e2e {:>7.0} ms", r.pass + 1, r.arm, r.turn, r.prompt_tokens, r.cached_tokens, r.dropped_tokens, r.debt_at_arrival, r.ttft_ms, r.e2e_ms);
        })?;
        let lines = |xs: Vec<String>| xs.join("\n") + "\n";
        std::fs::write(out.join("probes.jsonl"), lines(run.probes.iter().map(|p| serde_json::to_string(p).unwrap_or_default()).collect()))?;
        std::fs::write(out.join("slices.jsonl"), lines(run.slices.iter().map(|p| serde_json::to_string(p).unwrap_or_default()).collect()))?;
        let scorer_name = args.scorer.as_deref().map_or("self".to_string(), |s| s.rsplit('/').next().unwrap_or(s).to_string());
        let name = args.model.model.rsplit('/').next().unwrap_or(&args.model.model).to_string();
        let title = format!(
            "{name}: append-heavy session, keep {} (scored by {scorer_name}, {} layers, min {} tokens, recovery slices of {}), {} turns, think {} ms, {} passes, {} threads, kernels {}",
            sparse.keep, sparse.layers, sparse.min_tokens, sparse.recover_slice, spec.turns, spec.think_ms, spec.passes, reckon_engine::pool::current().threads(), reckon_engine::kernels::cpu::simd_level().name()
        );
        let table = spec_prefill::session_markdown(&run);
        std::fs::write(out.join("session.md"), format!("{title}\n\n{table}"))?;
        println!("{title}\n\n{table}\nraw records and table: {}", out.display());
        return Ok(());
    }
    if let Some(layers) = &args.rank_layers {
        let layers = list(layers, "--rank-layers", number("--rank-layers"))?;
        let scorer = lab.scorer.clone().unwrap_or_else(|| model.clone());
        let mut raw = std::fs::File::create(out.join("rank.jsonl"))?;
        let records = spec_prefill::rank(&scorer, &tokenizer, &loaded.template, &lab, &layers, |r| {
            let _ = writeln!(raw, "{}", serde_json::to_string(r).unwrap_or_default());
        })?;
        let scorer_name = args.scorer.as_deref().unwrap_or(&args.model.model);
        let title = format!("ranking by {scorer_name}'s first layers, {} needles per length, {} threads, kernels {}", args.needles, reckon_engine::pool::current().threads(), reckon_engine::kernels::cpu::simd_level().name());
        let table = spec_prefill::rank_markdown(&records);
        std::fs::write(out.join("rank.md"), format!("{title}\n\n{table}"))?;
        println!("{title}\n\n{table}\nraw records and table: {}", out.display());
        return Ok(());
    }
    let mut raw = std::fs::File::create(out.join("records.jsonl"))?;
    let records = spec_prefill::run(&model, &tokenizer, &loaded.template, &lab, |r| {
        let _ = writeln!(raw, "{}", serde_json::to_string(r).unwrap_or_default());
        eprintln!("pass {} length {:>5} keep {:.2} needle {}: {:>8.0} ms (scoring {:>5.0}), {} {}", r.pass + 1, r.length, r.keep, r.needle, r.ttft_ms, r.scoring_ms, if r.correct { "found" } else { "MISSED" }, r.reply);
    })?;
    let rows = spec_prefill::rows(&records);
    let name = args.model.model.rsplit('/').next().unwrap_or(&args.model.model).to_string();
    let scorer_name = args.scorer.as_deref().map_or("self".to_string(), |s| s.rsplit('/').next().unwrap_or(s).to_string());
    let title = format!("{name}: sparse prefill (scored by {scorer_name}, {} layers) vs full, {} passes, {} threads, kernels {}", args.layers, args.passes, reckon_engine::pool::current().threads(), reckon_engine::kernels::cpu::simd_level().name());
    let table = spec_prefill::markdown(&rows);
    std::fs::write(out.join("table.md"), format!("{title}\n\n{table}"))?;
    spec_prefill::plot(&rows, &name, &out.join("spec-prefill.svg"))?;
    println!("{title}\n\n{table}\nraw records, table and plot: {}", out.display());
    Ok(())
}

fn run_eviction(args: EvictionArgs) -> Result<()> {
    use reckon_lab::eviction;
    anyhow::ensure!(args.needles >= 1 && args.max_tokens >= 1, "--needles and --max-tokens must be at least 1");
    let loaded = load(&args.model)?;
    anyhow::ensure!(loaded.draft.is_none(), "this lab runs without a draft model (--spec draft is for serve, run, chat and lab spec --draft)");
    let cfg = loaded.model.config.clone();
    let kv_dtypes = args.model.kv_dtypes(&cfg, 16)?;
    let number = |flag: &'static str| move |s: &str| s.parse::<usize>().with_context(|| format!("{flag}: '{s}' is not a number"));
    let lengths = list(&args.lengths, "--lengths", number("--lengths"))?;
    let windows = list(&args.windows, "--windows", number("--windows"))?;
    anyhow::ensure!(windows.iter().all(|&w| w > 0), "--windows: a window holds at least one token");
    let longest = lengths.iter().copied().max().unwrap_or(0);
    anyhow::ensure!(longest + 256 + args.max_tokens < cfg.context_length, "--lengths: {longest} tokens leave no room in the model's {}-token context", cfg.context_length);
    let out = out_dir(&args.out, "eviction")?;
    let sparse = args.model.sparse_attention()?;
    let spec = eviction::EvictionSpec { lengths, windows, sinks: args.sinks, needles: args.needles, seed: args.seed, max_tokens: args.max_tokens, kv_dtypes, sparse };
    let (model, tokenizer) = (Arc::new(loaded.model), Arc::new(loaded.tokenizer));
    let mut raw = std::fs::File::create(out.join("recall.jsonl"))?;
    let records = eviction::recall(&model, &tokenizer, &loaded.template, &spec, |r| {
        let _ = writeln!(raw, "{}", serde_json::to_string(r).unwrap_or_default());
        let arm = match (r.window, r.sparse) {
            (Some(w), _) => format!("window {w}"),
            (None, Some(b)) => format!("sparse {b}"),
            (None, None) => "full".to_string(),
        };
        eprintln!("{:>5} tokens {:>12} needle {} ({:>5} from the end): {} '{}' ({:.0} ms)", r.prompt_tokens, arm, r.needle, r.distance_from_end, if r.correct { "ok  " } else { "MISS" }, r.reply, r.prefill_ms);
    })?;
    let mut fluency = Vec::new();
    if args.fluency_tokens > 0 {
        let text = std::fs::read_to_string(&args.text).with_context(|| format!("--text {}", args.text.display()))?;
        let mut tokens = tokenizer.encode(&text, true, false)?;
        tokens.truncate(args.fluency_tokens.min(cfg.context_length));
        eprintln!("teacher forcing {} tokens of {} through {} arms", tokens.len(), args.text.display(), 1 + spec.windows.len() * if spec.sinks > 0 { 2 } else { 1 } + usize::from(spec.sparse.is_some()));
        fluency = eviction::fluency(&model, &tokens, &spec.windows, spec.sinks, spec.sparse);
        let mut f = std::fs::File::create(out.join("fluency.jsonl"))?;
        for r in &fluency {
            writeln!(f, "{}", serde_json::to_string(r)?)?;
        }
    }
    let name = args.model.model.rsplit('/').next().unwrap_or(&args.model.model).to_string();
    let title = format!("{name}: needle recall vs prompt length, seed {}", args.seed);
    let table = eviction::markdown(&model, &spec, &records, &fluency);
    std::fs::write(out.join("table.md"), format!("{title}\n\n{table}"))?;
    eviction::plot(&spec, &records, &title, &out.join("recall.svg"))?;
    println!("{title}\n\n{table}\nraw records, table and plot: {}", out.display());
    Ok(())
}

fn run_spec(args: SpecArgs) -> Result<()> {
    use reckon_lab::spec;
    anyhow::ensure!(args.passes >= 1 && args.max_tokens >= 2, "--passes must be at least 1 and --max-tokens at least 2");
    let number = |flag: &'static str| move |s: &str| s.parse::<usize>().with_context(|| format!("{flag}: '{s}' is not a number"));
    let ks = list(&args.ks, "--ks", number("--ks"))?;
    let streams = list(&args.streams, "--streams", number("--streams"))?;
    anyhow::ensure!(streams.iter().all(|&s| s >= 1), "--streams: at least 1");
    let workloads = list(&args.workloads, "--workloads", |s| {
        anyhow::ensure!(spec::WORKLOADS.contains(&s), "--workloads: '{s}' is none of {}", spec::WORKLOADS.join(", "));
        Ok(s.to_string())
    })?;
    let (min_n, max_n) = turn_range(&args.model.spec_ngram).context("--spec-ngram")?;
    let draft_ks = list(&args.draft_ks, "--draft-ks", number("--draft-ks"))?;
    let loaded = load(&args.model)?;
    let draft = match &args.draft {
        Some(name) => Some(Arc::new(super::common::load_draft(name, &loaded.tokenizer, &args.model)?)),
        None => None,
    };
    let out = out_dir(&args.out, "spec")?;
    let lab = spec::SpecLabSpec { ks, auto_k: (args.auto_k > 0).then_some(args.auto_k), workloads, streams, passes: args.passes, max_tokens: args.max_tokens, seed: args.seed, min_n, max_n, draft, draft_ks };
    let (model, tokenizer) = (Arc::new(loaded.model), Arc::new(loaded.tokenizer));
    let mut raw = std::fs::File::create(out.join("records.jsonl"))?;
    let records = spec::run(&model, &tokenizer, &loaded.template, &lab, |r| {
        let _ = writeln!(raw, "{}", serde_json::to_string(r).unwrap_or_default());
        eprintln!("pass {} {:>9} x{} {:>10}: {:7.1} tok/s, {:>3} of {:>3} guesses kept{}", r.pass + 1, r.workload, r.streams, r.proposer.label(r.k), r.decode_tokens_per_s, r.accepted, r.drafted, if r.identical { "" } else { "  OUTPUT DIFFERS" });
    })?;
    let rows = spec::rows(&records);
    let name = args.model.model.rsplit('/').next().unwrap_or(&args.model.model).to_string();
    let drafter = args.draft.as_deref().map_or(String::new(), |d| format!(", draft model {}", d.rsplit('/').next().unwrap_or(d)));
    let title = format!("{name}: speculation (n-gram {min_n}-{max_n}{drafter}) vs none, {} passes, {} threads, kernels {}", args.passes, reckon_engine::pool::current().threads(), reckon_engine::kernels::cpu::simd_level().name());
    let table = spec::markdown(&rows);
    std::fs::write(out.join("table.md"), format!("{title}\n\n{table}"))?;
    spec::plot(&rows, &title, &out.join("speedup.svg"))?;
    anyhow::ensure!(rows.iter().all(|r| r.identical), "speculation changed a greedy output (see the table): {}", out.display());
    println!("{title}\n\n{table}\nraw records, table and plot: {}", out.display());
    Ok(())
}

fn turn_range(spec: &str) -> Result<(usize, usize)> {
    let parse = |s: &str| s.trim().parse::<usize>().with_context(|| format!("--turn-tokens '{spec}': expected MIN-MAX, e.g. 150-300"));
    let (lo, hi) = match spec.split_once('-') {
        Some((a, b)) => (parse(a)?, parse(b)?),
        None => (parse(spec)?, parse(spec)?),
    };
    anyhow::ensure!(lo >= 1 && lo <= hi, "--turn-tokens '{spec}': need 1 <= MIN <= MAX");
    Ok((lo, hi))
}

fn run_prefix(args: PrefixArgs) -> Result<()> {
    anyhow::ensure!(args.turns >= 1 && args.sessions >= 1 && args.passes >= 1, "--turns, --sessions and --passes must be at least 1");
    anyhow::ensure!(args.max_tokens >= 1, "--max-tokens must be at least 1");
    let turn_tokens = turn_range(&args.turn_tokens)?;
    let loaded = load(&args.model)?;
    anyhow::ensure!(loaded.draft.is_none(), "this lab runs without a draft model (--spec draft is for serve, run, chat and lab spec --draft)");
    let cfg = &loaded.model.config;
    let kv = args.model.kv_choice(cfg, args.kv.block_size, false)?;
    let engine = args.kv.engine_config(&loaded.model, None, &kv, cfg.context_length, 16, 16, true)?;
    let spec = PrefixSpec { turns: args.turns, sessions: args.sessions, prefix_tokens: args.prefix_tokens, turn_tokens, max_tokens: args.max_tokens, passes: args.passes, timestamp: args.timestamp, engine };
    let out = args.out.clone().unwrap_or_else(|| {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        PathBuf::from(format!("bench/out/prefix-{secs}"))
    });
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let command: Vec<String> = std::env::args().collect();
    std::fs::write(out.join("command.txt"), format!("{}\n{}", command.join(" "), super::common::stamp()))?;
    let mut raw = std::fs::File::create(out.join("records.jsonl"))?;
    let (model, tokenizer) = (Arc::new(loaded.model), Arc::new(loaded.tokenizer));
    let records = prefix::run(&model, &tokenizer, &loaded.template, &spec, |r| {
        let _ = writeln!(raw, "{}", serde_json::to_string(r).unwrap_or_default());
        eprintln!(
            "pass {} cache {:>3} turn {:>2} session {}: {:>5} prompt tokens, {:>5} cached, TTFT {:>7.1} ms",
            r.pass + 1,
            if r.prefix_cache { "on" } else { "off" },
            r.turn + 1,
            r.session + 1,
            r.prompt_tokens,
            r.cached_tokens,
            r.ttft_ms
        );
    })?;
    let rows = report::rows(&records);
    let findings = report::findings(&records, &rows, args.kv.block_size);
    let table = report::markdown(&rows, &findings, args.kv.block_size);
    let name = args.model.model.rsplit('/').next().unwrap_or(&args.model.model).to_string();
    let title = format!("{name}: {} turns x {} session(s), {}-token system prompt{}", args.turns, args.sessions, args.prefix_tokens, if args.timestamp { ", timestamp first" } else { "" });
    std::fs::write(out.join("table.md"), format!("{title}\n\n{table}"))?;
    report::plot(&rows, &title, &out.join("ttft.svg"))?;
    println!("{title}\n\n{table}\nraw records, table and plot: {}", out.display());
    Ok(())
}

pub(crate) fn list<T>(spec: &str, flag: &str, parse: impl Fn(&str) -> Result<T>) -> Result<Vec<T>> {
    let v: Vec<T> = spec.split(',').filter(|s| !s.trim().is_empty()).map(|s| parse(s.trim())).collect::<Result<_>>()?;
    anyhow::ensure!(!v.is_empty(), "{flag}: empty list");
    Ok(v)
}

pub(crate) fn out_dir(out: &Option<PathBuf>, leg: &str) -> Result<PathBuf> {
    let out = out.clone().unwrap_or_else(|| {
        let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        PathBuf::from(format!("bench/out/{leg}-{secs}"))
    });
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let command: Vec<String> = std::env::args().collect();
    std::fs::write(out.join("command.txt"), format!("{}\n{}", command.join(" "), super::common::stamp()))?;
    Ok(out)
}

fn run_kv_quant(args: KvQuantArgs, tax: bool) -> Result<()> {
    use reckon_engine::kv::KvDtypes;
    use reckon_lab::kv;
    anyhow::ensure!(args.passes >= 1, "--passes must be at least 1");
    let loaded = load(&args.model)?;
    anyhow::ensure!(loaded.draft.is_none(), "this lab runs without a draft model (--spec draft is for serve, run, chat and lab spec --draft)");
    let cfg = loaded.model.config.clone();
    let dtypes = list(&args.arms, "--arms", |s| {
        let d = KvDtypes::parse(&s.replace('/', ",")).map_err(|e| anyhow::anyhow!("--arms: {e}"))?;
        d.check_shape(cfg.head_dim, 16).map_err(|e| anyhow::anyhow!("--arms: {e}"))?;
        Ok(d)
    })?;
    let room = args.n_prompt.max(args.n_gen) + 64;
    let default_depths = if tax {
        let mut d: Vec<usize> = [0, 1024, 2048, 4096, 8192].into_iter().filter(|&d| d + room < cfg.context_length).collect();
        let last = (cfg.context_length - room) / 1024 * 1024;
        if last > *d.last().unwrap_or(&0) && last <= 16384 {
            d.push(last);
        }
        d.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",")
    } else {
        "0,1024,2048,4096".to_string()
    };
    let depths = list(args.depths.as_deref().unwrap_or(&default_depths), "--depths", |s| {
        let d: usize = s.parse().with_context(|| format!("--depths: '{s}' is not a number"))?;
        anyhow::ensure!(d % 16 == 0 && d + args.n_prompt.max(args.n_gen) < cfg.context_length, "--depths: {d} must be a multiple of 16 that leaves room in the model's {}-token context", cfg.context_length);
        Ok(d)
    })?;
    let out = if args.serve_passes { PathBuf::new() } else { out_dir(&args.out, if tax { "kv-tax" } else { "kv-quant" })? };
    let quality_tokens = args.quality_tokens.unwrap_or(if tax { 0 } else { 4096 });
    let model = Arc::new(loaded.model);
    let tokenizer = Arc::new(loaded.tokenizer);
    let spec = kv::KvQuantSpec { dtypes: dtypes.clone(), depths: depths.clone(), passes: args.passes, n_gen: args.n_gen, n_prompt: args.n_prompt, chunk: 512 };
    if args.serve_passes {
        return serve_passes(&model, &spec);
    }
    let mut raw = std::fs::File::create(out.join("records.jsonl"))?;
    let threads = reckon_engine::pool::current().threads();
    let mut others = Vec::new();
    if let Some(python) = &args.llamacpp {
        others.push(PassProcess::llamacpp(python, &super::common::model_path(&args.model.model)?, &depths, args.n_gen, args.n_prompt, threads)?);
    }
    if let Some(level) = args.second_simd {
        others.push(PassProcess::reckon_at(level, &args, &depths, threads)?);
    }
    let mut external = |pass: usize| -> std::result::Result<Vec<kv::SpeedRecord>, reckon_lab::LabError> {
        let mut out = Vec::new();
        for p in others.iter_mut() {
            out.extend(p.pass(pass).map_err(|e| reckon_lab::LabError::Request(format!("{}: {e:#}", p.prefix.trim_end())))?);
        }
        Ok(out)
    };
    let ext: Option<kv::ExternalPass> = if args.llamacpp.is_some() || args.second_simd.is_some() { Some(&mut external) } else { None };
    let records = kv::speed_with(&model, &spec, |r| {
        let _ = writeln!(raw, "{}", serde_json::to_string(r).unwrap_or_default());
        eprintln!("pass {} {:>9} {} @ d{:<5}: {:8.1} tok/s{}", r.pass + 1, r.kv_dtype, r.test, r.depth, r.tokens_per_s, if r.drift_check { " (drift check)" } else { "" });
    }, ext)?;
    let mut quality = Vec::new();
    let bandwidth = (tax || args.bandwidth).then(|| {
        eprintln!("measuring the read bandwidth");
        reckon_lab::bandwidth::measure(reckon_engine::pool::current().threads())
    });
    if let Some(bw) = &bandwidth {
        std::fs::write(out.join("bandwidth.json"), serde_json::to_string(bw)?)?;
    }
    if quality_tokens > 0 {
        let text = std::fs::read_to_string(&args.text).with_context(|| format!("--text {}", args.text.display()))?;
        let mut tokens = tokenizer.encode(&text, true, false)?;
        tokens.truncate(quality_tokens.min(cfg.context_length));
        eprintln!("teacher forcing {} tokens of {} through {} arms", tokens.len(), args.text.display(), dtypes.len());
        quality = kv::quality(&model, &tokens, 512, &dtypes);
        let mut f = std::fs::File::create(out.join("quality.jsonl"))?;
        for q in &quality {
            writeln!(f, "{}", serde_json::to_string(q)?)?;
        }
    }
    let needle_tokens = args.needle_tokens.unwrap_or(if tax { 0 } else { 2048 });
    let mut recall = Vec::new();
    if needle_tokens > 0 {
        anyhow::ensure!(needle_tokens + 300 < cfg.context_length, "--needle-tokens {needle_tokens} leaves no room in the model's {}-token context", cfg.context_length);
        let mut f = std::fs::File::create(out.join("recall.jsonl"))?;
        for &d in &dtypes {
            let spec = reckon_lab::eviction::EvictionSpec { lengths: vec![needle_tokens], windows: Vec::new(), sinks: 0, needles: 5, seed: 1, max_tokens: 12, kv_dtypes: d, sparse: None };
            eprintln!("needle recall, {} KV, {needle_tokens} tokens", d.name());
            recall.extend(reckon_lab::eviction::recall(&model, &tokenizer, &loaded.template, &spec, |r| {
                let _ = writeln!(f, "{}", serde_json::to_string(r).unwrap_or_default());
            })?);
        }
    }
    let mut arms: Vec<String> = dtypes.iter().map(|d| d.name()).collect();
    for r in records.iter().filter(|r| !kv::implementation(&r.kv_dtype).is_empty()) {
        if !arms.contains(&r.kv_dtype) {
            arms.push(r.kv_dtype.clone());
        }
    }
    let rows = kv::speed_rows(&records, &arms, &depths);
    let mut csv = String::from("kv_dtype,depth,test,tokens_per_s_median,min,max,ratio_median,ratio_min,ratio_max\n");
    for r in &rows {
        let (t, q) = (&r.tokens_per_s, &r.ratio);
        csv += &format!("{},{},{},{:.2},{:.2},{:.2},{:.4},{:.4},{:.4}\n", r.kv_dtype, r.depth, r.test, t.median, t.min, t.max, q.median, q.min, q.max);
    }
    std::fs::write(out.join("speed.csv"), csv)?;
    let name = args.model.model.rsplit('/').next().unwrap_or(&args.model.model).to_string();
    let title = format!("{name}: KV dtypes, {} passes, {} threads, kernels {}", args.passes, reckon_engine::pool::current().threads(), reckon_engine::kernels::cpu::simd_level().name());
    let mut table = kv::markdown(&model, &rows, &quality, kv::drift(&records), args.price_per_hour, bandwidth.as_ref());
    let versus = kv::best_over_external(&rows);
    if !versus.is_empty() {
        table += "\nreckon's fastest arm over llama.cpp's fastest (medians, same passes):\n\n| test | depth | reckon | llama.cpp | reckon / llama.cpp |\n|---|---|---|---|---|\n";
        for (test, depth, ours, theirs, x) in versus {
            table += &format!("| {test} | {depth} | {ours} | {} | {x:.2}x |\n", theirs.trim_start_matches(kv::LLAMACPP));
        }
    }
    if let Some(first) = recall.first() {
        table += &format!("\nNeedle recall at {} prompt tokens (5 facts in a seeded haystack, greedy; `reckon lab eviction`):\n\n| KV | recalled |\n|---|---|\n", first.prompt_tokens);
        for d in &dtypes {
            let n = recall.iter().filter(|r| r.kv_dtype == d.name() && r.correct).count();
            table += &format!("| {} | {n}/5 |\n", d.name());
        }
    }
    std::fs::write(out.join("table.md"), format!("{title}\n\n{table}"))?;
    kv::plot(&rows, &title, &out.join("speed.svg"))?;
    println!("{title}\n\n{table}\nraw records, table and plot: {}", out.display());
    Ok(())
}

/// `kv-quant --serve-passes`: `ready` once the caches are filled, then one speed pass per `pass N` line on
/// stdin, its records as one JSON line on stdout (`{"records": [...]}`), until stdin closes.
fn serve_passes(model: &Arc<reckon_engine::model::Model>, spec: &reckon_lab::kv::KvQuantSpec) -> Result<()> {
    use std::io::BufRead;
    let mut runner = reckon_lab::kv::SpeedRunner::new(model, spec)?;
    let stdout = std::io::stdout();
    // caches filled: the caller starts its passes now (it waits for this line, so the warm-up never
    // overlaps its measurements)
    writeln!(stdout.lock(), "ready")?;
    stdout.lock().flush()?;
    for line in std::io::stdin().lock().lines() {
        let line = line?;
        let pass: usize = line.strip_prefix("pass ").and_then(|n| n.trim().parse().ok()).with_context(|| format!("--serve-passes: '{line}' is not `pass N`"))?;
        let records = runner.pass(pass, |_| {})?;
        let mut out = stdout.lock();
        writeln!(out, "{}", serde_json::json!({ "records": records }))?;
        out.flush()?;
    }
    Ok(())
}

/// A second process measuring its arms inside the same passes: it says `ready` once loaded and warmed up,
/// then one line `pass N` in, one JSON line of that pass's records out. bench/kv-quant-llamacpp in its `--serve` mode (the model loaded once per
/// llama.cpp configuration), or this binary at another SIMD level (`kv-quant --serve-passes`).
struct PassProcess {
    /// What its arms' names start with (`"llama.cpp "`, `"avx2 "`).
    prefix: String,
    child: std::process::Child,
    input: std::process::ChildStdin,
    output: std::io::BufReader<std::process::ChildStdout>,
}

impl PassProcess {
    fn llamacpp(python: &std::path::Path, model: &std::path::Path, depths: &[usize], n_gen: usize, n_prompt: usize, threads: usize) -> Result<PassProcess> {
        let script = std::path::Path::new("bench/kv-quant-llamacpp");
        anyhow::ensure!(script.exists(), "--llamacpp: run from the repository root (bench/kv-quant-llamacpp not found)");
        anyhow::ensure!(python.exists(), "--llamacpp: {} not found (bench/setup-llamacpp makes the venv)", python.display());
        let depths = depths.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
        let mut cmd = std::process::Command::new(python);
        cmd.arg(script).arg("--serve").arg("-m").arg(model).args(["--depths", &depths, "-n", &n_gen.to_string(), "-p", &n_prompt.to_string(), "-t", &threads.to_string()]);
        Self::start(reckon_lab::kv::LLAMACPP, cmd)
    }

    /// This binary's `kv-quant` with the same model, arms, depths and sizes at SIMD level `level`.
    fn reckon_at(level: super::common::SimdArg, args: &KvQuantArgs, depths: &[usize], threads: usize) -> Result<PassProcess> {
        use clap::ValueEnum;
        let level = level.to_possible_value().context("a SIMD level")?.get_name().to_string();
        let depths = depths.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(",");
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.args(["lab", "kv-quant", "--serve-passes", "-m", &args.model.model, "--arms", &args.arms, "--depths", &depths, "-n", &args.n_gen.to_string(), "-p", &args.n_prompt.to_string()]);
        cmd.args(["-t", &threads.to_string(), "--simd", &level, "--kv-dtype", &args.model.kv_dtype]);
        if let Some(n) = args.model.numerics {
            cmd.args(["--numerics", n.to_possible_value().context("numerics")?.get_name()]);
        }
        if args.model.no_huge_pages {
            cmd.arg("--no-huge-pages");
        }
        Self::start(&format!("{level} "), cmd)
    }

    fn start(prefix: &str, mut cmd: std::process::Command) -> Result<PassProcess> {
        use std::process::Stdio;
        let mut child = cmd.stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().with_context(|| format!("starting {cmd:?}"))?;
        let (input, mut output) = (child.stdin.take().context("stdin")?, std::io::BufReader::new(child.stdout.take().context("stdout")?));
        // it loads and warms up first, alone: nothing is measured meanwhile
        let mut line = String::new();
        std::io::BufRead::read_line(&mut output, &mut line)?;
        anyhow::ensure!(line.trim() == "ready", "{cmd:?} did not start (said {line:?})");
        Ok(PassProcess { prefix: prefix.to_string(), child, input, output })
    }

    fn pass(&mut self, pass: usize) -> Result<Vec<reckon_lab::kv::SpeedRecord>> {
        use std::io::BufRead;
        writeln!(self.input, "pass {pass}")?;
        self.input.flush()?;
        let mut line = String::new();
        anyhow::ensure!(self.output.read_line(&mut line)? > 0, "the process ended early");
        let v: serde_json::Value = serde_json::from_str(&line).context("its reply")?;
        let records = v["records"].as_array().context("no records")?;
        records
            .iter()
            .map(|r| {
                let test = match r["test"].as_str() {
                    Some("tg") => "tg",
                    Some("pp") => "pp",
                    t => anyhow::bail!("unknown test {t:?}"),
                };
                Ok(reckon_lab::kv::SpeedRecord {
                    pass,
                    kv_dtype: format!("{}{}", self.prefix, r["kv"].as_str().or(r["kv_dtype"].as_str()).context("kv")?),
                    depth: r["depth"].as_u64().context("depth")? as usize,
                    test,
                    tokens: r["tokens"].as_u64().context("tokens")? as usize,
                    tokens_per_s: r["tokens_per_s"].as_f64().context("tokens_per_s")?,
                    drift_check: false,
                })
            })
            .collect()
    }
}

impl Drop for PassProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

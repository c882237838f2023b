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
    }
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
    let cfg = &loaded.model.config;
    let kv_dtypes = args.model.kv_dtypes(cfg, args.kv.block_size)?;
    let engine = args.kv.engine_config(cfg, kv_dtypes, cfg.context_length, 16, 16, true)?;
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

//! `reckon`: the command line. Library crates use thiserror; anyhow lives here only.

mod cmd;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "reckon", version = concat!(env!("CARGO_PKG_VERSION"), " (", env!("RECKON_COMMIT"), ")"), about = "An LLM inference engine that measures what every optimization costs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a reply to one prompt (chat template applied unless --raw), streamed to stdout.
    Run(cmd::run::RunArgs),
    /// Interactive multi-turn chat, streaming.
    Chat(cmd::chat::ChatArgs),
    /// Show a model file: path, architecture, context length, tensors by type, sizes, memory estimate.
    Info(cmd::info::InfoArgs),
    /// Measure prefill and decode throughput, llama-bench style.
    Bench(cmd::bench::BenchArgs),
    /// Serve the model over an OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions,
    /// /v1/models, /health, /metrics.
    Serve(cmd::serve::ServeArgs),
    /// Experiments: what an optimization buys on this machine (`reckon lab prefix`).
    Lab(cmd::lab::LabArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn,reckon_server=info".into()),
        )
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(a) => cmd::run::run(a),
        Command::Chat(a) => cmd::chat::run(a),
        Command::Info(a) => cmd::info::run(a),
        Command::Bench(a) => cmd::bench::run(a),
        Command::Serve(a) => cmd::serve::run(a),
        Command::Lab(a) => cmd::lab::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

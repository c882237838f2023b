//! `reckon bench`: prefill and decode tokens/s, llama-bench style (medians over repetitions).

use super::common::{model_path, ModelArgs};
use anyhow::Result;
use clap::Args;
use reckon_lab::bench::{run as run_bench, BenchSpec};

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens for the prefill test (0 skips it).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    pub n_prompt: usize,
    /// Generated tokens for the decode test (0 skips it).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    pub n_gen: usize,
    /// Tokens already in the KV cache before each test.
    #[arg(short = 'd', long = "n-depth", default_value_t = 0)]
    pub n_depth: usize,
    /// Timed repetitions (after one warm-up).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub reps: usize,
    /// Tokens per prefill step.
    #[arg(short = 'b', long = "batch", default_value_t = 512)]
    pub chunk: usize,
    /// After the tests, measure the memory read bandwidth and show each decode's ceiling (bandwidth ÷
    /// bytes read per token) and the fraction of it reached; and the same over a working set of one
    /// token's bytes, read again and again (the cache's bandwidth where the cache holds them).
    #[arg(long)]
    pub bandwidth: bool,
    /// One JSON object per line per test.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: BenchArgs) -> Result<()> {
    let threads = args.model.init_process()?;
    let path = model_path(&args.model.model)?;
    let model = std::sync::Arc::new(args.model.load_model(&path)?);
    let kv_dtypes = args.model.kv_dtypes(&model.config, reckon_lab::bench::BLOCK_SIZE)?;
    let spec = BenchSpec { n_prompt: args.n_prompt, n_gen: args.n_gen, n_depth: args.n_depth, reps: args.reps, threads, chunk: args.chunk, kv_dtypes, bandwidth: args.bandwidth, kv_window: args.model.kv_window()?, sparse_attention: args.model.sparse_attention()?, speculation: args.model.spec()? };
    anyhow::ensure!(args.model.draft_model_name()?.is_none(), "reckon bench measures one model: a draft model is measured by `reckon lab spec --draft MODEL`");
    let name = path.file_name().map(|f| f.to_string_lossy().to_string()).unwrap_or_default();
    let results = run_bench(model, &name, &spec)?;
    if let Some(bw) = results.iter().find_map(|r| r.read_gb_s) {
        eprintln!("read bandwidth ({threads} threads, after the tests): {bw:.1} GB/s");
    }
    if args.json {
        for r in &results {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(());
    }
    let (head, rule) = if args.bandwidth { (" MB/token | bound t/s | of bound | footprint GB/s | footprint bound t/s | of it |", "---|---|---|---|---|---|") } else { ("", "") };
    println!("| model | numerics | KV | threads | test | t/s median | min | max |{head}");
    println!("|---|---|---|---|---|---|---|---|{rule}");
    for r in &results {
        let bound = match (r.bytes_per_token, r.bound_tokens_per_s, r.fraction_of_bound, r.footprint_read_gb_s, r.footprint_bound_tokens_per_s, r.fraction_of_footprint_bound) {
            (Some(b), Some(t), Some(f), Some(fg), Some(ft), Some(ff)) => format!(" {:.1} | {t:.1} | {:.0}% | {fg:.1} | {ft:.1} | {:.0}% |", b as f64 / 1e6, 100.0 * f, 100.0 * ff),
            _ if args.bandwidth => " | | | | | |".to_string(),
            _ => String::new(),
        };
        println!("| {} | {} | {} | {} | {} | {:.2} | {:.2} | {:.2} |{bound}", r.model, r.numerics, r.kv_dtype, r.threads, r.test_name(), r.tokens_per_s_median, r.tokens_per_s_min, r.tokens_per_s_max);
    }
    Ok(())
}

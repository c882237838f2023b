//! `reckon run`: one prompt in, the generated text streamed to stdout (logs and stats on stderr). It
//! drives the same engine as `reckon serve`, with one request.

use super::common::{load, KvChoice, Loaded, ModelArgs, SamplingArgs};
use anyhow::{Context, Result};
use clap::Args;
use reckon_engine::engine::{spawn_with_models, EngineConfig, EngineHandle, Event, FinishReason, GenerateParams};
use reckon_engine::template::ChatMessage;
use std::io::{Read, Write};
use std::sync::Arc;
use std::time::Instant;

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Raw completion: no chat template; BOS as the GGUF says; only the generated text on stdout.
    #[arg(long)]
    pub raw: bool,
    /// A system message (chat mode only).
    #[arg(long, conflicts_with = "raw")]
    pub system: Option<String>,
    /// Maximum tokens to generate.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 512)]
    pub max_tokens: usize,
    /// Context size in tokens (default: the model's, capped at 8192).
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    /// Print timings to stderr.
    #[arg(long)]
    pub stats: bool,
    /// The prompt; "-" reads it from stdin.
    pub prompt: String,
}

pub fn context_size(loaded: &Loaded, requested: Option<usize>) -> usize {
    requested.unwrap_or(loaded.model.config.context_length.min(8192))
}

/// An engine for one conversation: a KV cache as large as the context (plus a block), prefix caching
/// on so a conversation's next turn reuses the last one's blocks.
pub const BLOCK_SIZE: usize = 16;

pub fn start_engine(loaded: Loaded, ctx: usize, kv: &KvChoice) -> Result<(EngineHandle, Arc<reckon_engine::tokenizer::Tokenizer>, reckon_engine::template::ChatTemplate)> {
    let mut config = EngineConfig { block_size: BLOCK_SIZE, max_running: 1, max_waiting: 1, max_model_len: ctx, kv_dtypes: kv.dtypes, kv_window: kv.window, sparse_attention: kv.sparse, hybrid_kv: kv.hybrid, spec: kv.spec.clone(), spec_prefill: kv.spec_prefill, ..EngineConfig::default() };
    // the most one sequence of the whole context holds, and a block per layer group to spare
    let layout = config.kv_layout(&loaded.model, false);
    config.num_blocks = layout.max_blocks_held(ctx, BLOCK_SIZE, config.max_batch_tokens) + layout.num_groups();
    let tokenizer = Arc::new(loaded.tokenizer);
    let engine = spawn_with_models(Arc::new(loaded.model), loaded.draft.map(Arc::new), loaded.scorer.map(Arc::new), tokenizer.clone(), config, None).context("starting the engine")?;
    Ok((engine, tokenizer, loaded.template))
}

pub fn run(mut args: RunArgs) -> Result<()> {
    // speculation where it pays, by default (docs/speculative.md): the same tokens, greedy or seeded
    args.model.default_spec = super::common::SpecArg::Auto;
    let prompt_text = if args.prompt == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("reading the prompt from stdin")?;
        s
    } else {
        args.prompt.clone()
    };
    let loaded = load(&args.model)?;
    let sampling = args.sampling.params(&loaded.sampling.params);
    let ctx = context_size(&loaded, args.ctx_size);
    let text = if args.raw {
        prompt_text
    } else {
        let mut msgs = Vec::new();
        if let Some(sys) = &args.system {
            msgs.push(ChatMessage::new("system", sys));
        }
        msgs.push(ChatMessage::new("user", &prompt_text));
        loaded.template.render(&msgs, true)?
    };
    let prompt = loaded.tokenizer.encode(&text, true, true)?;
    let kv = args.model.kv_choice(&loaded.model.config, BLOCK_SIZE, false)?;
    let (engine, _, _) = start_engine(loaded, ctx, &kv)?;
    let params = GenerateParams { sampling, ..GenerateParams::greedy(prompt, args.max_tokens) };
    let stats = stream(&engine, params)?;
    if !args.raw {
        println!();
    }
    if args.stats {
        eprintln!("{stats}");
    }
    Ok(())
}

pub struct GenStats {
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub generated: usize,
    /// The generated text.
    pub text: String,
    pub first_token_s: f64,
    pub total_s: f64,
    pub finish: Option<FinishReason>,
}

impl std::fmt::Display for GenStats {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let decode_s = (self.total_s - self.first_token_s).max(1e-9);
        write!(
            f,
            "prompt: {} tokens ({} cached), first token after {:.3} s | generated: {} tokens, {:.1} tok/s | finish: {}",
            self.prompt_tokens,
            self.cached_tokens,
            self.first_token_s,
            self.generated,
            self.generated.saturating_sub(1) as f64 / decode_s,
            self.finish.map_or("stopped reading".to_string(), |r| format!("{r:?}"))
        )
    }
}

/// Submits a request and prints its text to stdout as it is generated. A closed stdout (`| head`) ends
/// the request early.
pub fn stream(engine: &EngineHandle, params: GenerateParams) -> Result<GenStats> {
    let prompt_tokens = params.prompt.len();
    let start = Instant::now();
    let (id, mut events) = engine.submit(params).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut out = std::io::stdout().lock();
    let mut stats = GenStats { prompt_tokens, cached_tokens: 0, generated: 0, text: String::new(), first_token_s: 0.0, total_s: 0.0, finish: None };
    while let Some(event) = events.blocking_recv() {
        match event {
            Event::Token { text, .. } => {
                if stats.generated == 0 {
                    stats.first_token_s = start.elapsed().as_secs_f64();
                }
                stats.generated += 1;
                stats.text.push_str(&text);
                if let Err(e) = out.write_all(text.as_bytes()).and_then(|_| out.flush()) {
                    engine.abort(id);
                    // a closed pipe is a normal way to stop reading
                    if e.kind() != std::io::ErrorKind::BrokenPipe {
                        return Err(e.into());
                    }
                }
            }
            Event::Finished { reason, usage, .. } => {
                stats.finish = Some(reason);
                stats.cached_tokens = usage.cached_tokens;
                break;
            }
            Event::Error(e) => anyhow::bail!("generation failed: {e}"),
        }
    }
    stats.total_s = start.elapsed().as_secs_f64();
    Ok(stats)
}

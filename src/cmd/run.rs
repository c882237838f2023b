//! `reckon run`: one prompt in, the generated text streamed to stdout (logs and stats on stderr).

use super::common::{init_threads, load, Loaded, ModelArgs, SamplingArgs};
use anyhow::{Context, Result};
use clap::Args;
use reckon_engine::sampler::Sampler;
use reckon_engine::session::{FinishReason, Session};
use reckon_engine::template::ChatMessage;
use reckon_engine::tokenizer::IncrementalDecoder;
use std::io::{Read, Write};
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

pub fn run(args: RunArgs) -> Result<()> {
    init_threads(args.model.threads)?;
    let params = args.sampling.params()?;
    let prompt_text = if args.prompt == "-" {
        let mut s = String::new();
        std::io::stdin().read_to_string(&mut s).context("reading the prompt from stdin")?;
        s
    } else {
        args.prompt.clone()
    };
    let loaded = load(&args.model)?;
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
    let ctx = context_size(&loaded, args.ctx_size);
    anyhow::ensure!(
        prompt.len() < ctx,
        "the prompt is {} tokens, which does not fit the context of {ctx} tokens (raise --ctx-size)",
        prompt.len()
    );
    let mut session = Session::new(&loaded.model, ctx);
    let mut sampler = Sampler::new(params);
    let stats = stream(&loaded, &mut session, &prompt, args.max_tokens, &mut sampler)?;
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
    pub generated: usize,
    /// The generated token ids (end-of-generation token excluded).
    pub tokens: Vec<u32>,
    pub first_token_s: f64,
    pub total_s: f64,
    pub finish: FinishReason,
}

impl std::fmt::Display for GenStats {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        let decode_s = (self.total_s - self.first_token_s).max(1e-9);
        write!(
            f,
            "prompt: {} tokens, first token after {:.3} s | generated: {} tokens, {:.1} tok/s | finish: {:?}",
            self.prompt_tokens,
            self.first_token_s,
            self.generated,
            self.generated.saturating_sub(1) as f64 / decode_s,
            self.finish
        )
    }
}

/// Generates and prints text to stdout as it is decoded.
pub fn stream(loaded: &Loaded, session: &mut Session, prompt: &[u32], max_tokens: usize, sampler: &mut Sampler) -> Result<GenStats> {
    let mut decoder = IncrementalDecoder::new(&loaded.tokenizer, false);
    let mut out = std::io::stdout().lock();
    let start = Instant::now();
    let mut first = None;
    let mut tokens = Vec::new();
    let mut write_err = None;
    let finish = session.generate(prompt, max_tokens, sampler, loaded.tokenizer.eog_ids(), |tok| {
        first.get_or_insert_with(|| start.elapsed().as_secs_f64());
        tokens.push(tok);
        let piece = decoder.push(tok);
        if let Err(e) = out.write_all(piece.as_bytes()).and_then(|_| out.flush()) {
            write_err = Some(e);
            return false;
        }
        true
    })?;
    if let Some(e) = write_err {
        // A closed pipe (`| head`) is a normal way to stop reading.
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            return Err(e.into());
        }
    }
    let _ = out.write_all(decoder.finish().as_bytes()).and_then(|_| out.flush());
    Ok(GenStats {
        prompt_tokens: prompt.len(),
        generated: tokens.len(),
        tokens,
        first_token_s: first.unwrap_or(0.0),
        total_s: start.elapsed().as_secs_f64(),
        finish,
    })
}

//! `reckon chat`: an interactive conversation. Each turn renders the whole conversation with the chat
//! template and submits it to the engine, whose prefix cache holds the earlier turns' blocks, so only the
//! new turn is prefilled.

use super::common::{load, ModelArgs, SamplingArgs};
use super::run::{context_size, start_engine, stream};
use anyhow::Result;
use clap::Args;
use reckon_engine::engine::GenerateParams;
use reckon_engine::template::ChatMessage;
use std::io::{BufRead, Write};

#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// A system message for the whole conversation.
    #[arg(long)]
    pub system: Option<String>,
    /// Maximum tokens per reply.
    #[arg(short = 'n', long = "max-tokens", default_value_t = 1024)]
    pub max_tokens: usize,
    #[arg(short = 'c', long = "ctx-size")]
    pub ctx_size: Option<usize>,
    /// Print timings to stderr after each reply.
    #[arg(long)]
    pub stats: bool,
}

pub fn run(mut args: ChatArgs) -> Result<()> {
    // speculation where it pays, by default (docs/speculative.md): the same tokens, greedy or seeded
    args.model.default_spec = super::common::SpecArg::Auto;
    let loaded = load(&args.model)?;
    let mut sampling = args.sampling.params(&loaded.sampling.params);
    let ctx = context_size(&loaded, args.ctx_size);
    let kv = args.model.kv_choice(&loaded.model.config, super::run::BLOCK_SIZE, false)?;
    let (engine, tokenizer, template) = start_engine(loaded, ctx, &kv)?;
    let mut messages: Vec<ChatMessage> = args.system.iter().map(|s| ChatMessage::new("system", s)).collect();
    eprintln!("reckon chat: {} ({} tokens of context). Empty line or Ctrl-D quits; /reset starts over.", args.model.model, ctx);
    let stdin = std::io::stdin();
    loop {
        eprint!("> ");
        std::io::stderr().flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 || line.trim().is_empty() {
            return Ok(());
        }
        if line.trim() == "/reset" {
            messages.retain(|m| m.role == "system");
            continue;
        }
        messages.push(ChatMessage::new("user", line.trim_end_matches(['\n', '\r'])));
        let prompt = tokenizer.encode(&template.render(&messages, true)?, true, true)?;
        if prompt.len() + 1 >= ctx {
            eprintln!("error: the conversation ({} tokens) no longer fits the context of {ctx}; /reset to start over", prompt.len());
            messages.pop();
            continue;
        }
        let params = GenerateParams { sampling: sampling.clone(), ..GenerateParams::greedy(prompt, args.max_tokens) };
        // each reply draws fresh random numbers (the same seed every turn would repeat choices)
        sampling.seed = sampling.seed.wrapping_add(1);
        let stats = stream(&engine, params)?;
        println!();
        messages.push(ChatMessage::new("assistant", &stats.text));
        if args.stats {
            eprintln!("{stats}");
        }
    }
}

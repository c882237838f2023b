//! `reckon info`: what a model file holds and what it will cost in memory.

use super::common::{describe_sampling, model_path};
use anyhow::{Context, Result};
use clap::Args;
use reckon_engine::gguf::GgufFile;
use reckon_engine::model::ModelConfig;
use reckon_engine::kv::{KvDtype, KvDtypes, KvLayout};
use serde_json::json;
use std::collections::BTreeMap;

#[derive(Args)]
pub struct InfoArgs {
    /// A GGUF file path or a fetched model's short name.
    pub model: String,
    /// One JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Also list every metadata key.
    #[arg(long)]
    pub metadata: bool,
}

pub fn run(args: InfoArgs) -> Result<()> {
    let path = model_path(&args.model)?;
    let file = GgufFile::open(&path).with_context(|| format!("reading {}", path.display()))?;
    let cfg = ModelConfig::from_gguf(&file)?;
    let mut by_type: BTreeMap<&str, (usize, u64, u64)> = BTreeMap::new();
    for t in &file.header().tensors {
        let e = by_type.entry(t.dtype.name()).or_default();
        e.0 += 1;
        e.1 += t.num_bytes;
        e.2 += t.num_elements();
    }
    let params: u64 = by_type.values().map(|v| v.2).sum();
    let weight_bytes: u64 = by_type.values().map(|v| v.1).sum();
    // A mixture of experts runs n_used of n_expert experts a token: the rest of the expert tensors is
    // neither computed nor read by a decode step.
    let inactive = |t: &reckon_engine::gguf::TensorInfo, x: u64| match cfg.moe {
        Some(m) if t.name.contains("_exps.") => x / m.n_expert as u64 * (m.n_expert - m.n_used) as u64,
        _ => 0,
    };
    let active_params = params - file.header().tensors.iter().map(|t| inactive(t, t.num_elements())).sum::<u64>();
    let active_weight_bytes = weight_bytes - file.header().tensors.iter().map(|t| inactive(t, t.num_bytes)).sum::<u64>();
    // f16 keys and values of every layer.
    let kv_bytes_per_token = cfg.kv_f16_bytes_per_token() as u64;
    // Per kind of layer, f16, and what an 8,192-token sequence holds with every layer's blocks in one
    // table and with sliding layers in groups of their own (`kv::layout`; 16-token blocks, 512-token
    // chunks, the server's defaults), and how many such sequences 1 GiB holds at once.
    let (bs, chunk, depth, budget) = (16, 512, 8192, 1usize << 30);
    let cell = KvDtypes::F16.bytes_per_token(1, cfg.kv_dim());
    let hybrid = if cfg.short_conv.is_some() { KvLayout::attention_only(&(0..cfg.n_layers).map(|il| cfg.has_kv(il)).collect::<Vec<_>>()) } else { KvLayout::hybrid(&(0..cfg.n_layers).map(|il| cfg.layer_window(il)).collect::<Vec<_>>()) };
    let per_seq = |l: &KvLayout| l.max_blocks_held(depth, bs, chunk) * l.page_bytes(cell, bs);
    let fits = |l: &KvLayout| budget / l.page_bytes(cell, bs) / l.max_blocks_held(depth, bs, chunk);
    let uniform = if cfg.short_conv.is_some() { hybrid.clone() } else { KvLayout::uniform(cfg.n_layers) };
    let layouts: Vec<(&str, &KvLayout)> = if hybrid.is_hybrid() { vec![("one_group", &uniform), ("hybrid", &hybrid)] } else { vec![("one_group", &uniform)] };
    let kinds = hybrid.memory_by_kind(cell, bs, chunk);
    let name = file.get("general.name").and_then(|v| v.as_str()).unwrap_or("").to_string();
    let sampling = reckon_engine::sampler::SamplingParams::from_gguf(&file);
    let sp = &sampling.params;
    let report = json!({
        "path": path.canonicalize().unwrap_or(path.clone()),
        "name": name,
        "architecture": cfg.arch.name(),
        "gguf_version": file.header().version,
        "file_bytes": file.file_size(),
        "parameters": params,
        "active_parameters": active_params,
        "experts": cfg.moe.map(|m| json!({"count": m.n_expert, "used_per_token": m.n_used, "feed_forward_length": m.ffn_dim})),
        // a hybrid model's recurrent state: f32, per sequence, whatever its length
        "recurrent_state": cfg.short_conv.as_ref().map(|sc| json!({"kind": "short_convolution", "layers": sc.is_conv.iter().filter(|&&c| c).count(), "l_cache": sc.l_cache, "bytes_per_sequence": sc.state_len(cfg.d_model) * 4})),
        "context_length": cfg.context_length,
        "layers": cfg.n_layers,
        "embedding_length": cfg.d_model,
        "heads": cfg.n_heads,
        "kv_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "feed_forward_length": cfg.ffn_dim,
        "vocab_size": cfg.vocab_size,
        "rope_base": cfg.rope_base,
        "sliding_window": cfg.sliding_window,
        // what `run`, `chat` and requests to `serve` sample with unless told otherwise
        "sampling_defaults": {
            "temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p, "min_p": sp.min_p,
            "repeat_penalty": sp.repetition_penalty, "penalty_last_n": sp.penalty_last_n,
            "from_model_file": sampling.declared, "skipped": sampling.skipped,
        },
        "tensors_by_type": by_type.iter().map(|(k, v)| (k.to_string(), json!({"count": v.0, "bytes": v.1, "elements": v.2}))).collect::<BTreeMap<_, _>>(),
        "memory": {
            "weights_bytes": weight_bytes,
            "active_weights_bytes": active_weight_bytes,
            "kv_f16_bytes_per_token": kv_bytes_per_token,
            "kv_f16_bytes_at_4096": kv_bytes_per_token * 4096,
            "kv_f16_bytes_at_context_length": kv_bytes_per_token * cfg.context_length as u64,
            "total_at_4096_bytes": weight_bytes + kv_bytes_per_token * 4096,
            "kv_f16_by_layer_type": kinds.iter().map(|k| (k.label(), json!({"layers": k.layers, "bytes_per_token": k.bytes_per_token, "max_positions_per_sequence": k.max_positions}))).collect::<BTreeMap<_, _>>(),
            "kv_f16_at_8192": layouts.iter().map(|(n, l)| (n.to_string(), json!({"layer_groups": l.num_groups(), "block_bytes": l.page_bytes(cell, bs), "bytes_per_sequence": per_seq(l), "sequences_in_1GiB": fits(l)}))).collect::<BTreeMap<_, _>>(),
            "kv_bytes_per_token_by_dtype": KvDtype::ALL.iter().filter(|d| KvDtypes { k: **d, v: **d }.check_shape(cfg.head_dim, 16).is_ok()).map(|&d| (d.name(), KvDtypes { k: d, v: d }.bytes_per_token(cfg.kv_layers(), cfg.kv_dim()))).collect::<BTreeMap<_, _>>(),
        },
    });
    if args.json {
        let mut report = report;
        if args.metadata {
            report["metadata"] = json!(file.header().metadata.iter().map(|(k, v)| (k.clone(), v.summary())).collect::<BTreeMap<_, _>>());
        }
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    println!("path:            {}", report["path"].as_str().unwrap_or_default());
    println!("name:            {name}");
    println!("architecture:    {} (GGUF v{})", cfg.arch.name(), file.header().version);
    println!("file size:       {:.1} MiB, {:.1} M parameters", mib(file.file_size()), params as f64 / 1e6);
    println!("context length:  {}", cfg.context_length);
    println!("layers:          {} × d_model {}, ffn {}", cfg.n_layers, cfg.d_model, cfg.ffn_dim);
    if let Some(m) = cfg.moe {
        println!("experts:         {} of {} a token, ffn {} each: {:.1} M active parameters, {:.1} MiB of active weights",
            m.n_used, m.n_expert, m.ffn_dim, active_params as f64 / 1e6, mib(active_weight_bytes));
    }
    println!("attention:       {} heads, {} kv heads, head dim {}, rope base {}", cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_base);
    if let Some(sc) = &cfg.short_conv {
        let n = sc.is_conv.iter().filter(|&&c| c).count();
        println!("recurrent:       {n} of {} layers are short convolutions over {} positions: {:.1} KiB of state a sequence (f32), beside the KV of the {} attention layers",
            cfg.n_layers, sc.l_cache, (sc.state_len(cfg.d_model) * 4) as f64 / 1024.0, cfg.n_layers - n);
    }
    if let Some(w) = cfg.sliding_window {
        println!("sliding window:  {w} tokens on {} of every {} layers (local rope base {})", cfg.swa_period - 1, cfg.swa_period, cfg.rope_base_local);
    }
    println!("vocabulary:      {}", cfg.vocab_size);
    let source = if sampling.declared.is_empty() { "llama.cpp's defaults; the file recommends none".to_string() } else { format!("the file's {} over llama.cpp's defaults", sampling.declared.join(", ")) };
    println!("sampling:        {} ({source})", describe_sampling(sp));
    for s in &sampling.skipped {
        println!("  not taken: {s}");
    }
    println!("tensors by type:");
    for (ty, (count, bytes, _)) in &by_type {
        println!("  {ty:<6} {count:>4} tensors  {:>9.2} MiB", mib(*bytes));
    }
    println!("memory:          weights {:.1} MiB (memory-mapped); f16 KV {:.1} KiB/token = {:.1} MiB at 4096 tokens, {:.1} MiB at {}",
        mib(weight_bytes), kv_bytes_per_token as f64 / 1024.0, mib(kv_bytes_per_token * 4096), mib(kv_bytes_per_token * cfg.context_length as u64), cfg.context_length);
    if let Some(by_dtype) = report["memory"]["kv_bytes_per_token_by_dtype"].as_object() {
        let line: Vec<String> = by_dtype.iter().map(|(d, b)| format!("{d} {:.1} KiB", b.as_f64().unwrap_or(0.0) / 1024.0)).collect();
        println!("KV per token:    {} (--kv-dtype)", line.join(", "));
    }
    if hybrid.is_hybrid() {
        let kind: Vec<String> = kinds.iter().map(|k| format!("{} {} layers {:.1} KiB/token{}", k.label(), k.layers, k.bytes_per_token as f64 / 1024.0, k.max_positions.map_or(String::new(), |p| format!(" (at most {p} positions kept)")))).collect();
        println!("KV by layer:     {} (f16)", kind.join("; "));
        for (_, l) in &layouts {
            let what = if l.is_hybrid() { format!("{} layer groups of {}", l.num_groups(), l.slots()) } else { "one table (--no-hybrid-kv)".into() };
            println!("  at 8192 tokens, {what}: {:.1} MiB a sequence, {} sequences in 1 GiB", mib(per_seq(l) as u64), fits(l));
        }
    }
    if args.metadata {
        println!("metadata:");
        for (k, v) in &file.header().metadata {
            println!("  {k} = {}", v.summary());
        }
    }
    Ok(())
}

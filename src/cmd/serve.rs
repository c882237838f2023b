//! `reckon serve`: the OpenAI-compatible HTTP server over the engine.

use crate::cmd::common::{byte_size, describe_sampling, load, KvArgs, ModelArgs, SamplingArgs};
use anyhow::{Context, Result};
use clap::Args;
use reckon_engine::engine::{spawn_engine, Engine, EngineHandle};
use reckon_engine::kv::DiskTierConfig;
use reckon_server::{router, AppState, DEFAULT_MAX_BODY_BYTES};
use std::time::Duration;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to bind (loopback by default).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require this key on API requests (`Authorization: Bearer KEY` or `x-api-key: KEY`); /health and
    /// /metrics stay open. A key on the command line is visible to other users of the machine: prefer
    /// --api-key-file.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Keys from a file, one per line (blank lines and lines starting with # skipped); any of them is
    /// accepted, together with --api-key.
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// Log every request's prompt text (at info level). Off by default: the log holds lengths and tool
    /// names, never what users wrote.
    #[arg(long)]
    pub log_prompts: bool,
    /// Most messages (or input items) one request may carry; more get 400.
    #[arg(long, default_value_t = reckon_server::RequestLimits::default().max_messages)]
    pub max_messages: usize,
    /// Never switch to the slow-state fallback (by default, when the engine's steps run well over its
    /// model of this host's speed for a sustained window, it runs them on one thread until a probe step
    /// is back to normal: docs/reliability.md).
    #[arg(long)]
    pub no_slow_state: bool,
    /// Most tools one request may carry; more get 400.
    #[arg(long, default_value_t = reckon_server::RequestLimits::default().max_tools)]
    pub max_tools: usize,
    #[command(flatten)]
    pub kv: KvArgs,
    /// What requests get for the sampling fields they omit (every API): these flags, else the model
    /// file's general.sampling.*, else llama.cpp's defaults; `--seed` is the seed of requests without one.
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Sequences running at once.
    #[arg(long, default_value_t = 64)]
    pub max_running: usize,
    /// Requests allowed to wait; more get HTTP 429.
    #[arg(long, default_value_t = 256)]
    pub max_waiting: usize,
    /// Reuse the KV blocks of earlier prompts' common prefixes (automatic prefix caching; the default).
    #[arg(long = "prefix-cache", overrides_with = "no_prefix_cache")]
    pub prefix_cache: bool,
    /// Compute every prompt from scratch.
    #[arg(long = "no-prefix-cache")]
    pub no_prefix_cache: bool,
    /// Also keep prefix-cache blocks on disk here: blocks evicted from memory (and all cached blocks at
    /// shutdown) are written to it and read back on a hit, also after a restart with the same model.
    #[arg(long)]
    pub prefix_cache_dir: Option<PathBuf>,
    /// Size bound of --prefix-cache-dir; the least recently used block files go first.
    #[arg(long, default_value = "4GiB")]
    pub prefix_cache_dir_size: String,
    /// Longest sequence (prompt and output), default the model's context up to 8192.
    #[arg(short = 'c', long)]
    pub ctx_size: Option<usize>,
    /// On SIGTERM or Ctrl-C: seconds running requests may take to finish (new ones get 503 meanwhile);
    /// any still running then ends with an error event.
    #[arg(long, default_value_t = 30.0)]
    pub drain_timeout: f64,
    /// Largest request body accepted (bytes with a unit); larger ones get 413.
    #[arg(long)]
    pub max_body_size: Option<String>,
    /// Publish KV-cache events (which prefix-cache blocks are stored and removed) on this ZeroMQ
    /// endpoint, as vLLM does, for a cluster's KV-aware router: `tcp://127.0.0.1:5557` (bound; see
    /// --kv-events-connect). docs/cluster.md gives the format.
    #[arg(long, value_name = "ENDPOINT")]
    pub kv_events: Option<String>,
    /// Connect the --kv-events socket to the endpoint (an indexer that binds, as llm-d's) instead of
    /// binding it.
    #[arg(long, requires = "kv_events")]
    pub kv_events_connect: bool,
    /// Answer replay requests for missed event batches on this endpoint (a ZeroMQ ROUTER, bound).
    #[arg(long, value_name = "ENDPOINT")]
    pub kv_events_replay: Option<String>,
    /// The topic frame of every event message (llm-d's indexer wants `kv@<pod>@<model>`).
    #[arg(long, value_name = "TOPIC")]
    pub kv_events_topic: Option<String>,
    /// vLLM's --kv-events-config JSON (enable_kv_cache_events, publisher, endpoint, replay_endpoint,
    /// buffer_steps, hwm, max_queue_size, topic), with reckon's bind, encoding (array or map) and hash
    /// (int or bytes); the --kv-events* flags override its fields.
    #[arg(long, value_name = "JSON")]
    pub kv_events_config: Option<String>,
    /// The model's name in the API (repeatable: the first is the one answers carry, the others are
    /// accepted too). Default: the -m value.
    #[arg(long = "served-model-name")]
    pub served_model_name: Vec<String>,
    /// Also accept NAME as the model MODEL (one of the served names), e.g. an agent's own model id:
    /// --alias claude-haiku-4-5=qwen2.5-coder-0.5b. Repeatable.
    #[arg(long = "alias", value_name = "NAME=MODEL")]
    pub alias: Vec<String>,
}

/// The served names: the primary one first, then the other accepted names.
fn served_names(args: &ServeArgs) -> Result<(String, Vec<String>)> {
    let mut names = if args.served_model_name.is_empty() { vec![args.model.model.clone()] } else { args.served_model_name.clone() };
    for a in &args.alias {
        let (name, model) = a.split_once('=').with_context(|| format!("--alias {a}: expected NAME=MODEL"))?;
        anyhow::ensure!(!name.is_empty(), "--alias {a}: the name is empty");
        anyhow::ensure!(names.iter().any(|n| n == model), "--alias {a}: '{model}' is not a served model name ({})", names.join(", "));
        names.push(name.to_string());
    }
    let primary = names.remove(0);
    names.retain(|n| *n != primary);
    names.dedup();
    Ok((primary, names))
}

pub fn run(mut args: ServeArgs) -> Result<()> {
    // speculation where it pays, by default (docs/speculative.md): the same tokens, greedy or seeded
    args.model.default_spec = super::common::SpecArg::Auto;
    anyhow::ensure!(args.drain_timeout.is_finite() && args.drain_timeout >= 0.0, "--drain-timeout must be a number of seconds");
    let drain = Duration::from_secs_f64(args.drain_timeout);
    let max_body_bytes = match &args.max_body_size {
        Some(s) => byte_size(s, "--max-body-size")?.context("--max-body-size needs a unit (32MiB, 500KB)")?,
        None => DEFAULT_MAX_BODY_BYTES,
    };
    let mut api_keys: Vec<String> = args.api_key.iter().cloned().collect();
    if let Some(path) = &args.api_key_file {
        let text = std::fs::read_to_string(path).with_context(|| format!("--api-key-file {}", path.display()))?;
        let keys: Vec<String> = text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(str::to_string).collect();
        anyhow::ensure!(!keys.is_empty(), "--api-key-file {}: no key in it", path.display());
        api_keys.extend(keys);
    }
    anyhow::ensure!(api_keys.iter().all(|k| !k.is_empty()), "--api-key: the key is empty");
    let events_config = kv_events_config(&args)?;
    // The port opens first and answers 503 until the model is loaded (a readiness probe sees "loading",
    // not a refused connection).
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let addr = format!("{}:{}", args.host, args.port);
    let listener = rt.block_on(listen(&addr)).with_context(|| format!("cannot listen on {addr}"))?.into_std()?;
    let loading = reckon_server::front::LoadingResponder::start(listener).context("starting the loading responder")?;
    let loaded = load(&args.model)?;
    let cfg = &loaded.model.config;
    let max_model_len = args.ctx_size.unwrap_or(cfg.context_length.min(8192));
    let kv = args.model.kv_choice(cfg, args.kv.block_size, args.prefix_cache_dir.is_some())?;
    let kv_dtypes = kv.dtypes;
    let mut config = args.kv.engine_config(&loaded.model, loaded.draft.as_ref(), &kv, max_model_len, args.max_running, args.max_waiting, !args.no_prefix_cache)?;
    if !args.no_slow_state {
        config.slow_state = reckon_engine::engine::slow::SlowStateConfig::ON;
    }
    let num_blocks = config.num_blocks;
    let layout = config.kv_layout(&loaded.model, kv.disk_tier);
    let mut window = config.kv_window.map_or(String::new(), |w| format!(", window {} + {} sinks", w.window, w.sinks));
    if let Some(s) = config.sparse_attention {
        window += &format!(", sparse attention: {} history + {} local + {} sink positions", s.budget, s.local, s.sinks);
    }
    if layout.is_hybrid() {
        window += &format!(", {} layer groups of {} layers", layout.num_groups(), layout.slots());
    }
    let (model_id, aliases) = served_names(&args)?;
    let sampling = reckon_server::SamplingDefaults { params: args.sampling.over(&loaded.sampling.params), seed: args.sampling.seed };
    let tokenizer = Arc::new(loaded.tokenizer);
    let disk = match &args.prefix_cache_dir {
        Some(dir) => {
            let max_bytes = byte_size(&args.prefix_cache_dir_size, "--prefix-cache-dir-size")?.context("--prefix-cache-dir-size needs a unit (4GiB, 500MB)")?;
            anyhow::ensure!(!args.no_prefix_cache, "--prefix-cache-dir needs the prefix cache; drop --no-prefix-cache");
            Some(DiskTierConfig { dir: dir.clone(), max_bytes: max_bytes as u64 })
        }
        None => None,
    };
    let model_card = reckon_server::ModelCard { path: loaded.model_path.display().to_string(), architecture: cfg.arch.name().to_string(), vocab_size: cfg.vocab_size };
    let disk_context = || format!("prefix cache dir {}", args.prefix_cache_dir.as_deref().unwrap_or(std::path::Path::new("")).display());
    let mut engine = Engine::new(Arc::new(loaded.model), loaded.draft.map(Arc::new), tokenizer.clone(), config, disk).with_context(disk_context)?;
    if let Some(scorer) = loaded.scorer {
        engine = engine.with_scorer(Arc::new(scorer))?;
    }
    let mut kv_event_stats = None;
    if let Some(events) = events_config {
        let p = rt.block_on(reckon_server::kv_events::start(events))?;
        engine = engine.with_kv_events(p.sink);
        kv_event_stats = Some(p.stats);
        eprintln!("reckon: KV-cache events on {}{}", p.endpoint, p.replay_endpoint.map_or(String::new(), |r| format!(", replay on {r}")));
    }
    let engine = spawn_engine(engine).with_context(disk_context)?;
    let state = AppState { engine, tokenizer, template: Arc::new(loaded.template), model_id, aliases, responses: Default::default(), grammar: Default::default(), api_keys, limits: reckon_server::RequestLimits { max_messages: args.max_messages, max_tools: args.max_tools }, log_prompts: args.log_prompts, metrics: Default::default(), max_body_bytes, sampling, model_card, kv_events: kv_event_stats };
    let listener = loading.stop()?;
    rt.block_on(async move {
        if !is_loopback(&args.host) && state.api_keys.is_empty() {
            eprintln!("reckon: warning: listening on {} without --api-key: anyone who can reach this port can use the model", args.host);
        }
        eprintln!("reckon serving {} on http://{} ({} KV blocks of {} tokens, {}{window})", state.model_id, listener.local_addr()?, num_blocks, args.kv.block_size, kv_dtypes.name());
        eprintln!("reckon: requests that omit them sample with {}", describe_sampling(&state.sampling.params));
        let engine = state.engine.clone();
        let router = router(state);
        // a thread of its own accepts and answers /health probes, whatever the workers' queue holds
        let incoming = reckon_server::front::spawn(listener, router.clone()).context("starting the front thread")?;
        let served = reckon_server::serve(incoming, router, engine.clone(), stop_on_signal(engine.clone(), drain)).await;
        if let Ok(Some(why)) = served {
            // a failed engine saves nothing: the process exits non-zero for its supervisor to restart it
            anyhow::bail!("{why}");
        }
        // also after a server error: the engine saves its prefix cache before the process ends
        let _ = tokio::task::spawn_blocking(move || engine.shutdown(Duration::ZERO)).await;
        served.map(drop).context("server failed")
    })
}

/// The KV-cache event publisher's configuration from --kv-events-config and the --kv-events* flags, or
/// none.
fn kv_events_config(args: &ServeArgs) -> Result<Option<reckon_server::kv_events::KvEventsConfig>> {
    let mut c = match &args.kv_events_config {
        Some(json) => serde_json::from_str(json).context("--kv-events-config")?,
        None if args.kv_events.is_some() => reckon_server::kv_events::KvEventsConfig { bind: Some(!args.kv_events_connect), ..Default::default() },
        None => {
            anyhow::ensure!(args.kv_events_replay.is_none() && args.kv_events_topic.is_none(), "--kv-events-replay and --kv-events-topic go with --kv-events (or --kv-events-config)");
            return Ok(None);
        }
    };
    if let Some(e) = &args.kv_events {
        c.endpoint = e.clone();
        c.bind = Some(!args.kv_events_connect);
    }
    if let Some(r) = &args.kv_events_replay {
        c.replay_endpoint = Some(r.clone());
    }
    if let Some(t) = &args.kv_events_topic {
        c.topic = t.clone();
    }
    anyhow::ensure!(!args.no_prefix_cache || !c.enabled(), "KV-cache events describe the prefix cache; drop --no-prefix-cache");
    Ok(c.enabled().then_some(c))
}

/// A listener with a 4,096-connection accept queue (the kernel caps it at `net.core.somaxconn`): a flood
/// of a thousand connections at once filled tokio's default of 1,024 while the workers were busy, and a
/// connection that found the queue full waited out a TCP retransmission, a health probe included
/// (docs/reliability.md, the flood). The front thread (`reckon_server::front`) now accepts, but a queue
/// this deep still absorbs a burst that arrives faster than one thread accepts.
async fn listen(addr: &str) -> std::io::Result<tokio::net::TcpListener> {
    let mut last = None;
    for a in tokio::net::lookup_host(addr).await? {
        let socket = if a.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
        socket.set_reuseaddr(true)?;
        match socket.bind(a) {
            Ok(()) => return socket.listen(4096),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::new(std::io::ErrorKind::AddrNotAvailable, format!("{addr}: no address"))))
}

fn is_loopback(host: &str) -> bool {
    host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Resolves on SIGINT or SIGTERM, once the engine has stopped: new requests get 503 at once, running ones
/// finish within `drain` (the rest end with an error event), the prefix cache is saved to its disk tier,
/// and then the server stops (after the open streams have sent their last event).
async fn stop_on_signal(engine: EngineHandle, drain: Duration) {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = interrupt => {}
        _ = terminate => {}
    }
    eprintln!("reckon: stopping: finishing running requests for up to {:.0} s, then saving the prefix cache if it has a disk tier (interrupt again to quit now)", drain.as_secs_f64());
    tokio::spawn(async {
        if tokio::signal::ctrl_c().await.is_ok() {
            std::process::exit(130);
        }
    });
    let _ = tokio::task::spawn_blocking(move || engine.shutdown(drain)).await;
}

//! `GET /metrics` in Prometheus text format (written by the `prometheus` crate, which escapes label values:
//! a served model name may hold quotes or backslashes): the names a Kubernetes inference gateway reads from
//! vLLM (queue lengths, KV-cache usage, cache config), and reckon's own latency histograms and counters.
//! The engine's figures are atomics it publishes; each scrape reads them into a registry of its own.

use crate::AppState;
use reckon_engine::engine::{Event, Timings};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;
use prometheus::core::Collector;
use prometheus::{Counter, Gauge, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, Opts, Registry, TextEncoder};
use std::sync::atomic::Ordering;

/// Latency bucket bounds in seconds (vLLM-like spread, from interactive to batch).
const LATENCY_BOUNDS: [f64; 14] = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0];

/// Latency observations from the request handlers (lock-free: every token observes one).
pub struct Metrics {
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue: Histogram,
    /// When the server started (seconds since the epoch).
    started: f64,
}

impl Metrics {
    fn started_unix_secs(&self) -> f64 {
        self.started
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let histogram = |name: &str, help: &str| Histogram::with_opts(HistogramOpts::new(name, help).buckets(LATENCY_BOUNDS.to_vec())).expect("a valid histogram");
        Metrics {
            ttft: histogram("reckon_time_to_first_token_seconds", "Arrival to first generated token."),
            itl: histogram("reckon_inter_token_latency_seconds", "Time between a request's tokens, on every API, streamed or not."),
            e2e: histogram("reckon_e2e_request_latency_seconds", "Arrival to the end of the request."),
            queue: histogram("reckon_request_queue_time_seconds", "Arrival to first scheduled step."),
            started: std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64()),
        }
    }
}

/// A request's token events on their way to an API's shape, observed the same way for every API and
/// answer mode: the gap before each token after the first (the inter-token histogram) and, at the end,
/// the engine's timings.
pub struct Metered {
    events: UnboundedReceiver<Event>,
    metrics: Arc<Metrics>,
    last_token: Option<Instant>,
}

impl Metered {
    pub fn new(events: UnboundedReceiver<Event>, metrics: &Arc<Metrics>) -> Metered {
        Metered { events, metrics: metrics.clone(), last_token: None }
    }

    pub async fn recv(&mut self) -> Option<Event> {
        let ev = self.events.recv().await?;
        match &ev {
            Event::Token { .. } => {
                let now = Instant::now();
                if let Some(prev) = self.last_token.replace(now) {
                    self.metrics.itl.observe((now - prev).as_secs_f64());
                }
            }
            Event::Finished { timings, .. } => self.metrics.finished(timings),
            Event::Error(_) => {}
        }
        Some(ev)
    }
}

impl Metrics {
    /// A finished request's engine timings.
    fn finished(&self, t: &Timings) {
        self.ttft.observe(t.time_to_first_token.as_secs_f64());
        self.e2e.observe(t.end_to_end.as_secs_f64());
        self.queue.observe(t.queue.as_secs_f64());
    }
}

/// The families of one scrape, all labelled with the served model's name (escaped by the encoder: a name
/// may hold any character).
struct Scrape<'a> {
    registry: Registry,
    model: &'a str,
}

impl Scrape<'_> {
    fn opts(&self, name: &str, help: &str) -> Opts {
        Opts::new(name, help).const_label("model_name", self.model)
    }

    fn add(&self, c: impl Collector + 'static) {
        // names are this file's constants: a clash or a bad name is a bug here
        self.registry.register(Box::new(c)).expect("a metric name registered once");
    }

    fn gauge(&self, name: &str, help: &str, v: f64) {
        self.gauge_with(self.opts(name, help), v);
    }

    fn gauge_with(&self, opts: Opts, v: f64) {
        let g = Gauge::with_opts(opts).expect("a valid gauge");
        g.set(v);
        self.add(g);
    }

    /// A gauge with one more label, a series per value.
    fn gauges(&self, name: &str, help: &str, label: &str, series: impl IntoIterator<Item = (String, f64)>) {
        let g = GaugeVec::new(self.opts(name, help), &[label]).expect("a valid gauge");
        series.into_iter().for_each(|(l, v)| g.with_label_values(&[l.as_str()]).set(v));
        self.add(g);
    }

    /// A counter of the engine's, read at the scrape (`name` without vLLM's `_total` suffix is not
    /// added: the names are given whole).
    fn counter(&self, name: &str, help: &str, v: u64) {
        let c = IntCounter::with_opts(self.opts(name, help)).expect("a valid counter");
        c.inc_by(v);
        self.add(c);
    }

    fn seconds(&self, name: &str, help: &str, nanos: u64) {
        let c = Counter::with_opts(self.opts(name, help)).expect("a valid counter");
        c.inc_by(nanos as f64 / 1e9);
        self.add(c);
    }
}

/// The `Content-Type` of `render`'s text (Prometheus' text format 0.0.4, as vLLM serves).
pub const CONTENT_TYPE: &str = prometheus::TEXT_FORMAT;

pub fn render(state: &AppState) -> String {
    let s = state.engine.stats();
    // The request counts first (Acquire, pairing with the engine's Release stores, made after the blocks').
    let (waiting, running) = (s.waiting.load(Ordering::Acquire), s.running.load(Ordering::Acquire));
    let load = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed);
    let count = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let (num_blocks, block_size) = (state.engine.config().num_blocks, state.engine.config().block_size);
    let used = load(&s.blocks_used);
    let usage = if num_blocks == 0 { 0.0 } else { used as f64 / num_blocks as f64 };
    let out = Scrape { registry: Registry::new(), model: &state.model_id };
    out.gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", waiting as f64);
    out.gauge("vllm:num_requests_running", "Requests in the running batch.", running as f64);
    out.gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", usage);
    // vLLM's label names; cache_dtype as `--kv-dtype` spells it (vLLM: "auto" for the model's dtype, "fp8").
    let info = out.opts("vllm:cache_config_info", "KV-cache configuration.").const_label("block_size", block_size.to_string()).const_label("num_gpu_blocks", num_blocks.to_string()).const_label("cache_dtype", state.engine.config().kv_dtypes.name());
    out.gauge_with(info, 1.0);
    // The Gateway API Inference Extension's model-server protocol reads LoRA adapters from this gauge's
    // labels (vLLM's: the value is the time of the last change). reckon serves none: empty lists.
    let lora = out.opts("vllm:lora_requests_info", "Running stats on LoRA requests (reckon serves no adapters).").const_label("max_lora", "0").const_label("running_lora_adapters", "").const_label("waiting_lora_adapters", "");
    out.gauge_with(lora, state.metrics.started_unix_secs());
    if let Some(k) = &state.kv_events {
        out.counter("reckon_kv_events_batches_published_total", "KV-cache event batches published (--kv-events).", k.batches_published.load(Ordering::Relaxed));
        out.counter("reckon_kv_events_batches_dropped_total", "KV-cache event batches dropped on a full queue (each left a gap in the sequence numbers) or refused by the PUB socket.", k.batches_dropped.load(Ordering::Relaxed));
        out.counter("reckon_kv_events_replay_clients_dropped_total", "KV-cache event replay clients dropped for reading nothing for a second, the rest of their answer abandoned.", k.replay_clients_dropped.load(Ordering::Relaxed));
    }
    out.gauge("reckon_kv_blocks_free", "KV-cache blocks free.", (num_blocks - used.min(num_blocks)) as f64);
    out.gauge("reckon_slow_state", "1 while the engine sees a slow host and runs its fallback (docs/reliability.md).", if s.slow_state.load(Ordering::Relaxed) { 1.0 } else { 0.0 });
    // Per kind of layer (`kv::layout`): what a token costs there, and how many positions a sequence keeps
    // (0: all of them). With Gemma-3's sliding layers in groups of their own, their positions are capped.
    let (kinds, page_bytes) = state.engine.kv_memory();
    out.gauge("reckon_kv_block_bytes", "Bytes of one KV-cache block (a page of the layers one layer group holds).", page_bytes as f64);
    out.gauge("reckon_kv_layer_groups", "KV-cache layer groups, each with its own block table per sequence (1: every layer in one).", state.engine.kv_layout().num_groups() as f64);
    out.gauge("reckon_prefix_cache_disk_blocks", "Block files in the prefix cache's disk tier.", load(&s.prefix_cache_disk_blocks) as f64);
    out.gauge("reckon_prefix_cache_blocks", "KV-cache blocks holding a cached prefix (in use or reclaimable).", load(&s.prefix_cache_blocks) as f64);
    let per_kind: [(&str, &str, fn(&reckon_engine::kv::layout::LayerKindMemory) -> usize); 3] = [
        ("reckon_kv_layers", "Layers of this type.", |k| k.layers),
        ("reckon_kv_bytes_per_token", "KV-cache bytes one token takes in the layers of this type.", |k| k.bytes_per_token),
        ("reckon_kv_max_positions_per_sequence", "Positions a sequence keeps in the layers of this type at most (0: every position).", |k| k.max_positions.unwrap_or(0)),
    ];
    for (name, help, value) in per_kind {
        out.gauges(name, help, "layer_type", kinds.iter().map(|k| (k.label().to_string(), value(k) as f64)));
    }
    for (name, help, v) in [
        ("reckon_prompt_tokens_total", "Prompt tokens of finished requests.", &s.prompt_tokens),
        ("reckon_generation_tokens_total", "Generated tokens.", &s.generated_tokens),
        ("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", &s.prefix_cache_queried_tokens),
        ("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache (not computed).", &s.prefix_cache_hit_tokens),
        ("reckon_prefix_cache_disk_hits_total", "Prompt tokens read back from the prefix cache's disk tier.", &s.prefix_cache_disk_hit_tokens),
        // vLLM's speculative-decoding counters: steps that carried guesses, guesses, guesses kept
        ("vllm:spec_decode_num_drafts_total", "Steps in which a request carried speculative guesses.", &s.spec_drafts),
        ("vllm:spec_decode_num_draft_tokens_total", "Speculative guesses checked.", &s.spec_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens_total", "Speculative guesses the model kept.", &s.spec_accepted_tokens),
        ("reckon_slow_state_episodes_total", "Slow states the engine detected.", &s.slow_state_episodes),
        ("reckon_slow_state_fallback_steps_total", "Steps run in the slow-state fallback.", &s.slow_state_fallback_steps),
        ("reckon_num_preemptions_total", "Sequences preempted (freed, recomputed later).", &s.preemptions),
        ("reckon_request_success_total", "Requests finished (stop token, stop string or length).", &s.finished_requests),
        ("reckon_request_aborted_total", "Requests aborted (the client went away).", &s.aborted_requests),
        ("reckon_request_failed_total", "Requests ended with an error (a grammar that failed, a shutdown's drain timeout).", &s.failed_requests),
        ("reckon_spec_prefill_requests_total", "Requests whose prompt was prefilled sparsely (docs/spec-prefill.md).", &s.spec_prefill_requests),
        ("reckon_spec_prefill_dropped_tokens_total", "Prompt tokens a sparse prefill did not compute.", &s.spec_prefill_dropped_tokens),
        ("reckon_spec_prefill_recovery_steps_total", "Engine steps of idle recovery (background prefills of sparse prompts' full keys and values).", &s.spec_prefill_recovery_steps),
        ("reckon_spec_prefill_recovered_tokens_total", "Prompt tokens idle recovery computed.", &s.spec_prefill_recovered_tokens),
    ] {
        out.counter(name, help, count(v));
    }
    // the kept guesses by position, as vLLM's
    let per_pos = IntCounterVec::new(out.opts("vllm:spec_decode_num_accepted_tokens_per_pos", "Speculative guesses kept, by their position in the step's guesses (the last counts every later one too)."), &["position"]).expect("a valid counter");
    for (p, c) in s.spec_accepted_per_pos.iter().enumerate() {
        per_pos.with_label_values(&[p.to_string().as_str()]).inc_by(count(c));
    }
    out.add(per_pos);
    // the engine's time and the draft model's share
    for (name, help, v) in [
        ("reckon_engine_step_seconds_total", "Time of the engine's model steps (the draft model's passes included).", &s.step_ns),
        ("reckon_spec_draft_model_seconds_total", "Time the draft model of speculative decoding took (part of the engine's steps).", &s.draft_ns),
        ("reckon_spec_prefill_recovery_seconds_total", "Time of the engine's steps that carried an idle-recovery slice.", &s.spec_prefill_recovery_ns),
        ("reckon_slow_state_seconds_total", "Time spent in slow states that have ended (docs/reliability.md).", &s.slow_state_ns),
    ] {
        out.seconds(name, help, count(v));
    }
    // the controller's fit and expected gain
    out.gauge("reckon_spec_prefill_recovery_debt_tokens", "Prompt tokens sparse prefills left uncomputed that idle recovery has yet to recompute.", count(&s.spec_prefill_recovery_debt) as f64);
    let terms = [("fixed", &s.step_cost_a_ns), ("per_token", &s.step_cost_b_ns)].map(|(t, v)| (t.to_string(), count(v) as f64 / 1e9));
    out.gauges("reckon_spec_step_cost_seconds", "The engine's step time fitted as fixed + per_token x tokens (what --spec auto decides by; 0 until fitted).", "term", terms);
    out.gauge("reckon_spec_draft_pass_seconds", "The draft model's fitted pass over one token (0 until fitted or without one).", count(&s.draft_step_ns) as f64 / 1e9);
    out.gauge("reckon_spec_expected_speedup", "What --spec auto expected its latest choice of guesses to gain in tokens per second (0 before it chose).", count(&s.spec_gain_milli) as f64 / 1e3);
    let m = &state.metrics;
    for h in [&m.ttft, &m.itl, &m.e2e, &m.queue] {
        out.add(h.clone());
    }
    TextEncoder::new().encode_to_string(&out.registry.gather()).expect("the text encoder writes to a string")
}

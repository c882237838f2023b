//! `GET /metrics` in Prometheus text format: the names a Kubernetes inference gateway reads from vLLM
//! (queue lengths, KV-cache usage, cache config), and reckon's own latency histograms and counters.

use crate::AppState;
use reckon_engine::engine::{Event, Timings};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Latency bucket bounds in seconds (vLLM-like spread, from interactive to batch).
const LATENCY_BOUNDS: [f64; 14] = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0];

/// Lock-free (every streamed token observes one): cumulative bucket counts, the sum in nanoseconds.
#[derive(Debug, Default)]
struct Histogram {
    counts: [AtomicU64; LATENCY_BOUNDS.len()],
    sum_nanos: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    fn observe(&self, d: Duration) {
        let v = d.as_secs_f64();
        for (c, &b) in self.counts.iter().zip(&LATENCY_BOUNDS) {
            if v <= b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.sum_nanos.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        // observations land bucket by bucket while this reads: keep the series cumulative (monotone)
        let mut running = 0;
        for (c, b) in self.counts.iter().zip(&LATENCY_BOUNDS) {
            running = c.load(Ordering::Relaxed).max(running);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {running}");
        }
        let (count, sum) = (self.count.load(Ordering::Relaxed).max(running), self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}\n{name}_sum {sum}\n{name}_count {count}");
    }
}

#[derive(Default)]
struct Latencies {
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
    queue: Histogram,
}

/// Latency observations from the request handlers.
#[derive(Default)]
pub struct Metrics {
    latencies: Latencies,
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
                    self.metrics.latencies.itl.observe(now - prev);
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
        let l = &self.latencies;
        l.ttft.observe(t.time_to_first_token);
        l.e2e.observe(t.end_to_end);
        l.queue.observe(t.queue);
    }
}

pub fn render(state: &AppState) -> String {
    let s = state.engine.stats();
    // The request counts first (Acquire, pairing with the engine's Release stores, made after the blocks').
    let (waiting, running) = (s.waiting.load(Ordering::Acquire), s.running.load(Ordering::Acquire));
    let load = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed);
    let count = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let (num_blocks, block_size) = (state.engine.config().num_blocks, state.engine.config().block_size);
    let used = load(&s.blocks_used);
    let usage = if num_blocks == 0 { 0.0 } else { used as f64 / num_blocks as f64 };
    let model = &state.model_id;
    let mut out = String::new();
    let mut gauge = |name: &str, help: &str, labels: &str, v: f64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v}");
    };
    let m = format!("model_name=\"{model}\"");
    gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", &m, waiting as f64);
    gauge("vllm:num_requests_running", "Requests in the running batch.", &m, running as f64);
    gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", &m, usage);
    // vLLM's label names; cache_dtype as `--kv-dtype` spells it (vLLM: "auto" for the model's dtype, "fp8").
    let info = format!("{m},block_size=\"{block_size}\",num_gpu_blocks=\"{num_blocks}\",cache_dtype=\"{}\"", state.engine.config().kv_dtypes.name());
    gauge("vllm:cache_config_info", "KV-cache configuration.", &info, 1.0);
    gauge("reckon_kv_blocks_free", "KV-cache blocks free.", &m, (num_blocks - used.min(num_blocks)) as f64);
    gauge("reckon_slow_state", "1 while the engine sees a slow host and runs its fallback (docs/reliability.md).", &m, if s.slow_state.load(std::sync::atomic::Ordering::Relaxed) { 1.0 } else { 0.0 });
    // Per kind of layer (`kv::layout`): what a token costs there, and how many positions a sequence keeps
    // (0: all of them). With Gemma-3's sliding layers in groups of their own, their positions are capped.
    let (kinds, page_bytes) = state.engine.kv_memory();
    gauge("reckon_kv_block_bytes", "Bytes of one KV-cache block (a page of the layers one layer group holds).", &m, page_bytes as f64);
    gauge("reckon_kv_layer_groups", "KV-cache layer groups, each with its own block table per sequence (1: every layer in one).", &m, state.engine.kv_layout().num_groups() as f64);
    gauge("reckon_prefix_cache_disk_blocks", "Block files in the prefix cache's disk tier.", &m, load(&s.prefix_cache_disk_blocks) as f64);
    gauge("reckon_prefix_cache_blocks", "KV-cache blocks holding a cached prefix (in use or reclaimable).", &m, load(&s.prefix_cache_blocks) as f64);
    let per_kind: [(&str, &str, fn(&reckon_engine::kv::layout::LayerKindMemory) -> usize); 3] = [
        ("reckon_kv_layers", "Layers of this type.", |k| k.layers),
        ("reckon_kv_bytes_per_token", "KV-cache bytes one token takes in the layers of this type.", |k| k.bytes_per_token),
        ("reckon_kv_max_positions_per_sequence", "Positions a sequence keeps in the layers of this type at most (0: every position).", |k| k.max_positions.unwrap_or(0)),
    ];
    for (name, help, value) in per_kind {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
        for k in &kinds {
            let _ = writeln!(out, "{name}{{{m},layer_type=\"{}\"}} {}", k.label(), value(k));
        }
    }
    let mut counter = |name: &str, help: &str, v: u64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{m}}} {v}");
    };
    counter("reckon_prompt_tokens_total", "Prompt tokens of finished requests.", count(&s.prompt_tokens));
    counter("reckon_generation_tokens_total", "Generated tokens.", count(&s.generated_tokens));
    counter("vllm:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", count(&s.prefix_cache_queried_tokens));
    counter("vllm:prefix_cache_hits_total", "Prompt tokens found in the prefix cache (not computed).", count(&s.prefix_cache_hit_tokens));
    counter("reckon_prefix_cache_disk_hits_total", "Prompt tokens read back from the prefix cache's disk tier.", count(&s.prefix_cache_disk_hit_tokens));
    // vLLM's speculative-decoding counters: steps that carried guesses, guesses, guesses kept
    counter("vllm:spec_decode_num_drafts_total", "Steps in which a request carried speculative guesses.", count(&s.spec_drafts));
    counter("vllm:spec_decode_num_draft_tokens_total", "Speculative guesses checked.", count(&s.spec_draft_tokens));
    counter("vllm:spec_decode_num_accepted_tokens_total", "Speculative guesses the model kept.", count(&s.spec_accepted_tokens));
    counter("reckon_slow_state_episodes_total", "Slow states the engine detected.", count(&s.slow_state_episodes));
    counter("reckon_slow_state_fallback_steps_total", "Steps run in the slow-state fallback.", count(&s.slow_state_fallback_steps));
    counter("reckon_num_preemptions_total", "Sequences preempted (freed, recomputed later).", count(&s.preemptions));
    counter("reckon_request_success_total", "Requests finished (stop token, stop string or length).", count(&s.finished_requests));
    counter("reckon_request_aborted_total", "Requests aborted (the client went away).", count(&s.aborted_requests));
    counter("reckon_request_failed_total", "Requests ended with an error (cut short by a shutdown's drain timeout).", count(&s.failed_requests));
    // the kept guesses by position, as vLLM's; the engine's time and the draft model's share; the
    // controller's fit and expected gain
    let name = "vllm:spec_decode_num_accepted_tokens_per_pos";
    let _ = writeln!(out, "# HELP {name} Speculative guesses kept, by their position in the step's guesses (the last counts every later one too).\n# TYPE {name} counter");
    for (p, c) in s.spec_accepted_per_pos.iter().enumerate() {
        let _ = writeln!(out, "{name}{{{m},position=\"{p}\"}} {}", count(c));
    }
    for (name, help, v) in [
        ("reckon_spec_prefill_requests_total", "Requests whose prompt was prefilled sparsely (docs/spec-prefill.md).", &s.spec_prefill_requests),
        ("reckon_spec_prefill_dropped_tokens_total", "Prompt tokens a sparse prefill did not compute.", &s.spec_prefill_dropped_tokens),
        ("reckon_spec_prefill_recovery_steps_total", "Engine steps of idle recovery (background prefills of sparse prompts' full keys and values).", &s.spec_prefill_recovery_steps),
        ("reckon_spec_prefill_recovered_tokens_total", "Prompt tokens idle recovery computed.", &s.spec_prefill_recovered_tokens),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{m}}} {}", count(v));
    }
    for (name, help, v) in [
        ("reckon_engine_step_seconds_total", "Time of the engine's model steps (the draft model's passes included).", &s.step_ns),
        ("reckon_spec_draft_model_seconds_total", "Time the draft model of speculative decoding took (part of the engine's steps).", &s.draft_ns),
        ("reckon_spec_prefill_recovery_seconds_total", "Time of the engine's steps that carried an idle-recovery slice.", &s.spec_prefill_recovery_ns),
        ("reckon_slow_state_seconds_total", "Time spent in slow states that have ended (docs/reliability.md).", &s.slow_state_ns),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{m}}} {}", count(v) as f64 / 1e9);
    }
    let name = "reckon_spec_prefill_recovery_debt_tokens";
    let _ = writeln!(out, "# HELP {name} Prompt tokens sparse prefills left uncomputed that idle recovery has yet to recompute.\n# TYPE {name} gauge\n{name}{{{m}}} {}", count(&s.spec_prefill_recovery_debt));
    let name = "reckon_spec_step_cost_seconds";
    let _ = writeln!(out, "# HELP {name} The engine's step time fitted as fixed + per_token x tokens (what --spec auto decides by; 0 until fitted).\n# TYPE {name} gauge");
    for (term, v) in [("fixed", &s.step_cost_a_ns), ("per_token", &s.step_cost_b_ns)] {
        let _ = writeln!(out, "{name}{{{m},term=\"{term}\"}} {}", count(v) as f64 / 1e9);
    }
    let name = "reckon_spec_draft_pass_seconds";
    let _ = writeln!(out, "# HELP {name} The draft model's fitted pass over one token (0 until fitted or without one).\n# TYPE {name} gauge\n{name}{{{m}}} {}", count(&s.draft_step_ns) as f64 / 1e9);
    let name = "reckon_spec_expected_speedup";
    let _ = writeln!(out, "# HELP {name} What --spec auto expected its latest choice of guesses to gain in tokens per second (0 before it chose).\n# TYPE {name} gauge\n{name}{{{m}}} {}", count(&s.spec_gain_milli) as f64 / 1e3);
    let l = &state.metrics.latencies;
    l.ttft.render("reckon_time_to_first_token_seconds", "Arrival to first generated token.", &mut out);
    l.itl.render("reckon_inter_token_latency_seconds", "Time between a request's tokens, on every API, streamed or not.", &mut out);
    l.e2e.render("reckon_e2e_request_latency_seconds", "Arrival to the end of the request.", &mut out);
    l.queue.render("reckon_request_queue_time_seconds", "Arrival to first scheduled step.", &mut out);
    out
}

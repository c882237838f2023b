//! `reckon lab serve`: a load generator for any OpenAI-compatible server, so reckon, llama-server and
//! vLLM are measured by one tool. Closed loop (C clients, each sending its next request when the last
//! ends) or open loop (Poisson arrivals at a rate), streamed `/v1/completions` or `/v1/chat/completions`,
//! prompts of a fixed length or from a file of real conversations (ShareGPT's format).
//!
//! Per request: TTFT (sent -> first streamed text), ITL (gaps between streamed chunks that carry text),
//! TPOT ((end - first text) / (output tokens - 1)) and end to end. Per level (target, load, pass):
//! request and token throughput over the level's wall time (first request sent -> last answer done),
//! percentiles, errors by kind, goodput (requests per second that met every SLO given) and $/M output
//! tokens at a price per hour. Targets alternate (A B, then B A) from level to level and pass to pass, and
//! every figure is a median (min-max) over passes.

use crate::http::{self, Endpoint, Failure, Read, SseParser};
use crate::stats::{summarize, Summary};
use crate::LabError;
use reckon_engine::sampler::Rng;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One server under test.
#[derive(Clone, Debug)]
pub struct Target {
    pub name: String,
    pub endpoint: Endpoint,
    /// The `model` sent (what the server's /v1/models lists first, unless told).
    pub model: String,
}

/// How requests arrive at a level.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum Load {
    /// C clients, each sending its next request as soon as its last one ends.
    Concurrency(usize),
    /// Arrivals at this many requests per second, however many are in flight: Poisson (exponential
    /// gaps), or evenly spaced with `ServeSpec::constant_arrivals`.
    Rate(f64),
}

impl Load {
    pub fn label(&self) -> String {
        match self {
            Load::Concurrency(c) => format!("{c} clients"),
            Load::Rate(r) => format!("{r} req/s"),
        }
    }
    /// The level's x in the plots.
    pub fn x(&self) -> f64 {
        match self {
            Load::Concurrency(c) => *c as f64,
            Load::Rate(r) => *r,
        }
    }
}

/// One request's prompt and the output it asks for.
#[derive(Clone, Debug, PartialEq)]
pub struct Prompt {
    pub text: String,
    pub output_tokens: usize,
}

/// Where prompts come from.
#[derive(Clone, Debug)]
pub enum Prompts {
    /// Seeded common English words (about one token each in the BPE vocabularies of the served models;
    /// the server's own count is in the records), `output_tokens` each.
    Fixed { prompt_words: usize, output_tokens: usize },
    /// Taken in order (cycled) from a file.
    Dataset(Vec<Prompt>),
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum Api {
    Completions,
    Chat,
}

#[derive(Clone, Debug)]
pub struct ServeSpec {
    pub targets: Vec<Target>,
    pub loads: Vec<Load>,
    /// Requests per level; 0: `4 x C` (at least 16) for a concurrency, `20 s x rate` (at least 16) for a rate.
    pub requests: usize,
    pub passes: usize,
    pub warmup: usize,
    pub prompts: Prompts,
    pub api: Api,
    /// Send `ignore_eos` so every answer is as long as asked (the server must accept it: reckon,
    /// llama-server, vLLM and SGLang do).
    pub ignore_eos: bool,
    pub api_key: Option<String>,
    pub timeout: Duration,
    pub slo_ttft_ms: Option<f64>,
    pub slo_tpot_ms: Option<f64>,
    pub price_per_hour: Option<f64>,
    pub seed: u64,
    /// Stop sending a level's requests after this long (those in flight finish), whatever `requests` says.
    pub duration: Option<Duration>,
    /// With a rate: evenly spaced arrivals instead of Poisson ones (guidellm's `constant` profile).
    pub constant_arrivals: bool,
}

impl ServeSpec {
    fn requests_at(&self, load: Load) -> usize {
        if self.requests > 0 {
            return self.requests;
        }
        match load {
            Load::Concurrency(c) => (4 * c).max(16),
            Load::Rate(r) => ((20.0 * r).ceil() as usize).max(16),
        }
    }
}

/// One request as measured.
#[derive(Clone, Debug, Serialize)]
pub struct RequestRecord {
    pub target: String,
    pub pass: usize,
    pub load: Load,
    pub id: usize,
    /// When it was sent, seconds after the level began.
    pub sent_s: f64,
    pub ok: bool,
    pub error: Option<String>,
    pub status: u16,
    pub prompt_tokens: Option<usize>,
    /// The server's count (`usage`), else the chunks that carried text.
    pub output_tokens: usize,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: f64,
    pub finish_reason: Option<String>,
    /// Gaps between the chunks that carried text, ms.
    pub itl_ms: Vec<f64>,
}

/// Percentiles of one latency over a level's requests.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub mean: f64,
}

/// Nearest-rank percentiles (`stats::percentile`; NaN for no samples).
pub fn percentiles(xs: &[f64]) -> Percentiles {
    if xs.is_empty() {
        return Percentiles { p50: f64::NAN, p90: f64::NAN, p99: f64::NAN, mean: f64::NAN };
    }
    let mut s = xs.to_vec();
    s.sort_by(f64::total_cmp);
    let at = |q: f64| crate::stats::percentile(&s, q);
    Percentiles { p50: at(0.5), p90: at(0.9), p99: at(0.99), mean: s.iter().sum::<f64>() / s.len() as f64 }
}

/// One level: a target at a load in a pass.
#[derive(Clone, Debug, Serialize)]
pub struct LevelRecord {
    pub target: String,
    pub pass: usize,
    pub load: Load,
    /// When the level began (Unix seconds): with each request's `sent_s`, `ttft_ms` and `itl_ms`, every
    /// token's arrival time, to line up with events outside (a CPU hog starting).
    pub start_unix_s: f64,
    pub requests: usize,
    pub ok: usize,
    pub errors: BTreeMap<String, usize>,
    pub duration_s: f64,
    pub requests_per_s: f64,
    pub output_tokens_per_s: f64,
    /// Prompt and output tokens per second (prompt tokens as the server counted them).
    pub total_tokens_per_s: f64,
    pub ttft_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub tpot_ms: Percentiles,
    pub e2e_ms: Percentiles,
    /// Requests per second that ended well within every SLO given (None without an SLO).
    pub goodput_per_s: Option<f64>,
    /// The share of requests that did.
    pub goodput_share: Option<f64>,
    /// Dollars per million output tokens at `price_per_hour`.
    pub usd_per_m_output: Option<f64>,
}

pub fn level(spec: &ServeSpec, target: &str, pass: usize, load: Load, start_unix_s: f64, duration_s: f64, reqs: &[RequestRecord]) -> LevelRecord {
    let ok: Vec<&RequestRecord> = reqs.iter().filter(|r| r.ok).collect();
    let mut errors = BTreeMap::new();
    for r in reqs.iter().filter(|r| !r.ok) {
        *errors.entry(r.error.clone().unwrap_or_default()).or_insert(0) += 1;
    }
    let out_tokens: usize = ok.iter().map(|r| r.output_tokens).sum();
    let prompt_tokens: usize = ok.iter().filter_map(|r| r.prompt_tokens).sum();
    let d = duration_s.max(1e-9);
    let good = |r: &&RequestRecord| spec.slo_ttft_ms.is_none_or(|s| r.ttft_ms.is_some_and(|t| t <= s)) && spec.slo_tpot_ms.is_none_or(|s| r.tpot_ms.is_none_or(|t| t <= s));
    let has_slo = spec.slo_ttft_ms.is_some() || spec.slo_tpot_ms.is_some();
    let n_good = ok.iter().filter(|r| good(r)).count();
    let output_tokens_per_s = out_tokens as f64 / d;
    LevelRecord {
        target: target.to_string(),
        pass,
        load,
        start_unix_s,
        requests: reqs.len(),
        ok: ok.len(),
        errors,
        duration_s,
        requests_per_s: ok.len() as f64 / d,
        output_tokens_per_s,
        total_tokens_per_s: (out_tokens + prompt_tokens) as f64 / d,
        ttft_ms: percentiles(&ok.iter().filter_map(|r| r.ttft_ms).collect::<Vec<_>>()),
        itl_ms: percentiles(&ok.iter().flat_map(|r| r.itl_ms.iter().copied()).collect::<Vec<_>>()),
        tpot_ms: percentiles(&ok.iter().filter_map(|r| r.tpot_ms).collect::<Vec<_>>()),
        e2e_ms: percentiles(&ok.iter().map(|r| r.e2e_ms).collect::<Vec<_>>()),
        goodput_per_s: has_slo.then(|| n_good as f64 / d),
        goodput_share: has_slo.then(|| n_good as f64 / reqs.len().max(1) as f64),
        usd_per_m_output: spec.price_per_hour.filter(|_| output_tokens_per_s > 0.0).map(|p| p / 3600.0 / output_tokens_per_s * 1e6),
    }
}

const WORDS: &[&str] = &[
    "the", "time", "people", "year", "way", "day", "man", "thing", "woman", "life", "child", "world", "school", "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week", "company", "system", "program", "question", "work", "government", "number", "night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend", "father", "power", "hour", "game", "line", "end", "member", "law", "car", "city", "community", "name", "president", "team", "minute", "idea", "kid", "body", "information", "back", "parent", "face", "others", "level", "office", "door", "health", "person", "art", "war", "history", "party", "result", "change", "morning", "reason", "research", "girl", "guy", "moment", "air", "teacher", "force", "education", "good", "new", "first", "last", "long", "great", "little", "own", "other", "old", "big", "high", "different", "small", "large", "next", "early", "young", "important", "few", "public", "bad", "same", "able", "make", "take", "come", "see", "know", "get", "give", "find", "think", "tell", "become", "show", "leave", "feel", "put", "bring", "begin", "keep", "hold", "write", "stand", "hear", "let", "mean", "set", "meet", "run", "pay", "sit", "speak", "lie", "lead", "read", "grow", "lose", "fall", "send", "build", "stay", "open", "walk", "win", "offer", "remember", "love", "consider", "appear", "buy", "wait", "serve", "die", "expect", "stop", "spend", "river", "garden", "music", "paper", "window", "table", "market", "winter", "summer", "light", "dog", "horse", "bread", "stone", "tree",
];

/// Request `id`'s prompt. Fixed prompts start with their id (a distinct first token: no prefix is shared
/// between requests, in any pass); a dataset's prompts are tagged likewise.
pub fn prompt_for(prompts: &Prompts, seed: u64, id: usize) -> Prompt {
    match prompts {
        Prompts::Fixed { prompt_words, output_tokens } => {
            let mut rng = Rng::new(seed ^ (id as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let mut text = format!("{id}.");
            for _ in 1..*prompt_words {
                text.push(' ');
                text.push_str(WORDS[(rng.next_u64() % WORDS.len() as u64) as usize]);
            }
            Prompt { text, output_tokens: *output_tokens }
        }
        Prompts::Dataset(list) => {
            let p = &list[id % list.len()];
            Prompt { text: format!("[{id}] {}", p.text), output_tokens: p.output_tokens }
        }
    }
}

/// Prompts from a file of conversations: a JSON array or JSON lines, each entry either ShareGPT's
/// `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}` (the first
/// human turn is the prompt; the reply that follows it sets the output length at one token per 4 bytes,
/// as no tokenizer of the server is at hand) or `{"prompt": ..., "output_tokens": N}`. Output lengths are
/// clamped to 4..=`max_output`; entries without both parts are skipped.
pub fn read_dataset(text: &str, max_output: usize) -> Result<Vec<Prompt>, String> {
    let entries: Vec<serde_json::Value> = match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Array(a)) => a,
        Ok(v) => vec![v],
        Err(_) => text.lines().filter(|l| !l.trim().is_empty()).enumerate().map(|(i, l)| serde_json::from_str(l).map_err(|e| format!("line {}: {e}", i + 1))).collect::<Result<_, _>>()?,
    };
    let clamp = |n: usize| n.clamp(4, max_output.max(4));
    let mut out = Vec::new();
    for e in &entries {
        if let (Some(p), Some(n)) = (e.get("prompt").and_then(|p| p.as_str()), e.get("output_tokens").and_then(|n| n.as_u64())) {
            out.push(Prompt { text: p.to_string(), output_tokens: clamp(n as usize) });
            continue;
        }
        let Some(turns) = e.get("conversations").and_then(|c| c.as_array()) else { continue };
        let role = |t: &serde_json::Value| t.get("from").or_else(|| t.get("role")).and_then(|r| r.as_str()).unwrap_or("").to_string();
        let value = |t: &serde_json::Value| t.get("value").or_else(|| t.get("content")).and_then(|v| v.as_str()).unwrap_or("").to_string();
        let Some(i) = turns.iter().position(|t| matches!(role(t).as_str(), "human" | "user")) else { continue };
        let Some(reply) = turns.get(i + 1).filter(|t| matches!(role(t).as_str(), "gpt" | "assistant" | "chatgpt" | "bard")) else { continue };
        let (prompt, reply) = (value(&turns[i]), value(reply));
        if prompt.trim().is_empty() || reply.trim().is_empty() {
            continue;
        }
        out.push(Prompt { text: prompt, output_tokens: clamp(reply.len().div_ceil(4)) });
    }
    if out.is_empty() {
        return Err(format!("no usable entry among {} (expected ShareGPT conversations or prompt/output_tokens objects)", entries.len()));
    }
    Ok(out)
}

/// The JSON body of a streamed request.
pub fn request_body(target: &Target, api: Api, prompt: &Prompt, ignore_eos: bool) -> serde_json::Value {
    let mut body = serde_json::json!({
        "model": target.model,
        "max_tokens": prompt.output_tokens,
        "temperature": 0,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    match api {
        Api::Completions => body["prompt"] = prompt.text.clone().into(),
        Api::Chat => body["messages"] = serde_json::json!([{"role": "user", "content": prompt.text}]),
    }
    if ignore_eos {
        body["ignore_eos"] = true.into();
    }
    body
}

/// What an OpenAI stream said, fed event by event.
#[derive(Default, Debug)]
pub struct StreamTally {
    /// Arrival times of the events that carried text.
    pub text_at: Vec<Instant>,
    pub prompt_tokens: Option<usize>,
    pub completion_tokens: Option<usize>,
    pub finish_reason: Option<String>,
    pub done: bool,
    pub error: bool,
}

impl StreamTally {
    pub fn feed(&mut self, at: Instant, data: &str) {
        if data.trim() == "[DONE]" {
            self.done = true;
            return;
        }
        let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else { return };
        if v.get("error").is_some_and(|e| !e.is_null()) {
            self.error = true;
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            self.prompt_tokens = u["prompt_tokens"].as_u64().map(|n| n as usize).or(self.prompt_tokens);
            self.completion_tokens = u["completion_tokens"].as_u64().map(|n| n as usize).or(self.completion_tokens);
        }
        let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else { return };
        let nonempty = |x: &serde_json::Value| x.as_str().is_some_and(|s| !s.is_empty());
        let delta = &choice["delta"];
        if nonempty(&choice["text"]) || nonempty(&delta["content"]) || nonempty(&delta["reasoning_content"]) || delta.get("tool_calls").is_some_and(|t| !t.is_null()) {
            self.text_at.push(at);
        }
        if let Some(f) = choice.get("finish_reason").and_then(|f| f.as_str()) {
            self.finish_reason = Some(f.to_string());
        }
    }
}

/// Sends one streamed request and measures it.
pub async fn measure(target: &Target, spec: &ServeSpec, body: Vec<u8>, pass: usize, load: Load, id: usize, level_start: Instant) -> RequestRecord {
    let path = match spec.api {
        Api::Completions => "/v1/completions",
        Api::Chat => "/v1/chat/completions",
    };
    let sent = Instant::now();
    let tally = Arc::new(Mutex::new((SseParser::default(), StreamTally::default())));
    let t = tally.clone();
    let read = Read::Each(Box::new(move |at, bytes| {
        let mut g = t.lock().unwrap();
        let (parser, tally) = &mut *g;
        for ev in parser.push(bytes) {
            tally.feed(at, &ev.data);
        }
        true
    }));
    let auth = spec.api_key.as_ref().map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    let answer = http::send(&target.endpoint, "POST", path, &headers, Some(body), spec.timeout, read).await;
    let end = Instant::now();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let mut rec = RequestRecord { target: target.name.clone(), pass, load, id, sent_s: (sent - level_start).as_secs_f64(), ok: false, error: None, status: 0, prompt_tokens: None, output_tokens: 0, ttft_ms: None, tpot_ms: None, e2e_ms: ms(end - sent), finish_reason: None, itl_ms: Vec::new() };
    let failure = match answer {
        Err(f) => Some(f),
        Ok(a) => {
            rec.status = a.status;
            let g = tally.lock().unwrap();
            let tally = &g.1;
            rec.prompt_tokens = tally.prompt_tokens;
            rec.output_tokens = tally.completion_tokens.unwrap_or(tally.text_at.len());
            rec.finish_reason = tally.finish_reason.clone();
            rec.ttft_ms = tally.text_at.first().map(|&t| ms(t - sent));
            rec.itl_ms = tally.text_at.windows(2).map(|w| (ms(w[1] - w[0]) * 1000.0).round() / 1000.0).collect();
            if let (Some(&first), true) = (tally.text_at.first(), rec.output_tokens > 1) {
                rec.tpot_ms = Some(ms(end - first) / (rec.output_tokens - 1) as f64);
            }
            if a.status != 200 {
                Some(Failure::Status(a.status))
            } else if tally.error {
                Some(Failure::StreamError)
            } else if !tally.done && tally.finish_reason.is_none() {
                Some(Failure::Incomplete)
            } else {
                None
            }
        }
    };
    rec.ok = failure.is_none();
    rec.error = failure.map(|f| f.kind());
    rec
}

/// The model a server serves: the first id of its `/v1/models`.
pub async fn served_model(ep: &Endpoint, api_key: Option<&str>) -> Result<String, String> {
    let auth = api_key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    let a = http::send(ep, "GET", "/v1/models", &headers, None, Duration::from_secs(30), Read::All).await.map_err(|f| format!("{}: GET /v1/models: {}", ep.url(""), f.kind()))?;
    let v = a.json().ok_or_else(|| format!("{}: /v1/models: not JSON (HTTP {})", ep.url(""), a.status))?;
    v["data"][0]["id"].as_str().map(str::to_string).ok_or_else(|| format!("{}: /v1/models lists no model", ep.url("")))
}

/// Runs one level: `n` requests at `load` against `target`. Returns the level's wall time and requests.
pub async fn run_level(target: &Target, spec: &ServeSpec, pass: usize, load: Load, n: usize, first_id: usize) -> (f64, f64, Vec<RequestRecord>) {
    let start_unix_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    let start = Instant::now();
    let records = Arc::new(Mutex::new(Vec::with_capacity(n)));
    let mut tasks = tokio::task::JoinSet::new();
    let body = |id: usize| serde_json::to_vec(&request_body(target, spec.api, &prompt_for(&spec.prompts, spec.seed, id), spec.ignore_eos)).unwrap_or_default();
    match load {
        Load::Concurrency(c) => {
            let next = Arc::new(AtomicUsize::new(0));
            // bodies made up front (no prompt building while measuring), unless a duration bounds the level
            let bodies: Arc<Vec<Vec<u8>>> = Arc::new((0..n.min(if spec.duration.is_some() { 20_000 } else { n })).map(|i| body(first_id + i)).collect());
            for _ in 0..c.min(n) {
                let (next, bodies, records, target, spec) = (next.clone(), bodies.clone(), records.clone(), target.clone(), spec.clone());
                tasks.spawn(async move {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= bodies.len() || spec.duration.is_some_and(|d| start.elapsed() >= d) {
                            break;
                        }
                        let r = measure(&target, &spec, bodies[i].clone(), pass, load, first_id + i, start).await;
                        records.lock().unwrap().push(r);
                    }
                });
            }
        }
        Load::Rate(rate) => {
            // exponential gaps from a seeded generator: the same arrival times in every pass
            let mut rng = Rng::new(spec.seed ^ 0x5eed ^ (rate.to_bits()));
            let (mut at, constant) = (0.0f64, spec.constant_arrivals);
            for i in 0..n {
                if spec.duration.is_some_and(|d| at >= d.as_secs_f64()) {
                    break;
                }
                let (records, target, spec, b) = (records.clone(), target.clone(), spec.clone(), body(first_id + i));
                let when = start + Duration::from_secs_f64(at);
                tasks.spawn(async move {
                    tokio::time::sleep_until(when.into()).await;
                    let r = measure(&target, &spec, b, pass, load, first_id + i, start).await;
                    records.lock().unwrap().push(r);
                });
                at += if constant { 1.0 / rate } else { -(1.0 - rng.next_f64()).ln() / rate };
            }
        }
    }
    while tasks.join_next().await.is_some() {}
    let duration = start.elapsed().as_secs_f64();
    let mut recs = std::mem::take(&mut *records.lock().unwrap());
    recs.sort_by_key(|r| r.id);
    (start_unix_s, duration, recs)
}

/// Runs every level of every pass; `on_level` gets each level's summary and requests as they finish.
pub fn run(spec: &ServeSpec, mut on_level: impl FnMut(&LevelRecord, &[RequestRecord])) -> Result<Vec<LevelRecord>, LabError> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        // distinct ids (so distinct prompts) for every request of the run, warm-up included
        let mut next_id = 0usize;
        for t in &spec.targets {
            let (_, _, warm) = run_level(t, spec, 0, Load::Concurrency(1), spec.warmup, next_id).await;
            next_id += spec.warmup;
            if let Some(bad) = warm.iter().find(|r| !r.ok) {
                return Err(LabError::Request(format!("{}: the warm-up request failed: {} (HTTP {})", t.name, bad.error.clone().unwrap_or_default(), bad.status)));
            }
        }
        let mut levels = Vec::new();
        for pass in 0..spec.passes {
            for (li, &load) in spec.loads.iter().enumerate() {
                let n = spec.requests_at(load);
                // A B, B A, ...: along the levels and from pass to pass, so drift hits every target
                let mut order: Vec<&Target> = spec.targets.iter().collect();
                if (pass + li) % 2 == 1 {
                    order.reverse();
                }
                for t in order {
                    let (at, d, reqs) = run_level(t, spec, pass, load, n, next_id).await;
                    next_id += n;
                    let l = level(spec, &t.name, pass, load, at, d, &reqs);
                    on_level(&l, &reqs);
                    levels.push(l);
                }
            }
        }
        Ok(levels)
    })
}

/// A (target, load) over passes.
#[derive(Clone, Debug, Serialize)]
pub struct ServeRow {
    pub target: String,
    pub load: Load,
    pub requests_per_s: Summary,
    pub output_tokens_per_s: Summary,
    /// Output tok/s over the first target's at the same load in the same pass (per-pass ratios).
    pub vs_first: Option<Summary>,
    pub goodput_per_s: Option<Summary>,
    pub goodput_share: Option<Summary>,
    /// Medians over passes of each pass's percentile.
    pub ttft_ms: Percentiles,
    pub itl_ms: Percentiles,
    pub tpot_ms: Percentiles,
    pub e2e_ms: Percentiles,
    pub errors: BTreeMap<String, usize>,
    pub requests: usize,
    pub usd_per_m_output: Option<f64>,
}

pub fn rows(levels: &[LevelRecord]) -> Vec<ServeRow> {
    let mut keys: Vec<(String, Load)> = Vec::new();
    for l in levels {
        if !keys.iter().any(|(t, ld)| *t == l.target && *ld == l.load) {
            keys.push((l.target.clone(), l.load));
        }
    }
    let first = levels.first().map(|l| l.target.clone()).unwrap_or_default();
    let med = |xs: Vec<f64>| summarize(&xs.into_iter().filter(|x| x.is_finite()).collect::<Vec<_>>());
    let pct = |ls: &[&LevelRecord], f: fn(&LevelRecord) -> Percentiles| {
        let m = |g: fn(&Percentiles) -> f64| med(ls.iter().map(|l| g(&f(l))).collect()).map_or(f64::NAN, |s| s.median);
        Percentiles { p50: m(|p| p.p50), p90: m(|p| p.p90), p99: m(|p| p.p99), mean: m(|p| p.mean) }
    };
    let mut out: Vec<ServeRow> = keys
        .into_iter()
        .map(|(target, load)| {
            let ls: Vec<&LevelRecord> = levels.iter().filter(|l| l.target == target && l.load == load).collect();
            let vs_first = (target != first).then(|| {
                let ratios: Vec<f64> = ls.iter().filter_map(|l| levels.iter().find(|f| f.target == first && f.load == load && f.pass == l.pass).map(|f| l.output_tokens_per_s / f.output_tokens_per_s)).collect();
                med(ratios)
            });
            let mut errors = BTreeMap::new();
            for l in &ls {
                for (k, v) in &l.errors {
                    *errors.entry(k.clone()).or_insert(0) += v;
                }
            }
            let tps = med(ls.iter().map(|l| l.output_tokens_per_s).collect());
            ServeRow {
                requests_per_s: med(ls.iter().map(|l| l.requests_per_s).collect()).unwrap_or(Summary { median: 0.0, min: 0.0, max: 0.0, n: 0 }),
                output_tokens_per_s: tps.unwrap_or(Summary { median: 0.0, min: 0.0, max: 0.0, n: 0 }),
                vs_first: vs_first.flatten(),
                goodput_per_s: med(ls.iter().filter_map(|l| l.goodput_per_s).collect()),
                goodput_share: med(ls.iter().filter_map(|l| l.goodput_share).collect()),
                ttft_ms: pct(&ls, |l| l.ttft_ms),
                itl_ms: pct(&ls, |l| l.itl_ms),
                tpot_ms: pct(&ls, |l| l.tpot_ms),
                e2e_ms: pct(&ls, |l| l.e2e_ms),
                requests: ls.iter().map(|l| l.requests).sum(),
                usd_per_m_output: med(ls.iter().filter_map(|l| l.usd_per_m_output).collect()).map(|s| s.median),
                errors,
                target,
                load,
            }
        })
        .collect();
    out.sort_by(|a, b| a.target.cmp(&b.target).then(a.load.x().total_cmp(&b.load.x())));
    // the first target's rows first, as measured
    out.sort_by_key(|r| r.target != first);
    out
}

fn span(s: &Summary, digits: usize) -> String {
    format!("{:.*} ({:.*}-{:.*})", digits, s.median, digits, s.min, digits, s.max)
}

pub fn markdown(rows: &[ServeRow]) -> String {
    let mut t = String::new();
    let first = rows.first().map(|r| r.target.as_str()).unwrap_or("");
    let slo = rows.iter().any(|r| r.goodput_per_s.is_some());
    let price = rows.iter().any(|r| r.usd_per_m_output.is_some());
    let _ = write!(t, "| target | load | req/s | output tok/s | x {first} |");
    if slo {
        t.push_str(" goodput req/s | within SLO |");
    }
    t.push_str(" TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | TPOT p50 / p99 ms | E2E p50 / p99 ms | errors |");
    if price {
        t.push_str(" $/M output tokens |");
    }
    t.push('\n');
    let cols = 10 + if slo { 2 } else { 0 } + usize::from(price);
    t.push_str(&"|---".repeat(cols));
    t.push_str("|\n");
    for r in rows {
        let vs = r.vs_first.as_ref().map_or("1.00x".to_string(), |s| format!("{:.2}x ({:.2}-{:.2})", s.median, s.min, s.max));
        let _ = write!(t, "| {} | {} | {} | {} | {vs} |", r.target, r.load.label(), span(&r.requests_per_s, 2), span(&r.output_tokens_per_s, 1));
        if slo {
            let g = r.goodput_per_s.as_ref().map_or("—".into(), |s| span(s, 2));
            let share = r.goodput_share.as_ref().map_or("—".into(), |s| format!("{:.0}%", s.median * 100.0));
            let _ = write!(t, " {g} | {share} |");
        }
        let errors = if r.errors.is_empty() { format!("0 of {}", r.requests) } else { r.errors.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ") + &format!(" of {}", r.requests) };
        let _ = write!(
            t,
            " {:.0} / {:.0} / {:.0} | {:.1} / {:.1} / {:.1} | {:.1} / {:.1} | {:.0} / {:.0} | {errors} |",
            r.ttft_ms.p50, r.ttft_ms.p90, r.ttft_ms.p99, r.itl_ms.p50, r.itl_ms.p90, r.itl_ms.p99, r.tpot_ms.p50, r.tpot_ms.p99, r.e2e_ms.p50, r.e2e_ms.p99
        );
        if price {
            let _ = write!(t, " {} |", r.usd_per_m_output.map_or("—".into(), |p| format!("{p:.2}")));
        }
        t.push('\n');
    }
    t
}

/// Two plots: output tok/s against load, and TTFT / ITL p99 against load, a line per target.
pub fn plot(rows: &[ServeRow], title: &str, dir: &std::path::Path) -> Result<(), LabError> {
    use plotters::prelude::*;
    let err = |e: &dyn std::fmt::Display| LabError::Plot(e.to_string());
    let rate = rows.iter().any(|r| matches!(r.load, Load::Rate(_)));
    let x_desc = if rate { "offered load (requests/s, Poisson)" } else { "concurrent clients" };
    let xmax = rows.iter().map(|r| r.load.x()).fold(1.0, f64::max) * 1.05;
    let mut targets: Vec<&str> = Vec::new();
    for r in rows {
        if !targets.contains(&r.target.as_str()) {
            targets.push(&r.target);
        }
    }
    let colors = [RED, BLUE, GREEN, MAGENTA, CYAN, BLACK];
    type Pick = fn(&ServeRow) -> f64;
    let figures: [(&str, &str, Vec<(&str, Pick)>); 2] = [
        ("throughput.svg", "output tokens/s (median over passes)", vec![("", |r: &ServeRow| r.output_tokens_per_s.median)]),
        ("latency.svg", "p99 ms (median over passes)", vec![("TTFT p99", |r: &ServeRow| r.ttft_ms.p99), ("ITL p99", |r: &ServeRow| r.itl_ms.p99)]),
    ];
    for (file, y_desc, series) in figures {
        let path = dir.join(file);
        let root = SVGBackend::new(&path, (800, 450)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| err(&e))?;
        let ymax = rows.iter().flat_map(|r| series.iter().map(move |(_, f)| f(r))).filter(|y| y.is_finite()).fold(1.0, f64::max) * 1.1;
        let mut chart = ChartBuilder::on(&root).caption(title, ("sans-serif", 15)).margin(12).x_label_area_size(35).y_label_area_size(60).build_cartesian_2d(0.0..xmax, 0.0..ymax).map_err(|e| err(&e))?;
        chart.configure_mesh().x_desc(x_desc).y_desc(y_desc).draw().map_err(|e| err(&e))?;
        for (i, t) in targets.iter().enumerate() {
            let color = colors[i % colors.len()];
            for (j, (name, f)) in series.iter().enumerate() {
                let pts: Vec<(f64, f64)> = rows.iter().filter(|r| r.target == *t).map(|r| (r.load.x(), f(r))).filter(|p| p.1.is_finite()).collect();
                let label = if name.is_empty() { t.to_string() } else { format!("{t} {name}") };
                let style = color.stroke_width(if j == 0 { 2 } else { 1 });
                chart.draw_series(LineSeries::new(pts.clone(), style)).map_err(|e| err(&e))?.label(label).legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], style));
                chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled()))).map_err(|e| err(&e))?;
            }
        }
        chart.configure_series_labels().position(SeriesLabelPosition::UpperLeft).border_style(BLACK).background_style(WHITE).draw().map_err(|e| err(&e))?;
        root.present().map_err(|e| err(&e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        let p = percentiles(&xs);
        assert_eq!((p.p50, p.p90, p.p99, p.mean), (50.0, 90.0, 99.0, 50.5));
        assert!(percentiles(&[]).p50.is_nan());
        assert_eq!(percentiles(&[7.0]).p99, 7.0);
    }

    #[test]
    fn prompts_are_distinct_and_fixed_by_the_seed() {
        let p = Prompts::Fixed { prompt_words: 20, output_tokens: 8 };
        assert_eq!(prompt_for(&p, 1, 3), prompt_for(&p, 1, 3));
        assert_ne!(prompt_for(&p, 1, 3).text, prompt_for(&p, 1, 4).text);
        assert_eq!(prompt_for(&p, 1, 3).text.split(' ').count(), 20);
        assert!(prompt_for(&p, 1, 3).text.starts_with("3. "));
    }

    #[test]
    fn sharegpt_and_prompt_files() {
        let sharegpt = r#"[{"conversations":[{"from":"system","value":"s"},{"from":"human","value":"hi there"},{"from":"gpt","value":"0123456789abcdefghij"}]},
            {"conversations":[{"from":"human","value":"only a question"}]}]"#;
        let d = read_dataset(sharegpt, 1000).unwrap();
        assert_eq!(d, vec![Prompt { text: "hi there".into(), output_tokens: 5 }]);
        let jsonl = "{\"prompt\": \"a\", \"output_tokens\": 9000}\n\n{\"prompt\": \"b\", \"output_tokens\": 1}\n";
        let d = read_dataset(jsonl, 256).unwrap();
        assert_eq!(d.iter().map(|p| p.output_tokens).collect::<Vec<_>>(), vec![256, 4]);
        assert!(read_dataset("[]", 10).is_err());
        assert!(read_dataset("{\"x\":1}\nnot json", 10).unwrap_err().contains("line 2"));
    }

    #[test]
    fn stream_tally_reads_both_shapes() {
        let now = Instant::now();
        let mut t = StreamTally::default();
        t.feed(now, r#"{"choices":[{"text":"","finish_reason":null}]}"#);
        t.feed(now, r#"{"choices":[{"text":"a","finish_reason":null}]}"#);
        t.feed(now, r#"{"choices":[{"delta":{"content":"b"},"finish_reason":"length"}]}"#);
        t.feed(now, r#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}"#);
        t.feed(now, "[DONE]");
        assert_eq!((t.text_at.len(), t.prompt_tokens, t.completion_tokens, t.finish_reason.as_deref(), t.done, t.error), (2, Some(7), Some(2), Some("length"), true, false));
        let mut e = StreamTally::default();
        e.feed(now, r#"{"error":{"message":"x"}}"#);
        assert!(e.error);
    }

    fn rec(ok: bool, ttft: f64, tpot: f64, out: usize) -> RequestRecord {
        RequestRecord { target: "a".into(), pass: 0, load: Load::Concurrency(2), id: 0, sent_s: 0.0, ok, error: (!ok).then(|| "http_429".into()), status: if ok { 200 } else { 429 }, prompt_tokens: Some(10), output_tokens: out, ttft_ms: Some(ttft), tpot_ms: Some(tpot), e2e_ms: ttft + tpot * out as f64, finish_reason: None, itl_ms: vec![tpot; out.saturating_sub(1)] }
    }

    #[test]
    fn goodput_counts_requests_within_every_slo() {
        let spec = ServeSpec { targets: vec![], loads: vec![], requests: 0, passes: 1, warmup: 0, prompts: Prompts::Fixed { prompt_words: 1, output_tokens: 1 }, api: Api::Completions, ignore_eos: true, api_key: None, timeout: Duration::from_secs(1), slo_ttft_ms: Some(100.0), slo_tpot_ms: Some(10.0), price_per_hour: Some(3.6), seed: 1, duration: None, constant_arrivals: false };
        let reqs = vec![rec(true, 50.0, 5.0, 100), rec(true, 150.0, 5.0, 100), rec(true, 50.0, 20.0, 100), rec(false, 0.0, 0.0, 0)];
        let l = level(&spec, "a", 0, Load::Concurrency(2), 0.0, 2.0, &reqs);
        assert_eq!((l.ok, l.errors.get("http_429").copied(), l.goodput_per_s, l.goodput_share), (3, Some(1), Some(0.5), Some(0.25)));
        assert_eq!(l.output_tokens_per_s, 150.0);
        // $3.6/hour = $0.001/s; at 150 tok/s a million tokens take 6667 s
        assert!((l.usd_per_m_output.unwrap() - 6.6667).abs() < 1e-3);
        assert_eq!(requests_in(&spec), (16, 16, 40));
    }

    fn requests_in(spec: &ServeSpec) -> (usize, usize, usize) {
        (spec.requests_at(Load::Concurrency(1)), spec.requests_at(Load::Concurrency(4)), spec.requests_at(Load::Rate(2.0)))
    }

    #[test]
    fn rows_pair_passes_with_the_first_target() {
        let spec = ServeSpec { targets: vec![], loads: vec![], requests: 0, passes: 2, warmup: 0, prompts: Prompts::Fixed { prompt_words: 1, output_tokens: 1 }, api: Api::Completions, ignore_eos: true, api_key: None, timeout: Duration::from_secs(1), slo_ttft_ms: None, slo_tpot_ms: None, price_per_hour: None, seed: 1, duration: None, constant_arrivals: false };
        let reqs = |n: usize| (0..n).map(|_| rec(true, 10.0, 1.0, 10)).collect::<Vec<_>>();
        let c = Load::Concurrency(2);
        let levels = vec![level(&spec, "a", 0, c, 0.0, 1.0, &reqs(10)), level(&spec, "b", 0, c, 0.0, 1.0, &reqs(20)), level(&spec, "b", 1, c, 0.0, 1.0, &reqs(30)), level(&spec, "a", 1, c, 0.0, 1.0, &reqs(10))];
        let rows = rows(&levels);
        assert_eq!(rows.iter().map(|r| r.target.as_str()).collect::<Vec<_>>(), vec!["a", "b"]);
        let vs = rows[1].vs_first.unwrap();
        assert_eq!((vs.median, vs.min, vs.max), (2.5, 2.0, 3.0));
        assert!(markdown(&rows).contains("| b | 2 clients | 25.00 (20.00-30.00) | 250.0 (200.0-300.0) | 2.50x (2.00-3.00) |"), "{}", markdown(&rows));
    }
}

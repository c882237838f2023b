//! `reckon lab soak`: many clients misbehaving for a bounded time, then an account of every request.
//! Each client sends, until the deadline, requests drawn from a seeded generator: one of the four APIs
//! (chat, completions, responses, messages), streamed (two thirds) or not, half of the streamed ones
//! hung up after a few events (a third of all requests), some with stop strings, some sampled with a
//! seed, prompts of random length up to the context (the longer ones must be refused cleanly).
//!
//! Every request ends in one of four ways: complete (the API's whole answer: `[DONE]`,
//! `response.completed`, `message_stop`, or a body in the API's shape), a clean error (an error status
//! with a body in the API's error shape, or an error event ending a stream), hung up (by the client, on
//! purpose), or failed (anything else: no connection, a timeout, a stream cut without its end, a 5xx
//! other than 503, an error body not in the API's shape). A soak passes with no failure.
//!
//! `overload` sends a flood at once and checks it gets only successes and 429s; `health_probe` measures
//! how fast `/health` answers meanwhile.

use crate::http::{self, Endpoint, Failure, Read, SseParser};
use reckon_engine::sampler::Rng;
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct SoakSpec {
    pub endpoint: Endpoint,
    pub model: String,
    pub clients: usize,
    pub duration: Duration,
    /// Prompts are 1..=this many words (about a token each for BPE vocabularies).
    pub max_prompt_words: usize,
    /// Requests ask for 1..=this many tokens.
    pub max_tokens: usize,
    pub api_key: Option<String>,
    pub seed: u64,
    /// A request that takes longer fails (a hang).
    pub timeout: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum SoakApi {
    Chat,
    Completions,
    Responses,
    Messages,
}

impl SoakApi {
    pub const ALL: [SoakApi; 4] = [SoakApi::Chat, SoakApi::Completions, SoakApi::Responses, SoakApi::Messages];
    pub fn path(self) -> &'static str {
        match self {
            SoakApi::Chat => "/v1/chat/completions",
            SoakApi::Completions => "/v1/completions",
            SoakApi::Responses => "/v1/responses",
            SoakApi::Messages => "/v1/messages",
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            SoakApi::Chat => "chat",
            SoakApi::Completions => "completions",
            SoakApi::Responses => "responses",
            SoakApi::Messages => "messages",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub enum Outcome {
    Complete,
    CleanError,
    HungUp,
    Failed,
}

/// One request of the soak, as drawn and as it ended.
#[derive(Clone, Debug, Serialize)]
pub struct SoakRequest {
    pub client: usize,
    pub seq: usize,
    pub api: SoakApi,
    pub stream: bool,
    /// Hang up after this many events.
    pub hang_up_after: Option<usize>,
    pub stop: bool,
    pub seeded: bool,
    pub prompt_words: usize,
    /// Tokens asked for at most (0: none given, up to the context).
    pub max_tokens: usize,
    pub outcome: Outcome,
    pub status: u16,
    /// Why it failed or what the error said.
    pub detail: Option<String>,
    pub ms: f64,
}

/// Draws client `client`'s request number `seq`.
pub fn draw(spec: &SoakSpec, client: usize, seq: usize) -> (SoakRequest, serde_json::Value) {
    let mut rng = Rng::new(spec.seed ^ ((client as u64) << 32) ^ (seq as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut pick = |n: usize| (rng.next_u64() % n as u64) as usize;
    let api = SoakApi::ALL[pick(4)];
    let stream = pick(3) != 0;
    let hang_up_after = (stream && pick(2) == 0).then(|| 1 + pick(8));
    let stop = pick(4) == 0;
    let seeded = pick(4) == 0;
    // lengths skewed short (most requests are), with a tail to the context and past it
    let prompt_words = if pick(4) == 0 { 1 + pick(spec.max_prompt_words.max(1)) } else { 1 + pick((spec.max_prompt_words / 16).max(1)) };
    let max_tokens = 1 + pick(spec.max_tokens.max(1));
    let words = crate::serve::prompt_for(&crate::serve::Prompts::Fixed { prompt_words, output_tokens: max_tokens }, spec.seed, client * 1_000_000 + seq).text;
    let mut body = match api {
        SoakApi::Chat => serde_json::json!({"model": spec.model, "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens}),
        SoakApi::Completions => serde_json::json!({"model": spec.model, "prompt": words, "max_tokens": max_tokens}),
        SoakApi::Responses => serde_json::json!({"model": spec.model, "input": words, "max_output_tokens": max_tokens}),
        SoakApi::Messages => serde_json::json!({"model": spec.model, "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens}),
    };
    body["stream"] = stream.into();
    if stop {
        let key = if api == SoakApi::Messages { "stop_sequences" } else { "stop" };
        if api != SoakApi::Responses {
            body[key] = serde_json::json!(["e", " the"]);
        }
    }
    if seeded {
        body["temperature"] = 0.8.into();
        if api != SoakApi::Messages && api != SoakApi::Responses {
            body["seed"] = (seq as u64).into();
        }
    } else {
        body["temperature"] = 0.into();
    }
    let req = SoakRequest { client, seq, api, stream, hang_up_after, stop, seeded, prompt_words, max_tokens, outcome: Outcome::Failed, status: 0, detail: None, ms: 0.0 };
    (req, body)
}

/// Whether an error body is in the API's own error shape.
fn error_shape(api: SoakApi, body: &serde_json::Value) -> bool {
    let err = &body["error"];
    match api {
        SoakApi::Messages => body["type"] == "error" && err["type"].is_string() && err["message"].is_string(),
        _ => err["message"].is_string() && err["type"].is_string(),
    }
}

/// Whether a 200 body is the API's whole answer.
fn answer_shape(api: SoakApi, body: &serde_json::Value) -> bool {
    match api {
        SoakApi::Chat => body["choices"][0]["message"].is_object() && body["choices"][0]["finish_reason"].is_string(),
        SoakApi::Completions => body["choices"][0]["text"].is_string() && body["choices"][0]["finish_reason"].is_string(),
        SoakApi::Responses => body["output"].is_array() && matches!(body["status"].as_str(), Some("completed" | "incomplete")),
        SoakApi::Messages => body["type"] == "message" && body["content"].is_array() && body["stop_reason"].is_string(),
    }
}

/// How a stream ended, from its events.
#[derive(Default)]
struct StreamEnd {
    events: usize,
    done: bool,
    error: Option<String>,
}

impl StreamEnd {
    fn feed(&mut self, api: SoakApi, ev: &http::SseEvent) {
        self.events += 1;
        let v: serde_json::Value = serde_json::from_str(&ev.data).unwrap_or_default();
        match api {
            SoakApi::Chat | SoakApi::Completions => {
                if ev.data.trim() == "[DONE]" {
                    self.done = true;
                } else if v.get("error").is_some_and(|e| !e.is_null()) {
                    self.error = Some(v["error"]["message"].as_str().unwrap_or("?").to_string());
                }
            }
            SoakApi::Responses => match v["type"].as_str() {
                Some("response.completed" | "response.incomplete") => self.done = true,
                Some("response.failed" | "error") => self.error = Some(v["response"]["error"]["message"].as_str().or(v["message"].as_str()).unwrap_or("?").to_string()),
                _ => {}
            },
            SoakApi::Messages => match ev.event.as_deref().or(v["type"].as_str()) {
                Some("message_stop") => self.done = true,
                Some("error") => self.error = Some(v["error"]["message"].as_str().unwrap_or("?").to_string()),
                _ => {}
            },
        }
    }
}

/// Sends one drawn request and classifies how it ended.
pub async fn send(spec: &SoakSpec, mut req: SoakRequest, body: serde_json::Value) -> SoakRequest {
    let start = Instant::now();
    let api = req.api;
    let end = Arc::new(Mutex::new((SseParser::default(), StreamEnd::default(), false)));
    let read = if req.stream {
        let (e, hang) = (end.clone(), req.hang_up_after);
        Read::Each(Box::new(move |_, bytes| {
            let mut g = e.lock().unwrap();
            let (parser, end, hung) = &mut *g;
            for ev in parser.push(bytes) {
                end.feed(api, &ev);
            }
            if hang.is_some_and(|k| end.events >= k) && !end.done && end.error.is_none() {
                *hung = true;
                return false;
            }
            true
        }))
    } else {
        Read::All
    };
    let auth = spec.api_key.as_ref().map(|k| format!("Bearer {k}"));
    let mut headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    if api == SoakApi::Messages {
        headers.push(("anthropic-version", "2023-06-01"));
    }
    let answer = http::send(&spec.endpoint, "POST", api.path(), &headers, Some(serde_json::to_vec(&body).unwrap_or_default()), spec.timeout, read).await;
    req.ms = start.elapsed().as_secs_f64() * 1e3;
    let (outcome, detail) = match answer {
        Err(f) => (Outcome::Failed, Some(f.kind())),
        Ok(a) => {
            req.status = a.status;
            let g = end.lock().unwrap();
            let (_, stream_end, hung) = &*g;
            if a.status != 200 {
                let body = a.json().unwrap_or_default();
                let shaped = error_shape(api, &body);
                let msg = body["error"]["message"].as_str().map(str::to_string);
                if shaped && (a.status < 500 || a.status == 503) {
                    (Outcome::CleanError, msg)
                } else {
                    (Outcome::Failed, Some(format!("{}: {}", Failure::Status(a.status).kind(), String::from_utf8_lossy(&a.body()).chars().take(200).collect::<String>())))
                }
            } else if *hung {
                (Outcome::HungUp, None)
            } else if req.stream {
                match (&stream_end.error, stream_end.done) {
                    (Some(e), _) => (Outcome::CleanError, Some(e.clone())),
                    (None, true) => (Outcome::Complete, None),
                    (None, false) => (Outcome::Failed, Some(format!("{} after {} events", Failure::Incomplete.kind(), stream_end.events))),
                }
            } else {
                match a.json() {
                    Some(v) if answer_shape(api, &v) => (Outcome::Complete, None),
                    _ => (Outcome::Failed, Some(format!("not a whole answer: {}", String::from_utf8_lossy(&a.body()).chars().take(200).collect::<String>()))),
                }
            }
        }
    };
    req.outcome = outcome;
    req.detail = detail;
    req
}

/// What a soak saw.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SoakReport {
    pub requests: usize,
    pub duration_s: f64,
    pub outcomes: BTreeMap<String, usize>,
    /// Per API, outcome counts.
    pub by_api: BTreeMap<String, BTreeMap<String, usize>>,
    /// Clean errors by status (0: an error event in a stream).
    pub clean_errors_by_status: BTreeMap<u16, usize>,
    /// The first failures, whole.
    pub failures: Vec<SoakRequest>,
    pub failed: usize,
    /// `/health` probed once a second meanwhile: the slowest answer, ms, and probes that failed.
    pub health_max_ms: f64,
    pub health_failures: usize,
}

fn key(o: Outcome) -> String {
    format!("{o:?}")
}

pub fn report(requests: &[SoakRequest], duration_s: f64, health: &[Option<f64>]) -> SoakReport {
    let mut r = SoakReport { requests: requests.len(), duration_s, ..Default::default() };
    for q in requests {
        *r.outcomes.entry(key(q.outcome)).or_default() += 1;
        *r.by_api.entry(q.api.name().into()).or_default().entry(key(q.outcome)).or_default() += 1;
        if q.outcome == Outcome::CleanError {
            *r.clean_errors_by_status.entry(if q.status == 200 { 0 } else { q.status }).or_default() += 1;
        }
        if q.outcome == Outcome::Failed {
            r.failed += 1;
            if r.failures.len() < 20 {
                r.failures.push(q.clone());
            }
        }
    }
    r.health_max_ms = health.iter().flatten().copied().fold(0.0, f64::max);
    r.health_failures = health.iter().filter(|h| h.is_none()).count();
    r
}

/// Probes `/health` from a thread of its own (so the load generator's own work never delays a probe)
/// every `every` until `stop` is set: each answer's time in ms, None for a failure (not 200 or 503, or no
/// answer within 5 s).
pub fn spawn_probe(ep: Endpoint, every: Duration, stop: Arc<std::sync::atomic::AtomicBool>) -> std::thread::JoinHandle<Vec<Option<f64>>> {
    std::thread::spawn(move || match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt.block_on(health_probe(ep, every, stop)),
        Err(_) => vec![None],
    })
}

async fn health_probe(ep: Endpoint, every: Duration, stop: Arc<std::sync::atomic::AtomicBool>) -> Vec<Option<f64>> {
    let mut out = Vec::new();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let t = Instant::now();
        let a = http::send(&ep, "GET", "/health", &[], None, Duration::from_secs(5), Read::All).await;
        out.push(a.ok().filter(|a| a.status == 200 || a.status == 503).map(|_| t.elapsed().as_secs_f64() * 1e3));
        tokio::time::sleep(every.saturating_sub(t.elapsed())).await;
    }
    out
}

/// Runs the soak; `on_request` sees each request as it ends.
pub async fn run(spec: &SoakSpec, on_request: impl FnMut(&SoakRequest) + Send + 'static) -> SoakReport {
    let start = Instant::now();
    let deadline = start + spec.duration;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let probe = spawn_probe(spec.endpoint.clone(), Duration::from_secs(1), stop.clone());
    let sink = Arc::new(Mutex::new((Vec::new(), on_request)));
    let mut clients = tokio::task::JoinSet::new();
    for c in 0..spec.clients {
        let (spec, sink) = (spec.clone(), sink.clone());
        clients.spawn(async move {
            let mut seq = 0;
            while Instant::now() < deadline {
                let (req, body) = draw(&spec, c, seq);
                let done = send(&spec, req, body).await;
                let mut g = sink.lock().unwrap();
                (g.1)(&done);
                g.0.push(done);
                seq += 1;
            }
        });
    }
    while clients.join_next().await.is_some() {}
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let health = probe.join().unwrap_or_default();
    let requests = std::mem::take(&mut sink.lock().unwrap().0);
    report(&requests, start.elapsed().as_secs_f64(), &health)
}

/// A flood: `n` streamed chat requests sent at once (each on its own connection). Counts answers by
/// status, and failures (no answer, a hang past the timeout) by kind, while `/health` is probed every
/// 50 ms.
#[derive(Clone, Debug, Default, Serialize)]
pub struct FloodReport {
    pub sent: usize,
    pub by_status: BTreeMap<u16, usize>,
    /// 429s that carried a `Retry-After`.
    pub retry_after: usize,
    pub failures: BTreeMap<String, usize>,
    pub duration_s: f64,
    pub health_max_ms: f64,
    pub health_probes: usize,
    pub health_failures: usize,
}

pub async fn flood(ep: &Endpoint, model: &str, n: usize, max_tokens: usize, timeout: Duration, api_key: Option<&str>) -> FloodReport {
    let start = Instant::now();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let probe = spawn_probe(ep.clone(), Duration::from_millis(50), stop.clone());
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..n {
        let (ep, auth) = (ep.clone(), api_key.map(|k| format!("Bearer {k}")));
        let body = serde_json::json!({"model": model, "messages": [{"role": "user", "content": format!("{i}. Tell me about rivers.")}], "max_tokens": max_tokens, "temperature": 0, "stream": true});
        tasks.spawn(async move {
            let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
            let a = http::send(&ep, "POST", "/v1/chat/completions", &headers, Some(body.to_string().into_bytes()), timeout, Read::All).await;
            match a {
                Err(f) => Err(f.kind()),
                Ok(a) => {
                    let text = String::from_utf8_lossy(&a.body()).into_owned();
                    if a.status == 200 && !text.contains("data: [DONE]") {
                        return Err("incomplete".to_string());
                    }
                    Ok((a.status, a.headers.contains_key("retry-after")))
                }
            }
        });
    }
    let mut r = FloodReport { sent: n, ..Default::default() };
    while let Some(res) = tasks.join_next().await {
        match res {
            Ok(Ok((status, retry))) => {
                *r.by_status.entry(status).or_default() += 1;
                r.retry_after += usize::from(status == 429 && retry);
            }
            Ok(Err(kind)) => *r.failures.entry(kind).or_default() += 1,
            Err(_) => *r.failures.entry("panic".into()).or_default() += 1,
        }
    }
    r.duration_s = start.elapsed().as_secs_f64();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let health = probe.join().unwrap_or_default();
    r.health_probes = health.len();
    r.health_max_ms = health.iter().flatten().copied().fold(0.0, f64::max);
    r.health_failures = health.iter().filter(|h| h.is_none()).count();
    r
}

/// One value of a Prometheus text exposition (the first sample of `name`, any labels).
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' '])).and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse().ok())
}

/// The total KV blocks from `vllm:cache_config_info`'s `num_gpu_blocks` label.
pub fn total_blocks(text: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with("vllm:cache_config_info{"))?;
    let at = line.find("num_gpu_blocks=\"")? + "num_gpu_blocks=\"".len();
    line[at..].split('"').next()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> SoakSpec {
        SoakSpec { endpoint: Endpoint::parse("http://127.0.0.1:1").unwrap(), model: "m".into(), clients: 64, duration: Duration::from_secs(1), max_prompt_words: 2048, max_tokens: 64, api_key: None, seed: 7, timeout: Duration::from_secs(5) }
    }

    #[test]
    fn the_mix_is_as_described() {
        let s = spec();
        let reqs: Vec<SoakRequest> = (0..64).flat_map(|c| (0..50).map(move |q| (c, q))).map(|(c, q)| draw(&s, c, q).0).collect();
        let share = |f: &dyn Fn(&SoakRequest) -> bool| reqs.iter().filter(|r| f(r)).count() as f64 / reqs.len() as f64;
        for api in SoakApi::ALL {
            assert!((share(&|r| r.api == api) - 0.25).abs() < 0.03, "{api:?}");
        }
        assert!((share(&|r| r.stream) - 2.0 / 3.0).abs() < 0.03);
        assert!((share(&|r| r.hang_up_after.is_some()) - 1.0 / 3.0).abs() < 0.03);
        assert!((share(&|r| r.stop) - 0.25).abs() < 0.03 && (share(&|r| r.seeded) - 0.25).abs() < 0.03);
        assert!(reqs.iter().any(|r| r.prompt_words > 1500) && reqs.iter().all(|r| r.prompt_words <= 2048));
        // the same draw for the same client and sequence number
        assert_eq!(draw(&s, 3, 9).1, draw(&s, 3, 9).1);
    }

    #[test]
    fn shapes_and_metrics() {
        assert!(error_shape(SoakApi::Chat, &serde_json::json!({"error": {"message": "m", "type": "invalid_request_error"}})));
        assert!(!error_shape(SoakApi::Messages, &serde_json::json!({"error": {"message": "m", "type": "invalid_request_error"}})));
        assert!(error_shape(SoakApi::Messages, &serde_json::json!({"type": "error", "error": {"message": "m", "type": "invalid_request_error"}})));
        assert!(answer_shape(SoakApi::Completions, &serde_json::json!({"choices": [{"text": "", "finish_reason": "length"}]})));
        assert!(!answer_shape(SoakApi::Chat, &serde_json::json!({"choices": []})));
        let text = "# HELP x\nreckon_kv_blocks_free{model_name=\"m\"} 12\nvllm:cache_config_info{model_name=\"m\",block_size=\"16\",num_gpu_blocks=\"40\",cache_dtype=\"f16\"} 1\nreckon_kv_blocks_free_x 3\n";
        assert_eq!((metric(text, "reckon_kv_blocks_free"), total_blocks(text)), (Some(12.0), Some(40.0)));
    }
}

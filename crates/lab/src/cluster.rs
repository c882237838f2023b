//! `reckon lab cluster`: several replicas behind a router, replaying `lab prefix`'s multi-session agent
//! workload under different routing policies, and failover when replicas die or drain mid-run.
//!
//! The replicas and the router are processes the binary starts; this module drives the sessions
//! (concurrent, each turn resending the whole history, streamed), keeps a KV-event index of what each
//! replica caches (`KvIndex`: the lab's own precise-prefix picker, as llm-d's indexer works: it
//! subscribes to every replica's stream and recomputes block keys from the events' token ids), and
//! summarizes per policy: prefix-cache hit rate from `cached_tokens`, TTFT, throughput, outcomes.

use crate::http::{self, Endpoint, Read, SseParser};
use crate::prefix::conversation;
use reckon_engine::template::{ChatMessage, ChatTemplate};
use reckon_engine::tokenizer::Tokenizer;
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The workload: `sessions` agent conversations of `turns` turns, run concurrently, each session's turns
/// in order. Each session has a system prompt of its own (another repository: its first line differs),
/// so what a replica caches for one session serves only that session's later turns.
#[derive(Clone, Debug)]
pub struct ClusterSpec {
    pub sessions: usize,
    pub turns: usize,
    pub prefix_tokens: usize,
    pub turn_tokens: (usize, usize),
    pub max_tokens: usize,
    pub model: String,
    pub timeout: Duration,
    /// Tokens per KV block of the replicas (what the KV-event index keys).
    pub block_size: usize,
    /// A client whose request failed with a visible error sends it again this many times.
    pub client_retries: usize,
}

/// Where a request goes: through a router, or to the replica the KV-event index picks.
#[derive(Clone)]
pub enum Route {
    /// Chat requests to a router.
    Router(Endpoint),
    /// The prompt rendered and tokenized by the client, sent as token ids to `/v1/completions` through a
    /// router that routes by token ids (vllm-router's `kv_aware`: its HTTP pools do not tokenize).
    RouterTokens { ep: Endpoint, tokenizer: Arc<Tokenizer>, template: Arc<ChatTemplate> },
    KvEvents { replicas: Vec<Endpoint>, index: Arc<KvIndex>, tokenizer: Arc<Tokenizer>, template: Arc<ChatTemplate> },
}

/// One request as the client saw it.
#[derive(Clone, Debug, Serialize)]
pub struct ClusterRecord {
    pub policy: String,
    pub pass: usize,
    pub session: usize,
    pub turn: usize,
    /// 1 for the first try; more when the client sent it again after a visible error.
    pub attempt: usize,
    /// Seconds from the start of the pass.
    pub start_s: f64,
    /// `ok`, or the failure the client saw (`status 503`, `connect`, `broken`, `timeout`, ...).
    pub outcome: String,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub ttft_s: Option<f64>,
    pub e2e_s: f64,
    /// KV-event routing: the replica picked and the prompt blocks its index said it held.
    pub replica: Option<usize>,
    pub predicted_blocks: Option<usize>,
}

/// Runs every session of the workload through `route`, concurrently; `on_record` sees each request.
/// `at_fraction` is called once with each fraction in `events` when that share of the workload's
/// requests has finished (the failover leg kills and drains replicas there).
pub async fn run(spec: &ClusterSpec, route: Route, policy: &str, pass: usize, tokenizer: &Arc<Tokenizer>, events: Vec<(f64, Box<dyn FnOnce() + Send>)>, on_record: impl Fn(&ClusterRecord) + Send + Sync + 'static) -> Vec<ClusterRecord> {
    let start = Instant::now();
    let total = spec.sessions * spec.turns;
    let done = Arc::new(AtomicUsize::new(0));
    let events = Arc::new(Mutex::new(events));
    let on_record = Arc::new(on_record);
    let mut tasks = Vec::new();
    for s in 0..spec.sessions {
        let (spec, route, policy, tok, done, events, on_record) = (spec.clone(), route.clone(), policy.to_string(), tokenizer.clone(), done.clone(), events.clone(), on_record.clone());
        tasks.push(tokio::spawn(async move {
            let system = format!("You work in the repository project-{s}.\n{}", conversation::system_prompt(&tok, spec.prefix_tokens, None).unwrap_or_default());
            let mut history: Vec<ChatMessage> = vec![ChatMessage::new("system", &system)];
            let mut out = Vec::new();
            for turn in 0..spec.turns {
                let user = conversation::user_turn(&tok, s, turn, spec.turn_tokens.0, spec.turn_tokens.1).unwrap_or_default();
                history.push(ChatMessage::new("user", &user));
                let mut reply = None;
                for attempt in 1..=1 + spec.client_retries {
                    let (rec, text) = one_request(&spec, &route, &policy, pass, s, turn, attempt, &history, start).await;
                    on_record(&rec);
                    let ok = rec.outcome == "ok";
                    out.push(rec);
                    if ok {
                        reply = Some(text);
                        break;
                    }
                }
                match reply {
                    Some(text) => history.push(ChatMessage::new("assistant", &text)),
                    // (the turn is given up: the session goes on without it)
                    None => {
                        history.pop();
                    }
                }
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                let due: Vec<Box<dyn FnOnce() + Send>> = {
                    let mut ev = events.lock().unwrap_or_else(|e| e.into_inner());
                    let (now, later): (Vec<_>, Vec<_>) = ev.drain(..).partition(|(f, _)| n as f64 >= f * total as f64);
                    *ev = later;
                    now.into_iter().map(|(_, f)| f).collect()
                };
                for f in due {
                    tokio::task::spawn_blocking(f);
                }
            }
            out
        }));
    }
    let mut records = Vec::new();
    for t in tasks {
        records.extend(t.await.unwrap_or_default());
    }
    records
}

#[allow(clippy::too_many_arguments)]
async fn one_request(spec: &ClusterSpec, route: &Route, policy: &str, pass: usize, session: usize, turn: usize, attempt: usize, messages: &[ChatMessage], start: Instant) -> (ClusterRecord, String) {
    let msgs: Vec<serde_json::Value> = messages.iter().map(|m| serde_json::json!({"role": m.role, "content": m.content})).collect();
    let mut body = serde_json::json!({"model": spec.model, "messages": msgs, "max_tokens": spec.max_tokens, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
    let mut path = "/v1/chat/completions";
    let (ep, replica, predicted) = match route {
        Route::Router(ep) => (ep.clone(), None, None),
        Route::RouterTokens { ep, tokenizer, template } => {
            let ids = template.render(messages, true).ok().and_then(|t| tokenizer.encode(&t, true, true).ok()).unwrap_or_default();
            body = serde_json::json!({"model": spec.model, "prompt": ids, "max_tokens": spec.max_tokens, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}});
            path = "/v1/completions";
            (ep.clone(), None, None)
        }
        Route::KvEvents { replicas, index, tokenizer, template } => {
            let keys = template.render(messages, true).ok().and_then(|t| tokenizer.encode(&t, true, true).ok()).map(|ids| KvIndex::prompt_keys(&ids, spec.block_size)).unwrap_or_default();
            let (r, blocks) = index.pick(&keys);
            (replicas[r].clone(), Some(r), Some(blocks))
        }
    };
    if let (Route::KvEvents { index, .. }, Some(r)) = (route, replica) {
        index.inflight[r].fetch_add(1, Ordering::Relaxed);
    }
    let t0 = Instant::now();
    let first = Arc::new(Mutex::new(None::<Instant>));
    let seen = first.clone();
    let mut sse = SseParser::default();
    let read = Read::Each(Box::new(move |at, bytes| {
        for e in sse.push(bytes) {
            // (the first token's text: a first chunk with the role and empty content is not one)
            let token = serde_json::from_str::<serde_json::Value>(&e.data).ok().and_then(|v| piece(&v).map(|c| !c.is_empty())).unwrap_or(false);
            if token {
                seen.lock().unwrap_or_else(|p| p.into_inner()).get_or_insert(at);
            }
        }
        true
    }));
    let answer = http::send(&ep, "POST", path, &[], Some(body.to_string().into_bytes()), spec.timeout, read).await;
    if let (Route::KvEvents { index, .. }, Some(r)) = (route, replica) {
        index.inflight[r].fetch_sub(1, Ordering::Relaxed);
    }
    let e2e_s = t0.elapsed().as_secs_f64();
    let mut rec = ClusterRecord {
        policy: policy.into(), pass, session, turn, attempt, start_s: (t0 - start).as_secs_f64(), outcome: String::new(),
        prompt_tokens: 0, cached_tokens: 0, completion_tokens: 0, ttft_s: None, e2e_s, replica, predicted_blocks: predicted,
    };
    let mut text = String::new();
    rec.outcome = match answer {
        Err(f) => format!("{f:?}").to_lowercase(),
        Ok(a) if a.status != 200 => format!("status {}", a.status),
        Ok(a) => {
            let (mut done, mut error) = (false, false);
            let mut p = SseParser::default();
            for e in p.push(&a.body()) {
                if e.data == "[DONE]" {
                    done = true;
                    continue;
                }
                let Ok(v) = serde_json::from_str::<serde_json::Value>(&e.data) else { continue };
                if v.get("error").is_some() {
                    error = true;
                }
                if let Some(c) = piece(&v) {
                    text.push_str(c);
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    rec.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as usize;
                    rec.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
                    rec.cached_tokens = u.pointer("/prompt_tokens_details/cached_tokens").and_then(|c| c.as_u64()).unwrap_or(0) as usize;
                }
            }
            if error { "stream error".into() } else if !done { "incomplete".into() } else { "ok".into() }
        }
    };
    rec.ttft_s = first.lock().unwrap_or_else(|p| p.into_inner()).map(|f| (f - t0).as_secs_f64());
    (rec, text)
}

/// A streamed chunk's text: a chat delta's content, or a completion's text.
fn piece(v: &serde_json::Value) -> Option<&str> {
    v.pointer("/choices/0/delta/content").or_else(|| v.pointer("/choices/0/text")).and_then(|c| c.as_str())
}

/// What each replica's KV-cache events say it holds, as block keys of the lab's own: FNV-1a 64 over the
/// parent's key and the block's token ids (as llm-d's indexer recomputes keys from `token_ids`, so a
/// replica's hash function never has to be known). Fed by `KvSubscriber`s.
pub struct KvIndex {
    replicas: Vec<Mutex<ReplicaIndex>>,
    /// Requests in flight per replica (the tie-breaker).
    pub inflight: Vec<AtomicUsize>,
}

#[derive(Default)]
struct ReplicaIndex {
    /// The replica's block hash -> the lab's key.
    keys_of: HashMap<u64, u64>,
    held: HashSet<u64>,
    /// Next sequence number expected, and gaps seen.
    next_seq: Option<u64>,
    gaps: usize,
}

/// One event of a replica's stream (vLLM v0.11.0's array encoding, int hashes).
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    Stored { hash: u64, parent: Option<u64>, tokens: Vec<u32>, medium: String },
    Removed { hash: u64, medium: String },
    Cleared,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = FNV_OFFSET;
    for b in parent.to_le_bytes().into_iter().chain(tokens.iter().flat_map(|t| t.to_le_bytes())) {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl KvIndex {
    pub fn new(replicas: usize) -> Self {
        KvIndex { replicas: (0..replicas).map(|_| Mutex::default()).collect(), inflight: (0..replicas).map(|_| AtomicUsize::new(0)).collect() }
    }

    /// The keys of a prompt's full blocks.
    pub fn prompt_keys(ids: &[u32], block_size: usize) -> Vec<u64> {
        let mut parent = 0;
        ids.chunks_exact(block_size)
            .map(|b| {
                parent = fnv(parent, b);
                parent
            })
            .collect()
    }

    /// Applies one batch of replica `r`'s events (sequence number `seq`). Only the memory medium counts
    /// (a block on disk is read back, not free). Returns false if a batch was missed before this one.
    pub fn apply(&self, r: usize, seq: u64, events: Vec<KvEvent>) -> bool {
        let mut ix = self.replicas[r].lock().unwrap_or_else(|e| e.into_inner());
        let in_order = ix.next_seq.is_none_or(|n| n == seq);
        if !in_order {
            ix.gaps += 1;
        }
        ix.next_seq = Some(seq + 1);
        for e in events {
            match e {
                KvEvent::Stored { hash, parent, tokens, medium } if medium == "CPU" || medium == "GPU" => {
                    let parent_key = match parent {
                        None => 0,
                        Some(p) => match ix.keys_of.get(&p) {
                            Some(&k) => k,
                            None => continue, // (its parent is unknown: unreachable from a prompt's first block)
                        },
                    };
                    let key = fnv(parent_key, &tokens);
                    ix.keys_of.insert(hash, key);
                    ix.held.insert(key);
                }
                KvEvent::Removed { hash, medium } if medium == "CPU" || medium == "GPU" => {
                    if let Some(k) = ix.keys_of.remove(&hash) {
                        ix.held.remove(&k);
                    }
                }
                KvEvent::Cleared => {
                    ix.keys_of.clear();
                    ix.held.clear();
                }
                _ => {}
            }
        }
        in_order
    }

    /// The replica holding the longest run of `keys` from the first (ties: fewest requests in flight,
    /// then the lowest index), and that run's length in blocks.
    pub fn pick(&self, keys: &[u64]) -> (usize, usize) {
        let mut best = (0, 0, usize::MAX);
        for (r, ix) in self.replicas.iter().enumerate() {
            let ix = ix.lock().unwrap_or_else(|e| e.into_inner());
            let run = keys.iter().take_while(|k| ix.held.contains(k)).count();
            let load = self.inflight[r].load(Ordering::Relaxed);
            if run > best.1 || (run == best.1 && load < best.2) {
                best = (r, run, load);
            }
        }
        (best.0, best.1)
    }

    /// Batches missed per replica (sequence-number gaps).
    pub fn gaps(&self) -> Vec<usize> {
        self.replicas.iter().map(|ix| ix.lock().unwrap_or_else(|e| e.into_inner()).gaps).collect()
    }
}

/// Decodes one `EventBatch` in vLLM v0.11.0's array encoding with int hashes.
pub fn decode_batch(mut b: &[u8]) -> Result<Vec<KvEvent>, String> {
    use rmp::decode::*;
    let e = |x: &dyn std::fmt::Debug| format!("{x:?}");
    let n = read_array_len(&mut b).map_err(|x| e(&x))?;
    if n < 2 {
        return Err(format!("an EventBatch of {n} fields"));
    }
    let _ts: f64 = read_f64(&mut b).map_err(|x| e(&x))?;
    let count = read_array_len(&mut b).map_err(|x| e(&x))?;
    let mut out = Vec::with_capacity(count as usize);
    let string = |b: &mut &[u8]| -> Result<String, String> {
        let len = read_str_len(b).map_err(|x| e(&x))? as usize;
        let (s, rest) = b.split_at(len.min(b.len()));
        *b = rest;
        Ok(String::from_utf8_lossy(s).into_owned())
    };
    for _ in 0..count {
        let fields = read_array_len(&mut b).map_err(|x| e(&x))?;
        let tag = string(&mut b)?;
        let hashes = |b: &mut &[u8]| -> Result<Vec<u64>, String> {
            let n = read_array_len(b).map_err(|x| e(&x))?;
            (0..n).map(|_| read_int::<u64, _>(b).map_err(|x| e(&x))).collect()
        };
        match (tag.as_str(), fields) {
            ("BlockStored", 7) => {
                let hs = hashes(&mut b)?;
                let parent = if b.first() == Some(&0xc0) {
                    b = &b[1..];
                    None
                } else {
                    Some(read_int::<u64, _>(&mut b).map_err(|x| e(&x))?)
                };
                let n = read_array_len(&mut b).map_err(|x| e(&x))?;
                let tokens: Vec<u32> = (0..n).map(|_| read_int::<u32, _>(&mut b).map_err(|x| e(&x))).collect::<Result<_, _>>()?;
                let block_size: usize = read_int(&mut b).map_err(|x| e(&x))?;
                read_nil(&mut b).map_err(|x| e(&x))?;
                let medium = string(&mut b)?;
                // (one hash per block: a batch of several blocks chains them)
                let mut parent = parent;
                for (i, h) in hs.iter().enumerate() {
                    let t = tokens.get(i * block_size..(i + 1) * block_size).unwrap_or_default().to_vec();
                    out.push(KvEvent::Stored { hash: *h, parent, tokens: t, medium: medium.clone() });
                    parent = Some(*h);
                }
            }
            ("BlockRemoved", 3) => {
                let hs = hashes(&mut b)?;
                let medium = string(&mut b)?;
                out.extend(hs.into_iter().map(|hash| KvEvent::Removed { hash, medium: medium.clone() }));
            }
            ("AllBlocksCleared", 1) => out.push(KvEvent::Cleared),
            (t, n) => return Err(format!("an event {t} of {n} fields")),
        }
    }
    Ok(out)
}

/// Subscribes to replica `r`'s event stream at `endpoint` and feeds `index` until the task is dropped.
pub async fn subscribe(endpoint: String, r: usize, index: Arc<KvIndex>) -> Result<(), String> {
    use zeromq::{Socket, SocketRecv, SubSocket};
    let mut sub = SubSocket::new();
    sub.connect(&endpoint).await.map_err(|e| format!("{endpoint}: {e}"))?;
    sub.subscribe("").await.map_err(|e| format!("{endpoint}: {e}"))?;
    loop {
        let m = sub.recv().await.map_err(|e| format!("{endpoint}: {e}"))?;
        let frames = m.into_vec();
        let [_, seq, payload] = &frames[..] else { continue };
        let Ok(seq) = <[u8; 8]>::try_from(&seq[..]).map(u64::from_be_bytes) else { continue };
        match decode_batch(payload) {
            Ok(events) => {
                index.apply(r, seq, events);
            }
            Err(e) => return Err(format!("{endpoint}: batch {seq}: {e}")),
        }
    }
}

/// Per policy: requests, outcomes, the prefix-cache hit rate, TTFT and throughput.
#[derive(Clone, Debug, Serialize)]
pub struct PolicySummary {
    pub policy: String,
    pub requests: usize,
    pub ok: usize,
    /// Requests that ended with an error the client saw (then possibly sent again).
    pub failed_visibly: usize,
    /// Turns that succeeded only when the client sent them again.
    pub ok_after_retry: usize,
    /// Turns given up (every attempt failed visibly).
    pub turns_lost: usize,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub hit_rate: f64,
    pub ttft_p50_s: f64,
    pub ttft_p99_s: f64,
    pub completion_tokens: usize,
    pub wall_s: f64,
    pub tokens_per_s: f64,
    /// KV-event routing: the prompt tokens its index predicted against those the replicas reported.
    pub predicted_tokens: Option<usize>,
}

pub fn summarize(policy: &str, records: &[ClusterRecord], block_size: usize) -> PolicySummary {
    let ok: Vec<&ClusterRecord> = records.iter().filter(|r| r.outcome == "ok").collect();
    let mut ttft: Vec<f64> = ok.iter().filter_map(|r| r.ttft_s).collect();
    ttft.sort_by(f64::total_cmp);
    let at = |q: f64| crate::stats::percentile(&ttft, q);
    let wall_s = records.iter().map(|r| r.start_s + r.e2e_s).fold(0.0, f64::max);
    let (prompt_tokens, cached_tokens): (usize, usize) = (ok.iter().map(|r| r.prompt_tokens).sum(), ok.iter().map(|r| r.cached_tokens).sum());
    let completion_tokens: usize = ok.iter().map(|r| r.completion_tokens).sum();
    let mut turns: HashMap<(usize, usize), bool> = HashMap::new();
    for r in records {
        *turns.entry((r.session, r.turn)).or_default() |= r.outcome == "ok";
    }
    PolicySummary {
        policy: policy.into(),
        requests: records.len(),
        ok: ok.len(),
        failed_visibly: records.len() - ok.len(),
        ok_after_retry: ok.iter().filter(|r| r.attempt > 1).count(),
        turns_lost: turns.values().filter(|ok| !**ok).count(),
        prompt_tokens,
        cached_tokens,
        hit_rate: if prompt_tokens == 0 { 0.0 } else { cached_tokens as f64 / prompt_tokens as f64 },
        ttft_p50_s: at(0.5),
        ttft_p99_s: at(0.99),
        completion_tokens,
        wall_s,
        tokens_per_s: if wall_s > 0.0 { completion_tokens as f64 / wall_s } else { 0.0 },
        predicted_tokens: ok.iter().map(|r| r.predicted_blocks.map(|b| b * block_size)).sum(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_index_keys_blocks_by_their_tokens_and_picks_the_longest_held_run() {
        let ix = KvIndex::new(2);
        let ids: Vec<u32> = (0..40).collect();
        let keys = KvIndex::prompt_keys(&ids, 16);
        assert_eq!(keys.len(), 2);
        // replica 1 stored the prompt's two blocks under hashes of its own, chained
        let stored = vec![
            KvEvent::Stored { hash: 9, parent: None, tokens: ids[..16].to_vec(), medium: "CPU".into() },
            KvEvent::Stored { hash: 7, parent: Some(9), tokens: ids[16..32].to_vec(), medium: "CPU".into() },
        ];
        assert!(ix.apply(1, 0, stored));
        assert_eq!(ix.pick(&keys), (1, 2));
        // the second block evicted, and a batch missed
        assert!(!ix.apply(1, 5, vec![KvEvent::Removed { hash: 7, medium: "CPU".into() }]));
        assert_eq!((ix.pick(&keys), ix.gaps()), ((1, 1), vec![0, 1]));
        // a cleared replica holds nothing: ties go to the one with fewer requests in flight
        ix.apply(1, 6, vec![KvEvent::Cleared]);
        ix.inflight[0].fetch_add(1, Ordering::Relaxed);
        assert_eq!(ix.pick(&keys), (1, 0));
    }
}

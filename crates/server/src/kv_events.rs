//! KV-cache events on the wire, as vLLM publishes them (`vllm/distributed/kv_events.py`, release
//! v0.11.0), for the routers and indexers that read vLLM's stream (llm-d's KV-cache indexer, Dynamo's
//! router, vllm-router's `kv_aware` policy).
//!
//! A ZeroMQ PUB socket sends one message per engine step that changed the cache (and per disk-tier
//! write), three frames: the topic, the sequence number (8 bytes big-endian, from 0, gapless) and a
//! MessagePack `EventBatch`. The last `buffer_steps` batches are kept: a ROUTER socket (the replay
//! endpoint) answers `[identity, "", start (8 bytes big-endian)]` with one `[identity, "", seq, batch]`
//! per kept batch from `start` on, then `[identity, "", -1 (8 bytes), ""]`.
//!
//! The `EventBatch` is always vLLM's array, `[ts: float, events: [event...], data_parallel_rank: int]`.
//! Events (`Encoding`): `array`, as in v0.11.0 through v0.20.0 (msgspec `array_like=True`, `tag=True`):
//!   BlockStored      = ["BlockStored", block_hashes: [hash], parent_block_hash: hash | nil,
//!                       token_ids: [int], block_size: int, lora_id: nil, medium: str]
//!   BlockRemoved     = ["BlockRemoved", block_hashes: [hash], medium: str]
//!   AllBlocksCleared = ["AllBlocksCleared"]
//! and `map`, as in v0.34.0 (events no longer `array_like`): the same fields by name with the tag
//! under `"type"`, `BlockStored` also with `lora_name: nil` (fields at their defaults omitted, as
//! msgspec's `omit_defaults` does). vllm-router 0.1.17's `kv_aware` policy reads `map`.
//!
//! A hash is reckon's 128-bit chained block key: by default its low 64 bits as an unsigned int (vLLM's
//! int form), or its 16 bytes big-endian (`hash: bytes`, like vLLM's default byte hashes). A parent is
//! nil for a sequence's first block. `medium` is `"CPU"` for the blocks the model reads (host memory:
//! reckon runs on CPUs; vLLM's GPU blocks are `"GPU"`; `memory_medium` renames it, for a router that
//! discounts host memory as a slower tier) and `"DISK"` for the disk tier. One event per block, each
//! with its `block_size` token ids.

use bytes::Bytes;
use reckon_engine::kv::{KvEvent, KvEventSink, Medium};
use serde::Deserialize;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// How events are encoded (see the module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// vLLM v0.11.0-v0.20.0: events as arrays.
    #[default]
    Array,
    /// vLLM v0.34.0: events as maps tagged by `"type"`.
    Map,
}

/// How block hashes are written.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HashForm {
    /// The low 64 bits, an unsigned int.
    #[default]
    Int,
    /// 16 bytes, big-endian.
    Bytes,
}

/// vLLM's `--kv-events-config` (its `KVEventsConfig` fields), with reckon's `bind`, `encoding` and `hash`.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KvEventsConfig {
    pub enable_kv_cache_events: bool,
    /// `"zmq"`, or `"null"` for none.
    pub publisher: String,
    /// The PUB socket's endpoint.
    pub endpoint: String,
    /// Bind the PUB socket (a server publishing on its own address) or connect it (to an indexer that
    /// binds, as llm-d's does). `None`: vLLM's rule, bind when the endpoint has `*` or `::`.
    pub bind: Option<bool>,
    /// The ROUTER socket answering replay requests (always bound).
    pub replay_endpoint: Option<String>,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Accepted for vLLM's configs; the socket's own queue bounds what a slow subscriber holds.
    pub hwm: usize,
    /// Batches queued for the publisher at most; more are dropped, counted, and leave a gap in the
    /// sequence numbers.
    pub max_queue_size: usize,
    pub topic: String,
    pub encoding: Encoding,
    pub hash: HashForm,
    pub data_parallel_rank: u32,
    /// The `medium` of the blocks the model reads (`"CPU"`).
    pub memory_medium: String,
}

impl Default for KvEventsConfig {
    fn default() -> Self {
        KvEventsConfig {
            enable_kv_cache_events: true,
            publisher: "zmq".into(),
            endpoint: "tcp://*:5557".into(),
            bind: None,
            replay_endpoint: None,
            buffer_steps: 10_000,
            hwm: 100_000,
            max_queue_size: 100_000,
            topic: String::new(),
            encoding: Encoding::Array,
            hash: HashForm::Int,
            data_parallel_rank: 0,
            memory_medium: "CPU".into(),
        }
    }
}

impl KvEventsConfig {
    /// Whether events are published at all.
    pub fn enabled(&self) -> bool {
        self.enable_kv_cache_events && self.publisher != "null"
    }

    fn binds(&self) -> bool {
        self.bind.unwrap_or(self.endpoint.contains('*') || self.endpoint.contains("::"))
    }
}

/// Counters of the publisher (for `/metrics` and tests).
#[derive(Debug, Default)]
pub struct KvEventStats {
    pub batches_published: AtomicU64,
    pub batches_dropped: AtomicU64,
}

/// A batch as the engine handed it over, with its time and sequence number.
struct Pending {
    seq: u64,
    ts: f64,
    events: Vec<KvEvent>,
}

/// A running publisher: the sink to give the engine (`Engine::with_kv_events`), its counters, and the
/// endpoints as bound (a port 0 resolved).
pub struct Publisher {
    pub sink: KvEventSink,
    pub stats: Arc<KvEventStats>,
    pub endpoint: String,
    pub replay_endpoint: Option<String>,
}

/// Opens the sockets and starts publishing on the current tokio runtime. Fails if an endpoint cannot be
/// used.
pub async fn start(config: KvEventsConfig) -> std::io::Result<Publisher> {
    let err = |what: &str, e: zeromq::ZmqError| std::io::Error::other(format!("KV events {what}: {e}"));
    if config.publisher != "zmq" {
        return Err(std::io::Error::other(format!("KV events: publisher {:?} (only \"zmq\" and \"null\")", config.publisher)));
    }
    let mut publisher = PubSocket::new();
    let endpoint = if config.binds() {
        publisher.bind(&config.endpoint).await.map_err(|e| err(&format!("cannot bind {}", config.endpoint), e))?.to_string()
    } else {
        publisher.connect(&config.endpoint).await.map_err(|e| err(&format!("cannot connect to {}", config.endpoint), e))?;
        config.endpoint.clone()
    };
    let (replay, replay_endpoint) = match &config.replay_endpoint {
        Some(ep) => {
            let mut r = RouterSocket::new();
            let bound = r.bind(ep).await.map_err(|e| err(&format!("cannot bind the replay endpoint {ep}"), e))?;
            (Some(r), Some(bound.to_string()))
        }
        None => (None, None),
    };
    let (tx, rx) = tokio::sync::mpsc::channel::<Pending>(config.max_queue_size.max(1));
    let stats = Arc::new(KvEventStats::default());
    let dropped = stats.clone();
    // The sequence number is taken as a batch is queued, so a batch dropped on a full queue leaves a gap
    // a subscriber sees (and a replay cannot fill), never a silent loss. (One lock: the engine and the
    // disk writer queue batches from their own threads, and numbers must follow queue order.)
    let queue = std::sync::Mutex::new((0u64, tx));
    let sink: KvEventSink = Arc::new(move |events: Vec<KvEvent>| {
        let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let mut q = queue.lock().unwrap_or_else(|e| e.into_inner());
        let seq = q.0;
        q.0 += 1;
        if q.1.try_send(Pending { seq, ts, events }).is_err() {
            dropped.batches_dropped.fetch_add(1, Ordering::Relaxed);
        }
    });
    tokio::spawn(publish(config, publisher, replay, rx, stats.clone()));
    Ok(Publisher { sink, stats, endpoint, replay_endpoint })
}

async fn publish(config: KvEventsConfig, mut publisher: PubSocket, mut replay: Option<RouterSocket>, mut rx: tokio::sync::mpsc::Receiver<Pending>, stats: Arc<KvEventStats>) {
    let topic = Bytes::from(config.topic.clone().into_bytes());
    let mut kept: VecDeque<(u64, Bytes)> = VecDeque::new();
    loop {
        tokio::select! {
            batch = rx.recv() => {
                let Some(batch) = batch else { break };
                let seq = batch.seq;
                let payload = Bytes::from(encode_batch(&batch.events, batch.ts, &config));
                let frames = vec![topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
                if let Err(e) = publisher.send(ZmqMessage::try_from(frames).expect("three frames")).await {
                    tracing::warn!("KV events: publishing batch {seq} failed: {e}");
                }
                stats.batches_published.fetch_add(1, Ordering::Relaxed);
                kept.push_back((seq, payload));
                if kept.len() > config.buffer_steps {
                    kept.pop_front();
                }
            }
            request = async { replay.as_mut().expect("polled only with a replay socket").recv().await }, if replay.is_some() => {
                let router = replay.as_mut().expect("a replay socket");
                match request {
                    Ok(m) => answer_replay(router, m, &kept).await,
                    Err(e) => tracing::warn!("KV events: replay request: {e}"),
                }
            }
        }
    }
}

/// Answers `[identity, "", start]` with every kept batch from `start` on, then the end marker.
async fn answer_replay(router: &mut RouterSocket, request: ZmqMessage, kept: &VecDeque<(u64, Bytes)>) {
    let frames = request.into_vec();
    let [identity, _, start] = &frames[..] else {
        tracing::warn!("KV events: a replay request of {} frames (want identity, empty, start)", frames.len());
        return;
    };
    let Ok(start) = <[u8; 8]>::try_from(&start[..]).map(u64::from_be_bytes) else {
        tracing::warn!("KV events: a replay start of {} bytes (want 8)", start.len());
        return;
    };
    let empty = Bytes::new();
    for (seq, payload) in kept.iter().filter(|(s, _)| *s >= start) {
        let m = vec![identity.clone(), empty.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
        if router.send(ZmqMessage::try_from(m).expect("four frames")).await.is_err() {
            return;
        }
    }
    let end = vec![identity.clone(), empty.clone(), Bytes::copy_from_slice(&(-1i64).to_be_bytes()), empty];
    let _ = router.send(ZmqMessage::try_from(end).expect("four frames")).await;
}

/// One `EventBatch` in `config`'s encoding.
pub fn encode_batch(events: &[KvEvent], ts: f64, config: &KvEventsConfig) -> Vec<u8> {
    use rmp::encode::*;
    let mut w = Vec::with_capacity(64 + events.len() * 96);
    let map = config.encoding == Encoding::Map;
    let hash = |w: &mut Vec<u8>, h: u128| match config.hash {
        HashForm::Int => write_uint(w, h as u64).map(|_| ()),
        HashForm::Bytes => write_bin(w, &h.to_be_bytes()),
    };
    let medium = |m: Medium| match m {
        Medium::Memory => config.memory_medium.as_str(),
        Medium::Disk => "DISK",
    };
    // (writing into a Vec cannot fail)
    let mut go = || -> Result<(), Box<dyn std::error::Error>> {
        let key = |w: &mut Vec<u8>, k: &str| if map { write_str(w, k) } else { Ok(()) };
        // (the batch is an array in every release)
        write_array_len(&mut w, 3)?;
        write_f64(&mut w, ts)?;
        write_array_len(&mut w, events.len() as u32)?;
        for e in events {
            match e {
                KvEvent::BlockStored { hash: h, parent, tokens, medium: m } => {
                    if map { write_map_len(&mut w, 8)?; write_str(&mut w, "type")?; } else { write_array_len(&mut w, 7)?; }
                    write_str(&mut w, "BlockStored")?;
                    key(&mut w, "block_hashes")?;
                    write_array_len(&mut w, 1)?;
                    hash(&mut w, *h)?;
                    key(&mut w, "parent_block_hash")?;
                    match parent {
                        Some(p) => hash(&mut w, *p)?,
                        None => write_nil(&mut w)?,
                    }
                    key(&mut w, "token_ids")?;
                    write_array_len(&mut w, tokens.len() as u32)?;
                    for &t in tokens.iter() {
                        write_uint(&mut w, t as u64)?;
                    }
                    key(&mut w, "block_size")?;
                    write_uint(&mut w, tokens.len() as u64)?;
                    key(&mut w, "lora_id")?;
                    write_nil(&mut w)?;
                    key(&mut w, "medium")?;
                    write_str(&mut w, medium(*m))?;
                    if map {
                        write_str(&mut w, "lora_name")?;
                        write_nil(&mut w)?;
                    }
                }
                KvEvent::BlockRemoved { hash: h, medium: m } => {
                    if map { write_map_len(&mut w, 3)?; write_str(&mut w, "type")?; } else { write_array_len(&mut w, 3)?; }
                    write_str(&mut w, "BlockRemoved")?;
                    key(&mut w, "block_hashes")?;
                    write_array_len(&mut w, 1)?;
                    hash(&mut w, *h)?;
                    key(&mut w, "medium")?;
                    write_str(&mut w, medium(*m))?;
                }
                KvEvent::AllBlocksCleared => {
                    if map { write_map_len(&mut w, 1)?; write_str(&mut w, "type")?; } else { write_array_len(&mut w, 1)?; }
                    write_str(&mut w, "AllBlocksCleared")?;
                }
            }
        }
        write_uint(&mut w, config.data_parallel_rank as u64)?;
        Ok(())
    };
    go().expect("writing MessagePack into a Vec");
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_array_batch_is_vllm_0_11s_layout_byte_for_byte() {
        let events = vec![
            KvEvent::BlockStored { hash: 0x1_0000_0000_0000_0005, parent: None, tokens: vec![1, 2].into(), medium: Medium::Memory },
            KvEvent::BlockRemoved { hash: 7, medium: Medium::Disk },
            KvEvent::AllBlocksCleared,
        ];
        let got = encode_batch(&events, 1.5, &KvEventsConfig::default());
        let mut want = vec![0x93, 0xcb];
        want.extend_from_slice(&1.5f64.to_be_bytes());
        want.push(0x93);
        // ["BlockStored", [5], nil, [1, 2], 2, nil, "CPU"] (the hash's low 64 bits)
        want.extend_from_slice(&[0x97, 0xab]);
        want.extend_from_slice(b"BlockStored");
        want.extend_from_slice(&[0x91, 0x05, 0xc0, 0x92, 0x01, 0x02, 0x02, 0xc0, 0xa3]);
        want.extend_from_slice(b"CPU");
        // ["BlockRemoved", [7], "DISK"]
        want.extend_from_slice(&[0x93, 0xac]);
        want.extend_from_slice(b"BlockRemoved");
        want.extend_from_slice(&[0x91, 0x07, 0xa4]);
        want.extend_from_slice(b"DISK");
        // ["AllBlocksCleared"], then the rank
        want.extend_from_slice(&[0x91, 0xb0]);
        want.extend_from_slice(b"AllBlocksCleared");
        want.push(0x00);
        assert_eq!(got, want);
    }

    /// A batch dropped on a full queue keeps its sequence number: the subscriber sees a gap, which a
    /// replay (from the kept batches) shows too.
    #[test]
    fn a_batch_dropped_on_a_full_queue_leaves_a_gap() {
        use zeromq::{DealerSocket, SocketRecv, SocketSend};
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let config = KvEventsConfig { endpoint: "tcp://127.0.0.1:0".into(), bind: Some(true), replay_endpoint: Some("tcp://127.0.0.1:0".into()), max_queue_size: 1, ..Default::default() };
            let p = start(config).await.unwrap();
            // (on this one thread the publisher runs only when the test awaits)
            (p.sink)(vec![KvEvent::AllBlocksCleared]); // 0: queued
            (p.sink)(vec![KvEvent::AllBlocksCleared]); // 1: the queue is full, dropped
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            (p.sink)(vec![KvEvent::AllBlocksCleared]); // 2
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            assert_eq!((p.stats.batches_published.load(Ordering::Relaxed), p.stats.batches_dropped.load(Ordering::Relaxed)), (2, 1));
            let mut dealer = DealerSocket::new();
            dealer.connect(p.replay_endpoint.as_deref().unwrap()).await.unwrap();
            dealer.send(ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&0u64.to_be_bytes())]).unwrap()).await.unwrap();
            let mut seqs = Vec::new();
            loop {
                let frames = dealer.recv().await.unwrap().into_vec();
                let seq = i64::from_be_bytes(frames[1][..].try_into().unwrap());
                if seq == -1 {
                    break;
                }
                seqs.push(seq);
            }
            assert_eq!(seqs, vec![0, 2]);
        });
    }

    #[test]
    fn a_config_reads_vllms_json() {
        let c: KvEventsConfig = serde_json::from_str(r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv@pod@m", "buffer_steps": 100, "hwm": 1000}"#).unwrap();
        assert!(c.enabled() && c.binds());
        assert_eq!((c.replay_endpoint.as_deref(), c.topic.as_str(), c.buffer_steps), (Some("tcp://*:5558"), "kv@pod@m", 100));
        let c: KvEventsConfig = serde_json::from_str(r#"{"endpoint": "tcp://10.0.0.1:5557", "encoding": "map", "hash": "bytes"}"#).unwrap();
        assert!(!c.binds(), "vLLM's rule: no wildcard, connect");
        assert!(serde_json::from_str::<KvEventsConfig>(r#"{"endpont": "x"}"#).is_err(), "a misspelt key is an error");
    }
}

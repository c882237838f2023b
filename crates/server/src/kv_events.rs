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
//! What the zeromq crate (0.7) does with a client that does not read, and so what is built around it:
//! - PUB: `send` never waits and never fails for a message of frames: it queues the message for
//!   fan-out (100,000 at most) and each subscriber's writer (100,000 at most per subscriber), dropping
//!   it, without an error, where a queue is full or no one subscribes. A slow subscriber loses messages
//!   (a gap in its sequence numbers); it cannot hold up the live stream.
//! - ROUTER: `send` queues up to 100,000 messages per peer and then waits, without end, for a peer that
//!   never reads (there is no send timeout or high-water option, and no way to disconnect one peer).
//!   So replays are answered on a task of their own, every send bounded by `REPLAY_SEND_TIMEOUT`; a
//!   client that overruns it is dropped (its answer abandoned, its later requests ignored, counted in
//!   `replay_clients_dropped`) while the live stream and the other replay clients go on.
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
use std::sync::{Arc, Mutex};
use std::time::Duration;
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
    /// vLLM's send high-water mark of the PUB socket (ZeroMQ's `SNDHWM`: messages queued per subscriber
    /// before more are dropped for it; 0, no limit). The zeromq crate has no such option: its PUB queues
    /// a fixed 100,000 messages per subscriber (and 100,000 awaiting fan-out) and drops the rest. So here
    /// `hwm` bounds what reckon's own queue holds, the batches waiting between the engine and the
    /// publishing task: at most `min(hwm, max_queue_size)` (0: `max_queue_size` alone); a batch past it is
    /// dropped like one past `max_queue_size`.
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

    /// Batches that may wait between the engine and the publishing task (`hwm` and `max_queue_size`).
    fn queue_bound(&self) -> usize {
        let hwm = if self.hwm == 0 { usize::MAX } else { self.hwm };
        self.max_queue_size.min(hwm).max(1)
    }

    fn binds(&self) -> bool {
        self.bind.unwrap_or(self.endpoint.contains('*') || self.endpoint.contains("::"))
    }
}

/// Counters of the publisher (for `/metrics` and tests).
#[derive(Debug, Default)]
pub struct KvEventStats {
    /// Batches the PUB socket took. (The zeromq crate's PUB send returns without waiting and discards,
    /// without an error, a message no subscriber has room for: see the module doc.)
    pub batches_published: AtomicU64,
    /// Batches dropped on a full queue (each leaves a gap in the sequence numbers that a replay cannot
    /// fill) or refused by the PUB socket (kept for replay all the same).
    pub batches_dropped: AtomicU64,
    /// Replay clients that read nothing for `REPLAY_SEND_TIMEOUT`: the rest of their answer abandoned.
    pub replay_clients_dropped: AtomicU64,
}

/// How long one message of a replay answer may wait for room in its client's queue before the client
/// is dropped. The zeromq crate's ROUTER queues up to 100,000 messages per peer in memory and only then
/// makes a send wait (for the peer's TCP connection to drain), so a send that waits at all means the
/// client has left a whole queue and its socket buffers unread; a client that reads is back within
/// milliseconds, and a second rides out a scheduling hiccup or a pause on a loaded host. It is also the
/// longest that one stuck client holds up the replay clients behind it (they are answered in turn).
pub const REPLAY_SEND_TIMEOUT: Duration = Duration::from_secs(1);

/// Identities of replay clients dropped for not reading, remembered at most (the oldest forgotten): a
/// client stays connected, and the crate keeps its full queue, until it goes away; its further requests
/// on that connection are ignored rather than stalling the replay task a second each.
const DROPPED_CLIENTS_REMEMBERED: usize = 1024;

/// The kept batches, `(seq, MessagePack batch)` in sequence order: written by the publishing task,
/// read (a snapshot of cheap `Bytes` clones, under the lock only while copying) by the replay task.
type Kept = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

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

/// Opens the sockets and starts publishing (and answering replays, on a task of its own) on the current
/// tokio runtime. Fails if an endpoint cannot be used.
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
    let (tx, rx) = tokio::sync::mpsc::channel::<Pending>(config.queue_bound());
    let stats = Arc::new(KvEventStats::default());
    let dropped = stats.clone();
    // The sequence number is taken as a batch is queued, so a batch dropped on a full queue leaves a gap
    // a subscriber sees (and a replay cannot fill), never a silent loss. (One lock: the engine and the
    // disk writer queue batches from their own threads, and numbers must follow queue order.)
    let queue = Mutex::new((0u64, tx));
    let sink: KvEventSink = Arc::new(move |events: Vec<KvEvent>| {
        let ts = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let mut q = queue.lock().unwrap_or_else(|e| e.into_inner());
        let seq = q.0;
        q.0 += 1;
        if q.1.try_send(Pending { seq, ts, events }).is_err() {
            dropped.batches_dropped.fetch_add(1, Ordering::Relaxed);
        }
    });
    // Batches are kept only for a replay socket to answer from.
    let kept = replay.as_ref().map(|_| Kept::default());
    if let (Some(router), Some(kept)) = (replay, &kept) {
        tokio::spawn(serve_replay(router, kept.clone(), stats.clone(), REPLAY_SEND_TIMEOUT));
    }
    tokio::spawn(publish(config, publisher, rx, kept, stats.clone()));
    Ok(Publisher { sink, stats, endpoint, replay_endpoint })
}

/// The live loop: encodes each queued batch, keeps it, and hands it to the PUB socket. Nothing here waits
/// on a client: the crate's PUB send only queues (see the module doc), and replays are another task's.
async fn publish(config: KvEventsConfig, mut publisher: PubSocket, mut rx: tokio::sync::mpsc::Receiver<Pending>, kept: Option<Kept>, stats: Arc<KvEventStats>) {
    let topic = Bytes::from(config.topic.clone().into_bytes());
    while let Some(batch) = rx.recv().await {
        let seq = batch.seq;
        let payload = Bytes::from(encode_batch(&batch.events, batch.ts, &config));
        // Kept before it is sent, so a subscriber that saw a batch live finds it in a replay.
        if let Some(kept) = &kept {
            let mut kept = kept.lock().unwrap_or_else(|e| e.into_inner());
            kept.push_back((seq, payload.clone()));
            while kept.len() > config.buffer_steps {
                kept.pop_front();
            }
        }
        let frames = vec![topic.clone(), Bytes::copy_from_slice(&seq.to_be_bytes()), payload];
        match publisher.send(ZmqMessage::try_from(frames).expect("three frames")).await {
            Ok(()) => stats.batches_published.fetch_add(1, Ordering::Relaxed),
            Err(e) => {
                tracing::warn!("KV events: the PUB socket refused batch {seq} (counted as dropped; kept for replay): {e}");
                stats.batches_dropped.fetch_add(1, Ordering::Relaxed)
            }
        };
    }
}

/// The replay task: owns the ROUTER socket and answers one request at a time, every send bounded by
/// `send_timeout`, so a client that does not read costs the others at most that long and the live
/// stream nothing.
async fn serve_replay(mut router: RouterSocket, kept: Kept, stats: Arc<KvEventStats>, send_timeout: Duration) {
    let mut dropped: VecDeque<Bytes> = VecDeque::new();
    loop {
        let request = match router.recv().await {
            Ok(m) => m,
            Err(e) => {
                // (the crate's ROUTER waits for peers rather than failing; should it fail, no busy loop)
                tracing::warn!("KV events: receiving a replay request: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let frames = request.into_vec();
        let [identity, _, start] = &frames[..] else {
            tracing::warn!("KV events: a replay request of {} frames (want identity, empty, start)", frames.len());
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(&start[..]).map(u64::from_be_bytes) else {
            tracing::warn!("KV events: a replay start of {} bytes (want 8)", start.len());
            continue;
        };
        if dropped.contains(identity) {
            tracing::debug!("KV events: ignoring a replay request from client {} (dropped for not reading)", hex(identity));
            continue;
        }
        let answer: Vec<(u64, Bytes)> = {
            let kept = kept.lock().unwrap_or_else(|e| e.into_inner());
            let from = kept.partition_point(|(s, _)| *s < start);
            kept.range(from..).cloned().collect()
        };
        if let Err(Stuck { sent }) = answer_replay(&mut router, identity, &answer, send_timeout).await {
            tracing::warn!("KV events: replay client {} read nothing for {send_timeout:?}: dropped, its answer from batch {start} abandoned after {sent} of {} messages", hex(identity), answer.len() + 1);
            stats.replay_clients_dropped.fetch_add(1, Ordering::Relaxed);
            if dropped.len() == DROPPED_CLIENTS_REMEMBERED {
                dropped.pop_front();
            }
            dropped.push_back(identity.clone());
        }
    }
}

/// A replay client that did not take a message within the send timeout, after `sent` messages.
struct Stuck {
    sent: usize,
}

/// Sends `[identity, "", seq, batch]` for each of `answer`, then the end marker `[identity, "", -1, ""]`.
/// A client gone (the crate no longer knows its identity) ends the answer quietly.
async fn answer_replay(router: &mut RouterSocket, identity: &Bytes, answer: &[(u64, Bytes)], send_timeout: Duration) -> Result<(), Stuck> {
    let empty = Bytes::new();
    let messages = answer.iter().map(|(seq, payload)| (seq.to_be_bytes(), payload.clone())).chain([((-1i64).to_be_bytes(), empty.clone())]);
    for (sent, (seq, payload)) in messages.enumerate() {
        let m = ZmqMessage::try_from(vec![identity.clone(), empty.clone(), Bytes::copy_from_slice(&seq), payload]).expect("four frames");
        match tokio::time::timeout(send_timeout, router.send(m)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::debug!("KV events: replay client {} gone after {sent} messages: {e}", hex(identity));
                return Ok(());
            }
            Err(_) => return Err(Stuck { sent }),
        }
        // (a send with room in the queue never yields: let other tasks run during a long answer)
        if sent % 256 == 255 {
            tokio::task::yield_now().await;
        }
    }
    Ok(())
}

/// A client identity for the log.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
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
    /// replay (from the kept batches) shows too. The queue is bounded by `max_queue_size` or by `hwm`.
    #[test]
    fn a_batch_dropped_on_a_full_queue_leaves_a_gap() {
        let base = KvEventsConfig { endpoint: "tcp://127.0.0.1:0".into(), bind: Some(true), replay_endpoint: Some("tcp://127.0.0.1:0".into()), ..Default::default() };
        a_full_queue_drops_the_second_batch(KvEventsConfig { max_queue_size: 1, ..base.clone() });
        a_full_queue_drops_the_second_batch(KvEventsConfig { hwm: 1, ..base.clone() });
        assert_eq!((KvEventsConfig { hwm: 0, max_queue_size: 5, ..base.clone() }).queue_bound(), 5, "hwm 0: no limit of its own");
    }

    fn a_full_queue_drops_the_second_batch(config: KvEventsConfig) {
        use zeromq::{DealerSocket, SocketRecv, SocketSend};
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
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

    /// The frames' sequence number, as a subscriber or a replay client reads it (8 bytes, signed for
    /// the end marker).
    fn seq_of(frame: &Bytes) -> i64 {
        i64::from_be_bytes(frame[..].try_into().expect("an 8-byte sequence number"))
    }

    /// Receives live batches until batch `want`, which must come within `within`.
    async fn receive_live(sub: &mut zeromq::SubSocket, want: u64, within: Duration) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let m = tokio::time::timeout_at(deadline, sub.recv()).await.unwrap_or_else(|_| panic!("live batch {want} not received within {within:?}")).expect("a live batch");
            let seq = seq_of(&m.into_vec()[1]);
            assert!(seq <= want as i64, "live batch {seq} came before {want}");
            if seq == want as i64 {
                return;
            }
        }
    }

    /// A replay client that asks for many big batches again and again and never reads fills its queue
    /// in the crate (100,000 messages) and its TCP buffers: it is dropped after `REPLAY_SEND_TIMEOUT`,
    /// while a subscriber gets every live batch published meanwhile, and a replay client that reads is
    /// answered afterwards.
    #[test]
    fn a_replay_client_that_never_reads_is_dropped_while_the_live_stream_goes_on() {
        use zeromq::{DealerSocket, SocketRecv, SocketSend, SubSocket};
        // 2,000 kept batches of about 1 KiB: each request queues 2,000 messages (2 MB) for the client,
        // so some 50 of them fill the crate's queue whatever the host's socket buffers hold; 400 leave
        // a wide margin (those after the drop are ignored).
        const KEPT: u64 = 2_000;
        const REQUESTS: usize = 400;
        // (generous: every wait usually ends in milliseconds, the drop after about a second)
        const LIVE_WITHIN: Duration = Duration::from_secs(10);
        const DROPPED_WITHIN: Duration = Duration::from_secs(60);
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async {
            let config = KvEventsConfig { endpoint: "tcp://127.0.0.1:0".into(), bind: Some(true), replay_endpoint: Some("tcp://127.0.0.1:0".into()), buffer_steps: KEPT as usize, ..Default::default() };
            let p = start(config).await.unwrap();
            let replay_request = |start: u64| ZmqMessage::try_from(vec![Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())]).unwrap();
            let dropped = || p.stats.replay_clients_dropped.load(Ordering::Relaxed);
            let started = tokio::time::Instant::now();
            for _ in 0..KEPT {
                (p.sink)(vec![KvEvent::BlockStored { hash: 1, parent: None, tokens: vec![1; 1000].into(), medium: Medium::Memory }]);
            }
            while p.stats.batches_published.load(Ordering::Relaxed) < KEPT {
                assert!(started.elapsed() < LIVE_WITHIN, "the kept batches were not published");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            // The subscriber, once its subscription has reached the publisher (batches until one arrives).
            let mut sub = SubSocket::new();
            sub.connect(&p.endpoint).await.unwrap();
            sub.subscribe("").await.unwrap();
            let mut next = KEPT;
            loop {
                (p.sink)(vec![KvEvent::AllBlocksCleared]);
                next += 1;
                if let Ok(m) = tokio::time::timeout(Duration::from_millis(100), sub.recv()).await {
                    // (an earlier one of these may come first: read on to the latest)
                    if seq_of(&m.expect("a live batch").into_vec()[1]) != next as i64 - 1 {
                        receive_live(&mut sub, next - 1, LIVE_WITHIN).await;
                    }
                    break;
                }
                assert!(started.elapsed() < LIVE_WITHIN, "the subscriber never got a live batch");
            }
            // The stuck client.
            let mut stuck = DealerSocket::new();
            stuck.connect(p.replay_endpoint.as_deref().unwrap()).await.unwrap();
            for _ in 0..REQUESTS {
                stuck.send(replay_request(0)).await.unwrap();
            }
            // Live batches, each received before the next is published, until the client is dropped.
            let asked_at = tokio::time::Instant::now();
            let mut live_before_the_drop = 0;
            loop {
                let was_dropped = dropped() > 0;
                (p.sink)(vec![KvEvent::AllBlocksCleared]);
                next += 1;
                receive_live(&mut sub, next - 1, LIVE_WITHIN).await;
                if was_dropped {
                    break;
                }
                live_before_the_drop += 1;
                assert!(asked_at.elapsed() < DROPPED_WITHIN, "the replay client that never reads was not dropped");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(live_before_the_drop > 0, "live batches flowed while the replay client was stuck");
            // A replay client that reads is answered: the last live batch, then the end marker.
            let mut reader = DealerSocket::new();
            reader.connect(p.replay_endpoint.as_deref().unwrap()).await.unwrap();
            reader.send(replay_request(next - 1)).await.unwrap();
            let mut seqs = Vec::new();
            while seqs.last() != Some(&-1) {
                let m = tokio::time::timeout(LIVE_WITHIN, reader.recv()).await.expect("a replay answer within the bound").unwrap();
                seqs.push(seq_of(&m.into_vec()[1]));
            }
            assert_eq!(seqs, vec![next as i64 - 1, -1]);
            assert_eq!(dropped(), 1, "the stuck client's later requests were ignored, not answered into a full queue");
            eprintln!("dropped the stuck replay client {:?} after it asked, {live_before_the_drop} live batches meanwhile; {:?} in all", asked_at.elapsed(), started.elapsed());
            drop(stuck);
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

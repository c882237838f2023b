//! The engine loop: one thread owns the model's KV storage, the scheduler and every running request, and
//! repeats schedule -> one batched forward step -> sample -> detokenize -> send token events. Clients
//! talk to it only through an `EngineHandle` (submit, abort) and the event channel each request gets.
//!
//! A request whose event receiver is dropped is treated as aborted at its next token; an explicit abort
//! is handled before the next step. Either way its blocks are released within one step.

mod disk_tier;
mod request;

pub use disk_tier::{kv_numerics_version, DiskTierConfig, KvFormat, KV_NUMERICS_VERSION};
pub use request::{Completion, Event, FinishReason, GenerateRequest, RequestId, Timings, TokenLogprobs, Usage};

use crate::kv::KvStorage;
use crate::model::{LogitsWanted, Model, Scratch, SeqInput};
use crate::sampler::Sampler;
use crate::scheduler::{sha256_block_hash, BlockHash, BlockPool, EvictedBlock, Restore, Scheduler, SchedulerConfig, StepPlan};
use disk_tier::{BlockFile, DiskTier};
use crate::tokenizer::{Tokenizer, Utf8Stream};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::mpsc::{self, error::TryRecvError, UnboundedReceiver, UnboundedSender};

/// Keys and values read back from the disk tier and held by one waiting request, at most.
const RESTORE_MAX_BYTES: usize = 256 << 20;

#[derive(Clone, Copy, Debug)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// KV blocks (fixed at start-up from the memory budget).
    pub num_blocks: usize,
    /// Token budget of one step.
    pub max_batch_tokens: usize,
    /// Prefill tokens of a step that also decodes (`SchedulerConfig::max_prefill_tokens_while_decoding`).
    pub max_prefill_tokens_while_decoding: usize,
    /// Sequences running at once.
    pub max_running: usize,
    /// Requests waiting at most; more are refused (`SubmitError::QueueFull`).
    pub max_waiting: usize,
    /// Longest sequence, prompt and output together.
    pub max_model_len: usize,
    /// Reuse the KV blocks of earlier requests' common prefixes.
    pub prefix_caching: bool,
}

/// How a token id turns into text, and whether it ends a generation: the tokenizer, or a stand-in in
/// tests on tiny random models.
pub trait Detokenizer: Send + Sync {
    fn token_bytes(&self, id: u32) -> Vec<u8>;
    fn is_end_of_generation(&self, id: u32) -> bool;
}

impl Detokenizer for Tokenizer {
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        Tokenizer::token_bytes(self, id, false)
    }

    fn is_end_of_generation(&self, id: u32) -> bool {
        self.is_eog(id)
    }
}

/// Why a request was refused at submission. The engine is the one place requests are checked; the server
/// maps each variant to its API's status and field.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("{waiting} requests are already waiting (the limit); try again later")]
    QueueFull { waiting: usize },
    /// The prompt can never run here: empty, unknown token ids, longer than the context, or needing more
    /// KV blocks than the whole cache has.
    #[error("{0}")]
    Prompt(String),
    #[error("max_tokens must be at least 1")]
    NoNewTokens,
    /// Out-of-range sampling parameters.
    #[error("{0}")]
    Sampling(String),
    #[error("the engine has stopped")]
    Stopped,
}

/// Live figures for metrics, updated after every step and read without stopping the engine.
#[derive(Debug, Default)]
pub struct EngineStats {
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    pub blocks_used: AtomicUsize,
    pub preemptions: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub finished_requests: AtomicU64,
    pub aborted_requests: AtomicU64,
    /// Prompt tokens of admitted requests, and of those the ones found in the prefix cache.
    pub prefix_cache_queried_tokens: AtomicU64,
    pub prefix_cache_hit_tokens: AtomicU64,
    /// Blocks holding a cached prefix (held by a request or not).
    pub prefix_cache_blocks: AtomicUsize,
    /// Of the hit tokens, those read back from the disk tier; block files there.
    pub prefix_cache_disk_hit_tokens: AtomicU64,
    pub prefix_cache_disk_blocks: AtomicUsize,
    /// Submitted but not yet seen by the engine (counts toward the waiting limit).
    unseen: AtomicUsize,
}

type Ack = std::sync::mpsc::Sender<()>;

enum Command {
    /// `engine`: a sender into this channel, for work the request starts elsewhere (a disk read) to answer
    /// on; it keeps the engine running until that answer, even if every handle is dropped meanwhile.
    Submit { id: RequestId, req: GenerateRequest, events: UnboundedSender<Event>, arrived: Instant, engine: UnboundedSender<Command> },
    Abort(RequestId),
    /// Abort everything, save the prefix cache to disk, acknowledge, stop.
    Shutdown(Ack),
    /// From the disk reader: a held request's prompt blocks `first..first + blocks.len()`.
    Restored { id: RequestId, first: usize, blocks: Vec<Vec<u8>> },
}

/// Prompt blocks for the disk reader to load: keys `hashes` of blocks `first..`, their token ids, and the
/// key of the block before `first` (the sequence's root key if `first` is 0).
struct ReadJob {
    id: RequestId,
    first: usize,
    parent: BlockHash,
    hashes: Vec<BlockHash>,
    tokens: Vec<u32>,
    /// Set when the request ends (aborted, or the engine stops): the rest of the read is skipped.
    cancelled: Arc<AtomicBool>,
    /// Where the blocks go. A strong sender: the engine keeps running while a read is outstanding, even
    /// if every handle is gone; once the engine has stopped, the send just fails.
    reply: UnboundedSender<Command>,
}

/// The disk reader thread: loads each job's blocks in order while they verify, then hands them to the
/// engine. Every job gets its answer (no blocks if cancelled or if loading panicked), so a held request
/// is always released.
fn read_blocks(disk: &DiskTier, jobs: std::sync::mpsc::Receiver<ReadJob>, block_size: usize) {
    for job in jobs {
        let load = || {
            let mut blocks = Vec::new();
            for (k, &hash) in job.hashes.iter().enumerate() {
                if job.cancelled.load(Ordering::Relaxed) {
                    return Vec::new();
                }
                let parent = if k == 0 { job.parent } else { job.hashes[k - 1] };
                match disk.load(hash, parent, &job.tokens[k * block_size..(k + 1) * block_size]) {
                    Some(data) => blocks.push(data),
                    None => break,
                }
            }
            disk.touch_chain(&job.hashes[..blocks.len()]);
            blocks
        };
        let blocks = std::panic::catch_unwind(std::panic::AssertUnwindSafe(load)).unwrap_or_default();
        let _ = job.reply.send(Command::Restored { id: job.id, first: job.first, blocks });
    }
}

/// The client side of the engine; cheap to clone, usable from any thread or task.
#[derive(Clone)]
pub struct EngineHandle {
    commands: UnboundedSender<Command>,
    next_id: Arc<AtomicU64>,
    stats: Arc<EngineStats>,
    config: EngineConfig,
    vocab_size: usize,
}

impl EngineHandle {
    /// Queues a generation; its events arrive on the returned receiver, ending with `Finished` or `Error`.
    pub fn submit(&self, req: GenerateRequest) -> Result<(RequestId, UnboundedReceiver<Event>), SubmitError> {
        self.validate(&req)?;
        let waiting = self.stats.waiting.load(Ordering::Relaxed) + self.stats.unseen.load(Ordering::Relaxed);
        if waiting >= self.config.max_waiting {
            return Err(SubmitError::QueueFull { waiting });
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, rx) = mpsc::unbounded_channel();
        self.stats.unseen.fetch_add(1, Ordering::Relaxed);
        let cmd = Command::Submit { id, req, events, arrived: Instant::now(), engine: self.commands.clone() };
        if self.commands.send(cmd).is_err() {
            self.stats.unseen.fetch_sub(1, Ordering::Relaxed);
            return Err(SubmitError::Stopped);
        }
        Ok((id, rx))
    }

    /// Stops a request; its receiver gets `Finished { reason: Abort, .. }` unless it already finished.
    pub fn abort(&self, id: RequestId) {
        let _ = self.commands.send(Command::Abort(id));
    }

    /// Stops the engine: requests still running or waiting end as aborted, every cached block not yet in
    /// the disk tier (if any) is written there, and then this returns. Later submits are refused.
    pub fn shutdown(&self) {
        let (ack, done) = std::sync::mpsc::channel();
        if self.commands.send(Command::Shutdown(ack)).is_ok() {
            let _ = done.recv();
        }
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    fn validate(&self, req: &GenerateRequest) -> Result<(), SubmitError> {
        let refuse = |m: String| Err(SubmitError::Prompt(m));
        let (max_len, n) = (self.config.max_model_len, req.prompt.len());
        if n == 0 {
            return refuse("the prompt is empty".into());
        }
        if n >= max_len {
            return refuse(format!("this model's maximum context length is {max_len} tokens; the prompt has {n} tokens"));
        }
        if let Some(&bad) = req.prompt.iter().find(|&&t| t as usize >= self.vocab_size) {
            return refuse(format!("token id {bad} is outside the vocabulary ({} tokens)", self.vocab_size));
        }
        // As the scheduler's admission check: the prompt and one generated token must fit the whole pool.
        let blocks_needed = (n + 1).div_ceil(self.config.block_size);
        if blocks_needed > self.config.num_blocks {
            let cache_tokens = self.config.num_blocks * self.config.block_size;
            return refuse(format!("the prompt has {n} tokens; the KV cache holds {cache_tokens} tokens in all (raise --kv-memory)"));
        }
        if req.max_new_tokens == 0 {
            return Err(SubmitError::NoNewTokens);
        }
        req.sampling.validate().map_err(|e| SubmitError::Sampling(e.to_string()))
    }
}

/// Starts the engine thread. It stops when every handle is dropped and no request is left.
pub fn spawn(model: Arc<Model>, detok: Arc<dyn Detokenizer>, config: EngineConfig) -> EngineHandle {
    spawn_with(model, detok, config, None).expect("no disk tier to open")
}

/// `spawn`, with the prefix cache's disk tier in `disk` (ignored when prefix caching is off). Fails if
/// the directory cannot be created or read.
pub fn spawn_with(model: Arc<Model>, detok: Arc<dyn Detokenizer>, config: EngineConfig, disk: Option<DiskTierConfig>) -> std::io::Result<EngineHandle> {
    let kv = model.new_kv(config.block_size, config.num_blocks);
    // With a disk tier, chain keys start from the model's fingerprint: files of other models never match.
    let disk = match disk.filter(|_| config.prefix_caching) {
        Some(d) => {
            let (shape, fingerprint) = (kv.shape, model.fingerprint());
            let format = KvFormat {
                model: fingerprint,
                num_layers: shape.num_layers as u32,
                kv_dim: shape.kv_dim as u32,
                block_size: shape.block_size as u32,
                dtype: 0,
                version: kv_numerics_version(model.numerics()),
            };
            Some(DiskTier::open(&d, format)?)
        }
        None => None,
    };
    let root = disk.as_ref().map_or(0, |d| sha256_block_hash(d.format().model, &[d.format().version]));
    let (commands, rx) = mpsc::unbounded_channel();
    let disk = disk.map(Arc::new);
    let reader = match &disk {
        Some(d) => {
            let (jobs, queue) = std::sync::mpsc::channel::<ReadJob>();
            let (d, bs) = (d.clone(), config.block_size);
            let thread = std::thread::Builder::new().name("reckon-kv-read".into()).spawn(move || read_blocks(&d, queue, bs))?;
            Some((jobs, thread))
        }
        None => None,
    };
    let stats = Arc::new(EngineStats::default());
    let vocab_size = model.config.vocab_size;
    let sched_config = SchedulerConfig {
        block_size: config.block_size,
        max_batch_tokens: config.max_batch_tokens,
        max_prefill_tokens_while_decoding: config.max_prefill_tokens_while_decoding,
        max_running: config.max_running,
        max_model_len: config.max_model_len,
        prefix_caching: config.prefix_caching,
    };
    let engine = EngineLoop {
        kv,
        sched: Scheduler::with_pool(sched_config, BlockPool::with_hasher(config.num_blocks, sha256_block_hash, root)),
        disk,
        reader,
        scratch: Scratch::default(),
        requests: HashMap::new(),
        model,
        detok,
        commands: rx,
        stats: stats.clone(),
    };
    std::thread::Builder::new().name("reckon-engine".into()).spawn(move || engine.run())?;
    Ok(EngineHandle { commands, next_id: Arc::new(AtomicU64::new(1)), stats, config, vocab_size })
}

/// A request the engine is working on.
struct Active {
    req: GenerateRequest,
    events: UnboundedSender<Event>,
    sampler: Sampler,
    text: Utf8Stream,
    arrived: Instant,
    first_scheduled: Option<Instant>,
    first_token: Option<Instant>,
    /// Keys and values of prompt blocks read from the disk tier, until the first admission uses them.
    restored: Vec<Vec<u8>>,
    /// Cancels an outstanding disk read when the request ends.
    read_cancelled: Option<Arc<AtomicBool>>,
}

struct EngineLoop {
    model: Arc<Model>,
    detok: Arc<dyn Detokenizer>,
    kv: KvStorage,
    sched: Scheduler,
    disk: Option<Arc<DiskTier>>,
    /// The disk reader's job queue and thread.
    reader: Option<(std::sync::mpsc::Sender<ReadJob>, std::thread::JoinHandle<()>)>,
    scratch: Scratch,
    requests: HashMap<RequestId, Active>,
    commands: UnboundedReceiver<Command>,
    stats: Arc<EngineStats>,
}

impl EngineLoop {
    fn run(mut self) {
        loop {
            if !self.sched.has_runnable_work() {
                // Idle (or waiting only for disk reads): sleep until a command comes; every handle gone
                // means shut down.
                match self.commands.blocking_recv() {
                    Some(Command::Shutdown(ack)) => return self.stop(Some(ack)),
                    Some(cmd) => self.handle(cmd),
                    None => return self.stop(None),
                }
            }
            loop {
                match self.commands.try_recv() {
                    Ok(Command::Shutdown(ack)) => return self.stop(Some(ack)),
                    Ok(cmd) => self.handle(cmd),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) if self.sched.has_work() => break,
                    Err(TryRecvError::Disconnected) => return self.stop(None),
                }
            }
            if self.sched.has_work() {
                self.step();
            }
            self.publish_stats();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { id, mut req, events, arrived, engine } => {
                self.stats.unseen.fetch_sub(1, Ordering::Relaxed);
                // The scheduler keeps the token ids; the request keeps its settings.
                let prompt = std::mem::take(&mut req.prompt);
                match self.sched.add(id, prompt, req.max_new_tokens) {
                    Ok(()) => {
                        if let Some(salt) = &req.cache_salt {
                            self.sched.set_cache_salt(id, salt.as_bytes());
                        }
                        let sampler = Sampler::new(req.sampling.clone());
                        let active = Active { req, events, sampler, text: Utf8Stream::default(), arrived, first_scheduled: None, first_token: None, restored: Vec::new(), read_cancelled: None };
                        self.requests.insert(id, active);
                        self.request_restore(id, engine);
                    }
                    Err(e) => {
                        let _ = events.send(Event::Error(e.to_string()));
                    }
                }
            }
            Command::Abort(id) => self.finish(id, FinishReason::Abort),
            Command::Shutdown(_) => unreachable!("handled by the loop"),
            Command::Restored { id, first, blocks } => {
                // a request aborted meanwhile is gone: its blocks are dropped
                if let Some(active) = self.requests.get_mut(&id) {
                    let n = blocks.len();
                    active.restored = blocks;
                    self.sched.offer_restored(id, first, n);
                }
            }
        }
    }

    /// Ends every request as aborted and saves the prefix cache to the disk tier.
    fn stop(&mut self, ack: Option<Ack>) {
        // refuse what is still queued, and everything from now on (submit then says Stopped); other
        // shutdown callers are answered when the save is done
        let mut acks: Vec<Ack> = ack.into_iter().collect();
        self.commands.close();
        while let Ok(cmd) = self.commands.try_recv() {
            match cmd {
                Command::Submit { events, .. } => {
                    self.stats.unseen.fetch_sub(1, Ordering::Relaxed);
                    let _ = events.send(Event::Error(SubmitError::Stopped.to_string()));
                }
                Command::Shutdown(ack) => acks.push(ack),
                Command::Abort(_) | Command::Restored { .. } => {}
            }
        }
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            self.finish(id, FinishReason::Abort);
        }
        self.publish_stats();
        if let Some((jobs, reader)) = self.reader.take() {
            drop(jobs);
            let _ = reader.join();
        }
        if let Some(disk) = self.disk.take() {
            // in eviction order, so the disk's size bound drops what memory would have dropped first
            for e in self.sched.pool().cached_blocks() {
                if disk.contains(e.hash) {
                    disk.touch_chain(&[e.hash]);
                } else {
                    disk.store(self.block_file(e), true);
                }
            }
            match Arc::try_unwrap(disk) {
                Ok(disk) => disk.close(),
                Err(_) => tracing::warn!("prefix cache dir: still shared at shutdown; queued writes may be lost"),
            }
        }
        for ack in acks {
            let _ = ack.send(());
        }
    }

    fn block_file(&self, e: EvictedBlock) -> BlockFile {
        BlockFile { hash: e.hash, parent_hash: e.parent_hash, data: self.kv.read_block(e.block), tokens: e.tokens }
    }

    /// If the prompt's next blocks after those cached in memory are in the disk tier, holds the request
    /// and has the reader load them (`Command::Restored` brings them back).
    fn request_restore(&mut self, id: RequestId, reply: UnboundedSender<Command>) {
        let (Some(disk), Some((jobs, _))) = (&self.disk, &self.reader) else { return };
        let (root, hashes, in_memory) = self.sched.probe(id).expect("just added");
        // bounded: at most half the pool, and RESTORE_MAX_BYTES held per waiting request
        let max_blocks = (self.kv.shape.num_blocks / 2).min(RESTORE_MAX_BYTES / self.kv.block_bytes().max(1));
        let end = hashes.len().min(in_memory + max_blocks);
        if in_memory >= end || !disk.contains(hashes[in_memory]) {
            return;
        }
        let bs = self.kv.shape.block_size;
        let tokens = self.sched.seq(id).expect("just added").tokens[in_memory * bs..end * bs].to_vec();
        let parent = if in_memory == 0 { root } else { hashes[in_memory - 1] };
        let cancelled = Arc::new(AtomicBool::new(false));
        let job = ReadJob { id, first: in_memory, parent, hashes: hashes[in_memory..end].to_vec(), tokens, cancelled: cancelled.clone(), reply };
        if jobs.send(job).is_ok() {
            self.sched.hold(id);
            if let Some(active) = self.requests.get_mut(&id) {
                active.read_cancelled = Some(cancelled);
            }
        }
    }

    /// Writes cached blocks about to be overwritten to the disk tier (in the background; dropped, not
    /// copied, when the writer is behind).
    fn save_evicted(&mut self, evicted: Vec<EvictedBlock>) {
        if let Some(disk) = &self.disk {
            for e in evicted {
                if disk.contains(e.hash) {
                    disk.touch_chain(&[e.hash]);
                } else if disk.has_room() {
                    disk.store(self.block_file(e), false);
                }
            }
        }
    }

    /// Fills the blocks the scheduler assigned to restored prompt blocks.
    fn write_restores(&mut self, restores: &[Restore]) {
        for r in restores {
            let Some(active) = self.requests.get_mut(&r.id) else { continue };
            let data = std::mem::take(&mut active.restored);
            for (i, &b) in r.blocks.iter().enumerate() {
                self.kv.write_block(b, &data[r.skip + i]);
            }
        }
    }

    /// One model step over everything the scheduler planned.
    fn step(&mut self) {
        let scheduling = Instant::now();
        let mut plan = self.sched.schedule();
        // evicted blocks are saved before restores or this step overwrite them
        self.save_evicted(std::mem::take(&mut plan.evicted));
        self.write_restores(&plan.restores);
        if plan.is_empty() {
            return;
        }
        let now = Instant::now();
        for c in &plan.chunks {
            if let Some(a) = self.requests.get_mut(&c.id) {
                if a.first_scheduled.is_none() {
                    a.first_scheduled = Some(now);
                    a.restored = Vec::new();
                }
            }
        }
        let sampled = match self.forward_and_sample(&plan) {
            Ok(s) => s,
            Err(e) => {
                // A failed step fails the requests in it, not the engine.
                for c in &plan.chunks {
                    if let Some(a) = self.requests.remove(&c.id) {
                        let _ = a.events.send(Event::Error(format!("model step failed: {e}")));
                    }
                    self.sched.remove(c.id);
                }
                return;
            }
        };
        let step_ms = now.elapsed().as_secs_f64() * 1e3;
        let emitting = Instant::now();
        let tokens: Vec<u32> = sampled.iter().map(|s| s.1).collect();
        self.sched.complete_step(&plan, &tokens);
        for (id, token, logprobs) in sampled {
            self.emit(id, token, logprobs);
        }
        // ms: the model step and sampling; schedule_ms and emit_ms: the engine's own work around it.
        let step_tokens: usize = plan.chunks.iter().map(|c| c.len).sum();
        let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
        tracing::debug!(sequences = plan.chunks.len(), tokens = step_tokens, ms = step_ms, schedule_ms = ms(now - scheduling), emit_ms = ms(emitting.elapsed()), "step");
    }

    /// Runs the model on the plan's chunks and samples a token for every chunk that ends its sequence.
    fn forward_and_sample(&mut self, plan: &StepPlan) -> crate::error::Result<Vec<(RequestId, u32, Option<TokenLogprobs>)>> {
        let inputs: Vec<SeqInput> = plan
            .chunks
            .iter()
            .map(|c| {
                let seq = self.sched.seq(c.id).expect("planned sequences exist");
                let logits = if c.samples { LogitsWanted::Last } else { LogitsWanted::None };
                SeqInput { tokens: &seq.tokens[c.start..c.start + c.len], start_pos: c.start, block_table: &seq.block_table, logits }
            })
            .collect();
        let logits = self.model.forward(&inputs, &mut self.kv, &mut self.scratch)?;
        if rest_between_steps() {
            // The pool's workers park now: while the token events go out, the HTTP threads they wake
            // find a free core instead of preempting this thread (see `rest_between_steps`).
            crate::pool::current().rest();
        }
        let vocab = self.model.config.vocab_size;
        let mut out = Vec::new();
        for (row, c) in plan.chunks.iter().filter(|c| c.samples).enumerate() {
            let lg = &logits[row * vocab..(row + 1) * vocab];
            let seq = self.sched.seq(c.id).expect("planned sequences exist");
            let active = self.requests.get_mut(&c.id).expect("scheduled requests are active");
            let token = active.sampler.sample(lg, &seq.tokens);
            let logprobs = active.req.logprobs.map(|k| token_logprobs(lg, token, k));
            out.push((c.id, token, logprobs));
        }
        Ok(out)
    }

    /// Sends a generated token and finishes the request if it stops here.
    fn emit(&mut self, id: RequestId, token: u32, logprobs: Option<TokenLogprobs>) {
        self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
        let seq = self.sched.seq(id).expect("sampled sequences exist");
        let (generated, max_new) = (seq.num_generated(), seq.max_new_tokens);
        let active = self.requests.get_mut(&id).expect("sampled requests are active");
        active.first_token.get_or_insert_with(Instant::now);
        let stop = (!active.req.ignore_eos && self.detok.is_end_of_generation(token)) || active.req.stop_token_ids.contains(&token);
        let mut text = if stop { String::new() } else { active.text.push(&self.detok.token_bytes(token)) };
        let finish = if stop {
            Some(FinishReason::Stop)
        } else if generated >= max_new {
            Some(FinishReason::Length)
        } else {
            None
        };
        if finish.is_some() {
            text.push_str(&active.text.finish());
        }
        let delivered = active.events.send(Event::Token { id: token, text, logprobs }).is_ok();
        match finish {
            Some(reason) => self.finish(id, reason),
            None if !delivered => self.finish(id, FinishReason::Abort),
            None => {}
        }
    }

    /// Ends a request: its last event, its blocks back to the pool.
    fn finish(&mut self, id: RequestId, reason: FinishReason) {
        let Some(active) = self.requests.remove(&id) else { return };
        if let Some(read) = &active.read_cancelled {
            read.store(true, Ordering::Relaxed);
        }
        let Some(seq) = self.sched.remove(id) else { return };
        let now = Instant::now();
        let usage = Usage { prompt_tokens: seq.num_prompt_tokens, completion_tokens: seq.num_generated(), cached_tokens: seq.num_cached_tokens };
        let since = |t: Option<Instant>| t.unwrap_or(now).duration_since(active.arrived);
        let timings = Timings {
            queue: since(active.first_scheduled),
            time_to_first_token: since(active.first_token),
            end_to_end: now.duration_since(active.arrived),
        };
        let _ = active.events.send(Event::Finished { reason, usage, timings });
        self.stats.prompt_tokens.fetch_add(seq.num_prompt_tokens as u64, Ordering::Relaxed);
        let counter = if reason == FinishReason::Abort { &self.stats.aborted_requests } else { &self.stats.finished_requests };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn publish_stats(&self) {
        let s = &self.stats;
        s.waiting.store(self.sched.num_waiting(), Ordering::Relaxed);
        s.running.store(self.sched.num_running(), Ordering::Relaxed);
        let pool = self.sched.pool();
        s.blocks_used.store(pool.num_blocks() - pool.num_free(), Ordering::Relaxed);
        s.preemptions.store(self.sched.num_preemptions(), Ordering::Relaxed);
        let prefix = self.sched.prefix_stats();
        s.prefix_cache_queried_tokens.store(prefix.queried_tokens, Ordering::Relaxed);
        s.prefix_cache_hit_tokens.store(prefix.hit_tokens, Ordering::Relaxed);
        s.prefix_cache_blocks.store(pool.num_cached(), Ordering::Relaxed);
        s.prefix_cache_disk_hit_tokens.store(prefix.disk_hit_tokens, Ordering::Relaxed);
        s.prefix_cache_disk_blocks.store(self.disk.as_ref().map_or(0, |d| d.num_files()), Ordering::Relaxed);
    }
}

/// Whether the pool's workers park between engine steps (on unless `RECKON_POOL_REST=0`). With both
/// cores of a small machine busy (this thread and a spinning worker), each token event's wake-up of an
/// HTTP thread landed on this thread's core and preempted it. `bench/serve-load -c 1,8 -r 8` against a
/// `RECKON_POOL_REST=0` build (SmolLM2, engine step log): sending a step's events took 0.60 → 0.06 ms at
/// 8 streams (10.3 ms steps either way), 0.22 → 0.04 ms at one; decode tokens/s at 8 streams 697 → 724
/// (median of the passes; ahead in 5 of 8).
fn rest_between_steps() -> bool {
    static REST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *REST.get_or_init(|| std::env::var("RECKON_POOL_REST").map_or(true, |v| v != "0"))
}

/// Natural-log probabilities of `token` and of the `k` most likely tokens (ties by lower id).
fn token_logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = logits.iter().map(|&l| ((l - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    let lp = |l: f32| (l as f64 - lse) as f32;
    if k == 0 {
        return TokenLogprobs { logprob: lp(logits[token as usize]), top: Vec::new() };
    }
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(order.len());
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if k > 0 && k < order.len() {
        order.select_nth_unstable_by(k - 1, by_logit);
    }
    order.truncate(k);
    order.sort_unstable_by(by_logit);
    TokenLogprobs { logprob: lp(logits[token as usize]), top: order.into_iter().map(|t| (t, lp(logits[t as usize]))).collect() }
}

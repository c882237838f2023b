//! The engine on its own thread: the loop takes commands (submit, abort, shutdown, finished disk reads)
//! between steps and steps while there is work. Clients hold an `EngineHandle` (cheap to clone, any thread
//! or task) and read each request's events from its own channel.
//!
//! A request whose event receiver is dropped is treated as aborted at its next token; an explicit abort
//! is handled before the next step. Either way its blocks are released within one step.
//!
//! A panic on the engine thread is a failed engine, not a silent stop: every request in flight or queued
//! gets an error event, the disk tier is written no more, and `EngineHandle::failure` says so from then
//! on (the server's `/health` answers 503 and the process exits for its supervisor to restart it).

use super::validate::{validate, GenerateParams, Limits, RequestError, ValidatedRequest};
use super::{Detokenizer, Engine, EngineConfig, EngineStats, Event, RequestId};
use crate::kv::offload::RestoredBlocks;
use crate::kv::DiskTierConfig;
use crate::model::Model;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{self, error::TryRecvError, UnboundedReceiver, UnboundedSender};
use tokio::sync::watch;

type Ack = std::sync::mpsc::Sender<()>;

enum Command {
    /// `reply`: the submitting handle's sender, for a disk read to answer on; it keeps the engine running
    /// until that answer, even if every handle is dropped meanwhile.
    Submit { id: RequestId, req: ValidatedRequest, events: UnboundedSender<Event>, arrived: Instant, reply: UnboundedSender<Command> },
    Abort(RequestId),
    /// Finish what runs until `deadline` (later submits are refused), fail the rest, save the prefix
    /// cache, acknowledge, stop.
    Shutdown { deadline: Instant, ack: Ack },
    /// A disk read for a waiting request finished.
    Restored(RestoredBlocks),
    /// Drop the prefix cache (`Engine::reset_prefix_cache`); the answer says whether it was.
    ResetPrefixCache(std::sync::mpsc::Sender<bool>),
}

/// The client side of the engine.
#[derive(Clone)]
pub struct EngineHandle {
    commands: UnboundedSender<Command>,
    next_id: Arc<AtomicU64>,
    stats: Arc<EngineStats>,
    config: EngineConfig,
    limits: Limits,
    /// The KV layout in effect, and the bytes of one layer's key and value of a token.
    kv_layout: crate::kv::KvLayout,
    kv_cell_bytes: usize,
    /// Set when a shutdown starts: submits are refused from then on.
    draining: Arc<AtomicBool>,
    /// Why the engine thread failed (it panicked), once it has.
    failure: watch::Receiver<Option<String>>,
}

impl EngineHandle {
    /// Validates and queues a generation; its events arrive on the returned receiver, ending with
    /// `Finished` or `Error`.
    pub fn submit(&self, params: GenerateParams) -> Result<(RequestId, UnboundedReceiver<Event>), RequestError> {
        if let Some(why) = self.failure() {
            return Err(RequestError::Failed(why));
        }
        if self.draining.load(Ordering::Relaxed) {
            return Err(RequestError::ShuttingDown);
        }
        let req = validate(params, &self.limits)?;
        let waiting = self.stats.waiting.load(Ordering::Relaxed) + self.stats.unseen.load(Ordering::Relaxed);
        if waiting >= self.config.max_waiting {
            return Err(RequestError::QueueFull { waiting });
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, rx) = mpsc::unbounded_channel();
        self.stats.unseen.fetch_add(1, Ordering::Relaxed);
        let cmd = Command::Submit { id, req, events, arrived: Instant::now(), reply: self.commands.clone() };
        if self.commands.send(cmd).is_err() {
            self.stats.unseen.fetch_sub(1, Ordering::Relaxed);
            return Err(self.failure().map_or(RequestError::Stopped, RequestError::Failed));
        }
        Ok((id, rx))
    }

    /// Why the engine failed, once it has (a panic on its thread; `None` while it works). Nothing is
    /// served after that: the process should exit so that its supervisor starts a new one.
    pub fn failure(&self) -> Option<String> {
        self.failure.borrow().clone()
    }

    /// Resolves when the engine fails, with why; never, if it does not.
    pub async fn failed(&self) -> String {
        let mut rx = self.failure.clone();
        let why = rx.wait_for(Option::is_some).await.map(|why| why.clone().unwrap_or_default());
        match why {
            Ok(why) => why,
            // the engine thread ended without failing (a clean stop): nothing to wait for
            Err(_) => std::future::pending().await,
        }
    }

    /// The requests waiting (queued or not yet seen by the engine) when a submit now would be refused
    /// for a full queue (`RequestError::QueueFull`): an API checks it before it builds a prompt, so the
    /// requests a flood gets refused cost no template rendering or tokenizing.
    pub fn queue_full(&self) -> Option<usize> {
        let waiting = self.stats.waiting.load(Ordering::Relaxed) + self.stats.unseen.load(Ordering::Relaxed);
        (waiting >= self.config.max_waiting).then_some(waiting)
    }

    /// Stops a request; its receiver gets `Finished { reason: Abort, .. }` unless it already finished.
    pub fn abort(&self, id: RequestId) {
        let _ = self.commands.send(Command::Abort(id));
    }

    /// Stops the engine: submits are refused at once (`ShuttingDown`), running and queued requests go on
    /// for up to `drain` and any still unfinished then ends with an error event, every cached block not
    /// yet in the disk tier (if any) is written there, and then this returns.
    pub fn shutdown(&self, drain: Duration) {
        self.draining.store(true, Ordering::Relaxed);
        let (ack, done) = std::sync::mpsc::channel();
        if self.commands.send(Command::Shutdown { deadline: Instant::now() + drain, ack }).is_ok() {
            let _ = done.recv();
        }
    }

    /// Drops every cached prefix in memory if no request holds a block (`Engine::reset_prefix_cache`);
    /// blocks until the engine answers (false also when it has stopped).
    pub fn reset_prefix_cache(&self) -> bool {
        let (ack, done) = std::sync::mpsc::channel();
        self.commands.send(Command::ResetPrefixCache(ack)).is_ok() && done.recv().unwrap_or(false)
    }

    /// Whether a shutdown has started.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The KV layout in effect (`EngineConfig::kv_layout`).
    pub fn kv_layout(&self) -> &crate::kv::KvLayout {
        &self.kv_layout
    }

    /// The KV cache's memory per kind of layer (`KvLayout::memory_by_kind`), and the bytes of one block.
    pub fn kv_memory(&self) -> (Vec<crate::kv::layout::LayerKindMemory>, usize) {
        let (bs, chunk) = (self.config.block_size, self.config.max_batch_tokens);
        (self.kv_layout.memory_by_kind(self.kv_cell_bytes, bs, chunk), self.kv_layout.page_bytes(self.kv_cell_bytes, bs))
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }
}

/// Starts the engine thread. It stops when every handle is dropped and no request is left.
pub fn spawn(model: Arc<Model>, detok: Arc<dyn Detokenizer>, config: EngineConfig) -> EngineHandle {
    spawn_with(model, detok, config, None).expect("no disk tier to open")
}

/// `spawn`, with the prefix cache's disk tier in `disk` (ignored when prefix caching is off). Fails if
/// the directory cannot be created or read.
pub fn spawn_with(model: Arc<Model>, detok: Arc<dyn Detokenizer>, config: EngineConfig, disk: Option<DiskTierConfig>) -> std::io::Result<EngineHandle> {
    spawn_with_draft(model, None, detok, config, disk)
}

/// `spawn_with`, with a draft model for speculative decoding (`Engine::new`).
pub fn spawn_with_draft(model: Arc<Model>, draft: Option<Arc<Model>>, detok: Arc<dyn Detokenizer>, config: EngineConfig, disk: Option<DiskTierConfig>) -> std::io::Result<EngineHandle> {
    spawn_with_models(model, draft, None, detok, config, disk)
}

/// `spawn_with_draft`, with a scorer for sparse prefill too (`Engine::with_scorer`).
pub fn spawn_with_models(model: Arc<Model>, draft: Option<Arc<Model>>, scorer: Option<Arc<Model>>, detok: Arc<dyn Detokenizer>, config: EngineConfig, disk: Option<DiskTierConfig>) -> std::io::Result<EngineHandle> {
    let mut engine = Engine::new(model, draft, detok, config, disk)?;
    if let Some(s) = scorer {
        engine = engine.with_scorer(s)?;
    }
    spawn_engine(engine)
}

/// Runs `engine` (built with `Engine::new` and its `with_*` options) on a thread of its own.
pub fn spawn_engine(engine: Engine) -> std::io::Result<EngineHandle> {
    let config = *engine.config();
    let (commands, rx) = mpsc::unbounded_channel();
    let (stats, limits) = (engine.stats().clone(), engine.limits());
    let (kv_layout, kv_cell_bytes) = (engine.kv_layout().clone(), engine.kv_cell_bytes());
    let (failed, failure) = watch::channel(None);
    let mut worker = Loop { engine, commands: rx, drain: None };
    std::thread::Builder::new().name("reckon-engine".into()).spawn(move || {
        // (the panic hook has printed the message and where: this turns it into a failed engine)
        if let Err(payload) = catch_unwind(AssertUnwindSafe(|| worker.run())) {
            worker.fail_all(panic_message(&*payload), &failed);
        }
    })?;
    Ok(EngineHandle { commands, next_id: Arc::new(AtomicU64::new(1)), stats, config, limits, kv_layout, kv_cell_bytes, draining: Arc::new(AtomicBool::new(false)), failure })
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    let text = payload.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| payload.downcast_ref::<String>().cloned());
    format!("the engine failed (a panic on its thread: {}); the server must be restarted", text.as_deref().unwrap_or("no message"))
}

struct Loop {
    engine: Engine,
    commands: UnboundedReceiver<Command>,
    /// A shutdown in progress: its deadline and who waits for it.
    drain: Option<(Instant, Vec<Ack>)>,
}

impl Loop {
    fn run(&mut self) {
        loop {
            // idle: recover a sparse prefill's full prompt in the background (not while draining)
            if !self.engine.has_runnable_work() && !(self.drain.is_none() && self.engine.start_recovery()) {
                // Idle (or waiting only for disk reads): sleep until a command comes; every handle gone
                // means stop.
                if self.drain.is_some() && !self.engine.has_work() {
                    return self.stop();
                }
                match self.commands.blocking_recv() {
                    Some(cmd) => self.handle(cmd),
                    None => return self.stop(),
                }
            }
            loop {
                match self.commands.try_recv() {
                    Ok(cmd) => self.handle(cmd),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) if self.engine.has_work() => break,
                    Err(TryRecvError::Disconnected) => return self.stop(),
                }
            }
            if let Some((deadline, _)) = &self.drain {
                if !self.engine.has_work() || Instant::now() >= *deadline {
                    return self.stop();
                }
            }
            if self.engine.has_work() {
                self.engine.step();
            }
            self.engine.publish_stats();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { id, req, events, arrived, reply } => {
                self.engine.stats().unseen.fetch_sub(1, Ordering::Relaxed);
                let restore_reply: crate::kv::offload::RestoreReply = Box::new(move |r| {
                    let _ = reply.send(Command::Restored(r));
                });
                self.engine.add_request(id, req, events, arrived, Some(restore_reply));
            }
            Command::Abort(id) => self.engine.abort(id),
            Command::Shutdown { deadline, ack } => match &mut self.drain {
                // a second shutdown cannot extend the first one's deadline
                Some((first, acks)) => {
                    *first = (*first).min(deadline);
                    acks.push(ack);
                }
                None => {
                    self.engine.stop_recovery();
                    self.drain = Some((deadline, vec![ack]));
                }
            },
            Command::Restored(r) => self.engine.restored(r),
            Command::ResetPrefixCache(ack) => {
                let _ = ack.send(self.engine.reset_prefix_cache());
            }
        }
    }

    /// After a panic: says so to every handle first (submits are refused from then on), then fails every
    /// queued submit and every request with an error event, stops disk-tier writes, and answers every
    /// waiting caller. The engine itself is not stepped again.
    fn fail_all(&mut self, why: String, failed: &watch::Sender<Option<String>>) {
        tracing::error!("{why}");
        failed.send_replace(Some(why.clone()));
        self.commands.close();
        while let Ok(cmd) = self.commands.try_recv() {
            match cmd {
                Command::Submit { events, .. } => {
                    self.engine.stats().unseen.fetch_sub(1, Ordering::Relaxed);
                    let _ = events.send(Event::Error(why.clone()));
                }
                Command::Shutdown { ack, .. } => {
                    let _ = ack.send(());
                }
                Command::ResetPrefixCache(ack) => {
                    let _ = ack.send(false);
                }
                Command::Abort(_) | Command::Restored(_) => {}
            }
        }
        // (what `abandon` reads may be what broke: a second panic there still leaves the callers answered)
        if catch_unwind(AssertUnwindSafe(|| self.engine.abandon(&why))).is_err() {
            tracing::error!("the failed engine's requests could not all be told");
        }
        for ack in self.drain.take().map(|(_, a)| a).unwrap_or_default() {
            let _ = ack.send(());
        }
    }

    /// Fails what is left (queued submits and unfinished requests), saves the prefix cache, answers
    /// every shutdown caller.
    fn stop(&mut self) {
        let mut acks = self.drain.take().map(|(_, a)| a).unwrap_or_default();
        // refuse what is still queued, and everything from now on (submit then says Stopped)
        self.commands.close();
        while let Ok(cmd) = self.commands.try_recv() {
            match cmd {
                Command::Submit { events, .. } => {
                    self.engine.stats().unseen.fetch_sub(1, Ordering::Relaxed);
                    let _ = events.send(Event::Error(RequestError::ShuttingDown.to_string()));
                }
                Command::Shutdown { ack, .. } => acks.push(ack),
                Command::ResetPrefixCache(ack) => {
                    let _ = ack.send(false);
                }
                Command::Abort(_) | Command::Restored(_) => {}
            }
        }
        for id in self.engine.request_ids() {
            self.engine.fail(id, "the server shut down before this request finished");
        }
        self.engine.publish_stats();
        self.engine.close();
        for ack in acks {
            let _ = ack.send(());
        }
    }
}

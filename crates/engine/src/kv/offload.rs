//! The engine's side of the disk tier: evicted blocks go out to files, and a new request whose next
//! prompt blocks are on disk waits while a reader thread loads them, then has them written into the
//! blocks its admission got. The scheduler only sees ids: `hold`, `offer_restored` and `Restore`.

use super::disk_tier::{BlockFile, DiskTier, DiskTierConfig, KvFormat};
use super::{sha256_block_hash, BlockHash, EvictedBlock, KvStorage, PrefixProbe};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Keys and values read back from the disk tier and held by one waiting request, at most.
const RESTORE_MAX_BYTES: usize = 256 << 20;

/// Prompt blocks read back for one request: its blocks `first..first + blocks.len()`.
pub struct RestoredBlocks {
    pub id: u64,
    pub first: usize,
    pub blocks: Vec<Vec<u8>>,
}

/// Where a finished read is delivered (the engine loop's command channel). Called exactly once per read,
/// with no blocks if the read was cancelled or failed.
pub type RestoreReply = Box<dyn FnOnce(RestoredBlocks) + Send>;

/// Prompt blocks for the reader to load: keys `hashes` of blocks `first..`, their token ids, and the key
/// of the block before `first` (the request's root key if `first` is 0).
struct ReadJob {
    id: u64,
    first: usize,
    parent: BlockHash,
    hashes: Vec<BlockHash>,
    tokens: Vec<u32>,
    /// Set when the request ends: the rest of the read is skipped.
    cancelled: Arc<AtomicBool>,
    reply: RestoreReply,
}

/// A request the reader is loading blocks for, or whose loaded blocks await its admission.
struct Pending {
    cancelled: Arc<AtomicBool>,
    restored: Vec<Vec<u8>>,
}

pub struct DiskOffload {
    disk: Option<Arc<DiskTier>>,
    /// The reader's job queue and thread.
    reader: Option<(std::sync::mpsc::Sender<ReadJob>, std::thread::JoinHandle<()>)>,
    pending: HashMap<u64, Pending>,
    root: BlockHash,
}

impl DiskOffload {
    /// Opens (creates) the directory and starts the reader thread.
    pub fn open(config: &DiskTierConfig, format: KvFormat) -> std::io::Result<DiskOffload> {
        let disk = Arc::new(DiskTier::open(config, format)?);
        let (jobs, queue) = std::sync::mpsc::channel::<ReadJob>();
        let (d, bs) = (disk.clone(), format.block_size as usize);
        let thread = std::thread::Builder::new().name("reckon-kv-read".into()).spawn(move || read_blocks(&d, queue, bs))?;
        Ok(DiskOffload { disk: Some(disk), reader: Some((jobs, thread)), pending: HashMap::new(), root: sha256_block_hash(format.model, &[format.version]) })
    }

    /// The root key of every request's block chain: a model and KV format fingerprint, so files of
    /// another model or format never match.
    pub fn root(&self) -> BlockHash {
        self.root
    }

    pub fn num_files(&self) -> usize {
        self.disk.as_ref().map_or(0, |d| d.num_files())
    }

    /// If a new request's prompt blocks after those cached in memory are on disk, starts reading them
    /// (at most half the pool, and `RESTORE_MAX_BYTES`) and returns true: the request must wait for
    /// `reply`. `tokens`: the request's prompt.
    pub fn start_restore(&mut self, id: u64, probe: &PrefixProbe, tokens: &[u32], kv: &KvStorage, reply: RestoreReply) -> bool {
        let (Some(disk), Some((jobs, _))) = (&self.disk, &self.reader) else { return false };
        let max_blocks = (kv.shape.num_blocks / 2).min(RESTORE_MAX_BYTES / kv.block_bytes().max(1));
        let (hashes, in_memory) = (&probe.hashes, probe.in_memory);
        let end = hashes.len().min(in_memory + max_blocks);
        if in_memory >= end || !disk.contains(hashes[in_memory]) {
            return false;
        }
        let bs = kv.shape.block_size;
        let parent = if in_memory == 0 { probe.root } else { hashes[in_memory - 1] };
        let cancelled = Arc::new(AtomicBool::new(false));
        let tokens = tokens[in_memory * bs..end * bs].to_vec();
        let job = ReadJob { id, first: in_memory, parent, hashes: hashes[in_memory..end].to_vec(), tokens, cancelled: cancelled.clone(), reply };
        if jobs.send(job).is_err() {
            return false;
        }
        self.pending.insert(id, Pending { cancelled, restored: Vec::new() });
        true
    }

    /// Keeps a finished read's blocks until the request's admission; false if the request is gone.
    pub fn restored(&mut self, r: RestoredBlocks) -> bool {
        match self.pending.get_mut(&r.id) {
            Some(p) => {
                p.restored = r.blocks;
                true
            }
            None => false,
        }
    }

    /// Fills the blocks an admission assigned to a request's restored blocks (`skip`: the first one
    /// used), and drops the rest of what was read.
    pub fn write_restore(&mut self, kv: &mut KvStorage, id: u64, skip: usize, blocks: &[u32]) {
        let Some(p) = self.pending.remove(&id) else { return };
        // (a `NULL_BLOCK` entry: a block a window's gap made useless; its read is dropped)
        for (i, &b) in blocks.iter().enumerate().filter(|(_, &b)| b != crate::kv::NULL_BLOCK) {
            kv.write_block(b, &p.restored[skip + i]);
        }
    }

    /// The request has ended or was admitted without its restored blocks: cancels its read, drops them.
    pub fn forget(&mut self, id: u64) {
        if let Some(p) = self.pending.remove(&id) {
            p.cancelled.store(true, Ordering::Relaxed);
        }
    }

    /// Writes cached blocks about to be overwritten to the disk tier (in the background; dropped, not
    /// copied, when the writer is behind).
    pub fn save_evicted(&self, kv: &KvStorage, evicted: Vec<EvictedBlock>) {
        let Some(disk) = &self.disk else { return };
        for e in evicted {
            if disk.contains(e.hash) {
                disk.touch_chain(&[e.hash]);
            } else if disk.has_room() {
                disk.store(block_file(kv, e), false);
            }
        }
    }

    /// At shutdown: stops the reader, writes every cached block not on disk yet (`cached`: in eviction
    /// order, so the size bound drops what memory would have dropped first), and waits for the writes.
    pub fn close(&mut self, kv: &KvStorage, cached: Vec<EvictedBlock>) {
        for (_, p) in self.pending.drain() {
            p.cancelled.store(true, Ordering::Relaxed);
        }
        if let Some((jobs, reader)) = self.reader.take() {
            drop(jobs);
            let _ = reader.join();
        }
        let Some(disk) = self.disk.take() else { return };
        for e in cached {
            if disk.contains(e.hash) {
                disk.touch_chain(&[e.hash]);
            } else {
                disk.store(block_file(kv, e), true);
            }
        }
        match Arc::try_unwrap(disk) {
            Ok(disk) => disk.close(),
            Err(_) => tracing::warn!("prefix cache dir: still shared at shutdown; queued writes may be lost"),
        }
    }
}

fn block_file(kv: &KvStorage, e: EvictedBlock) -> BlockFile {
    BlockFile { hash: e.hash, parent_hash: e.parent_hash, data: kv.read_block(e.block), tokens: e.tokens }
}

/// The reader thread: loads each job's blocks in order while they verify, then replies. Every job gets
/// its reply (no blocks if cancelled or if loading panicked), so a waiting request is always released.
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
        (job.reply)(RestoredBlocks { id: job.id, first: job.first, blocks });
    }
}

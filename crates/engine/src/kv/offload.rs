//! The engine's side of the disk tier: evicted blocks go out to files, and a new request whose next
//! prompt blocks are on disk waits while a reader thread loads them, then has them written into the
//! blocks its admission got. The scheduler only sees ids: `hold`, `offer_restored` and `Restore`.

use super::disk_tier::{BlockFile, DiskTier, DiskTierConfig, KvFormat};
use super::{sha256_block_hash, BlockHash, EvictedBlock, KvStorage, KvWindow, PrefixProbe};
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Keys and values read back from the disk tier and held by one waiting request, at most.
const RESTORE_MAX_BYTES: usize = 256 << 20;

/// Prompt blocks read back for one request: its blocks `first..first + blocks.len()`, `None` where the
/// read skipped a block no query after it attends to (a window's gap).
pub struct RestoredBlocks {
    pub id: u64,
    pub first: usize,
    pub blocks: Vec<Option<Vec<u8>>>,
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
    /// Blocks to load at most (the gap's, skipped, not counted).
    max_loaded: usize,
    /// Set when the request ends: the rest of the read is skipped.
    cancelled: Arc<AtomicBool>,
    reply: RestoreReply,
}

/// A request the reader is loading blocks for, or whose loaded blocks await its admission.
struct Pending {
    cancelled: Arc<AtomicBool>,
    restored: Vec<Option<Vec<u8>>>,
}

pub struct DiskOffload {
    disk: Option<Arc<DiskTier>>,
    /// The reader's job queue and thread.
    reader: Option<(std::sync::mpsc::Sender<ReadJob>, std::thread::JoinHandle<()>)>,
    pending: HashMap<u64, Pending>,
    root: BlockHash,
    window: Option<KvWindow>,
}

impl DiskOffload {
    /// Opens (creates) the directory and starts the reader thread. `window`: the engine's KV window, if
    /// any (a read then skips the blocks in its gap).
    pub fn open(config: &DiskTierConfig, format: KvFormat, window: Option<KvWindow>) -> std::io::Result<DiskOffload> {
        let disk = Arc::new(DiskTier::open(config, format)?);
        let (jobs, queue) = std::sync::mpsc::channel::<ReadJob>();
        let (d, bs) = (disk.clone(), format.block_size as usize);
        let thread = std::thread::Builder::new().name("reckon-kv-read".into()).spawn(move || read_blocks(&d, queue, bs, window))?;
        Ok(DiskOffload { disk: Some(disk), reader: Some((jobs, thread)), pending: HashMap::new(), root: sha256_block_hash(format.model, &[format.version]), window })
    }

    /// The root key of every request's block chain: a model and KV format fingerprint, so files of
    /// another model or format never match.
    pub fn root(&self) -> BlockHash {
        self.root
    }

    /// The disk tier's KV-cache events go to `sink` (`DiskTier::send_events_to`).
    pub fn send_events_to(&self, sink: super::KvEventSink) {
        if let Some(d) = &self.disk {
            d.send_events_to(sink, self.root);
        }
    }

    pub fn num_files(&self) -> usize {
        self.disk.as_ref().map_or(0, |d| d.num_files())
    }

    /// If a new request's prompt blocks after those cached in memory are on disk (`read_len` finds a
    /// run), starts reading them (at most half the pool, and `RESTORE_MAX_BYTES`) and returns true: the
    /// request must wait for `reply`. `tokens`: the request's prompt. Under a window the read continues
    /// past blocks that are not on disk if no query after it attends to them, and skips them.
    pub fn start_restore(&mut self, id: u64, probe: &PrefixProbe, tokens: &[u32], kv: &KvStorage, reply: RestoreReply) -> bool {
        let (Some(disk), Some((jobs, _))) = (&self.disk, &self.reader) else { return false };
        let max_loaded = (kv.shape.num_blocks / 2).min(RESTORE_MAX_BYTES / kv.block_bytes().max(1));
        let (hashes, in_memory) = (&probe.hashes, probe.in_memory);
        let (end, bs) = (hashes.len(), kv.shape.block_size);
        let present: Vec<bool> = hashes.get(in_memory..).unwrap_or_default().iter().map(|&h| disk.contains(h)).collect();
        if read_len(in_memory, &present, self.window, bs, max_loaded) == 0 {
            return false;
        }
        let parent = if in_memory == 0 { probe.root } else { hashes[in_memory - 1] };
        let cancelled = Arc::new(AtomicBool::new(false));
        let tokens = tokens[in_memory * bs..end * bs].to_vec();
        let job = ReadJob { id, first: in_memory, parent, hashes: hashes[in_memory..end].to_vec(), tokens, max_loaded, cancelled: cancelled.clone(), reply };
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
        // (a `NULL_BLOCK` entry: a block a window's gap made useless; its read is dropped, or was skipped)
        let block_bytes = kv.block_bytes();
        for (i, &b) in blocks.iter().enumerate().filter(|(_, &b)| b != crate::kv::NULL_BLOCK) {
            let data = p.restored[skip + i].as_deref().expect("the scheduler restores only blocks that were read");
            kv.write_block(b, &data[..block_bytes]);
            // (the state after the block, which the admission gave a snapshot slot)
            if data.len() > block_bytes {
                kv.conv_states.write_snapshot(b, &data[block_bytes..]);
            }
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

    /// The engine failed: nothing more is written to the directory (`DiskTier::abandon`), not even at
    /// shutdown; pending reads are cancelled.
    pub fn abandon(&mut self) {
        for (_, p) in self.pending.drain() {
            p.cancelled.store(true, Ordering::Relaxed);
        }
        if let Some(disk) = self.disk.take() {
            disk.abandon();
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

/// A block's file: its keys and values, then the state snapshot it kept, if any.
fn block_file(kv: &KvStorage, e: EvictedBlock) -> BlockFile {
    let mut data = kv.read_block(e.block);
    if let Some(s) = e.state {
        data.extend_from_slice(&kv.conv_states.snapshot_bytes(s));
    }
    BlockFile { hash: e.hash, parent_hash: e.parent_hash, data, tokens: e.tokens }
}

/// How many blocks from `first` one read restores: the longest run whose blocks attended to from its
/// end are all on disk (`present[k]` for block `first + k`), at most `max_loaded` of them. Under a
/// window the blocks of the run's gap (`skipped`) need not be on disk and are not loaded; the blocks
/// before `first` that its end attends to are in memory (the hit the read continues holds them).
fn read_len(first: usize, present: &[bool], window: Option<KvWindow>, bs: usize, max_loaded: usize) -> usize {
    // missing[i]: blocks absent among the first i
    let mut missing = vec![0; present.len() + 1];
    for (i, &p) in present.iter().enumerate() {
        missing[i + 1] = missing[i] + usize::from(!p);
    }
    (1..=present.len())
        .rev()
        .find(|&n| {
            let gap = skipped(window, bs, first, n);
            n - gap.len() <= max_loaded && missing[n] == missing[gap.end] - missing[gap.start]
        })
        .unwrap_or(0)
}

/// The blocks of a read of `first..first + n` that no query at its end attends to (a window's gap), as
/// indices `k` of block `first + k`; empty without a window.
fn skipped(window: Option<KvWindow>, bs: usize, first: usize, n: usize) -> Range<usize> {
    let Some(w) = window else { return 0..0 };
    let dead = w.dead_blocks((first + n) * bs, bs);
    let clamp = |b: usize| b.clamp(first, first + n) - first;
    clamp(dead.start)..clamp(dead.end)
}

/// The reader thread: loads each job's blocks (those `read_len` takes) while they verify, then replies.
/// A block that fails to load counts as absent and the run is chosen again (what was loaded for a
/// longer run and is not needed by the shorter one is dropped). Every job gets its reply (no blocks if
/// cancelled or if loading panicked), so a waiting request is always released.
fn read_blocks(disk: &DiskTier, jobs: std::sync::mpsc::Receiver<ReadJob>, block_size: usize, window: Option<KvWindow>) {
    for job in jobs {
        let load = || {
            let mut present: Vec<bool> = job.hashes.iter().map(|&h| disk.contains(h)).collect();
            let mut blocks: Vec<Option<Vec<u8>>> = vec![None; job.hashes.len()];
            let n = 'runs: loop {
                let n = read_len(job.first, &present, window, block_size, job.max_loaded);
                let gap = skipped(window, block_size, job.first, n);
                for (k, b) in blocks.iter_mut().enumerate() {
                    if k >= n || gap.contains(&k) {
                        *b = None;
                    }
                }
                for k in (0..n).filter(|k| !gap.contains(k)) {
                    if job.cancelled.load(Ordering::Relaxed) {
                        return Vec::new();
                    }
                    if blocks[k].is_some() {
                        continue;
                    }
                    let parent = if k == 0 { job.parent } else { job.hashes[k - 1] };
                    match disk.load(job.hashes[k], parent, &job.tokens[k * block_size..(k + 1) * block_size]) {
                        Some(data) => blocks[k] = Some(data),
                        None => {
                            present[k] = false;
                            continue 'runs;
                        }
                    }
                }
                break n;
            };
            blocks.truncate(n);
            let read: Vec<BlockHash> = (0..n).filter(|&k| blocks[k].is_some()).map(|k| job.hashes[k]).collect();
            disk.touch_chain(&read);
            blocks
        };
        let blocks = std::panic::catch_unwind(std::panic::AssertUnwindSafe(load)).unwrap_or_default();
        (job.reply)(RestoredBlocks { id: job.id, first: job.first, blocks });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_takes_the_longest_run_on_disk_and_under_a_window_skips_its_gap() {
        // without a window: the leading blocks on disk, at most `max_loaded`
        assert_eq!(read_len(0, &[true, true, false, true], None, 4, 8), 2);
        assert_eq!(read_len(3, &[true, true, true], None, 4, 2), 2);
        assert_eq!(read_len(0, &[false, true], None, 4, 8), 0);
        // blocks of 4, window 8, sinks 4 (block 0): a read of blocks 0..8 ends at 32, whose query
        // attends to block 0 and blocks 6 and 7; blocks 1..6 need not be on disk
        let w = Some(KvWindow { window: 8, sinks: 4 });
        let gap = [true, false, false, false, false, false, true, true];
        assert_eq!(read_len(0, &gap, w, 4, 8), 8);
        assert_eq!(skipped(w, 4, 0, 8), 1..6);
        assert_eq!(skipped(None, 4, 0, 8), 0..0);
        // block 7 missing: a run ending at 28 attends to block 5 (not on disk), and so on down to one block
        assert_eq!(read_len(0, &gap[..7], w, 4, 8), 1);
        // three blocks loaded at most: the run of 8 loads exactly 3
        assert_eq!(read_len(0, &gap, w, 4, 3), 8);
        assert_eq!(read_len(0, &gap, w, 4, 2), 1);
        // a read after a memory hit of 4 blocks: blocks 4..10, gap of a run ending at 40 is 1..8
        assert_eq!(read_len(4, &[false, false, false, false, true, true], w, 4, 8), 6);
        assert_eq!(skipped(w, 4, 4, 6), 0..4);
    }
}

//! The prefix cache's disk tier: KV blocks evicted from memory (and every cached block at shutdown) are
//! written to a directory in the background, one file per block, up to a size bound (least recently used
//! files deleted first); a prompt whose next blocks are on disk reads them back instead of computing
//! them. A restarted server with the same model and KV format reuses them.
//!
//! A file names the model (a fingerprint of the GGUF file), the KV format, the block's chain key and
//! its parent's, and the block's token ids; a file of another model or format, a truncated one, or one
//! whose checksum fails is ignored with a warning, never served.
//!
//! File layout (little-endian): magic `RKNKV002`, fingerprint u128, num_layers u32, kv_dim u32,
//! block_size u32, dtype u32 (`KvDtypes::code`, 0 = f16), numerics version u32, hash u128, parent_hash u128,
//! tokens [u32; block_size], data_len u64, checksum u64, then the data (`KvStorage::read_block`; for a
//! hybrid recurrent model's block that kept one, followed by its state snapshot, `ConvStates`).
//!
//! The size bound counts this model's and format's block files; files of other models sharing the
//! directory are left alone.

use super::BlockHash;
use std::collections::{BTreeMap, HashMap};
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

const MAGIC: &[u8; 8] = b"RKNKV002";
const EXTENSION: &str = "kvb";
/// Blocks queued for writing at most; more are dropped (the engine never waits on the disk).
const QUEUE_LEN: usize = 64;
/// Bump when a change to the kernels, RoPE or KV layout changes the keys and values computed for the same
/// tokens: files from before are then another format, never served. (2: the packed numerics store keys
/// by dimension and score each cell with one FMA chain.)
pub const KV_NUMERICS_VERSION: u32 = 2;

/// The numerics version of KV computed by a model loaded with `numerics`: the two arithmetics give
/// different keys and values for the same tokens, so their files must never serve each other.
pub fn kv_numerics_version(numerics: crate::model::Numerics) -> u32 {
    16 * KV_NUMERICS_VERSION
        + match numerics {
            crate::model::Numerics::Ggml => 0,
            crate::model::Numerics::Packed => 1,
        }
}

#[derive(Clone, Debug)]
pub struct DiskTierConfig {
    pub dir: PathBuf,
    /// Bytes of block files kept at most.
    pub max_bytes: u64,
}

/// What a block file must match to be used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvFormat {
    /// The model file's fingerprint (`Model::fingerprint`).
    pub model: u128,
    pub num_layers: u32,
    pub kv_dim: u32,
    pub block_size: u32,
    /// `KvDtypes::code` (0 = f16 keys and values).
    pub dtype: u32,
    /// `kv_numerics_version` of the build and numerics that wrote the file.
    pub version: u32,
    /// Bytes of a hybrid recurrent model's state snapshot, which a block's data may carry after its
    /// keys and values (0: none). Not in the header: the model's fingerprint implies it.
    pub state_len: u64,
}

/// Bytes of the header before the token ids.
const FIXED_HEADER: usize = 8 + 16 + 20 + 32;

impl KvFormat {
    fn header_len(&self) -> usize {
        FIXED_HEADER + 4 * self.block_size as usize + 16
    }

    /// Bytes of one block's keys and values (`KvStorage::block_bytes`).
    fn data_len(&self) -> u64 {
        let dtypes = super::KvDtypes::from_code(self.dtype).unwrap_or(super::KvDtypes::F16);
        self.block_size as u64 * dtypes.bytes_per_token(self.num_layers as usize, self.kv_dim as usize) as u64
    }

    /// Whether a file's data of `n` bytes fits: the keys and values, or those and a state snapshot.
    fn data_len_ok(&self, n: u64) -> bool {
        n == self.data_len() || (self.state_len > 0 && n == self.data_len() + self.state_len)
    }

    /// A header's format is this one (the state length, not in headers, aside).
    fn matches(&self, header: &KvFormat) -> bool {
        *self == KvFormat { state_len: self.state_len, ..*header }
    }
}

/// One block to write.
pub struct BlockFile {
    pub hash: BlockHash,
    pub parent_hash: BlockHash,
    pub tokens: Box<[u32]>,
    pub data: Vec<u8>,
}

#[derive(Debug, Default)]
struct Index {
    /// Key -> (bytes, last use tick).
    files: HashMap<BlockHash, (u64, u64)>,
    /// Last use tick -> key, oldest first.
    by_use: BTreeMap<u64, BlockHash>,
    total_bytes: u64,
    clock: u64,
}

impl Index {
    fn touch(&mut self, hash: BlockHash) {
        if let Some(f) = self.files.get_mut(&hash) {
            self.clock += 1;
            self.by_use.remove(&f.1);
            f.1 = self.clock;
            self.by_use.insert(self.clock, hash);
        }
    }

    fn insert(&mut self, hash: BlockHash, bytes: u64) {
        self.remove(hash);
        self.clock += 1;
        self.files.insert(hash, (bytes, self.clock));
        self.by_use.insert(self.clock, hash);
        self.total_bytes += bytes;
    }

    fn remove(&mut self, hash: BlockHash) {
        if let Some((bytes, tick)) = self.files.remove(&hash) {
            self.total_bytes -= bytes;
            self.by_use.remove(&tick);
        }
    }

    /// Deletes least recently used files until the total fits `max_bytes`.
    /// (returns the keys of the deleted files)
    fn trim(&mut self, dir: &Path, max_bytes: u64) -> Vec<BlockHash> {
        let mut gone = Vec::new();
        while self.total_bytes > max_bytes {
            let Some((_, &old)) = self.by_use.iter().next() else { break };
            self.remove(old);
            let _ = fs::remove_file(file_name(dir, old));
            gone.push(old);
        }
        gone
    }
}

/// Where the disk tier's events go (`DiskTier::send_events_to`), and the root key (a first block's
/// parent, announced as none).
type EventTarget = Arc<Mutex<Option<(super::KvEventSink, BlockHash)>>>;

pub struct DiskTier {
    events: EventTarget,
    dir: PathBuf,
    format: KvFormat,
    index: Arc<Mutex<Index>>,
    /// Blocks sent to the writer and not yet written.
    queued: Arc<AtomicUsize>,
    writer: Option<(SyncSender<BlockFile>, JoinHandle<()>)>,
    /// Set when the engine failed (`abandon`): the writer drops what is queued, writes nothing more.
    abandoned: Arc<std::sync::atomic::AtomicBool>,
}

fn file_name(dir: &Path, hash: BlockHash) -> PathBuf {
    dir.join(format!("{hash:032x}.{EXTENSION}"))
}

/// A fast 64-bit checksum of the data (catches torn and flipped files; the directory is trusted): four
/// independent multiply-rotate lanes over 32-byte strides, so the multiplies overlap.
fn checksum(data: &[u8]) -> u64 {
    const K: u64 = 0x0100_0000_01b3;
    let mut lanes: [u64; 4] = [0x9e37_79b9_7f4a_7c15 ^ data.len() as u64, 1, 2, 3];
    let mut strides = data.chunks_exact(32);
    for s in &mut strides {
        for (i, lane) in lanes.iter_mut().enumerate() {
            let w = u64::from_le_bytes(s[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
            *lane = (*lane ^ w).wrapping_mul(K).rotate_left(29);
        }
    }
    let mut h = lanes.iter().fold(0u64, |h, &l| (h ^ l).wrapping_mul(K).rotate_left(29));
    for &b in strides.remainder() {
        h = (h ^ b as u64).wrapping_mul(K);
    }
    h
}

/// A parsed file header.
struct Header {
    format: KvFormat,
    hash: BlockHash,
    parent_hash: BlockHash,
    tokens: Vec<u32>,
    data_len: u64,
    checksum: u64,
}

fn read_header(r: &mut impl Read) -> io::Result<Option<Header>> {
    let mut fixed = [0u8; FIXED_HEADER];
    r.read_exact(&mut fixed)?;
    if &fixed[..8] != MAGIC {
        return Ok(None);
    }
    let u32_at = |o: usize| u32::from_le_bytes(fixed[o..o + 4].try_into().expect("4 bytes"));
    let u128_at = |o: usize| u128::from_le_bytes(fixed[o..o + 16].try_into().expect("16 bytes"));
    let format = KvFormat { model: u128_at(8), num_layers: u32_at(24), kv_dim: u32_at(28), block_size: u32_at(32), dtype: u32_at(36), version: u32_at(40), state_len: 0 };
    if format.block_size == 0 || format.block_size > 1 << 16 {
        return Ok(None);
    }
    let mut rest = vec![0u8; 4 * format.block_size as usize + 16];
    r.read_exact(&mut rest)?;
    let n = 4 * format.block_size as usize;
    let tokens = rest[..n].chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
    let data_len = u64::from_le_bytes(rest[n..n + 8].try_into().expect("8 bytes"));
    let checksum = u64::from_le_bytes(rest[n + 8..n + 16].try_into().expect("8 bytes"));
    Ok(Some(Header { format, hash: u128_at(44), parent_hash: u128_at(60), tokens, data_len, checksum }))
}

fn write_file(dir: &Path, format: &KvFormat, block: &BlockFile) -> io::Result<u64> {
    let mut buf = Vec::with_capacity(format.header_len() + block.data.len());
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&format.model.to_le_bytes());
    for x in [format.num_layers, format.kv_dim, format.block_size, format.dtype, format.version] {
        buf.extend_from_slice(&x.to_le_bytes());
    }
    buf.extend_from_slice(&block.hash.to_le_bytes());
    buf.extend_from_slice(&block.parent_hash.to_le_bytes());
    for t in block.tokens.iter() {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    buf.extend_from_slice(&(block.data.len() as u64).to_le_bytes());
    buf.extend_from_slice(&checksum(&block.data).to_le_bytes());
    buf.extend_from_slice(&block.data);
    // write then rename: a reader never sees a half-written file under the real name
    let path = file_name(dir, block.hash);
    let tmp = path.with_extension("tmp");
    fs::File::create(&tmp)?.write_all(&buf)?;
    fs::rename(&tmp, &path)?;
    Ok(buf.len() as u64)
}

impl DiskTier {
    /// Opens (creating) the directory, indexes the usable block files already there and starts the
    /// writer thread.
    pub fn open(config: &DiskTierConfig, format: KvFormat) -> io::Result<DiskTier> {
        fs::create_dir_all(&config.dir)?;
        let mut index = scan(&config.dir, &format)?;
        index.trim(&config.dir, config.max_bytes);
        let index = Arc::new(Mutex::new(index));
        let queued = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = sync_channel::<BlockFile>(QUEUE_LEN);
        let (dir, idx, max_bytes, pending) = (config.dir.clone(), index.clone(), config.max_bytes, queued.clone());
        let events: EventTarget = Default::default();
        let target = events.clone();
        let abandoned = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop = abandoned.clone();
        let writer = std::thread::Builder::new().name("reckon-kv-disk".into()).spawn(move || {
            for block in rx {
                let known = idx.lock().unwrap_or_else(|e| e.into_inner()).files.contains_key(&block.hash);
                if !known && !stop.load(Ordering::Relaxed) {
                    match write_file(&dir, &format, &block) {
                        Ok(bytes) => {
                            let mut index = idx.lock().unwrap_or_else(|e| e.into_inner());
                            index.insert(block.hash, bytes);
                            let gone = index.trim(&dir, max_bytes);
                            drop(index);
                            if let Some((sink, root)) = target.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                                use super::{KvEvent, Medium};
                                let parent = (block.parent_hash != *root).then_some(block.parent_hash);
                                let mut events = vec![KvEvent::BlockStored { hash: block.hash, parent, tokens: block.tokens.clone(), medium: Medium::Disk }];
                                events.extend(gone.into_iter().map(|hash| KvEvent::BlockRemoved { hash, medium: Medium::Disk }));
                                sink(events);
                            }
                        }
                        Err(e) => tracing::warn!("prefix cache dir {}: cannot write a block: {e}", dir.display()),
                    }
                }
                pending.fetch_sub(1, Ordering::Relaxed);
            }
        })?;
        Ok(DiskTier { events, dir: config.dir.clone(), format, index, queued, writer: Some((tx, writer)), abandoned })
    }

    /// Sends which keys the directory gains and loses from now on to `sink` (`kv::events`); a block
    /// whose parent key is `root` is announced as a sequence's first. Files already there are not
    /// announced.
    pub fn send_events_to(&self, sink: super::KvEventSink, root: BlockHash) {
        *self.events.lock().unwrap_or_else(|e| e.into_inner()) = Some((sink, root));
    }

    fn index(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn format(&self) -> &KvFormat {
        &self.format
    }

    pub fn contains(&self, hash: BlockHash) -> bool {
        self.index().files.contains_key(&hash)
    }

    /// Marks blocks as just used, the last one first: a chain's first block (which every read-back
    /// starts from) ends up the most recently used, so the size bound trims chains from their tails.
    /// (Under a KV window a read-back marks only the blocks it loaded, so its gap's files go first.)
    pub fn touch_chain(&self, hashes: &[BlockHash]) {
        let mut index = self.index();
        for &h in hashes.iter().rev() {
            index.touch(h);
        }
    }

    /// Whether `store` would queue a block now (check before copying one out).
    pub fn has_room(&self) -> bool {
        self.queued.load(Ordering::Relaxed) < QUEUE_LEN
    }

    /// Block files indexed.
    pub fn num_files(&self) -> usize {
        self.index().files.len()
    }

    /// Queues a block for writing; dropped if the writer is behind (`wait` blocks instead, at shutdown).
    pub fn store(&self, block: BlockFile, wait: bool) {
        let Some((tx, _)) = &self.writer else { return };
        if self.abandoned.load(Ordering::Relaxed) {
            return;
        }
        self.queued.fetch_add(1, Ordering::Relaxed);
        let sent = if wait { tx.send(block).is_ok() } else { !matches!(tx.try_send(block), Err(TrySendError::Full(_) | TrySendError::Disconnected(_))) };
        if !sent {
            self.queued.fetch_sub(1, Ordering::Relaxed);
            tracing::debug!("prefix cache dir: writer behind, a block was not saved");
        }
    }

    /// The data of the block with this key, parent key and tokens, if its file is there and sound.
    pub fn load(&self, hash: BlockHash, parent_hash: BlockHash, tokens: &[u32]) -> Option<Vec<u8>> {
        if !self.contains(hash) {
            return None;
        }
        let path = file_name(&self.dir, hash);
        match self.read_verified(&path, hash, parent_hash, tokens) {
            Ok(found) => found,
            // deleted meanwhile by the size bound (which also dropped it from the index): a plain miss
            Err(None) => None,
            Err(Some(reason)) => {
                tracing::warn!("prefix cache dir: ignoring {}: {reason}", path.display());
                self.index().remove(hash);
                let _ = fs::remove_file(&path);
                if let Some((sink, _)) = self.events.lock().unwrap_or_else(|e| e.into_inner()).as_ref() {
                    sink(vec![super::KvEvent::BlockRemoved { hash, medium: super::Medium::Disk }]);
                }
                None
            }
        }
    }

    /// `Ok(None)`: a sound file for other tokens (a key collision); `Err(Some(why))`: a file not to use
    /// again; `Err(None)`: no file.
    fn read_verified(&self, path: &Path, hash: BlockHash, parent_hash: BlockHash, tokens: &[u32]) -> Result<Option<Vec<u8>>, Option<String>> {
        let bad = |why: String| Err(Some(why));
        let mut f = match fs::File::open(path) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(None),
            Err(e) => return bad(e.to_string()),
        };
        let h = match read_header(&mut f) {
            Ok(Some(h)) => h,
            Ok(None) => return bad("not a reckon KV block file".into()),
            Err(e) => return bad(format!("unreadable header ({e})")),
        };
        if !self.format.matches(&h.format) {
            return bad("another model or KV format".into());
        }
        if h.hash != hash {
            return bad("its key does not match its name".into());
        }
        if !self.format.data_len_ok(h.data_len) {
            return bad(format!("the header gives {} data bytes, the format {}", h.data_len, self.format.data_len()));
        }
        if h.parent_hash != parent_hash || h.tokens != tokens {
            return Ok(None);
        }
        let mut data = Vec::with_capacity(h.data_len as usize);
        if let Err(e) = f.take(h.data_len + 1).read_to_end(&mut data) {
            return bad(e.to_string());
        }
        if data.len() as u64 != h.data_len {
            return bad(format!("{} data bytes, the header says {}", data.len(), h.data_len));
        }
        if checksum(&data) != h.checksum {
            return bad("checksum mismatch".into());
        }
        Ok(Some(data))
    }

    /// The engine failed: what it computed may be wrong, so nothing more is written (what is queued is
    /// dropped; a write under way finishes, as files are written then renamed). Reads go on.
    pub fn abandon(&self) {
        self.abandoned.store(true, Ordering::Relaxed);
    }

    /// Waits for every queued write.
    pub fn close(mut self) {
        if let Some((tx, writer)) = self.writer.take() {
            drop(tx);
            let _ = writer.join();
        }
    }
}

/// Indexes the directory's block files of this format, least recently modified first; warns about the
/// others and deletes leftovers of interrupted writes.
fn scan(dir: &Path, format: &KvFormat) -> io::Result<Index> {
    let mut found: Vec<(std::time::SystemTime, BlockHash, u64)> = Vec::new();
    let (mut other_format, mut unreadable) = (0, 0);
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        match path.extension().and_then(|e| e.to_str()) {
            Some(EXTENSION) => {}
            Some("tmp") => {
                let _ = fs::remove_file(&path);
                continue;
            }
            _ => continue,
        }
        let header = fs::File::open(&path).and_then(|mut f| read_header(&mut f));
        let meta = fs::metadata(&path);
        match (header, meta) {
            (Ok(Some(h)), Ok(m)) if format.matches(&h.format) && format.data_len_ok(h.data_len) && m.len() == format.header_len() as u64 + h.data_len && path == file_name(dir, h.hash) => {
                found.push((m.modified().unwrap_or(std::time::UNIX_EPOCH), h.hash, m.len()));
            }
            (Ok(Some(h)), Ok(_)) if !format.matches(&h.format) => other_format += 1,
            _ => unreadable += 1,
        }
    }
    if other_format > 0 {
        tracing::warn!("prefix cache dir {}: ignoring {other_format} block files of another model or KV format", dir.display());
    }
    if unreadable > 0 {
        tracing::warn!("prefix cache dir {}: ignoring {unreadable} unreadable or truncated block files", dir.display());
    }
    found.sort();
    let mut index = Index::default();
    for (_, hash, bytes) in found {
        index.insert(hash, bytes);
    }
    Ok(index)
}

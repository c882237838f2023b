//! The prefix cache's disk tier: KV blocks evicted from memory (and every cached block at shutdown) are
//! written to a directory in the background, one file per block, up to a size bound (least recently used
//! files deleted first); a prompt whose next blocks are on disk reads them back instead of computing
//! them. A restarted server with the same model and KV format reuses them.
//!
//! A file names the model (a fingerprint of the GGUF file), the KV format, the block's chain key and
//! its parent's, and the block's token ids; a file of another model or format, a truncated one, or one
//! whose checksum fails is ignored with a warning, never served.
//!
//! File layout (little-endian): magic `RKNKV001`, fingerprint u128, num_layers u32, kv_dim u32,
//! block_size u32, dtype u32 (0 = f16), hash u128, parent_hash u128, tokens [u32; block_size],
//! data_len u64, checksum u64, then the data (`KvStorage::read_block`).

use crate::scheduler::BlockHash;
use std::collections::HashMap;
use std::fs;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

const MAGIC: &[u8; 8] = b"RKNKV001";
const EXTENSION: &str = "kvb";
/// Blocks queued for writing at most; more are dropped (the engine never waits on the disk).
const QUEUE_LEN: usize = 256;

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
    /// 0 = f16.
    pub dtype: u32,
}

impl KvFormat {
    fn header_len(&self) -> usize {
        8 + 16 + 16 + 32 + 4 * self.block_size as usize + 16
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
    total_bytes: u64,
    clock: u64,
}

impl Index {
    fn touch(&mut self, hash: BlockHash) {
        self.clock += 1;
        let clock = self.clock;
        if let Some(f) = self.files.get_mut(&hash) {
            f.1 = clock;
        }
    }

    fn insert(&mut self, hash: BlockHash, bytes: u64) {
        self.clock += 1;
        if let Some((old, _)) = self.files.insert(hash, (bytes, self.clock)) {
            self.total_bytes -= old;
        }
        self.total_bytes += bytes;
    }

    fn remove(&mut self, hash: BlockHash) {
        if let Some((bytes, _)) = self.files.remove(&hash) {
            self.total_bytes -= bytes;
        }
    }

    fn least_recently_used(&self) -> Option<BlockHash> {
        self.files.iter().min_by_key(|(_, f)| f.1).map(|(h, _)| *h)
    }
}

pub struct DiskTier {
    dir: PathBuf,
    format: KvFormat,
    index: Arc<Mutex<Index>>,
    writer: Option<(SyncSender<BlockFile>, JoinHandle<()>)>,
}

fn file_name(dir: &Path, hash: BlockHash) -> PathBuf {
    dir.join(format!("{hash:032x}.{EXTENSION}"))
}

/// A fast 64-bit checksum of the data (catches torn and flipped files; the directory is trusted).
fn checksum(data: &[u8]) -> u64 {
    let mut h: u64 = 0x9e37_79b9_7f4a_7c15 ^ data.len() as u64;
    let mut words = data.chunks_exact(8);
    for w in &mut words {
        h = (h ^ u64::from_le_bytes(w.try_into().expect("8 bytes"))).wrapping_mul(0x0100_0000_01b3).rotate_left(29);
    }
    for &b in words.remainder() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
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
    let mut fixed = [0u8; 8 + 16 + 16 + 32];
    r.read_exact(&mut fixed)?;
    if &fixed[..8] != MAGIC {
        return Ok(None);
    }
    let u32_at = |o: usize| u32::from_le_bytes(fixed[o..o + 4].try_into().expect("4 bytes"));
    let u128_at = |o: usize| u128::from_le_bytes(fixed[o..o + 16].try_into().expect("16 bytes"));
    let format = KvFormat { model: u128_at(8), num_layers: u32_at(24), kv_dim: u32_at(28), block_size: u32_at(32), dtype: u32_at(36) };
    if format.block_size == 0 || format.block_size > 1 << 16 {
        return Ok(None);
    }
    let mut rest = vec![0u8; 4 * format.block_size as usize + 16];
    r.read_exact(&mut rest)?;
    let n = 4 * format.block_size as usize;
    let tokens = rest[..n].chunks_exact(4).map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes"))).collect();
    let data_len = u64::from_le_bytes(rest[n..n + 8].try_into().expect("8 bytes"));
    let checksum = u64::from_le_bytes(rest[n + 8..n + 16].try_into().expect("8 bytes"));
    Ok(Some(Header { format, hash: u128_at(40), parent_hash: u128_at(56), tokens, data_len, checksum }))
}

fn write_file(dir: &Path, format: &KvFormat, block: &BlockFile) -> io::Result<u64> {
    let mut buf = Vec::with_capacity(format.header_len() + block.data.len());
    buf.extend_from_slice(MAGIC);
    buf.extend_from_slice(&format.model.to_le_bytes());
    for x in [format.num_layers, format.kv_dim, format.block_size, format.dtype] {
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
        let index = Arc::new(Mutex::new(scan(&config.dir, &format)?));
        let (tx, rx) = sync_channel::<BlockFile>(QUEUE_LEN);
        let (dir, idx, max_bytes) = (config.dir.clone(), index.clone(), config.max_bytes);
        let writer = std::thread::Builder::new().name("reckon-kv-disk".into()).spawn(move || {
            for block in rx {
                if idx.lock().unwrap_or_else(|e| e.into_inner()).files.contains_key(&block.hash) {
                    continue;
                }
                match write_file(&dir, &format, &block) {
                    Ok(bytes) => {
                        let mut index = idx.lock().unwrap_or_else(|e| e.into_inner());
                        index.insert(block.hash, bytes);
                        while index.total_bytes > max_bytes {
                            let Some(old) = index.least_recently_used() else { break };
                            index.remove(old);
                            let _ = fs::remove_file(file_name(&dir, old));
                        }
                    }
                    Err(e) => tracing::warn!("prefix cache dir {}: cannot write a block: {e}", dir.display()),
                }
            }
        })?;
        Ok(DiskTier { dir: config.dir.clone(), format, index, writer: Some((tx, writer)) })
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

    /// Block files indexed, and their bytes.
    pub fn usage(&self) -> (usize, u64) {
        let i = self.index();
        (i.files.len(), i.total_bytes)
    }

    /// Queues a block for writing; dropped if the writer is behind (`wait` blocks instead, at shutdown).
    pub fn store(&self, block: BlockFile, wait: bool) {
        let Some((tx, _)) = &self.writer else { return };
        if wait {
            let _ = tx.send(block);
        } else if let Err(TrySendError::Full(_)) = tx.try_send(block) {
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
            Ok(Some(data)) => {
                self.index().touch(hash);
                Some(data)
            }
            Ok(None) => None,
            Err(reason) => {
                tracing::warn!("prefix cache dir: ignoring {}: {reason}", path.display());
                self.index().remove(hash);
                let _ = fs::remove_file(&path);
                None
            }
        }
    }

    /// `Ok(None)`: a sound file for other tokens (a key collision); `Err`: a file not to use again.
    fn read_verified(&self, path: &Path, hash: BlockHash, parent_hash: BlockHash, tokens: &[u32]) -> Result<Option<Vec<u8>>, String> {
        let mut f = fs::File::open(path).map_err(|e| e.to_string())?;
        let h = read_header(&mut f).map_err(|e| format!("unreadable header ({e})"))?.ok_or("not a reckon KV block file")?;
        if h.format != self.format {
            return Err("another model or KV format".into());
        }
        if h.hash != hash {
            return Err("its key does not match its name".into());
        }
        if h.parent_hash != parent_hash || h.tokens != tokens {
            return Ok(None);
        }
        let mut data = Vec::with_capacity(h.data_len as usize);
        f.take(h.data_len + 1).read_to_end(&mut data).map_err(|e| e.to_string())?;
        if data.len() as u64 != h.data_len {
            return Err(format!("{} data bytes, the header says {}", data.len(), h.data_len));
        }
        if checksum(&data) != h.checksum {
            return Err("checksum mismatch".into());
        }
        Ok(Some(data))
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
/// others.
fn scan(dir: &Path, format: &KvFormat) -> io::Result<Index> {
    let mut found: Vec<(std::time::SystemTime, BlockHash, u64)> = Vec::new();
    let (mut other_format, mut unreadable) = (0, 0);
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().and_then(|e| e.to_str()) != Some(EXTENSION) {
            continue;
        }
        let header = fs::File::open(&path).and_then(|mut f| read_header(&mut f));
        let meta = fs::metadata(&path);
        match (header, meta) {
            (Ok(Some(h)), Ok(m)) if h.format == *format && m.len() == format.header_len() as u64 + h.data_len && path == file_name(dir, h.hash) => {
                found.push((m.modified().unwrap_or(std::time::UNIX_EPOCH), h.hash, m.len()));
            }
            (Ok(Some(h)), Ok(_)) if h.format != *format => other_format += 1,
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

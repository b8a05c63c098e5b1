//! The local chunk store, which is also the bounded cache of fetched ones.
//!
//! Every chunk of every image on this host is one file under
//! `images/chunks/sha256/`. Two kinds share the directory:
//! - **pinned** chunks belong to an image converted here and pushed
//!   nowhere: they exist nowhere else, so they are never evicted and do not
//!   count against the bound;
//! - **cached** chunks can be fetched again from a registry: their total
//!   stays under `image_cache_max_bytes`, the least recently used going
//!   first.
//!
//! Reads go through a small in-memory set of decompressed chunks; a read
//! holds its chunk's bytes, so evicting the file never fails a read.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::{chunk_dir, chunk_hex, decompress, sha256, write_cached, ChunkRef, Index};
use crate::{ImageError, Result};

/// Decompressed chunks kept in memory (each [`super::CHUNK_SIZE`]).
const MEMORY_CHUNKS: usize = 32;

/// Where the chunks a disk lacks come from.
#[async_trait::async_trait]
pub trait Fetch: Send + Sync {
    /// The compressed bytes of `chunk` (checked by the caller).
    async fn fetch(&self, chunk: &ChunkRef) -> Result<Vec<u8>>;
}

/// One image's disk as the cache serves it.
pub struct Disk {
    /// What errors name: the image's reference.
    pub image: String,
    pub index: Index,
    /// None: every chunk must be local (an image converted here).
    pub remote: Option<Arc<dyn Fetch>>,
    /// Chunks in the order they were first read (what a boot reads).
    reads: Mutex<(Vec<usize>, HashSet<usize>)>,
}

/// Most chunks a read order keeps (a boot reads a few hundred).
const MAX_ORDER: usize = 4096;

impl Disk {
    pub fn new(image: String, index: Index, remote: Option<Arc<dyn Fetch>>) -> Self {
        Self {
            image,
            index,
            remote,
            reads: Mutex::new((Vec::new(), HashSet::new())),
        }
    }

    fn note_read(&self, i: usize) {
        let mut r = self.reads.lock().unwrap_or_else(|p| p.into_inner());
        if r.0.len() < MAX_ORDER && r.1.insert(i) {
            r.0.push(i);
        }
    }

    /// The chunks read so far, in first-read order.
    pub fn read_order(&self) -> Vec<usize> {
        self.reads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .0
            .clone()
    }
}

/// What `GET /metrics` and `tine image list` show of the cache.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheStats {
    pub max_bytes: u64,
    /// Compressed bytes of evictable chunks on disk.
    pub cached_bytes: u64,
    /// Compressed bytes of chunks that exist only here.
    pub pinned_bytes: u64,
    /// Chunk reads served locally (memory or disk).
    pub hits: u64,
    /// Chunk reads that had to fetch.
    pub misses: u64,
    pub fetched_bytes: u64,
    pub evictions: u64,
    pub errors: u64,
    pub last_error: Option<String>,
}

struct OnDisk {
    size: u64,
    used: u64,
}

#[derive(Default)]
struct State {
    disk: HashMap<String, OnDisk>,
    pinned: HashSet<String>,
    /// Which image directories (and meta mtimes) `pinned` was made from.
    pins_from: Vec<(String, Option<std::time::SystemTime>)>,
    memory: HashMap<String, (Arc<Vec<u8>>, u64)>,
    inflight: HashMap<String, Arc<tokio::sync::Mutex<()>>>,
    stats: CacheStats,
}

pub struct ChunkCache {
    images: PathBuf,
    dir: PathBuf,
    state: Mutex<State>,
    tick: AtomicU64,
}

impl ChunkCache {
    /// The cache of the image store at `images`, bounded to `max_bytes`
    /// of evictable chunks; what is on disk is counted now.
    pub fn open(images: &Path, max_bytes: u64) -> Self {
        let dir = chunk_dir(images);
        let _ = std::fs::create_dir_all(&dir);
        let mut state = State::default();
        let mut found: Vec<(String, u64, std::time::SystemTime)> = Vec::new();
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if chunk_hex(&format!("sha256:{name}")).is_err() {
                // A write that crashed half way.
                let _ = std::fs::remove_file(e.path());
                continue;
            }
            if let Ok(m) = e.metadata() {
                found.push((name, m.len(), m.modified().unwrap_or(std::time::UNIX_EPOCH)));
            }
        }
        // Oldest first: their ticks say which go first.
        found.sort_by_key(|f| f.2);
        let mut tick = 0;
        for (name, size, _) in found {
            tick += 1;
            state.disk.insert(name, OnDisk { size, used: tick });
        }
        state.stats.max_bytes = max_bytes;
        let cache = Self {
            images: images.to_path_buf(),
            dir,
            state: Mutex::new(state),
            tick: AtomicU64::new(tick + 1),
        };
        cache.refresh_pins();
        cache.evict(0);
        cache
    }

    /// Change the bound (evicting at once down to it).
    pub fn set_max_bytes(&self, max_bytes: u64) {
        self.lock().stats.max_bytes = max_bytes;
        self.evict(0);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn next_tick(&self) -> u64 {
        self.tick.fetch_add(1, Ordering::Relaxed)
    }

    pub fn stats(&self) -> CacheStats {
        let s = self.lock();
        let mut stats = s.stats.clone();
        stats.cached_bytes = 0;
        stats.pinned_bytes = 0;
        for (hex, e) in &s.disk {
            if s.pinned.contains(hex) {
                stats.pinned_bytes += e.size;
            } else {
                stats.cached_bytes += e.size;
            }
        }
        stats
    }

    /// Re-read which chunks belong to images that exist only here, when
    /// the set of images (or one's metadata) changed since the last time;
    /// chunk files another process wrote are counted too.
    pub fn refresh_pins(&self) {
        let mut from: Vec<(String, Option<std::time::SystemTime>)> =
            std::fs::read_dir(&self.images)
                .into_iter()
                .flatten()
                .flatten()
                .filter(|e| e.file_name().len() == 64)
                .map(|e| {
                    let m =
                        std::fs::metadata(e.path().join("meta.json")).and_then(|m| m.modified());
                    (e.file_name().to_string_lossy().into_owned(), m.ok())
                })
                .collect();
        from.sort();
        if self.lock().pins_from == from {
            return;
        }
        let mut pinned = HashSet::new();
        for (name, _) in &from {
            let dir = self.images.join(name);
            let local_only = std::fs::read(dir.join("meta.json"))
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
                .is_some_and(|m| m["chunks"].is_object() && m["chunks"]["remote"].is_null());
            if !local_only {
                continue;
            }
            if let Some(index) = std::fs::read(dir.join("index.json"))
                .ok()
                .and_then(|b| Index::from_json(&b).ok())
            {
                for c in index.chunks.iter().flatten() {
                    if let Ok(h) = chunk_hex(&c.digest) {
                        pinned.insert(h.to_string());
                    }
                }
            }
        }
        let mut found = Vec::new();
        for e in std::fs::read_dir(&self.dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.len() == 64 {
                if let Ok(m) = e.metadata() {
                    found.push((name, m.len()));
                }
            }
        }
        let mut s = self.lock();
        s.pinned = pinned;
        s.pins_from = from;
        for (name, size) in found {
            let used = self.tick.fetch_add(1, Ordering::Relaxed);
            s.disk.entry(name).or_insert(OnDisk { size, used });
        }
    }

    /// Evict least recently used cached chunks until `incoming` more bytes
    /// fit under the bound.
    fn evict(&self, incoming: u64) {
        let mut s = self.lock();
        let max = s.stats.max_bytes;
        let mut cached: u64 = s
            .disk
            .iter()
            .filter(|(h, _)| !s.pinned.contains(*h))
            .map(|(_, e)| e.size)
            .sum();
        while cached + incoming > max {
            let victim = s
                .disk
                .iter()
                .filter(|(h, _)| !s.pinned.contains(*h))
                .min_by_key(|(_, e)| e.used)
                .map(|(h, e)| (h.clone(), e.size));
            let Some((hex, size)) = victim else { break };
            let _ = std::fs::remove_file(self.dir.join(&hex));
            s.disk.remove(&hex);
            s.stats.evictions += 1;
            cached -= size;
        }
    }

    fn record_error(&self, e: &ImageError) {
        let mut s = self.lock();
        s.stats.errors += 1;
        s.stats.last_error = Some(e.to_string());
        tracing::error!("{e}");
    }

    /// The decompressed bytes of chunk `i` of `disk` (shorter than a chunk
    /// at the disk's end; empty for a chunk of zeros).
    pub async fn read(&self, disk: &Disk, i: usize) -> Result<Arc<Vec<u8>>> {
        if matches!(disk.index.chunks.get(i), Some(Some(_))) {
            disk.note_read(i);
        }
        self.load(disk, i).await
    }

    async fn read_chunk(&self, disk: &Disk, i: usize, chunk: &ChunkRef) -> Result<Arc<Vec<u8>>> {
        let chunk_err = |detail: String| ImageError::Chunk {
            image: disk.image.clone(),
            index: i,
            digest: chunk.digest.clone(),
            detail,
        };
        let damaged = |detail: String| ImageError::Damaged {
            image: disk.image.clone(),
            index: i,
            digest: chunk.digest.clone(),
            detail,
        };
        let hex = chunk_hex(&chunk.digest)?.to_string();
        if let Some(data) = self.in_memory(&hex) {
            return Ok(data);
        }
        // One load per chunk at a time: the others wait, then find it.
        let gate = self.lock().inflight.entry(hex.clone()).or_default().clone();
        let _held = gate.lock().await;
        let result = async {
            if let Some(data) = self.in_memory(&hex) {
                return Ok(data);
            }
            let path = self.dir.join(&hex);
            let on_disk = self.lock().disk.contains_key(&hex) || path.exists();
            if on_disk {
                if let Some(data) = self.load_local(&path, chunk, disk.index.chunk_size).await {
                    let data = Arc::new(data);
                    self.remember(&hex, chunk.size, data.clone(), false);
                    return Ok(data);
                }
            }
            let Some(remote) = &disk.remote else {
                return Err(chunk_err(
                    "missing from the local store and the image was never pushed".into(),
                ));
            };
            let bytes = remote.fetch(chunk).await.map_err(|e| match e {
                // The registry's client checks the digest itself.
                ImageError::Digest { .. } => damaged(e.to_string()),
                e => chunk_err(e.to_string()),
            })?;
            if sha256(&bytes) != chunk.digest {
                return Err(damaged(format!(
                    "the {} bytes fetched do not match the digest (damaged in the registry?)",
                    bytes.len()
                )));
            }
            let size = bytes.len() as u64;
            let data = tokio::task::spawn_blocking({
                let cs = disk.index.chunk_size;
                move || decompress(&bytes, cs).map(|d| (d, bytes))
            })
            .await
            .map_err(|e| chunk_err(e.to_string()))?
            .map_err(|e| damaged(format!("does not decompress: {e}")))?;
            let (data, bytes) = data;
            {
                let mut s = self.lock();
                s.stats.misses += 1;
                s.stats.fetched_bytes += size;
            }
            self.refresh_pins();
            let (pinned, max) = {
                let s = self.lock();
                (s.pinned.contains(&hex), s.stats.max_bytes)
            };
            let keep = pinned || size <= max;
            if keep {
                if !pinned {
                    self.evict(size);
                }
                write_cached(&path, &bytes)?;
            }
            let data = Arc::new(data);
            self.remember(&hex, size, data.clone(), keep);
            Ok(data)
        }
        .await;
        self.lock().inflight.remove(&hex);
        result
    }

    /// Fetch the chunks of `order` that are not here yet, two at a time,
    /// until they would fill half the cache (a prefetch must not evict
    /// what it fetched before it is read). Errors are counted as reads'.
    pub async fn prefetch(self: Arc<Self>, disk: Arc<Disk>, order: Vec<usize>) {
        let budget = self.lock().stats.max_bytes / 2;
        let mut planned = 0u64;
        let mut todo = Vec::new();
        for i in order {
            let Some(Some(c)) = disk.index.chunks.get(i) else {
                continue;
            };
            let here = chunk_hex(&c.digest).is_ok_and(|h| self.lock().disk.contains_key(h));
            if here
                || disk
                    .reads
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .1
                    .contains(&i)
            {
                continue;
            }
            planned += c.size;
            if planned > budget {
                break;
            }
            todo.push(i);
        }
        let started = std::time::Instant::now();
        let n = todo.len();
        let slots = Arc::new(tokio::sync::Semaphore::new(2));
        let mut tasks = tokio::task::JoinSet::new();
        for i in todo {
            let (cache, disk) = (self.clone(), disk.clone());
            let permit = slots.clone().acquire_owned().await.expect("never closed");
            tasks.spawn(async move {
                let _permit = permit;
                let _ = cache.load(&disk, i).await;
            });
        }
        while tasks.join_next().await.is_some() {}
        tracing::info!(image = %disk.image, chunks = n, ms = started.elapsed().as_millis() as u64, "prefetched");
    }

    /// Like [`ChunkCache::read`], without recording a read.
    async fn load(&self, disk: &Disk, i: usize) -> Result<Arc<Vec<u8>>> {
        let Some(Some(chunk)) = disk.index.chunks.get(i) else {
            return Ok(Arc::new(Vec::new()));
        };
        let result = self.read_chunk(disk, i, chunk).await;
        if let Err(e) = &result {
            self.record_error(e);
        }
        result
    }

    fn in_memory(&self, hex: &str) -> Option<Arc<Vec<u8>>> {
        let tick = self.next_tick();
        let mut s = self.lock();
        let data = s.memory.get_mut(hex).map(|(d, used)| {
            *used = tick;
            d.clone()
        })?;
        s.stats.hits += 1;
        if let Some(e) = s.disk.get_mut(hex) {
            e.used = tick;
        }
        Some(data)
    }

    /// Read a chunk file and check it; a damaged one is removed (it will
    /// be fetched again) and None returned.
    async fn load_local(&self, path: &Path, chunk: &ChunkRef, chunk_size: u64) -> Option<Vec<u8>> {
        let path2 = path.to_path_buf();
        let digest = chunk.digest.clone();
        let loaded = tokio::task::spawn_blocking(move || {
            let bytes = std::fs::read(&path2).ok()?;
            if sha256(&bytes) != digest {
                tracing::warn!(
                    "chunk {} is damaged on disk; fetching it again",
                    path2.display()
                );
                let _ = std::fs::remove_file(&path2);
                return None;
            }
            decompress(&bytes, chunk_size).ok()
        })
        .await
        .ok()
        .flatten();
        let mut s = self.lock();
        match &loaded {
            Some(_) => s.stats.hits += 1,
            None => {
                if let Some(hex) = path.file_name().and_then(|n| n.to_str()) {
                    s.disk.remove(hex);
                }
            }
        }
        loaded
    }

    fn remember(&self, hex: &str, size: u64, data: Arc<Vec<u8>>, on_disk: bool) {
        let tick = self.next_tick();
        let mut s = self.lock();
        if on_disk {
            s.disk.insert(hex.to_string(), OnDisk { size, used: tick });
        } else if let Some(e) = s.disk.get_mut(hex) {
            e.used = tick;
            // Touch the file so a restart keeps the order.
            let _ = std::fs::File::open(self.dir.join(hex))
                .and_then(|f| f.set_modified(std::time::SystemTime::now()));
        }
        if s.memory.len() >= MEMORY_CHUNKS {
            if let Some(old) = s
                .memory
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(h, _)| h.clone())
            {
                s.memory.remove(&old);
            }
        }
        s.memory.insert(hex.to_string(), (data, tick));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chunks::{build, CHUNK_SIZE};
    use std::os::unix::fs::FileExt;

    /// Chunks served from a directory standing in for a registry, counted.
    struct Dir(PathBuf, AtomicU64);

    #[async_trait::async_trait]
    impl Fetch for Dir {
        async fn fetch(&self, chunk: &ChunkRef) -> Result<Vec<u8>> {
            self.1.fetch_add(1, Ordering::Relaxed);
            Ok(std::fs::read(self.0.join(chunk_hex(&chunk.digest)?)).unwrap())
        }
    }

    fn disk_with(path: &Path, chunks: u64) -> Vec<Vec<u8>> {
        let f = std::fs::File::create(path).unwrap();
        let mut all = Vec::new();
        for i in 0..chunks {
            // Incompressible enough that each chunk has a real size.
            let data: Vec<u8> = (0..CHUNK_SIZE)
                .map(|j| ((j * 2654435761 + i * 97) >> 7) as u8)
                .collect();
            f.write_all_at(&data, i * CHUNK_SIZE).unwrap();
            all.push(data);
        }
        all
    }

    #[tokio::test]
    async fn the_bound_holds_reads_stay_correct_and_damage_is_named() {
        let tmp = tempfile::tempdir().unwrap();
        let registry = tmp.path().join("registry");
        let content = disk_with(&tmp.path().join("disk"), 6);
        let index = build(&tmp.path().join("disk"), &registry).unwrap();
        let one = index.chunks[0].as_ref().unwrap().size;
        let images = tmp.path().join("images");
        // Room for two chunks of the six.
        let cache = ChunkCache::open(&images, one * 2 + one / 2);
        let fetches = Arc::new(Dir(registry.clone(), AtomicU64::new(0)));
        let disk = Disk::new("test/img:v1".into(), index.clone(), Some(fetches.clone()));
        for round in 0..2 {
            for (i, want) in content.iter().enumerate() {
                let got = cache.read(&disk, i).await.unwrap();
                assert_eq!(&got[..], &want[..], "round {round} chunk {i}");
                let st = cache.stats();
                assert!(st.cached_bytes <= st.max_bytes, "{st:?}");
            }
        }
        let st = cache.stats();
        assert_eq!(st.misses, 6, "the second round hits memory: {st:?}");
        assert!(st.evictions >= 3, "{st:?}");
        let on_disk: u64 = std::fs::read_dir(chunk_dir(&images))
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        assert!(
            on_disk <= st.max_bytes && on_disk == st.cached_bytes,
            "{on_disk} {st:?}"
        );

        // A chunk damaged at its source is an error naming image and
        // chunk, never data.
        let victim = index.chunks[5].as_ref().unwrap();
        let path = registry.join(chunk_hex(&victim.digest).unwrap());
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[10] ^= 0xff;
        std::fs::write(&path, bytes).unwrap();
        let fresh = ChunkCache::open(&tmp.path().join("other"), 1 << 30);
        let err = fresh.read(&disk, 5).await.unwrap_err().to_string();
        assert!(
            err.contains("test/img:v1") && err.contains("chunk 5"),
            "{err}"
        );
        assert!(err.contains(&victim.digest), "{err}");
        assert_eq!(fresh.stats().errors, 1);
    }

    #[tokio::test]
    async fn prefetch_fetches_a_boot_order_within_half_the_bound() {
        let tmp = tempfile::tempdir().unwrap();
        let registry = tmp.path().join("registry");
        disk_with(&tmp.path().join("disk"), 6);
        let index = build(&tmp.path().join("disk"), &registry).unwrap();
        let one = index.chunks[0].as_ref().unwrap().size;
        let fetches = Arc::new(Dir(registry.clone(), AtomicU64::new(0)));
        let cache = Arc::new(ChunkCache::open(&tmp.path().join("a"), 1 << 30));
        let disk = Arc::new(Disk::new(
            "img".into(),
            index.clone(),
            Some(fetches.clone()),
        ));
        cache.clone().prefetch(disk.clone(), vec![4, 1, 4]).await;
        assert_eq!(fetches.1.load(Ordering::Relaxed), 2);
        assert!(disk.read_order().is_empty(), "a prefetch is not a read");
        cache.read(&disk, 4).await.unwrap();
        cache.read(&disk, 1).await.unwrap();
        assert_eq!(fetches.1.load(Ordering::Relaxed), 2, "both were prefetched");
        assert_eq!(disk.read_order(), vec![4, 1]);
        // Half of a bound smaller than two chunks holds none.
        let small = Arc::new(ChunkCache::open(&tmp.path().join("b"), one * 3 / 2));
        let disk = Arc::new(Disk::new("img".into(), index, Some(fetches.clone())));
        small.clone().prefetch(disk, vec![0, 2]).await;
        assert_eq!(fetches.1.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn chunks_of_a_local_only_image_are_pinned_and_not_counted() {
        let tmp = tempfile::tempdir().unwrap();
        let images = tmp.path().join("images");
        disk_with(&tmp.path().join("disk"), 3);
        let index = build(&tmp.path().join("disk"), &chunk_dir(&images)).unwrap();
        let image_dir = images.join("ab".repeat(32));
        std::fs::create_dir_all(&image_dir).unwrap();
        std::fs::write(image_dir.join("index.json"), index.to_json()).unwrap();
        std::fs::write(
            image_dir.join("meta.json"),
            r#"{"chunks": {"remote": null}}"#,
        )
        .unwrap();
        // A bound of zero evicts nothing pinned.
        let cache = ChunkCache::open(&images, 0);
        let st = cache.stats();
        assert_eq!(st.cached_bytes, 0);
        assert_eq!(st.pinned_bytes, index.stored_bytes());
        let disk = Disk::new("local".into(), index, None);
        assert_eq!(
            cache.read(&disk, 2).await.unwrap().len(),
            CHUNK_SIZE as usize
        );
    }
}

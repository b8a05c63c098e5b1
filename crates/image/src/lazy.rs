//! Captures read lazily: a capture's big files (its RAM and its disk),
//! pulled from a registry chunk by chunk as a VM first touches them, under
//! one FUSE mount the image daemon serves.
//!
//! ```text
//! <data>/images/lazy/<capture>.json   what a capture's files are made of
//!                                     (0600: it may hold credentials)
//! <data>/images/lazy/<capture>.error  its damaged chunk, once one was read
//! /run/tine/lazy/<data-hash>/<capture>/<file>
//!                                     the files, read-only, as QEMU maps them
//! /run/tine/lazy/<data-hash>/<capture>/error
//!                                     the damaged chunk, once one was read
//! ```
//!
//! The mount is outside the data directory so that removing a data
//! directory never meets it (a mount point cannot be removed), and a mount
//! left by a daemon that was killed is detached by the next one.
//!
//! A host that restores a capture it lacks registers it ([`register`]),
//! fetches only its small device state, and points the snapshot's `ram`
//! and `disk.qcow2` at [`path_of`]. QEMU maps the RAM file MAP_PRIVATE as
//! it maps any snapshot's: a page the guest touches for the first time is
//! a FUSE read, answered from the chunk cache (the same bounded cache OCI
//! images use, so pulled captures count against `image_cache_max_bytes`),
//! which fetches the chunk from the registry and checks its digest first.
//! A chunk that cannot be fetched or does not match is an EIO: the disk
//! read fails in the guest and a RAM page faults QEMU out (SIGBUS), never
//! a guest running on wrong bytes; the error, naming the capture and the
//! chunk, is logged; a damaged chunk's is kept, and read next to the file
//! as `error` ([`read_failure`]), for whoever reports the VM's end and to
//! refuse later restores of it.
//!
//! Why FUSE and not userfaultfd: QEMU's guest RAM lives in QEMU's process,
//! and a userfaultfd must be registered by the process that owns the
//! memory; QEMU only does so for its own postcopy migration. A file QEMU
//! maps needs no change to QEMU, keeps restores the MAP_PRIVATE mapping of
//! a frozen file every local restore is, and lives in the image daemon,
//! which outlives server restarts as the QEMUs do. `fuser` is the
//! maintained pure-Rust FUSE library (no libfuse needed; as root it mounts
//! with mount(2) directly).

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, KernelConfig,
    LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyLseek,
    ReplyOpen, Request,
};
use serde::{Deserialize, Serialize};

use crate::chunks::cache::{ChunkCache, Disk};
use crate::chunks::remote::RegistryChunks;
use crate::chunks::Index;
use crate::registry::RegistryOptions;
use crate::{io, ImageError, ImageRef, Result};

/// One file of a capture as a chunked artifact in a registry.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LazyFile {
    /// The artifact (`host/repo:tag`) its chunks are blobs of.
    pub reference: String,
    pub index: Index,
}

/// What [`register`] records of a capture.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Descriptor {
    pub capture: String,
    /// The snapshot made of it: once that is gone (and nothing has the
    /// files open) the daemon forgets the capture.
    pub snapshot_dir: PathBuf,
    pub files: BTreeMap<String, LazyFile>,
    pub registries: RegistryOptions,
}

/// Directory of the descriptors.
pub fn descriptors_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("images").join("lazy")
}

/// The daemon's mount point: under `/run`, named by a hash of the data
/// directory.
pub fn mount_dir(data_dir: &Path) -> PathBuf {
    let canonical = std::fs::canonicalize(data_dir).unwrap_or_else(|_| data_dir.to_path_buf());
    let hash = crate::chunks::sha256(canonical.as_os_str().as_encoded_bytes());
    let hex = hash.strip_prefix("sha256:").unwrap_or(&hash);
    Path::new("/run/tine/lazy").join(&hex[..16])
}

/// Where file `file` of capture `capture` appears once registered.
pub fn path_of(data_dir: &Path, capture: &str, file: &str) -> PathBuf {
    mount_dir(data_dir).join(capture).join(file)
}

/// A capture id or file name: what may appear as one path component.
fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s != "."
        && s != ".."
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Record `d` for the daemon to serve (replacing an earlier one).
pub fn register(data_dir: &Path, d: &Descriptor) -> Result<()> {
    let bad = |what: &str| ImageError::Io {
        context: format!("capture {:?}: {what} is not a valid name", d.capture),
        source: std::io::ErrorKind::InvalidInput.into(),
    };
    if !valid_name(&d.capture) {
        return Err(bad("its id"));
    }
    if let Some(f) = d.files.keys().find(|f| !valid_name(f)) {
        return Err(bad(f));
    }
    let dir = descriptors_dir(data_dir);
    std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
    let json = serde_json::to_vec(d).unwrap_or_default();
    crate::nbd::daemon::write_private(&dir.join(format!("{}.json", d.capture)), &json)?;
    let _ = std::fs::remove_file(dir.join(format!("{}.error", d.capture)));
    Ok(())
}

/// The captures registered here (read lazily now or soon).
pub fn registered(data_dir: &Path) -> Vec<String> {
    described(&descriptors_dir(data_dir))
}

/// The captures with a descriptor in `dir`.
fn described(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_str()?.strip_suffix(".json")?.to_string();
            valid_name(&n).then_some(n)
        })
        .collect()
}

/// Forget capture `capture` (files already open stay readable).
pub fn unregister(data_dir: &Path, capture: &str) {
    if valid_name(capture) {
        let dir = descriptors_dir(data_dir);
        let _ = std::fs::remove_file(dir.join(format!("{capture}.json")));
        let _ = std::fs::remove_file(dir.join(format!("{capture}.error")));
    }
}

/// Why reading lazily read file `path` failed, if it is one and a chunk
/// of it was damaged: the error names the capture, the file and the chunk
/// (served as `error` next to it).
pub fn read_failure(path: &Path) -> Option<String> {
    if !path.starts_with("/run/tine/lazy") {
        return None;
    }
    std::fs::read_to_string(path.with_file_name(ERROR_FILE)).ok()
}

/// What the daemon serves next to a capture's files once a chunk of it
/// was found damaged.
const ERROR_FILE: &str = "error";

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Contents never change, so the kernel may keep names and attributes.
const TTL: Duration = Duration::from_secs(3600);
const ROOT: u64 = 1;

enum Node {
    Dir(String),
    /// A capture's damaged chunk (`error`).
    Error(String),
    File {
        capture: String,
        disk: Arc<Disk>,
        size: u64,
        /// Bytes of its chunks that are not zeros (what `stat` shows as
        /// allocated, as for a sparse file).
        stored: u64,
    },
}

#[derive(Default)]
struct Inodes {
    next: u64,
    nodes: HashMap<u64, Arc<Node>>,
    /// (capture, file or "" for the capture's directory) → inode.
    names: HashMap<(String, String), u64>,
}

struct LazyFs {
    descriptors: PathBuf,
    cache: Arc<ChunkCache>,
    rt: tokio::runtime::Handle,
    inodes: Mutex<Inodes>,
    open: Arc<Mutex<HashMap<String, usize>>>,
}

fn attr(ino: u64, node: &Node) -> FileAttr {
    let (kind, perm, size, stored, nlink) = match node {
        Node::Dir(_) => (FileType::Directory, 0o555, 0, 0, 2),
        Node::Error(text) => (
            FileType::RegularFile,
            0o444,
            text.len() as u64,
            text.len() as u64,
            1,
        ),
        Node::File { size, stored, .. } => (FileType::RegularFile, 0o444, *size, *stored, 1),
    };
    FileAttr {
        ino: INodeNo(ino),
        size,
        blocks: stored.div_ceil(512),
        atime: UNIX_EPOCH,
        mtime: UNIX_EPOCH,
        ctime: UNIX_EPOCH,
        crtime: UNIX_EPOCH,
        kind,
        perm,
        nlink,
        uid: 0,
        gid: 0,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

fn root_attr() -> FileAttr {
    attr(ROOT, &Node::Dir(String::new()))
}

impl LazyFs {
    fn descriptor(&self, capture: &str) -> Option<Descriptor> {
        if !valid_name(capture) {
            return None;
        }
        let bytes = std::fs::read(self.descriptors.join(format!("{capture}.json"))).ok()?;
        serde_json::from_slice(&bytes).ok()
    }

    fn node(&self, ino: u64) -> Option<Arc<Node>> {
        lock(&self.inodes).nodes.get(&ino).cloned()
    }

    /// The inode of `(capture, file)`, made with `make` the first time.
    fn inode(&self, key: (String, String), make: impl FnOnce() -> Node) -> (u64, Arc<Node>) {
        let mut i = lock(&self.inodes);
        if let Some(&ino) = i.names.get(&key) {
            if let Some(n) = i.nodes.get(&ino) {
                return (ino, n.clone());
            }
        }
        i.next = i.next.max(ROOT) + 1;
        let ino = i.next;
        let node = Arc::new(make());
        i.nodes.insert(ino, node.clone());
        i.names.insert(key, ino);
        (ino, node)
    }

    /// The `error` file of `capture`, as it is now (a fresh inode each
    /// time: its text may change).
    fn error_of(&self, capture: &str) -> Option<(u64, Arc<Node>)> {
        let text =
            std::fs::read_to_string(self.descriptors.join(format!("{capture}.error"))).ok()?;
        let mut i = lock(&self.inodes);
        i.next = i.next.max(ROOT) + 1;
        let ino = i.next;
        let node = Arc::new(Node::Error(text));
        i.nodes.insert(ino, node.clone());
        Some((ino, node))
    }

    fn lookup_capture(&self, capture: &str) -> Option<(u64, Arc<Node>)> {
        self.descriptor(capture)?;
        Some(self.inode((capture.to_string(), String::new()), || {
            Node::Dir(capture.to_string())
        }))
    }

    fn lookup_file(&self, capture: &str, file: &str) -> Option<(u64, Arc<Node>)> {
        let key = (capture.to_string(), file.to_string());
        if let Some(&ino) = self
            .inodes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .names
            .get(&key)
        {
            return self.node(ino).map(|n| (ino, n));
        }
        let d = self.descriptor(capture)?;
        let f = d.files.get(file)?;
        let reference = ImageRef::parse(&f.reference).ok()?;
        let remote = RegistryChunks::new(reference, &d.registries, None);
        let disk = Arc::new(Disk::new(
            format!("capture {capture} ({file})"),
            f.index.clone(),
            Some(remote),
        ));
        let size = f.index.disk_size;
        let stored =
            (f.index.chunks.iter().flatten().count() as u64 * f.index.chunk_size).min(size);
        Some(self.inode(key, || Node::File {
            capture: capture.to_string(),
            disk,
            size,
            stored,
        }))
    }
}

/// The first offset at or after `at` that is data (`data`) or a hole in a
/// file of `size` bytes made of `index`'s chunks; None past the end (or
/// no data after `at`), as lseek(2) answers ENXIO.
fn seek(index: &Index, size: u64, at: u64, data: bool) -> Option<u64> {
    if at >= size {
        return None;
    }
    let cs = index.chunk_size;
    let first = (at / cs) as usize;
    for (i, c) in index.chunks.iter().enumerate().skip(first) {
        if c.is_some() == data {
            return Some((i as u64 * cs).max(at));
        }
    }
    // No more data: ENXIO; no more holes: the end is one.
    (!data).then_some(size)
}

/// Bytes `[offset, offset + size)` of `disk` (short at its end).
async fn read_range(cache: &ChunkCache, disk: &Disk, offset: u64, size: u32) -> Result<Vec<u8>> {
    let total = disk.index.disk_size;
    let end = offset.saturating_add(u64::from(size)).min(total);
    let cs = disk.index.chunk_size;
    let mut out = Vec::with_capacity(end.saturating_sub(offset) as usize);
    let mut at = offset;
    while at < end {
        let i = (at / cs) as usize;
        let within = (at % cs) as usize;
        let take = ((cs - within as u64).min(end - at)) as usize;
        let data = cache.read(disk, i).await?;
        // A chunk of zeros is empty; a chunk at the end may be short.
        let have = data.len().saturating_sub(within).min(take);
        if have > 0 {
            out.extend_from_slice(&data[within..within + have]);
        }
        out.resize(out.len() + (take - have), 0);
        at += take as u64;
    }
    Ok(out)
}

impl Filesystem for LazyFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // Fault-around and readahead bring whole chunks' worth at once.
        let _ = config.set_max_readahead(1 << 20);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let Some(name) = name.to_str() else {
            return reply.error(Errno::ENOENT);
        };
        let found = match parent.0 {
            ROOT => self.lookup_capture(name),
            p => match self.node(p).as_deref() {
                Some(Node::Dir(capture)) if name == ERROR_FILE => {
                    return match self.error_of(capture) {
                        Some((ino, node)) => {
                            reply.entry(&Duration::ZERO, &attr(ino, &node), fuser::Generation(0))
                        }
                        None => reply.error(Errno::ENOENT),
                    };
                }
                Some(Node::Dir(capture)) => self.lookup_file(capture, name),
                _ => None,
            },
        };
        match found {
            Some((ino, node)) => reply.entry(&TTL, &attr(ino, &node), fuser::Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino.0 == ROOT {
            return reply.attr(&TTL, &root_attr());
        }
        match self.node(ino.0) {
            Some(node) => reply.attr(&TTL, &attr(ino.0, &node)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        match self.node(ino.0).as_deref() {
            Some(Node::File { capture, .. }) => {
                *lock(&self.open).entry(capture.clone()).or_default() += 1;
                reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE)
            }
            Some(Node::Error(_)) => reply.opened(FileHandle(0), FopenFlags::FOPEN_DIRECT_IO),
            Some(Node::Dir(_)) => reply.error(Errno::EISDIR),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if let Some(Node::File { capture, .. }) = self.node(ino.0).as_deref() {
            let mut open = lock(&self.open);
            if let Some(n) = open.get_mut(capture) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    open.remove(capture);
                }
            }
        }
        reply.ok();
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(node) = self.node(ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        if let Node::Error(text) = &*node {
            let start = (offset as usize).min(text.len());
            let end = start.saturating_add(size as usize).min(text.len());
            return reply.data(&text.as_bytes()[start..end]);
        }
        let Node::File { capture, disk, .. } = &*node else {
            return reply.error(Errno::EISDIR);
        };
        let (disk, cache, capture) = (disk.clone(), self.cache.clone(), capture.clone());
        let errors = self.descriptors.clone();
        self.rt.spawn(async move {
            match read_range(&cache, &disk, offset, size).await {
                Ok(data) => reply.data(&data),
                Err(e) => {
                    tracing::error!("{e}");
                    // A damaged chunk stays damaged: later restores are
                    // refused (a fetch that failed may work next time).
                    if matches!(e, ImageError::Damaged { .. }) {
                        let _ =
                            std::fs::write(errors.join(format!("{capture}.error")), e.to_string());
                    }
                    reply.error(Errno::EIO)
                }
            }
        });
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        // Nothing is ever written.
        reply.ok();
    }

    /// SEEK_DATA and SEEK_HOLE by the index (a chunk of zeros is a hole),
    /// so sparse copies skip them without fetching anything.
    fn lseek(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: i64,
        whence: i32,
        reply: ReplyLseek,
    ) {
        let node = self.node(ino.0);
        let Some(Node::File { disk, size, .. }) = node.as_deref() else {
            return reply.error(Errno::EINVAL);
        };
        let Ok(at) = u64::try_from(offset) else {
            return reply.error(Errno::EINVAL);
        };
        match seek(&disk.index, *size, at, whence == libc::SEEK_DATA) {
            _ if whence != libc::SEEK_DATA && whence != libc::SEEK_HOLE => {
                reply.error(Errno::EINVAL)
            }
            Some(to) => reply.offset(to as i64),
            None => reply.error(Errno::ENXIO),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let mut entries: Vec<(u64, FileType, String)> = vec![
            (ino.0, FileType::Directory, ".".into()),
            (ROOT, FileType::Directory, "..".into()),
        ];
        if ino.0 == ROOT {
            for n in described(&self.descriptors) {
                if let Some((i, _)) = self.lookup_capture(&n) {
                    entries.push((i, FileType::Directory, n));
                }
            }
        } else if let Some(Node::Dir(capture)) = self.node(ino.0).as_deref() {
            let files = self
                .descriptor(capture)
                .map(|d| d.files)
                .unwrap_or_default();
            for f in files.keys() {
                if let Some((i, _)) = self.lookup_file(capture, f) {
                    entries.push((i, FileType::RegularFile, f.clone()));
                }
            }
        } else {
            return reply.error(Errno::ENOENT);
        }
        for (n, (i, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(i), (n + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// The mounted filesystem; dropping it unmounts.
pub struct Mounted {
    _session: fuser::BackgroundSession,
    open: Arc<Mutex<HashMap<String, usize>>>,
    descriptors: PathBuf,
}

impl Mounted {
    /// Files some process (a QEMU) has open or mapped.
    pub fn open_files(&self) -> usize {
        lock(&self.open).values().sum()
    }

    /// Forget captures whose snapshot is gone, when nothing reads them
    /// (a minute after registration at the earliest: a restore in flight
    /// registers before its snapshot exists). Until then the cluster
    /// keeps their chunks in the registry.
    pub fn forget_unused(&self) {
        let old = SystemTime::now() - Duration::from_secs(60);
        for e in std::fs::read_dir(&self.descriptors)
            .into_iter()
            .flatten()
            .flatten()
        {
            let path = e.path();
            if path.extension() != Some(OsStr::new("json")) {
                continue;
            }
            let young = e
                .metadata()
                .and_then(|m| m.modified())
                .is_ok_and(|t| t > old);
            let d: Option<Descriptor> = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok());
            let gone = d.is_none_or(|d| {
                !d.snapshot_dir.join("meta.json").exists()
                    && !lock(&self.open).contains_key(&d.capture)
            });
            if gone && !young {
                let _ = std::fs::remove_file(&path);
                let _ = std::fs::remove_file(path.with_extension("error"));
            }
        }
    }
}

/// Mount the lazy files of `data_dir` (a stale mount of a daemon that died
/// is detached first). Reads run on `rt`.
pub fn mount(
    data_dir: &Path,
    cache: Arc<ChunkCache>,
    rt: tokio::runtime::Handle,
) -> Result<Mounted> {
    let at = mount_dir(data_dir);
    let _ = nix::mount::umount2(&at, nix::mount::MntFlags::MNT_DETACH);
    std::fs::create_dir_all(&at).map_err(io(format!("creating {}", at.display())))?;
    let descriptors = descriptors_dir(data_dir);
    std::fs::create_dir_all(&descriptors)
        .map_err(io(format!("creating {}", descriptors.display())))?;
    let open = Arc::new(Mutex::new(HashMap::new()));
    let fs = LazyFs {
        descriptors: descriptors.clone(),
        cache,
        rt,
        inodes: Mutex::new(Inodes::default()),
        open: open.clone(),
    };
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        fuser::MountOption::FSName("tine-lazy".into()),
        fuser::MountOption::RO,
        fuser::MountOption::NoDev,
        fuser::MountOption::NoSuid,
        fuser::MountOption::NoExec,
        fuser::MountOption::DefaultPermissions,
    ];
    // The jailed QEMUs run as their own uids.
    config.acl = fuser::SessionACL::All;
    let session = fuser::spawn_mount(fs, &at, &config).map_err(io(format!(
        "mounting the lazy captures on {}",
        at.display()
    )))?;
    Ok(Mounted {
        _session: session,
        open,
        descriptors,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_single_safe_components() {
        for ok in ["abc", "snap-1.ram", "x_y"] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", ".", "..", "a/b", "a b", "é", &"x".repeat(129)] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn seek_finds_data_and_holes_by_chunk() {
        let c = |d: &str| {
            Some(crate::chunks::ChunkRef {
                digest: d.into(),
                size: 1,
            })
        };
        // [data, zeros, data, zeros(short)] with 10-byte chunks, 35 bytes.
        let index = Index {
            version: 1,
            chunk_size: 10,
            disk_size: 35,
            chunks: vec![c("a"), None, c("b"), None],
            boot_order: vec![],
        };
        assert_eq!(seek(&index, 35, 0, true), Some(0));
        assert_eq!(seek(&index, 35, 5, true), Some(5));
        assert_eq!(seek(&index, 35, 5, false), Some(10));
        assert_eq!(seek(&index, 35, 12, true), Some(20));
        assert_eq!(seek(&index, 35, 25, false), Some(30));
        assert_eq!(seek(&index, 35, 31, true), None);
        assert_eq!(seek(&index, 35, 35, false), None);
    }

    #[test]
    fn mounts_are_outside_data_dirs_and_one_per_data_dir() {
        let (a, b) = (
            mount_dir(Path::new("/data/a")),
            mount_dir(Path::new("/data/b")),
        );
        assert!(a.starts_with("/run/tine/lazy") && b.starts_with("/run/tine/lazy"));
        assert_ne!(a, b);
        assert_eq!(read_failure(Path::new("/data/a/snapshots/x/ram")), None);
    }
}

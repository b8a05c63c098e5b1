//! The FUSE filesystem the image daemon serves: a directory per registered
//! capture, its files read through the chunk cache, holes where its chunks
//! are zeros, and `error` once a chunk was found damaged.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, KernelConfig,
    LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyLseek,
    ReplyOpen, Request,
};

use super::{described, lock, valid_name, Descriptor, ERROR_FILE};
use crate::chunks::cache::{ChunkCache, Disk};
use crate::chunks::remote::RegistryChunks;
use crate::chunks::Index;
use crate::{ImageError, ImageRef, Result};

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
pub(super) struct Inodes {
    next: u64,
    nodes: HashMap<u64, Arc<Node>>,
    /// (capture, file or "" for the capture's directory) → inode.
    names: HashMap<(String, String), u64>,
}

pub(super) struct LazyFs {
    pub(super) descriptors: PathBuf,
    pub(super) cache: Arc<ChunkCache>,
    pub(super) rt: tokio::runtime::Handle,
    pub(super) inodes: Mutex<Inodes>,
    pub(super) open: Arc<Mutex<HashMap<String, usize>>>,
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

#[cfg(test)]
mod tests {
    use super::*;

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
}

//! Converted images as content-addressed chunks.
//!
//! A root disk (the ext4 a conversion makes) is cut into fixed-size chunks
//! of [`CHUNK_SIZE`] bytes. A chunk that is all zeros (most of a sparse
//! disk) is not stored at all; every other one is compressed with zstd and
//! named by the sha256 of its compressed bytes, so equal chunks of two
//! images are one file (zstd at one level is deterministic). The
//! [`Index`] lists, for each chunk of the disk, its digest or nothing.
//!
//! A chunk is the same blob locally (`images/chunks/sha256/<hex>`) and in a
//! registry (a layer of the pushed artifact), so a node that has only the
//! index fetches what a read needs by digest and checks it on arrival.

pub mod cache;
pub mod prune;
pub mod remote;

use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{io, ImageError, Result};

/// Bytes of disk per chunk: small enough that a boot fetches little it
/// does not read, large enough that an image is a few thousand blobs.
pub const CHUNK_SIZE: u64 = 1 << 20;

/// zstd level of every chunk (fixed: a different level would make other
/// bytes, and equal chunks of two images would no longer dedupe).
const LEVEL: i32 = 3;

/// Media types of the pushed artifact.
pub const INDEX_MEDIA_TYPE: &str = "application/vnd.tine.rootfs.index.v1+json";
pub const CHUNK_MEDIA_TYPE: &str = "application/vnd.tine.rootfs.chunk.v1+zstd";
pub const ARTIFACT_TYPE: &str = "application/vnd.tine.rootfs.v1";

/// One stored chunk.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    /// `sha256:<hex>` of the compressed bytes.
    pub digest: String,
    /// Compressed bytes.
    pub size: u64,
}

/// What a converted disk is made of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Index {
    pub version: u32,
    pub chunk_size: u64,
    /// Bytes of the disk the guest sees.
    pub disk_size: u64,
    /// One entry per chunk of the disk; `None` is a chunk of zeros.
    pub chunks: Vec<Option<ChunkRef>>,
    /// Chunks in the order an earlier boot first read them: a host that
    /// starts the image fetches these in the background.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub boot_order: Vec<usize>,
}

impl Index {
    /// The distinct chunks, each once, in disk order.
    pub fn unique(&self) -> Vec<ChunkRef> {
        let mut seen = std::collections::HashSet::new();
        self.chunks
            .iter()
            .flatten()
            .filter(|c| seen.insert(c.digest.clone()))
            .cloned()
            .collect()
    }

    /// Compressed bytes of the distinct chunks (what a full fetch moves).
    pub fn stored_bytes(&self) -> u64 {
        self.unique().iter().map(|c| c.size).sum()
    }

    pub fn from_json(bytes: &[u8]) -> Result<Self> {
        let index: Index = serde_json::from_slice(bytes).map_err(|e| ImageError::Io {
            context: "a chunk index is not valid JSON".into(),
            source: e.into(),
        })?;
        let expect = index.disk_size.div_ceil(index.chunk_size.max(1));
        if index.version != 1 || index.chunk_size == 0 || index.chunks.len() as u64 != expect {
            return Err(ImageError::Io {
                context: "a chunk index is inconsistent".into(),
                source: std::io::ErrorKind::InvalidData.into(),
            });
        }
        for c in index.chunks.iter().flatten() {
            chunk_hex(&c.digest)?;
        }
        if index.boot_order.iter().any(|&i| i >= index.chunks.len()) {
            return Err(ImageError::Io {
                context: "a chunk index's boot order names a chunk it does not have".into(),
                source: std::io::ErrorKind::InvalidData.into(),
            });
        }
        Ok(index)
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// The hex of a `sha256:` digest, refused unless it is one.
pub fn chunk_hex(digest: &str) -> Result<&str> {
    match digest.strip_prefix("sha256:") {
        Some(h) if h.len() == 64 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) => {
            Ok(h)
        }
        _ => Err(ImageError::Reference {
            reference: digest.to_string(),
            detail: "not a sha256 digest".into(),
        }),
    }
}

pub fn sha256(data: &[u8]) -> String {
    format!("sha256:{:x}", Sha256::digest(data))
}

/// Where chunks live under an image store directory.
pub fn chunk_dir(images: &Path) -> PathBuf {
    images.join("chunks").join("sha256")
}

/// Decompress a chunk (at most `chunk_size` bytes out).
pub fn decompress(data: &[u8], chunk_size: u64) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::with_capacity(chunk_size as usize);
    zstd::stream::read::Decoder::new(data)?
        .take(chunk_size + 1)
        .read_to_end(&mut out)?;
    if out.len() as u64 > chunk_size {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "a chunk is larger than its index says",
        ));
    }
    Ok(out)
}

/// Cut the disk image at `disk` into chunks under `dir` (a chunk already
/// there is kept: same digest, same bytes) and return its index. Holes are
/// skipped without reading them.
pub fn build(disk: &Path, dir: &Path) -> Result<Index> {
    std::fs::create_dir_all(dir).map_err(io(format!("creating {}", dir.display())))?;
    let file = std::fs::File::open(disk).map_err(io(format!("opening {}", disk.display())))?;
    let disk_size = file
        .metadata()
        .map_err(io(format!("reading {}", disk.display())))?
        .len();
    let count = disk_size.div_ceil(CHUNK_SIZE);
    let mut chunks = Vec::with_capacity(count as usize);
    let mut buf = vec![0u8; CHUNK_SIZE as usize];
    for i in 0..count {
        let off = i * CHUNK_SIZE;
        let len = CHUNK_SIZE.min(disk_size - off) as usize;
        if !has_data(&file, off, len as u64) {
            chunks.push(None);
            continue;
        }
        file.read_exact_at(&mut buf[..len], off)
            .map_err(io(format!("reading {}", disk.display())))?;
        if buf[..len].iter().all(|&b| b == 0) {
            chunks.push(None);
            continue;
        }
        let data = zstd::bulk::compress(&buf[..len], LEVEL).map_err(io("compressing a chunk"))?;
        let digest = sha256(&data);
        let path = dir.join(chunk_hex(&digest)?);
        if !path.exists() {
            write_atomic(&path, &data)?;
        }
        chunks.push(Some(ChunkRef {
            digest,
            size: data.len() as u64,
        }));
    }
    Ok(Index {
        version: 1,
        chunk_size: CHUNK_SIZE,
        disk_size,
        chunks,
        boot_order: Vec::new(),
    })
}

/// Write the whole disk of `index` from the chunks in `dir` into `out`
/// (sparse where the disk is zeros), checking every chunk.
pub fn assemble(index: &Index, dir: &Path, out: &Path) -> Result<()> {
    let f = std::fs::File::create(out).map_err(io(format!("creating {}", out.display())))?;
    f.set_len(index.disk_size)
        .map_err(io(format!("sizing {}", out.display())))?;
    for (i, c) in index.chunks.iter().enumerate() {
        let Some(c) = c else { continue };
        let bytes = std::fs::read(dir.join(chunk_hex(&c.digest)?))
            .map_err(io(format!("reading chunk {}", c.digest)))?;
        if sha256(&bytes) != c.digest {
            return Err(ImageError::Damaged {
                image: out.display().to_string(),
                index: i,
                digest: c.digest.clone(),
                detail: "in the local store".into(),
            });
        }
        let data = decompress(&bytes, index.chunk_size).map_err(io("decompressing a chunk"))?;
        f.write_all_at(&data, i as u64 * index.chunk_size)
            .map_err(io(format!("writing {}", out.display())))?;
    }
    Ok(())
}

/// Whether `[off, off+len)` of `file` holds any data (not only a hole).
fn has_data(file: &std::fs::File, off: u64, len: u64) -> bool {
    use std::os::fd::AsRawFd;
    // SAFETY: lseek on a descriptor we own; it moves only the offset,
    // which nothing else here uses (reads are positional).
    let next = unsafe { libc::lseek(file.as_raw_fd(), off as libc::off_t, libc::SEEK_DATA) };
    // ENXIO: no data after `off`; any other error: assume data.
    if next < 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ENXIO);
    }
    (next as u64) < off + len
}

/// Image state that must survive a crash (metadata, chunks stored only
/// here, chunks pulled into the local store), through [`tine_durable`].
pub fn write_atomic(path: &Path, data: &[u8]) -> Result<()> {
    tine_durable::write(path, data).map_err(io(format!("storing {}", path.display())))
}

/// A file whose content is checked when read and can be had again (a
/// chunk in the cache, verified against its digest; statistics): atomic,
/// not synced.
pub fn write_cached(path: &Path, data: &[u8]) -> Result<()> {
    tine_durable::write_unsynced(path, data).map_err(io(format!("storing {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_skips_holes_and_zeros_and_dedupes_equal_chunks() {
        let tmp = tempfile::tempdir().unwrap();
        let disk = tmp.path().join("disk");
        let f = std::fs::File::create(&disk).unwrap();
        f.set_len(8 * CHUNK_SIZE + 100).unwrap();
        let pattern: Vec<u8> = (0..CHUNK_SIZE).map(|i| (i % 251) as u8).collect();
        f.write_all_at(&pattern, 0).unwrap();
        f.write_all_at(&pattern, 3 * CHUNK_SIZE).unwrap();
        // Explicit zeros (not a hole) are not stored either.
        f.write_all_at(&vec![0u8; CHUNK_SIZE as usize], 5 * CHUNK_SIZE)
            .unwrap();
        f.write_all_at(b"tail", 8 * CHUNK_SIZE).unwrap();
        drop(f);
        let dir = tmp.path().join("chunks");
        let index = build(&disk, &dir).unwrap();
        assert_eq!(index.chunks.len(), 9);
        assert_eq!(index.chunks[0], index.chunks[3], "equal chunks, one digest");
        assert!(index.chunks[1].is_none() && index.chunks[5].is_none());
        assert_eq!(index.unique().len(), 2);
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 2);
        let c0 = index.chunks[0].as_ref().unwrap();
        let data = std::fs::read(dir.join(chunk_hex(&c0.digest).unwrap())).unwrap();
        assert_eq!(sha256(&data), c0.digest);
        assert_eq!(decompress(&data, CHUNK_SIZE).unwrap(), pattern);
        let last = index.chunks[8].as_ref().unwrap();
        let data = std::fs::read(dir.join(chunk_hex(&last.digest).unwrap())).unwrap();
        assert_eq!(decompress(&data, CHUNK_SIZE).unwrap()[..4], *b"tail");
        let back = Index::from_json(&index.to_json()).unwrap();
        assert_eq!(back, index);
        let mut bad = index.clone();
        bad.chunks.pop();
        assert!(Index::from_json(&bad.to_json()).is_err());
    }
}

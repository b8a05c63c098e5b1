//! CRC-32 of snapshot files, and checking a sealed file once per process.
//!
//! Snapshot files are written once and never changed; a file that passed
//! its check keeps passing until it is replaced (a new inode) or touched
//! (a new mtime), so [`once`] remembers what passed.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::sync::Mutex;

/// CRC-32 of the whole file at `path`.
pub fn file_crc(path: &Path) -> io::Result<u32> {
    let mut f = File::open(path)?;
    let mut hasher = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match f.read(&mut buf)? {
            0 => return Ok(hasher.finalize()),
            n => hasher.update(&buf[..n]),
        }
    }
}

/// CRC-32 of the whole content of the sparse file at `path` (holes count
/// as the zeros they read as), reading only its data: holes are folded in
/// with `combine`. Equal for files with equal content, whatever their
/// holes.
pub fn sparse_crc(path: &Path) -> io::Result<u32> {
    sparse_crc_of(&File::open(path)?)
}

/// [`sparse_crc`] of an open file.
pub fn sparse_crc_of(f: &File) -> io::Result<u32> {
    const BLOCK: usize = 1 << 20;
    let len = f.metadata()?.len();
    let mut zero_block = crc32fast::Hasher::new();
    zero_block.update(&vec![0u8; BLOCK]);
    let mut hasher = crc32fast::Hasher::new();
    let zeros = |hasher: &mut crc32fast::Hasher, mut n: u64| {
        while n >= BLOCK as u64 {
            hasher.combine(&zero_block);
            n -= BLOCK as u64;
        }
        hasher.update(&vec![0u8; n as usize]);
    };
    let mut buf = vec![0u8; BLOCK];
    let mut pos = 0u64;
    for (data, end) in crate::sparse::data_extents(f)? {
        zeros(&mut hasher, data - pos);
        let mut at = data;
        while at < end {
            let n = ((end - at) as usize).min(BLOCK);
            f.read_exact_at(&mut buf[..n], at)?;
            hasher.update(&buf[..n]);
            at += n as u64;
        }
        pos = end;
    }
    zeros(&mut hasher, len - pos);
    Ok(hasher.finalize())
}

/// Run `check` on the open file `file` unless this process saw the same
/// file pass before (the open file's identity, not its path's: a file
/// renamed over the path meanwhile is another one).
pub fn once(file: &File, check: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
    let key = file_key(file)?;
    if PASSED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashSet::new)
        .contains(&key)
    {
        return Ok(());
    }
    check()?;
    remember(key);
    Ok(())
}

/// Count `file` as checked: this process has just written it and summed
/// what it wrote (a RAM layer), so reading it back would check nothing.
pub fn written(file: &File) -> io::Result<()> {
    remember(file_key(file)?);
    Ok(())
}

/// (device, inode, size, mtime, ctime) of the files that passed; the
/// ctime (which no one can set) tells a new file on a reused inode.
type FileKey = (u64, u64, u64, (i64, i64), (i64, i64));
static PASSED: Mutex<Option<HashSet<FileKey>>> = Mutex::new(None);

fn file_key(file: &File) -> io::Result<FileKey> {
    let m = file.metadata()?;
    Ok((
        m.dev(),
        m.ino(),
        m.size(),
        (m.mtime(), m.mtime_nsec()),
        (m.ctime(), m.ctime_nsec()),
    ))
}

fn remember(key: FileKey) {
    PASSED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get_or_insert_with(HashSet::new)
        .insert(key);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sparse_file_sums_like_its_dense_copy() {
        let dir = tempfile::tempdir().unwrap();
        let sparse = dir.path().join("sparse");
        let dense = dir.path().join("dense");
        let f = File::create(&sparse).unwrap();
        f.set_len((5 << 20) + 12345).unwrap();
        f.write_all_at(b"hello", 3 << 20).unwrap();
        f.write_all_at(&[7u8; 9000], (4 << 20) + 100).unwrap();
        drop(f);
        std::fs::write(&dense, std::fs::read(&sparse).unwrap()).unwrap();
        let want = file_crc(&dense).unwrap();
        assert_eq!(sparse_crc(&sparse).unwrap(), want);
        assert_eq!(sparse_crc(&dense).unwrap(), want);
        // One byte changed, in the data or in a hole.
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&sparse)
            .unwrap();
        f.write_all_at(b"j", 3 << 20).unwrap();
        assert_ne!(sparse_crc(&sparse).unwrap(), want);
        f.write_all_at(b"h", 3 << 20).unwrap();
        f.write_all_at(b"x", 1 << 20).unwrap();
        assert_ne!(sparse_crc(&sparse).unwrap(), want);
    }
}

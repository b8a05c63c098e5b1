//! Where a sparse file holds data (`SEEK_DATA` / `SEEK_HOLE`): RAM files
//! are mostly holes (pages the guest never touched), and reading a hole
//! only makes the kernel produce zeros.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;

use nix::unistd::{lseek, Whence};

/// The byte ranges `[start, end)` of `f` that hold data, ascending; the
/// rest reads as zeros. A filesystem without hole support reports the
/// whole file as data.
pub fn data_extents(f: &File) -> io::Result<Vec<(u64, u64)>> {
    let len = f.metadata()?.len();
    let mut out = Vec::new();
    let mut pos = 0u64;
    while pos < len {
        let start = match lseek(f.as_fd(), pos as i64, Whence::SeekData) {
            Ok(p) => p as u64,
            Err(nix::errno::Errno::ENXIO) => break, // no data after pos
            Err(e) => return Err(e.into()),
        };
        if start >= len {
            break;
        }
        let end = (lseek(f.as_fd(), start as i64, Whence::SeekHole)? as u64).min(len);
        out.push((start, end));
        pos = end;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn finds_the_data_between_holes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let f = File::create(&path).unwrap();
        let mib = 1u64 << 20;
        f.set_len(8 * mib).unwrap();
        f.write_all_at(&[1u8; 4096], 2 * mib).unwrap();
        f.write_all_at(&[2u8; 8192], 5 * mib).unwrap();
        let f = File::open(&path).unwrap();
        let got = data_extents(&f).unwrap();
        // Filesystems may round extents to their blocks, never lose data.
        assert_eq!(got.len(), 2, "{got:?}");
        assert!(got[0].0 <= 2 * mib && got[0].1 >= 2 * mib + 4096, "{got:?}");
        assert!(got[1].0 <= 5 * mib && got[1].1 >= 5 * mib + 8192, "{got:?}");
        assert!(got[1].1 <= 8 * mib);
        let empty = File::create(dir.path().join("e")).unwrap();
        assert!(data_extents(&empty).unwrap().is_empty());
    }
}

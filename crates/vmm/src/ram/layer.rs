//! The RAM layer file: the guest pages a capture changed over its parent.
//!
//! ```text
//! offset 0      header (one page): magic "TINERAML", version, page size,
//!               RAM size, entry count, data page count, index offset,
//!               CRC-32 of everything after the header (version 2)
//! offset 4096   data: one page per non-zero entry, in index order
//! index_offset  index: one u64 per entry, ascending page numbers; the top
//!               bit marks a page that is all zeros (it has no data)
//! ```
//!
//! Data comes first so a capture can stream pages out as it finds them and
//! write the index and header last; a file whose header was never written
//! (a crash mid-capture) fails the magic check, and a page damaged later
//! fails [`Layer::verify`].

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;

pub const PAGE: usize = 4096;
pub(crate) const MAGIC: &[u8; 8] = b"TINERAML";
/// 2 added the checksum; 1 (no checksum) is still read.
const VERSION: u32 = 2;
const ZERO_BIT: u64 = 1 << 63;

fn invalid(detail: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, detail)
}

/// Where a layer's page lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageData {
    Zero,
    /// Byte offset of the page in the layer file.
    At(u64),
}

/// An open layer: its index in memory, its data read on demand.
#[derive(Debug)]
pub struct Layer {
    file: File,
    ram_bytes: u64,
    entries: Vec<(u64, PageData)>,
    /// CRC-32 of the bytes after the header; `None` in a version-1 layer.
    crc: Option<u32>,
}

impl Layer {
    pub fn open(path: &Path) -> io::Result<Self> {
        let file = File::open(path)?;
        let len = file.metadata()?.len();
        let mut header = [0u8; 52];
        file.read_exact_at(&mut header, 0)
            .map_err(|_| invalid("truncated header".into()))?;
        if &header[0..8] != MAGIC {
            return Err(invalid("not a tine RAM layer (bad magic)".into()));
        }
        let u32_at = |o: usize| u32::from_le_bytes(header[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(header[o..o + 8].try_into().unwrap());
        let (version, page_size) = (u32_at(8), u32_at(12));
        let (ram_bytes, count, data_pages, index_at) =
            (u64_at(16), u64_at(24), u64_at(32), u64_at(40));
        if !(1..=VERSION).contains(&version) || page_size as usize != PAGE {
            return Err(invalid(format!(
                "version {version}, page size {page_size} (this tine reads {VERSION}, {PAGE})"
            )));
        }
        let expected = (PAGE as u64)
            .checked_add(data_pages.saturating_mul(PAGE as u64))
            .filter(|&d| d == index_at)
            .and_then(|d| d.checked_add(count.saturating_mul(8)));
        if expected != Some(len) || data_pages > count {
            return Err(invalid(format!(
                "{len} bytes do not fit {count} entries with {data_pages} data pages"
            )));
        }
        let mut raw = vec![0u8; count as usize * 8];
        file.read_exact_at(&mut raw, index_at)?;
        let mut entries = Vec::with_capacity(count as usize);
        let mut next_data = PAGE as u64;
        let mut last: Option<u64> = None;
        for chunk in raw.chunks_exact(8) {
            let word = u64::from_le_bytes(chunk.try_into().unwrap());
            let page = word & !ZERO_BIT;
            if last.is_some_and(|l| page <= l) || page >= ram_bytes / PAGE as u64 {
                return Err(invalid(format!("index entry for page {page} out of order")));
            }
            last = Some(page);
            let data = if word & ZERO_BIT != 0 {
                PageData::Zero
            } else {
                let at = next_data;
                next_data += PAGE as u64;
                PageData::At(at)
            };
            entries.push((page, data));
        }
        if next_data != index_at {
            return Err(invalid("index and data page count disagree".into()));
        }
        Ok(Self {
            file,
            ram_bytes,
            entries,
            crc: (version >= 2).then(|| u32_at(48)),
        })
    }

    /// Read the whole layer and check it against its checksum (a layer
    /// without one passes).
    pub fn verify(&self) -> io::Result<()> {
        let Some(want) = self.crc else {
            return Ok(());
        };
        let len = self.file.metadata()?.len();
        let mut hasher = crc32fast::Hasher::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut at = PAGE as u64;
        while at < len {
            let n = ((len - at) as usize).min(buf.len());
            self.file.read_exact_at(&mut buf[..n], at)?;
            hasher.update(&buf[..n]);
            at += n as u64;
        }
        let got = hasher.finalize();
        if got != want {
            return Err(invalid(format!(
                "checksum mismatch (CRC-32 {got:08x}, its header says {want:08x}): the file is damaged"
            )));
        }
        Ok(())
    }

    /// The open layer file.
    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn ram_bytes(&self) -> u64 {
        self.ram_bytes
    }

    /// `(page number, data)` in ascending page order.
    pub fn entries(&self) -> &[(u64, PageData)] {
        &self.entries
    }

    /// Read `buf.len()` bytes of page data starting at byte `at`.
    pub fn read_at(&self, buf: &mut [u8], at: u64) -> io::Result<()> {
        self.file.read_exact_at(buf, at)
    }

    /// Read one page's bytes into `buf` (`PAGE` long).
    pub fn read(&self, data: PageData, buf: &mut [u8]) -> io::Result<()> {
        match data {
            PageData::Zero => {
                buf.fill(0);
                Ok(())
            }
            PageData::At(at) => self.file.read_exact_at(buf, at),
        }
    }
}

/// Writes a layer page by page, in ascending page order.
pub struct LayerWriter {
    out: BufWriter<File>,
    ram_bytes: u64,
    index: Vec<u64>,
    data_pages: u64,
    crc: crc32fast::Hasher,
}

impl LayerWriter {
    pub fn create(path: &Path, ram_bytes: u64) -> io::Result<Self> {
        let mut out = BufWriter::with_capacity(1 << 20, File::create(path)?);
        // The header is written last; zeros until then fail the magic check.
        out.write_all(&[0u8; PAGE])?;
        Ok(Self {
            out,
            ram_bytes,
            index: Vec::new(),
            data_pages: 0,
            crc: crc32fast::Hasher::new(),
        })
    }

    /// Add `page` with contents `bytes` (`PAGE` long).
    pub fn push(&mut self, page: u64, bytes: &[u8]) -> io::Result<()> {
        debug_assert_eq!(bytes.len(), PAGE);
        if self.index.last().is_some_and(|&l| page <= l & !ZERO_BIT) {
            return Err(invalid(format!("page {page} pushed out of order")));
        }
        if is_zero(bytes) {
            self.index.push(page | ZERO_BIT);
        } else {
            self.out.write_all(bytes)?;
            self.crc.update(bytes);
            self.index.push(page);
            self.data_pages += 1;
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    /// Write index and header; returns the pages and data pages. The file
    /// is not synced: a capture syncs its files once the VM runs again
    /// (`Snapshot::sync`).
    pub fn finish(mut self) -> io::Result<(u64, u64)> {
        for word in &self.index {
            self.out.write_all(&word.to_le_bytes())?;
            self.crc.update(&word.to_le_bytes());
        }
        let file = self.out.into_inner().map_err(|e| e.into_error())?;
        let mut header = Vec::with_capacity(52);
        header.extend_from_slice(MAGIC);
        header.extend_from_slice(&VERSION.to_le_bytes());
        header.extend_from_slice(&(PAGE as u32).to_le_bytes());
        header.extend_from_slice(&self.ram_bytes.to_le_bytes());
        header.extend_from_slice(&(self.index.len() as u64).to_le_bytes());
        header.extend_from_slice(&self.data_pages.to_le_bytes());
        let index_at = PAGE as u64 + self.data_pages * PAGE as u64;
        header.extend_from_slice(&index_at.to_le_bytes());
        header.extend_from_slice(&self.crc.finalize().to_le_bytes());
        file.write_all_at(&header, 0)?;
        Ok((self.index.len() as u64, self.data_pages))
    }
}

pub fn is_zero(bytes: &[u8]) -> bool {
    // Compare in u64 words; the compiler vectorises this loop.
    let (head, words, tail) = unsafe {
        // SAFETY: any byte pattern is a valid u64; align_to only splits the
        // slice at alignment boundaries and never reads out of bounds.
        bytes.align_to::<u64>()
    };
    head.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0) && tail.iter().all(|&b| b == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page(fill: u8) -> Vec<u8> {
        vec![fill; PAGE]
    }

    #[test]
    fn round_trip_with_zero_pages() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l");
        let mut w = LayerWriter::create(&path, 64 * PAGE as u64).unwrap();
        w.push(1, &page(7)).unwrap();
        w.push(2, &page(0)).unwrap();
        w.push(40, &page(9)).unwrap();
        assert_eq!(w.finish().unwrap(), (3, 2));
        let l = Layer::open(&path).unwrap();
        assert_eq!(l.ram_bytes(), 64 * PAGE as u64);
        let pages: Vec<u64> = l.entries().iter().map(|e| e.0).collect();
        assert_eq!(pages, vec![1, 2, 40]);
        assert_eq!(l.entries()[1].1, PageData::Zero);
        let mut buf = page(1);
        l.read(l.entries()[2].1, &mut buf).unwrap();
        assert_eq!(buf, page(9));
        l.read(l.entries()[1].1, &mut buf).unwrap();
        assert_eq!(buf, page(0));
    }

    #[test]
    fn out_of_order_push_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = LayerWriter::create(&dir.path().join("l"), 64 * PAGE as u64).unwrap();
        w.push(5, &page(1)).unwrap();
        assert!(w.push(5, &page(1)).is_err());
        assert!(w.push(3, &page(0)).is_err());
    }

    #[test]
    fn damaged_files_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("l");
        let mut w = LayerWriter::create(&path, 64 * PAGE as u64).unwrap();
        w.push(3, &page(4)).unwrap();
        w.finish().unwrap();
        let bytes = std::fs::read(&path).unwrap();

        // Truncated: the index no longer fits.
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        assert!(Layer::open(&path).is_err());
        // Never finished: no magic.
        let mut unfinished = bytes.clone();
        unfinished[..8].fill(0);
        std::fs::write(&path, &unfinished).unwrap();
        assert!(Layer::open(&path)
            .unwrap_err()
            .to_string()
            .contains("magic"));
        // A page number beyond the RAM size.
        let mut beyond = bytes.clone();
        let at = beyond.len() - 8;
        beyond[at..].copy_from_slice(&1000u64.to_le_bytes());
        std::fs::write(&path, &beyond).unwrap();
        assert!(Layer::open(&path).is_err());
        // A flipped bit in a data page: it opens, and fails verification.
        let mut flipped = bytes.clone();
        flipped[PAGE + 100] ^= 1;
        std::fs::write(&path, &flipped).unwrap();
        let err = Layer::open(&path).unwrap().verify().unwrap_err();
        assert!(err.to_string().contains("checksum mismatch"), "{err}");
        // Intact again.
        std::fs::write(&path, &bytes).unwrap();
        let l = Layer::open(&path).unwrap();
        assert_eq!(l.entries().len(), 1);
        l.verify().unwrap();
    }

    #[test]
    fn zero_detection() {
        assert!(is_zero(&page(0)));
        let mut p = page(0);
        p[PAGE - 1] = 1;
        assert!(!is_zero(&p));
        p[PAGE - 1] = 0;
        p[3] = 1;
        assert!(!is_zero(&p));
    }
}

//! Guest RAM of snapshots as a root file plus page layers.
//!
//! A snapshot of a booted VM holds its whole RAM as a file (the root). A
//! snapshot of a VM restored from another snapshot holds only a *layer*:
//! the pages that differ from its parent's RAM. A VM restored from a chain
//! maps the root file MAP_PRIVATE (so all VMs of one root share its pages
//! in the host page cache) and gets the chain's pages written into its
//! mapping before it runs.
//!
//! Capturing a layer costs a pagemap scan (8 bytes per guest page) plus
//! reading the pages the VM has made private and the parent chain's pages,
//! and writing the ones that differ: it grows with what the guest changed,
//! not with its RAM size. Long chains are merged by [`Chain::write_merged`].

pub mod guest_ram;
pub mod layer;
pub mod tracker;

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

pub use guest_ram::GuestRam;
use layer::{Layer, LayerWriter, PageData, PAGE};
pub use tracker::WriteTracker;

/// Consecutive pages moved per system call.
const RUN: usize = 256;

/// The RAM of a snapshot: its root file and its layers, root-first.
pub struct Chain {
    root: File,
    /// The page ranges `[start, end)` where the root holds data; the rest
    /// of it is holes (pages its guest never touched), read as zeros
    /// without asking the kernel.
    root_data: Vec<(u64, u64)>,
    layers: Vec<Layer>,
    /// The topmost layer holding each page.
    top: BTreeMap<u64, (usize, PageData)>,
}

impl std::fmt::Debug for Chain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chain")
            .field("layers", &self.layers.len())
            .field("pages", &self.top.len())
            .finish()
    }
}

impl Chain {
    /// Open `root` and `layers` (root-first); each layer must describe RAM
    /// of the root's size.
    pub fn open(root: &Path, layers: &[PathBuf]) -> io::Result<Self> {
        let root_file = File::open(root)?;
        let ram_bytes = root_file.metadata()?.len();
        let mut opened = Vec::with_capacity(layers.len());
        let mut top = BTreeMap::new();
        for (i, path) in layers.iter().enumerate() {
            let layer = Layer::open(path)
                .and_then(|l| crate::checksum::once(l.file(), || l.verify()).map(|()| l))
                .map_err(|e| {
                    io::Error::new(e.kind(), format!("RAM layer {}: {e}", path.display()))
                })?;
            if layer.ram_bytes() != ram_bytes {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "RAM layer {} is for {} bytes of RAM, its root has {ram_bytes}",
                        path.display(),
                        layer.ram_bytes()
                    ),
                ));
            }
            for &(page, data) in layer.entries() {
                top.insert(page, (i, data));
            }
            opened.push(layer);
        }
        let root_data = crate::sparse::data_extents(&root_file)?
            .into_iter()
            .map(|(start, end)| (start / PAGE as u64, end.div_ceil(PAGE as u64)))
            .collect();
        Ok(Self {
            root: root_file,
            root_data,
            layers: opened,
            top,
        })
    }

    /// Pages some layer holds, ascending.
    pub fn pages(&self) -> impl Iterator<Item = u64> + '_ {
        self.top.keys().copied()
    }

    pub fn page_count(&self) -> usize {
        self.top.len()
    }

    /// The page's contents under this chain.
    pub fn read(&self, page: u64, buf: &mut [u8]) -> io::Result<()> {
        self.read_run(&[page], buf)
    }

    /// Where a page's bytes are: (file, byte offset), or `None` for zeros.
    fn locate(&self, page: u64) -> Option<(Option<usize>, u64)> {
        match self.top.get(&page) {
            Some(&(_, PageData::Zero)) => None,
            Some(&(layer, PageData::At(at))) => Some((Some(layer), at)),
            None if self.root_holds(page) => Some((None, page * PAGE as u64)),
            None => None,
        }
    }

    /// Whether the root file has data (not a hole) at `page`.
    fn root_holds(&self, page: u64) -> bool {
        let i = self.root_data.partition_point(|&(start, _)| start <= page);
        i > 0 && page < self.root_data[i - 1].1
    }

    /// Split consecutive `pages` into stretches that lie contiguously in
    /// one file (or are all zeros): `(first index, pages, where)`.
    fn stretches<'p>(
        &'p self,
        pages: &'p [u64],
    ) -> impl Iterator<Item = (usize, usize, Option<(Option<usize>, u64)>)> + 'p {
        let mut i = 0;
        std::iter::from_fn(move || {
            if i >= pages.len() {
                return None;
            }
            let here = self.locate(pages[i]);
            let mut n = 1;
            while i + n < pages.len() {
                let next = self.locate(pages[i + n]);
                let contiguous = match (here, next) {
                    (None, None) => true,
                    (Some((f, at)), Some((g, next_at))) => {
                        f == g && next_at == at + (n * PAGE) as u64
                    }
                    _ => false,
                };
                if !contiguous {
                    break;
                }
                n += 1;
            }
            let stretch = (i, n, here);
            i += n;
            Some(stretch)
        })
    }

    /// Read `n` pages' bytes from where [`Chain::locate`] put them.
    fn read_at(&self, file: Option<usize>, at: u64, out: &mut [u8]) -> io::Result<()> {
        match file {
            None => self.root.read_exact_at(out, at),
            Some(layer) => self.layers[layer].read_at(out, at),
        }
    }

    /// The contents of consecutive `pages` into `buf`, one read per stretch
    /// that lies contiguously in one file.
    pub fn read_run(&self, pages: &[u64], buf: &mut [u8]) -> io::Result<()> {
        for (i, n, here) in self.stretches(pages) {
            let out = &mut buf[i * PAGE..(i + n) * PAGE];
            match here {
                None => out.fill(0),
                Some((file, at)) => self.read_at(file, at, out)?,
            }
        }
        Ok(())
    }

    /// Push onto `changed` `base + i` for each page `pages[i]` (consecutive)
    /// whose bytes in `now` differ from this chain's. A page the chain
    /// holds as zeros (most of a guest's free memory) is checked in place;
    /// the others are read into `scratch` (at least as long as `now`).
    fn differing(
        &self,
        pages: &[u64],
        now: &[u8],
        scratch: &mut [u8],
        base: usize,
        changed: &mut Vec<usize>,
    ) -> io::Result<()> {
        for (i, n, here) in self.stretches(pages) {
            let mine = &now[i * PAGE..(i + n) * PAGE];
            match here {
                None => {
                    for (j, page) in mine.chunks_exact(PAGE).enumerate() {
                        if !layer::is_zero(page) {
                            changed.push(base + i + j);
                        }
                    }
                }
                Some((file, at)) => {
                    let before = &mut scratch[..n * PAGE];
                    self.read_at(file, at, before)?;
                    let pairs = mine.chunks_exact(PAGE).zip(before.chunks_exact(PAGE));
                    for (j, (a, b)) in pairs.enumerate() {
                        if a != b {
                            changed.push(base + i + j);
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Write every layered page into `ram` (a VM that maps the root file
    /// and has not run yet). Returns the pages written.
    pub fn apply(&self, ram: &GuestRam) -> io::Result<u64> {
        let mut buf = vec![0u8; RUN * PAGE];
        let pages: Vec<u64> = self.pages().collect();
        for run in runs(&pages) {
            let bytes = run.len() * PAGE;
            self.read_run(run, &mut buf[..bytes])?;
            ram.write(run[0], &buf[..bytes])?;
        }
        Ok(pages.len() as u64)
    }

    /// Write the chain's pages into `file`, a copy of the root (so it
    /// becomes the whole RAM). Returns the pages written.
    pub fn write_into(&self, file: &File) -> io::Result<u64> {
        let mut buf = vec![0u8; RUN * PAGE];
        let pages: Vec<u64> = self.pages().collect();
        for run in runs(&pages) {
            let bytes = run.len() * PAGE;
            self.read_run(run, &mut buf[..bytes])?;
            file.write_all_at(&buf[..bytes], run[0] * PAGE as u64)?;
        }
        Ok(pages.len() as u64)
    }

    /// Write the chain's pages as one layer over its root (compaction).
    pub fn write_merged(&self, out: &Path) -> io::Result<(u64, u64)> {
        let mut w = LayerWriter::create(out, self.root.metadata()?.len())?;
        let mut buf = vec![0u8; PAGE];
        for page in self.pages() {
            self.read(page, &mut buf)?;
            w.push(page, &buf)?;
        }
        w.finish()
    }
}

/// The pages of a stopped VM that may differ from `parent`: those it has
/// private copies of, and those the parent's layers hold (the VM got them
/// written at restore). Ascending.
pub fn candidates(ram: &GuestRam, parent: &Chain) -> io::Result<Vec<u64>> {
    let mut pages = ram.private_pages()?;
    pages.extend(parent.pages());
    pages.sort_unstable();
    pages.dedup();
    Ok(pages)
}

/// Where a capture reads the VM's current pages from.
pub enum Current<'a> {
    /// The (stopped) VM itself.
    Live(&'a GuestRam),
    /// A copy taken while it was stopped ([`copy_out`]), so the VM could
    /// run on while the layer is written.
    Copied { pages: &'a [u64], data: &'a [u8] },
}

impl<'a> Current<'a> {
    /// The bytes of consecutive `run`: read into `buf` from a live VM, or
    /// the copy's own bytes.
    fn run<'b>(&'b self, run: &[u64], buf: &'b mut [u8]) -> io::Result<&'b [u8]> {
        match self {
            Current::Live(ram) => {
                let out = &mut buf[..run.len() * PAGE];
                ram.read(run[0], out)?;
                Ok(out)
            }
            Current::Copied { .. } => self.copied(run[0], run.len()),
        }
    }

    /// `n` pages of a copy from `page` on.
    fn copied(&self, page: u64, n: usize) -> io::Result<&'a [u8]> {
        let Current::Copied { pages, data } = self else {
            return Err(io::Error::other("not a copy"));
        };
        let i = pages
            .binary_search(&page)
            .map_err(|_| io::Error::new(io::ErrorKind::NotFound, "page missing from the copy"))?;
        data.get(i * PAGE..(i + n) * PAGE)
            .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, "pages missing from the copy"))
    }
}

/// Copy `pages` (ascending) out of the stopped VM, one call per run.
pub fn copy_out(ram: &GuestRam, pages: &[u64]) -> io::Result<Vec<u8>> {
    let mut data = vec![0u8; pages.len() * PAGE];
    let mut at = 0;
    for run in runs(pages) {
        let bytes = run.len() * PAGE;
        ram.read(run[0], &mut data[at..at + bytes])?;
        at += bytes;
    }
    Ok(data)
}

/// Write to `out` a layer of those `candidates` whose `current` contents
/// differ from `parent`. Returns the pages written and how many of them
/// carry data (the others are zero).
///
/// The reading and comparing, which is most of a large capture's time (a
/// capture after a big write reads hundreds of MiB twice), is split over
/// [`WORKERS`] threads, [`CHUNK`] pages each at a time; the layer is
/// written in page order by the calling thread.
pub fn write_layer(
    candidates: &[u64],
    current: &Current<'_>,
    parent: &Chain,
    out: &Path,
) -> io::Result<(u64, u64)> {
    write_layer_in(candidates, current, parent, out, CHUNK)
}

fn write_layer_in(
    candidates: &[u64],
    current: &Current<'_>,
    parent: &Chain,
    out: &Path,
    chunk: usize,
) -> io::Result<(u64, u64)> {
    let ram_bytes = parent.root.metadata()?.len();
    let mut w = LayerWriter::create(out, ram_bytes)?;
    let workers = WORKERS.min(candidates.len().div_ceil(chunk)).max(1);
    let mut bufs: Vec<Buffers> = (0..workers).map(|_| Buffers::new()).collect();
    for round in candidates.chunks(chunk * workers) {
        let parts: Vec<&[u64]> = round.chunks(chunk).collect();
        let changed: Vec<io::Result<Vec<usize>>> = std::thread::scope(|s| {
            let handles: Vec<_> = parts
                .iter()
                .zip(bufs.iter_mut())
                .map(|(part, bufs)| s.spawn(move || changed_pages(part, current, parent, bufs)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(io::Error::other("compare panicked")))
                })
                .collect()
        });
        for ((part, bufs), changed) in parts.iter().zip(&bufs).zip(changed) {
            for (k, i) in changed?.into_iter().enumerate() {
                let bytes = match current {
                    Current::Live(_) => &bufs.kept[k * PAGE..(k + 1) * PAGE],
                    Current::Copied { .. } => current.copied(part[i], 1)?,
                };
                w.push(part[i], bytes)?;
            }
        }
    }
    w.finish()
}

/// Threads comparing pages in [`write_layer`].
const WORKERS: usize = 2;
/// Pages a thread compares before the changed ones are written (16 MiB).
const CHUNK: usize = 16 * RUN;

/// One comparing thread's memory, reused from chunk to chunk.
struct Buffers {
    /// A run of a live VM's pages, compared while still in the CPU's cache.
    run: Vec<u8>,
    /// A run of the parent's pages.
    scratch: Vec<u8>,
    /// The changed pages of a live VM, in order, until they are written.
    kept: Vec<u8>,
}

impl Buffers {
    fn new() -> Self {
        Self {
            run: vec![0u8; RUN * PAGE],
            scratch: vec![0u8; RUN * PAGE],
            kept: Vec::new(),
        }
    }
}

/// The indexes of those `pages` (ascending) whose contents now differ from
/// `parent`'s; a live VM's changed pages are kept in `bufs.kept`, in order.
fn changed_pages(
    pages: &[u64],
    current: &Current<'_>,
    parent: &Chain,
    bufs: &mut Buffers,
) -> io::Result<Vec<usize>> {
    let mut changed = Vec::new();
    bufs.kept.clear();
    let mut first = 0;
    for run in runs(pages) {
        let before = changed.len();
        let mine = current.run(run, &mut bufs.run)?;
        parent.differing(run, mine, &mut bufs.scratch, first, &mut changed)?;
        if let Current::Live(_) = current {
            for &i in &changed[before..] {
                let at = (i - first) * PAGE;
                bufs.kept.extend_from_slice(&mine[at..at + PAGE]);
            }
        }
        first += run.len();
    }
    Ok(changed)
}

/// Split ascending page numbers into runs of consecutive pages, at most
/// [`RUN`] long.
fn runs(pages: &[u64]) -> impl Iterator<Item = &[u64]> {
    let mut rest = pages;
    std::iter::from_fn(move || {
        if rest.is_empty() {
            return None;
        }
        let mut n = 1;
        while n < rest.len() && n < RUN && rest[n] == rest[n - 1] + 1 {
            n += 1;
        }
        let (run, tail) = rest.split_at(n);
        rest = tail;
        Some(run)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_split_at_gaps_and_at_the_limit() {
        let pages: Vec<u64> = [1, 2, 3, 7, 9, 10]
            .into_iter()
            .chain(100..100 + RUN as u64 + 2)
            .collect();
        let got: Vec<Vec<u64>> = runs(&pages).map(|r| r.to_vec()).collect();
        assert_eq!(got[0], vec![1, 2, 3]);
        assert_eq!(got[1], vec![7]);
        assert_eq!(got[2], vec![9, 10]);
        assert_eq!(got[3].len(), RUN);
        assert_eq!(got[4], vec![100 + RUN as u64, 101 + RUN as u64]);
        assert_eq!(runs(&[]).count(), 0);
    }

    fn layer(dir: &Path, name: &str, pages: &[(u64, u8)]) -> PathBuf {
        let path = dir.join(name);
        let mut w = LayerWriter::create(&path, 16 * PAGE as u64).unwrap();
        for &(p, fill) in pages {
            w.push(p, &vec![fill; PAGE]).unwrap();
        }
        w.finish().unwrap();
        path
    }

    /// Pages split over threads and rounds still give a layer of exactly
    /// the changed pages, in order, with their new contents.
    #[test]
    fn a_layer_holds_exactly_the_changed_pages() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let fill = |p: u64| (p % 7) as u8 + 1;
        let mut bytes = Vec::new();
        for p in 0..16u64 {
            bytes.extend(std::iter::repeat_n(fill(p), PAGE));
        }
        std::fs::write(&root, bytes).unwrap();
        let below = layer(dir.path(), "below", &[(4, 40), (5, 0)]);
        let parent = Chain::open(&root, std::slice::from_ref(&below)).unwrap();
        // Now: pages 1, 4 unchanged; 2 changed; 5 (zero below) now data;
        // 9 now zero; 10..16 alternate changed and unchanged.
        let mut now: Vec<(u64, u8)> = vec![(1, fill(1)), (2, 99), (4, 40), (5, 5), (9, 0)];
        now.extend((10..16).map(|p| (p, if p % 2 == 0 { 200 } else { fill(p) })));
        let pages: Vec<u64> = now.iter().map(|&(p, _)| p).collect();
        let data: Vec<u8> = now
            .iter()
            .flat_map(|&(_, f)| std::iter::repeat_n(f, PAGE))
            .collect();
        let current = Current::Copied {
            pages: &pages,
            data: &data,
        };
        for chunk in [1, 3, 4096] {
            let out = dir.path().join(format!("out{chunk}"));
            write_layer_in(&pages, &current, &parent, &out, chunk).unwrap();
            let got = Layer::open(&out).unwrap();
            let listed: Vec<u64> = got.entries().iter().map(|&(p, _)| p).collect();
            assert_eq!(listed, vec![2, 5, 9, 10, 12, 14], "chunk {chunk}");
            let chain = Chain::open(&root, &[below.clone(), out]).unwrap();
            let mut buf = vec![0u8; PAGE];
            for &(p, f) in &now {
                chain.read(p, &mut buf).unwrap();
                assert!(buf.iter().all(|&b| b == f), "page {p} chunk {chunk}");
            }
        }
    }

    #[test]
    fn upper_layers_win_and_merging_keeps_contents() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::write(&root, vec![1u8; 16 * PAGE]).unwrap();
        let a = layer(dir.path(), "a", &[(2, 2), (3, 2), (5, 0)]);
        let b = layer(dir.path(), "b", &[(3, 3), (9, 3)]);
        let chain = Chain::open(&root, &[a.clone(), b.clone()]).unwrap();
        let contents = |c: &Chain| -> Vec<u8> {
            let mut buf = vec![0u8; PAGE];
            (0..16)
                .map(|p| {
                    c.read(p, &mut buf).unwrap();
                    buf[0]
                })
                .collect()
        };
        let want = vec![1, 1, 2, 3, 1, 0, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1];
        assert_eq!(contents(&chain), want);
        assert_eq!(chain.pages().collect::<Vec<_>>(), vec![2, 3, 5, 9]);
        // One read of all pages, across root, layers and a zero page.
        let all: Vec<u64> = (0..16).collect();
        let mut buf = vec![7u8; 16 * PAGE];
        chain.read_run(&all, &mut buf).unwrap();
        let firsts: Vec<u8> = buf.chunks(PAGE).map(|p| p[0]).collect();
        assert_eq!(firsts, want);
        assert!(buf.chunks(PAGE).all(|p| p.iter().all(|&b| b == p[0])));

        let merged = dir.path().join("m");
        assert_eq!(chain.write_merged(&merged).unwrap(), (4, 3));
        let flat = Chain::open(&root, &[merged]).unwrap();
        assert_eq!(contents(&flat), want);

        // A sparse root: its holes read as zeros, next to layered pages.
        let sparse = dir.path().join("sparse");
        let f = File::create(&sparse).unwrap();
        f.set_len(16 * PAGE as u64).unwrap();
        f.write_all_at(&vec![1u8; PAGE], 3 * PAGE as u64).unwrap();
        f.write_all_at(&vec![1u8; PAGE], 9 * PAGE as u64).unwrap();
        drop(f);
        let chain = Chain::open(&sparse, &[a.clone(), b.clone()]).unwrap();
        assert!(chain.root_holds(9) && !chain.root_holds(12) && !chain.root_holds(0));
        let mut buf = vec![7u8; 16 * PAGE];
        chain.read_run(&all, &mut buf).unwrap();
        let firsts: Vec<u8> = buf.chunks(PAGE).map(|p| p[0]).collect();
        assert_eq!(firsts, vec![0, 0, 2, 3, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0]);
        assert!(buf.chunks(PAGE).all(|p| p.iter().all(|&b| b == p[0])));

        let small = dir.path().join("small");
        std::fs::write(&small, vec![1u8; 8 * PAGE]).unwrap();
        assert!(Chain::open(&small, &[a]).is_err(), "size mismatch");
    }

    /// A live VM's pages (here: a private mapping in this process) are
    /// compared run by run: over the root's holes a page counts as changed
    /// only if it is not all zeros, over data only if its bytes differ,
    /// whatever the chunk and thread split.
    #[test]
    fn a_live_layer_checks_pages_over_holes_for_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        let pages = 3 * RUN + 5;
        let len = pages * PAGE;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&root)
            .unwrap();
        f.set_len(len as u64).unwrap();
        // Data in pages [RUN, 2 * RUN); holes elsewhere.
        f.write_all_at(&vec![7u8; RUN * PAGE], (RUN * PAGE) as u64)
            .unwrap();
        let mut map = guest_ram::PrivateMap::new(&f, len);
        let mem = map.bytes();
        let mut want = Vec::new();
        let mut written = Vec::new();
        for p in 0..pages {
            let page = &mut mem[p * PAGE..(p + 1) * PAGE];
            let over_data = (RUN..2 * RUN).contains(&p);
            match p % 4 {
                // Rewritten with what the root has: not changed.
                0 => page.fill(if over_data { 7 } else { 0 }),
                // One byte off at the end of the page: changed.
                1 => page[PAGE - 1] = 1,
                // Zeros: changed over data only.
                2 => {
                    page.fill(0);
                    if over_data {
                        want.push(p as u64);
                    }
                    written.push(p as u64);
                    continue;
                }
                _ => continue,
            }
            if p % 4 == 1 {
                want.push(p as u64);
            }
            written.push(p as u64);
        }
        let me = std::process::id() as i32;
        let ram = GuestRam::find(me, &root, len as u64).unwrap();
        let parent = Chain::open(&root, &[]).unwrap();
        for chunk in [1, 7, RUN, 4096] {
            let out = dir.path().join(format!("live{chunk}"));
            write_layer_in(&written, &Current::Live(&ram), &parent, &out, chunk).unwrap();
            let got = Layer::open(&out).unwrap();
            let listed: Vec<u64> = got.entries().iter().map(|&(p, _)| p).collect();
            assert_eq!(listed, want, "chunk {chunk}");
            let chain = Chain::open(&root, &[out]).unwrap();
            let mut buf = vec![0u8; PAGE];
            for p in 0..pages {
                chain.read(p as u64, &mut buf).unwrap();
                assert_eq!(buf, mem[p * PAGE..(p + 1) * PAGE], "page {p} chunk {chunk}");
            }
        }
    }
}

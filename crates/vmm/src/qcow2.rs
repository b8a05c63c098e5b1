//! The one reader of qcow2 headers.
//!
//! tine reads the headers of images it did not necessarily write (a
//! template's disk pulled from a registry, a capture restored after a
//! crash), to follow backing chains (the jail binds exactly the files a
//! chain reaches) and to learn a disk's size. Every field used is checked
//! against the format's own bounds here, once, so a damaged or hostile
//! header is an error naming the file, never a huge allocation or a read
//! far outside it.
//!
//! A header is also refused when it uses what tine's images never do: an
//! incompatible feature (an external data file names a host path that
//! `qemu-img`, run as root over a sandbox's disk, would then write; a
//! corrupt flag; anything newer) or a header extension other than the
//! backing format and the feature name table, which is all `qemu-img
//! create` writes. A guest that escaped into its QEMU can rewrite its own
//! overlay's header; it cannot make tine follow it anywhere.

use std::os::unix::fs::FileExt;
use std::path::Path;

/// What tine uses of a qcow2 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub version: u32,
    /// Bytes of the virtual disk.
    pub virtual_size: u64,
    /// The backing file's name as written (a path, or a `json:` spec).
    pub backing: Option<Vec<u8>>,
}

#[derive(Debug, thiserror::Error)]
pub enum HeaderError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    /// Not a qcow2 image at all (a raw image, say).
    #[error("{0} is not a qcow2 image")]
    NotQcow2(String),
    #[error("{path} has a damaged qcow2 header: {what}")]
    Damaged { path: String, what: String },
    /// A well-formed header using what tine's images never do.
    #[error("{path} uses qcow2 features tine does not write: {what}")]
    Unsupported { path: String, what: String },
}

/// The fixed part of a version 2 header; version 3 adds more after it.
const V2_LEN: u64 = 72;
/// The format caps a backing file name at 1023 bytes.
const MAX_BACKING_NAME: u32 = 1023;
/// Bytes read from the start of an image: the header and its extensions
/// (`qemu-img` writes them within the first 64 KiB cluster).
const READ_LEN: usize = 64 << 10;
/// Header extensions tine's images have: the backing file's format and the
/// feature name table.
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;
const EXT_FEATURE_NAMES: u32 = 0x6803_f857;
/// The one incompatible feature bit accepted: "dirty" (refcounts to be
/// repaired), which names nothing outside the image.
const INCOMPAT_DIRTY: u64 = 1;

/// Read and check the header of the qcow2 image at `path`.
pub fn read(path: &Path) -> Result<Header, HeaderError> {
    let shown = || path.display().to_string();
    let io = |source| HeaderError::Io {
        path: shown(),
        source,
    };
    let file = std::fs::File::open(path).map_err(io)?;
    let mut start = vec![0u8; READ_LEN];
    let mut got = 0;
    while got < start.len() {
        match file.read_at(&mut start[got..], got as u64).map_err(io)? {
            0 => break,
            n => got += n,
        }
    }
    let fields = parse(&start[..got]).map_err(|e| e.at(shown()))?;
    let backing = match fields.backing {
        None => None,
        Some((offset, len)) => {
            let mut name = vec![0u8; len as usize];
            file.read_exact_at(&mut name, offset).map_err(io)?;
            Some(name)
        }
    };
    Ok(Header {
        version: fields.version,
        virtual_size: fields.virtual_size,
        backing,
    })
}

/// The checked fields of a header's first bytes, before any name is read.
#[derive(Debug, PartialEq, Eq)]
struct Fields {
    version: u32,
    virtual_size: u64,
    /// (offset, length) of the backing file name.
    backing: Option<(u64, u32)>,
}

/// Why a header is refused, before its file's name is known.
#[derive(Debug, PartialEq, Eq)]
enum Refusal {
    NotQcow2,
    Damaged(String),
    Unsupported(String),
}

impl Refusal {
    fn at(self, path: String) -> HeaderError {
        match self {
            Refusal::NotQcow2 => HeaderError::NotQcow2(path),
            Refusal::Damaged(what) => HeaderError::Damaged { path, what },
            Refusal::Unsupported(what) => HeaderError::Unsupported { path, what },
        }
    }
}

/// Check a version 3 header's incompatible features and every header
/// extension (`bytes`: the image's first bytes, header included).
fn check_features(bytes: &[u8], version: u32) -> Result<(), Refusal> {
    let u32_at = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let unsupported = |what: String| Err(Refusal::Unsupported(what));
    let damaged = |what: String| Err(Refusal::Damaged(what));
    let ext_start = if version >= 3 {
        if bytes.len() < 104 {
            return damaged(format!(
                "{} bytes long, shorter than a version 3 header",
                bytes.len()
            ));
        }
        let incompatible = u64::from_be_bytes(bytes[72..80].try_into().expect("8 bytes"));
        if incompatible & !INCOMPAT_DIRTY != 0 {
            return unsupported(format!(
                "incompatible features {incompatible:#x} (an external data file is bit 2, a corrupt image bit 1)"
            ));
        }
        let len = u32_at(100);
        if len < 104 || len % 8 != 0 || len as usize > bytes.len() {
            return damaged(format!("a header length of {len}"));
        }
        len as usize
    } else {
        V2_LEN as usize
    };
    let mut at = ext_start;
    loop {
        if at + 8 > bytes.len() {
            return damaged(format!(
                "header extensions run past its first {} bytes",
                bytes.len()
            ));
        }
        let (kind, len) = (u32_at(at), u32_at(at + 4) as usize);
        if kind == 0 {
            return Ok(());
        }
        if kind != EXT_BACKING_FORMAT && kind != EXT_FEATURE_NAMES {
            return unsupported(format!(
                "header extension {kind:#010x} (0x44415441 is an external data file)"
            ));
        }
        at = match at.checked_add(8 + len.div_ceil(8) * 8) {
            Some(next) if next <= bytes.len() => next,
            _ => return damaged(format!("a header extension of {len} bytes")),
        };
    }
}

fn parse(bytes: &[u8]) -> Result<Fields, Refusal> {
    if bytes.len() < 4 || &bytes[..4] != b"QFI\xfb" {
        return Err(Refusal::NotQcow2);
    }
    if bytes.len() < V2_LEN as usize {
        return Err(Refusal::Damaged(format!(
            "{} bytes long, shorter than a header",
            bytes.len()
        )));
    }
    let u32_at = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    let u64_at = |at: usize| u64::from_be_bytes(bytes[at..at + 8].try_into().expect("8 bytes"));
    let damaged = |what: String| Err(Refusal::Damaged(what));
    let version = u32_at(4);
    if !(2..=3).contains(&version) {
        return damaged(format!("version {version} (tine reads 2 and 3)"));
    }
    let cluster_bits = u32_at(20);
    if !(9..=21).contains(&cluster_bits) {
        return damaged(format!(
            "cluster_bits {cluster_bits} (the format allows 9 to 21)"
        ));
    }
    let (offset, len) = (u64_at(8), u32_at(16));
    let backing = if offset == 0 || len == 0 {
        None
    } else {
        if len > MAX_BACKING_NAME {
            return damaged(format!(
                "a backing file name of {len} bytes (at most {MAX_BACKING_NAME})"
            ));
        }
        // The name sits after the header, inside the first cluster.
        let end = offset.checked_add(u64::from(len));
        if offset < V2_LEN || end.is_none_or(|e| e > 1u64 << cluster_bits) {
            return damaged(format!(
                "a backing file name at bytes {offset}..+{len}, outside the header's cluster"
            ));
        }
        Some((offset, len))
    };
    check_features(bytes, version)?;
    Ok(Fields {
        version,
        virtual_size: u64_at(24),
        backing,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version 3 header with 64 KiB clusters, as `qemu-img` writes one
    /// (header length 104, then the end of the extensions).
    fn header(backing: Option<(u64, u32)>, size: u64) -> Vec<u8> {
        let mut h = vec![0u8; 112];
        h[..4].copy_from_slice(b"QFI\xfb");
        h[4..8].copy_from_slice(&3u32.to_be_bytes());
        h[100..104].copy_from_slice(&104u32.to_be_bytes());
        let (off, len) = backing.unwrap_or((0, 0));
        h[8..16].copy_from_slice(&off.to_be_bytes());
        h[16..20].copy_from_slice(&len.to_be_bytes());
        h[20..24].copy_from_slice(&16u32.to_be_bytes());
        h[24..32].copy_from_slice(&size.to_be_bytes());
        h
    }

    fn set(mut h: Vec<u8>, at: usize, v: &[u8]) -> Vec<u8> {
        h[at..at + v.len()].copy_from_slice(v);
        h
    }

    #[test]
    fn good_headers_give_their_fields() {
        let f = parse(&header(None, 1 << 30)).unwrap();
        assert_eq!((f.version, f.virtual_size, f.backing), (3, 1 << 30, None));
        let f = parse(&header(Some((0x200, 40)), 5)).unwrap();
        assert_eq!(f.backing, Some((0x200, 40)));
        // Version 2, and a name ending exactly at the cluster's end.
        let h = set(header(Some((65536 - 10, 10)), 5), 4, &2u32.to_be_bytes());
        assert_eq!(parse(&h).unwrap().backing, Some((65526, 10)));
    }

    #[test]
    fn malformed_headers_are_refused() {
        let damaged = |h: &[u8]| matches!(parse(h), Err(Refusal::Damaged(_)));
        assert_eq!(parse(b""), Err(Refusal::NotQcow2));
        assert_eq!(parse(b"QFI"), Err(Refusal::NotQcow2));
        assert_eq!(parse(&[0u8; 104]), Err(Refusal::NotQcow2));
        assert!(damaged(&header(None, 1)[..40]), "truncated");
        for v in [0u32, 1, 4, u32::MAX] {
            assert!(
                damaged(&set(header(None, 1), 4, &v.to_be_bytes())),
                "version {v}"
            );
        }
        for bits in [0u32, 8, 22, 63, u32::MAX] {
            assert!(
                damaged(&set(header(None, 1), 20, &bits.to_be_bytes())),
                "bits {bits}"
            );
        }
        for (off, len) in [
            (0x200, 1024),      // longer than the format allows
            (0x200, u32::MAX),  // a 4 GiB allocation if trusted
            (8, 10),            // inside the header
            (65536, 1),         // past the first cluster
            (u64::MAX - 2, 10), // wraps around
            (1 << 40, 16),      // far outside the file
        ] {
            assert!(damaged(&header(Some((off, len)), 1)), "backing {off}+{len}");
        }
    }

    /// `kind`'s extension of `len` bytes after the header, then the end.
    fn with_ext(kind: u32, len: u32) -> Vec<u8> {
        let mut h = header(None, 1);
        h.truncate(104);
        h.extend_from_slice(&kind.to_be_bytes());
        h.extend_from_slice(&len.to_be_bytes());
        h.extend(std::iter::repeat_n(0u8, (len as usize).div_ceil(8) * 8 + 8));
        h
    }

    /// The attack: a guest that took over its QEMU rewrites its overlay's
    /// header to name an external data file (a host path) or set flags
    /// tine never writes, for `qemu-img` run as root to follow.
    #[test]
    fn features_tine_never_writes_are_refused() {
        let unsupported = |h: &[u8]| matches!(parse(h), Err(Refusal::Unsupported(_)));
        for bit in [1u64 << 1, 1 << 2, 1 << 3, 1 << 4, 1 << 63] {
            assert!(
                unsupported(&set(header(None, 1), 72, &bit.to_be_bytes())),
                "incompatible bit {bit:#x}"
            );
        }
        // "dirty" names nothing outside the image.
        parse(&set(header(None, 1), 72, &1u64.to_be_bytes())).unwrap();
        assert!(
            unsupported(&with_ext(0x4441_5441, 16)),
            "external data file"
        );
        assert!(unsupported(&with_ext(0x2385_2875, 16)), "bitmaps");
        assert!(unsupported(&with_ext(0x0537_be77, 16)), "encryption");
        parse(&with_ext(EXT_BACKING_FORMAT, 5)).unwrap();
        parse(&with_ext(EXT_FEATURE_NAMES, 384)).unwrap();
        let damaged = |h: &[u8]| matches!(parse(h), Err(Refusal::Damaged(_)));
        // An extension longer than what is read, a missing end, a header
        // length that is no header's.
        let mut long = with_ext(EXT_FEATURE_NAMES, 8);
        long[108..112].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(damaged(&long));
        assert!(damaged(&header(None, 1)[..104]), "no end of extensions");
        for len in [0u32, 100, 105, 1 << 20] {
            assert!(
                damaged(&set(header(None, 1), 100, &len.to_be_bytes())),
                "length {len}"
            );
        }
    }

    #[test]
    fn reads_a_real_image_and_names_the_file_in_errors() {
        let dir = tempfile::tempdir().unwrap();
        let base = dir.path().join("base.qcow2");
        let over = dir.path().join("over.qcow2");
        let img = |args: &[&str]| {
            let ok = std::process::Command::new("qemu-img")
                .args(args)
                .output()
                .expect("qemu-img")
                .status
                .success();
            assert!(ok, "{args:?}");
        };
        img(&["create", "-q", "-f", "qcow2", base.to_str().unwrap(), "3M"]);
        img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            base.to_str().unwrap(),
            over.to_str().unwrap(),
        ]);
        let h = read(&over).unwrap();
        assert_eq!(h.virtual_size, 3 << 20);
        assert_eq!(
            h.backing.as_deref(),
            Some(base.to_str().unwrap().as_bytes())
        );
        assert_eq!(read(&base).unwrap().backing, None);
        let raw = dir.path().join("raw");
        std::fs::write(&raw, [0u8; 4096]).unwrap();
        assert!(matches!(read(&raw), Err(HeaderError::NotQcow2(p)) if p.ends_with("raw")));
        let bad = dir.path().join("bad.qcow2");
        std::fs::write(&bad, header(Some((0x200, 5000)), 1)).unwrap();
        let e = read(&bad).unwrap_err().to_string();
        assert!(e.contains("bad.qcow2") && e.contains("5000"), "{e}");
        // qemu-img's own external data file: refused, naming the file.
        let ext = dir.path().join("ext.qcow2");
        img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-o",
            &format!("data_file={}", dir.path().join("host-file").display()),
            ext.to_str().unwrap(),
            "1M",
        ]);
        let e = read(&ext).unwrap_err().to_string();
        assert!(
            e.contains("ext.qcow2") && e.contains("does not write"),
            "{e}"
        );
        // A name the header promises but the file does not hold.
        std::fs::write(&bad, header(Some((0x200, 10)), 1)).unwrap();
        assert!(matches!(read(&bad), Err(HeaderError::Io { .. })));
        assert!(matches!(
            read(&dir.path().join("missing")),
            Err(HeaderError::Io { .. })
        ));
    }
}

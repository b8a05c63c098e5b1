//! Applying image layers (tarballs, gzip or not) to a tree, in order, as
//! the OCI image spec says: `.wh.NAME` deletes `NAME` of the layers below,
//! `.wh..wh..opq` empties its directory of what the layers below put there,
//! a file replaces a directory and the other way round; owners, modes
//! (setuid included), xattrs, mtimes, hardlinks, symlinks, device nodes
//! and sparse files are kept.
//!
//! Every path stays inside the tree: `..` is refused, and nothing is
//! created or deleted through a symlink in a parent directory (the `tar`
//! crate checks its own writes the same way).

use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::{Component, Path, PathBuf};

use tar::{Archive, EntryType};

const WHITEOUT: &str = ".wh.";
const OPAQUE: &str = ".wh..wh..opq";

/// What applying one layer did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub entries: u64,
    pub whiteouts: u64,
    pub opaque: u64,
}

fn bad(detail: impl Into<String>) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, detail.into())
}

/// An entry's path as a relative path with normal components only.
fn clean(path: &Path) -> std::io::Result<PathBuf> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => {
                return Err(bad(format!("{} leaves the image root", path.display())))
            }
        }
    }
    Ok(out)
}

/// `root/dir`, if every component of `dir` is a real directory (not a
/// symlink) inside `root`.
fn real_dir(root: &Path, dir: &Path) -> Option<PathBuf> {
    let mut at = root.to_path_buf();
    for c in dir.components() {
        at.push(c);
        match std::fs::symlink_metadata(&at) {
            Ok(m) if m.is_dir() => {}
            _ => return None,
        }
    }
    Some(at)
}

/// `root/rel`, if its parent is a real directory inside `root`.
fn inside(root: &Path, rel: &Path) -> Option<PathBuf> {
    let dir = real_dir(root, rel.parent().unwrap_or(Path::new("")))?;
    Some(dir.join(rel.file_name()?))
}

fn remove_any(path: &Path) -> std::io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

/// Open a layer blob, gunzipping it if it is gzip.
fn open(blob: &Path) -> std::io::Result<Box<dyn Read>> {
    let mut f = File::open(blob)?;
    let mut magic = [0u8; 4];
    let n = f.read(&mut magic)?;
    f.rewind()?;
    match &magic[..n] {
        [0x1f, 0x8b, ..] => Ok(Box::new(flate2::read::GzDecoder::new(BufReader::new(f)))),
        [0x28, 0xb5, 0x2f, 0xfd] => Err(bad("zstd layers are not supported yet")),
        _ => Ok(Box::new(BufReader::new(f))),
    }
}

/// Apply layer `blob` to the tree at `root`.
pub fn apply(blob: &Path, root: &Path) -> std::io::Result<Applied> {
    let mut applied = Applied::default();
    // First the deletions, which are of the layers below only.
    let mut archive = Archive::new(open(blob)?);
    for entry in archive.entries()? {
        let entry = entry?;
        let rel = clean(&entry.path()?)?;
        let Some(name) = rel.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        if name == OPAQUE {
            applied.opaque += 1;
            let Some(dir) = real_dir(root, rel.parent().unwrap_or(Path::new(""))) else {
                continue;
            };
            if let Ok(children) = std::fs::read_dir(&dir) {
                for child in children {
                    remove_any(&child?.path())?;
                }
            }
        } else if let Some(target) = name.strip_prefix(WHITEOUT) {
            applied.whiteouts += 1;
            if let Some(path) = inside(root, &rel.with_file_name(target)) {
                remove_any(&path)?;
            }
        }
    }
    // Then the contents.
    let mut archive = Archive::new(open(blob)?);
    archive.set_preserve_permissions(true);
    archive.set_preserve_ownerships(true);
    archive.set_preserve_mtime(true);
    archive.set_unpack_xattrs(true);
    archive.set_overwrite(true);
    for entry in archive.entries()? {
        let mut entry = entry?;
        let rel = clean(&entry.path()?)?;
        let Some(name) = rel.file_name().and_then(|n| n.to_str()) else {
            continue; // the root itself
        };
        if name.starts_with(WHITEOUT) {
            continue;
        }
        let Some(dst) = inside(root, &rel) else {
            // A parent is a symlink or missing: let the tar crate create
            // missing parents and refuse escapes.
            entry.unpack_in(root)?;
            applied.entries += 1;
            continue;
        };
        let kind = entry.header().entry_type();
        let existing = std::fs::symlink_metadata(&dst).ok();
        match (&existing, kind) {
            (Some(m), EntryType::Directory) if !m.is_dir() => remove_any(&dst)?,
            (Some(m), k) if k != EntryType::Directory && m.is_dir() => remove_any(&dst)?,
            _ => {}
        }
        match kind {
            EntryType::Char | EntryType::Block | EntryType::Fifo => {
                make_node(&entry, &dst)?;
            }
            _ => {
                entry.unpack_in(root)?;
            }
        }
        applied.entries += 1;
    }
    Ok(applied)
}

/// A device node or FIFO, with its owner and mode.
fn make_node<R: Read>(entry: &tar::Entry<R>, dst: &Path) -> std::io::Result<()> {
    use nix::sys::stat::{makedev, mknod, Mode, SFlag};
    let h = entry.header();
    let kind = match h.entry_type() {
        EntryType::Char => SFlag::S_IFCHR,
        EntryType::Block => SFlag::S_IFBLK,
        _ => SFlag::S_IFIFO,
    };
    let dev = makedev(
        u64::from(h.device_major()?.unwrap_or(0)),
        u64::from(h.device_minor()?.unwrap_or(0)),
    );
    let mode = h.mode()? & 0o7777;
    remove_any(dst)?;
    mknod(dst, kind, Mode::from_bits_truncate(mode), dev).map_err(std::io::Error::from)?;
    let uid = u32::try_from(h.uid()?).unwrap_or(0);
    let gid = u32::try_from(h.gid()?).unwrap_or(0);
    nix::unistd::fchownat(
        nix::fcntl::AT_FDCWD,
        dst,
        Some(uid.into()),
        Some(gid.into()),
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .map_err(std::io::Error::from)?;
    // chown clears setuid/setgid bits: set the mode last.
    nix::sys::stat::fchmodat(
        nix::fcntl::AT_FDCWD,
        dst,
        Mode::from_bits_truncate(mode),
        nix::sys::stat::FchmodatFlags::FollowSymlink,
    )
    .map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use super::*;

    fn header(path: &str, kind: EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_path(path).unwrap();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(1234);
        h.set_gid(1234);
        h.set_size(size);
        h.set_cksum();
        h
    }

    fn layer(path: &Path, build: impl FnOnce(&mut tar::Builder<File>)) {
        let mut b = tar::Builder::new(File::create(path).unwrap());
        build(&mut b);
        b.finish().unwrap();
    }

    fn file(b: &mut tar::Builder<File>, path: &str, mode: u32, data: &[u8]) {
        let h = header(path, EntryType::Regular, mode, data.len() as u64);
        b.append(&h, data).unwrap();
    }

    fn dir(b: &mut tar::Builder<File>, path: &str) {
        b.append(&header(path, EntryType::Directory, 0o755, 0), &[][..])
            .unwrap();
    }

    fn link(b: &mut tar::Builder<File>, path: &str, kind: EntryType, target: &str) {
        let mut h = header(path, kind, 0o777, 0);
        h.set_link_name(target).unwrap();
        h.set_cksum();
        b.append(&h, &[][..]).unwrap();
    }

    #[test]
    fn layers_apply_with_whiteouts_links_and_modes() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let (l1, l2) = (tmp.path().join("l1.tar"), tmp.path().join("l2.tar"));
        layer(&l1, |b| {
            dir(b, "a");
            file(b, "a/gone", 0o644, b"x");
            file(b, "a/kept", 0o644, b"kept");
            dir(b, "opq");
            file(b, "opq/old", 0o644, b"old");
            file(b, "b", 0o644, b"bee");
            dir(b, "becomes-file");
            link(b, "escape", EntryType::Symlink, "/");
        });
        layer(&l2, |b| {
            file(b, "a/.wh.gone", 0o644, b"");
            file(b, "opq/.wh..wh..opq", 0o644, b"");
            file(b, "opq/new", 0o644, b"new");
            link(b, "hard", EntryType::Link, "b");
            link(b, "soft", EntryType::Symlink, "b");
            file(b, "suid", 0o4755, b"#!/bin/sh\n");
            file(b, "becomes-file", 0o600, b"now a file");
            // A whiteout through a symlink must not delete on the host.
            file(b, "escape/.wh.etc", 0o644, b"");
        });
        apply(&l1, &root).unwrap();
        let applied = apply(&l2, &root).unwrap();
        assert_eq!((applied.whiteouts, applied.opaque), (2, 1), "{applied:?}");
        assert!(!root.join("a/gone").exists());
        assert_eq!(std::fs::read(root.join("a/kept")).unwrap(), b"kept");
        assert!(
            !root.join("opq/old").exists(),
            "opaque dir hides the lower layer"
        );
        assert_eq!(std::fs::read(root.join("opq/new")).unwrap(), b"new");
        let (b, hard) = (
            std::fs::metadata(root.join("b")).unwrap(),
            std::fs::metadata(root.join("hard")).unwrap(),
        );
        assert_eq!(b.ino(), hard.ino(), "a hardlink, not a copy");
        assert_eq!(
            std::fs::read_link(root.join("soft")).unwrap(),
            Path::new("b")
        );
        let suid = std::fs::metadata(root.join("suid")).unwrap();
        assert_eq!(suid.permissions().mode() & 0o7777, 0o4755);
        assert_eq!((suid.uid(), suid.gid()), (1234, 1234));
        assert!(std::fs::metadata(root.join("becomes-file"))
            .unwrap()
            .is_file());
        assert!(Path::new("/etc").exists());
    }

    #[test]
    fn paths_leaving_the_root_are_refused() {
        assert!(clean(Path::new("../x")).is_err());
        assert!(clean(Path::new("a/../../x")).is_err());
        assert_eq!(clean(Path::new("/./a/b")).unwrap(), Path::new("a/b"));
    }
}

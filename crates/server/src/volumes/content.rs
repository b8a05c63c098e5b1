//! The files of one volume, as the content API reads and writes them.
//!
//! Every path is resolved from the volume's `data/` directory by
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`: the kernel refuses
//! any `..` or symlink (written by a sandbox that mounts the volume, say)
//! that would lead out of it. The last component of a path is then acted
//! on through its parent's descriptor without following it (`fstatat`,
//! `unlinkat`, `fchownat` with `AT_SYMLINK_NOFOLLOW`), so a symlink is
//! removed or described, never what it points to. All calls block: run
//! them off the async runtime.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{FileStat, Mode, SFlag};
use nix::unistd::{Gid, Uid};
use serde::Serialize;

use super::{Result, VolumeError, Volumes};
use crate::db::VolumeRow;

/// The owner of what the content API makes when the caller names none:
/// the guest's `user`, as E2B's sandboxes run commands.
pub const DEFAULT_UID: u32 = 1000;
pub const DEFAULT_GID: u32 = 1000;

/// One file, directory or symlink, in the shape the SDKs read
/// (`VolumeEntryStat`).
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
    pub size: u64,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub atime: String,
    pub mtime: String,
    pub ctime: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
}

/// What a new file or directory gets.
#[derive(Debug, Clone, Copy, Default)]
pub struct Owner {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub mode: Option<u32>,
}

/// A path inside a volume: its components, none of them `..`.
#[derive(Debug, Clone)]
pub struct VolPath {
    parts: Vec<String>,
}

impl VolPath {
    pub fn parse(path: &str) -> Result<Self> {
        let bad = |detail: &str| VolumeError::BadPath {
            path: path.to_string(),
            detail: detail.to_string(),
        };
        if path.contains('\0') {
            return Err(bad("contains a NUL byte"));
        }
        let mut parts = Vec::new();
        for c in path.split('/') {
            match c {
                "" | "." => {}
                ".." => return Err(bad("'..' is not allowed")),
                c if c.len() > 255 => return Err(bad("a name is longer than 255 bytes")),
                c => parts.push(c.to_string()),
            }
        }
        if path.len() > 4096 {
            return Err(bad("longer than 4096 bytes"));
        }
        Ok(Self { parts })
    }

    fn rel(&self) -> String {
        match self.parts.is_empty() {
            true => ".".into(),
            false => self.parts.join("/"),
        }
    }

    pub fn display(&self) -> String {
        format!("/{}", self.parts.join("/"))
    }

    fn child(&self, name: &str) -> Self {
        let mut parts = self.parts.clone();
        parts.push(name.to_string());
        Self { parts }
    }
}

pub struct Content<'a> {
    vols: &'a Volumes,
    id: String,
    max_bytes: u64,
    data: OwnedFd,
    tmp: PathBuf,
}

fn rfc3339(secs: i64, nanos: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp_nanos(secs as i128 * 1_000_000_000 + nanos as i128)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| "1970-01-01T00:00:00Z".into())
}

impl<'a> Content<'a> {
    pub(super) fn open(vols: &'a Volumes, row: &VolumeRow) -> Result<Self> {
        let root = vols.root(&row.id);
        let data = nix::fcntl::open(
            &root.join("data"),
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| VolumeError::Io {
            context: format!("opening volume {}", row.id),
            source: e.into(),
        })?;
        Ok(Self {
            vols,
            id: row.id.clone(),
            max_bytes: row.max_bytes,
            data,
            tmp: root.join("tmp"),
        })
    }

    fn fail(&self, path: &VolPath, e: Errno, what: &str) -> VolumeError {
        let p = path.display();
        match e {
            Errno::ENOENT => VolumeError::PathNotFound(p),
            Errno::EXDEV | Errno::ELOOP => VolumeError::BadPath {
                path: p,
                detail: "leads out of the volume".into(),
            },
            Errno::ENOTDIR => VolumeError::BadPath {
                path: p,
                detail: "a part of it is not a directory".into(),
            },
            Errno::EISDIR => VolumeError::BadPath {
                path: p,
                detail: "is a directory".into(),
            },
            Errno::EEXIST => VolumeError::PathExists(p),
            Errno::ENOTEMPTY => VolumeError::BadPath {
                path: p,
                detail: "is a directory that is not empty".into(),
            },
            Errno::ENOSPC | Errno::EDQUOT => VolumeError::Full {
                id: self.id.clone(),
                detail: "the host's disk is full".into(),
            },
            e => VolumeError::Io {
                context: format!("{what} {p} in volume {}", self.id),
                source: e.into(),
            },
        }
    }

    /// `path` opened from the volume's top with `flags`, never leaving it.
    fn open_beneath(&self, path: &VolPath, flags: OFlag, mode: Mode) -> Result<OwnedFd> {
        // openat2 takes nothing but O_DIRECTORY, O_NOFOLLOW and O_CLOEXEC
        // with O_PATH (EINVAL), and a mode only with O_CREAT.
        let extra = match flags.contains(OFlag::O_PATH) {
            true => OFlag::O_CLOEXEC,
            false => OFlag::O_CLOEXEC | OFlag::O_NOCTTY,
        };
        let how = OpenHow::new()
            .flags(flags | extra)
            .mode(mode)
            .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        nix::fcntl::openat2(self.data.as_fd(), path.rel().as_str(), how)
            .map_err(|e| self.fail(path, e, "opening"))
    }

    /// The directory that holds `path`, and `path`'s last name.
    fn parent(&self, path: &VolPath) -> Result<(OwnedFd, String)> {
        let Some((name, up)) = path.parts.split_last() else {
            return Err(VolumeError::BadPath {
                path: "/".into(),
                detail: "is the volume's top directory".into(),
            });
        };
        let up = VolPath { parts: up.to_vec() };
        let dir = self.open_beneath(&up, OFlag::O_PATH | OFlag::O_DIRECTORY, Mode::empty())?;
        Ok((dir, name.clone()))
    }

    fn entry(&self, dir: &OwnedFd, name: &str, path: &VolPath) -> Result<Entry> {
        let st = nix::sys::stat::fstatat(dir.as_fd(), name, AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| self.fail(path, e, "reading"))?;
        Ok(self.describe(dir, name, path, &st))
    }

    fn describe(&self, dir: &OwnedFd, name: &str, path: &VolPath, st: &FileStat) -> Entry {
        let kind = match SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) {
            SFlag::S_IFREG => "file",
            SFlag::S_IFDIR => "directory",
            SFlag::S_IFLNK => "symlink",
            _ => "unknown",
        };
        let target = (kind == "symlink")
            .then(|| nix::fcntl::readlinkat(dir.as_fd(), name).ok())
            .flatten()
            .map(|t| t.to_string_lossy().into_owned());
        Entry {
            name: path.parts.last().cloned().unwrap_or_default(),
            kind,
            path: path.display(),
            size: st.st_size as u64,
            mode: st.st_mode & 0o7777,
            uid: st.st_uid,
            gid: st.st_gid,
            atime: rfc3339(st.st_atime, st.st_atime_nsec),
            mtime: rfc3339(st.st_mtime, st.st_mtime_nsec),
            ctime: rfc3339(st.st_ctime, st.st_ctime_nsec),
            target,
        }
    }

    /// What `path` is (a symlink is described, not followed).
    pub fn stat(&self, path: &VolPath) -> Result<Entry> {
        if path.parts.is_empty() {
            return self.entry(&self.data, ".", path);
        }
        let (dir, name) = self.parent(path)?;
        self.entry(&dir, &name, path)
    }

    /// File `path` opened for reading (symlinks inside the volume followed).
    pub fn read(&self, path: &VolPath) -> Result<std::fs::File> {
        let fd = self.open_beneath(path, OFlag::O_RDONLY, Mode::empty())?;
        let st = nix::sys::stat::fstat(&fd).map_err(|e| self.fail(path, e, "reading"))?;
        if SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) != SFlag::S_IFREG {
            return Err(VolumeError::BadPath {
                path: path.display(),
                detail: "is not a file".into(),
            });
        }
        Ok(std::fs::File::from(fd))
    }

    /// The entries under directory `path`, `depth` levels down (1: its
    /// own), directories' contents after them.
    pub fn list(&self, path: &VolPath, depth: u32) -> Result<Vec<Entry>> {
        let mut out = Vec::new();
        self.list_into(path, depth.max(1), &mut out)?;
        Ok(out)
    }

    fn list_into(&self, path: &VolPath, depth: u32, out: &mut Vec<Entry>) -> Result<()> {
        let fd = self.open_beneath(path, OFlag::O_RDONLY | OFlag::O_DIRECTORY, Mode::empty())?;
        let keep = fd.try_clone().map_err(|e| VolumeError::Io {
            context: "duplicating a descriptor".into(),
            source: e,
        })?;
        let mut dir = nix::dir::Dir::from_fd(fd).map_err(|e| self.fail(path, e, "listing"))?;
        let mut names: Vec<String> = dir
            .iter()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n != "." && n != "..")
            .collect();
        names.sort();
        for name in names {
            let child = path.child(&name);
            let Ok(st) =
                nix::sys::stat::fstatat(keep.as_fd(), name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
            else {
                continue; // removed meanwhile
            };
            let e = self.describe(&keep, &name, &child, &st);
            let is_dir = e.kind == "directory";
            out.push(e);
            if is_dir && depth > 1 {
                self.list_into(&child, depth - 1, out)?;
            }
        }
        Ok(())
    }

    fn own(&self, dir: &OwnedFd, name: &str, path: &VolPath, owner: Owner) -> Result<()> {
        nix::unistd::fchownat(
            dir.as_fd(),
            name,
            Some(Uid::from_raw(owner.uid.unwrap_or(DEFAULT_UID))),
            Some(Gid::from_raw(owner.gid.unwrap_or(DEFAULT_GID))),
            AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| self.fail(path, e, "changing the owner of"))?;
        if let Some(mode) = owner.mode {
            self.chmod(dir, name, path, mode)?;
        }
        Ok(())
    }

    /// chmod that never follows a symlink in the last place.
    fn chmod(&self, dir: &OwnedFd, name: &str, path: &VolPath, mode: u32) -> Result<()> {
        let how = OpenHow::new()
            .flags(OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        let fd = nix::fcntl::openat2(dir.as_fd(), name, how)
            .map_err(|e| self.fail(path, e, "opening"))?;
        let st = nix::sys::stat::fstat(&fd).map_err(|e| self.fail(path, e, "reading"))?;
        if SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFLNK {
            return Err(VolumeError::BadPath {
                path: path.display(),
                detail: "is a symlink, which has no mode of its own".into(),
            });
        }
        // An O_PATH descriptor takes chmod through its /proc link (the
        // kernel's own way; it is the file just opened, not a path lookup).
        let proc = format!("/proc/self/fd/{}", fd.as_raw_fd());
        nix::sys::stat::fchmodat(
            nix::fcntl::AT_FDCWD,
            proc.as_str(),
            Mode::from_bits_truncate(mode & 0o7777),
            nix::sys::stat::FchmodatFlags::FollowSymlink,
        )
        .map_err(|e| self.fail(path, e, "changing the mode of"))
    }

    /// Make directory `path`; with `parents`, the directories above it too.
    pub fn mkdir(&self, path: &VolPath, owner: Owner, parents: bool) -> Result<Entry> {
        if parents {
            for i in 1..path.parts.len() {
                let up = VolPath {
                    parts: path.parts[..i].to_vec(),
                };
                match self.mkdir_one(
                    &up,
                    Owner {
                        mode: None,
                        ..owner
                    },
                ) {
                    Ok(()) | Err(VolumeError::PathExists(_)) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        self.mkdir_one(path, owner)?;
        self.stat(path)
    }

    fn mkdir_one(&self, path: &VolPath, owner: Owner) -> Result<()> {
        let (dir, name) = self.parent(path)?;
        nix::sys::stat::mkdirat(dir.as_fd(), name.as_str(), Mode::from_bits_truncate(0o755))
            .map_err(|e| self.fail(path, e, "making"))?;
        self.own(&dir, &name, path, owner)
    }

    /// Change the owner and mode of `path`.
    pub fn update(&self, path: &VolPath, owner: Owner) -> Result<Entry> {
        let (dir, name) = match path.parts.is_empty() {
            true => (
                self.data.try_clone().map_err(|e| VolumeError::Io {
                    context: "duplicating a descriptor".into(),
                    source: e,
                })?,
                ".".to_string(),
            ),
            false => self.parent(path)?,
        };
        if owner.uid.is_some() || owner.gid.is_some() {
            nix::unistd::fchownat(
                dir.as_fd(),
                name.as_str(),
                owner.uid.map(Uid::from_raw),
                owner.gid.map(Gid::from_raw),
                AtFlags::AT_SYMLINK_NOFOLLOW,
            )
            .map_err(|e| self.fail(path, e, "changing the owner of"))?;
        }
        if let Some(mode) = owner.mode {
            self.chmod(&dir, &name, path, mode)?;
        }
        self.entry(&dir, &name, path)
    }

    /// Remove `path`: a file or symlink, or a directory with everything
    /// in it (symlinks in it are removed, not followed).
    pub fn remove(&self, path: &VolPath) -> Result<()> {
        let (dir, name) = self.parent(path)?;
        let st = nix::sys::stat::fstatat(dir.as_fd(), name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
            .map_err(|e| self.fail(path, e, "reading"))?;
        if SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFDIR {
            // std's remove_dir_all works through descriptors and never
            // follows a symlink; the /proc link names the parent itself.
            let at = PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd())).join(&name);
            std::fs::remove_dir_all(&at).map_err(|e| VolumeError::Io {
                context: format!("removing {} in volume {}", path.display(), self.id),
                source: e,
            })?;
        } else {
            nix::unistd::unlinkat(
                dir.as_fd(),
                name.as_str(),
                nix::unistd::UnlinkatFlags::NoRemoveDir,
            )
            .map_err(|e| self.fail(path, e, "removing"))?;
        }
        self.vols.forget_usage(&self.id);
        Ok(())
    }

    /// Put the uploaded file `upload` ([`Volumes::upload_path`]) at `path` (replacing a file there),
    /// making the directories above it; refused whole when the volume
    /// would hold more than its limit.
    pub fn commit(&self, upload: &Path, path: &VolPath, owner: Owner) -> Result<Entry> {
        let result = self.commit_inner(upload, path, owner);
        if result.is_err() {
            let _ = std::fs::remove_file(upload);
        }
        result
    }

    fn commit_inner(&self, upload: &Path, path: &VolPath, owner: Owner) -> Result<Entry> {
        if path.parts.is_empty() {
            return Err(VolumeError::BadPath {
                path: "/".into(),
                detail: "is the volume's top directory".into(),
            });
        }
        if path.parts.len() > 1 {
            let up = VolPath {
                parts: path.parts[..path.parts.len() - 1].to_vec(),
            };
            match self.mkdir(
                &up,
                Owner {
                    mode: None,
                    ..owner
                },
                true,
            ) {
                Ok(_) | Err(VolumeError::PathExists(_)) => {}
                Err(e) => return Err(e),
            }
        }
        let (dir, name) = self.parent(path)?;
        let size = std::fs::metadata(upload)
            .map_err(|source| VolumeError::Io {
                context: format!("reading {}", upload.display()),
                source,
            })?
            .len();
        let _one = self.vols.writes.lock().unwrap_or_else(|p| p.into_inner());
        let old =
            match nix::sys::stat::fstatat(dir.as_fd(), name.as_str(), AtFlags::AT_SYMLINK_NOFOLLOW)
            {
                Ok(st)
                    if SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
                        == SFlag::S_IFDIR =>
                {
                    return Err(VolumeError::BadPath {
                        path: path.display(),
                        detail: "is a directory".into(),
                    })
                }
                Ok(st) => st.st_size as u64,
                Err(Errno::ENOENT) => 0,
                Err(e) => return Err(self.fail(path, e, "reading")),
            };
        let used = self.vols.usage(&self.id)?;
        if used.saturating_sub(old) + size > self.max_bytes {
            return Err(VolumeError::Full {
                id: self.id.clone(),
                detail: format!(
                    "{size} bytes at {} would take it past its {} bytes ({used} used)",
                    path.display(),
                    self.max_bytes
                ),
            });
        }
        let tmp_dir = nix::fcntl::open(
            &self.tmp,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| self.fail(path, e, "opening the uploads of"))?;
        let up_name = upload
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        self.own(
            &tmp_dir,
            &up_name,
            path,
            Owner {
                mode: Some(owner.mode.unwrap_or(0o644)),
                ..owner
            },
        )?;
        nix::fcntl::renameat(
            tmp_dir.as_fd(),
            up_name.as_str(),
            dir.as_fd(),
            name.as_str(),
        )
        .map_err(|e| self.fail(path, e, "writing"))?;
        self.vols.add_usage(&self.id, size as i64 - old as i64);
        self.entry(&dir, &name, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_split_and_dot_dot_is_refused() {
        let p = VolPath::parse("/a//b/./c/").unwrap();
        assert_eq!(p.display(), "/a/b/c");
        assert_eq!(p.rel(), "a/b/c");
        assert_eq!(VolPath::parse("/").unwrap().rel(), ".");
        assert_eq!(VolPath::parse("").unwrap().display(), "/");
        assert_eq!(VolPath::parse("x y+z").unwrap().display(), "/x y+z");
        for bad in ["..", "/a/../b", "a/..", "nul\0byte"] {
            assert!(
                matches!(VolPath::parse(bad), Err(VolumeError::BadPath { .. })),
                "{bad:?}"
            );
        }
        assert!(VolPath::parse(&"n".repeat(256)).is_err());
        assert!(VolPath::parse(&"a/".repeat(2100)).is_err());
    }
}

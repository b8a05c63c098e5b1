//! One volume as an NFSv3 file system ([`nfsserve::vfs::NFSFileSystem`]).
//!
//! A file's NFS id is its host inode number; a file handle is the
//! volume's epoch (from its creation time) and that id, so handles stay
//! valid across server restarts, pauses, restores and forks (a guest
//! restored from memory presents the handles it had). An id is turned
//! back into a path through a map filled by lookups and listings; a path
//! is checked against the id on every use (`lstat`'s inode), and a miss
//! (a server restart, a rename by the content API) walks the volume once
//! to refill the map, else the handle is stale.
//!
//! Every path is opened from the volume's `data/` with `openat2`
//! (`RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS`) and names are acted on
//! through their directory's descriptor without following them, exactly
//! as the content API does: a symlink a guest writes is kept as a symlink
//! (its guest follows it, in its own file system), never followed here.
//!
//! The RPC calls carry the caller's uid but nfsserve does not pass it on:
//! what a guest makes through a mount belongs to `user` (1000:1000), as
//! what the content API makes; `chown` in the guest changes it. Writes
//! count against the volume's limit: past it the guest sees `ENOSPC`.

use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use nfsserve::nfs::{fattr3, fileid3, filename3, nfs_fh3, nfspath3, nfsstat3, sattr3, set_size3};
use nfsserve::vfs::{NFSFileSystem, ReadDirResult, VFSCapabilities};
use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sys::stat::{FileStat, Mode, SFlag};

use super::super::Volumes;

pub(super) type NfsResult<T> = Result<T, nfsstat3>;

/// Volume `id`'s files, served to the guests that mount it. Cheap to
/// clone; every sandbox mounting the volume shares one map of ids.
#[derive(Clone)]
pub struct VolumeFs {
    inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) vols: Arc<Volumes>,
    pub(super) id: String,
    pub(super) max_bytes: u64,
    pub(super) data: OwnedFd,
    pub(super) root: u64,
    pub(super) epoch: u64,
    /// Inode -> path below `data/` ("" for the top).
    pub(super) paths: Mutex<HashMap<u64, String>>,
    /// When the last walk of the volume started (one at a time).
    pub(super) walked: Mutex<Option<Instant>>,
}

pub(super) fn errno(e: Errno) -> nfsstat3 {
    match e {
        Errno::ENOENT => nfsstat3::NFS3ERR_NOENT,
        Errno::EEXIST => nfsstat3::NFS3ERR_EXIST,
        Errno::ENOTDIR => nfsstat3::NFS3ERR_NOTDIR,
        Errno::EISDIR => nfsstat3::NFS3ERR_ISDIR,
        Errno::ENOTEMPTY => nfsstat3::NFS3ERR_NOTEMPTY,
        Errno::ENOSPC | Errno::EDQUOT => nfsstat3::NFS3ERR_NOSPC,
        Errno::ENAMETOOLONG => nfsstat3::NFS3ERR_NAMETOOLONG,
        Errno::EINVAL => nfsstat3::NFS3ERR_INVAL,
        Errno::EPERM => nfsstat3::NFS3ERR_PERM,
        // Out of the volume (EXDEV), or a symlink where a file was meant.
        Errno::EACCES | Errno::EXDEV | Errno::ELOOP => nfsstat3::NFS3ERR_ACCES,
        Errno::EFBIG => nfsstat3::NFS3ERR_FBIG,
        _ => nfsstat3::NFS3ERR_IO,
    }
}

/// A single name inside a directory: no `/`, no NUL, not `.` or `..`.
pub(super) fn name_of(f: &[u8]) -> NfsResult<String> {
    let s = std::str::from_utf8(f).map_err(|_| nfsstat3::NFS3ERR_INVAL)?;
    if s.len() > 255 {
        return Err(nfsstat3::NFS3ERR_NAMETOOLONG);
    }
    if s.is_empty() || s == "." || s == ".." || s.contains(['/', '\0']) {
        return Err(nfsstat3::NFS3ERR_INVAL);
    }
    Ok(s.to_string())
}

pub(super) fn join(dir: &str, name: &str) -> String {
    match dir.is_empty() {
        true => name.to_string(),
        false => format!("{dir}/{name}"),
    }
}

pub(super) fn kind(st: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits())
}

impl VolumeFs {
    /// Serve volume `id` (its files in `data`).
    pub(super) fn open(
        vols: Arc<Volumes>,
        id: &str,
        max_bytes: u64,
        epoch: u64,
    ) -> std::io::Result<Self> {
        let data = nix::fcntl::open(
            &vols.root(id).join("data"),
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        let root = nix::sys::stat::fstat(data.as_fd())?.st_ino;
        Ok(Self {
            inner: Arc::new(Inner {
                vols,
                id: id.to_string(),
                max_bytes,
                data,
                root,
                epoch,
                paths: Mutex::new(HashMap::new()),
                walked: Mutex::new(None),
            }),
        })
    }

    pub(super) fn downgrade(&self) -> std::sync::Weak<Inner> {
        Arc::downgrade(&self.inner)
    }

    pub(super) fn upgrade(weak: &std::sync::Weak<Inner>) -> Option<Self> {
        weak.upgrade().map(|inner| Self { inner })
    }

    /// Run `f`, which moves file contents (up to 1 MiB), off the async
    /// runtime.
    async fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce(&Inner) -> NfsResult<T> + Send + 'static,
    ) -> NfsResult<T> {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .unwrap_or(Err(nfsstat3::NFS3ERR_SERVERFAULT))
    }

    /// Run `f`, a few metadata system calls on a local file system (a
    /// handful of microseconds) that take no lock but the path map's, where
    /// it is: a hand-off to a blocking thread would cost more than the
    /// calls. (A walk after a miss hands the worker's tasks off.)
    async fn quick<T>(&self, f: impl FnOnce(&Inner) -> NfsResult<T>) -> NfsResult<T> {
        f(&self.inner)
    }
}

#[async_trait::async_trait]
impl NFSFileSystem for VolumeFs {
    fn capabilities(&self) -> VFSCapabilities {
        VFSCapabilities::ReadWrite
    }

    fn root_dir(&self) -> fileid3 {
        self.inner.root
    }

    async fn lookup(&self, dirid: fileid3, filename: &filename3) -> NfsResult<fileid3> {
        self.quick(|fs| fs.lookup(dirid, &filename.0)).await
    }

    async fn getattr(&self, id: fileid3) -> NfsResult<fattr3> {
        self.quick(|fs| fs.getattr(id)).await
    }

    async fn setattr(&self, id: fileid3, setattr: sattr3) -> NfsResult<fattr3> {
        // A size change waits for the volume's write lock: off the runtime.
        match setattr.size {
            set_size3::Void => self.quick(|fs| fs.setattr(id, setattr)).await,
            set_size3::size(_) => self.blocking(move |fs| fs.setattr(id, setattr)).await,
        }
    }

    async fn read(&self, id: fileid3, offset: u64, count: u32) -> NfsResult<(Vec<u8>, bool)> {
        self.blocking(move |fs| fs.read(id, offset, count)).await
    }

    async fn write(&self, id: fileid3, offset: u64, data: &[u8]) -> NfsResult<fattr3> {
        let data = data.to_vec();
        self.blocking(move |fs| fs.write(id, offset, &data)).await
    }

    async fn create(
        &self,
        dirid: fileid3,
        filename: &filename3,
        attr: sattr3,
    ) -> NfsResult<(fileid3, fattr3)> {
        let name = filename.0.clone();
        match attr.size {
            set_size3::Void => self.quick(|fs| fs.create(dirid, &name, attr)).await,
            set_size3::size(_) => self.blocking(move |fs| fs.create(dirid, &name, attr)).await,
        }
    }

    async fn create_exclusive(&self, dirid: fileid3, filename: &filename3) -> NfsResult<fileid3> {
        self.quick(|fs| fs.create_file(dirid, &filename.0, 0o644))
            .await
    }

    async fn mkdir(&self, dirid: fileid3, dirname: &filename3) -> NfsResult<(fileid3, fattr3)> {
        let name = dirname.0.clone();
        self.quick(|fs| {
            fs.make(dirid, &name, |dir, name| {
                nix::sys::stat::mkdirat(dir.as_fd(), name, Mode::from_bits_truncate(0o755))
            })
        })
        .await
    }

    async fn remove(&self, dirid: fileid3, filename: &filename3) -> NfsResult<()> {
        let name = filename.0.clone();
        self.blocking(move |fs| fs.remove(dirid, &name)).await
    }

    async fn rename(
        &self,
        from_dirid: fileid3,
        from_filename: &filename3,
        to_dirid: fileid3,
        to_filename: &filename3,
    ) -> NfsResult<()> {
        let (f, t) = (from_filename.0.clone(), to_filename.0.clone());
        self.blocking(move |fs| fs.rename(from_dirid, &f, to_dirid, &t))
            .await
    }

    async fn readdir(
        &self,
        dirid: fileid3,
        start_after: fileid3,
        max_entries: usize,
    ) -> NfsResult<ReadDirResult> {
        self.blocking(move |fs| fs.readdir(dirid, start_after, max_entries))
            .await
    }

    async fn symlink(
        &self,
        dirid: fileid3,
        linkname: &filename3,
        symlink: &nfspath3,
        _attr: &sattr3,
    ) -> NfsResult<(fileid3, fattr3)> {
        let name = linkname.0.clone();
        let target = symlink.0.clone();
        self.quick(|fs| {
            let target = <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(&target);
            fs.make(dirid, &name, |dir, name| {
                nix::unistd::symlinkat(target, dir.as_fd(), name)
            })
        })
        .await
    }

    async fn readlink(&self, id: fileid3) -> NfsResult<nfspath3> {
        self.quick(|fs| fs.readlink(id)).await
    }

    fn id_to_fh(&self, id: fileid3) -> nfs_fh3 {
        let mut data = Vec::with_capacity(16);
        data.extend_from_slice(&self.inner.epoch.to_le_bytes());
        data.extend_from_slice(&id.to_le_bytes());
        nfs_fh3 { data }
    }

    fn fh_to_id(&self, fh: &nfs_fh3) -> NfsResult<fileid3> {
        let (Some(epoch), Some(id)) = (fh.data.get(0..8), fh.data.get(8..16)) else {
            return Err(nfsstat3::NFS3ERR_BADHANDLE);
        };
        if fh.data.len() != 16 {
            return Err(nfsstat3::NFS3ERR_BADHANDLE);
        }
        let epoch = u64::from_le_bytes(epoch.try_into().expect("8 bytes"));
        match epoch == self.inner.epoch {
            true => Ok(u64::from_le_bytes(id.try_into().expect("8 bytes"))),
            false => Err(nfsstat3::NFS3ERR_STALE),
        }
    }

    fn serverid(&self) -> nfsserve::nfs::cookieverf3 {
        self.inner.epoch.to_le_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::content::{DEFAULT_GID, DEFAULT_UID};
    use super::*;

    fn volume(max: u64) -> (tempfile::TempDir, VolumeFs) {
        let dir = tempfile::tempdir().unwrap();
        let db = Arc::new(crate::db::Db::open(&dir.path().join("db.sqlite")).unwrap());
        let vols = Arc::new(Volumes::with_limit(db, dir.path(), max));
        let row = vols.create("team", "v").unwrap();
        let fs = VolumeFs::open(vols, &row.id, max, 7).unwrap();
        (dir, fs)
    }

    #[test]
    fn files_directories_renames_and_handles_after_a_restart() {
        let (_dir, fs) = volume(1 << 20);
        let v = &fs.inner;
        let root = v.root;
        let (dir, _) = v
            .make(root, b"d", |d, n| {
                nix::sys::stat::mkdirat(d.as_fd(), n, Mode::from_bits_truncate(0o755))
            })
            .unwrap();
        let (file, attr) = v.create(root, b"a.txt", sattr3::default()).unwrap();
        assert_eq!(
            (attr.uid, attr.gid, attr.mode),
            (DEFAULT_UID, DEFAULT_GID, 0o644)
        );
        assert_eq!(v.write(file, 0, b"hello").unwrap().size, 5);
        assert_eq!(v.read(file, 0, 100).unwrap(), (b"hello".to_vec(), true));
        assert_eq!(v.read(file, 1, 2).unwrap(), (b"el".to_vec(), false));
        v.rename(root, b"a.txt", dir, b"b.txt").unwrap();
        assert_eq!(v.lookup(dir, b"b.txt").unwrap(), file);
        assert_eq!(v.lookup(dir, b"..").unwrap(), root);
        assert_eq!(v.lookup(root, b"..").unwrap(), root);
        let names: Vec<_> = v
            .readdir(dir, 0, 10)
            .unwrap()
            .entries
            .into_iter()
            .map(|e| e.name.0)
            .collect();
        assert_eq!(names, vec![b"b.txt".to_vec()]);
        // A new server knows no paths: the handle is found by a walk.
        let again = VolumeFs::open(v.vols.clone(), &v.id, v.max_bytes, 7).unwrap();
        assert_eq!(again.inner.read(file, 0, 5).unwrap().0, b"hello");
        // Handles of another epoch (another volume) are stale.
        let fh = fs.id_to_fh(file);
        assert_eq!(fs.fh_to_id(&fh).unwrap(), file);
        let other = VolumeFs::open(v.vols.clone(), &v.id, v.max_bytes, 8).unwrap();
        assert!(matches!(other.fh_to_id(&fh), Err(nfsstat3::NFS3ERR_STALE)));
        // Removed: its handle is stale.
        v.remove(dir, b"b.txt").unwrap();
        assert!(matches!(v.getattr(file), Err(nfsstat3::NFS3ERR_STALE)));
    }

    #[test]
    fn names_symlinks_and_the_limit() {
        let (_dir, fs) = volume(1000);
        let v = &fs.inner;
        let root = v.root;
        for bad in [&b".."[..], b"a/b", b"", b"."] {
            assert!(v.create(root, bad, sattr3::default()).is_err(), "{bad:?}");
        }
        // A symlink is kept as written and never followed here.
        let (link, _) = v
            .make(root, b"out", |d, n| {
                nix::unistd::symlinkat("/etc", d.as_fd(), n)
            })
            .unwrap();
        assert_eq!(v.readlink(link).unwrap().0, b"/etc");
        assert!(v.lookup(link, b"passwd").is_err());
        assert!(v.read(link, 0, 10).is_err());
        // Past the volume's limit: no space, and nothing written.
        let (f, _) = v.create(root, b"f", sattr3::default()).unwrap();
        v.write(f, 0, &[1; 900]).unwrap();
        assert!(matches!(
            v.write(f, 900, &[1; 200]),
            Err(nfsstat3::NFS3ERR_NOSPC)
        ));
        assert_eq!(v.getattr(f).unwrap().size, 900);
        v.remove(root, b"f").unwrap();
        let (g, _) = v.create(root, b"g", sattr3::default()).unwrap();
        assert_eq!(v.write(g, 0, &[2; 950]).unwrap().size, 950);
        // Renaming a file onto itself frees nothing; nor does an empty
        // write far out take room.
        v.rename(root, b"g", root, b"g").unwrap();
        assert!(matches!(
            v.write(g, 950, &[3; 100]),
            Err(nfsstat3::NFS3ERR_NOSPC)
        ));
        v.write(g, 999, &[]).unwrap();
        assert_eq!(v.write(g, 950, &[3; 50]).unwrap().size, 1000);
        // Truncating frees, growing by setattr counts.
        let size = |n| sattr3 {
            size: set_size3::size(n),
            ..sattr3::default()
        };
        assert_eq!(v.setattr(g, size(100)).unwrap().size, 100);
        assert!(matches!(
            v.setattr(g, size(2000)),
            Err(nfsstat3::NFS3ERR_NOSPC)
        ));
        assert_eq!(v.setattr(g, size(1000)).unwrap().size, 1000);
    }

    #[test]
    fn a_listing_goes_on_after_its_cookie_is_removed() {
        let (_dir, fs) = volume(1 << 20);
        let v = &fs.inner;
        for i in 0..10 {
            v.create(v.root, format!("f{i}").as_bytes(), sattr3::default())
                .unwrap();
        }
        let first = v.readdir(v.root, 0, 4).unwrap();
        assert_eq!(first.entries.len(), 4);
        assert!(!first.end);
        // As `rm -rf` does: remove what was listed, then go on.
        for e in &first.entries {
            v.remove(v.root, &e.name.0).unwrap();
        }
        let cookie = first.entries.last().unwrap().fileid;
        let rest = v.readdir(v.root, cookie, 100).unwrap();
        assert_eq!(rest.entries.len(), 6);
        assert!(rest.end);
    }
}

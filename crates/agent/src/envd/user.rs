//! Users: who a call runs as, that user's login environment, path
//! resolution, and the ownership of what file calls create.
//!
//! As in E2B's envd, file operations run as the agent (root in a guest):
//! the files API is the operator's hand, not the sandbox user's. The user
//! only resolves `~` and relative paths and owns the files and directories
//! a call creates. Processes still run as the user (`process/spawn.rs`).

use std::ffi::CString;
use std::path::{Path, PathBuf};

use nix::unistd::{Gid, Uid};

use super::error::{EnvdError, Result};

/// PATH of every process started through the API (that of Debian's login).
pub const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
    pub home: PathBuf,
    pub shell: PathBuf,
}

impl User {
    /// Looks a user up in the passwd database; `unauthenticated` when there
    /// is no such user (what envd answers for a bad `Authorization`).
    pub fn lookup(name: &str) -> Result<User> {
        let invalid = || EnvdError::Unauthenticated(format!("invalid username: '{name}'"));
        if name.is_empty() || name.contains('\0') {
            return Err(invalid());
        }
        let pw = nix::unistd::User::from_name(name)
            .map_err(|e| EnvdError::Internal(format!("looking up user '{name}': {e}")))?
            .ok_or_else(invalid)?;
        let groups = CString::new(name)
            .ok()
            .and_then(|c| nix::unistd::getgrouplist(&c, pw.gid).ok())
            .map(|g| g.into_iter().map(Gid::as_raw).collect())
            .unwrap_or_else(|| vec![pw.gid.as_raw()]);
        Ok(User {
            name: pw.name,
            uid: pw.uid.as_raw(),
            gid: pw.gid.as_raw(),
            groups,
            home: pw.dir,
            shell: pw.shell,
        })
    }

    /// The user this agent runs as (used when no user is asked for and the
    /// default user does not exist, e.g. a developer's host).
    pub fn current() -> Result<User> {
        let uid = Uid::effective();
        let pw = nix::unistd::User::from_uid(uid)
            .ok()
            .flatten()
            .ok_or_else(|| EnvdError::Internal(format!("uid {uid} has no passwd entry")))?;
        User::lookup(&pw.name)
    }

    /// The login environment (`HOME`, `USER`, `LOGNAME`, `SHELL`, `PATH`).
    pub fn login_env(&self) -> Vec<(String, String)> {
        let shell = if self.shell.as_os_str().is_empty() {
            "/bin/sh".into()
        } else {
            self.shell.display().to_string()
        };
        vec![
            ("HOME".into(), self.home.display().to_string()),
            ("USER".into(), self.name.clone()),
            ("LOGNAME".into(), self.name.clone()),
            ("SHELL".into(), shell),
            ("PATH".into(), DEFAULT_PATH.into()),
        ]
    }

    /// Resolves a request path: `~` and `~/x` against home, relative paths
    /// against `base` (the default workdir) or home.
    pub fn resolve(&self, path: &str, base: Option<&Path>) -> Result<PathBuf> {
        if path.contains('\0') {
            return Err(EnvdError::InvalidArgument(
                "path contains a NUL byte".into(),
            ));
        }
        let p = if path == "~" {
            self.home.clone()
        } else if let Some(rest) = path.strip_prefix("~/") {
            self.home.join(rest)
        } else if Path::new(path).is_absolute() {
            PathBuf::from(path)
        } else {
            base.unwrap_or(&self.home).join(path)
        };
        Ok(normalize(&p))
    }

    /// The (uid, gid) that owns what a call of this user creates.
    pub fn owner(&self) -> (u32, u32) {
        (self.uid, self.gid)
    }
}

/// Lexically removes `.` and `..` (like Go's `filepath.Clean`).
pub fn normalize(p: &Path) -> PathBuf {
    use std::path::Component;
    let mut out = PathBuf::from("/");
    for c in p.components() {
        match c {
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
            Component::ParentDir => {
                out.pop();
            }
            Component::Normal(n) => out.push(n),
        }
    }
    out
}

/// Runs a file operation on a blocking thread, as the agent itself (root
/// in a guest). envd serves every file call as root: the caller's user only
/// expands `~` and relative paths and owns what a call creates
/// ([`ensure_dirs`], [`chown`]).
pub async fn blocking<T, F>(f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T> + Send + 'static,
{
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| EnvdError::Internal(format!("file operation failed: {e}")))?
}

/// Creates `dir` and each missing parent, handing every directory it
/// creates to `owner` (those that exist are left as they are), as envd's
/// `EnsureDirs`. A component that exists and is not a directory is an
/// invalid argument naming it.
pub fn ensure_dirs(dir: &Path, owner: (u32, u32)) -> Result<()> {
    let mut at = PathBuf::from("/");
    for c in dir.components() {
        let std::path::Component::Normal(name) = c else {
            continue;
        };
        at.push(name);
        match std::fs::metadata(&at) {
            Ok(m) if m.is_dir() => continue,
            Ok(_) => {
                return Err(EnvdError::InvalidArgument(format!(
                    "path is a file: {}",
                    at.display()
                )))
            }
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(EnvdError::io(&e, at.display()))
            }
            Err(_) => {}
        }
        match std::fs::create_dir(&at) {
            Ok(()) => chown(&at, owner)?,
            // Made by someone else meanwhile: theirs, as it is.
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && at.is_dir() => {}
            Err(e) => return Err(EnvdError::io(&e, at.display())),
        }
    }
    Ok(())
}

/// Gives `path` (not what a symlink points at) to `owner`. A no-op for the
/// agent's own uid when it is not root (a developer's host).
pub fn chown(path: &Path, (uid, gid): (u32, u32)) -> Result<()> {
    if !Uid::effective().is_root() {
        return Ok(());
    }
    std::os::unix::fs::lchown(path, Some(uid), Some(gid))
        .map_err(|e| EnvdError::io(&e, format!("changing the owner of {}", path.display())))
}

/// Name of a uid (numeric string when it has no passwd entry).
pub fn user_name(uid: u32) -> String {
    nix::unistd::User::from_uid(Uid::from_raw(uid))
        .ok()
        .flatten()
        .map(|u| u.name)
        .unwrap_or_else(|| uid.to_string())
}

/// Name of a gid (numeric string when it has no group entry).
pub fn group_name(gid: u32) -> String {
    nix::unistd::Group::from_gid(Gid::from_raw(gid))
        .ok()
        .flatten()
        .map(|g| g.name)
        .unwrap_or_else(|| gid.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_is_found_and_bogus_is_unauthenticated() {
        let root = User::lookup("root").unwrap();
        assert_eq!(root.uid, 0);
        assert_eq!(root.gid, 0);
        assert!(root.login_env().contains(&("USER".into(), "root".into())));
        let err = User::lookup("no-such-user-tine").unwrap_err();
        assert_eq!(err.code(), tine_connect::Code::Unauthenticated);
        assert!(User::lookup("").is_err());
    }

    #[test]
    fn paths_resolve_like_envd() {
        let u = User {
            name: "u".into(),
            uid: 1,
            gid: 1,
            groups: vec![1],
            home: "/home/u".into(),
            shell: "/bin/sh".into(),
        };
        assert_eq!(u.resolve("~", None).unwrap(), PathBuf::from("/home/u"));
        assert_eq!(
            u.resolve("~/a/../b", None).unwrap(),
            PathBuf::from("/home/u/b")
        );
        assert_eq!(u.resolve("x", None).unwrap(), PathBuf::from("/home/u/x"));
        assert_eq!(
            u.resolve("x", Some(Path::new("/w"))).unwrap(),
            PathBuf::from("/w/x")
        );
        assert_eq!(
            u.resolve("/../etc/./passwd", None).unwrap(),
            PathBuf::from("/etc/passwd")
        );
        assert!(u.resolve("a\0b", None).is_err());
    }

    #[test]
    fn ensure_dirs_hands_new_directories_to_the_owner_only() {
        if !Uid::effective().is_root() {
            return;
        }
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let deep = dir.path().join("a/b/c");
        ensure_dirs(&deep, (65534, 65534)).unwrap();
        for d in ["a", "a/b", "a/b/c"] {
            let m = std::fs::metadata(dir.path().join(d)).unwrap();
            assert_eq!((m.uid(), m.gid()), (65534, 65534), "{d}");
        }
        // What existed before keeps its owner.
        assert_eq!(std::fs::metadata(dir.path()).unwrap().uid(), 0);
        ensure_dirs(&deep, (1, 1)).unwrap();
        assert_eq!(std::fs::metadata(&deep).unwrap().uid(), 65534);
        // A file in the way is named.
        std::fs::write(dir.path().join("f"), b"x").unwrap();
        let err = ensure_dirs(&dir.path().join("f/g"), (1, 1)).unwrap_err();
        assert_eq!(err.code(), tine_connect::Code::InvalidArgument);
        assert!(err.to_string().contains("path is a file"), "{err}");
    }
}

//! Users: who a call runs as, that user's login environment, and running
//! file operations with that user's credentials.
//!
//! File operations switch only the calling thread's filesystem credentials
//! (`setfsuid`/`setfsgid` and the raw `setgroups` syscall are per-thread on
//! Linux), always on a blocking-pool thread and always restored by a guard,
//! so the kernel does the permission checks and new files belong to the
//! user without a `chown`.

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

    /// Whether switching to this user is needed and possible.
    fn must_switch(&self) -> bool {
        Uid::effective().is_root() && self.uid != 0
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

/// Runs `f` on a blocking thread with `user`'s filesystem credentials.
pub async fn run_as<T, F>(user: &User, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T> + Send + 'static,
{
    let user = user.clone();
    tokio::task::spawn_blocking(move || {
        let _guard = FsCreds::switch(&user)?;
        f()
    })
    .await
    .map_err(|e| EnvdError::Internal(format!("file operation failed: {e}")))?
}

/// Holds the thread's switched filesystem credentials; restores root's on drop.
struct FsCreds {
    switched: bool,
}

impl FsCreds {
    fn switch(user: &User) -> Result<FsCreds> {
        if !user.must_switch() {
            return Ok(FsCreds { switched: false });
        }
        let groups: Vec<libc::gid_t> = user.groups.clone();
        // SAFETY: raw setgroups/setfsgid/setfsuid only change this thread's
        // credentials (the kernel keeps credentials per task; the libc
        // wrappers would broadcast to all threads, which we must avoid).
        // `groups` outlives the call.
        unsafe {
            if libc::syscall(libc::SYS_setgroups, groups.len(), groups.as_ptr()) != 0 {
                return Err(EnvdError::Internal(format!(
                    "setgroups: {}",
                    std::io::Error::last_os_error()
                )));
            }
            libc::syscall(libc::SYS_setfsgid, user.gid);
            libc::syscall(libc::SYS_setfsuid, user.uid);
        }
        Ok(FsCreds { switched: true })
    }
}

impl Drop for FsCreds {
    fn drop(&mut self) {
        if self.switched {
            let root_groups: [libc::gid_t; 1] = [0];
            // SAFETY: as in `switch`, per-thread credential syscalls; this
            // restores root's filesystem ids and a plain group list.
            unsafe {
                libc::syscall(libc::SYS_setfsuid, 0);
                libc::syscall(libc::SYS_setfsgid, 0);
                libc::syscall(libc::SYS_setgroups, 1usize, root_groups.as_ptr());
            }
        }
    }
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

    #[tokio::test]
    async fn run_as_switches_file_credentials() {
        if !Uid::effective().is_root() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o777),
        )
        .unwrap();
        let nobody = User {
            name: "nobody".into(),
            uid: 65534,
            gid: 65534,
            groups: vec![65534],
            home: "/".into(),
            shell: "/bin/sh".into(),
        };
        let p = dir.path().join("f");
        let p2 = p.clone();
        run_as(&nobody, move || {
            std::fs::write(&p2, b"x").map_err(|e| EnvdError::io(&e, "f"))
        })
        .await
        .unwrap();
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(&p).unwrap().uid(), 65534);
        // A root-only file is out of reach while switched, and reachable after.
        let secret = dir.path().join("secret");
        std::fs::write(&secret, b"s").unwrap();
        std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .unwrap();
        let s2 = secret.clone();
        let err = run_as(&nobody, move || {
            std::fs::read(&s2).map_err(|e| EnvdError::io(&e, "secret"))
        })
        .await
        .unwrap_err();
        assert_eq!(err.code(), tine_connect::Code::PermissionDenied);
        let root = User::lookup("root").unwrap();
        run_as(&root, move || {
            std::fs::read(&secret).map_err(|e| EnvdError::io(&e, "secret"))
        })
        .await
        .unwrap();
    }
}

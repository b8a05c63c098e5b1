//! The jail's mount plan: from what one QEMU [`Needs`], the directories,
//! links, binds and device nodes of its root, as [`Step`]s that
//! [`Prepared::enter`](super::Prepared::enter) takes in the child.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use crate::config::Accel;
use crate::error::{IoContext, Result};

use super::{chain, jail_err, Needs};

/// One step of building the jail, with host paths already prefixed by the
/// jail root.
#[derive(Debug)]
pub(super) enum Step {
    Mkdir(CString),
    Touch(CString),
    Bind {
        src: CString,
        dst: CString,
        rw: bool,
    },
    Symlink {
        target: CString,
        link: CString,
    },
    Mknod {
        path: CString,
        mode: libc::mode_t,
        dev: libc::dev_t,
        owned: bool,
    },
}

pub(super) fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("paths have no NUL byte")
}

/// `path` under the jail root `root`.
fn inside(root: &Path, path: &Path) -> PathBuf {
    root.join(path.strip_prefix("/").unwrap_or(path))
}

/// Plan the mounts for `needs`: what is bound where, which directories
/// hold the mount points. Pure apart from reading the disk chain and
/// whether the host's `/lib` & co. are links.
pub(super) fn plan(root: &Path, data_dir: &Path, needs: &Needs, accel: Accel) -> Result<Vec<Step>> {
    // (host path, read-write?)
    let mut binds: Vec<(PathBuf, bool)> = vec![(PathBuf::from("/usr"), false)];
    if Path::new("/etc/ld.so.cache").exists() {
        binds.push(("/etc/ld.so.cache".into(), false));
    }
    binds.extend(needs.rw_dirs.iter().map(|d| (d.clone(), true)));
    binds.extend(needs.ro_files.iter().map(|f| (f.clone(), false)));
    if let Some(b) = &needs.binary {
        binds.push((b.clone(), false));
    }
    if let Some(disk) = &needs.disk {
        let below = chain::below_within(disk, &needs.chain_allowed).map_err(|e| {
            jail_err(
                &disk.display().to_string(),
                format!("{e}; refusing to start"),
            )
        })?;
        for b in below {
            match b {
                chain::Backing::File(p) => binds.push((p, false)),
                chain::Backing::Socket(p) => {
                    // Connecting needs write access to the socket; only
                    // jails that bind it can reach it (the data directory
                    // is 0700).
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o666))
                        .ctx(|| format!("chmod {}", p.display()))?;
                    binds.push((p, false));
                }
            }
        }
    }
    let mut steps = Vec::new();
    let mut dirs: Vec<PathBuf> = Vec::new();
    let add_parents = |p: &Path, dirs: &mut Vec<PathBuf>| {
        for a in p.ancestors().skip(1) {
            if a != Path::new("/") && !dirs.iter().any(|d| d == a) {
                dirs.push(a.to_path_buf());
            }
        }
    };
    // Top-level links or directories the loader and the binary expect.
    let mut links = Vec::new();
    for top in ["/lib", "/lib64", "/bin", "/sbin"] {
        let p = Path::new(top);
        match std::fs::read_link(p) {
            Ok(target) => links.push((target, p.to_path_buf())),
            Err(_) if p.is_dir() => binds.push((p.to_path_buf(), false)),
            Err(_) => {}
        }
    }
    // Resolve, drop duplicates and anything inside another bound directory.
    let mut resolved: Vec<(PathBuf, bool, bool)> = Vec::new(); // (path, rw, is_dir)
    for (p, rw) in binds {
        let p = std::fs::canonicalize(&p).ctx(|| format!("jail: {} is missing", p.display()))?;
        let is_dir = p.is_dir();
        if let Some(existing) = resolved.iter_mut().find(|(q, _, _)| *q == p) {
            existing.1 |= rw;
        } else {
            resolved.push((p, rw, is_dir));
        }
    }
    let covered = |p: &Path, all: &[(PathBuf, bool, bool)]| {
        all.iter()
            .any(|(q, _, dir)| *dir && q != p && p.starts_with(q))
    };
    let kept: Vec<(PathBuf, bool, bool)> = resolved
        .iter()
        .filter(|(p, _, _)| !covered(p, &resolved))
        .cloned()
        .collect();
    for (p, rw, is_dir) in &kept {
        add_parents(p, &mut dirs);
        // Files tine wrote before jails (or QEMU wrote 0640) must be
        // readable by the jail's uid; the data directory itself is 0700.
        if !rw && !is_dir && p.starts_with(data_dir) {
            use std::os::unix::fs::PermissionsExt;
            if let Ok(m) = std::fs::metadata(p) {
                let mode = m.permissions().mode();
                if m.is_file() && mode & 0o004 == 0 {
                    std::fs::set_permissions(
                        p,
                        std::fs::Permissions::from_mode((mode | 0o444) & 0o7777),
                    )
                    .ctx(|| format!("chmod {}", p.display()))?;
                }
            }
        }
    }
    add_parents(Path::new("/dev/null"), &mut dirs);
    dirs.sort_by_key(|d| d.components().count());
    for d in &dirs {
        steps.push(Step::Mkdir(cstr(&inside(root, d))));
    }
    for (target, link) in links {
        steps.push(Step::Symlink {
            target: cstr(&target),
            link: cstr(&inside(root, &link)),
        });
    }
    for (p, rw, is_dir) in kept {
        let dst = cstr(&inside(root, &p));
        steps.push(if is_dir {
            Step::Mkdir(dst.clone())
        } else {
            Step::Touch(dst.clone())
        });
        steps.push(Step::Bind {
            src: cstr(&p),
            dst,
            rw,
        });
    }
    let chr = libc::S_IFCHR;
    for (name, major, minor) in [
        ("null", 1, 3),
        ("zero", 1, 5),
        ("random", 1, 8),
        ("urandom", 1, 9),
    ] {
        steps.push(Step::Mknod {
            path: cstr(&inside(root, &Path::new("/dev").join(name))),
            mode: chr | 0o666,
            dev: libc::makedev(major, minor),
            owned: false,
        });
    }
    if accel == Accel::Kvm {
        steps.push(Step::Mknod {
            path: cstr(&inside(root, Path::new("/dev/kvm"))),
            mode: chr | 0o600,
            dev: libc::makedev(10, 232),
            owned: true,
        });
    }
    Ok(steps)
}

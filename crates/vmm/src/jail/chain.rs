//! The files a qcow2 overlay's backing chain reaches, read from the
//! images' own headers, so a jail can hold exactly them.

use std::path::{Path, PathBuf};

/// How far a chain may go before it is called a loop.
const MAX_DEPTH: usize = 256;

/// One file under an overlay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backing {
    /// An image file (qcow2 or raw).
    File(PathBuf),
    /// The unix socket of an NBD export.
    Socket(PathBuf),
}

/// The backing file named in a qcow2 header ([`crate::qcow2`]), or `None`
/// (no backing, or not a qcow2 file: a raw image ends a chain). A damaged
/// header, or one with features tine never writes, is an error.
fn backing_name(path: &Path) -> std::io::Result<Option<String>> {
    use crate::qcow2::HeaderError;
    match crate::qcow2::read(path) {
        Ok(h) => Ok(h
            .backing
            .map(|name| String::from_utf8_lossy(&name).into_owned())),
        Err(HeaderError::NotQcow2(_)) => Ok(None),
        Err(HeaderError::Io { source, .. }) => Err(source),
        Err(e @ (HeaderError::Damaged { .. } | HeaderError::Unsupported { .. })) => Err(
            std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()),
        ),
    }
}

/// The NBD socket in a `json:` backing spec, if it is one as
/// `RootDisk::backing` writes it (an NBD export over a unix socket and
/// nothing else: a spec could name any host file).
fn socket_of(spec: &str) -> Option<PathBuf> {
    let v: serde_json::Value = serde_json::from_str(spec.strip_prefix("json:")?).ok()?;
    let v = v.as_object()?;
    let known = [
        "file.driver",
        "file.server.type",
        "file.server.path",
        "file.export",
        "file.reconnect-delay",
    ];
    if v.keys().any(|k| !known.contains(&k.as_str()))
        || v.get("file.driver")?.as_str() != Some("nbd")
        || v.get("file.server.type")?.as_str() != Some("unix")
    {
        return None;
    }
    v.get("file.server.path")?.as_str().map(PathBuf::from)
}

/// Every file below `overlay` (not the overlay itself), top first.
pub fn below(overlay: &Path) -> std::io::Result<Vec<Backing>> {
    let mut out = Vec::new();
    let mut current = overlay.to_path_buf();
    for _ in 0..MAX_DEPTH {
        let Some(name) = backing_name(&current)? else {
            return Ok(out);
        };
        if name.starts_with("json:") {
            let socket = socket_of(&name).ok_or_else(|| {
                std::io::Error::other(format!(
                    "{} names a backing spec tine does not write: {name:?}",
                    current.display()
                ))
            })?;
            out.push(Backing::Socket(socket));
            return Ok(out);
        }
        let next = match Path::new(&name) {
            p if p.is_absolute() => p.to_path_buf(),
            p => current.parent().unwrap_or(Path::new("/")).join(p),
        };
        out.push(Backing::File(next.clone()));
        current = next;
    }
    Err(std::io::Error::other(format!(
        "the backing chain of {} is deeper than {MAX_DEPTH}",
        overlay.display()
    )))
}

/// [`below`], refusing a chain that names any file but `allowed` ones
/// (compared after resolving links): the chain comes from qcow2 headers,
/// which the VMs that wrote those overlays could have forged.
pub fn below_within(overlay: &Path, allowed: &[PathBuf]) -> std::io::Result<Vec<Backing>> {
    let allowed: Vec<PathBuf> = allowed
        .iter()
        .filter_map(|p| std::fs::canonicalize(p).ok())
        .collect();
    let below = below(overlay)?;
    for b in &below {
        let (Backing::File(p) | Backing::Socket(p)) = b;
        let real = std::fs::canonicalize(p).ok();
        if !real.as_ref().is_some_and(|r| allowed.contains(r)) {
            return Err(std::io::Error::other(format!(
                "the backing chain of {} names {}, which is not one of the disks it was made over",
                overlay.display(),
                p.display()
            )));
        }
    }
    Ok(below)
}

/// The files the backing chain of an overlay made over the snapshot disks
/// `disk_over` (nearest first) may name: those disks and the base image
/// `rootfs`. The chain is read from qcow2 headers, which a VM
/// that was captured could have written; nothing else is let into its
/// jail or read by tine. For an overlay over a snapshot from before tine
/// recorded that (`None`), any snapshot's disk.
pub(crate) fn allowed_disks(
    paths: &crate::Paths,
    disk_over: Option<&[PathBuf]>,
    rootfs: &crate::RootDisk,
) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = match disk_over {
        Some(disks) => disks.to_vec(),
        None => std::fs::read_dir(paths.snapshots_dir())
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path().join("disk.qcow2"))
            .collect(),
    };
    out.push(match rootfs {
        crate::RootDisk::File(p) => p.clone(),
        crate::RootDisk::Nbd { socket, .. } => socket.clone(),
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qemu_img(args: &[&str]) -> bool {
        std::process::Command::new("qemu-img")
            .args(args)
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false)
    }

    #[test]
    fn follows_files_and_stops_at_an_nbd_socket() {
        let d = tempfile::tempdir().unwrap();
        let p = |n: &str| d.path().join(n).display().to_string();
        std::fs::write(d.path().join("base.raw"), vec![0u8; 1 << 20]).unwrap();
        if !qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "raw",
            "-b",
            &p("base.raw"),
            &p("a.qcow2"),
        ]) {
            eprintln!("qemu-img is missing: skipped");
            return;
        }
        assert!(qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-F",
            "qcow2",
            "-b",
            &p("a.qcow2"),
            &p("b.qcow2")
        ]));
        assert_eq!(
            below(&d.path().join("b.qcow2")).unwrap(),
            vec![
                Backing::File(d.path().join("a.qcow2")),
                Backing::File(d.path().join("base.raw"))
            ]
        );
        let spec = r#"json:{"file.driver":"nbd","file.server.type":"unix","file.server.path":"/run/x.sock","file.export":"e"}"#;
        assert!(qemu_img(&[
            "create",
            "-q",
            "-f",
            "qcow2",
            "-u",
            "-F",
            "raw",
            "-b",
            spec,
            &p("n.qcow2"),
            "1M"
        ]));
        assert_eq!(
            below(&d.path().join("n.qcow2")).unwrap(),
            vec![Backing::Socket("/run/x.sock".into())]
        );
        assert_eq!(below(&d.path().join("base.raw")).unwrap(), vec![]);
    }

    #[test]
    fn a_chain_naming_other_files_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let p = |n: &str| d.path().join(n).display().to_string();
        std::fs::write(d.path().join("base.raw"), vec![0u8; 1 << 20]).unwrap();
        std::fs::write(d.path().join("secret"), vec![7u8; 1 << 20]).unwrap();
        let create = |backing: &str, fmt: &str, out: &str| {
            qemu_img(&[
                "create",
                "-q",
                "-f",
                "qcow2",
                "-u",
                "-F",
                fmt,
                "-b",
                backing,
                &p(out),
                "1M",
            ])
        };
        if !create(&p("base.raw"), "raw", "good.qcow2") {
            eprintln!("qemu-img is missing: skipped");
            return;
        }
        let allowed = [d.path().join("base.raw")];
        let good = d.path().join("good.qcow2");
        assert_eq!(
            below_within(&good, &allowed).unwrap(),
            vec![Backing::File(d.path().join("base.raw"))]
        );
        // A header forged to name another file, directly or through a link
        // whose name looks allowed, or through a json: spec.
        assert!(create(&p("secret"), "raw", "forged.qcow2"));
        let e = below_within(&d.path().join("forged.qcow2"), &allowed).unwrap_err();
        assert!(e.to_string().contains("secret"), "{e}");
        std::os::unix::fs::symlink(d.path().join("secret"), d.path().join("base.link")).unwrap();
        assert!(create(&p("base.link"), "raw", "linked.qcow2"));
        assert!(below_within(&d.path().join("linked.qcow2"), &allowed).is_err());
        let spec = format!(
            r#"json:{{"file.driver":"file","file.filename":"{}"}}"#,
            p("secret")
        );
        assert!(create(&spec, "raw", "spec.qcow2"));
        let e = below(&d.path().join("spec.qcow2")).unwrap_err();
        assert!(e.to_string().contains("does not write"), "{e}");
    }
}

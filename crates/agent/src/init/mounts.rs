//! Filesystem setup of PID 1: pseudo filesystems and the switch into the
//! rootfs. The initramfs is a ramfs, where `pivot_root` is not allowed, so we
//! do what `switch_root(8)` does: move the mounts over, then `chroot`.

use std::os::fd::AsRawFd;
use std::path::Path;

use anyhow::Context;
use nix::mount::{mount, MsFlags};

fn mount_fs(
    src: &str,
    target: &str,
    fstype: &str,
    flags: MsFlags,
    data: Option<&str>,
) -> anyhow::Result<()> {
    std::fs::create_dir_all(target).with_context(|| format!("creating {target}"))?;
    match mount(Some(src), target, Some(fstype), flags, data) {
        Ok(()) | Err(nix::errno::Errno::EBUSY) => Ok(()),
        Err(e) => Err(e).with_context(|| format!("mounting {fstype} on {target}")),
    }
}

/// `/proc`, `/sys` and `/dev` in the initramfs.
pub fn early() -> anyhow::Result<()> {
    let nodev = MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC | MsFlags::MS_NODEV;
    mount_fs("proc", "/proc", "proc", nodev, None)?;
    mount_fs("sysfs", "/sys", "sysfs", nodev, None)?;
    mount_fs(
        "devtmpfs",
        "/dev",
        "devtmpfs",
        MsFlags::MS_NOSUID,
        Some("mode=0755"),
    )?;
    Ok(())
}

/// Point stdin/stdout/stderr at the console. The kernel opens it for init
/// only when the initramfs has a `/dev/console` node; after devtmpfs is
/// mounted it always exists.
pub fn reopen_console() {
    if let Ok(console) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/console")
    {
        for fd in 0..3 {
            // SAFETY: dup2 on a valid open descriptor onto 0..2; no Rust
            // object owns fds 0..2 as typed handles that could be invalidated.
            unsafe { libc::dup2(console.as_raw_fd(), fd) };
        }
    }
}

/// Mount `device` (ext4) on `new_root` and make it `/`, carrying the
/// pseudo filesystems along.
pub fn switch_root(device: &Path, new_root: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(new_root)?;
    mount(
        Some(device),
        new_root,
        Some("ext4"),
        MsFlags::MS_NOATIME,
        None::<&str>,
    )
    .with_context(|| {
        format!(
            "mounting {} (ext4) on {}",
            device.display(),
            new_root.display()
        )
    })?;
    for dir in ["/dev", "/proc", "/sys"] {
        let target = new_root.join(dir.trim_start_matches('/'));
        std::fs::create_dir_all(&target)?;
        mount(
            Some(dir),
            &target,
            None::<&str>,
            MsFlags::MS_MOVE,
            None::<&str>,
        )
        .with_context(|| format!("moving {dir} into the new root"))?;
    }
    nix::unistd::chdir(new_root)?;
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .context("moving the new root onto /")?;
    nix::unistd::chroot(".").context("chroot into the new root")?;
    nix::unistd::chdir("/")?;
    Ok(())
}

/// Mounts a Debian userland expects, inside the rootfs.
pub fn late() -> anyhow::Result<()> {
    let nosuid = MsFlags::MS_NOSUID;
    mount_fs(
        "devpts",
        "/dev/pts",
        "devpts",
        nosuid | MsFlags::MS_NOEXEC,
        Some("gid=5,mode=0620,ptmxmode=0666"),
    )?;
    mount_fs(
        "tmpfs",
        "/dev/shm",
        "tmpfs",
        nosuid | MsFlags::MS_NODEV,
        Some("mode=1777"),
    )?;
    mount_fs(
        "tmpfs",
        "/run",
        "tmpfs",
        nosuid | MsFlags::MS_NODEV,
        Some("mode=0755"),
    )?;
    for (link, target) in [
        ("/dev/fd", "/proc/self/fd"),
        ("/dev/stdin", "/proc/self/fd/0"),
        ("/dev/stdout", "/proc/self/fd/1"),
        ("/dev/stderr", "/proc/self/fd/2"),
    ] {
        if std::fs::symlink_metadata(link).is_err() {
            std::os::unix::fs::symlink(target, link).with_context(|| format!("linking {link}"))?;
        }
    }
    Ok(())
}

/// Where [`identity_on_tmpfs`] keeps the files it mounts over `/etc`.
const IDENTITY_DIR: &str = "/run/tine";

/// Put `/etc/hostname` and `/etc/machine-id` on tmpfs (bind mounts from
/// `/run/tine`, as container runtimes do): every create and fork rewrites
/// both through `/init`, and a tmpfs write is much cheaper for a guest
/// than its first ext4 write after a restore (measured: ≈ 40 ms under
/// TCG). A file the rootfs lacks is created (empty) to mount over; one
/// that is not a regular file (a symlink) is left alone, and a failure is
/// only logged (the file then stays on the disk).
pub fn identity_on_tmpfs() {
    if let Err(e) = std::fs::create_dir_all(IDENTITY_DIR) {
        eprintln!("tine-agent: creating {IDENTITY_DIR}: {e}");
        return;
    }
    for name in ["hostname", "machine-id"] {
        let target = Path::new("/etc").join(name);
        let is_file = match std::fs::symlink_metadata(&target) {
            Ok(meta) => meta.file_type().is_file(),
            Err(_) => std::fs::File::create(&target).is_ok(),
        };
        if !is_file {
            continue;
        }
        let copy = Path::new(IDENTITY_DIR).join(name);
        let bound = std::fs::copy(&target, &copy)
            .map_err(anyhow::Error::from)
            .and_then(|_| {
                mount(
                    Some(&copy),
                    &target,
                    None::<&str>,
                    MsFlags::MS_BIND,
                    None::<&str>,
                )
                .map_err(anyhow::Error::from)
            });
        if let Err(e) = bound {
            eprintln!("tine-agent: {} on tmpfs: {e}", target.display());
        }
    }
}

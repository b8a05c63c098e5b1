//! The library clones' QEMUs preload (`shim/tine-shim.c`, built by
//! `build.rs` and embedded here): it leaves a userfaultfd in QEMU for write
//! tracking ([`crate::ram::tracker`]) and guards the shared RAM file so the
//! balloon can give freed guest pages back without touching it.
//!
//! Why a preload and not a QEMU patch: tine runs the distribution's QEMU.
//! QEMU discards a reported free page of a file-backed RAM block with
//! `fallocate(PUNCH_HOLE)` on the file and then `madvise(MADV_DONTNEED)`,
//! and refuses both when the file was opened read-only. A clone's file is
//! shared by every clone of its snapshot, so punching it would zero pages
//! under all of them. The shim makes QEMU's open of that one path
//! read-only and its punches of that file no-ops, which leaves QEMU's
//! `MADV_DONTNEED`: the clone's private copy goes back to the host.
//! [`check_read_only`] verifies the result before the guest runs.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// The shim, built by `build.rs`.
pub(crate) static SHIM: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/tine-shim.so"));

/// What a QEMU preloads: the shim, and the RAM file it guards (if any).
#[derive(Debug, Clone)]
pub struct Preload {
    pub lib: PathBuf,
    /// The `mem-path` QEMU opens read-only although it is told otherwise.
    pub guard_ram: Option<PathBuf>,
}

impl Preload {
    /// The environment that loads it.
    pub fn env(&self) -> Vec<(&'static str, std::ffi::OsString)> {
        let mut env = vec![("LD_PRELOAD", self.lib.clone().into_os_string())];
        if let Some(ram) = &self.guard_ram {
            env.push(("TINE_SHIM_RAM", ram.clone().into_os_string()));
        }
        env
    }
}

/// Write the shim into `dir` (once per build of it, and once per process)
/// and return its path. It is read-only for everyone, so every jail may
/// map it.
pub fn install(dir: &Path) -> io::Result<PathBuf> {
    static DONE: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);
    let sum = crc32fast::hash(SHIM);
    let path = dir.join(format!("tine-shim-{sum:08x}.so"));
    let mut done = DONE.lock().unwrap_or_else(|e| e.into_inner());
    if done.as_ref() == Some(&path) && path.exists() {
        return Ok(path);
    }
    if !std::fs::read(&path).is_ok_and(|have| have == SHIM) {
        std::fs::create_dir_all(dir)?;
        let tmp = dir.join(format!(".tine-shim-{sum:08x}.{}", std::process::id()));
        std::fs::write(&tmp, SHIM)?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))?;
        std::fs::rename(&tmp, &path)?;
    }
    *done = Some(path.clone());
    Ok(path)
}

/// Check that process `pid` holds `file` open, and only read-only: a
/// QEMU told `readonly=off` that did not load the shim would punch holes
/// in a file every clone shares.
pub fn check_read_only(pid: i32, file: &Path) -> io::Result<()> {
    let want = std::fs::metadata(file)?;
    let mut held = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let entry = entry?;
        // Follows the descriptor to its file; one closed meanwhile is skipped.
        let Ok(meta) = std::fs::metadata(entry.path()) else {
            continue;
        };
        if meta.dev() != want.dev() || meta.ino() != want.ino() {
            continue;
        }
        let name = entry.file_name();
        let info =
            std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{}", name.to_string_lossy()))?;
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .and_then(|f| i32::from_str_radix(f.trim(), 8).ok())
            .ok_or_else(|| io::Error::other(format!("no flags in fdinfo {name:?}")))?;
        if flags & libc::O_ACCMODE != libc::O_RDONLY {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "QEMU {pid} holds {} open for writing (descriptor {}): the shim did not \
                     guard it",
                    file.display(),
                    name.to_string_lossy()
                ),
            ));
        }
        held += 1;
    }
    if held == 0 {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("QEMU {pid} does not hold {} open", file.display()),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn installed_once_and_readable_by_all() {
        let dir = tempfile::tempdir().unwrap();
        let a = install(dir.path()).unwrap();
        let b = install(dir.path()).unwrap();
        assert_eq!(a, b);
        assert_eq!(std::fs::read(&a).unwrap(), SHIM);
        assert_eq!(&SHIM[..4], b"\x7fELF");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&a).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o644);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    /// A real process with the shim preloaded opens the guarded file for
    /// writing and punches a hole in it: it gets a read-only descriptor,
    /// the punch "succeeds", and the file is unchanged. Another file is
    /// opened and punched as asked.
    #[test]
    fn the_guarded_file_is_opened_read_only_and_never_punched() {
        let dir = tempfile::tempdir().unwrap();
        let guarded = dir.path().join("ram");
        let other = dir.path().join("other");
        std::fs::write(&guarded, vec![7u8; 1 << 16]).unwrap();
        std::fs::write(&other, vec![7u8; 1 << 16]).unwrap();
        let preload = Preload {
            lib: install(dir.path()).unwrap(),
            guard_ram: Some(guarded.clone()),
        };
        // Python's os.open and os.posix_fallocate do not reach fallocate,
        // so call libc's through ctypes, as QEMU does.
        let script = "import ctypes,os,sys,time\n\
            libc=ctypes.CDLL(None,use_errno=True)\n\
            libc.fallocate64.argtypes=[ctypes.c_int,ctypes.c_int,ctypes.c_int64,ctypes.c_int64]\n\
            out=[]\n\
            for p in sys.argv[1:]:\n    \
                fd=os.open(p,os.O_RDWR)\n    \
                acc=os.get_blocking(fd) and 0\n    \
                r=libc.fallocate64(fd,3,4096,8192)\n    \
                out.append('%d:%d' % (r, ctypes.get_errno()))\n\
            print(' '.join(out),flush=True)\n\
            sys.stdin.read()\n";
        let mut cmd = std::process::Command::new("python3");
        cmd.args(["-c", script])
            .arg(&guarded)
            .arg(&other)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped());
        for (k, v) in preload.env() {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("python3 runs");
        let mut line = String::new();
        use std::io::BufRead;
        std::io::BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        // Both punches report success; only the other file's happened.
        assert_eq!(line.trim(), "0:0 0:0", "python said {line:?}");
        let pid = child.id() as i32;
        check_read_only(pid, &guarded).expect("the guarded file is held read-only");
        let err = check_read_only(pid, &other).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::PermissionDenied, "{err}");
        drop(child.stdin.take());
        child.wait().unwrap();
        assert_eq!(std::fs::read(&guarded).unwrap(), vec![7u8; 1 << 16]);
        let punched = std::fs::read(&other).unwrap();
        assert!(punched[4096..12288].iter().all(|&b| b == 0));
        assert!(punched[..4096].iter().all(|&b| b == 7));
        let gone = check_read_only(pid, &guarded).unwrap_err();
        assert_eq!(gone.kind(), io::ErrorKind::NotFound, "{gone}");
    }
}

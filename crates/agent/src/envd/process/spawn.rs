//! Starting a process as a user, on pipes or on a new PTY.
//!
//! Children are started with `std::process::Command` (never waited for
//! here: `crate::reaper` owns `waitpid`). A pipe child gets its own process
//! group, a PTY child its own session with the PTY as controlling terminal,
//! so signals can go to the whole group.

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, IntoRawFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use tokio::io::unix::AsyncFd;

use crate::envd::error::{EnvdError, Result};
use crate::envd::user::User;

pub struct Spec {
    pub cmd: String,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: PathBuf,
    pub user: User,
    pub pty: Option<(u16, u16)>,
    pub stdin: bool,
}

pub struct Spawned {
    pub pid: u32,
    pub stdin: Option<tokio::net::unix::pipe::Sender>,
    pub stdout: Option<tokio::net::unix::pipe::Receiver>,
    pub stderr: Option<tokio::net::unix::pipe::Receiver>,
    pub pty: Option<std::sync::Arc<PtyMaster>>,
}

fn is_executable(p: &Path) -> bool {
    std::fs::metadata(p)
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Finds `cmd` like `execvp` would, so that a missing program is an error
/// here and not an exec failure in the child.
fn resolve_program(cmd: &str, env: &[(String, String)]) -> Result<PathBuf> {
    if cmd.is_empty() {
        return Err(EnvdError::InvalidArgument("process cmd is empty".into()));
    }
    if cmd.contains('/') {
        let p = PathBuf::from(cmd);
        return if is_executable(&p) {
            Ok(p)
        } else {
            Err(EnvdError::InvalidArgument(format!(
                "executable {cmd:?} not found or not executable"
            )))
        };
    }
    let path = env
        .iter()
        .rev()
        .find(|(k, _)| k == "PATH")
        .map(|(_, v)| v.as_str())
        .unwrap_or(crate::envd::user::DEFAULT_PATH);
    path.split(':')
        .filter(|d| !d.is_empty())
        .map(|d| Path::new(d).join(cmd))
        .find(|p| is_executable(p))
        .ok_or_else(|| {
            EnvdError::InvalidArgument(format!("executable file {cmd:?} not found in $PATH"))
        })
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(OFlag::O_CLOEXEC).map_err(io::Error::from)
}

pub fn spawn(spec: Spec) -> Result<Spawned> {
    let program = resolve_program(&spec.cmd, &spec.env)?;
    if !spec.cwd.is_dir() {
        return Err(EnvdError::InvalidArgument(format!(
            "cwd {:?} does not exist or is not a directory",
            spec.cwd
        )));
    }
    let mut cmd = Command::new(&program);
    cmd.arg0(&spec.cmd)
        .args(&spec.args)
        .env_clear()
        .envs(spec.env.iter().cloned())
        .current_dir(&spec.cwd);

    let mut parent_stdin = None;
    let mut parent_out = None;
    let mut parent_err = None;
    let mut pty = None;
    let start_err = |e: io::Error| EnvdError::Internal(format!("starting {:?}: {e}", spec.cmd));
    if let Some((cols, rows)) = spec.pty {
        let (master, slave) = open_pty(cols, rows).map_err(start_err)?;
        cmd.stdin(Stdio::from(slave.try_clone().map_err(start_err)?));
        cmd.stdout(Stdio::from(slave.try_clone().map_err(start_err)?));
        cmd.stderr(Stdio::from(slave));
        pty = Some(std::sync::Arc::new(
            PtyMaster::new(master).map_err(start_err)?,
        ));
    } else {
        if spec.stdin {
            let (r, w) = pipe().map_err(start_err)?;
            cmd.stdin(Stdio::from(r));
            parent_stdin = Some(w);
        } else {
            cmd.stdin(Stdio::null());
        }
        let (r, w) = pipe().map_err(start_err)?;
        cmd.stdout(Stdio::from(w));
        parent_out = Some(r);
        let (r, w) = pipe().map_err(start_err)?;
        cmd.stderr(Stdio::from(w));
        parent_err = Some(r);
    }

    let switch = nix::unistd::Uid::effective().is_root() && spec.user.uid != 0;
    let (uid, gid) = (spec.user.uid, spec.user.gid);
    let groups: Vec<libc::gid_t> = spec.user.groups.clone();
    let is_pty = spec.pty.is_some();
    // SAFETY: the closure runs in the forked child before exec and only
    // makes async-signal-safe syscalls on data prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            if is_pty {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(io::Error::last_os_error());
                }
            } else if libc::setpgid(0, 0) < 0 {
                return Err(io::Error::last_os_error());
            }
            if switch
                && (libc::setgroups(groups.len(), groups.as_ptr()) < 0
                    || libc::setgid(gid) < 0
                    || libc::setuid(uid) < 0)
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }

    // `Command::spawn` waits for a child whose exec failed and asserts on
    // the result, which can race with the reaper; the checks above make
    // that rare and the catch keeps it from taking the agent down.
    let child = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cmd.spawn()))
        .map_err(|_| EnvdError::Internal(format!("starting {:?} failed", spec.cmd)))?
        .map_err(start_err)?;
    let pid = child.id();
    drop(cmd); // closes the child's ends of the pipes in this process
    drop(child); // dropping a std Child neither waits nor kills

    let to_async = |e: io::Error| EnvdError::Internal(format!("registering pipes: {e}"));
    Ok(Spawned {
        pid,
        stdin: parent_stdin
            .map(tokio::net::unix::pipe::Sender::from_owned_fd)
            .transpose()
            .map_err(to_async)?,
        stdout: parent_out
            .map(tokio::net::unix::pipe::Receiver::from_owned_fd)
            .transpose()
            .map_err(to_async)?,
        stderr: parent_err
            .map(tokio::net::unix::pipe::Receiver::from_owned_fd)
            .transpose()
            .map_err(to_async)?,
        pty,
    })
}

/// A new PTY pair, both ends close-on-exec from the start.
fn open_pty(cols: u16, rows: u16) -> io::Result<(OwnedFd, OwnedFd)> {
    let master = nix::pty::posix_openpt(OFlag::O_RDWR | OFlag::O_NOCTTY | OFlag::O_CLOEXEC)?;
    nix::pty::grantpt(&master)?;
    nix::pty::unlockpt(&master)?;
    let name = nix::pty::ptsname_r(&master)?;
    let slave: OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOCTTY)
        .open(name)?
        .into();
    // SAFETY: `into_raw_fd` hands over the only owner of a valid open fd.
    let master = unsafe { OwnedFd::from_raw_fd(master.into_raw_fd()) };
    set_winsize(&master, cols, rows)?;
    Ok((master, slave))
}

fn set_winsize(fd: &impl AsFd, cols: u16, rows: u16) -> io::Result<()> {
    let ws = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads one `winsize` from the valid pointer.
    if unsafe { libc::ioctl(fd.as_fd().as_raw_fd(), libc::TIOCSWINSZ, &ws) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The parent's side of a PTY, non-blocking and registered with tokio.
pub struct PtyMaster {
    fd: AsyncFd<OwnedFd>,
    write_lock: tokio::sync::Mutex<()>,
}

impl PtyMaster {
    fn new(fd: OwnedFd) -> io::Result<PtyMaster> {
        let flags = OFlag::from_bits_truncate(fcntl(&fd, FcntlArg::F_GETFL)?);
        fcntl(&fd, FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
        // SAFETY: `fd` is an open OwnedFd that the AsyncFd owns from here on,
        // so it stays the same open file description for its whole life.
        let fd = unsafe { AsyncFd::register(fd) }.map_err(io::Error::from)?;
        Ok(PtyMaster {
            fd,
            write_lock: tokio::sync::Mutex::new(()),
        })
    }

    /// Non-blocking read; `Ok(0)` once the child side is gone (`EIO`).
    pub fn try_read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match nix::unistd::read(self.fd.get_ref(), buf) {
            Ok(n) => Ok(n),
            Err(nix::errno::Errno::EIO) => Ok(0),
            Err(e) => Err(e.into()),
        }
    }

    pub async fn readable(&self) -> io::Result<()> {
        let mut guard = self.fd.readable().await?;
        guard.clear_ready();
        Ok(())
    }

    pub async fn write_all(&self, mut data: &[u8]) -> io::Result<()> {
        let _serial = self.write_lock.lock().await;
        while !data.is_empty() {
            let mut guard = self.fd.writable().await?;
            match guard.try_io(|fd| nix::unistd::write(fd.get_ref(), data).map_err(io::Error::from))
            {
                Ok(Ok(n)) => data = &data[n..],
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => continue,
            }
        }
        Ok(())
    }

    pub fn resize(&self, cols: u16, rows: u16) -> io::Result<()> {
        set_winsize(self.fd.get_ref(), cols, rows)
    }
}

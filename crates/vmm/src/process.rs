//! The QEMU process of a VM: spawned in the VM's network namespace and its
//! own session (so it outlives the tine process that started it and can be
//! adopted after a restart), watched until it exits.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Stdio;

use nix::sched::{setns, CloneFlags};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::unix::AsyncFd;
use tokio::sync::watch;

use crate::error::{Error, IoContext, Result};
use crate::jail::Prepared;
use crate::netns::Netns;

/// A running (or exited) QEMU process.
#[derive(Debug)]
pub struct QemuProcess {
    pid: i32,
    /// `None` while running; then a description of how it ended.
    exit: watch::Receiver<Option<String>>,
}

impl QemuProcess {
    /// Start `binary args` inside `netns`, its stdout and stderr going to
    /// `log`; jailed when `jail` is set ([`crate::jail`]). `keep_fd` (the
    /// tap) is left open across exec; `preload` is loaded into it
    /// (`LD_PRELOAD`; the jail must bind it, see [`crate::shim`]).
    pub fn spawn(
        binary: &str,
        args: &[String],
        netns: &Netns,
        log: &Path,
        jail: Option<std::sync::Arc<Prepared>>,
        keep_fd: Option<RawFd>,
        preload: Option<&crate::shim::Preload>,
    ) -> Result<Self> {
        let log_file = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .create(true)
                .write(true)
                .truncate(true)
                .mode(0o600)
                .open(log)
                .ctx(|| format!("creating {}", log.display()))?
        };
        let log_err = log_file
            .try_clone()
            .ctx(|| "duplicating the log fd".into())?;
        let ns_fd = netns.file().as_raw_fd();

        let mut cmd = std::process::Command::new(binary);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(log_file)
            .stderr(log_err);
        for (key, value) in preload.map(|p| p.env()).unwrap_or_default() {
            cmd.env(key, value);
        }
        // SAFETY: the closure runs in the forked child before exec and only
        // makes async-signal-safe system calls (setsid, setns, fcntl, and
        // the jail's, see `Prepared::enter`) on data made before the fork.
        unsafe {
            cmd.pre_exec(move || {
                nix::unistd::setsid().map_err(std::io::Error::from)?;
                // SAFETY: ns_fd is the namespace file the parent holds open
                // for the whole spawn; fork copied the descriptor.
                let fd = std::os::fd::BorrowedFd::borrow_raw(ns_fd);
                setns(fd, CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
                if let Some(fd) = keep_fd {
                    if libc::fcntl(fd, libc::F_SETFD, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                if let Some(jail) = &jail {
                    // SAFETY: we are the forked child, before exec.
                    jail.enter()?;
                }
                Ok(())
            });
        }
        let mut child = tokio::process::Command::from(cmd)
            .kill_on_drop(false)
            .spawn()
            .map_err(|source| Error::Spawn {
                binary: binary.to_string(),
                source,
            })?;
        let pid = child.id().expect("a just-spawned child has a pid") as i32;
        let (tx, rx) = watch::channel(None);
        tokio::spawn(async move {
            let how = match child.wait().await {
                Ok(status) => status.to_string(),
                Err(e) => format!("wait failed: {e}"),
            };
            let _ = tx.send(Some(how));
        });
        Ok(Self { pid, exit: rx })
    }

    /// Watch a QEMU process this tine process did not start (after a
    /// restart). Fails when `pid` is gone.
    pub fn adopt(pid: i32) -> Result<Self> {
        // SAFETY: pidfd_open(2) takes a pid and flags and returns a new fd
        // or -1; no memory is passed.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error()).ctx(|| format!("pidfd_open({pid})"));
        }
        // SAFETY: fd is a fresh descriptor owned by nobody else.
        let pidfd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        // SAFETY: the OwnedFd is moved into the AsyncFd and stays open and
        // unchanged for the AsyncFd's whole life.
        let async_fd =
            unsafe { AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE) }
                .map_err(|e| e.into_parts().1)
                .ctx(|| "registering the pidfd".into())?;
        let (tx, rx) = watch::channel(None);
        tokio::spawn(async move {
            // A pidfd becomes readable when the process exits.
            let _ = async_fd.readable().await;
            let _ = tx.send(Some("exited (adopted process, status unknown)".into()));
        });
        Ok(Self { pid, exit: rx })
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// How the process ended, or `None` while it runs.
    pub fn exit_status(&self) -> Option<String> {
        self.exit.borrow().clone()
    }

    /// Wait until the process has exited; returns how it ended.
    pub async fn wait(&self) -> String {
        let mut rx = self.exit.clone();
        loop {
            if let Some(s) = rx.borrow_and_update().clone() {
                return s;
            }
            if rx.changed().await.is_err() {
                return "exited".into();
            }
        }
    }

    /// SIGKILL and wait for the exit.
    pub async fn kill(&self) -> String {
        if self.exit_status().is_none() {
            let _ = kill(Pid::from_raw(self.pid), Signal::SIGKILL);
        }
        self.wait().await
    }
}

/// The CPU time (user + system, all threads) process `pid` has used so
/// far, from `/proc/PID/stat`; `None` if it is gone or unreadable.
pub fn cpu_time(pid: i32) -> Option<std::time::Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    parse_cpu_ticks(&stat).map(|ticks| {
        let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .filter(|&t| t > 0)
            .unwrap_or(100) as u64;
        std::time::Duration::from_nanos(ticks.saturating_mul(1_000_000_000) / hz)
    })
}

/// utime + stime, in clock ticks, from a `/proc/PID/stat` line (fields 14
/// and 15; the command name before them may hold spaces and parentheses).
fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let rest = stat.rsplit_once(')')?.1;
    let mut f = rest.split_whitespace().skip(11);
    let utime: u64 = f.next()?.parse().ok()?;
    let stime: u64 = f.next()?.parse().ok()?;
    Some(utime + stime)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_ticks_are_read_after_a_command_name_with_spaces_and_parentheses() {
        let line = "4242 (qemu (x) 1) S 1 4242 4242 0 -1 4194560 100 0 0 0 37 5 0 0 20 0 3 0";
        assert_eq!(parse_cpu_ticks(line), Some(42));
        assert_eq!(parse_cpu_ticks("4242 (qemu) S 1"), None);
        assert_eq!(parse_cpu_ticks("garbage"), None);
        assert!(cpu_time(std::process::id() as i32).is_some());
    }
}

//! The one place that calls `waitpid`.
//!
//! As PID 1 the agent inherits every orphan in the guest and must reap them,
//! and the process API needs the exit status of the children it started. Two
//! `waitpid` callers would steal statuses from each other, so all reaping
//! happens here: on every SIGCHLD we drain `waitpid(-1, WNOHANG)` and hand
//! each status to whoever [`Reaper::watch`]ed that pid. A status that arrives
//! before its watcher (a child that exits at once) is kept until claimed.
//!
//! Rule for the rest of the agent: never call `wait`/`waitpid` and never use
//! `tokio::process::Child::wait`; spawn with `std::process::Command` (or
//! fork/exec) and call [`Reaper::watch`] with the pid.

use std::collections::{HashMap, VecDeque};
use std::sync::{Mutex, OnceLock};

use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::oneshot;

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// It called `exit(code)`.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
}

impl Exit {
    /// Exit code as envd reports it: the code, or -1 when a signal killed it.
    pub fn code(self) -> i32 {
        match self {
            Exit::Code(c) => c,
            Exit::Signal(_) => -1,
        }
    }

    /// Text like Go's `ProcessState.String()`, which real envd reports as
    /// the `status` of an end event: `exit status 1`, `signal: killed`.
    pub fn status_string(self) -> String {
        match self {
            Exit::Code(c) => format!("exit status {c}"),
            Exit::Signal(s) => format!("signal: {}", signal_name(s)),
        }
    }
}

fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGKILL => "killed".into(),
        libc::SIGTERM => "terminated".into(),
        libc::SIGINT => "interrupt".into(),
        libc::SIGHUP => "hangup".into(),
        libc::SIGPIPE => "broken pipe".into(),
        libc::SIGSEGV => "segmentation fault".into(),
        libc::SIGABRT => "aborted".into(),
        libc::SIGQUIT => "quit".into(),
        other => format!("signal {other}"),
    }
}

/// Statuses nobody claimed are kept up to this many (orphans reaped as PID 1
/// are never claimed, so the list must be bounded).
const MAX_UNCLAIMED: usize = 4096;

#[derive(Default)]
struct State {
    started: bool,
    watchers: HashMap<i32, oneshot::Sender<Exit>>,
    unclaimed: HashMap<i32, Exit>,
    unclaimed_order: VecDeque<i32>,
}

pub struct Reaper {
    state: Mutex<State>,
}

/// The process-wide reaper.
pub fn global() -> &'static Reaper {
    static REAPER: OnceLock<Reaper> = OnceLock::new();
    REAPER.get_or_init(|| Reaper {
        state: Mutex::new(State::default()),
    })
}

impl Reaper {
    /// Start the SIGCHLD loop. Idempotent. It runs on a thread of its own
    /// with its own small runtime, so it outlives whichever runtime first
    /// called this (tests create one runtime per test).
    pub fn start(&'static self) -> std::io::Result<()> {
        {
            let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if st.started {
                return Ok(());
            }
            st.started = true;
        }
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("reaper".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let mut sigchld = match signal(SignalKind::child()) {
                        Ok(s) => s,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok(()));
                    loop {
                        self.drain();
                        if sigchld.recv().await.is_none() {
                            break;
                        }
                    }
                });
            })?;
        ready_rx
            .recv()
            .map_err(|_| std::io::Error::other("the reaper thread died"))?
    }

    /// Resolves with the exit of `pid`, which must be a child of this process.
    pub fn watch(&self, pid: i32) -> oneshot::Receiver<Exit> {
        let (tx, rx) = oneshot::channel();
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(exit) = st.unclaimed.remove(&pid) {
            st.unclaimed_order.retain(|p| *p != pid);
            let _ = tx.send(exit);
        } else {
            st.watchers.insert(pid, tx);
        }
        drop(st);
        // The child may have exited before the watcher was registered and
        // after the last drain; drain once more so it is not missed.
        self.drain();
        rx
    }

    fn drain(&self) {
        loop {
            let exit = match waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::Exited(pid, code)) => (pid.as_raw(), Exit::Code(code)),
                Ok(WaitStatus::Signaled(pid, sig, _)) => (pid.as_raw(), Exit::Signal(sig as i32)),
                Ok(WaitStatus::StillAlive) => return,
                Ok(_) => continue, // stopped/continued: not an exit
                Err(nix::errno::Errno::EINTR) => continue,
                Err(_) => return, // ECHILD: no children left
            };
            self.deliver(exit.0, exit.1);
        }
    }

    fn deliver(&self, pid: i32, exit: Exit) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = st.watchers.remove(&pid) {
            let _ = tx.send(exit);
            return;
        }
        st.unclaimed.insert(pid, exit);
        st.unclaimed_order.push_back(pid);
        while st.unclaimed_order.len() > MAX_UNCLAIMED {
            if let Some(old) = st.unclaimed_order.pop_front() {
                st.unclaimed.remove(&old);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One runtime for all tests: the SIGCHLD loop lives on the runtime
    /// that started it, and a per-test runtime would take it down with it.
    fn rt() -> &'static tokio::runtime::Runtime {
        static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
        RT.get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
                .unwrap()
        })
    }

    #[test]
    // The reaper under test waits for the children, not `Child::wait`.
    #[allow(clippy::zombie_processes)]
    fn reports_exit_codes_and_signals() {
        rt().block_on(async {
            global().start().unwrap();
            let child = std::process::Command::new("sh")
                .args(["-c", "exit 7"])
                .spawn()
                .unwrap();
            let exit = global().watch(child.id() as i32).await.unwrap();
            assert_eq!(exit, Exit::Code(7));
            assert_eq!(exit.status_string(), "exit status 7");

            let child = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap();
            let rx = global().watch(child.id() as i32);
            nix::sys::signal::kill(Pid::from_raw(child.id() as i32), nix::sys::signal::SIGKILL)
                .unwrap();
            let exit = rx.await.unwrap();
            assert_eq!(exit, Exit::Signal(libc::SIGKILL));
            assert_eq!(exit.code(), -1);
            assert_eq!(exit.status_string(), "signal: killed");
        })
    }

    #[test]
    // The reaper under test waits for the children, not `Child::wait`.
    #[allow(clippy::zombie_processes)]
    fn a_child_that_exits_before_watch_is_not_lost() {
        rt().block_on(async {
            global().start().unwrap();
            let child = std::process::Command::new("true").spawn().unwrap();
            std::thread::sleep(std::time::Duration::from_millis(200));
            let exit = global().watch(child.id() as i32).await.unwrap();
            assert_eq!(exit, Exit::Code(0));
        })
    }
}

//! Errors of the VM driver. Every variant names what failed, so a user who
//! reads only the message knows which file, process or step to look at.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what} not found at {path} (run scripts/setup-host.sh to build it)")]
    MissingArtifact { what: &'static str, path: PathBuf },

    #[error("cannot start {binary}: {source}")]
    Spawn {
        binary: String,
        #[source]
        source: std::io::Error,
    },

    #[error("QEMU of VM {vm} exited ({status}) {during}; last QEMU output: {qemu_log:?}; last console lines: {console:?}")]
    QemuExited {
        vm: String,
        status: String,
        during: &'static str,
        qemu_log: String,
        console: String,
    },

    #[error(
        "the agent of VM {vm} did not answer within {secs} s; last console lines: {console:?}"
    )]
    AgentTimeout {
        vm: String,
        secs: u64,
        console: String,
    },

    #[error("QMP: {0}")]
    Qmp(#[from] crate::qmp::QmpError),

    #[error("network namespace {name}: {detail}")]
    Netns { name: String, detail: String },

    #[error("snapshot {path}: {detail}")]
    Snapshot { path: PathBuf, detail: String },

    #[error("VM {vm} is {state}, cannot {op}")]
    InvalidState {
        vm: String,
        state: &'static str,
        op: &'static str,
    },

    #[error("guest agent of VM {vm}: {detail}")]
    Agent { vm: String, detail: String },

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Attach a description to an `io::Error`.
pub(crate) trait IoContext<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Io {
            context: context(),
            source,
        })
    }
}

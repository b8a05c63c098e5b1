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

    #[error("the guest of VM {vm} was not ready within {secs} s; last console lines: {console:?}")]
    NotReady {
        vm: String,
        secs: u64,
        console: String,
    },

    #[error("QMP: {0}")]
    Qmp(#[from] crate::qmp::QmpError),

    #[error("network namespace {name}: {detail}")]
    Netns { name: String, detail: String },

    #[error("{what} {id} not found")]
    NotFound { what: &'static str, id: String },

    #[error("snapshot {path}: {detail}")]
    Snapshot { path: PathBuf, detail: String },

    #[error("VM {vm} is {state}, cannot {op}")]
    InvalidState {
        vm: String,
        state: &'static str,
        op: &'static str,
    },

    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What kind of failure an [`Error`] is, for callers that answer for it
/// (the server maps kinds to HTTP statuses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// A VM or snapshot that is not there.
    NotFound,
    /// The VM is in a state the operation does not apply to.
    InvalidState,
    /// A snapshot's files are damaged or of another version.
    Damaged,
    /// The guest's QEMU died.
    Guest,
    /// The guest did not answer in time.
    Timeout,
    /// The host failed: missing artifacts, spawning, namespaces, files, QMP.
    Host,
    /// The host's disk (or a file size limit) is full.
    NoSpace,
}

impl Error {
    pub fn kind(&self) -> ErrorKind {
        if self.is_no_space() {
            return ErrorKind::NoSpace;
        }
        match self {
            Error::NotFound { .. } => ErrorKind::NotFound,
            Error::InvalidState { .. } => ErrorKind::InvalidState,
            Error::Snapshot { .. } => ErrorKind::Damaged,
            Error::QemuExited { .. } => ErrorKind::Guest,
            Error::NotReady { .. } => ErrorKind::Timeout,
            Error::MissingArtifact { .. }
            | Error::Spawn { .. }
            | Error::Qmp(_)
            | Error::Netns { .. }
            | Error::Io { .. } => ErrorKind::Host,
        }
    }
}

impl Error {
    /// A write failed for lack of space: `ENOSPC`, `EDQUOT` or `EFBIG`
    /// from tine's own I/O, or QEMU reporting the same for a file it
    /// wrote (QMP gives only the text).
    fn is_no_space(&self) -> bool {
        let os = |e: &std::io::Error| {
            matches!(
                e.raw_os_error(),
                Some(libc::ENOSPC | libc::EDQUOT | libc::EFBIG)
            )
        };
        match self {
            Error::Io { source, .. } => os(source),
            Error::Qmp(crate::qmp::QmpError::Io(e)) => os(e),
            Error::Qmp(crate::qmp::QmpError::Command { desc, .. }) => {
                desc.contains("No space left on device")
                    || desc.contains("Disk quota exceeded")
                    || desc.contains("File too large")
            }
            _ => false,
        }
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_disk_is_its_own_kind() {
        let io = |errno| Error::Io {
            context: "writing".into(),
            source: std::io::Error::from_raw_os_error(errno),
        };
        assert_eq!(io(libc::ENOSPC).kind(), ErrorKind::NoSpace);
        assert_eq!(io(libc::EFBIG).kind(), ErrorKind::NoSpace);
        assert_eq!(io(libc::EIO).kind(), ErrorKind::Host);
        let qmp = |desc: &str| {
            Error::Qmp(crate::qmp::QmpError::Command {
                command: "xen-save-devices-state".into(),
                class: "GenericError".into(),
                desc: desc.into(),
            })
        };
        assert_eq!(
            qmp("Failed to save: No space left on device").kind(),
            ErrorKind::NoSpace
        );
        assert_eq!(qmp("Device busy").kind(), ErrorKind::Host);
    }
}

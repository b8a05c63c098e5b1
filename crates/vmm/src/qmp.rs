//! A small typed QMP client over the VM's unix socket.
//!
//! Why our own: the driver needs about ten commands (`stop`, `cont`,
//! `migrate*`, `query-*`, `quit`), one connection per VM, one command at a
//! time. The `qapi` crate generates bindings for the whole schema, which
//! costs minutes of compile time on our 2-core CI machines for no gain here.
//! Protocol: a greeting, `qmp_capabilities`, then one JSON object per line;
//! asynchronous events may arrive between a command and its reply.

use std::path::Path;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

/// How long one QMP command may take before we call QEMU wedged.
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);
/// How long to wait for the greeting before calling the socket busy.
const GREETING_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("connecting to {path}: {source}")]
    Connect {
        path: String,
        source: std::io::Error,
    },
    #[error("I/O on the QMP socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("no QMP greeting on {0}: another process (a tine server?) controls this VM")]
    Busy(String),
    #[error("QEMU closed the QMP socket")]
    Closed,
    #[error("no reply to {0} within {REPLY_TIMEOUT:?}")]
    Timeout(String),
    #[error("malformed QMP message {line:?}: {detail}")]
    Protocol { line: String, detail: String },
    #[error("{command} failed: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
}

pub struct Qmp {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
}

impl Qmp {
    /// Connect to the QMP socket at `path`, read the greeting and leave
    /// capabilities negotiation mode. Process `pid` must serve the socket
    /// (checked with its peer credentials: the directory holding it is the
    /// jailed QEMU's, which could put another VM's socket there).
    pub async fn connect(path: &Path, pid: i32) -> Result<Self, QmpError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| QmpError::Connect {
                path: path.display().to_string(),
                source,
            })?;
        let peer = stream.peer_cred().ok().and_then(|c| c.pid());
        if peer != Some(pid) {
            return Err(QmpError::Connect {
                path: path.display().to_string(),
                source: std::io::Error::other(format!(
                    "the socket is served by pid {peer:?}, not by QEMU {pid}"
                )),
            });
        }
        let (r, w) = stream.into_split();
        let mut qmp = Self {
            reader: BufReader::new(r),
            writer: w,
        };
        // QEMU serves one QMP client at a time; a second one is accepted
        // but gets no greeting until the first leaves.
        let greeting = tokio::time::timeout(GREETING_TIMEOUT, qmp.read_message("greeting"))
            .await
            .map_err(|_| QmpError::Busy(path.display().to_string()))??;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol {
                line: greeting.to_string(),
                detail: "expected the QMP greeting".into(),
            });
        }
        qmp.execute::<Value>("qmp_capabilities", None).await?;
        Ok(qmp)
    }

    async fn read_message(&mut self, waiting_for: &str) -> Result<Value, QmpError> {
        let mut line = String::new();
        let n = tokio::time::timeout(REPLY_TIMEOUT, self.reader.read_line(&mut line))
            .await
            .map_err(|_| QmpError::Timeout(waiting_for.to_string()))??;
        if n == 0 {
            return Err(QmpError::Closed);
        }
        serde_json::from_str(&line).map_err(|e| QmpError::Protocol {
            line,
            detail: e.to_string(),
        })
    }

    /// Run `command` with optional `arguments` and decode its `return`.
    pub async fn execute<R: DeserializeOwned>(
        &mut self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<R, QmpError> {
        let mut msg = json!({ "execute": command });
        if let Some(args) = arguments {
            msg["arguments"] = args;
        }
        let mut bytes = serde_json::to_vec(&msg).expect("a json! value serializes");
        bytes.push(b'\n');
        self.writer.write_all(&bytes).await?;
        loop {
            let reply = self.read_message(command).await?;
            if reply.get("event").is_some() {
                tracing::trace!(event = %reply["event"], "QMP event");
                continue;
            }
            if let Some(ret) = reply.get("return") {
                return serde_json::from_value(ret.clone()).map_err(|e| QmpError::Protocol {
                    line: reply.to_string(),
                    detail: format!("unexpected reply to {command}: {e}"),
                });
            }
            if let Some(err) = reply.get("error") {
                return Err(QmpError::Command {
                    command: command.to_string(),
                    class: err["class"].as_str().unwrap_or("?").to_string(),
                    desc: err["desc"].as_str().unwrap_or("?").to_string(),
                });
            }
            return Err(QmpError::Protocol {
                line: reply.to_string(),
                detail: "neither return, error nor event".into(),
            });
        }
    }

    /// Run a command whose reply is empty.
    pub async fn run(&mut self, command: &str, arguments: Option<Value>) -> Result<(), QmpError> {
        self.execute::<Value>(command, arguments).await.map(drop)
    }

    /// Poll `query-migrate` until the migration leaves its active states.
    /// Returns an error carrying QEMU's `error-desc` if it failed.
    pub async fn wait_migration(&mut self, what: &str) -> Result<(), QmpError> {
        let mut delay = Duration::from_micros(500);
        loop {
            let status: Value = self.execute("query-migrate", None).await?;
            match status["status"].as_str().unwrap_or("none") {
                "completed" => return Ok(()),
                "failed" | "cancelled" => {
                    return Err(QmpError::Command {
                        command: what.to_string(),
                        class: status["status"].as_str().unwrap_or("failed").to_string(),
                        desc: status["error-desc"]
                            .as_str()
                            .unwrap_or("no detail from QEMU")
                            .to_string(),
                    })
                }
                _ => {
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_millis(20));
                }
            }
        }
    }
}

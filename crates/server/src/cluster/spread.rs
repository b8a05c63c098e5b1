//! Forks beyond one node: a fork asking for more children than its
//! source's node has room for starts what fits there and pushes its
//! capture to the registry; the gateway asks other nodes for the rest,
//! and each pulls the capture and starts its share from it
//! ([`fork_elsewhere`]). Every child starts as a child of a local fork
//! does: reseeded, with the source's metadata, environment and network
//! policy.

use super::captures::{CaptureError, Captures};
use crate::sandboxes::{ForkResult, Manager, SandboxError};

/// On a fork's answer from the source's node to a gateway: the children
/// that did not fit, to start elsewhere from `capture`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct Elsewhere {
    pub capture: String,
    pub count: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum SpreadError {
    #[error(transparent)]
    Sandbox(#[from] SandboxError),
    #[error(transparent)]
    Capture(#[from] CaptureError),
}

/// Fork sandbox `id` into `count` children on this node if it has room;
/// otherwise start as many as fit here and push the fork's capture for
/// the rest (`Some(Elsewhere)`).
pub async fn fork_here(
    manager: &Manager,
    captures: &Captures,
    id: &str,
    count: i64,
    timeout_secs: Option<i64>,
) -> Result<(Vec<ForkResult>, Option<Elsewhere>), SpreadError> {
    let count_ok = crate::sandboxes::limits::fork_count(&manager.config, count)?;
    let room = manager.room();
    let source = manager.get(id)?;
    // The volumes it mounts live here: so do its children.
    if room >= count_ok || !source.volume_mounts.is_empty() {
        return Ok((manager.fork(id, count, timeout_secs).await?, None));
    }
    let row = manager.fork_capture(id).await?;
    // The push reads the capture while the local children start from it.
    let (pushed, here) = tokio::join!(captures.push_fork(manager.db(), &row), async {
        if room == 0 {
            return Ok(Vec::new());
        }
        manager
            .fork_from(&source, &row.id, room, timeout_secs)
            .await
    });
    let here = here?;
    pushed?;
    Ok((
        here,
        Some(Elsewhere {
            capture: row.id,
            count: count_ok - room,
        }),
    ))
}

/// `count` children of sandbox `id` of `team` from fork capture `capture`,
/// which another node pushed: pulled unless this node has it.
pub async fn fork_elsewhere(
    manager: &Manager,
    captures: &Captures,
    team: &str,
    id: &str,
    capture: &str,
    count: i64,
    timeout_secs: Option<i64>,
) -> Result<Vec<ForkResult>, SpreadError> {
    let count = crate::sandboxes::limits::fork_count(&manager.config, count)?;
    let source = captures.fork_source(manager.db(), team, capture).await?;
    if source.id != id {
        return Err(SandboxError::InvalidArgument(format!(
            "fork capture {capture} is not of sandbox {id}"
        ))
        .into());
    }
    Ok(manager
        .fork_from(&source, capture, count, timeout_secs)
        .await?)
}

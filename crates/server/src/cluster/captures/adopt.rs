//! Adopting a paused sandbox of another node from its pushed pause
//! capture.

use std::sync::atomic::Ordering;

use super::{failed, CaptureError, Captures};
use crate::db::{Db, SnapshotKind};
use crate::model::SandboxState;

impl Captures {
    /// Make paused sandbox `sandbox_id` of `team`, which this node does
    /// not have, this node's from the capture its own node pushed when it
    /// paused: pulled, installed, and the sandbox recorded here as paused
    /// on it (its `connect` then resumes it as any). The catalog records
    /// the move. `Ok(false)`: no capture of it was pushed.
    pub async fn adopt(&self, db: &Db, team: &str, sandbox_id: &str) -> Result<bool, CaptureError> {
        // Here already (a killed row is one that moved away from here).
        let here = || {
            db.get_sandbox(sandbox_id)
                .ok()
                .flatten()
                .is_some_and(|s| !matches!(s.state, SandboxState::Killed | SandboxState::Failed))
        };
        if here() {
            return Ok(false);
        }
        let Some((id, from, record)) = self.find_pause(team, sandbox_id).await? else {
            return Ok(false);
        };
        let err = failed(&id);
        let sandbox = record
            .sandbox
            .clone()
            .filter(|s| s.id == sandbox_id && s.team == team)
            .ok_or_else(|| err("its record names another sandbox".into()))?;
        let _one = self.pulls.lock().await;
        if here() {
            return Ok(true);
        }
        let t = std::time::Instant::now();
        let fetched = self.pull(&id, &record).await?;
        let row = record.row(&id, SnapshotKind::Pause, sandbox_id.to_string(), Vec::new());
        let detail = format!("from node {from}: its pause capture {id} pulled from the registry");
        db.adopt_sandbox(&sandbox, &row, &detail)
            .map_err(|e| err(e.to_string()))?;
        // From here on the old node's lists no longer speak for it; its
        // next resume here pushes a new capture when it pauses again.
        self.catalog
            .record_move(sandbox_id, &from, &self.node)
            .await?;
        self.forget(&id).await;
        self.stats.adopted.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            sandbox = sandbox_id,
            capture = %id,
            from = %from,
            mib = fetched >> 20,
            secs = t.elapsed().as_secs_f64(),
            "paused sandbox adopted from its pushed capture"
        );
        Ok(true)
    }
}

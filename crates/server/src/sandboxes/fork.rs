//! Forks: one capture of a running sandbox, many children started from
//! it, here or (from the capture pushed to a cluster's registry) on other
//! nodes.

use std::time::Instant;

use futures::future::join_all;
use tine_vmm::{SnapshotInfo, SnapshotRef};

use super::capture::rec_machine;
use super::{limits, CreateRequest, Manager, SandboxError, Source};
use crate::db::{SnapshotKind, SnapshotRow};
use crate::model::SandboxRecord;

/// Outcome of one fork child.
pub type ForkResult = Result<SandboxRecord, SandboxError>;

impl Manager {
    /// Capture the sandbox once and start `count` sandboxes from it, all at
    /// once. Each child succeeds or fails on its own.
    pub async fn fork(
        &self,
        id: &str,
        count: i64,
        timeout_secs: Option<i64>,
    ) -> Result<Vec<ForkResult>, SandboxError> {
        let count = limits::fork_count(&self.config, count)?;
        let timeout_secs = limits::optional_timeout(&self.config, timeout_secs)?;
        let source_rec = self.get(id)?;
        let ticket = self.admit(&source_rec.team, count as u64, rec_machine(&source_rec))?;
        let _ = self.fit_pool();
        let (row, mut snapshot) = {
            let _op = self.lock(id).await;
            self.capture_running(id, SnapshotKind::Fork, vec![]).await?
        };
        if share_fork_ram(self.config.fork_shared_ram_from, count, snapshot.info()) {
            snapshot = self.materialize(id, &row.id).await?;
        }
        let results = self
            .launch_children(&source_rec, &row, snapshot, count, timeout_secs, &ticket)
            .await;
        self.event(id, "forked", &format!("{count} children from {}", row.id));
        // A fork capture nobody started from is deleted now.
        self.gc();
        Ok(results)
    }

    /// How many more sandboxes this host admits now (its capacity, not a
    /// team's limits): the children of a fork that stay here when the
    /// rest go to other nodes of a cluster.
    pub fn room(&self) -> usize {
        let (cap, used, _) = self.capacity();
        cap.sandboxes.saturating_sub(used)
    }

    /// The capture of a fork whose children start elsewhere too (on other
    /// nodes of a cluster, from the capture pushed to the registry): made
    /// once, while the source keeps running; children start from it with
    /// [`Manager::fork_from`].
    pub async fn fork_capture(&self, id: &str) -> Result<SnapshotRow, SandboxError> {
        let _op = self.lock(id).await;
        Ok(self
            .capture_running(id, SnapshotKind::Fork, vec![])
            .await?
            .0)
    }

    /// `count` fork children of sandbox `source_rec` from its fork capture
    /// `capture` (made here by [`Manager::fork_capture`], or pulled from a
    /// cluster's registry): each starts as a child of [`Manager::fork`]
    /// does, reseeded, with the source's metadata, environment and network
    /// policy.
    pub async fn fork_from(
        &self,
        source_rec: &SandboxRecord,
        capture: &str,
        count: usize,
        timeout_secs: Option<i64>,
    ) -> Result<Vec<ForkResult>, SandboxError> {
        let timeout_secs = limits::optional_timeout(&self.config, timeout_secs)?;
        let row = self
            .db
            .get_snapshot(capture)?
            .ok_or_else(|| SandboxError::NotFound(format!("fork capture {capture}")))?;
        let ticket = self.admit(&source_rec.team, count as u64, rec_machine(source_rec))?;
        let _ = self.fit_pool();
        let snapshot = {
            let _chains = self.chains.read().await;
            self.driver.snapshots().open_snapshot(capture)
        }
        .map_err(SandboxError::vm(&source_rec.id, "opening the fork capture"))?;
        let results = self
            .launch_children(source_rec, &row, snapshot, count, timeout_secs, &ticket)
            .await;
        self.gc();
        Ok(results)
    }

    /// Start `count` children of `source_rec` from its fork capture `row`.
    async fn launch_children(
        &self,
        source_rec: &SandboxRecord,
        row: &SnapshotRow,
        snapshot: SnapshotRef,
        count: usize,
        timeout_secs: Option<u64>,
        ticket: &limits::Ticket<'_>,
    ) -> Vec<ForkResult> {
        let source = Source {
            snapshot,
            snapshot_id: Some(row.id.clone()),
            previous_token: Some(row.source_token.clone()),
            template: false,
            cold_boot: false,
        };
        let req = CreateRequest {
            template_id: source_rec.template_id.clone(),
            metadata: source_rec.metadata.clone(),
            env_vars: source_rec.env_vars.clone(),
            auto_pause: source_rec.auto_pause,
            lifecycle: source_rec.lifecycle,
            // Children inherit the policy (and get their own traffic token).
            network: Some(source_rec.network.clone()),
            team: source_rec.team.clone(),
            // Their guests have the source's volumes mounted.
            volume_mounts: source_rec.volume_mounts.clone(),
            iam: source_rec.iam.clone(),
            ..Default::default()
        };
        let machine = source.snapshot.info().machine;
        let children = (0..count).map(|_| {
            let rec = self.new_record(&source_rec.template_id, machine, &req, timeout_secs);
            self.launch(rec, &source, timeout_secs, None, ticket)
        });
        join_all(children).await
    }

    /// Give fork capture `snapshot_id` of sandbox `id` its own RAM file
    /// (the source runs on meanwhile; the children wait for it), and open
    /// it again so the children map that file.
    async fn materialize(&self, id: &str, snapshot_id: &str) -> Result<SnapshotRef, SandboxError> {
        let t = Instant::now();
        {
            let _chains = self.chains.read().await;
            self.driver.snapshots().materialize(snapshot_id).await
        }
        .map_err(SandboxError::vm(id, "preparing the fork's RAM file"))?;
        tracing::debug!(
            snapshot = %snapshot_id,
            ms = t.elapsed().as_secs_f64() * 1e3,
            "fork capture has its own RAM file"
        );
        self.driver
            .snapshots()
            .open_snapshot(snapshot_id)
            .map_err(SandboxError::vm(id, "opening the fork capture"))
    }
}

/// Whether the `count` children of a fork share one RAM file of their own
/// (made for them) rather than each taking a private copy of the pages the
/// capture's layers hold: when the fork is at least `shared_from` big (0:
/// never) and the copies would hold at least as much memory as that file.
/// A small fork of a sandbox that changed little is cheaper without it, in
/// memory and in time (the file is a copy of the whole root RAM).
pub(super) fn share_fork_ram(shared_from: usize, count: usize, info: &SnapshotInfo) -> bool {
    let copies = (count as u64).saturating_mul(info.layer_bytes);
    shared_from > 0 && count >= shared_from && copies >= info.root_ram_bytes
}

#[cfg(test)]
mod share_tests {
    use super::*;

    fn info(layer_bytes: u64, root_ram_bytes: u64) -> SnapshotInfo {
        SnapshotInfo {
            id: "f-1".into(),
            machine: tine_vmm::Machine::default(),
            layers: 1,
            disk_size_mb: 1,
            layer_bytes,
            root_ram_bytes,
            memory_file: Default::default(),
        }
    }

    #[test]
    fn forks_share_a_ram_file_only_when_it_saves_memory() {
        let root = 120 << 20; // bytes of the root RAM file
        let changed = 20 << 20; // bytes of changed pages
                                // 4 × 20 MiB of copies < 120 MiB: each child takes its copy.
        assert!(!share_fork_ram(2, 4, &info(changed, root)));
        // 16 × 20 MiB > 120 MiB: one shared file.
        assert!(share_fork_ram(2, 16, &info(changed, root)));
        // Below the configured size, or with sharing off: never.
        assert!(!share_fork_ram(32, 16, &info(changed, root)));
        assert!(!share_fork_ram(0, 16, &info(changed, root)));
        // Exactly as much either way: share (the copies would be per child).
        assert!(share_fork_ram(2, 2, &info(root / 2, root)));
    }
}

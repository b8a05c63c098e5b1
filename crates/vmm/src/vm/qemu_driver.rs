//! QEMU as the [`Driver`] and [`SnapshotStore`]: [`QemuDriver`] over the data directory, and
//! [`Vm`] as a [`VmHandle`].

use std::time::Duration;

use super::{cleanup, list, Vm};
use crate::config::{Artifacts, Machine, Paths};
use crate::driver::{
    Capture, CaptureFailed, Driver, Guest, Probe, SnapshotInfo, SnapshotRef, SnapshotStore,
    VmHandle,
};
use crate::error::{Error, Result};
use crate::snapshot::Snapshot;
use crate::StartOptions;

/// VMs and snapshots under one data directory, run by QEMU.
#[derive(Clone)]
pub struct QemuDriver {
    paths: Paths,
    probe: Probe,
}

impl QemuDriver {
    /// `probe` tells when a started guest is ready.
    pub fn new(paths: Paths, probe: Probe) -> Self {
        Self { paths, probe }
    }

    pub fn paths(&self) -> &Paths {
        &self.paths
    }

    fn options(&self) -> StartOptions {
        StartOptions::new(self.probe.clone())
    }

    /// The guest ports of VM `id`, through its namespace, without taking
    /// the VM over (for clients that talk straight to a guest).
    pub fn guest_of(&self, id: &str) -> Result<Guest> {
        Ok(std::sync::Arc::new(crate::netns::Netns::open(
            &crate::netns::name_of(id),
        )?))
    }
}

/// The QEMU snapshot inside `snapshot`, if it is one.
fn qemu_snapshot(snapshot: &SnapshotRef) -> Result<&Snapshot> {
    snapshot.inner::<Snapshot>().ok_or_else(|| Error::Snapshot {
        path: snapshot.id().into(),
        detail: "not a snapshot of the QEMU driver".into(),
    })
}

/// A QEMU snapshot as the manager sees it.
fn snapshot_ref(snapshot: Snapshot) -> SnapshotRef {
    let disk_size_mb = snapshot
        .meta
        .artifacts
        .rootfs
        .size()
        .map(|len| u32::try_from(len >> 20).unwrap_or(u32::MAX))
        .unwrap_or(0);
    let info = SnapshotInfo {
        id: snapshot.meta.id.clone(),
        machine: snapshot.meta.machine,
        layers: snapshot.layers.len(),
        disk_size_mb,
        layer_bytes: (snapshot.ram_chain().page_count() * crate::ram::layer::PAGE) as u64,
        root_ram_bytes: {
            use std::os::unix::fs::MetadataExt;
            std::fs::metadata(&snapshot.ram).map_or(0, |m| m.blocks() * 512)
        },
        memory_file: snapshot.ram.clone(),
    };
    SnapshotRef::new(info, snapshot)
}

#[async_trait::async_trait]
impl Driver for QemuDriver {
    fn boot_devices(&self) -> String {
        let mut parts = Vec::new();
        if self.paths().balloon {
            parts.push("balloon");
        }
        if self.paths().guest_tsc && crate::Accel::probe() == crate::Accel::Tcg {
            parts.push("tsc");
        }
        parts.join(",")
    }

    async fn boot(
        &self,
        id: &str,
        machine: Machine,
        artifacts: &Artifacts,
    ) -> Result<Box<dyn VmHandle>> {
        let vm = Vm::boot(&self.paths, id, machine, artifacts, self.options()).await?;
        Ok(Box::new(vm))
    }

    async fn boot_from_disk(&self, id: &str, snapshot: &SnapshotRef) -> Result<Box<dyn VmHandle>> {
        let snapshot = qemu_snapshot(snapshot)?;
        let vm = Vm::boot_from_disk(&self.paths, id, snapshot, self.options()).await?;
        Ok(Box::new(vm))
    }

    async fn restore_paused(&self, id: &str, snapshot: &SnapshotRef) -> Result<Box<dyn VmHandle>> {
        let snapshot = qemu_snapshot(snapshot)?;
        let vm = Vm::restore_paused(&self.paths, id, snapshot, self.probe.clone()).await?;
        Ok(Box::new(vm))
    }

    async fn restore(&self, id: &str, snapshot: &SnapshotRef) -> Result<Box<dyn VmHandle>> {
        let snapshot = qemu_snapshot(snapshot)?;
        let vm = Vm::restore(&self.paths, id, snapshot, self.options()).await?;
        Ok(Box::new(vm))
    }

    async fn adopt(&self, id: &str) -> Result<Box<dyn VmHandle>> {
        Ok(Box::new(
            Vm::adopt(&self.paths, id, self.probe.clone()).await?,
        ))
    }

    async fn cleanup(&self, id: &str) {
        cleanup(&self.paths, id).await
    }

    fn salvage_capture(&self, id: &str, snapshot_id: &str) -> Result<bool> {
        super::salvage_capture(&self.paths, id, snapshot_id)
    }

    fn vm_ids(&self) -> Vec<String> {
        list(&self.paths)
    }

    fn console_log(&self, id: &str) -> String {
        let path = self.paths.vm_dir(id).join("console.log");
        String::from_utf8_lossy(&std::fs::read(path).unwrap_or_default()).into_owned()
    }

    fn snapshots(&self) -> &dyn SnapshotStore {
        self
    }
}

#[async_trait::async_trait]
impl SnapshotStore for QemuDriver {
    fn open_snapshot(&self, id: &str) -> Result<SnapshotRef> {
        Snapshot::open(&self.paths, id).map(snapshot_ref)
    }

    fn unneeded_snapshots(
        &self,
        keep: &std::collections::HashSet<String>,
        grace: Duration,
    ) -> Vec<String> {
        crate::reclaim::unneeded_snapshots(&self.paths, keep, grace)
    }

    fn remove_stale_temp_files(&self, grace: Duration) -> usize {
        // Not while a compaction or materialization writes its own.
        let Ok(_no_rewrite) = crate::compact::REWRITES.try_lock() else {
            return 0;
        };
        let files = crate::reclaim::stale_temp_files(&self.paths, grace);
        for f in &files {
            tracing::info!(file = %f.display(), "removing a temp file a cut-short rewrite left");
            let _ = std::fs::remove_file(f);
        }
        files.len() + crate::disk::OverlayCache::new(self.paths.overlay_cache_dir()).prune(grace)
    }

    fn free_disk_bytes(&self) -> Option<u64> {
        let st = nix::sys::statvfs::statvfs(&self.paths.data_dir).ok()?;
        Some(st.blocks_available() as u64 * st.fragment_size() as u64)
    }

    fn snapshot_bytes(&self, id: &str) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::read_dir(self.paths.snapshot_dir(id))
            .map(|rd| {
                rd.flatten()
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.blocks() * 512)
                    .sum()
            })
            .unwrap_or(0)
    }

    fn delete_snapshot(&self, id: &str) -> Result<()> {
        Snapshot::delete(&self.paths, id)
    }

    async fn compact(&self, id: &str) -> Result<Option<String>> {
        crate::compact::compact(&self.paths, id).await
    }

    async fn materialize(&self, id: &str) -> Result<bool> {
        crate::compact::materialize(&self.paths, id).await
    }
}

#[async_trait::async_trait]
impl VmHandle for Vm {
    fn id(&self) -> &str {
        Vm::id(self)
    }

    fn process_id(&self) -> i32 {
        self.pid()
    }

    fn exit_status(&self) -> Option<String> {
        Vm::exit_status(self)
    }

    fn memory_file(&self) -> Option<std::path::PathBuf> {
        Some(self.record().ram.clone())
    }

    fn guest(&self) -> Guest {
        Vm::guest(self)
    }

    async fn start(&mut self) -> Result<()> {
        self.start_restored(None).await
    }

    async fn pause(&mut self) -> Result<()> {
        Vm::pause(self).await
    }

    async fn ensure_running(&mut self) -> Result<()> {
        match self.state() {
            super::VmState::Paused => Vm::resume(self).await,
            _ => Ok(()),
        }
    }

    async fn check_running(&mut self) -> Result<Option<String>> {
        Vm::check_running(self).await
    }

    async fn capture(&mut self, snapshot_id: &str) -> Result<Capture> {
        let snapshot = self.snapshot(snapshot_id).await?;
        Ok(Capture {
            snapshot: snapshot_ref(snapshot),
            vcpus_stopped: self.last_capture_stop().unwrap_or(Duration::ZERO),
        })
    }

    async fn capture_and_kill(
        self: Box<Self>,
        snapshot_id: &str,
    ) -> std::result::Result<SnapshotRef, CaptureFailed> {
        Vm::capture_and_kill(*self, snapshot_id)
            .await
            .map(snapshot_ref)
            .map_err(|(error, vm)| CaptureFailed {
                error,
                vm: vm.map(|vm| Box::new(vm) as Box<dyn VmHandle>),
            })
    }

    async fn kill(self: Box<Self>) -> Result<()> {
        Vm::kill(*self).await
    }
}

impl From<Snapshot> for SnapshotRef {
    fn from(snapshot: Snapshot) -> Self {
        snapshot_ref(snapshot)
    }
}

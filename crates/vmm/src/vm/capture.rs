//! Capturing a VM into a snapshot: stop it, save its device state, seal
//! its disk overlay and RAM into the snapshot, then continue it as a clone
//! of the capture or remove it.

use std::time::{Duration, Instant};

use serde_json::json;

use super::{unix_ms, write_atomic, Vm, VmState};
use crate::error::{Error, IoContext, Result};
use crate::netns::Netns;
use crate::snapshot::{Snapshot, SnapshotMeta, META_VERSION};

impl Vm {
    /// Capture the VM as snapshot `snap_id`: stop it, save its device state
    /// (RAM stays in its file thanks to `x-ignore-shared`), seal its disk
    /// overlay and RAM file into the snapshot, then continue this VM as a
    /// clone of that snapshot (its RAM MAP_PRIVATE over the frozen file).
    ///
    /// A VM that is itself a clone maps its RAM privately, so QEMU writes
    /// all of its RAM into the device state instead, and clones of that
    /// snapshot load it from there (incremental RAM layers are future work).
    pub async fn snapshot(&mut self, snap_id: &str) -> Result<Snapshot> {
        let t = Instant::now();
        let snapshot = self.capture(snap_id).await?;
        let captured = t.elapsed();
        // Continue as a clone of the snapshot, in the same namespace.
        let netns = Netns::open(&self.record.netns)?;
        let id = self.id().to_string();
        let clone = Vm::launch_clone(&self.paths, &id, netns, &snapshot).await?;
        *self = clone;
        self.start_restored(None).await?;
        tracing::info!(
            vm = self.id(),
            snapshot = snap_id,
            capture_ms = captured.as_secs_f64() * 1e3,
            continued_ms = (t.elapsed() - captured).as_secs_f64() * 1e3,
            "snapshot taken; the VM continues as its clone"
        );
        Ok(snapshot)
    }

    /// Capture the VM as snapshot `snap_id` (as [`Vm::snapshot`]), then
    /// remove the VM instead of continuing it (building a template).
    pub async fn capture_and_kill(mut self, snap_id: &str) -> Result<Snapshot> {
        let captured = self.capture(snap_id).await;
        self.kill().await?;
        captured
    }

    /// Stop, save and seal; leaves the VM `Stopped` with its QEMU gone.
    async fn capture(&mut self, snap_id: &str) -> Result<Snapshot> {
        self.require(&[VmState::Running, VmState::Paused], "snapshot")?;
        let snap_dir = self.paths.snapshot_dir(snap_id);
        let snap_ram = self.paths.snapshot_ram(snap_id);
        if snap_dir.exists() {
            return Err(Error::Snapshot {
                path: snap_dir,
                detail: "already exists".into(),
            });
        }
        std::fs::create_dir_all(&snap_dir).ctx(|| format!("creating {}", snap_dir.display()))?;
        let state_tmp = snap_dir.join("state.partial");
        // A clone's RAM is private, so QEMU streams all of it into the state;
        // that stream is then flattened into a RAM file (see `flatten`).
        let stream = if self.record.ram_shared {
            state_tmp.clone()
        } else {
            snap_dir.join("state.full")
        };

        let t_save = Instant::now();
        if self.state == VmState::Running {
            self.qmp.run("stop", None).await?;
            self.state = VmState::Paused;
        }
        let saved = async {
            // Shared RAM stays in its file; private RAM is streamed without
            // the capability, as `flatten` loads it (a QEMU with it on
            // refuses pages for RAM it maps shared).
            self.qmp
                .set_migrate_capability("x-ignore-shared", self.record.ram_shared)
                .await?;
            self.qmp
                .run(
                    "migrate",
                    Some(json!({ "uri": format!("file:{}", stream.display()) })),
                )
                .await?;
            self.qmp.wait_migration("saving the device state").await?;
            Ok::<_, Error>(())
        }
        .await;
        tracing::debug!(
            vm = self.id(),
            state_saved_ms = t_save.elapsed().as_secs_f64() * 1e3,
            "device state saved"
        );
        if let Err(e) = saved {
            let _ = Snapshot::delete(&self.paths, snap_id);
            return Err(e);
        }
        // The state is saved; QEMU's exit closes the disk (flushed when the
        // migration completed) and leaves the RAM file as it is.
        let _ = self.qmp.run("quit", None).await;
        if tokio::time::timeout(Duration::from_secs(10), self.process.wait())
            .await
            .is_err()
        {
            self.process.kill().await;
        }
        self.state = VmState::Stopped;

        let files = self.files();
        std::fs::rename(files.disk(), snap_dir.join("disk.qcow2"))
            .ctx(|| "sealing the disk overlay".into())?;
        if self.record.ram_shared {
            let t = Instant::now();
            let bytes = crate::snapshot::move_sparse(&self.record.ram, &snap_ram)
                .ctx(|| "freezing the RAM file".into())?;
            tracing::debug!(
                vm = self.id(),
                mib = bytes >> 20,
                ms = t.elapsed().as_secs_f64() * 1e3,
                "RAM moved into the snapshot"
            );
        } else {
            let t = Instant::now();
            let job = crate::flatten::Flatten {
                netns: &self.netns,
                machine: self.record.machine,
                artifacts: &self.record.artifacts,
                disk: &snap_dir.join("disk.qcow2"),
                work_dir: &files.dir,
            };
            let flattened = job.run(&stream, &snap_ram, &state_tmp).await;
            let _ = std::fs::remove_file(&stream);
            if let Err(e) = flattened {
                let _ = Snapshot::delete(&self.paths, snap_id);
                return Err(e);
            }
            tracing::debug!(
                vm = self.id(),
                flatten_ms = t.elapsed().as_secs_f64() * 1e3,
                "RAM flattened into a file"
            );
        }
        std::fs::rename(&state_tmp, snap_dir.join("state"))
            .ctx(|| "finishing the device state".into())?;
        let meta = SnapshotMeta {
            version: META_VERSION,
            id: snap_id.to_string(),
            source_vm: self.id().to_string(),
            machine: self.record.machine,
            artifacts: self.record.artifacts.clone(),
            extra_cmdline: self.record.extra_cmdline.clone(),
            created_unix_ms: unix_ms(),
        };
        write_atomic(
            &snap_dir.join("meta.json"),
            &serde_json::to_vec_pretty(&meta).expect("meta serializes"),
        )?;
        let snapshot = Snapshot::open(&self.paths, snap_id)?;
        Ok(snapshot)
    }
}

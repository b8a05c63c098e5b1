//! Restoring: a clone of a snapshot, its RAM file mapped MAP_PRIVATE with
//! the snapshot's RAM layers written over it, its device state loaded
//! over QMP, and the pages it writes tracked for its next capture.

use std::time::{Duration, Instant};

use serde_json::json;

use crate::config::Paths;
use crate::disk;
use crate::driver::Probe;
use crate::error::{Error, IoContext, Result};
use crate::netns::Netns;
use crate::ram::{GuestRam, WriteTracker};
use crate::snapshot::Snapshot;

use super::files::prepare_dirs;
use super::launch::Origin;
use super::{cleanup, log_tail, StartOptions, Vm, VmFiles, VmRecord, VmState, RESTORE_TIMEOUT};

impl Vm {
    /// Start a clone of `snapshot`: its RAM file mapped MAP_PRIVATE, a new
    /// overlay over its frozen disk, its device state loaded over QMP.
    pub async fn restore(
        paths: &Paths,
        id: &str,
        snapshot: &Snapshot,
        opts: StartOptions,
    ) -> Result<Vm> {
        let t = Instant::now();
        let mut vm = Vm::restore_paused(paths, id, snapshot, opts.probe.clone()).await?;
        let loaded = t.elapsed();
        let started = vm.start_restored(opts.ready_timeout).await;
        if started.is_err() {
            cleanup(paths, id).await;
        }
        started?;
        tracing::debug!(
            vm = id,
            loaded_ms = loaded.as_secs_f64() * 1e3,
            ready_ms = t.elapsed().as_secs_f64() * 1e3,
            "restored"
        );
        Ok(vm)
    }

    /// The first half of [`Vm::restore`]: namespace, overlay, QEMU and the
    /// device state loaded, vCPUs not yet running (state `Paused`). A warm
    /// pool keeps VMs in this state; [`Vm::start_restored`] finishes.
    pub async fn restore_paused(
        paths: &Paths,
        id: &str,
        snapshot: &Snapshot,
        probe: Probe,
    ) -> Result<Vm> {
        let files = VmFiles::new(paths, id);
        prepare_dirs(&files.dir, &paths.vm_ram_dir(id))?;
        let result = async {
            let t = Instant::now();
            let netns = Netns::create(id).await?;
            tracing::debug!(
                vm = id,
                netns_ms = t.elapsed().as_secs_f64() * 1e3,
                "namespace ready"
            );
            Vm::launch_clone(paths, id, netns, snapshot, probe).await
        }
        .await;
        if result.is_err() {
            cleanup(paths, id).await;
        }
        result
    }

    /// Run a VM from [`Vm::restore_paused`] and wait until its agent answers.
    pub async fn start_restored(&mut self, ready_timeout: Option<Duration>) -> Result<()> {
        self.resume().await?;
        self.wait_ready(ready_timeout.unwrap_or(RESTORE_TIMEOUT), "after restore")
            .await
    }

    /// Spawn QEMU for a clone of `snapshot` in `netns` and load the device
    /// state; the clone stays paused.
    pub(super) async fn launch_clone(
        paths: &Paths,
        id: &str,
        netns: Netns,
        snapshot: &Snapshot,
        probe: Probe,
    ) -> Result<Vm> {
        let files = VmFiles::new(paths, id);
        let t = Instant::now();
        let _ = std::fs::remove_file(files.disk());
        disk::OverlayCache::new(paths.overlay_cache_dir())
            .create_overlay(&snapshot.disk_path(), &files.disk())
            .await?;
        let t_overlay = t.elapsed();
        let meta = &snapshot.meta;
        let record = VmRecord {
            id: id.to_string(),
            pid: 0,
            netns: netns.name().to_string(),
            machine: meta.machine,
            artifacts: meta.artifacts.clone(),
            extra_cmdline: meta.extra_cmdline.clone(),
            ram_shared: false,
            ram: snapshot.ram.clone(),
            parent: Some(meta.id.clone()),
            disk_generation: 0,
            uid: None,
            disk_over: snapshot.disk_lineage(),
            balloon: meta.balloon,
        };
        let mut vm = Vm::launch(
            paths,
            record,
            netns,
            probe,
            "while restoring",
            Origin::Restore(snapshot),
        )
        .await?;
        let t_qmp = t.elapsed();
        if let Err(e) = vm.write_layers(snapshot).await {
            vm.process.kill().await;
            return Err(e);
        }
        let t_layers = t.elapsed();
        // Its RAM is now exactly the snapshot's: what it writes from here
        // on is what its next capture must look at.
        vm.tracker = vm.open_tracking(false).await;
        let t_tracked = t.elapsed();
        let state = snapshot.state_path();
        let loaded = async {
            vm.qmp
                .run(
                    "migrate-incoming",
                    Some(json!({ "uri": format!("file:{}", state.display()) })),
                )
                .await?;
            vm.qmp.wait_migration("loading the device state").await
        }
        .await;
        if let Err(e) = loaded {
            // QEMU usually exits when a stream is bad; report its own words.
            let _ = tokio::time::timeout(Duration::from_secs(2), vm.process.wait()).await;
            return Err(Error::Snapshot {
                path: snapshot.dir.clone(),
                detail: format!(
                    "QEMU could not load the device state: {e}; QEMU said: {:?}",
                    log_tail(&vm.files().qemu_log(), 600)
                ),
            });
        }
        // Loaded but not running (`-S`).
        vm.state = VmState::Paused;
        tracing::debug!(
            vm = id,
            overlay_ms = t_overlay.as_secs_f64() * 1e3,
            qemu_qmp_ms = (t_qmp - t_overlay).as_secs_f64() * 1e3,
            layers_ms = (t_layers - t_qmp).as_secs_f64() * 1e3,
            tracking_ms = (t_tracked - t_layers).as_secs_f64() * 1e3,
            migrate_ms = (t.elapsed() - t_tracked).as_secs_f64() * 1e3,
            tracked = vm.tracker.is_some(),
            "clone loaded"
        );
        Ok(vm)
    }

    /// Write the snapshot's RAM layers into a clone that has not run yet
    /// (its QEMU maps the root RAM file MAP_PRIVATE).
    async fn write_layers(&self, snapshot: &Snapshot) -> Result<()> {
        if snapshot.layers.is_empty() {
            return Ok(());
        }
        let t = Instant::now();
        let snapshot = snapshot.clone();
        let pid = self.pid();
        let pages = crate::blocking(move || snapshot.write_ram_layers(pid)).await?;
        tracing::debug!(
            vm = self.id(),
            pages,
            ms = t.elapsed().as_secs_f64() * 1e3,
            "RAM layers written"
        );
        Ok(())
    }

    /// Track the writes of this clone: one that has not run yet (its RAM
    /// is its snapshot's, so tracking starts armed), or one `adopted` from
    /// another tine process (disarmed until its next capture). Without the
    /// shim's userfaultfd, or if the kernel refuses, its captures compare
    /// every private page instead.
    pub(super) async fn open_tracking(
        &self,
        adopted: bool,
    ) -> Option<std::sync::Arc<WriteTracker>> {
        let keep = self.paths.track_writes;
        if self.record.ram_shared || (!adopted && !keep) || !crate::ram::tracker::supported() {
            return None;
        }
        let pid = self.pid();
        let root = self.record.ram.clone();
        let bytes = u64::from(self.record.machine.memory_mib) << 20;
        let opened = crate::blocking(move || {
            let ram = GuestRam::find(pid, &root, bytes)
                .ctx(|| format!("finding the guest RAM of QEMU {pid}"))?;
            let t = if adopted {
                WriteTracker::reattach(&ram)
            } else {
                WriteTracker::attach(&ram)
            };
            let t = t.ctx(|| format!("tracking the writes of QEMU {pid}"))?;
            match t {
                // Adopted with tracking now off: lift the old protection,
                // whose markers would read as swapped pages to the compare.
                Some(t) if !keep => t
                    .protect_all(false)
                    .map(|()| None)
                    .ctx(|| format!("lifting QEMU {pid}'s write protection")),
                t => Ok(t),
            }
        })
        .await;
        match opened {
            Ok(t) => {
                if t.is_none() && keep {
                    tracing::debug!(vm = self.id(), "QEMU has no userfaultfd: no write tracking");
                }
                t.map(std::sync::Arc::new)
            }
            Err(e) => {
                tracing::warn!(
                    vm = self.id(),
                    "no write tracking; captures compare every page: {e}"
                );
                None
            }
        }
    }
}

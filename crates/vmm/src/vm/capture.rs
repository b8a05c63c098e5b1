//! Capturing a VM into a snapshot.
//!
//! Every capture stops the vCPUs and saves the device state without RAM
//! (`xen-save-devices-state`: a few ms, tens of KB). Then:
//!
//! - a *restored* VM (RAM mapped MAP_PRIVATE over its parent's root file)
//!   writes a RAM layer of the pages that differ from its parent (see
//!   [`crate::ram`]) and seals its disk overlay by stacking a new one on
//!   top (`blockdev-snapshot-sync`). Neither grows with the guest's RAM
//!   size or with bytes written to disk, and the VM continues in the same
//!   QEMU process;
//! - a *booted* VM (RAM in a shared file) becomes a root snapshot: QEMU
//!   exits, its RAM file moves into the snapshot, and if the VM is to
//!   continue it is restored as a clone of that snapshot.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::json;

use super::{Vm, VmRecord, VmState};
use crate::blocking;
use crate::disk::{self, BackingFormat};
use crate::error::{Error, IoContext, Result};
use crate::netns::Netns;
use crate::ram::{self, layer::PAGE, Chain, Current, GuestRam, WriteTracker};
use crate::snapshot::{Snapshot, LAYER_FILE};

/// Most bytes of changed pages a capture copies out of a VM to let it run
/// on while the layer is written; beyond it the VM stays stopped until
/// the layer is on disk.
const COPY_LIMIT: usize = 256 << 20;

/// The RAM half of a capture, between the VM's stop and the layer's write.
struct RamCapture {
    parent: String,
    chain: std::sync::Arc<Chain>,
    candidates: Vec<u64>,
    copy: Option<Vec<u8>>,
    out: std::path::PathBuf,
    /// The write protection was set from this capture.
    rearmed: bool,
}

/// What happens to the VM after its capture.
#[derive(Clone, Copy, PartialEq, Eq)]
enum After {
    /// It goes on in the same QEMU (restored VMs only), running again as
    /// soon as its state is taken if it was running.
    Continue,
    /// Its QEMU exits.
    Exit,
}

impl Vm {
    /// Capture the VM as snapshot `snap_id`; the VM continues (running if
    /// it was). Its RNG state and clock are now also in the snapshot, so a
    /// caller that restores clones reseeds them (and this VM if it wants).
    pub async fn snapshot(&mut self, snap_id: &str) -> Result<Snapshot> {
        let t = Instant::now();
        let was_running = self.state == VmState::Running;
        if !self.record.ram_shared {
            // The capture lets the VM run again as soon as it can; if it
            // failed before that, this does.
            let captured = self.capture(snap_id, After::Continue).await;
            if was_running && self.state == VmState::Paused {
                self.resume().await?;
            }
            let snapshot = captured?;
            tracing::info!(
                vm = self.id(),
                snapshot = snap_id,
                total_ms = t.elapsed().as_secs_f64() * 1e3,
                "snapshot taken; the VM continues"
            );
            return Ok(snapshot);
        }
        let snapshot = self.capture(snap_id, After::Exit).await?;
        let captured = t.elapsed();
        // The RAM file is now the snapshot's: continue as its clone, in the
        // same namespace.
        let netns = Netns::open(&self.record.netns)?;
        let id = self.id().to_string();
        let clone =
            Vm::launch_clone(&self.paths, &id, netns, &snapshot, self.probe.clone()).await?;
        *self = clone;
        if was_running {
            self.start_restored(None).await?;
        }
        tracing::info!(
            vm = self.id(),
            snapshot = snap_id,
            capture_ms = captured.as_secs_f64() * 1e3,
            continued_ms = (t.elapsed() - captured).as_secs_f64() * 1e3,
            "root snapshot taken; the VM continues as its clone"
        );
        Ok(snapshot)
    }

    /// Capture the VM as snapshot `snap_id`, then remove the VM (pause,
    /// template builds). If the capture fails before QEMU exits (a full
    /// disk while writing the state or the RAM layer), the VM is given
    /// back with the error, running again if it was; otherwise it is gone.
    pub async fn capture_and_kill(
        mut self,
        snap_id: &str,
    ) -> std::result::Result<Snapshot, (Error, Option<Vm>)> {
        let was_running = self.state == VmState::Running;
        match self.capture(snap_id, After::Exit).await {
            Ok(snapshot) => self.kill().await.map(|()| snapshot).map_err(|e| (e, None)),
            Err(e) => {
                if self.state != VmState::Stopped && self.process.exit_status().is_none() {
                    let back = match (was_running, self.state) {
                        (true, VmState::Paused) => self.resume().await,
                        _ => Ok(()),
                    };
                    if back.is_ok() {
                        tracing::warn!(vm = self.id(), "capture failed, the VM goes on: {e}");
                        return Err((e, Some(self)));
                    }
                }
                let _ = self.kill().await;
                Err((e, None))
            }
        }
    }

    async fn capture(&mut self, snap_id: &str, after: After) -> Result<Snapshot> {
        self.require(&[VmState::Running, VmState::Paused], "snapshot")?;
        let snap_dir = self.paths.snapshot_dir(snap_id);
        if snap_dir.exists() {
            return Err(Error::Snapshot {
                path: snap_dir,
                detail: "already exists".into(),
            });
        }
        std::fs::create_dir_all(&snap_dir).ctx(|| format!("creating {}", snap_dir.display()))?;
        let generation = self.record.disk_generation;
        let captured = match crate::snapshot::reserve_meta(&snap_dir) {
            Ok(()) => self.capture_into(snap_id, &snap_dir, after).await,
            Err(e) => Err(e),
        };
        // A failed capture leaves the write tracker disarmed (its scan
        // disarmed it; only a finished capture confirms it).
        if captured.is_err() {
            if self.record.disk_generation == generation {
                let _ = Snapshot::delete(&self.paths, snap_id);
                let _ = std::fs::remove_file(self.files().disk_generation(generation + 1));
            } else {
                // The disk was sealed into the snapshot directory and the
                // VM's new overlay is backed by it there: keep that file,
                // on disk, since the VM's next capture is layered over it.
                let partial = format!("{LAYER_FILE}.partial");
                for name in ["state", "meta.json", "meta.json.tmp", LAYER_FILE, &partial] {
                    let _ = std::fs::remove_file(snap_dir.join(name));
                }
                let mut keep = vec![snap_dir.join("disk.qcow2"), snap_dir.clone()];
                keep.extend(snap_dir.parent().map(Path::to_path_buf));
                if let Err(e) = blocking(move || crate::snapshot::sync_all(&keep)).await {
                    tracing::error!(vm = self.id(), "the sealed disk layer is not synced: {e}");
                }
                tracing::warn!(
                    vm = self.id(),
                    dir = %snap_dir.display(),
                    "capture failed after sealing the disk; its disk layer stays (the VM's disk is stacked on it)"
                );
            }
        }
        captured
    }

    async fn capture_into(&mut self, snap_id: &str, dir: &Path, after: After) -> Result<Snapshot> {
        // What its disk is layered over now: the snapshot's disk will be.
        let disk_over = self.record.disk_over.clone();
        // The overlay QEMU will switch to is made before the VM stops.
        let next = match after {
            After::Continue => Some(self.prepare_next_overlay(dir).await?),
            After::Exit => None,
        };
        let was_running = self.state == VmState::Running;
        let t = Instant::now();
        self.stop_and_save_state(dir).await?;
        let t_state = t.elapsed();
        let ram = if self.record.ram_shared {
            None
        } else {
            Some(self.capture_ram(dir, after).await?)
        };
        let t_ram = t.elapsed();
        match next {
            Some(next) => {
                self.seal_disk_in_place(dir, &next).await?;
                if was_running {
                    self.resume().await?;
                }
            }
            None => {
                self.exit_into(dir).await?;
                crate::failpoint::hit("capture.after_exit");
            }
        }
        let t_stopped = t.elapsed();
        self.last_stop = Some(t_stopped);
        let rearmed = ram.as_ref().is_some_and(|r| r.rearmed);
        let parent = match ram {
            Some(ram) => Some(self.finish_layer(ram, dir).await?),
            None => None,
        };
        let snapshot = self
            .write_meta(snap_id, dir, parent, disk_over, after)
            .await?;
        if let (true, After::Continue, Some(tracker)) = (rearmed, after, &self.tracker) {
            // This capture is now the VM's parent: what its scan protected
            // again is what the next capture must look at.
            tracker.confirm();
        }
        // Its restore (a resume, a fork's children) will want an overlay
        // over its disk: make the blank one now, off that path.
        let cache = crate::disk::OverlayCache::new(self.paths.overlay_cache_dir());
        let disk = snapshot.disk_path();
        tokio::spawn(async move {
            if let Err(e) = cache.warm(&disk).await {
                tracing::debug!(disk = %disk.display(), "no blank overlay cached: {e}");
            }
        });
        tracing::debug!(
            vm = self.id(),
            snapshot = snap_id,
            state_ms = t_state.as_secs_f64() * 1e3,
            ram_ms = (t_ram - t_state).as_secs_f64() * 1e3,
            disk_ms = (t_stopped - t_ram).as_secs_f64() * 1e3,
            stopped_ms = t_stopped.as_secs_f64() * 1e3,
            layer_ms = (t.elapsed() - t_stopped).as_secs_f64() * 1e3,
            "captured"
        );
        Ok(snapshot)
    }

    /// Stop the vCPUs (if they run) and save the device state into `dir`.
    async fn stop_and_save_state(&mut self, dir: &Path) -> Result<()> {
        if self.state == VmState::Running {
            self.qmp.run("stop", None).await?;
            self.state = VmState::Paused;
        }
        // QEMU writes where a jailed QEMU can (a file made for it in the
        // VM's directory); tine moves it into the snapshot.
        let saving = self.files().state_saving();
        std::fs::write(&saving, b"").ctx(|| format!("creating {}", saving.display()))?;
        if let Some(uid) = self.record.uid {
            crate::jail::own(&saving, uid, 0o600)?;
        }
        self.qmp
            .run(
                "xen-save-devices-state",
                Some(json!({ "filename": saving, "live": false })),
            )
            .await?;
        let state = dir.join("state");
        std::fs::rename(&saving, &state).ctx(|| format!("moving {}", saving.display()))?;
        crate::jail::share(&state)
    }

    /// End QEMU and move its disk overlay (and a booted VM's RAM file)
    /// into the snapshot directory `dir`.
    async fn exit_into(&mut self, dir: &Path) -> Result<()> {
        self.quit().await;
        let disk = dir.join("disk.qcow2");
        std::fs::rename(self.active_disk(), &disk).ctx(|| "sealing the disk overlay".into())?;
        crate::jail::share(&disk)?;
        if self.record.ram_shared {
            freeze_ram(&self.record.ram, dir)?;
        }
        Ok(())
    }

    /// Flush the snapshot's files and publish its `meta.json` (its parent:
    /// the RAM layer's base), then open it; a VM that continues captures
    /// over it next.
    async fn write_meta(
        &mut self,
        snap_id: &str,
        dir: &Path,
        parent: Option<String>,
        disk_over: Option<Vec<std::path::PathBuf>>,
        after: After,
    ) -> Result<Snapshot> {
        let meta = capture_meta(&self.record, snap_id, dir, parent, disk_over)?;
        let bytes = serde_json::to_vec_pretty(&meta).expect("meta serializes");
        let dir_owned = dir.to_path_buf();
        blocking(move || crate::snapshot::publish(&dir_owned, &bytes)).await?;
        let snapshot = Snapshot::open(&self.paths, snap_id)?;
        if after == After::Continue {
            self.record.parent = Some(snap_id.to_string());
            self.save_record()?;
        }
        Ok(snapshot)
    }

    /// The RAM half of capturing this (stopped, restored) VM: find the
    /// pages that may differ from its parent. If the VM is to continue and
    /// they fit [`COPY_LIMIT`], copy them out so it can run on while the
    /// layer is written; otherwise write the layer now.
    async fn capture_ram(&self, dir: &Path, after: After) -> Result<RamCapture> {
        let t_open = Instant::now();
        let parent = self.record.parent.clone().ok_or_else(|| Error::Snapshot {
            path: dir.to_path_buf(),
            detail: format!("VM {} maps private RAM but names no parent", self.id()),
        })?;
        let chain = Snapshot::open(&self.paths, &parent)?.ram_chain();
        let pid = self.pid();
        let root = self.record.ram.clone();
        let bytes = u64::from(self.record.machine.memory_mib) << 20;
        let out = dir.join(format!("{LAYER_FILE}.partial"));
        let tracker = self.tracker.clone();
        let id = self.id().to_string();
        blocking(move || {
            let ram = GuestRam::find(pid, &root, bytes)
                .ctx(|| format!("finding the guest RAM of QEMU {pid}"))?;
            let open_ms = t_open.elapsed().as_secs_f64() * 1e3;
            let t = Instant::now();
            let tracked = tracker.as_deref().is_some_and(WriteTracker::armed);
            let (candidates, rearmed) = candidates(&ram, &chain, tracker.as_deref(), &id)?;
            tracing::debug!(
                vm = %id,
                pages = candidates.len(),
                tracked,
                open_ms,
                scan_ms = t.elapsed().as_secs_f64() * 1e3,
                "RAM scanned"
            );
            let copy = if after == After::Continue && candidates.len() * PAGE <= COPY_LIMIT {
                Some(
                    ram::copy_out(&ram, &candidates)
                        .ctx(|| format!("copying pages out of QEMU {pid}"))?,
                )
            } else {
                let written = ram::write_layer(&candidates, &Current::Live(&ram), &chain, &out)
                    .ctx(|| format!("writing {}", out.display()))?;
                tracing::debug!(pages = written.0, data = written.1, "RAM layer written");
                None
            };
            Ok(RamCapture {
                parent,
                chain,
                candidates,
                copy,
                out,
                rearmed,
            })
        })
        .await
    }

    /// Finish the RAM layer (from the copy, if one was taken); returns the
    /// parent it is over.
    async fn finish_layer(&self, ram: RamCapture, dir: &Path) -> Result<String> {
        let RamCapture {
            parent,
            chain,
            candidates,
            copy,
            out,
            ..
        } = ram;
        if let Some(data) = copy {
            let path = out.clone();
            let (pages, data) = blocking(move || {
                let current = Current::Copied {
                    pages: &candidates,
                    data: &data,
                };
                ram::write_layer(&candidates, &current, &chain, &path)
                    .ctx(|| format!("writing {}", path.display()))
            })
            .await?;
            tracing::debug!(vm = self.id(), pages, data, "RAM layer written");
        }
        let layer = dir.join(LAYER_FILE);
        std::fs::rename(&out, &layer).ctx(|| "finishing the RAM layer".into())?;
        // Summed as it was written: its next open need not read it back.
        std::fs::File::open(&layer)
            .and_then(|f| crate::checksum::written(&f))
            .ctx(|| format!("opening {}", layer.display()))?;
        Ok(parent)
    }

    /// Create the overlay the VM's disk continues in after a capture into
    /// `dir`: over `dir`'s `disk.qcow2` (not there yet; `-u`).
    async fn prepare_next_overlay(&self, dir: &Path) -> Result<std::path::PathBuf> {
        let next = self
            .files()
            .disk_generation(self.record.disk_generation + 1);
        let _ = std::fs::remove_file(&next);
        let size = disk::qcow2_virtual_size(&self.active_disk())?;
        disk::create_overlay_unchecked(&dir.join("disk.qcow2"), BackingFormat::Qcow2, &next, size)
            .await?;
        if let Some(uid) = self.record.uid {
            crate::jail::own(&next, uid, 0o600)?;
        }
        Ok(next)
    }

    /// Seal the disk overlay into `dir` while QEMU keeps running: the
    /// overlay becomes the snapshot's (a hard link, no copy) and QEMU
    /// stacks `next` over it and stops writing to it. The old name stays:
    /// QEMU reopens the old overlay by it.
    async fn seal_disk_in_place(&mut self, dir: &Path, next: &Path) -> Result<()> {
        let active = self.active_disk();
        let sealed = dir.join("disk.qcow2");
        std::fs::hard_link(&active, &sealed).ctx(|| "linking the disk overlay".into())?;
        let stacked = async {
            self.qmp
                .run(
                    "blockdev-snapshot-sync",
                    Some(json!({
                        "device": "root",
                        "snapshot-file": next,
                        "format": "qcow2",
                        "mode": "existing",
                    })),
                )
                .await?;
            Ok::<_, Error>(())
        }
        .await;
        if let Err(e) = stacked {
            let _ = std::fs::remove_file(next);
            let _ = std::fs::remove_file(&sealed);
            return Err(e);
        }
        // Recorded at once: after a crash, the VM is adopted with the
        // overlay QEMU writes now, over the sealed one.
        self.record.disk_generation += 1;
        self.record.disk_over = self
            .record
            .disk_over
            .take()
            .map(|below| std::iter::once(sealed.clone()).chain(below).collect());
        self.save_record()?;
        // QEMU holds it read-only now; every clone's jail may read it.
        crate::jail::share(&sealed)
    }

    /// Ask QEMU to exit (killing it if it does not); the VM is `Stopped`.
    async fn quit(&mut self) {
        let _ = self.qmp.run("quit", None).await;
        if tokio::time::timeout(Duration::from_secs(10), self.process.wait())
            .await
            .is_err()
        {
            self.process.kill().await;
        }
        self.state = VmState::Stopped;
    }
}

/// The pages of a stopped clone its capture must look at: those written
/// since its last capture if its writes are tracked, else every private
/// page and the parent chain's. Either way the protection is set again
/// from this capture (the bool says so); the tracker trusts it only once
/// the capture is the VM's parent ([`WriteTracker::confirm`]).
fn candidates(
    ram: &GuestRam,
    chain: &Chain,
    tracker: Option<&WriteTracker>,
    id: &str,
) -> Result<(Vec<u64>, bool)> {
    let pid = ram.pid();
    if let Some(t) = tracker.filter(|t| t.armed()) {
        match t.written() {
            Ok(pages) => return Ok((pages, true)),
            Err(e) => {
                tracing::warn!(vm = id, "write tracking failed; comparing every page: {e}")
            }
        }
    }
    // Protected pages that were never written read as swapped in the page
    // map: lift the protection so the page map tells the private ones.
    if let Some(t) = tracker {
        if let Err(e) = t.protect_all(false) {
            tracing::warn!(vm = id, "write protection not lifted: {e}");
        }
    }
    let pages = ram::candidates(ram, chain).ctx(|| format!("scanning QEMU {pid}'s RAM"))?;
    let rearmed = match tracker.map(|t| t.protect_all(true)) {
        Some(Ok(())) => true,
        Some(Err(e)) => {
            tracing::warn!(vm = id, "write tracking not re-armed: {e}");
            false
        }
        None => false,
    };
    Ok((pages, rearmed))
}

/// Move a booted VM's RAM file `ram` (its QEMU has exited) into snapshot
/// directory `dir` as `ram`: copied to `ram.partial`, synced, renamed, so
/// `ram` is never a torn copy.
pub(super) fn freeze_ram(ram: &Path, dir: &Path) -> Result<()> {
    // The RAM directory was the jail's: QEMU could have left a link there
    // to a file it could not read. It has quit, so nothing changes the
    // file between this check and the move.
    let kind = std::fs::symlink_metadata(ram)
        .ctx(|| format!("stat {}", ram.display()))?
        .file_type();
    if !kind.is_file() {
        return Err(Error::Snapshot {
            path: ram.to_path_buf(),
            detail: format!("is not a regular file ({kind:?}); not capturing it"),
        });
    }
    let partial = dir.join("ram.partial");
    let _ = std::fs::remove_file(&partial);
    crate::snapshot::move_sparse(ram, &partial).ctx(|| "freezing the RAM file".into())?;
    let frozen = dir.join("ram");
    std::fs::rename(&partial, &frozen).ctx(|| "installing the RAM file".into())?;
    crate::jail::share(&frozen)
}

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or(0)
}

/// The `meta.json` of capture `snap_id` of the VM `record` describes, whose
/// files are in `dir` (its device state checksummed).
pub(super) fn capture_meta(
    record: &VmRecord,
    snap_id: &str,
    dir: &Path,
    parent: Option<String>,
    disk_over: Option<Vec<PathBuf>>,
) -> Result<crate::snapshot::SnapshotMeta> {
    let state = dir.join("state");
    let state_crc =
        crate::checksum::file_crc(&state).ctx(|| format!("reading {}", state.display()))?;
    let mut checksums = std::collections::BTreeMap::from([("state".to_string(), state_crc)]);
    // A root snapshot's RAM file (a booted VM's, frozen).
    let ram = dir.join("ram");
    if ram.exists() {
        let crc = crate::checksum::sparse_crc(&ram).ctx(|| format!("reading {}", ram.display()))?;
        checksums.insert("ram".to_string(), crc);
    }
    Ok(crate::snapshot::SnapshotMeta {
        version: crate::snapshot::META_VERSION,
        id: snap_id.to_string(),
        source_vm: record.id.clone(),
        machine: record.machine,
        artifacts: record.artifacts.clone(),
        extra_cmdline: record.extra_cmdline.clone(),
        created_unix_ms: unix_ms(),
        parent,
        disk_over,
        checksums,
        balloon: record.balloon,
    })
}

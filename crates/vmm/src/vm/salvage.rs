//! Finishing a capture whose QEMU had exited when the process doing it
//! died: between QEMU's exit and `meta.json` (the capture's last file)
//! the VM's disk is already in the capture directory, so neither the VM
//! nor the capture holds the sandbox until the capture is finished.

use super::files::cleanup_pid;
use super::{VmFiles, VmRecord};
use crate::config::Paths;
use crate::error::{Error, IoContext, Result};
use crate::ram::layer::Layer;
use crate::snapshot::{Snapshot, LAYER_FILE};

/// Finish capture `snap_id` of VM `vm_id` from the files its capture left,
/// if its QEMU is gone and the capture got as far as QEMU's exit (device
/// state saved, RAM layer written). Returns whether the capture is now
/// whole; `Ok(false)`: there was nothing to finish (call before removing
/// the VM's files: its disk or RAM may still be there).
pub(crate) fn salvage_capture(paths: &Paths, vm_id: &str, snap_id: &str) -> Result<bool> {
    let dir = paths.snapshot_dir(snap_id);
    if dir.join("meta.json").exists() {
        // Whole, or damaged: an error then (the caller keeps its files).
        return Snapshot::open(paths, snap_id).map(|_| true);
    }
    let files = VmFiles::new(paths, vm_id);
    if cleanup_pid(paths, vm_id).is_some() || !dir.join("state").exists() {
        // Its QEMU runs on, or the capture never saved the device state.
        return Ok(false);
    }
    let record: VmRecord = match std::fs::read(files.record())
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
    {
        Some(r) => r,
        None => return Ok(false),
    };
    // Everything the capture needs must be there before anything moves.
    let disk = dir.join("disk.qcow2");
    let active = files.disk_generation(record.disk_generation);
    if !disk.exists() && !active.exists() {
        return Ok(false);
    }
    let ram = dir.join("ram");
    let layer = dir.join(LAYER_FILE);
    let partial_layer = dir.join(format!("{LAYER_FILE}.partial"));
    let ram_ready = if record.ram_shared {
        ram.exists() || record.ram.exists()
    } else {
        // Written whole before QEMU exits; its header comes last.
        layer.exists() || Layer::open(&partial_layer).and_then(|l| l.verify()).is_ok()
    };
    if !ram_ready {
        return Ok(false);
    }
    if !disk.exists() {
        std::fs::rename(&active, &disk).ctx(|| format!("moving {}", active.display()))?;
        crate::jail::share(&disk)?;
    }
    let parent = if record.ram_shared {
        if !ram.exists() {
            super::capture::freeze_ram(&record.ram, &dir)?;
        }
        None
    } else {
        if !layer.exists() {
            std::fs::rename(&partial_layer, &layer).ctx(|| "finishing the RAM layer".into())?;
        }
        record.parent.clone()
    };
    // (A capture that sealed the disk in place put its own disk first.)
    let disk_over = record
        .disk_over
        .clone()
        .map(|d| d.into_iter().filter(|p| p != &disk).collect());
    let meta = super::capture::capture_meta(&record, snap_id, &dir, parent, disk_over)?;
    crate::snapshot::publish(
        &dir,
        &serde_json::to_vec_pretty(&meta).expect("meta serializes"),
    )?;
    Snapshot::open(paths, snap_id).map_err(|e| Error::Snapshot {
        path: dir.clone(),
        detail: format!("finished from what its capture left, but: {e}"),
    })?;
    tracing::info!(
        vm = vm_id,
        snapshot = snap_id,
        "a capture cut short after its QEMU exited, finished"
    );
    Ok(true)
}

//! Which snapshot directories nothing needs: the files a crash left
//! behind (a capture cut short, a build layer whose row was never written)
//! that the manager's own bookkeeping cannot see.
//!
//! A snapshot directory is needed when its caller keeps it (it has a row,
//! or an operation in flight names it), when a VM runs on it (the snapshot
//! it was restored from, or a disk its overlay is layered over: a capture
//! cut short after sealing the disk leaves such a directory without a
//! row), or when a needed snapshot is layered over it (its RAM parent, or
//! a disk in its `disk_over`). Everything else, once older than the
//! caller's grace period (an operation may be writing it), is not.

use std::collections::{HashSet, VecDeque};
use std::path::Path;
use std::time::Duration;

use crate::config::Paths;
use crate::snapshot::SnapshotMeta;
use crate::vm::VmRecord;

/// Snapshot directories under `paths` that nothing needs (see the module
/// docs), given the ids the caller keeps. Empty when a VM's record cannot
/// be read: then what it runs on is unknown, and nothing is unneeded.
pub fn unneeded_snapshots(paths: &Paths, keep: &HashSet<String>, grace: Duration) -> Vec<String> {
    let snapshots = paths.snapshots_dir();
    let Ok(entries) = std::fs::read_dir(&snapshots) else {
        return Vec::new();
    };
    let all: Vec<(String, Option<Duration>)> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let age = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok());
            Some((name, age))
        })
        .collect();
    let mut queue: VecDeque<String> = keep.iter().cloned().collect();
    // A VM whose record predates `disk_over` may sit on a disk sealed into
    // a directory that has no meta.json yet: keep every such directory.
    let mut lineage_unknown = false;
    for vm in crate::vm::list(paths) {
        let record = paths.vm_dir(&vm).join("vm.json");
        let parsed = std::fs::read(&record)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<VmRecord>(&b).map_err(|e| e.to_string()));
        match parsed {
            Ok(r) => {
                lineage_unknown |= r.disk_over.is_none();
                queue.extend(r.parent);
                queue.extend(dirs_of(&snapshots, r.disk_over.iter().flatten()));
            }
            // A VM being made writes its record first; one without any
            // is being removed. Either way: decide another time.
            Err(e) if record.exists() => {
                tracing::warn!(vm = %vm, "its record is unreadable ({e}): no snapshot is reclaimed");
                return Vec::new();
            }
            Err(_) => {}
        }
    }
    let mut needed = HashSet::new();
    while let Some(id) = queue.pop_front() {
        if !needed.insert(id.clone()) {
            continue;
        }
        let Ok(bytes) = std::fs::read(snapshots.join(&id).join("meta.json")) else {
            continue;
        };
        if let Ok(meta) = serde_json::from_slice::<SnapshotMeta>(&bytes) {
            queue.extend(meta.parent);
            queue.extend(dirs_of(&snapshots, meta.disk_over.iter().flatten()));
        }
    }
    let sealed_only = |id: &str| {
        let dir = snapshots.join(id);
        dir.join("disk.qcow2").exists() && !dir.join("meta.json").exists()
    };
    let mut unneeded: Vec<String> = all
        .into_iter()
        .filter(|(id, age)| !needed.contains(id) && age.is_some_and(|a| a >= grace))
        .filter(|(id, _)| !(lineage_unknown && sealed_only(id)))
        .map(|(id, _)| id)
        .collect();
    unneeded.sort();
    unneeded
}

/// Temp files that a compaction or RAM materialization cut short left in
/// whole snapshot directories (those with a `meta.json`), older than
/// `grace`.
pub fn stale_temp_files(paths: &Paths, grace: Duration) -> Vec<std::path::PathBuf> {
    const TEMP: [&str; 3] = ["ram.layer.compact", "disk.compact.qcow2", "ram.partial"];
    let Ok(entries) = std::fs::read_dir(paths.snapshots_dir()) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for dir in entries.flatten().map(|e| e.path()) {
        if !dir.join("meta.json").exists() {
            continue;
        }
        for name in TEMP {
            let f = dir.join(name);
            let old = std::fs::symlink_metadata(&f)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age >= grace);
            if old {
                out.push(f);
            }
        }
    }
    out.sort();
    out
}

/// The snapshot ids of the disks in `disks` that lie in `snapshots`.
fn dirs_of<'a>(
    snapshots: &'a Path,
    disks: impl Iterator<Item = &'a std::path::PathBuf> + 'a,
) -> impl Iterator<Item = String> + 'a {
    disks.filter_map(move |disk| {
        let dir = disk.parent()?;
        (dir.parent()? == snapshots)
            .then(|| dir.file_name()?.to_str().map(str::to_string))
            .flatten()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Artifacts, Machine};

    fn meta(id: &str, parent: Option<&str>, disk_over: Vec<std::path::PathBuf>) -> SnapshotMeta {
        SnapshotMeta {
            version: crate::snapshot::META_VERSION,
            id: id.into(),
            source_vm: "vm".into(),
            machine: Machine::default(),
            artifacts: artifacts(),
            extra_cmdline: vec![],
            created_unix_ms: 0,
            parent: parent.map(str::to_string),
            disk_over: Some(disk_over),
            checksums: Default::default(),
            balloon: false,
        }
    }

    fn artifacts() -> Artifacts {
        Artifacts {
            kernel: "/k".into(),
            initramfs: "/i".into(),
            rootfs: crate::config::RootDisk::File("/r".into()),
        }
    }

    fn snapshot(paths: &Paths, m: Option<SnapshotMeta>, id: &str) {
        let dir = paths.snapshot_dir(id);
        std::fs::create_dir_all(&dir).unwrap();
        if let Some(m) = m {
            std::fs::write(dir.join("meta.json"), serde_json::to_vec(&m).unwrap()).unwrap();
        }
    }

    #[test]
    fn keeps_what_rows_vms_and_their_chains_need() {
        let tmp = tempfile::tempdir().unwrap();
        let paths = Paths {
            data_dir: tmp.path().into(),
            shm_dir: tmp.path().join("shm"),
            jail: Default::default(),
            track_writes: true,
            balloon: true,
            guest_tsc: true,
        };
        let disk = |id: &str| paths.snapshot_dir(id).join("disk.qcow2");
        // tpl <- kept (a row); tpl <- under-vm <- sealed (no meta: a capture
        // cut short after sealing), which a VM's overlay sits on.
        snapshot(&paths, Some(meta("tpl", None, vec![])), "tpl");
        snapshot(
            &paths,
            Some(meta("kept", Some("tpl"), vec![disk("tpl")])),
            "kept",
        );
        snapshot(
            &paths,
            Some(meta("under-vm", Some("tpl"), vec![disk("tpl")])),
            "under-vm",
        );
        snapshot(&paths, None, "sealed");
        // Orphans: a half-written capture, and a whole one nobody uses.
        snapshot(&paths, None, "half");
        snapshot(
            &paths,
            Some(meta("whole", Some("tpl"), vec![disk("tpl")])),
            "whole",
        );
        let vm_dir = paths.vm_dir("sbx");
        std::fs::create_dir_all(&vm_dir).unwrap();
        let record = serde_json::json!({
            "id": "sbx", "pid": 1, "netns": "n", "machine": Machine::default(),
            "artifacts": artifacts(), "extra_cmdline": [], "ram_shared": false,
            "ram": "/x", "parent": "tpl", "disk_over": [disk("sealed"), disk("under-vm"), disk("tpl")],
        });
        std::fs::write(vm_dir.join("vm.json"), record.to_string()).unwrap();
        let keep: HashSet<String> = ["kept".to_string()].into();
        assert_eq!(
            unneeded_snapshots(&paths, &keep, Duration::ZERO),
            vec!["half".to_string(), "whole".to_string()]
        );
        // Too young to judge.
        assert!(unneeded_snapshots(&paths, &keep, Duration::from_secs(600)).is_empty());
        // A compaction's temp file in a whole snapshot, not in a half one.
        std::fs::write(paths.snapshot_dir("kept").join("ram.layer.compact"), b"x").unwrap();
        std::fs::write(paths.snapshot_dir("half").join("ram.partial"), b"x").unwrap();
        assert_eq!(
            stale_temp_files(&paths, Duration::ZERO),
            vec![paths.snapshot_dir("kept").join("ram.layer.compact")]
        );
        assert!(stale_temp_files(&paths, Duration::from_secs(600)).is_empty());
        // A VM whose record predates disk_over: a sealed disk without a
        // meta.json may be under it, so such a directory stays.
        snapshot(&paths, None, "sealed-old");
        std::fs::write(paths.snapshot_dir("sealed-old").join("disk.qcow2"), b"").unwrap();
        let old_vm = paths.vm_dir("old");
        std::fs::create_dir_all(&old_vm).unwrap();
        let mut old = record.clone();
        old["id"] = "old".into();
        old.as_object_mut().unwrap().remove("disk_over");
        std::fs::write(old_vm.join("vm.json"), old.to_string()).unwrap();
        assert_eq!(
            unneeded_snapshots(&paths, &keep, Duration::ZERO),
            vec!["half".to_string(), "whole".to_string()]
        );
        std::fs::remove_dir_all(&old_vm).unwrap();
        // A record that cannot be read: nothing is reclaimed.
        std::fs::write(vm_dir.join("vm.json"), b"{").unwrap();
        assert!(unneeded_snapshots(&paths, &keep, Duration::ZERO).is_empty());
    }
}

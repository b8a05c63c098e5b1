//! Real QEMU VMs (TCG on machines without hardware virtualization).
//!
//! Needs the artifacts of `scripts/setup-host.sh` and the initramfs with
//! our agent (`scripts/build-initramfs.sh`); `scripts/test.sh` prepares
//! both. One cold boot per test run; everything else restores snapshots.

use std::path::PathBuf;
use std::time::Duration;

use tine_vmm::{
    Artifacts, Error, Guest, Machine, Paths, Probe, Snapshot, StartOptions, Vm, VmState,
};

/// Ready when the agent answers `GET /health` (what the server uses).
fn probe() -> Probe {
    std::sync::Arc::new(|guest: Guest| {
        Box::pin(async move {
            tine_agent_client::healthy(guest.connect(tine_agent_client::AGENT_PORT)).await
        })
    })
}

fn opts() -> StartOptions {
    StartOptions::new(probe())
}

const T: Duration = Duration::from_secs(60);

/// Removes whatever VMs a test left in its data dir when it ends, also
/// when it panicked (QEMU processes outlive the test process otherwise).
struct Reap(PathBuf);

impl Drop for Reap {
    fn drop(&mut self) {
        let pids = qemu_processes_under(&self.0);
        for pid in pids {
            let _ =
                nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
        }
        for entry in std::fs::read_dir(self.0.join("vms"))
            .into_iter()
            .flatten()
            .flatten()
        {
            let id = entry.file_name().to_string_lossy().into_owned();
            let _ = std::process::Command::new("ip")
                .args(["netns", "delete", &format!("tine-{id}")])
                .status();
            // Its cgroup leaf, now that its QEMU is gone.
            tine_vmm::jail::release(&tine_vmm::JailConfig::from_env(), &self.0, &id);
        }
    }
}

/// Artifacts from the real data dir; VMs and snapshots in a temp dir.
fn setup() -> (tempfile::TempDir, tempfile::TempDir, Paths, Artifacts, Reap) {
    let real = Paths::from_env();
    let artifacts = real.current_artifacts();
    artifacts.resolve().unwrap_or_else(|e| {
        panic!("{e}: run scripts/setup-host.sh and scripts/build-initramfs.sh first")
    });
    let data = tempfile::Builder::new()
        .prefix("tine-test-")
        .tempdir_in(&real.data_dir)
        .unwrap();
    std::fs::create_dir_all("/dev/shm/tine-test").unwrap();
    let shm = tempfile::tempdir_in("/dev/shm/tine-test").unwrap();
    let paths = Paths {
        data_dir: data.path().to_path_buf(),
        shm_dir: shm.path().to_path_buf(),
        jail: tine_vmm::JailConfig::from_env(),
        track_writes: true,
        balloon: true,
        guest_tsc: true,
    };
    let reap = Reap(data.path().to_path_buf());
    // Last in the tuple, so it is dropped first, before the dirs go.
    (data, shm, paths, artifacts, reap)
}

fn machine() -> Machine {
    Machine {
        vcpus: 1,
        memory_mib: 256,
        ..Machine::default()
    }
}

fn uniq(prefix: &str) -> String {
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{prefix}{:x}{:x}", std::process::id() % 4096, n % 65536)
}

async fn sh(vm: &Vm, cmd: &str) -> (String, i32) {
    let guest = vm.guest();
    let conn = guest.connect(tine_agent_client::AGENT_PORT);
    let out = tine_agent_client::process::exec(conn, "root", cmd, None, T)
        .await
        .unwrap_or_else(|e| panic!("exec {cmd:?} in {}: {e}", vm.id()));
    (
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        out.exit_code,
    )
}

fn qemu_processes_under(dir: &std::path::Path) -> Vec<i32> {
    let needle = dir.display().to_string();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd);
            cmd.contains("qemu-system") && cmd.contains(&needle)
        })
        .collect()
}

fn assert_gone(paths: &Paths, ids: &[String]) {
    assert!(
        qemu_processes_under(&paths.data_dir).is_empty(),
        "QEMU processes left behind"
    );
    let namespaces = tine_vmm::netns::list_ours();
    for id in ids {
        assert!(
            !namespaces.contains(&format!("tine-{id}")),
            "namespace of {id} left behind"
        );
        assert!(!paths.vm_dir(id).exists(), "directory of {id} left behind");
        assert!(!paths.vm_ram_dir(id).exists(), "RAM of {id} left behind");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn boot_snapshot_clone_kill() {
    let (_d, _s, paths, artifacts, _reap) = setup();
    let src_id = uniq("src");
    let mut src = Vm::boot(&paths, &src_id, machine(), &artifacts, opts())
        .await
        .expect("cold boot of the base template");
    assert_eq!(src.state(), VmState::Running);

    // The guest runs the Debian cloud kernel that setup unpacked.
    let release = std::fs::read_to_string(paths_real_release()).unwrap();
    let (uname, code) = sh(&src, "uname -r").await;
    assert_eq!((uname.as_str(), code), (release.trim(), 0));
    // stdout, stderr and exit codes come back.
    let guest = src.guest();
    let conn = guest.connect(tine_agent_client::AGENT_PORT);
    let out =
        tine_agent_client::process::exec(conn, "root", "echo out; echo err >&2; exit 3", None, T)
            .await
            .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "out\n");
    assert_eq!(String::from_utf8_lossy(&out.stderr), "err\n");
    assert_eq!(out.exit_code, 3);
    // The rootfs is the base template: user `user` with uid 1000.
    assert_eq!(sh(&src, "id -u user").await, ("1000".into(), 0));

    // State that must survive into the clones: a file and a running process.
    sh(&src, "echo before > /root/marker").await;
    let snap_id = uniq("snap");
    let snap = src.snapshot(&snap_id).await.expect("snapshot");
    assert_eq!(
        src.state(),
        VmState::Running,
        "the source continues after a snapshot"
    );

    let mut clones = Vec::new();
    for i in 0..3 {
        let id = uniq(&format!("c{i}"));
        let vm = Vm::restore(&paths, &id, &snap, opts())
            .await
            .expect("restore a clone");
        clones.push(vm);
    }
    for (i, vm) in clones.iter().enumerate() {
        assert_eq!(
            sh(vm, "cat /root/marker").await,
            ("before".into(), 0),
            "clone {i} sees the snapshot's file"
        );
        sh(vm, &format!("echo clone{i} > /root/mine")).await;
    }
    sh(&src, "echo source > /root/mine").await;
    for (i, vm) in clones.iter().enumerate() {
        assert_eq!(
            sh(vm, "cat /root/mine").await.0,
            format!("clone{i}"),
            "clone {i} sees only its own write"
        );
    }
    // Ten clones of one snapshot share its RAM pages in the host page cache.
    let mut more = Vec::new();
    for i in 0..7 {
        more.push(
            Vm::restore(&paths, &uniq(&format!("m{i}")), &snap, opts())
                .await
                .expect("restore"),
        );
    }
    for vm in clones.iter().chain(more.iter()) {
        let (rss, pss, shared, _) = ram_mapping_usage(vm.pid(), &snap.ram);
        assert!(rss > 0, "clone {} maps the snapshot's RAM file", vm.id());
        assert!(
            shared > 0 && pss < rss,
            "clone {} shares RAM pages: rss {rss} pss {pss} shared {shared} KiB",
            vm.id()
        );
    }
    for vm in more {
        vm.kill().await.unwrap();
    }
    assert_eq!(sh(&src, "cat /root/mine").await.0, "source");
    assert_eq!(sh(&src, "cat /root/marker").await.0, "before");

    // Pause and resume keep the guest intact.
    src.pause().await.unwrap();
    assert!(matches!(src.pause().await, Err(Error::InvalidState { .. })));
    src.resume().await.unwrap();
    assert_eq!(sh(&src, "echo alive").await.0, "alive");

    // A snapshot of a clone is a RAM layer over its parent plus a sealed
    // disk layer, and the clone continues in the same QEMU. State that
    // lives only in guest RAM (a tmpfs file, a process) comes along.
    let (blob, code) = sh(
        &clones[0],
        "head -c 6000000 /dev/urandom > /dev/shm/blob && sha256sum < /dev/shm/blob",
    )
    .await;
    assert_eq!(code, 0);
    sh(&clones[0], "(sleep 1000; echo late) > /dev/null 2>&1 &").await;
    let pid_before = clones[0].pid();
    let snap2_id = uniq("snap2");
    let snap2 = clones[0]
        .snapshot(&snap2_id)
        .await
        .expect("snapshot of a clone");
    assert_eq!(clones[0].pid(), pid_before, "the clone goes on in its QEMU");
    assert_eq!(clones[0].state(), VmState::Running);
    assert_eq!(snap2.meta.parent.as_deref(), Some(snap_id.as_str()));
    assert_eq!(snap2.ram, snap.ram, "the root RAM file stays the same");
    let layer2 = layer_pages(&snap2);
    assert!(
        layer2 > 6_000_000 / 4096 && layer2 < (256 << 20) / 4096 / 2,
        "the layer holds the changed pages, not all RAM: {layer2} pages"
    );
    sh(&clones[0], "echo after > /root/mine").await;
    let grandchild = Vm::restore(&paths, &uniq("gc"), &snap2, opts())
        .await
        .expect("restore");
    assert_eq!(sh(&grandchild, "cat /root/mine").await.0, "clone0");
    assert_eq!(sh(&grandchild, "sha256sum < /dev/shm/blob").await.0, blob);
    assert_eq!(sh(&grandchild, "pgrep -c -x sleep").await.0, "1");

    // Clones track the pages they write, so a capture of one restored from
    // a layer reads only what it wrote since; what it restores must still
    // be the whole guest: the layer's pages (the blob), and the new ones.
    assert!(grandchild.tracks_writes(), "the QEMU preloaded the shim");
    let mut grandchild = grandchild;
    let (small, _) = sh(
        &grandchild,
        "head -c 300000 /dev/urandom > /dev/shm/small && sha256sum < /dev/shm/small",
    )
    .await;
    let gc_snap = grandchild
        .snapshot(&uniq("gcsnap"))
        .await
        .expect("capture of a clone restored from a layer");
    assert!(grandchild.tracks_writes(), "armed again after the capture");
    let gcc = Vm::restore(&paths, &uniq("gcc"), &gc_snap, opts())
        .await
        .expect("restore");
    assert_eq!(sh(&gcc, "sha256sum < /dev/shm/blob").await.0, blob);
    assert_eq!(sh(&gcc, "sha256sum < /dev/shm/small").await.0, small);
    assert_eq!(sh(&gcc, "cat /root/mine").await.0, "clone0");
    gcc.kill().await.unwrap();

    // The balloon: memory a clone's guest frees goes back to the host (its
    // private copies are dropped, the shared RAM file is untouched), and a
    // capture after that restores the guest's RAM byte for byte, although
    // the dropped pages now read the root file and not the parent layer.
    let x = &mut clones[2];
    assert!(x.record().balloon && x.tracks_writes());
    let root_crc = tine_vmm::checksum::sparse_crc(&snap.ram).unwrap();
    let (fill, _) = sh(
        x,
        "head -c 48000000 /dev/urandom > /dev/shm/fill && sha256sum < /dev/shm/fill",
    )
    .await;
    let with_fill = x.snapshot(&uniq("fill")).await.expect("capture the fill");
    assert!(layer_pages(&with_fill) > 48_000_000 / 4096);
    let full_kib = settled_private_kib(x, Duration::from_secs(10)).await;
    sh(x, "rm /dev/shm/fill").await;
    let freed_kib = settled_private_kib(x, Duration::from_secs(60)).await;
    assert!(
        freed_kib + 32 * 1024 < full_kib,
        "the guest's freed 48 MB went back to the host: private {full_kib} -> {freed_kib} KiB"
    );
    let (small2, _) = sh(
        x,
        "head -c 200000 /dev/urandom > /dev/shm/small2 && sha256sum < /dev/shm/small2",
    )
    .await;
    settled_private_kib(x, Duration::from_secs(10)).await;
    x.pause().await.unwrap();
    let freed = x
        .snapshot(&uniq("freed"))
        .await
        .expect("capture after the balloon");
    assert_eq!(x.state(), VmState::Paused);
    // Read after the capture: reading a dropped page maps it again, which
    // the next scan would count as written.
    let live = guest_ram_crcs(x);
    let y = Vm::restore_paused(&paths, &uniq("bal"), &freed, probe())
        .await
        .expect("restore");
    let restored = guest_ram_crcs(&y);
    let differ: Vec<usize> = (0..live.len())
        .filter(|&i| live[i] != restored[i])
        .collect();
    assert!(
        differ.is_empty(),
        "{} pages differ between the captured guest and its restore, first {:?}",
        differ.len(),
        &differ[..differ.len().min(8)]
    );
    let mut y = y;
    y.start_restored(None).await.expect("start the restore");
    assert_eq!(sh(&y, "sha256sum < /dev/shm/small2").await.0, small2);
    assert_eq!(sh(&y, "test -e /dev/shm/fill; echo $?").await.0, "1");
    y.kill().await.unwrap();
    // The fill is still in the earlier capture, and the shared file is as
    // it was.
    let z = Vm::restore(&paths, &uniq("fill"), &with_fill, opts())
        .await
        .expect("restore");
    assert_eq!(sh(&z, "sha256sum < /dev/shm/fill").await.0, fill);
    z.kill().await.unwrap();
    assert_eq!(tine_vmm::checksum::sparse_crc(&snap.ram).unwrap(), root_crc);
    x.resume().await.unwrap();

    // A second capture right after holds only what changed since the first.
    let snap3_id = uniq("snap3");
    let snap3 = clones[0].snapshot(&snap3_id).await.expect("second capture");
    let layer3 = layer_pages(&snap3);
    assert!(
        layer3 < layer2 / 2,
        "incremental: {layer3} pages over a {layer2}-page parent layer"
    );
    assert_eq!(snap3.layers.len(), 2);
    // The clone's own disk is intact after two captures: what it wrote
    // between them reads back from disk, and new writes reach the disk.
    assert_eq!(
        sh(
            &clones[0],
            "sync; echo 3 > /proc/sys/vm/drop_caches; cat /root/mine; \
             dd if=/dev/zero of=/root/more bs=1M count=64 conv=fsync status=none && echo synced"
        )
        .await,
        ("after\nsynced".into(), 0)
    );
    let great = Vm::restore(&paths, &uniq("ggc"), &snap3, opts())
        .await
        .expect("restore a two-layer chain");
    assert_eq!(sh(&great, "cat /root/mine").await.0, "after");
    assert_eq!(sh(&great, "sha256sum < /dev/shm/blob").await.0, blob);
    great.kill().await.unwrap();

    // Compaction folds the chain into one layer over the root; the parent
    // snapshot can then go and the compacted one restores the same.
    assert_eq!(
        tine_vmm::compact::compact(&paths, &snap3_id).await.unwrap(),
        Some(snap_id.clone())
    );
    let snap3 = Snapshot::open(&paths, &snap3_id).unwrap();
    assert_eq!(snap3.layers.len(), 1);
    assert_eq!(snap3.meta.parent.as_deref(), Some(snap_id.as_str()));
    assert_eq!(
        tine_vmm::compact::compact(&paths, &snap3_id).await.unwrap(),
        None
    );
    let away = paths.snapshot_dir(&format!("{snap2_id}-away"));
    std::fs::rename(paths.snapshot_dir(&snap2_id), &away).unwrap();
    let flat = Vm::restore(&paths, &uniq("flat"), &snap3, opts())
        .await
        .expect("restore the compacted snapshot without its old parent");
    assert_eq!(sh(&flat, "cat /root/mine").await.0, "after");
    assert_eq!(sh(&flat, "sha256sum < /dev/shm/blob").await.0, blob);
    flat.kill().await.unwrap();
    std::fs::rename(&away, paths.snapshot_dir(&snap2_id)).unwrap();

    // Materializing gives the snapshot its whole RAM as its own file; VMs
    // restored from it map that file, and the clone that was captured into
    // it captures again as a layer over it.
    assert!(tine_vmm::compact::materialize(&paths, &snap3_id)
        .await
        .unwrap());
    let snap3 = Snapshot::open(&paths, &snap3_id).unwrap();
    assert!(snap3.layers.is_empty() && snap3.meta.parent.is_none());
    assert_eq!(snap3.ram, paths.snapshot_ram(&snap3_id));
    let full = Vm::restore(&paths, &uniq("full"), &snap3, opts())
        .await
        .expect("restore the materialized snapshot");
    assert_eq!(sh(&full, "cat /root/mine").await.0, "after");
    assert_eq!(sh(&full, "sha256sum < /dev/shm/blob").await.0, blob);
    let (rss, _, _, _) = ram_mapping_usage(full.pid(), &snap3.ram);
    assert!(rss > 0, "it maps the snapshot's own RAM file");
    full.kill().await.unwrap();
    sh(&clones[0], "echo again > /root/mine").await;
    let snap4_id = uniq("snap4");
    let snap4 = clones[0].snapshot(&snap4_id).await.expect("capture");
    assert_eq!(
        (snap4.ram.clone(), snap4.layers.len()),
        (snap3.ram.clone(), 1)
    );
    let again = Vm::restore(&paths, &uniq("again"), &snap4, opts())
        .await
        .expect("restore a layer over a materialized snapshot");
    assert_eq!(sh(&again, "cat /root/mine").await.0, "again");
    assert_eq!(sh(&again, "sha256sum < /dev/shm/blob").await.0, blob);
    again.kill().await.unwrap();

    // A damaged layer is refused with a message naming it.
    let (snap3, snap3_id) = (snap4, snap4_id);
    let layer_file = snap3.layer_path();
    let good = std::fs::read(&layer_file).unwrap();
    std::fs::write(&layer_file, &good[..good.len() - 5]).unwrap();
    let err = Snapshot::open(&paths, &snap3_id).expect_err("a truncated layer must fail");
    assert!(err.to_string().contains("RAM layer"), "{err}");
    std::fs::write(&layer_file, vec![0u8; 8192]).unwrap();
    let err = Snapshot::open(&paths, &snap3_id).expect_err("no magic");
    assert!(err.to_string().contains("damaged"), "{err}");
    Snapshot::delete(&paths, &snap3_id).unwrap();
    clones.push(grandchild);

    // Another process can take a VM over (as the CLI or a restarted server
    // does) once the one controlling it lets go; not while it holds QMP.
    let id1 = clones[1].id().to_string();
    let err = Vm::adopt(&paths, &id1, probe())
        .await
        .err()
        .expect("QMP is held by clones[1]");
    assert!(err.to_string().contains("another process"), "{err}");
    // A capture sealed its disk in place, then (as after a crash before
    // its record was saved) the record is rolled back one generation:
    // adoption asks QEMU which overlay it writes and catches up.
    let sealed_id = uniq("sealed");
    clones[1]
        .snapshot(&sealed_id)
        .await
        .expect("in-place capture");
    let want = clones[1].record().clone();
    drop(clones.remove(1));
    let record_path = paths.vm_dir(&id1).join("vm.json");
    let mut stale: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&record_path).unwrap()).unwrap();
    stale["disk_generation"] = (want.disk_generation - 1).into();
    if let Some(list) = stale["disk_over"].as_array_mut() {
        list.remove(0);
    }
    std::fs::write(&record_path, stale.to_string()).unwrap();
    let mut adopted = Vm::adopt(&paths, &id1, probe()).await.expect("adopt");
    assert_eq!(adopted.record().disk_generation, want.disk_generation);
    assert_eq!(adopted.record().disk_over, want.disk_over);
    assert_eq!(adopted.state(), VmState::Running);
    assert_eq!(sh(&adopted, "cat /root/mine").await.0, "clone1");
    // What it wrote under the old controller is unknown to this one: its
    // first capture compares every page, then tracks again.
    assert!(!adopted.tracks_writes());
    // And it captures on from the right overlay.
    let next_id = uniq("after-adopt");
    adopted
        .snapshot(&next_id)
        .await
        .expect("capture after adoption");
    assert!(adopted.tracks_writes(), "armed by its first capture");
    assert_eq!(sh(&adopted, "cat /root/mine").await.0, "clone1");
    sh(&adopted, "echo adopted > /root/mine").await;
    let after_adopt = adopted
        .snapshot(&uniq("after-adopt2"))
        .await
        .expect("tracked capture after adoption");
    let back = Vm::restore(&paths, &uniq("back"), &after_adopt, opts())
        .await
        .expect("restore");
    assert_eq!(sh(&back, "cat /root/mine").await.0, "adopted");
    back.kill().await.unwrap();
    clones.push(adopted);

    let mut ids: Vec<String> = clones.iter().map(|v| v.id().to_string()).collect();
    ids.push(src.id().to_string());
    for vm in clones {
        vm.kill().await.unwrap();
    }
    src.kill().await.unwrap();
    assert_gone(&paths, &ids);
    Snapshot::delete(&paths, &snap_id).unwrap();
    Snapshot::delete(&paths, &snap2_id).unwrap();
    assert!(!paths.snapshot_dir(&snap_id).exists());
    assert!(!paths.snapshot_ram(&snap_id).exists());
}

fn layer_pages(snap: &Snapshot) -> usize {
    tine_vmm::ram::layer::Layer::open(&snap.layer_path())
        .expect("the snapshot has a RAM layer")
        .entries()
        .len()
}

/// Rss, Pss, Shared (clean + dirty) and Private (clean + dirty) in KiB
/// of the mapping of `ram` in process `pid`, from /proc/PID/smaps.
fn ram_mapping_usage(pid: i32, ram: &std::path::Path) -> (u64, u64, u64, u64) {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).unwrap();
    let name = ram.display().to_string();
    let (mut rss, mut pss, mut shared, mut private, mut inside) = (0, 0, 0, 0, false);
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            inside = line.ends_with(&name);
            continue;
        }
        if !inside {
            continue;
        }
        let kib = |l: &str| {
            l.split_whitespace()
                .nth(1)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        match first {
            "Rss:" => rss += kib(line),
            "Pss:" => pss += kib(line),
            "Shared_Clean:" | "Shared_Dirty:" => shared += kib(line),
            "Private_Clean:" | "Private_Dirty:" => private += kib(line),
            _ => {}
        }
    }
    (rss, pss, shared, private)
}

/// The CRC-32 of every page of `vm`'s guest RAM (it must be stopped).
fn guest_ram_crcs(vm: &Vm) -> Vec<u32> {
    let bytes = u64::from(vm.record().machine.memory_mib) << 20;
    let ram = tine_vmm::ram::GuestRam::find(vm.pid(), &vm.record().ram, bytes).unwrap();
    let mut buf = vec![0u8; 256 * 4096];
    let mut crcs = Vec::new();
    let pages = bytes / 4096;
    for first in (0..pages).step_by(256) {
        ram.read(first, &mut buf).unwrap();
        crcs.extend(buf.chunks(4096).map(crc32fast::hash));
    }
    crcs
}

/// Private KiB of `vm`'s RAM mapping once it has stopped changing (two
/// readings 2 s apart agree within 1 MiB), or after `limit`.
async fn settled_private_kib(vm: &Vm, limit: Duration) -> u64 {
    let read = || ram_mapping_usage(vm.pid(), &vm.record().ram).3;
    let deadline = std::time::Instant::now() + limit;
    let mut last = read();
    loop {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let now = read();
        if now.abs_diff(last) < 1024 || std::time::Instant::now() > deadline {
            return now;
        }
        last = now;
    }
}

fn paths_real_release() -> PathBuf {
    Paths::from_env()
        .data_dir
        .join("current")
        .join("kernel-release")
}

#[tokio::test]
async fn missing_artifacts_are_named() {
    let (_d, _s, paths, artifacts, _reap) = setup();
    let mut bad = artifacts.clone();
    bad.kernel = PathBuf::from("/nonexistent/vmlinuz");
    let id = uniq("mk");
    let err = Vm::boot(&paths, &id, machine(), &bad, opts())
        .await
        .err()
        .expect("must fail");
    assert!(
        matches!(
            err,
            Error::MissingArtifact {
                what: "guest kernel",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("/nonexistent/vmlinuz"), "{err}");

    let mut bad = artifacts.clone();
    bad.rootfs = PathBuf::from("/nonexistent/rootfs.ext4").into();
    let err = Vm::boot(&paths, &id, machine(), &bad, opts())
        .await
        .err()
        .expect("must fail");
    assert!(err.to_string().contains("rootfs image"), "{err}");
    assert_gone(&paths, &[id]);
}

#[tokio::test]
async fn a_vm_that_dies_during_boot_says_why() {
    let (_d, _s, paths, artifacts, _reap) = setup();
    // The agent cannot find its root disk: it reports that on the console
    // and powers the VM off.
    let id = uniq("die");
    let opts = StartOptions {
        extra_cmdline: vec!["tine.root=/dev/nonexistent".into()],
        ..opts()
    };
    let err = Vm::boot(&paths, &id, machine(), &artifacts, opts)
        .await
        .err()
        .expect("must fail");
    let msg = err.to_string();
    assert!(matches!(err, Error::QemuExited { .. }), "{msg}");
    assert!(msg.contains("during boot"), "{msg}");
    assert!(
        msg.contains("/dev/nonexistent"),
        "the console tail names the missing disk: {msg}"
    );
    assert_gone(&paths, &[id]);
}

#[tokio::test]
async fn damaged_snapshots_are_refused_clearly() {
    let (_d, _s, paths, _artifacts, _reap) = setup();
    // Unknown snapshot.
    let err = Snapshot::open(&paths, "nope").expect_err("must fail");
    assert!(matches!(err, Error::NotFound { .. }), "{err}");
    assert_eq!(err.kind(), tine_vmm::ErrorKind::NotFound);
    assert!(err.to_string().contains("snapshot nope not found"), "{err}");

    // A snapshot whose device state is garbage: build the files by hand.
    let id = "broken";
    let dir = paths.snapshot_dir(id);
    std::fs::create_dir_all(&dir).unwrap();
    let meta = serde_json::json!({
        "version": tine_vmm::snapshot::META_VERSION, "id": id, "source_vm": "x",
        "machine": { "vcpus": 1, "memory_mib": 256, "accel": "tcg" },
        "artifacts": Paths::from_env().current_artifacts().resolve().unwrap(),
        "extra_cmdline": [], "created_unix_ms": 0
    });
    std::fs::write(dir.join("meta.json"), meta.to_string()).unwrap();
    std::fs::write(dir.join("state"), b"garbage, not a migration stream").unwrap();
    std::fs::write(dir.join("disk.qcow2"), b"").unwrap();
    let ram = paths.snapshot_ram(id);
    std::fs::create_dir_all(ram.parent().unwrap()).unwrap();
    std::fs::File::create(&ram)
        .unwrap()
        .set_len(256 << 20)
        .unwrap();
    let err = Snapshot::open(&paths, id).expect_err("must fail");
    assert!(
        err.to_string().contains("not a QEMU migration stream"),
        "{err}"
    );

    // A state file with the right magic but a corrupt body gets past the
    // check; QEMU must refuse it and the error must say so.
    let mut state = b"QEVM".to_vec();
    state.extend_from_slice(&[0xff; 64]);
    std::fs::write(dir.join("state"), &state).unwrap();
    let overlay_base = Paths::from_env()
        .current_artifacts()
        .resolve()
        .unwrap()
        .rootfs;
    std::fs::remove_file(dir.join("disk.qcow2")).unwrap();
    tine_vmm::disk::create_overlay(
        overlay_base.backing(),
        tine_vmm::disk::BackingFormat::Raw,
        &dir.join("disk.qcow2"),
    )
    .await
    .unwrap();
    let snap = Snapshot::open(&paths, id).unwrap();
    let vm_id = uniq("bad");
    let err = Vm::restore(&paths, &vm_id, &snap, opts())
        .await
        .err()
        .expect("must fail");
    let msg = err.to_string();
    assert!(matches!(err, Error::Snapshot { .. }), "{msg}");
    assert!(msg.contains("could not load the device state"), "{msg}");
    assert_gone(&paths, &[vm_id]);

    // A disk whose header was forged (as a VM could, writing its overlay
    // before a capture) to lay it over a host file: the jail refuses it.
    if paths.jail.enabled {
        let forged = std::process::Command::new("qemu-img")
            .args(["rebase", "-q", "-u", "-f", "qcow2", "-F", "raw", "-b"])
            .arg("/etc/hostname")
            .arg(dir.join("disk.qcow2"))
            .status()
            .unwrap();
        assert!(forged.success());
        let vm_id = uniq("forged");
        let err = Vm::restore(&paths, &vm_id, &snap, opts())
            .await
            .err()
            .expect("a forged backing chain must be refused");
        let msg = err.to_string();
        assert!(
            msg.contains("/etc/hostname") && msg.contains("refusing to start"),
            "{msg}"
        );
        assert_gone(&paths, &[vm_id]);
    }

    // A RAM file of the wrong size.
    std::fs::File::create(&ram)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let err = Snapshot::open(&paths, id).expect_err("must fail");
    assert!(err.to_string().contains("RAM file is"), "{err}");
}

/// Unmounts a test's small file system when the test ends.
struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
    }
}

/// A capture that runs out of disk space while writing its RAM layer
/// (before QEMU exits) gives the VM back, running and whole, with an error
/// of kind `NoSpace`; with the space back, the capture works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_capture_on_a_full_disk_gives_the_vm_back() {
    let real = Paths::from_env();
    let artifacts = real.current_artifacts();
    artifacts
        .resolve()
        .expect("artifacts (scripts/setup-host.sh)");
    let outer = tempfile::Builder::new()
        .prefix("tine-test-full-")
        .tempdir_in(&real.data_dir)
        .unwrap();
    let data = outer.path().join("data");
    std::fs::create_dir_all(&data).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=512m,mode=0700", "tmpfs"])
        .arg(&data)
        .status()
        .unwrap();
    assert!(mounted.success(), "mounting a small tmpfs for the data dir");
    let _unmount = Unmount(data.clone());
    std::fs::create_dir_all("/dev/shm/tine-test").unwrap();
    let shm = tempfile::tempdir_in("/dev/shm/tine-test").unwrap();
    let paths = Paths {
        data_dir: data.clone(),
        shm_dir: shm.path().to_path_buf(),
        jail: tine_vmm::JailConfig::from_env(),
        track_writes: true,
        // The data dir is a tmpfs here, filled below, and the VM continues
        // over a root RAM file in it. With the balloon, its QEMU was gone
        // after the failed capture (seen twice): a page the balloon
        // dropped reads that file again, and a hole in it needs a page of
        // the full tmpfs (on a disk file system, memory but no room).
        balloon: false,
        guest_tsc: true,
    };
    let _reap = Reap(data.clone());

    let id = uniq("full");
    let mut vm = Vm::boot(&paths, &id, machine(), &artifacts, opts())
        .await
        .expect("boot");
    // A root snapshot: the VM goes on as a clone of it, and its next
    // capture writes a RAM layer of the pages it changes.
    vm.snapshot(&uniq("root")).await.expect("root snapshot");
    let (sum, code) = sh(
        &vm,
        "head -c 48M /dev/urandom > /dev/shm/blob && sha256sum < /dev/shm/blob",
    )
    .await;
    assert_eq!(code, 0);
    let (_, code) = sh(&vm, "echo kept > /root/kept && sync").await;
    assert_eq!(code, 0);

    // Fill the file system but for 4 MiB.
    let free = nix::sys::statvfs::statvfs(&data).unwrap();
    let left = free.blocks_available() as u64 * free.fragment_size() as u64;
    let filler = data.join("filler");
    let f = std::fs::File::create(&filler).unwrap();
    nix::fcntl::posix_fallocate(&f, 0, (left - (4 << 20)) as i64).unwrap();
    drop(f);

    // A capture the VM survives fails after its disk was sealed: the
    // changed pages were copied out, the disk sealed into the capture and
    // the VM let run on its new overlay, then the layer finds no room.
    // The sealed disk stays (the VM's disk is stacked on it); nothing
    // else of the capture does.
    let sealed_id = uniq("sealed");
    let err = vm
        .snapshot(&sealed_id)
        .await
        .expect_err("a layer of 48 MiB with 4 MiB free must fail");
    assert_eq!(err.kind(), tine_vmm::ErrorKind::NoSpace, "{err}");
    assert_eq!(vm.state(), VmState::Running, "running again");
    let mut left: Vec<String> = std::fs::read_dir(paths.snapshot_dir(&sealed_id))
        .expect("the sealed disk's directory stays")
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["disk.qcow2"], "only the sealed disk stays");
    assert!(
        Snapshot::open(&paths, &sealed_id).is_err(),
        "not a snapshot"
    );

    let snap_id = uniq("layer");
    let (err, back) = match vm.capture_and_kill(&snap_id).await {
        Ok(_) => panic!("a capture with 4 MiB free must fail"),
        Err(failed) => failed,
    };
    assert_eq!(err.kind(), tine_vmm::ErrorKind::NoSpace, "{err}");
    let vm = back.expect("the VM is given back");
    assert_eq!(vm.state(), VmState::Running, "running again");
    assert_eq!(sh(&vm, "sha256sum < /dev/shm/blob").await.0, sum);
    assert!(
        !paths.snapshot_dir(&snap_id).exists(),
        "the failed snapshot is removed"
    );

    // With the space back, the same capture works.
    std::fs::remove_file(&filler).unwrap();
    let snap = match vm.capture_and_kill(&snap_id).await {
        Ok(s) => s,
        Err((e, _)) => panic!("capture with space: {e}"),
    };
    let clone = Vm::restore(&paths, &uniq("again"), &snap, opts())
        .await
        .expect("restore the capture");
    assert_eq!(sh(&clone, "sha256sum < /dev/shm/blob").await.0, sum);
    // Its disk reads through the layer the failed capture sealed.
    assert_eq!(sh(&clone, "cat /root/kept").await.0, "kept");
    clone.kill().await.unwrap();
}

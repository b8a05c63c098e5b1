//! Cold boots: a new VM from kernel, initramfs and rootfs, or over the
//! disk of a snapshot (its memory not used).

use crate::config::{Artifacts, Machine, Paths, RootDisk};
use crate::disk::{self, BackingFormat};
use crate::error::Result;
use crate::netns::Netns;

use super::files::prepare_dirs;
use super::launch::Origin;
use super::{cleanup, StartOptions, Vm, VmFiles, VmRecord, VmState, BOOT_TIMEOUT};

impl Vm {
    /// Cold-boot a VM from kernel + initramfs + a read-only rootfs image,
    /// and wait until its agent answers.
    pub async fn boot(
        paths: &Paths,
        id: &str,
        machine: Machine,
        artifacts: &Artifacts,
        mut opts: StartOptions,
    ) -> Result<Vm> {
        // The clock words go into the VM's record and its snapshots'
        // meta, so a cold boot from a snapshot's disk gets them again.
        let mut words = crate::qemu::guest_clock_cmdline(paths, machine.accel);
        words.append(&mut opts.extra_cmdline);
        opts.extra_cmdline = words;
        Vm::boot_over(paths, id, machine, artifacts, Origin::Boot, opts).await
    }

    /// Cold-boot a VM over the disk of `snapshot` (its memory is not
    /// used): what a sandbox paused without its memory resumes as.
    pub async fn boot_from_disk(
        paths: &Paths,
        id: &str,
        snapshot: &crate::snapshot::Snapshot,
        opts: StartOptions,
    ) -> Result<Vm> {
        let opts = StartOptions {
            extra_cmdline: snapshot.meta.extra_cmdline.clone(),
            ..opts
        };
        Vm::boot_over(
            paths,
            id,
            snapshot.meta.machine,
            &snapshot.meta.artifacts,
            Origin::Disk(snapshot),
            opts,
        )
        .await
    }

    /// Cold-boot with a new overlay over the disk of `origin`'s snapshot,
    /// or over the artifacts' rootfs for [`Origin::Boot`].
    async fn boot_over(
        paths: &Paths,
        id: &str,
        machine: Machine,
        artifacts: &Artifacts,
        origin: Origin<'_>,
        opts: StartOptions,
    ) -> Result<Vm> {
        let disk = match origin {
            Origin::Disk(s) | Origin::Restore(s) => Some(s.disk_path()),
            Origin::Boot => None,
        };
        let artifacts = artifacts.resolve()?;
        let files = VmFiles::new(paths, id);
        let ram_dir = paths.vm_ram_dir(id);
        prepare_dirs(&files.dir, &ram_dir)?;
        let ram = ram_dir.join("ram");
        let result = async {
            match (&disk, &artifacts.rootfs) {
                (Some(qcow2), _) => {
                    disk::create_overlay(qcow2, BackingFormat::Qcow2, &files.disk()).await?
                }
                (None, RootDisk::File(p)) => {
                    disk::create_overlay(p, BackingFormat::Raw, &files.disk()).await?
                }
                // Not opened here: the daemon may start later than this.
                (None, nbd) => {
                    let size = nbd.size().unwrap_or_default();
                    disk::create_overlay_unchecked(
                        nbd.backing(),
                        BackingFormat::Raw,
                        &files.disk(),
                        size,
                    )
                    .await?
                }
            }
            let netns = Netns::create(id).await?;
            let record = VmRecord {
                id: id.to_string(),
                pid: 0,
                netns: netns.name().to_string(),
                machine,
                artifacts: artifacts.clone(),
                extra_cmdline: opts.extra_cmdline.clone(),
                ram_shared: true,
                ram: ram.clone(),
                parent: None,
                disk_generation: 0,
                uid: None,
                disk_over: match origin {
                    Origin::Boot => Some(Vec::new()),
                    Origin::Disk(s) | Origin::Restore(s) => s.disk_lineage(),
                },
                balloon: paths.balloon,
            };
            let mut vm = Vm::launch(
                paths,
                record,
                netns,
                opts.probe.clone(),
                "during boot",
                origin,
            )
            .await?;
            vm.state = VmState::Running;
            vm.wait_ready(opts.ready_timeout.unwrap_or(BOOT_TIMEOUT), "during boot")
                .await?;
            Ok(vm)
        }
        .await;
        if result.is_err() {
            cleanup(paths, id).await;
        }
        result
    }
}

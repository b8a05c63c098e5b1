//! The QEMU command line for a microVM (pure: easy to test and to read).

use std::path::PathBuf;

use crate::config::{Accel, Artifacts, Machine};
use crate::netns::{GUEST_IP, HOST_IP, PREFIX_LEN, TAP_NAME};

/// Binary to run; `TINE_QEMU` overrides (tests use it to point at a missing
/// binary).
pub fn binary() -> String {
    std::env::var("TINE_QEMU").unwrap_or_else(|_| "qemu-system-x86_64".to_string())
}

/// Everything that differs between one launch and the next.
#[derive(Debug, Clone)]
pub struct Launch {
    pub machine: Machine,
    pub artifacts: Artifacts,
    /// This VM's qcow2 overlay.
    pub disk: PathBuf,
    /// Open the disk read-only (a QEMU that only converts a snapshot).
    pub disk_readonly: bool,
    pub ram: PathBuf,
    /// `share=on` (a booting VM, whose RAM file can later be frozen) or
    /// `share=off` (a clone: MAP_PRIVATE over a frozen RAM file).
    pub ram_shared: bool,
    /// A clone whose QEMU preloads the shim guarding its RAM file
    /// ([`crate::shim`]): QEMU is told the file is writable so it discards
    /// freed pages, and the shim opens it read-only.
    pub ram_guarded: bool,
    /// A virtio-balloon with free page reporting: the guest hands freed
    /// pages back. Part of the device state, so a snapshot restores with
    /// the device set it was taken with.
    pub balloon: bool,
    pub qmp_socket: PathBuf,
    pub console: Console,
    pub pidfile: PathBuf,
    /// The tap, opened by tine and inherited at this number; `None`:
    /// QEMU opens `tap0` itself.
    pub tap_fd: Option<i32>,
    /// QEMU's own seccomp filter (`-sandbox`): no obsolete calls, no
    /// privilege changes, no new processes, no resource-control calls.
    pub seccomp: bool,
    /// Start with `-incoming defer` to restore device state over QMP.
    pub incoming: bool,
    /// Extra kernel command-line words (tests use this to break a boot).
    pub extra_cmdline: Vec<String>,
}

/// Where the guest's serial console goes.
#[derive(Debug, Clone)]
pub enum Console {
    /// Appended to a file by QEMU (unbounded: the bench's floor only).
    #[cfg_attr(not(feature = "bench"), allow(dead_code))]
    File(PathBuf),
    /// A socket QEMU listens on; tine reads it into a capped log.
    Socket(PathBuf),
}

/// The host CPU's clock in kHz, from the first `cpu MHz` line of
/// `/proc/cpuinfo`.
pub fn host_cpu_khz() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz: f64 = info
        .lines()
        .find(|l| l.starts_with("cpu MHz"))?
        .split(':')
        .nth(1)?
        .trim()
        .parse()
        .ok()?;
    Some((mhz * 1000.0) as u64)
}

/// The guest's clock under TCG: the TSC, trusted as it is (no watchdog,
/// no cross-CPU sync check), so an idle guest stops its tick (NO_HZ).
///
/// TCG's TSC is the host's TSC read by each vCPU thread, so it is
/// synchronised across vCPUs and stops while the VM is stopped (QEMU
/// keeps its offset across a migration), which a restored guest needs. Left
/// alone, the guest finds it "unstable" (the sync check and the watchdog
/// measure an emulated CPU that is often descheduled) and falls back to
/// `refined-jiffies`: a 250 Hz tick on every vCPU, each one emulated, and a
/// clock that runs slow when ticks are late. KVM keeps the kernel's own
/// choice (kvm-clock). `TINE_GUEST_TSC=0` turns it off for new boots
/// (templates are named after it, see `Driver::boot_devices`).
///
/// Such a machine also has no i8254 PIT. QEMU resets the PIT's channel 0
/// to a square wave of 65536 counts, and the guest kernel (6.1) does not
/// stop it when it moves to the LAPIC timer: QEMU then wakes every 27 ms
/// to raise a masked interrupt, and kicks the vCPU each time (most of an
/// idle TCG guest's host CPU once the tick is gone). A TSC-clocked guest
/// with a TSC-deadline LAPIC timer never needs the PIT. Whether a VM has
/// one is part of its device state, so it follows the recorded kernel
/// command line ([`tsc_clocked`]), which its snapshots keep.
///
/// Two more words keep idle guests asleep, traced in a guest
/// (`timer:timer_start`): `nowatchdog` (the soft-lockup watchdog's
/// hrtimer on every vCPU, which an emulated CPU trips anyway) and no
/// proactive compaction (kcompactd woke every 500 ms).
pub fn guest_clock_cmdline(paths: &crate::Paths, accel: Accel) -> Vec<String> {
    if accel == Accel::Tcg && paths.guest_tsc {
        TSC_CLOCK
            .iter()
            .chain(QUIET_IDLE.iter())
            .map(|w| w.to_string())
            .collect()
    } else {
        Vec::new()
    }
}

const QUIET_IDLE: [&str; 2] = ["nowatchdog", "sysctl.vm.compaction_proactiveness=0"];

const TSC_CLOCK: [&str; 2] = ["clocksource=tsc", "tsc=reliable"];

/// Whether a VM booted with these extra kernel words runs on the TSC clock
/// (and so has no PIT).
pub fn tsc_clocked(extra_cmdline: &[String]) -> bool {
    TSC_CLOCK
        .iter()
        .all(|w| extra_cmdline.iter().any(|e| e == w))
}

/// Kernel command line. The `tine.*` words are read by our agent.
///
/// Under TCG the guest's early TSC calibration measures an emulated PIT
/// against an emulated TSC; on a busy host it fails and the kernel can hang
/// in early boot (seen here with two busy cores). Telling it the TSC rate
/// (TCG's TSC runs at the host's rate) skips the calibration.
pub fn kernel_cmdline(accel: Accel, extra: &[String]) -> String {
    let mut words = vec![
        "console=ttyS0".to_string(),
        "reboot=t".into(),
        "panic=-1".into(),
        "quiet".into(),
        "loglevel=4".into(),
        "8250.nr_uarts=1".into(),
        "i8042.noaux".into(),
        "i8042.nomux".into(),
        "i8042.nopnp".into(),
        "i8042.dumbkbd".into(),
        "random.trust_cpu=on".into(),
        "rw".into(),
        format!("tine.ip={GUEST_IP}/{PREFIX_LEN}"),
        format!("tine.gw={HOST_IP}"),
        format!("tine.dns={HOST_IP}"),
    ];
    if accel == Accel::Tcg {
        if let Some(khz) = host_cpu_khz() {
            words.push(format!("tsc_early_khz={khz}"));
        }
    }
    words.extend(extra.iter().cloned());
    words.join(" ")
}

pub fn args(l: &Launch) -> Vec<String> {
    let m = &l.machine;
    let (accel, cpu) = match m.accel {
        Accel::Kvm => ("kvm".to_string(), "host"),
        // tb-size bounds TCG's translated-code cache per process (it would
        // otherwise dominate a small guest's host memory).
        Accel::Tcg => ("tcg,tb-size=64".to_string(), "max"),
    };
    let p = |p: &PathBuf| p.display().to_string();
    let mut a: Vec<String> = vec![
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-display".into(),
        "none".into(),
        "-no-reboot".into(),
        "-M".into(),
        if tsc_clocked(&l.extra_cmdline) {
            // No i8254: see `guest_clock_cmdline`.
            "microvm,acpi=on,pit=off,memory-backend=mem".into()
        } else {
            "microvm,acpi=on,memory-backend=mem".into()
        },
        "-accel".into(),
        accel,
        "-cpu".into(),
        cpu.into(),
        "-smp".into(),
        m.vcpus.to_string(),
        "-m".into(),
        format!("{}M", m.memory_mib),
        "-object".into(),
        format!(
            "memory-backend-file,id=mem,size={}M,mem-path={},{}",
            m.memory_mib,
            p(&l.ram),
            // A clone opens the frozen file read-only (it is shared by
            // every clone and not theirs to change) and maps it private;
            // under the shim, QEMU asks for it writable and gets it
            // read-only.
            match (l.ram_shared, l.ram_guarded) {
                (true, _) => "share=on",
                (false, true) => "share=off",
                (false, false) => "share=off,readonly=on,rom=off",
            }
        ),
        "-drive".into(),
        format!(
            "id=root,file={},format=qcow2,if=none,cache=writeback,discard=unmap{}",
            p(&l.disk),
            if l.disk_readonly { ",readonly=on" } else { "" }
        ),
        "-device".into(),
        "virtio-blk-device,drive=root".into(),
        "-netdev".into(),
        match l.tap_fd {
            Some(fd) => format!("tap,id=net0,fd={fd}"),
            None => format!("tap,id=net0,ifname={TAP_NAME},script=no,downscript=no"),
        },
        "-device".into(),
        "virtio-net-device,netdev=net0,mac=52:54:00:74:69:6e".into(),
        "-object".into(),
        "rng-random,id=rng0,filename=/dev/urandom".into(),
        "-device".into(),
        "virtio-rng-device,rng=rng0".into(),
    ];
    if l.balloon {
        // Free pages are reported in 2 MiB blocks about 2 s after they are
        // freed; QEMU discards them (see `shim/tine-shim.c` for clones).
        a.extend([
            "-device".into(),
            "virtio-balloon-device,free-page-reporting=on".into(),
        ]);
    }
    a.extend([
        "-chardev".into(),
        match &l.console {
            Console::File(f) => format!("file,id=console,path={},append=on", p(f)),
            Console::Socket(s) => format!("socket,id=console,path={},server=on,wait=off", p(s)),
        },
        "-serial".into(),
        "chardev:console".into(),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", p(&l.qmp_socket)),
        "-pidfile".into(),
        p(&l.pidfile),
    ]);
    if !l.incoming {
        // Only a boot reads the kernel: QEMU keeps `-kernel` and `-initrd`
        // in its heap for the firmware (fw_cfg), ≈ 14 MiB of private memory
        // per process. A clone's guest booted long ago, and its device
        // state does not hold them.
        a.extend([
            "-kernel".into(),
            p(&l.artifacts.kernel),
            "-initrd".into(),
            p(&l.artifacts.initramfs),
            "-append".into(),
            kernel_cmdline(m.accel, &l.extra_cmdline),
        ]);
    }
    if l.seccomp {
        a.push("-sandbox".into());
        a.push("on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny".into());
    }
    if l.incoming {
        // Device state comes from `xen-save-devices-state`: no RAM section
        // and no configuration section, and it records the VM as running,
        // so `-S` keeps it stopped after the load until `cont`.
        a.extend(
            ["-S", "-global", "migration.send-configuration=off"]
                .into_iter()
                .map(String::from),
        );
        a.push("-incoming".into());
        a.push("defer".into());
    }
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(incoming: bool, shared: bool) -> Launch {
        Launch {
            machine: Machine {
                vcpus: 2,
                memory_mib: 256,
                accel: Accel::Tcg,
            },
            artifacts: Artifacts {
                kernel: "/k".into(),
                initramfs: "/i".into(),
                rootfs: "/r".into(),
            },
            disk: "/vm/disk.qcow2".into(),
            disk_readonly: false,
            ram: "/shm/ram".into(),
            ram_shared: shared,
            ram_guarded: false,
            balloon: true,
            qmp_socket: "/vm/qmp.sock".into(),
            console: Console::Socket("/vm/console.sock".into()),
            pidfile: "/vm/qemu.pid".into(),
            tap_fd: Some(7),
            seccomp: true,
            incoming,
            extra_cmdline: vec!["tine.hostname=x".into()],
        }
    }

    #[test]
    fn boot_command_line() {
        let a = args(&launch(false, true)).join(" ");
        assert!(a.contains("-M microvm,acpi=on,memory-backend=mem"));
        assert!(a.contains("mem-path=/shm/ram,share=on"));
        assert!(a.contains("-accel tcg,tb-size=64 -cpu max -smp 2 -m 256M"));
        assert!(a.contains("tine.hostname=x"));
        assert!(a.contains("tsc_early_khz="), "TCG boots get the TSC rate");
        assert!(!a.contains("-incoming"));
        assert!(a.contains("-kernel /k -initrd /i -append "));
        // QEMU's microvm must keep its option ROMs or the kernel won't boot.
        assert!(!a.contains("x-option-roms"));
        assert!(a.contains("-netdev tap,id=net0,fd=7 "));
        assert!(a.contains("socket,id=console,path=/vm/console.sock,server=on,wait=off"));
        assert!(a.contains(
            "-sandbox on,obsolete=deny,elevateprivileges=deny,spawn=deny,resourcecontrol=deny"
        ));
    }

    #[test]
    fn clone_command_line() {
        let a = args(&launch(true, false)).join(" ");
        assert!(a.contains("share=off,readonly=on,rom=off"));
        assert!(a.contains("-device virtio-balloon-device,free-page-reporting=on "));
        assert!(a.contains(" -S -global migration.send-configuration=off "));
        assert!(a.ends_with("-incoming defer"));
        assert!(!a.contains("-kernel"), "a clone does not load the kernel");
        assert!(!a.contains("-initrd"));
    }

    #[test]
    fn a_tsc_clocked_machine_has_no_pit_and_its_clones_neither() {
        let paths = crate::Paths {
            data_dir: "/d".into(),
            shm_dir: "/s".into(),
            jail: Default::default(),
            track_writes: true,
            balloon: true,
            guest_tsc: true,
        };
        let words = guest_clock_cmdline(&paths, Accel::Tcg);
        assert!(tsc_clocked(&words));
        assert!(guest_clock_cmdline(&paths, Accel::Kvm).is_empty());
        let off = crate::Paths {
            guest_tsc: false,
            ..paths
        };
        assert!(guest_clock_cmdline(&off, Accel::Tcg).is_empty());
        for incoming in [false, true] {
            let mut l = launch(incoming, !incoming);
            l.extra_cmdline.extend(words.iter().cloned());
            let a = args(&l).join(" ");
            assert!(
                a.contains("-M microvm,acpi=on,pit=off,memory-backend=mem"),
                "{a}"
            );
            if !incoming {
                assert!(a.contains("clocksource=tsc tsc=reliable"));
            }
        }
    }

    #[test]
    fn a_guarded_clone_asks_for_its_ram_file_writable() {
        let mut l = launch(true, false);
        l.ram_guarded = true;
        l.balloon = false;
        let a = args(&l).join(" ");
        assert!(a.contains("mem-path=/shm/ram,share=off "));
        assert!(!a.contains("readonly=on,rom"));
        assert!(!a.contains("virtio-balloon"));
    }
}

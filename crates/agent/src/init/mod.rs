//! PID 1 duties inside the VM.
//!
//! The kernel starts us from the initramfs that `scripts/build-initramfs.sh`
//! packs: `/init` (this binary), `/lib/modules/*.ko` and `/modules.order`.
//! [`boot`] turns that into a running guest: pseudo filesystems, the virtio
//! drivers, the rootfs from `/dev/vda` as the new `/`, hostname and network.
//! We stay PID 1 afterwards; [`crate::reaper`] reaps the orphans.

mod cmdline;
mod mounts;
mod net;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

pub use cmdline::Cmdline;

/// How long to wait for a device the kernel is still probing.
const DEVICE_WAIT: Duration = Duration::from_secs(20);

/// Bring the guest up. Errors name the step that failed; `main` prints them
/// to the console and powers the VM off so the host sees why.
pub fn boot() -> anyhow::Result<()> {
    let started = Instant::now();
    mounts::early().context("mounting /proc, /sys, /dev")?;
    mounts::reopen_console();
    let cmdline = Cmdline::read().context("reading /proc/cmdline")?;

    load_modules(Path::new("/modules.order")).context("loading kernel modules")?;

    let root_dev = cmdline.get("tine.root").unwrap_or("/dev/vda").to_string();
    wait_for(Path::new(&root_dev))
        .with_context(|| format!("waiting for the root disk {root_dev}"))?;
    mounts::switch_root(Path::new(&root_dev), Path::new("/newroot"))
        .with_context(|| format!("switching root to {root_dev}"))?;
    mounts::late().context("mounting /dev/pts, /dev/shm, /run")?;
    mounts::identity_on_tmpfs();

    let hostname = cmdline.get("tine.hostname").unwrap_or("tine");
    nix::unistd::sethostname(hostname).context("setting the hostname")?;

    net::up_loopback().context("bringing up lo")?;
    if let Some(ip) = cmdline.get("tine.ip") {
        wait_for(Path::new("/sys/class/net/eth0")).context("waiting for eth0")?;
        net::configure("eth0", ip, cmdline.get("tine.gw"))
            .with_context(|| format!("configuring eth0 with {ip}"))?;
    }
    if let Some(dns) = cmdline.get("tine.dns") {
        net::write_resolv_conf(Path::new("/etc/resolv.conf"), dns)
            .context("writing /etc/resolv.conf")?;
    }

    std::env::set_var(
        "PATH",
        "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    );
    std::env::set_var("HOME", "/root");
    eprintln!(
        "tine-agent: guest up in {} ms (kernel {})",
        started.elapsed().as_millis(),
        nix::sys::utsname::uname()
            .map(|u| u.release().to_string_lossy().into_owned())
            .unwrap_or_default()
    );
    Ok(())
}

/// Load the modules listed (dependencies first) in `order`. A module that is
/// already present (built in, or loaded) is fine.
fn load_modules(order: &Path) -> anyhow::Result<()> {
    let list = match std::fs::read_to_string(order) {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).context(format!("reading {}", order.display())),
    };
    for line in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let file = std::fs::File::open(line).with_context(|| format!("opening {line}"))?;
        match nix::kmod::finit_module(&file, c"", nix::kmod::ModuleInitFlags::empty()) {
            Ok(()) | Err(nix::errno::Errno::EEXIST) => {}
            Err(e) => bail!("loading {line}: {e}"),
        }
    }
    Ok(())
}

/// Poll until `path` exists (a device node or sysfs entry being probed).
fn wait_for(path: &Path) -> anyhow::Result<()> {
    let deadline = Instant::now() + DEVICE_WAIT;
    while !path.exists() {
        if Instant::now() > deadline {
            bail!("{} did not appear within {:?}", path.display(), DEVICE_WAIT);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    Ok(())
}

/// Stop the VM. QEMU runs with `-no-reboot`, so a reboot request makes it
/// exit, which the host driver sees as the VM ending.
pub fn power_off() -> ! {
    nix::unistd::sync();
    let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_AUTOBOOT);
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

//! Volumes mounted into sandboxes: NFSv3 from the host, one server per
//! mount inside the sandbox's own network namespace.
//!
//! Why NFS from the host, and not virtio-fs, 9p or a block device: a
//! mount has to survive pause/resume, snapshot restore and fork, which all
//! go through QEMU's migration stream. virtio-9p and vhost-user-fs block
//! migration; a shared block device allows one writer only. NFS lives in
//! the guest kernel's memory as a TCP client of an address, so a guest
//! restored anywhere (a resumed sandbox, every child of a fork) simply
//! reconnects and presents the same file handles ([`fs`] keeps them
//! valid), and many guests share one volume live.
//!
//! Every guest sees the same gateway address ([`tine_vmm::netns::HOST_IP`]);
//! each mount of a sandbox is served on port [`FIRST_PORT`] + its index, on
//! a listener created inside that sandbox's namespace: nothing outside it
//! can connect, and it serves only the volumes mounted into that sandbox.
//! The NFS server itself (nfsserve) listens on the namespace's loopback;
//! a [`relay`] of ours takes the guest's connections, so that they all
//! close when the sandbox's VM goes ([`Exports::release`]), and bounds what
//! a guest can make the server hold.
//! The NFS and MOUNT programs share the port (the guest mounts with
//! `port=` and `mountport=`, no portmapper, `nolock`).

mod attrs;
mod dirs;
pub mod fs;
mod handles;
mod io;
mod relay;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use nfsserve::tcp::{NFSTcp, NFSTcpListener};
use serde::{Deserialize, Serialize};
use tine_agent_client::GuestMount;
use tine_vmm::Guest;

use super::Volumes;
use fs::VolumeFs;

/// The port of a sandbox's first mount; the next ones follow.
pub const FIRST_PORT: u16 = *tine_vmm::firewall::VOLUME_PORTS.start();
/// Mounts one sandbox may have (the guest's firewall opens these ports).
pub const MAX_MOUNTS: usize = (*tine_vmm::firewall::VOLUME_PORTS.end() - FIRST_PORT) as usize + 1;

/// One entry of a sandbox's `volumeMounts`: volume `volume_id` (named
/// `name`) at `path` in the guest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeMount {
    pub volume_id: String,
    pub name: String,
    pub path: String,
}

/// The NFS servers of the sandboxes that mount volumes.
pub struct Exports {
    vols: Arc<Volumes>,
    /// One file system per volume, shared by every sandbox mounting it.
    shared: Mutex<HashMap<String, Weak<fs::Inner>>>,
    /// Each sandbox's servers.
    served: Mutex<HashMap<String, Vec<tokio::task::JoinHandle<()>>>>,
}

/// A volume's file handles start with this (fixed for the volume's life).
fn epoch(volume_id: &str) -> u64 {
    use sha2::Digest;
    let h = sha2::Sha256::digest(volume_id.as_bytes());
    u64::from_le_bytes(h[..8].try_into().expect("8 bytes")) | 1
}

impl Exports {
    pub fn new(vols: Arc<Volumes>) -> Self {
        Self {
            vols,
            shared: Mutex::new(HashMap::new()),
            served: Mutex::new(HashMap::new()),
        }
    }

    fn fs_of(&self, volume_id: &str) -> Result<VolumeFs, String> {
        let mut shared = self.shared.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(fs) = shared.get(volume_id).and_then(VolumeFs::upgrade) {
            return Ok(fs);
        }
        let row = self
            .vols
            .db
            .volume_by_id(volume_id)
            .map_err(|e| e.to_string())?
            .ok_or_else(|| format!("volume {volume_id} no longer exists"))?;
        let fs = VolumeFs::open(self.vols.clone(), &row.id, row.max_bytes, epoch(&row.id))
            .map_err(|e| format!("opening volume {volume_id}: {e}"))?;
        shared.retain(|_, w| w.strong_count() > 0);
        shared.insert(volume_id.to_string(), fs.downgrade());
        Ok(fs)
    }

    /// Serve `mounts` to sandbox `sandbox`, whose guest network is `guest`
    /// (replacing what it was served): what the guest's agent mounts.
    pub fn serve(
        &self,
        sandbox: &str,
        guest: &Guest,
        mounts: &[VolumeMount],
    ) -> Result<Vec<GuestMount>, String> {
        self.release(sandbox);
        if mounts.is_empty() {
            return Ok(Vec::new());
        }
        let mut tasks = Vec::new();
        let mut out = Vec::new();
        let result = (|| {
            for (i, m) in mounts.iter().enumerate().take(MAX_MOUNTS) {
                let fs = self.fs_of(&m.volume_id)?;
                let port = FIRST_PORT + i as u16;
                let failed =
                    |e: std::io::Error| format!("serving volume {} to the guest: {e}", m.name);
                let server = bind_inside(guest, port, fs).map_err(failed)?;
                let outer = guest.listen(port).map_err(failed)?;
                tasks.push(tokio::spawn(async move {
                    if let Err(e) = server.handle_forever().await {
                        tracing::warn!("volume server stopped: {e}");
                    }
                }));
                tasks.push(tokio::spawn(relay::run(outer, guest.clone(), port)));
                out.push(GuestMount {
                    path: m.path.clone(),
                    addr: tine_vmm::netns::HOST_IP.to_string(),
                    port,
                });
            }
            Ok(())
        })();
        if let Err(e) = result {
            tasks.iter().for_each(|t| t.abort());
            return Err(e);
        }
        self.served
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(sandbox.to_string(), tasks);
        Ok(out)
    }

    /// Sandbox `sandbox`'s VM is gone: stop its servers.
    pub fn release(&self, sandbox: &str) {
        let tasks = self
            .served
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(sandbox);
        for t in tasks.into_iter().flatten() {
            t.abort();
        }
    }
}

/// An NFS server of `fs` on the loopback of `guest`'s namespace, `port`.
fn bind_inside(
    guest: &Guest,
    port: u16,
    fs: VolumeFs,
) -> std::io::Result<NFSTcpListener<VolumeFs>> {
    let handle = tokio::runtime::Handle::current();
    let (tx, rx) = std::sync::mpsc::channel();
    let addr = format!("127.0.0.1:{port}");
    guest.run_inside(Box::new(move || {
        // The socket is made (and bound) on this thread, in the guest's
        // namespace, and registered with the server's runtime.
        let _ = tx.send(handle.block_on(NFSTcpListener::bind(&addr, fs)));
    }))?;
    rx.recv()
        .map_err(|_| std::io::Error::other("the namespace thread sent nothing"))?
}

//! The warm pool: per template snapshot, a few VMs restored ahead of time
//! (namespace, overlay, QEMU process, device state), run until their agent
//! answered a `/init` of their own (under TCG that fills QEMU's translation
//! cache for those code paths, which a fresh restore pays for on its first
//! calls), then paused again. A create runs the vCPUs, checks the agent and
//! hands the guest its real identity with another `/init` (clock, entropy,
//! token, env, host name): the reseed still happens on the create path,
//! only the restore and the warm-up have moved off it. Taken VMs are
//! replaced in the background.
//! Each pooled VM already carries the sandbox id it will be created under
//! (ids name namespaces and directories).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tine_vmm::{Driver, SnapshotRef, VmHandle};

/// A pooled VM and the access token its warm-up `/init` gave it (needed to
/// replace it).
pub struct Pooled {
    pub vm: Box<dyn VmHandle>,
    pub token: String,
}

pub struct WarmPool {
    size: usize,
    driver: Arc<dyn Driver>,
    network: Arc<crate::network::Network>,
    ready: Mutex<HashMap<String, Vec<Pooled>>>,
    filling: Mutex<HashSet<String>>,
    /// Set by [`WarmPool::drain`]: no new warm-ups, and one that finishes
    /// kills its VM instead of keeping it.
    closed: AtomicBool,
    /// Warm-ups in flight (a drain waits for them).
    warming: AtomicUsize,
}

/// How long a drain waits for warm-ups in flight to end.
const DRAIN_WAIT: Duration = Duration::from_secs(30);

impl WarmPool {
    pub fn new(
        size: usize,
        driver: Arc<dyn Driver>,
        network: Arc<crate::network::Network>,
    ) -> Self {
        Self {
            size,
            driver,
            network,
            ready: Mutex::new(HashMap::new()),
            filling: Mutex::new(HashSet::new()),
            closed: AtomicBool::new(false),
            warming: AtomicUsize::new(0),
        }
    }

    /// A paused, loaded VM of `snapshot_id`, if one is ready (pooled VMs
    /// whose QEMU died are dropped; their files go at the next start).
    pub fn take(&self, snapshot_id: &str) -> Option<Pooled> {
        let mut ready = self.ready.lock().unwrap_or_else(|e| e.into_inner());
        let vms = ready.get_mut(snapshot_id)?;
        while let Some(p) = vms.pop() {
            if p.vm.exit_status().is_none() {
                return Some(p);
            }
            tracing::warn!(vm = p.vm.id(), "warm pool: a pooled VM died");
        }
        None
    }

    fn count(&self, snapshot_id: &str) -> usize {
        self.ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(snapshot_id)
            .map_or(0, Vec::len)
    }

    /// Top the pool of `snapshot` up to its size, in the background, with
    /// at most `room` new VMs (what the sandbox limit leaves).
    pub fn refill(self: &Arc<Self>, snapshot: SnapshotRef, room: usize) {
        if self.size == 0 || room == 0 {
            return;
        }
        let key = snapshot.id().to_string();
        if !self
            .filling
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.clone())
        {
            return; // a refill of this snapshot is already running
        }
        let pool = self.clone();
        tokio::spawn(async move {
            let mut room = room;
            while pool.count(&key) < pool.size && room > 0 {
                room -= 1;
                pool.warming.fetch_add(1, Ordering::SeqCst);
                if pool.closed.load(Ordering::SeqCst) {
                    pool.warming.fetch_sub(1, Ordering::SeqCst);
                    break;
                }
                let id = crate::ids::sandbox_id();
                let warmed = warm(pool.driver.as_ref(), &pool.network, &id, &snapshot).await;
                let warmed = match warmed {
                    // Drained meanwhile: this VM is not kept.
                    Ok(p) if pool.closed.load(Ordering::SeqCst) => {
                        let _ = p.vm.kill().await;
                        Err("the pool was drained".to_string())
                    }
                    other => other,
                };
                pool.warming.fetch_sub(1, Ordering::SeqCst);
                match warmed {
                    Ok(vm) => pool
                        .ready
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .entry(key.clone())
                        .or_default()
                        .push(vm),
                    Err(e) => {
                        tracing::warn!(snapshot = %key, "warm pool: restore failed: {e}");
                        break;
                    }
                }
            }
            pool.filling
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .remove(&key);
        });
    }

    /// Kill the pooled VMs of snapshots `keep` refuses (a template that
    /// was rebuilt or deleted: nothing creates from it any more).
    pub async fn retain(&self, keep: impl Fn(&str) -> bool) {
        let gone: Vec<Pooled> = {
            let mut ready = self.ready.lock().unwrap_or_else(|e| e.into_inner());
            let stale: Vec<String> = ready.keys().filter(|k| !keep(k)).cloned().collect();
            stale
                .iter()
                .filter_map(|k| ready.remove(k))
                .flatten()
                .collect()
        };
        for p in gone {
            tracing::info!(
                vm = p.vm.id(),
                "warm pool: dropping a VM of a template that is gone"
            );
            let _ = p.vm.kill().await;
        }
    }

    /// Kill every pooled VM (at shutdown).
    ///
    /// (Pooled VMs are paused: they use no CPU while they wait.)
    /// Warm-ups in flight finish first (within [`DRAIN_WAIT`]), killing
    /// what they restored, so no QEMU outlives the server unowned.
    pub async fn drain(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let deadline = tokio::time::Instant::now() + DRAIN_WAIT;
        while self.warming.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let all: Vec<Pooled> = self
            .ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .flat_map(|(_, v)| v)
            .collect();
        for p in all {
            let _ = p.vm.kill().await;
        }
    }

    /// Let go of up to `n` pooled VMs (killed in the background) to make
    /// room for sandboxes; returns how many.
    pub fn shrink(&self, n: usize) -> usize {
        let gone: Vec<Pooled> = {
            let mut ready = self.ready.lock().unwrap_or_else(|e| e.into_inner());
            let mut gone = Vec::new();
            for vms in ready.values_mut() {
                while gone.len() < n {
                    match vms.pop() {
                        Some(p) => gone.push(p),
                        None => break,
                    }
                }
            }
            gone
        };
        let count = gone.len();
        for p in gone {
            tracing::info!(
                vm = p.vm.id(),
                "warm pool: a pooled VM makes room for a sandbox"
            );
            tokio::spawn(async move {
                let _ = p.vm.kill().await;
            });
        }
        count
    }

    /// Pooled VMs ready.
    pub fn len(&self) -> usize {
        let ready = self.ready.lock().unwrap_or_else(|e| e.into_inner());
        ready.values().map(Vec::len).sum()
    }

    /// Warm-ups in flight.
    pub fn warming(&self) -> usize {
        self.warming.load(Ordering::SeqCst)
    }

    /// Ids of pooled VMs (they have directories but no sandbox rows).
    pub fn ids(&self) -> HashSet<String> {
        self.ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .flatten()
            .map(|p| p.vm.id().to_string())
            .collect()
    }
}

/// Restore, run until the agent answered a `/init`, pause. The default
/// network policy is loaded but not opened (the guest forwards nothing
/// until its sandbox's policy is applied).
async fn warm(
    driver: &dyn Driver,
    network: &crate::network::Network,
    id: &str,
    snapshot: &SnapshotRef,
) -> Result<Pooled, String> {
    let mut vm = driver
        .restore_paused(id, snapshot)
        .await
        .map_err(|e| e.to_string())?;
    let token = crate::ids::random_hex(24);
    let warmed = async {
        network
            .apply_default(&vm.guest(), false)
            .await
            .map_err(|e| e.to_string())?;
        vm.start().await.map_err(|e| e.to_string())?;
        super::agent::init(&vm.guest(), id, Default::default(), &token, None)
            .await
            .map_err(|e| e.to_string())?;
        vm.pause().await.map_err(|e| e.to_string())
    }
    .await;
    match warmed {
        Ok(()) => Ok(Pooled { vm, token }),
        Err(e) => {
            let _ = vm.kill().await;
            Err(e)
        }
    }
}

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
//!
//! The pool also holds VMs restored ahead of a resume (`resume_ahead`):
//! right after a pause, its capture is loaded into a QEMU under the
//! paused sandbox's own id (namespace, overlay, process, RAM layers,
//! device state), vCPUs stopped and never run, so the sandbox's processes
//! do not advance while it is paused. Only that sandbox's resume of that
//! capture takes it; a kill, a resume from elsewhere or a shortage of room
//! kills it. Per sandbox by construction: its id names its namespace, its
//! directory, its jail's uid and cgroup, and its disk is an overlay over
//! that sandbox's capture.

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

/// A VM restored ahead of its sandbox's resume.
struct Ahead {
    /// The capture it was restored from.
    snapshot_id: String,
    vm: Box<dyn VmHandle>,
}

pub struct WarmPool {
    size: usize,
    /// VMs restored ahead of resumes, at most.
    resume_ahead: usize,
    /// Sandbox id → its VM restored ahead of its resume.
    ahead: Mutex<HashMap<String, Ahead>>,
    /// Restores ahead reserved and not finished (they count against
    /// `resume_ahead` as held ones do).
    ahead_starting: AtomicUsize,
    /// VMs restored ahead being killed in the background (evicted to make
    /// room), by sandbox id: whatever uses that id next waits for the kill,
    /// which removes files named after the id.
    dying: Mutex<HashMap<String, tokio::task::JoinHandle<()>>>,
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
        resume_ahead: usize,
        driver: Arc<dyn Driver>,
        network: Arc<crate::network::Network>,
    ) -> Self {
        Self {
            size,
            resume_ahead,
            ahead: Mutex::new(HashMap::new()),
            ahead_starting: AtomicUsize::new(0),
            dying: Mutex::new(HashMap::new()),
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
        let ahead: Vec<Ahead> = self
            .ahead
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, a)| a)
            .collect();
        for a in ahead {
            kill_or_clean(self.driver.as_ref(), a.vm).await;
        }
        let dying: Vec<_> = self
            .dying
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain()
            .map(|(_, h)| h)
            .collect();
        for kill in dying {
            let _ = kill.await;
        }
    }

    /// Let go of up to `n` pooled VMs (killed in the background) to make
    /// room for sandboxes; returns how many.
    pub fn shrink(&self, n: usize) -> usize {
        let gone: Vec<Box<dyn VmHandle>> = {
            let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            let ids: Vec<String> = ahead.keys().take(n).cloned().collect();
            ids.iter()
                .filter_map(|id| ahead.remove(id))
                .map(|a| a.vm)
                .collect()
        };
        let n = n - gone.len();
        let mut count = gone.len();
        for vm in gone {
            tracing::info!(
                vm = vm.id(),
                "resume ahead: a VM restored for a paused sandbox makes room"
            );
            self.kill_in_background(vm);
        }
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
        count += gone.len();
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

    /// Pooled VMs ready, and VMs restored ahead of resumes.
    pub fn len(&self) -> usize {
        let ready = self.ready.lock().unwrap_or_else(|e| e.into_inner());
        let ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner()).len();
        ready.values().map(Vec::len).sum::<usize>() + ahead
    }

    /// Warm-ups in flight.
    pub fn warming(&self) -> usize {
        self.warming.load(Ordering::SeqCst)
    }

    /// Ids of pooled VMs (they have directories but no live sandbox).
    pub fn ids(&self) -> HashSet<String> {
        let mut ids: HashSet<String> = self
            .ready
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .flatten()
            .map(|p| p.vm.id().to_string())
            .collect();
        ids.extend(
            self.ahead
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .keys()
                .cloned(),
        );
        ids
    }

    /// Reserve a restore ahead of a resume: false when `resume_ahead` are
    /// held or starting already, or the pool is drained. A reserved one
    /// holds a slot of the sandbox limit; [`WarmPool::restore_ahead`] ends
    /// the reservation.
    pub fn reserve_ahead(&self) -> bool {
        let ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        if self.closed.load(Ordering::SeqCst)
            || ahead.len() + self.ahead_starting.load(Ordering::SeqCst) >= self.resume_ahead
        {
            return false;
        }
        self.ahead_starting.fetch_add(1, Ordering::SeqCst);
        self.warming.fetch_add(1, Ordering::SeqCst);
        true
    }

    /// Restore `snapshot` (the capture sandbox `id` was just paused into)
    /// as VM `id`, vCPUs stopped, for that sandbox's resume. The caller
    /// holds the sandbox's lock (taken for the pause) and reserved it
    /// ([`WarmPool::reserve_ahead`]).
    pub async fn restore_ahead(&self, id: &str, snapshot: &SnapshotRef) {
        // Nothing else may hold the id while it is restored again.
        let _ = self.take_ahead(id, None).await;
        let restored = if self.closed.load(Ordering::SeqCst) {
            None
        } else {
            Some(self.driver.restore_paused(id, snapshot).await)
        };
        match restored {
            Some(Ok(vm)) if !self.closed.load(Ordering::SeqCst) => {
                let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
                ahead.insert(
                    id.to_string(),
                    Ahead {
                        snapshot_id: snapshot.id().to_string(),
                        vm,
                    },
                );
                // Under the same lock: never counted twice, nor not at all.
                self.end_reservation();
            }
            // Drained meanwhile.
            Some(Ok(vm)) => {
                self.end_reservation();
                kill_or_clean(self.driver.as_ref(), vm).await;
            }
            Some(Err(e)) => {
                self.end_reservation();
                tracing::warn!(sandbox = id, "resume ahead: restore failed: {e}");
            }
            None => self.end_reservation(),
        }
    }

    fn end_reservation(&self) {
        self.ahead_starting.fetch_sub(1, Ordering::SeqCst);
        self.warming.fetch_sub(1, Ordering::SeqCst);
    }

    /// Kill `vm` (restored ahead) without waiting; the next user of its id
    /// waits for it ([`WarmPool::take_ahead`]).
    fn kill_in_background(&self, vm: Box<dyn VmHandle>) {
        let id = vm.id().to_string();
        let driver = self.driver.clone();
        let handle = tokio::spawn(async move { kill_or_clean(driver.as_ref(), vm).await });
        let mut dying = self.dying.lock().unwrap_or_else(|e| e.into_inner());
        // Kills that are over need no waiting: forget them.
        dying.retain(|_, kill| !kill.is_finished());
        dying.insert(id, handle);
    }

    /// The VM restored ahead for sandbox `id`'s resume from capture
    /// `snapshot_id`, if there is one and it is alive. Any other VM held
    /// for `id`, or being killed, is gone when this returns (its id is
    /// about to be used again).
    pub async fn take_ahead(
        &self,
        id: &str,
        snapshot_id: Option<&str>,
    ) -> Option<Box<dyn VmHandle>> {
        let dying = self
            .dying
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id);
        if let Some(kill) = dying {
            let _ = kill.await;
        }
        let a = self
            .ahead
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(id)?;
        if snapshot_id.is_some_and(|s| s == a.snapshot_id) && a.vm.exit_status().is_none() {
            return Some(a.vm);
        }
        tracing::info!(sandbox = id, "resume ahead: its VM is not used");
        kill_or_clean(self.driver.as_ref(), a.vm).await;
        None
    }
}

/// Kill `vm`; if that fails, remove whatever it left under its id.
async fn kill_or_clean(driver: &dyn Driver, vm: Box<dyn VmHandle>) {
    let id = vm.id().to_string();
    if let Err(e) = vm.kill().await {
        tracing::warn!(vm = %id, "killing a VM restored ahead: {e}");
        driver.cleanup(&id).await;
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
        super::agent::init(
            &vm.guest(),
            id,
            Default::default(),
            &token,
            None,
            Vec::new(),
            None,
        )
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

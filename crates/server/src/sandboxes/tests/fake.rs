//! An in-memory [`Driver`] for the manager's unit tests: it records every
//! call, fails the operations it is told to, and its guests are one small
//! HTTP server on loopback that answers like the agent and records what it
//! was sent. Kept small and honest: no VM, no files.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tine_vmm::{
    Artifacts, BoxFuture, Capture, CaptureFailed, Driver, Error, Guest, GuestNet, Machine,
    SnapshotInfo, SnapshotRef, SnapshotStore, VmHandle,
};

/// What the fake agent was sent: method, path, `x-access-token`, body.
#[derive(Debug, Clone)]
pub struct AgentCall {
    pub path: String,
    pub token: Option<String>,
    pub body: serde_json::Value,
}

#[derive(Default)]
pub struct State {
    pub calls: Vec<String>,
    /// Operations to fail, each as many times as its count.
    pub fail: HashMap<&'static str, usize>,
    /// VMs that exist (ids), and snapshots with their parent.
    pub vms: HashSet<String>,
    /// Ids a VM was started under while another VM had it.
    pub reused: Vec<String>,
    pub snapshots: HashMap<String, (SnapshotInfo, Option<String>)>,
    pub agent_calls: Vec<AgentCall>,
}

#[derive(Clone)]
pub struct FakeDriver {
    pub state: Arc<Mutex<State>>,
    agent: SocketAddr,
    pids: Arc<AtomicI32>,
}

fn failure(op: &str) -> Error {
    Error::Io {
        context: format!("fake {op}"),
        source: std::io::Error::other("failed on demand"),
    }
}

impl FakeDriver {
    pub async fn start() -> Self {
        let state: Arc<Mutex<State>> = Arc::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let agent = listener.local_addr().unwrap();
        let recorded = state.clone();
        let app = axum::Router::new().fallback(move |req: axum::extract::Request| {
            let recorded = recorded.clone();
            async move {
                let path = req.uri().path().to_string();
                let token = req
                    .headers()
                    .get("x-access-token")
                    .and_then(|v| v.to_str().ok())
                    .map(String::from);
                let bytes = axum::body::to_bytes(req.into_body(), 1 << 20)
                    .await
                    .unwrap_or_default();
                let body = serde_json::from_slice(&bytes).unwrap_or(serde_json::Value::Null);
                let mut s = recorded.lock().unwrap();
                s.agent_calls.push(AgentCall { path, token, body });
                "{}"
            }
        });
        tokio::spawn(async move { axum::serve(listener, app).await });
        Self {
            state,
            agent,
            pids: Arc::new(AtomicI32::new(100)),
        }
    }

    /// Fail the next `times` calls of `op`.
    pub fn fail(&self, op: &'static str, times: usize) {
        self.state.lock().unwrap().fail.insert(op, times);
    }

    pub fn calls(&self, prefix: &str) -> Vec<String> {
        let s = self.state.lock().unwrap();
        s.calls
            .iter()
            .filter(|c| c.starts_with(prefix))
            .cloned()
            .collect()
    }

    pub fn inits(&self) -> Vec<AgentCall> {
        let s = self.state.lock().unwrap();
        s.agent_calls
            .iter()
            .filter(|c| c.path == "/init")
            .cloned()
            .collect()
    }

    pub fn has_snapshot(&self, id: &str) -> bool {
        self.state.lock().unwrap().snapshots.contains_key(id)
    }

    pub fn snapshot_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self
            .state
            .lock()
            .unwrap()
            .snapshots
            .keys()
            .cloned()
            .collect();
        ids.sort();
        ids
    }

    /// Record `call`; an error if `op` is to fail now.
    fn enter(&self, op: &'static str, call: String) -> Result<(), Error> {
        let mut s = self.state.lock().unwrap();
        s.calls.push(call);
        match s.fail.get_mut(op) {
            Some(n) if *n > 0 => {
                *n -= 1;
                Err(failure(op))
            }
            _ => Ok(()),
        }
    }

    fn vm(&self, id: &str, machine: Machine, parent: Option<String>) -> Box<dyn VmHandle> {
        let mut s = self.state.lock().unwrap();
        if !s.vms.insert(id.to_string()) {
            // One id names one VM's namespace, directory and jail.
            s.reused.push(id.to_string());
        }
        drop(s);
        Box::new(FakeVm {
            id: id.to_string(),
            pid: self.pids.fetch_add(1, Ordering::Relaxed),
            machine,
            parent,
            driver: self.clone(),
        })
    }

    pub fn add_snapshot(&self, id: &str, machine: Machine, parent: Option<String>) -> SnapshotRef {
        let layers = match &parent {
            Some(p) => self.state.lock().unwrap().snapshots[p].0.layers + 1,
            None => 0,
        };
        let info = SnapshotInfo {
            id: id.to_string(),
            machine,
            layers,
            disk_size_mb: 1,
            layer_bytes: 0,
            root_ram_bytes: 0,
            memory_file: Default::default(),
        };
        self.state
            .lock()
            .unwrap()
            .snapshots
            .insert(id.to_string(), (info.clone(), parent));
        SnapshotRef::new(info, ())
    }
}

struct FakeGuest(SocketAddr);

impl GuestNet for FakeGuest {
    fn connect(&self, _port: u16) -> BoxFuture<'_, std::io::Result<tokio::net::TcpStream>> {
        Box::pin(tokio::net::TcpStream::connect(self.0))
    }
    fn set_egress<'a>(
        &'a self,
        _rules: &'a tine_vmm::EgressRules,
        _open: bool,
    ) -> BoxFuture<'a, tine_vmm::Result<()>> {
        Box::pin(async { Ok(()) })
    }
    fn listen(&self, _port: u16) -> std::io::Result<tokio::net::TcpListener> {
        Err(std::io::ErrorKind::Unsupported.into())
    }
    fn connect_out(
        &self,
        _addr: std::net::SocketAddrV4,
    ) -> BoxFuture<'_, std::io::Result<tokio::net::TcpStream>> {
        Box::pin(async { Err(std::io::ErrorKind::Unsupported.into()) })
    }
    fn run_inside(&self, _f: Box<dyn FnOnce() + Send>) -> std::io::Result<()> {
        Err(std::io::ErrorKind::Unsupported.into())
    }
}

#[async_trait::async_trait]
impl Driver for FakeDriver {
    async fn boot(
        &self,
        id: &str,
        machine: Machine,
        _: &Artifacts,
    ) -> tine_vmm::Result<Box<dyn VmHandle>> {
        self.enter("boot", format!("boot {id}"))?;
        Ok(self.vm(id, machine, None))
    }

    async fn boot_from_disk(
        &self,
        id: &str,
        snapshot: &SnapshotRef,
    ) -> tine_vmm::Result<Box<dyn VmHandle>> {
        self.enter("boot", format!("boot_from_disk {id} {}", snapshot.id()))?;
        Ok(self.vm(id, snapshot.info().machine, None))
    }

    async fn restore_paused(
        &self,
        id: &str,
        snapshot: &SnapshotRef,
    ) -> tine_vmm::Result<Box<dyn VmHandle>> {
        self.enter("restore", format!("restore_paused {id} {}", snapshot.id()))?;
        Ok(self.vm(id, snapshot.info().machine, Some(snapshot.id().to_string())))
    }

    async fn restore(
        &self,
        id: &str,
        snapshot: &SnapshotRef,
    ) -> tine_vmm::Result<Box<dyn VmHandle>> {
        self.enter("restore", format!("restore {id} {}", snapshot.id()))?;
        // A real restore takes a while: let concurrent callers interleave.
        tokio::task::yield_now().await;
        Ok(self.vm(id, snapshot.info().machine, Some(snapshot.id().to_string())))
    }

    async fn adopt(&self, id: &str) -> tine_vmm::Result<Box<dyn VmHandle>> {
        self.enter("adopt", format!("adopt {id}"))?;
        if !self.state.lock().unwrap().vms.contains(id) {
            return Err(Error::NotFound {
                what: "VM",
                id: id.into(),
            });
        }
        Ok(self.vm(id, Machine::default(), None))
    }

    async fn cleanup(&self, id: &str) {
        let _ = self.enter("cleanup", format!("cleanup {id}"));
        self.state.lock().unwrap().vms.remove(id);
    }

    fn vm_ids(&self) -> Vec<String> {
        self.state.lock().unwrap().vms.iter().cloned().collect()
    }

    fn console_log(&self, id: &str) -> String {
        format!("console of {id}")
    }

    /// Nothing to finish (the fake's captures are whole or absent); fails
    /// when told to.
    fn salvage_capture(&self, id: &str, snapshot_id: &str) -> tine_vmm::Result<bool> {
        self.enter(
            "salvage_capture",
            format!("salvage_capture {id} {snapshot_id}"),
        )?;
        Ok(false)
    }

    /// No optional devices.
    fn boot_devices(&self) -> String {
        String::new()
    }

    fn snapshots(&self) -> &dyn SnapshotStore {
        self
    }
}

#[async_trait::async_trait]
impl SnapshotStore for FakeDriver {
    fn open_snapshot(&self, id: &str) -> tine_vmm::Result<SnapshotRef> {
        self.enter("open_snapshot", format!("open_snapshot {id}"))?;
        let s = self.state.lock().unwrap();
        let (info, _) = s.snapshots.get(id).ok_or_else(|| Error::NotFound {
            what: "snapshot",
            id: id.into(),
        })?;
        Ok(SnapshotRef::new(info.clone(), ()))
    }

    /// Those not kept and below none that is (the fake's VMs sit on
    /// nothing); the grace is not modelled.
    fn unneeded_snapshots(
        &self,
        keep: &std::collections::HashSet<String>,
        _grace: std::time::Duration,
    ) -> Vec<String> {
        let st = self.state.lock().unwrap();
        let mut needed = std::collections::HashSet::new();
        let mut queue: Vec<String> = keep.iter().cloned().collect();
        while let Some(id) = queue.pop() {
            if needed.insert(id.clone()) {
                queue.extend(st.snapshots.get(&id).and_then(|s| s.1.clone()));
            }
        }
        let mut out: Vec<String> = st
            .snapshots
            .keys()
            .filter(|id| !needed.contains(*id))
            .cloned()
            .collect();
        out.sort();
        out
    }

    fn delete_snapshot(&self, id: &str) -> tine_vmm::Result<()> {
        self.enter("delete_snapshot", format!("delete_snapshot {id}"))?;
        self.state.lock().unwrap().snapshots.remove(id);
        Ok(())
    }

    async fn compact(&self, id: &str) -> tine_vmm::Result<Option<String>> {
        self.enter("compact", format!("compact {id}"))?;
        Ok(None)
    }

    async fn materialize(&self, id: &str) -> tine_vmm::Result<bool> {
        self.enter("materialize", format!("materialize {id}"))?;
        Ok(true)
    }

    /// No temp files: nothing is rewritten on disk.
    fn remove_stale_temp_files(&self, _grace: std::time::Duration) -> usize {
        0
    }

    /// Unknown, as the trait allows.
    fn free_disk_bytes(&self) -> Option<u64> {
        None
    }

    /// Fake snapshots take no disk.
    fn snapshot_bytes(&self, _id: &str) -> u64 {
        0
    }
}

struct FakeVm {
    id: String,
    pid: i32,
    machine: Machine,
    parent: Option<String>,
    driver: FakeDriver,
}

#[async_trait::async_trait]
impl VmHandle for FakeVm {
    fn id(&self) -> &str {
        &self.id
    }
    fn process_id(&self) -> i32 {
        self.pid
    }
    fn exit_status(&self) -> Option<String> {
        let alive = self.driver.state.lock().unwrap().vms.contains(&self.id);
        (!alive).then(|| "killed behind the manager's back".to_string())
    }
    fn memory_file(&self) -> Option<std::path::PathBuf> {
        None
    }
    fn guest(&self) -> Guest {
        Arc::new(FakeGuest(self.driver.agent))
    }
    async fn start(&mut self) -> tine_vmm::Result<()> {
        self.driver.enter("start", format!("start {}", self.id))
    }
    async fn pause(&mut self) -> tine_vmm::Result<()> {
        self.driver.enter("pause", format!("pause {}", self.id))
    }
    /// The fake's guests never stop on their own.
    async fn check_running(&mut self) -> tine_vmm::Result<Option<String>> {
        Ok(None)
    }
    async fn ensure_running(&mut self) -> tine_vmm::Result<()> {
        self.driver
            .enter("ensure_running", format!("ensure_running {}", self.id))
    }
    async fn capture(&mut self, snapshot_id: &str) -> tine_vmm::Result<Capture> {
        self.driver
            .enter("capture", format!("capture {} {snapshot_id}", self.id))?;
        let snapshot = self
            .driver
            .add_snapshot(snapshot_id, self.machine, self.parent.clone());
        self.parent = Some(snapshot_id.to_string());
        Ok(Capture {
            snapshot,
            vcpus_stopped: Duration::from_millis(1),
        })
    }
    async fn capture_and_kill(
        self: Box<Self>,
        snapshot_id: &str,
    ) -> Result<SnapshotRef, CaptureFailed> {
        // "capture" fails it before QEMU exits (the VM goes on),
        // "capture_exit" after (the VM is gone).
        let call = format!("capture_and_kill {} {snapshot_id}", self.id);
        if let Err(error) = self.driver.enter("capture", call) {
            return Err(CaptureFailed {
                error,
                vm: Some(self),
            });
        }
        self.driver.state.lock().unwrap().vms.remove(&self.id);
        self.driver
            .enter("capture_exit", format!("exited {} {snapshot_id}", self.id))
            .map_err(CaptureFailed::gone)?;
        Ok(self
            .driver
            .add_snapshot(snapshot_id, self.machine, self.parent.clone()))
    }
    async fn kill(self: Box<Self>) -> tine_vmm::Result<()> {
        self.driver.state.lock().unwrap().vms.remove(&self.id);
        self.driver.enter("kill", format!("kill {}", self.id))
    }
}

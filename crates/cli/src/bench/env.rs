//! Where the bench runs: a `tine serve` it starts itself, in its own data
//! dir (`$TINE_DATA_DIR/bench`, whose `current` links to the guest
//! artifacts of `$TINE_DATA_DIR/current`), or a server it is given.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use tine_vmm::Paths;

/// A server started by the bench; stopped by [`OwnServer::stop`].
pub struct OwnServer {
    child: Option<tokio::process::Child>,
    port: u16,
    cpus: u32,
    memory_mb: u32,
    pub pool_size: usize,
    /// Paused sandboxes restored ahead of their resume (`resume_ahead`).
    pub resume_ahead: usize,
    /// `max_sandboxes` of its config; `None`: the server's default (and its
    /// `max_sandboxes_per_core`), as P15's density measures.
    pub max_sandboxes: Option<usize>,
    /// Whether its VMs run jailed (`[jail] enabled`).
    pub jail: bool,
    pub url: String,
    pub key: String,
    pub paths: Paths,
    pub log: PathBuf,
}

/// The data dir of the bench's own server, next to the usual one.
pub fn own_paths(base: &Paths) -> Paths {
    Paths {
        data_dir: base.data_dir.join("bench"),
        shm_dir: PathBuf::from(format!("{}-bench", base.shm_dir.display())),
        jail: base.jail.clone(),
        track_writes: base.track_writes,
        balloon: base.balloon,
        guest_tsc: base.guest_tsc,
    }
}

/// Where VMs started by hand live (a data dir no server owns, so no
/// server's recovery ever touches them).
pub fn floor_paths(base: &Paths) -> Paths {
    Paths {
        data_dir: base.data_dir.join("bench-floor"),
        shm_dir: PathBuf::from(format!("{}-bench-floor", base.shm_dir.display())),
        jail: base.jail.clone(),
        track_writes: base.track_writes,
        balloon: base.balloon,
        guest_tsc: base.guest_tsc,
    }
}

pub(super) fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

pub(super) fn link_artifacts(base: &Paths, paths: &Paths) -> anyhow::Result<()> {
    std::fs::create_dir_all(&paths.data_dir)
        .with_context(|| format!("creating {}", paths.data_dir.display()))?;
    let src = base.data_dir.join("current");
    if !src.join("vmlinuz").exists() {
        bail!(
            "no guest artifacts in {} (scripts/setup-host.sh builds them)",
            src.display()
        );
    }
    let link = paths.data_dir.join("current");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&src, &link).with_context(|| format!("linking {}", link.display()))
}

/// Where, in the bench server's data dir, P10's stand-in internet keeps
/// the CA of its HTTPS certificates.
pub const INET_CA_DIR: &str = "bench-inet-ca";

/// The bench server's `max_sandboxes` (every scenario but P15's density).
pub const BENCH_MAX_SANDBOXES: usize = 128;

#[allow(clippy::too_many_arguments)]
fn write_config(
    dir: &Path,
    port: u16,
    cpus: u32,
    memory_mb: u32,
    pool_size: usize,
    resume_ahead: usize,
    max_sandboxes: Option<usize>,
    jail: bool,
) -> anyhow::Result<PathBuf> {
    let path = dir.join("bench-server.toml");
    // P10's stand-in internet serves HTTPS with certificates of this CA,
    // which the server trusts for destinations of header transforms.
    let inet_ca = dir.join(INET_CA_DIR);
    tine_server::network::ca::EgressCa::load_or_create(&inet_ca)?;
    let text = format!(
        "listen = \"127.0.0.1:{port}\"\n\
         pool_size = {pool_size}\n\
         resume_ahead = {resume_ahead}\n\
         default_cpu_count = {cpus}\n\
         default_memory_mb = {memory_mb}\n\
         default_timeout_secs = 1800\n\
         max_fork_count = 64\n\
         {max}\
         [jail]\n\
         enabled = {jail}\n\
         [network]\n\
         upstream_ca_file = \"{ca}\"\n",
        max = max_sandboxes.map_or(String::new(), |m| format!("max_sandboxes = {m}\n")),
        ca = inet_ca.join("ca.crt").display(),
    );
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

impl OwnServer {
    /// Start `tine serve` (this very binary) on a free loopback port, with a
    /// fresh API key and `pool_size` warm VMs, and wait until it answers
    /// `/health`.
    pub async fn start(
        base: &Paths,
        cpus: u32,
        memory_mb: u32,
        pool_size: usize,
    ) -> anyhow::Result<Self> {
        let paths = own_paths(base);
        link_artifacts(base, &paths)?;
        let key = tine_server::db::Db::open(&paths.data_dir.join("tine.db"))?
            .create_key(&format!("bench-{}", std::process::id()))?
            .plaintext;
        let port = free_port()?;
        let log = paths.data_dir.join("bench-server.log");
        let _ = std::fs::remove_file(&log);
        let url = format!("http://127.0.0.1:{port}");
        let mut server = Self {
            child: None,
            port,
            cpus,
            memory_mb,
            pool_size,
            resume_ahead: 0,
            max_sandboxes: Some(BENCH_MAX_SANDBOXES),
            jail: true,
            url,
            key,
            paths,
            log,
        };
        server.spawn().await?;
        Ok(server)
    }

    /// Stop the server and start it again with another warm pool size (its
    /// sandboxes must be gone: the restart would adopt them).
    pub async fn restart(&mut self, pool_size: usize) -> anyhow::Result<()> {
        self.stop().await;
        self.pool_size = pool_size;
        self.spawn().await
    }

    async fn spawn(&mut self) -> anyhow::Result<()> {
        let config = write_config(
            &self.paths.data_dir,
            self.port,
            self.cpus,
            self.memory_mb,
            self.pool_size,
            self.resume_ahead,
            self.max_sandboxes,
            self.jail,
        )?;
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("opening {}", self.log.display()))?;
        let exe = std::env::current_exe().context("finding the tine binary")?;
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("serve")
            .arg("-c")
            .arg(&config)
            .env("TINE_DATA_DIR", &self.paths.data_dir)
            .env("TINE_SHM_DIR", &self.paths.shm_dir)
            // Per-stage timings of restores and captures (see `stages`).
            .env("TINE_LOG", "info,tine_vmm=debug,tine_server=debug")
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out);
        // Its own process group: a Ctrl-C reaches the bench only, which then
        // removes its sandboxes through the server before stopping it.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        let mut child = tokio::process::Command::from(cmd)
            .kill_on_drop(true)
            .spawn()
            .context("starting tine serve")?;
        let api = crate::client::Api::new(&self.url, &self.key);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if api.health().await {
                self.child = Some(child);
                return Ok(());
            }
            if let Some(status) = child.try_wait()? {
                bail!(
                    "tine serve exited ({status}): {}",
                    tine_vmm::log_tail(&self.log, 800)
                );
            }
            if Instant::now() > deadline {
                let _ = child.kill().await;
                bail!(
                    "tine serve did not answer /health within 60 s: {}",
                    tine_vmm::log_tail(&self.log, 800)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGTERM, then SIGKILL after 10 s.
    pub async fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Some(pid) = child.id() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid as i32),
                nix::sys::signal::Signal::SIGTERM,
            );
        }
        if tokio::time::timeout(Duration::from_secs(15), child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
    }
}

/// Remove VMs left by hand in `paths` by an interrupted earlier run.
pub async fn clean_hand_vms(paths: &Paths) {
    let driver = crate::driver(paths);
    for id in tine_vmm::Driver::vm_ids(&driver) {
        tine_vmm::Driver::cleanup(&driver, &id).await;
    }
}

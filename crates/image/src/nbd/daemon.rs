//! The image daemon: one NBD server per data directory, in its own
//! process (`tine image nbd-daemon`), shared by the server, the CLI and
//! every QEMU.
//!
//! Why a process of its own: QEMU processes outlive the tine process that
//! started them (a server restart adopts them), and their root disks must
//! keep answering meanwhile. Whoever needs the daemon calls [`ensure`],
//! which holds a shared lock on `run/nbd.hold` for as long as the returned
//! [`Hold`] lives and starts the daemon if its socket does not answer. The
//! daemon leaves once no QEMU is connected and nobody holds the lock
//! (checked every few seconds after [`IDLE`]).
//!
//! ```text
//! run/nbd.sock           the NBD socket (exports: image manifest hex)
//! run/nbd.lock           held by the running daemon
//! run/nbd.hold           shared by its users
//! run/nbd-settings.json  cache bound and registries (last writer wins)
//! run/image-cache.json   the cache's statistics, every second
//! run/nbd.log            the daemon's log
//! /run/tine/lazy/<hash>/  captures read lazily (crate::lazy, FUSE)
//! ```
//!
//! Open lazily read files count as connections: the daemon stays while a
//! QEMU maps a capture's RAM.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};

use super::Exports;
use crate::chunks::cache::{CacheStats, ChunkCache, Disk, Fetch};
use crate::chunks::remote::RegistryChunks;
use crate::chunks::Index;
use crate::registry::{Credentials, RegistryOptions};
use crate::{io, ImageError, ImageRef, Result};

/// How long the daemon stays with nothing connected before it may leave.
pub const IDLE: Duration = Duration::from_secs(30);

/// The default bound of the chunk cache.
pub const DEFAULT_CACHE_MAX_BYTES: u64 = 20 << 30;

/// What the daemon is told by its users.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Settings {
    pub cache_max_bytes: u64,
    pub registries: RegistryOptions,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            cache_max_bytes: DEFAULT_CACHE_MAX_BYTES,
            registries: RegistryOptions::default(),
        }
    }
}

fn run_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("run")
}

/// The NBD socket of `data_dir`'s daemon.
pub fn socket_path(data_dir: &Path) -> PathBuf {
    run_dir(data_dir).join("nbd.sock")
}

/// The cache statistics the daemon last wrote (None: no daemon yet).
pub fn read_stats(data_dir: &Path) -> Option<CacheStats> {
    let bytes = std::fs::read(run_dir(data_dir).join("image-cache.json")).ok()?;
    serde_json::from_slice(&bytes).ok()
}

/// Held by a user of the daemon; the daemon stays while one exists.
pub struct Hold {
    _lock: Flock<std::fs::File>,
}

fn open_lock(path: &Path) -> Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(io(format!("opening {}", path.display())))
}

/// Write `data` to `path` (through a temporary file) readable by root only.
pub(crate) fn write_private(path: &Path, data: &[u8]) -> Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io(format!("writing {}", tmp.display())))?;
    f.write_all(data)
        .map_err(io(format!("writing {}", tmp.display())))?;
    std::fs::rename(&tmp, path).map_err(io(format!("writing {}", path.display())))
}

/// Make sure `data_dir`'s daemon runs (starting `exe image nbd-daemon` if
/// not) and keep it running while the returned [`Hold`] lives. `settings`
/// replaces the daemon's (None keeps what it has).
pub async fn ensure(data_dir: &Path, exe: &Path, settings: Option<&Settings>) -> Result<Hold> {
    let run = run_dir(data_dir);
    std::fs::create_dir_all(&run).map_err(io(format!("creating {}", run.display())))?;
    let socket = socket_path(data_dir);
    if socket.as_os_str().len() > 100 {
        return Err(ImageError::Io {
            context: format!("{} is too long for a unix socket", socket.display()),
            source: std::io::ErrorKind::InvalidInput.into(),
        });
    }
    if let Some(s) = settings {
        let json = serde_json::to_vec_pretty(s).unwrap_or_default();
        write_private(&run.join("nbd-settings.json"), &json)?;
    }
    let hold_file = open_lock(&run.join("nbd.hold"))?;
    // Blocks only while a daemon that found itself unused is leaving.
    let lock = tokio::task::spawn_blocking(move || Flock::lock(hold_file, FlockArg::LockShared))
        .await
        .map_err(|e| io("locking nbd.hold")(std::io::Error::other(e)))?
        .map_err(|(_, e)| io("locking nbd.hold")(e.into()))?;
    let hold = Hold { _lock: lock };
    if tokio::net::UnixStream::connect(&socket).await.is_ok() {
        return Ok(hold);
    }
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(run.join("nbd.log"))
        .map_err(io("opening nbd.log"))?;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["image", "nbd-daemon", "--data-dir"])
        .arg(data_dir)
        .stdin(std::process::Stdio::null())
        .stdout(log.try_clone().map_err(io("opening nbd.log"))?)
        .stderr(log);
    // Its own process group: a ^C to the CLI that started it, or the
    // server's exit, does not take the QEMUs' disks with it.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let mut child = cmd
        .spawn()
        .map_err(io(format!("starting {} image nbd-daemon", exe.display())))?;
    // Reap it in the background so it leaves no zombie here.
    std::thread::spawn(move || child.wait());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if tokio::net::UnixStream::connect(&socket).await.is_ok() {
            return Ok(hold);
        }
        if std::time::Instant::now() > deadline {
            return Err(ImageError::Io {
                context: format!(
                    "the image daemon did not open {} (see {})",
                    socket.display(),
                    run.join("nbd.log").display()
                ),
                source: std::io::ErrorKind::TimedOut.into(),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn read_settings(run: &Path) -> Settings {
    std::fs::read(run.join("nbd-settings.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

/// Where the daemon keeps the order a disk's chunks were first read in
/// (`images/<hex>/reads.json`); `tine image push` sends it along.
pub const READS: &str = "reads.json";

/// The images of a store, opened as disks on first use.
struct StoreExports {
    images: PathBuf,
    registries: Mutex<RegistryOptions>,
    open: Mutex<HashMap<String, Arc<Disk>>>,
    /// Read-order lengths written so far, per export.
    saved: Mutex<HashMap<String, usize>>,
    cache: Arc<ChunkCache>,
}

impl StoreExports {
    /// Write each open disk's first-read order when it grew (only for a
    /// disk whose image has none yet: the first boot's is the one kept).
    fn save_read_orders(&self) {
        let open: Vec<(String, Arc<Disk>)> = self
            .open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let mut saved = self.saved.lock().unwrap_or_else(|p| p.into_inner());
        for (name, disk) in open {
            let order = disk.read_order();
            let before = saved.get(&name).copied();
            if order.is_empty() || before == Some(order.len()) {
                continue;
            }
            let path = self.images.join(&name).join(READS);
            if before.is_none() && path.exists() {
                saved.insert(name, order.len());
                continue;
            }
            let json = serde_json::to_vec(&order).unwrap_or_default();
            if crate::chunks::write_cached(&path, &json).is_ok() {
                saved.insert(name, order.len());
            }
        }
    }
}

#[async_trait::async_trait]
impl Exports for StoreExports {
    async fn open(&self, name: &str) -> Option<Arc<Disk>> {
        if name.len() != 64 || !name.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        if let Some(d) = self
            .open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
        {
            return Some(d.clone());
        }
        let dir = self.images.join(name);
        let meta: crate::ImageMeta =
            serde_json::from_slice(&std::fs::read(dir.join("meta.json")).ok()?).ok()?;
        let chunked = meta.chunks.as_ref()?;
        let index = Index::from_json(&std::fs::read(dir.join("index.json")).ok()?).ok()?;
        let remote: Option<Arc<dyn Fetch>> = match &chunked.remote {
            Some(r) => {
                let reference = ImageRef::parse(r).ok()?;
                let creds: Option<Credentials> = std::fs::read(dir.join("auth.json"))
                    .ok()
                    .and_then(|b| serde_json::from_slice(&b).ok());
                let opts = self
                    .registries
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone();
                Some(RegistryChunks::new(reference, &opts, creds.as_ref()))
            }
            None => None,
        };
        self.cache.refresh_pins();
        // What earlier boots read first: the pushed order, or this host's.
        let order = match index.boot_order.is_empty() {
            false => index.boot_order.clone(),
            true => std::fs::read(dir.join(READS))
                .ok()
                .and_then(|b| serde_json::from_slice::<Vec<usize>>(&b).ok())
                .unwrap_or_default(),
        };
        let fetches = remote.is_some();
        let disk = Arc::new(Disk::new(meta.reference.clone(), index, remote));
        if fetches && !order.is_empty() {
            tokio::spawn(self.cache.clone().prefetch(disk.clone(), order));
        }
        self.open
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string(), disk.clone());
        Some(disk)
    }
}

/// Run the daemon of `data_dir` until it is unused for [`IDLE`]; returns
/// at once if another one runs.
pub async fn run(data_dir: &Path) -> Result<()> {
    let run = run_dir(data_dir);
    std::fs::create_dir_all(&run).map_err(io(format!("creating {}", run.display())))?;
    let Ok(_me) = Flock::lock(
        open_lock(&run.join("nbd.lock"))?,
        FlockArg::LockExclusiveNonblock,
    ) else {
        tracing::info!("another image daemon runs for {}", data_dir.display());
        return Ok(());
    };
    let mut settings = read_settings(&run);
    let images = data_dir.join("images");
    let cache = Arc::new(ChunkCache::open(&images, settings.cache_max_bytes));
    let exports = Arc::new(StoreExports {
        images,
        registries: Mutex::new(settings.registries.clone()),
        open: Mutex::new(HashMap::new()),
        saved: Mutex::new(HashMap::new()),
        cache: cache.clone(),
    });
    let socket = socket_path(data_dir);
    let _ = std::fs::remove_file(&socket);
    let listener = tokio::net::UnixListener::bind(&socket)
        .map_err(io(format!("listening on {}", socket.display())))?;
    let connections = Arc::new(AtomicUsize::new(0));
    let server = tokio::spawn(super::serve(
        listener,
        exports.clone(),
        cache.clone(),
        connections.clone(),
    ));
    // Captures read lazily (crate::lazy): without FUSE, hosts pull them
    // whole instead (the server checks the mount before using it).
    let lazy = match crate::lazy::mount(data_dir, cache.clone(), tokio::runtime::Handle::current())
    {
        Ok(m) => Some(m),
        Err(e) => {
            tracing::warn!("captures will be pulled whole: {e}");
            None
        }
    };
    let open_lazy = || lazy.as_ref().map_or(0, |m| m.open_files());
    tracing::info!("image daemon on {}", socket.display());
    let mut ticks = 0u64;
    let mut idle_since = std::time::Instant::now();
    let mut last_stats = None;
    // SIGTERM (scripts stopping a cluster): leave, unmounting the lazy
    // captures (a mount left behind would fail every read of it).
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(io("handling SIGTERM"))?;
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            _ = term.recv() => {
                server.abort();
                let _ = std::fs::remove_file(&socket);
                tracing::info!("image daemon: SIGTERM; leaving");
                return Ok(());
            }
        }
        let now = read_settings(&run);
        if now != settings {
            cache.set_max_bytes(now.cache_max_bytes);
            *exports.registries.lock().unwrap_or_else(|p| p.into_inner()) = now.registries.clone();
            settings = now;
        }
        exports.save_read_orders();
        ticks += 1;
        if ticks % 10 == 0 {
            if let Some(m) = &lazy {
                m.forget_unused();
            }
        }
        let stats = cache.stats();
        if last_stats.as_ref() != Some(&stats) {
            let json = serde_json::to_vec_pretty(&stats).unwrap_or_default();
            let _ = crate::chunks::write_cached(&run.join("image-cache.json"), &json);
            last_stats = Some(stats);
        }
        if connections.load(Ordering::SeqCst) > 0 || open_lazy() > 0 {
            idle_since = std::time::Instant::now();
            continue;
        }
        if idle_since.elapsed() < IDLE {
            continue;
        }
        // Unused and unheld: leave, holding nbd.hold so that a user that
        // arrives now waits and then starts a new daemon.
        let hold = open_lock(&run.join("nbd.hold"))?;
        if let Ok(_held) = Flock::lock(hold, FlockArg::LockExclusiveNonblock) {
            if connections.load(Ordering::SeqCst) == 0 && open_lazy() == 0 {
                server.abort();
                let _ = std::fs::remove_file(&socket);
                tracing::info!("image daemon unused; leaving");
                return Ok(());
            }
        }
    }
}

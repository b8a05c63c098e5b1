//! `POST /init`, `GET /envs`, `GET /metrics`: what the host (not the SDKs)
//! calls after every create or restore, and for resource usage.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Serialize;

use super::error::{EnvdError, Result};
use super::{Envd, User};

pub fn routes() -> Router<Arc<Envd>> {
    Router::new()
        .route("/init", post(init))
        .route("/envs", get(envs))
        .route("/metrics", get(metrics))
}

/// The `/init` body: one type, shared with the host's client.
pub use tine_agent_client::InitRequest;

async fn init(State(envd): State<Arc<Envd>>, body: axum::body::Bytes) -> Result<StatusCode> {
    let req: InitRequest = if body.iter().all(u8::is_ascii_whitespace) {
        InitRequest::default()
    } else {
        serde_json::from_slice(&body)
            .map_err(|e| EnvdError::InvalidArgument(format!("invalid /init body: {e}")))?
    };
    if let Some(user) = req.default_user.as_deref().filter(|u| !u.is_empty()) {
        User::lookup(user).map_err(|_| {
            EnvdError::InvalidArgument(format!("default user {user:?} does not exist"))
        })?;
    }
    let workdir = req
        .default_workdir
        .as_deref()
        .filter(|w| !w.is_empty())
        .map(std::path::PathBuf::from);
    if let Some(w) = &workdir {
        if !w.is_absolute() {
            return Err(EnvdError::InvalidArgument(
                "defaultWorkdir must be absolute".into(),
            ));
        }
    }
    let timestamp = match req.timestamp.as_deref() {
        Some(t) => Some(
            super::time::parse_rfc3339(t)
                .ok_or_else(|| EnvdError::InvalidArgument(format!("invalid timestamp {t:?}")))?,
        ),
        None => None,
    };
    let entropy = match req.entropy.as_deref() {
        Some(e) => Some(
            super::proto::decode_bytes(e)
                .map_err(|_| EnvdError::InvalidArgument("entropy is not base64".into()))?,
        ),
        None => None,
    };
    {
        let mut d = envd.defaults.write().unwrap_or_else(|e| e.into_inner());
        if let Some(vars) = req.env_vars {
            d.env_vars.extend(vars);
        }
        if req.default_user.is_some() {
            d.user = req.default_user.filter(|u| !u.is_empty());
        }
        if req.default_workdir.is_some() {
            d.workdir = workdir;
        }
    }
    if let Some(token) = req.access_token {
        envd.auth.set(Some(token));
    }
    if let Some(ts) = timestamp {
        sync_clock(ts);
    }
    if let Some(bytes) = entropy {
        add_entropy(&bytes);
    }
    if let Some(name) = req.hostname.as_deref() {
        set_hostname(name)?;
    }
    if let Some(id) = req.machine_id.as_deref() {
        set_machine_id(id)?;
    }
    if let Some(pem) = req.trust_ca {
        let env = tokio::task::spawn_blocking(move || super::trust::install(&pem))
            .await
            .map_err(|e| EnvdError::Internal(format!("installing the egress CA: {e}")))?
            .map_err(|e| EnvdError::Internal(format!("installing the egress CA: {e}")))?;
        let mut d = envd.defaults.write().unwrap_or_else(|e| e.into_inner());
        for (k, v) in env {
            d.env_vars.entry(k).or_insert(v);
        }
    }
    if let Some(mounts) = req.mounts.filter(|m| !m.is_empty()) {
        tokio::task::spawn_blocking(move || super::volumes::mount_all(&mounts))
            .await
            .map_err(|e| EnvdError::Internal(format!("mounting volumes: {e}")))??;
    }
    let _ = req.hyperloop_ip;
    Ok(StatusCode::NO_CONTENT)
}

/// How far the guest's wall clock may be off `/init`'s timestamp before it
/// is set. A restored guest's clock stopped while it was captured, so after
/// any pause it is behind by the pause's length; the stamp itself is a few
/// milliseconds old when it arrives, so smaller drifts are left alone.
const CLOCK_TOLERANCE: std::time::Duration = std::time::Duration::from_millis(50);

fn sync_clock(ts: std::time::Duration) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default();
    let drift = now.abs_diff(ts);
    if drift <= CLOCK_TOLERANCE || !nix::unistd::Uid::effective().is_root() {
        return;
    }
    let spec = nix::sys::time::TimeSpec::from(ts);
    match nix::time::clock_settime(nix::time::ClockId::CLOCK_REALTIME, spec) {
        Ok(()) => tracing::info!(drift_ms = drift.as_millis() as u64, "clock set from /init"),
        Err(e) => tracing::warn!(%e, "setting the clock failed"),
    }
}

/// Credits `bytes` to the kernel pool with `RNDADDENTROPY` (root only).
fn add_entropy(bytes: &[u8]) {
    if bytes.is_empty() || !nix::unistd::Uid::effective().is_root() {
        return;
    }
    let Ok(file) = std::fs::OpenOptions::new().write(true).open("/dev/random") else {
        return;
    };
    let len = bytes.len().min(4096);
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
    let mut info = Vec::with_capacity(8 + len + 4);
    info.extend_from_slice(&((len * 8) as i32).to_ne_bytes());
    info.extend_from_slice(&(len as i32).to_ne_bytes());
    info.extend_from_slice(&bytes[..len]);
    info.resize(8 + len.div_ceil(4) * 4, 0);
    const RNDADDENTROPY: libc::c_ulong = 0x4008_5203; // _IOW('R', 0x03, int[2])
    use std::os::fd::AsRawFd;
    // SAFETY: the ioctl reads a rand_pool_info header followed by
    // `buf_size` bytes, all inside `info`, which outlives the call.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) };
    if rc < 0 {
        tracing::warn!(err = %std::io::Error::last_os_error(), "RNDADDENTROPY failed");
        return;
    }
    // Credited entropy only reaches the CRNG at its next reseed (up to a
    // minute away), and clones of one snapshot share the CRNG state until
    // then: force the reseed so /dev/urandom and getrandom diverge now.
    const RNDRESEEDCRNG: libc::c_ulong = 0x5207; // _IO('R', 0x07)
                                                 // SAFETY: RNDRESEEDCRNG takes no argument.
    if unsafe { libc::ioctl(file.as_raw_fd(), RNDRESEEDCRNG as _) } < 0 {
        tracing::warn!(err = %std::io::Error::last_os_error(), "RNDRESEEDCRNG failed");
    }
}

/// A host name is 1–64 letters, digits, '-' and '.'.
fn set_hostname(name: &str) -> Result<()> {
    let valid = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
    if !valid {
        return Err(EnvdError::InvalidArgument(format!(
            "invalid hostname {name:?}"
        )));
    }
    if !nix::unistd::Uid::effective().is_root() {
        return Ok(()); // on a host (tests), the agent leaves the host's name alone
    }
    // A resume sets the name the guest already has: change nothing then
    // (a first write into the guest's filesystem is costly under TCG).
    if nix::unistd::gethostname().ok().as_deref() != Some(std::ffi::OsStr::new(name)) {
        nix::unistd::sethostname(name)
            .map_err(|e| EnvdError::Internal(format!("sethostname: {e}")))?;
    }
    let _ = write_if_changed(Path::new("/etc/hostname"), &format!("{name}\n"));
    Ok(())
}

fn set_machine_id(id: &str) -> Result<()> {
    if id.len() != 32 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(EnvdError::InvalidArgument(
            "machineId must be 32 hex digits".into(),
        ));
    }
    if std::process::id() != 1 {
        return Ok(()); // only the guest's init owns /etc/machine-id
    }
    write_if_changed(
        Path::new("/etc/machine-id"),
        &format!("{}\n", id.to_ascii_lowercase()),
    )
    .map_err(|e| EnvdError::Internal(format!("writing /etc/machine-id: {e}")))
}

/// Write `content` to `path` unless it holds exactly that already.
fn write_if_changed(path: &Path, content: &str) -> std::io::Result<()> {
    if std::fs::read(path).is_ok_and(|old| old == content.as_bytes()) {
        return Ok(());
    }
    std::fs::write(path, content)
}

async fn envs(State(envd): State<Arc<Envd>>) -> Json<BTreeMap<String, String>> {
    Json(envd.defaults().env_vars)
}

#[derive(Debug, Clone, Copy)]
pub struct CpuSample {
    busy: u64,
    total: u64,
}

fn read_cpu() -> Option<CpuSample> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let line = stat.lines().next()?.strip_prefix("cpu ")?;
    let v: Vec<u64> = line
        .split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect();
    let total: u64 = v.iter().take(8).sum();
    let idle = v.get(3).copied().unwrap_or(0) + v.get(4).copied().unwrap_or(0);
    Some(CpuSample {
        busy: total.saturating_sub(idle),
        total,
    })
}

fn meminfo() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find_map(|l| {
                l.strip_prefix(name)?
                    .trim()
                    .strip_suffix("kB")?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .unwrap_or(0)
            * 1024
    };
    let total = field("MemTotal:");
    (total, total.saturating_sub(field("MemAvailable:")))
}

#[derive(Debug, Serialize)]
pub struct Metrics {
    ts: i64,
    cpu_count: usize,
    cpu_used_pct: f32,
    mem_total: u64,
    mem_used: u64,
    mem_total_mib: u64,
    mem_used_mib: u64,
    disk_used: u64,
    disk_total: u64,
}

#[allow(clippy::unnecessary_cast)] // statvfs field types differ between libcs
async fn metrics(State(envd): State<Arc<Envd>>) -> Json<Metrics> {
    let now = read_cpu();
    let cpu_used_pct = {
        let mut last = envd.cpu.lock().unwrap_or_else(|e| e.into_inner());
        let pct = match (*last, now) {
            (Some(a), Some(b)) if b.total > a.total => {
                (b.busy.saturating_sub(a.busy)) as f32 * 100.0 / (b.total - a.total) as f32
            }
            _ => 0.0,
        };
        *last = now;
        (pct * 100.0).round() / 100.0
    };
    let (mem_total, mem_used) = meminfo();
    let (disk_total, disk_used) = nix::sys::statvfs::statvfs("/")
        .map(|s| {
            let f = s.fragment_size() as u64;
            (
                s.blocks() as u64 * f,
                (s.blocks() - s.blocks_free()) as u64 * f,
            )
        })
        .unwrap_or((0, 0));
    let ts = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    Json(Metrics {
        ts,
        cpu_count: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        cpu_used_pct,
        mem_total,
        mem_used,
        mem_total_mib: mem_total >> 20,
        mem_used_mib: mem_used >> 20,
        disk_used,
        disk_total,
    })
}

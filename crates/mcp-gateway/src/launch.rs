//! `mcp-gateway --config JSON`, as E2B's SDK runs it (root, foreground,
//! GATEWAY_ACCESS_TOKEN set): check the config, write it and the token
//! where `serve` and `get_mcp_token()` read them, start `serve` detached,
//! wait until it answers /health, exit 0. Any failure: a message on stderr
//! (the SDK shows it in "Failed to start MCP gateway: ...") and non-zero.

use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

pub const PORT: u16 = 50005;
/// Within E2B's 60 s command timeout; MCP_GATEWAY_READY_SECS changes it.
fn ready_within() -> Duration {
    let secs = std::env::var("MCP_GATEWAY_READY_SECS")
        .ok()
        .and_then(|s| s.parse().ok());
    Duration::from_secs(secs.unwrap_or(45))
}

/// /etc/mcp-gateway (MCP_GATEWAY_DIR for tests): config.json, .token, the
/// daemon's pid file and log.
pub fn state_dir() -> PathBuf {
    std::env::var_os("MCP_GATEWAY_DIR").map_or_else(|| "/etc/mcp-gateway".into(), PathBuf::from)
}

pub fn listen_addr() -> String {
    std::env::var("MCP_GATEWAY_LISTEN").unwrap_or_else(|_| format!("0.0.0.0:{PORT}"))
}

pub fn log_file() -> PathBuf {
    std::env::var_os("MCP_GATEWAY_LOG")
        .map_or_else(|| "/var/log/mcp-gateway.log".into(), PathBuf::from)
}

pub fn run(config: &str) -> anyhow::Result<()> {
    let token = std::env::var("GATEWAY_ACCESS_TOKEN")
        .ok()
        .filter(|t| !t.is_empty())
        .context("GATEWAY_ACCESS_TOKEN is not set")?;
    crate::catalog::resolve(config)?;
    let dir = state_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    if let Some(parent) = Path::new(crate::catalog::MEMORY_FILE).parent() {
        let _ = std::fs::create_dir_all(parent);
    }
    write_private(&dir.join("config.json"), config)?;
    write_private(&dir.join(".token"), &token)?;
    stop_previous(&dir.join("gateway.pid"));

    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_file())
        .with_context(|| format!("opening {}", log_file().display()))?;
    let start_offset = log.metadata().map(|m| m.len()).unwrap_or(0);
    let exe = std::env::current_exe().context("finding my own path")?;
    let mut cmd = Command::new(exe);
    cmd.arg("serve")
        .env_remove("GATEWAY_ACCESS_TOKEN")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log);
    // SAFETY: setsid is async-signal-safe; the daemon leaves the command's
    // session so it outlives it.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting mcp-gateway serve")?;
    std::fs::write(dir.join("gateway.pid"), format!("{}\n", child.id()))?;

    let deadline = Instant::now() + ready_within();
    loop {
        if let Some(status) = child.try_wait()? {
            bail!("the gateway exited ({status}):\n{}", log_tail(start_offset));
        }
        if healthy() {
            return Ok(());
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!(
                "the gateway did not answer on port {PORT} within {:?}:\n{}",
                ready_within(),
                log_tail(start_offset)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn write_private(path: &Path, text: &str) -> anyhow::Result<()> {
    let _ = std::fs::remove_file(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    Ok(())
}

/// A gateway started by an earlier `--config` (its whole session) is stopped.
fn stop_previous(pidfile: &Path) {
    let Some(pid) = std::fs::read_to_string(pidfile)
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
    else {
        return;
    };
    // SAFETY: kill(2) with signal 0 only asks whether `pid` exists.
    let alive = || unsafe { libc::kill(pid, 0) } == 0;
    // SAFETY: plain kill(2); the daemon leads its own process group.
    unsafe { libc::kill(-pid, libc::SIGTERM) };
    for _ in 0..50 {
        if !alive() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // SAFETY: plain kill(2) of the daemon's process group, as above.
    unsafe { libc::kill(-pid, libc::SIGKILL) };
    let _ = std::fs::remove_file(pidfile);
    // The daemon is our child only when the same launcher started it; an
    // earlier launcher's daemon was reaped by init. Wait for the port.
    for _ in 0..50 {
        if std::net::TcpListener::bind(("0.0.0.0", PORT)).is_ok() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn healthy() -> bool {
    let addr = listen_addr().replace("0.0.0.0", "127.0.0.1");
    let Ok(mut s) = std::net::TcpStream::connect(&addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
    if s.write_all(b"GET /health HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .is_err()
    {
        return false;
    }
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out.starts_with("HTTP/1.0 200") || out.starts_with("HTTP/1.1 200")
}

/// What the daemon wrote since it started (the last 4 KiB of it).
fn log_tail(from: u64) -> String {
    let all = std::fs::read(log_file()).unwrap_or_default();
    let new = &all[(from as usize).min(all.len())..];
    let tail = &new[new.len().saturating_sub(4096)..];
    String::from_utf8_lossy(tail).trim_end().to_string()
}

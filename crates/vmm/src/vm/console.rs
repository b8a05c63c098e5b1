//! The guest's serial console, read from QEMU's console socket into a
//! capped log: `console.log` grows to the cap, then becomes
//! `console.log.1` (replacing the older one), so a guest writing without
//! end costs at most twice the cap on disk. QEMU drops output while no
//! reader is connected (before the first connect and while tine
//! restarts), and a guest that writes faster than the log is written waits
//! for the UART.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::AsyncReadExt;

/// Reads one VM's console until QEMU closes it; stops when dropped.
#[derive(Debug)]
pub struct ConsoleReader(tokio::task::AbortHandle);

impl Drop for ConsoleReader {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// The rotated-away part of `log`.
pub fn rotated(log: &Path) -> PathBuf {
    let mut name = log.as_os_str().to_owned();
    name.push(".1");
    PathBuf::from(name)
}

/// A log file that rotates once it holds `cap` bytes.
struct CappedLog {
    path: PathBuf,
    cap: u64,
    file: Option<std::fs::File>,
    size: u64,
}

impl CappedLog {
    fn new(path: PathBuf, cap: u64) -> Self {
        let size = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        Self {
            path,
            cap: cap.max(1),
            file: None,
            size,
        }
    }

    fn write(&mut self, mut data: &[u8]) -> std::io::Result<()> {
        while !data.is_empty() {
            if self.size >= self.cap {
                self.file = None;
                std::fs::rename(&self.path, rotated(&self.path))?;
                self.size = 0;
            }
            if self.file.is_none() {
                use std::os::unix::fs::OpenOptionsExt;
                self.file = Some(
                    std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .mode(0o600)
                        .open(&self.path)?,
                );
            }
            let room = (self.cap - self.size).min(data.len() as u64) as usize;
            self.file
                .as_mut()
                .expect("opened above")
                .write_all(&data[..room])?;
            self.size += room as u64;
            data = &data[room..];
        }
        Ok(())
    }
}

/// Connect to `socket` (retrying while QEMU starts; it must be served by
/// QEMU `pid`) and copy what the guest writes into `log`, capped at `cap`
/// bytes per file.
pub fn start(socket: PathBuf, pid: i32, log: PathBuf, cap: u64) -> ConsoleReader {
    let task = tokio::spawn(async move {
        let mut stream = None;
        for _ in 0..2000 {
            match tokio::net::UnixStream::connect(&socket).await {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        }
        let Some(mut stream) = stream else {
            tracing::warn!(socket = %socket.display(), "no console socket; console not logged");
            return;
        };
        let peer = stream.peer_cred().ok().and_then(|c| c.pid());
        if peer != Some(pid) {
            tracing::warn!(socket = %socket.display(), ?peer, pid, "the console socket is not QEMU's; console not logged");
            return;
        }
        let mut out = CappedLog::new(log, cap);
        let mut buf = vec![0u8; 16 << 10];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if let Err(e) = out.write(&buf[..n]) {
                        tracing::warn!(log = %out.path.display(), "console log: {e}");
                        return;
                    }
                }
            }
        }
    });
    ConsoleReader(task.abort_handle())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_never_holds_more_than_twice_its_cap() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("console.log");
        let mut log = CappedLog::new(path.clone(), 100);
        for i in 0..50u8 {
            log.write(&[b'a' + (i % 26); 37]).unwrap();
        }
        let now = std::fs::metadata(&path).unwrap().len();
        let old = std::fs::metadata(rotated(&path)).unwrap().len();
        assert!(now <= 100 && old == 100, "{now} {old}");
        // The newest bytes are at the end of console.log.
        let text = std::fs::read(&path).unwrap();
        assert_eq!(*text.last().unwrap(), b'a' + (49 % 26));
        // A reopened log goes on from the file's size.
        let mut again = CappedLog::new(path.clone(), 100);
        again.write(&[b'z'; 150]).unwrap();
        assert!(std::fs::metadata(&path).unwrap().len() <= 100);
    }
}

//! qcow2 overlays: every VM writes into its own overlay over a read-only
//! backing image (the template's rootfs, or a snapshot's frozen overlay).

use std::ffi::OsStr;
use std::path::Path;
use std::process::Stdio;

use crate::error::{Error, IoContext, Result};

/// Format of a backing file, as `qemu-img -F` wants it.
#[derive(Debug, Clone, Copy)]
pub enum BackingFormat {
    Raw,
    Qcow2,
}

impl BackingFormat {
    fn as_str(self) -> &'static str {
        match self {
            BackingFormat::Raw => "raw",
            BackingFormat::Qcow2 => "qcow2",
        }
    }
}

/// Create `path` as a qcow2 overlay over `backing` (absolute path kept in
/// the header), with the backing file's virtual size.
pub async fn create_overlay(
    backing: impl AsRef<OsStr>,
    format: BackingFormat,
    path: &Path,
) -> Result<()> {
    qemu_img_create(backing.as_ref(), format, path, None).await
}

/// Create `path` as a qcow2 overlay of `size` bytes over `backing` without
/// opening `backing` (`-u`): it may be an image a running QEMU holds.
pub async fn create_overlay_unchecked(
    backing: impl AsRef<OsStr>,
    format: BackingFormat,
    path: &Path,
    size: u64,
) -> Result<()> {
    qemu_img_create(backing.as_ref(), format, path, Some(size)).await
}

async fn qemu_img_create(
    backing: &OsStr,
    format: BackingFormat,
    path: &Path,
    size: Option<u64>,
) -> Result<()> {
    let mut cmd = tokio::process::Command::new("qemu-img");
    cmd.args(["create", "-q", "-f", "qcow2", "-F", format.as_str(), "-b"])
        .arg(backing);
    if size.is_some() {
        cmd.arg("-u");
    }
    cmd.arg(path);
    if let Some(size) = size {
        cmd.arg(size.to_string());
    }
    run(cmd, || {
        format!(
            "qemu-img create {} over {}",
            path.display(),
            backing.to_string_lossy()
        )
    })
    .await
}

/// Rebase `path` onto `backing`, copying into it every cluster in which its
/// old backing chain differs from the new backing (qemu-img's safe mode).
pub async fn rebase(path: &Path, backing: &Path, format: BackingFormat) -> Result<()> {
    let mut cmd = tokio::process::Command::new("qemu-img");
    cmd.args(["rebase", "-q", "-f", "qcow2", "-F", format.as_str(), "-b"])
        .arg(backing)
        .arg(path);
    run(cmd, || {
        format!(
            "qemu-img rebase {} onto {}",
            path.display(),
            backing.display()
        )
    })
    .await
}

async fn run(mut cmd: tokio::process::Command, what: impl FnOnce() -> String) -> Result<()> {
    let out = cmd
        .stdin(Stdio::null())
        .output()
        .await
        .ctx(|| "running qemu-img (is qemu-utils installed?)".into())?;
    if !out.status.success() {
        return Err(Error::Io {
            context: what(),
            source: std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        });
    }
    Ok(())
}

/// The virtual size recorded in a qcow2 image's header.
pub fn qcow2_virtual_size(path: &Path) -> Result<u64> {
    use std::os::unix::fs::FileExt;
    let mut header = [0u8; 32];
    std::fs::File::open(path)
        .and_then(|f| f.read_exact_at(&mut header, 0))
        .ctx(|| format!("reading the qcow2 header of {}", path.display()))?;
    if &header[..4] != b"QFI\xfb" {
        return Err(Error::Io {
            context: format!("{} is not a qcow2 image", path.display()),
            source: std::io::ErrorKind::InvalidData.into(),
        });
    }
    Ok(u64::from_be_bytes(
        header[24..32].try_into().expect("8 bytes"),
    ))
}

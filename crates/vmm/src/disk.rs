//! qcow2 overlays: every VM writes into its own overlay over a read-only
//! backing image (the template's rootfs, or a snapshot's frozen overlay).

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
pub async fn create_overlay(backing: &Path, format: BackingFormat, path: &Path) -> Result<()> {
    let out = tokio::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", format.as_str(), "-b"])
        .arg(backing)
        .arg(path)
        .stdin(Stdio::null())
        .output()
        .await
        .ctx(|| "running qemu-img (is qemu-utils installed?)".into())?;
    if !out.status.success() {
        return Err(Error::Io {
            context: format!(
                "qemu-img create {} over {}",
                path.display(),
                backing.display()
            ),
            source: std::io::Error::other(String::from_utf8_lossy(&out.stderr).trim().to_string()),
        });
    }
    Ok(())
}

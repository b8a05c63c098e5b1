//! Volumes the host serves over NFS, mounted when `/init` names them (a
//! tine extension): each at its path, unless a file system is mounted
//! there already (a guest restored from memory keeps its mounts, and its
//! NFS client reconnects by itself).

use std::path::Path;

use nix::mount::MsFlags;
use tine_agent_client::GuestMount;

use super::error::{EnvdError, Result};

/// Mount every volume of `mounts` that is not mounted yet. Blocks (the
/// first NFS call is a network round trip): run it off the runtime.
pub fn mount_all(mounts: &[GuestMount]) -> Result<()> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    // Outer paths first: `/a` mounted after `/a/b` would hide it.
    let mut mounts: Vec<&GuestMount> = mounts.iter().collect();
    mounts.sort_by_key(|m| m.path.matches('/').count());
    for m in mounts {
        let path = Path::new(&m.path);
        if !path.is_absolute() || m.path.contains("/../") || m.path.ends_with("/..") {
            return Err(EnvdError::InvalidArgument(format!(
                "mount path {:?} is not absolute and normal",
                m.path
            )));
        }
        if is_mount_point(&table, &m.path) {
            continue;
        }
        std::fs::create_dir_all(path).map_err(|e| {
            EnvdError::FailedPrecondition(format!("making mount point {}: {e}", m.path))
        })?;
        // Reads and writes of 1 MiB (the server's most; without `rsize`
        // the client would take its preferred 124 KiB), attributes cached
        // for a second (another sandbox's write shows within it), and no
        // negative lookups cached (its new files show at once).
        let options = format!(
            "vers=3,proto=tcp,port={p},mountport={p},mountproto=tcp,mountvers=3,\
             addr={a},mountaddr={a},nolock,noacl,hard,timeo=50,retrans=2,\
             rsize=1048576,wsize=1048576,actimeo=1,lookupcache=positive",
            p = m.port,
            a = m.addr
        );
        nix::mount::mount(
            Some(format!("{}:/", m.addr).as_str()),
            path,
            Some("nfs"),
            // A volume is shared: nothing one sandbox puts in it becomes a
            // device or a set-uid program in another.
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            Some(options.as_str()),
        )
        .map_err(|e| {
            EnvdError::FailedPrecondition(format!(
                "mounting the volume at {} (NFS from {}:{}): {e}",
                m.path, m.addr, m.port
            ))
        })?;
        tracing::info!(path = %m.path, port = m.port, "volume mounted");
    }
    Ok(())
}

/// Whether `path` is a mount point in `mountinfo` (its fifth field, with
/// spaces and such escaped as octal).
fn is_mount_point(mountinfo: &str, path: &str) -> bool {
    let escaped = path
        .replace('\\', "\\134")
        .replace(' ', "\\040")
        .replace('\t', "\\011")
        .replace('\n', "\\012");
    mountinfo
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|p| p == escaped)
}

#[cfg(test)]
mod tests {
    #[test]
    fn mount_points_are_read_from_mountinfo() {
        let info = "22 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n\
                    40 22 0:40 / /mnt/my\\040data rw - nfs 10.11.0.1:/ rw\n";
        assert!(super::is_mount_point(info, "/mnt/my data"));
        assert!(super::is_mount_point(info, "/"));
        assert!(!super::is_mount_point(info, "/mnt"));
    }
}

//! One host uid (and the gid of the same number) per jailed VM, from a
//! configured range. A claim is a file `<data>/jail/uids/<uid>` created
//! with `O_EXCL` and holding the VM id, so two tine processes (the server
//! and the CLI) never hand out the same uid; a claim whose VM directory is
//! gone (a crash) is taken back. Claims are made under an exclusive
//! `flock` on `<data>/jail/uids/.lock`: without it, two processes could
//! both take back the same stale claim and hand out one uid twice.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{Error, IoContext, Result};

fn claims_dir(data_dir: &Path) -> PathBuf {
    data_dir.join("jail").join("uids")
}

/// Claim a free uid in `base..base+count` for VM `vm_id`.
pub fn claim(data_dir: &Path, vms_dir: &Path, vm_id: &str, base: u32, count: u32) -> Result<u32> {
    let dir = claims_dir(data_dir);
    std::fs::create_dir_all(&dir).ctx(|| format!("creating {}", dir.display()))?;
    let lock_path = dir.join(".lock");
    let lock_file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .ctx(|| format!("opening {}", lock_path.display()))?;
    let _locked = nix::fcntl::Flock::lock(lock_file, nix::fcntl::FlockArg::LockExclusive)
        .map_err(|(_, e)| std::io::Error::from(e))
        .ctx(|| format!("locking {}", lock_path.display()))?;
    // Start where the VM id points, so claims spread and rarely collide.
    let start = vm_id
        .bytes()
        .fold(0u32, |h, b| h.wrapping_mul(31).wrapping_add(b.into()));
    for i in 0..count {
        let uid = base + (start.wrapping_add(i) % count);
        let path = dir.join(uid.to_string());
        // Twice: once more after taking back a stale claim.
        for _ in 0..2 {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&path)
            {
                Ok(mut f) => {
                    f.write_all(vm_id.as_bytes())
                        .ctx(|| format!("writing {}", path.display()))?;
                    return Ok(uid);
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    // Taken: by a VM that still has its directory, or left
                    // behind by one that is gone.
                    let owner = std::fs::read_to_string(&path).unwrap_or_default();
                    if owner == vm_id {
                        // A restart of the same VM keeps its uid.
                        return Ok(uid);
                    }
                    if owner.is_empty() || vms_dir.join(&owner).exists() {
                        break;
                    }
                    let _ = std::fs::remove_file(&path);
                }
                Err(e) => return Err(e).ctx(|| format!("creating {}", path.display())),
            }
        }
    }
    Err(Error::Io {
        context: format!(
            "no free jail uid in {base}..{}",
            u64::from(base) + u64::from(count)
        ),
        source: std::io::Error::other("every uid of the range is taken"),
    })
}

/// Give back every uid VM `vm_id` holds.
pub fn release_vm(data_dir: &Path, vm_id: &str) {
    let Ok(entries) = std::fs::read_dir(claims_dir(data_dir)) else {
        return;
    };
    for e in entries.flatten() {
        if std::fs::read_to_string(e.path()).is_ok_and(|owner| owner == vm_id) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_are_unique_and_stale_ones_are_taken_back() {
        let d = tempfile::tempdir().unwrap();
        let vms = d.path().join("vms");
        std::fs::create_dir_all(vms.join("a")).unwrap();
        std::fs::create_dir_all(vms.join("b")).unwrap();
        let a = claim(d.path(), &vms, "a", 1000, 2).unwrap();
        let b = claim(d.path(), &vms, "b", 1000, 2).unwrap();
        assert_ne!(a, b);
        assert_eq!(
            claim(d.path(), &vms, "a", 1000, 2).unwrap(),
            a,
            "a VM keeps its uid"
        );
        assert!(
            claim(d.path(), &vms, "c", 1000, 2).is_err(),
            "the range is full"
        );
        // VM a's directory disappears (a crash): its uid is free again.
        std::fs::remove_dir(vms.join("a")).unwrap();
        std::fs::create_dir_all(vms.join("c")).unwrap();
        let c = claim(d.path(), &vms, "c", 1000, 2).unwrap();
        assert_eq!(c, a);
        release_vm(d.path(), "not-b");
        assert!(claims_dir(d.path()).join(b.to_string()).exists());
        release_vm(d.path(), "b");
        assert!(!claims_dir(d.path()).join(b.to_string()).exists());
    }
}

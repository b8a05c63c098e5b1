//! Host memory of a QEMU process, from /proc.

use anyhow::Context;

fn kib_field(text: &str, field: &str) -> Option<u64> {
    text.lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l[field.len()..].split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// Proportional set size of `pid` in MiB (`/proc/PID/smaps_rollup`): shared
/// pages are divided among the processes that map them.
pub fn pss_mib(pid: i32) -> anyhow::Result<f64> {
    let path = format!("/proc/{pid}/smaps_rollup");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let kib = kib_field(&text, "Pss:").with_context(|| format!("no Pss in {path}"))?;
    Ok(kib as f64 / 1024.0)
}

/// Bytes of guest RAM `pid` has dirtied since it was restored: the
/// `Private_Dirty` of its mapping of a snapshot's RAM file (MAP_PRIVATE, so
/// every page the guest wrote is a private copy).
pub fn dirty_ram_bytes(pid: i32) -> anyhow::Result<u64> {
    let path = format!("/proc/{pid}/smaps");
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {path}"))?;
    let mut total = 0u64;
    let mut in_ram = false;
    let mut found = false;
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            in_ram = line.trim_end().ends_with("/ram");
            found |= in_ram;
        } else if in_ram && line.starts_with("Private_Dirty:") {
            total += kib_field(line, "Private_Dirty:").unwrap_or(0) * 1024;
        }
    }
    anyhow::ensure!(found, "QEMU {pid} maps no snapshot RAM file");
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_kib_fields() {
        let t = "Rss:  100 kB\nPss:   42 kB\nPss_Dirty: 7 kB\n";
        assert_eq!(kib_field(t, "Pss:"), Some(42));
        assert_eq!(kib_field(t, "Swap:"), None);
    }

    #[test]
    fn own_pss_is_positive() {
        assert!(pss_mib(std::process::id() as i32).unwrap() > 0.0);
    }
}

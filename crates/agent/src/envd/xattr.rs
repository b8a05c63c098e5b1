//! File metadata as `user.e2b.<key>` extended attributes (what envd does
//! with `X-Metadata-<key>` upload headers since 0.6.2; keys lowercased).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

const PREFIX: &str = "user.e2b.";

fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

fn list(path: &CString) -> io::Result<Vec<u8>> {
    loop {
        // SAFETY: a NULL buffer of size 0 asks for the needed size only.
        let n = unsafe { libc::llistxattr(path.as_ptr(), std::ptr::null_mut(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = vec![0u8; n as usize];
        // SAFETY: `buf` has exactly `buf.len()` writable bytes.
        let m = unsafe { libc::llistxattr(path.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if m >= 0 {
            buf.truncate(m as usize);
            return Ok(buf);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::ERANGE) {
            return Err(err); // ERANGE: the list grew in between; retry
        }
    }
}

fn get(path: &CString, name: &CString) -> io::Result<Vec<u8>> {
    loop {
        // SAFETY: as in `list`, a size query first.
        let n = unsafe { libc::lgetxattr(path.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut buf = vec![0u8; n as usize];
        // SAFETY: `buf` has exactly `buf.len()` writable bytes.
        let m = unsafe {
            libc::lgetxattr(
                path.as_ptr(),
                name.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if m >= 0 {
            buf.truncate(m as usize);
            return Ok(buf);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::ERANGE) {
            return Err(err);
        }
    }
}

/// The `user.e2b.*` attributes of `path`, prefix stripped (empty when the
/// filesystem has none or does not support them).
pub fn read_metadata(path: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let Ok(cp) = cpath(path) else { return out };
    let Ok(names) = list(&cp) else { return out };
    for name in names
        .split(|b| *b == 0)
        .filter(|n| n.starts_with(PREFIX.as_bytes()))
    {
        let Ok(cname) = CString::new(name) else {
            continue;
        };
        if let Ok(value) = get(&cp, &cname) {
            let key = String::from_utf8_lossy(&name[PREFIX.len()..]).into_owned();
            out.insert(key, String::from_utf8_lossy(&value).into_owned());
        }
    }
    out
}

/// Replaces all `user.e2b.*` attributes of `path` with `meta`.
pub fn replace_metadata(path: &Path, meta: &BTreeMap<String, String>) -> io::Result<()> {
    let cp = cpath(path)?;
    if let Ok(names) = list(&cp) {
        for name in names
            .split(|b| *b == 0)
            .filter(|n| n.starts_with(PREFIX.as_bytes()))
        {
            if let Ok(cname) = CString::new(name) {
                // SAFETY: both pointers are valid NUL-terminated strings.
                unsafe { libc::lremovexattr(cp.as_ptr(), cname.as_ptr()) };
            }
        }
    }
    for (key, value) in meta {
        let name = CString::new(format!("{PREFIX}{key}"))
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: valid NUL-terminated strings and a value buffer of the given length.
        let rc = unsafe {
            libc::lsetxattr(
                cp.as_ptr(),
                name.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_round_trips_and_is_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        let mut m = BTreeMap::new();
        m.insert("owner".to_string(), "me".to_string());
        m.insert("k2".to_string(), "v2".to_string());
        if let Err(e) = replace_metadata(&f, &m) {
            // Filesystems without user xattrs (old tmpfs) cannot hold metadata.
            assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP));
            return;
        }
        assert_eq!(read_metadata(&f), m);
        let mut m2 = BTreeMap::new();
        m2.insert("only".to_string(), "this".to_string());
        replace_metadata(&f, &m2).unwrap();
        assert_eq!(read_metadata(&f), m2);
        assert!(read_metadata(&dir.path().join("missing")).is_empty());
    }
}

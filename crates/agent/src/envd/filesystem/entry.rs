//! `EntryInfo`: everything the SDKs show about a file, from `lstat`, and
//! its binary protobuf schema ([`ENTRY_INFO`]).

use std::collections::{BTreeMap, HashMap};
use std::fs::Metadata;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use serde::Serialize;

use crate::envd::error::{EnvdError, Result};
use crate::envd::protobin::{f, Schema, Ty};
use crate::envd::user::{group_name, user_name};

pub const FILE_TYPE_FILE: &str = "FILE_TYPE_FILE";
pub const FILE_TYPE_DIRECTORY: &str = "FILE_TYPE_DIRECTORY";
pub const FILE_TYPE_SYMLINK: &str = "FILE_TYPE_SYMLINK";

#[derive(Debug, Clone, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    pub name: String,
    #[serde(rename = "type")]
    pub file_type: &'static str,
    pub path: String,
    /// int64: a string in proto3 JSON.
    pub size: String,
    pub mode: u32,
    pub permissions: String,
    pub owner: String,
    pub group: String,
    pub modified_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, String>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub is_symlink: bool,
}

/// `enum FileType`: the values of [`EntryInfo::file_type`].
const FILE_TYPE: &[(&str, i64)] = &[
    ("FILE_TYPE_UNSPECIFIED", 0),
    (FILE_TYPE_FILE, 1),
    (FILE_TYPE_DIRECTORY, 2),
    (FILE_TYPE_SYMLINK, 3),
];

/// Mirrors [`EntryInfo`].
pub static ENTRY_INFO: Schema = Schema {
    fields: &[
        f(1, "name", Ty::Str),
        f(2, "type", Ty::Enum(FILE_TYPE)),
        f(3, "path", Ty::Str),
        f(4, "size", Ty::I64),
        f(5, "mode", Ty::U32),
        f(6, "permissions", Ty::Str),
        f(7, "owner", Ty::Str),
        f(8, "group", Ty::Str),
        f(9, "modifiedTime", Ty::Timestamp),
        f(10, "symlinkTarget", Ty::Str),
        f(11, "metadata", Ty::StrMap),
        f(12, "isSymlink", Ty::Bool),
    ],
};

/// Caches uid/gid → name lookups during one listing.
#[derive(Default)]
pub struct Names {
    users: HashMap<u32, String>,
    groups: HashMap<u32, String>,
}

impl Names {
    fn user(&mut self, uid: u32) -> String {
        self.users
            .entry(uid)
            .or_insert_with(|| user_name(uid))
            .clone()
    }
    fn group(&mut self, gid: u32) -> String {
        self.groups
            .entry(gid)
            .or_insert_with(|| group_name(gid))
            .clone()
    }
}

fn kind(ft: std::fs::FileType) -> &'static str {
    if ft.is_dir() {
        FILE_TYPE_DIRECTORY
    } else if ft.is_symlink() {
        FILE_TYPE_SYMLINK
    } else {
        // Regular files and also devices, FIFOs and sockets (as envd does).
        FILE_TYPE_FILE
    }
}

/// `ls -l`-style permissions as Go's `FileMode.String()` prints them.
pub fn permissions_string(meta: &Metadata) -> String {
    let ft = meta.file_type();
    let mode = meta.mode();
    let mut s = String::with_capacity(11);
    if ft.is_dir() {
        s.push('d');
    } else if ft.is_symlink() {
        s.push('L');
    } else if ft.is_block_device() {
        s.push('D');
    } else if ft.is_char_device() {
        s.push_str("Dc");
    } else if ft.is_fifo() {
        s.push('p');
    } else if ft.is_socket() {
        s.push('S');
    }
    if mode & 0o4000 != 0 {
        s.push('u');
    }
    if mode & 0o2000 != 0 {
        s.push('g');
    }
    if mode & 0o1000 != 0 {
        s.push('t');
    }
    if s.is_empty() {
        s.push('-');
    }
    for shift in [6u32, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// Builds the entry of `path` (not following a final symlink, but
/// reporting the target's type and path for one).
pub fn entry_info(path: &Path, names: &mut Names) -> Result<EntryInfo> {
    let meta = std::fs::symlink_metadata(path).map_err(|e| EnvdError::io(&e, path.display()))?;
    Ok(entry_from_meta(path, &meta, names))
}

pub fn entry_from_meta(path: &Path, meta: &Metadata, names: &mut Names) -> EntryInfo {
    let is_symlink = meta.file_type().is_symlink();
    let (file_type, symlink_target) = if is_symlink {
        let target = std::fs::read_link(path).ok().map(|t| {
            let abs = if t.is_absolute() {
                t
            } else {
                path.parent().unwrap_or(Path::new("/")).join(t)
            };
            crate::envd::user::normalize(&abs)
        });
        let target_type = std::fs::metadata(path)
            .map(|m| kind(m.file_type()))
            .unwrap_or(FILE_TYPE_SYMLINK);
        (target_type, target.map(|t| t.display().to_string()))
    } else {
        (kind(meta.file_type()), None)
    };
    let modified = meta
        .modified()
        .map(crate::envd::time::format_system_time)
        .unwrap_or_else(|_| crate::envd::time::format_rfc3339(0, 0));
    EntryInfo {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "/".into()),
        file_type,
        path: path.display().to_string(),
        size: meta.len().to_string(),
        mode: meta.mode() & 0o777,
        permissions: permissions_string(meta),
        owner: names.user(meta.uid()),
        group: names.group(meta.gid()),
        modified_time: modified,
        symlink_target,
        metadata: if is_symlink {
            BTreeMap::new()
        } else {
            crate::envd::xattr::read_metadata(path)
        },
        is_symlink,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_fully_filled() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("a.txt");
        std::fs::write(&f, b"hello").unwrap();
        std::fs::set_permissions(&f, std::os::unix::fs::PermissionsExt::from_mode(0o640)).unwrap();
        let mut names = Names::default();
        let e = entry_info(&f, &mut names).unwrap();
        assert_eq!(e.name, "a.txt");
        assert_eq!(e.file_type, FILE_TYPE_FILE);
        assert_eq!(e.size, "5");
        assert_eq!(e.mode, 0o640);
        assert_eq!(e.permissions, "-rw-r-----");
        assert_eq!(e.owner, user_name(nix::unistd::geteuid().as_raw()));
        assert!(e.modified_time.ends_with('Z'));
        assert!(!e.is_symlink);

        let d = entry_info(dir.path(), &mut names).unwrap();
        assert_eq!(d.file_type, FILE_TYPE_DIRECTORY);
        assert!(d.permissions.starts_with('d'));

        let l = dir.path().join("link");
        std::os::unix::fs::symlink("a.txt", &l).unwrap();
        let e = entry_info(&l, &mut names).unwrap();
        assert!(e.is_symlink);
        assert_eq!(
            e.file_type, FILE_TYPE_FILE,
            "a symlink reports its target's type"
        );
        assert_eq!(e.symlink_target.as_deref(), Some(f.to_str().unwrap()));
        assert!(e.permissions.starts_with('L'));
        let json = serde_json::to_value(&e).unwrap();
        assert_eq!(json["isSymlink"], true);
        assert_eq!(json["type"], "FILE_TYPE_FILE");

        let dangling = dir.path().join("dangling");
        std::os::unix::fs::symlink("/nonexistent/x", &dangling).unwrap();
        assert_eq!(
            entry_info(&dangling, &mut names).unwrap().file_type,
            FILE_TYPE_SYMLINK
        );
        assert_eq!(
            entry_info(&dir.path().join("missing"), &mut names)
                .unwrap_err()
                .code(),
            tine_connect::Code::NotFound
        );
    }
}

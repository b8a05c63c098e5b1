//! `filesystem.Filesystem`: stat, list, make, move and remove entries, and
//! watch directories. As in envd, every operation runs as the agent
//! (root); the caller's user resolves `~` and relative paths and owns the
//! directories a call creates ([`crate::envd::user::ensure_dirs`]).
//!
//! Each message's binary protobuf schema sits next to its struct, here and
//! in [`entry`] and `watch`; [`schemas`] maps a method to its pair.

pub mod entry;
mod watch;

use std::path::{Path, PathBuf};

use axum::body::Body;
use axum::response::Response;
use serde::{Deserialize, Serialize};

use self::entry::{entry_info, EntryInfo, Names, ENTRY_INFO};
pub use self::watch::Watchers;
use self::watch::{WATCHER_EVENTS, WATCHER_ID, WATCH_DIR_RESPONSE, WATCH_REQUEST};
use super::error::{EnvdError, Result};
use super::protobin::{f, rep, Schema, Ty, EMPTY};
use super::rpc::{unary, Ctx, Wire};
use super::user::{blocking, ensure_dirs};

#[derive(Debug, Default, Deserialize)]
struct PathRequest {
    #[serde(default)]
    path: String,
}

/// Mirrors [`PathRequest`] (`StatRequest`, `MakeDirRequest`, `RemoveRequest`).
pub static PATH_REQUEST: Schema = Schema {
    fields: &[f(1, "path", Ty::Str)],
};

#[derive(Debug, Default, Deserialize)]
struct ListDirRequest {
    #[serde(default)]
    path: String,
    #[serde(default, deserialize_with = "crate::envd::proto::de_u32")]
    depth: u32,
}

/// Mirrors [`ListDirRequest`].
pub static LIST_DIR_REQUEST: Schema = Schema {
    fields: &[f(1, "path", Ty::Str), f(2, "depth", Ty::U32)],
};

#[derive(Debug, Default, Deserialize)]
struct MoveRequest {
    #[serde(default)]
    source: String,
    #[serde(default)]
    destination: String,
}

/// Mirrors [`MoveRequest`].
pub static MOVE_REQUEST: Schema = Schema {
    fields: &[f(1, "source", Ty::Str), f(2, "destination", Ty::Str)],
};

#[derive(Debug, Serialize)]
struct EntryResponse {
    entry: EntryInfo,
}

/// Mirrors [`EntryResponse`] (`StatResponse`, `MakeDirResponse`,
/// `MoveResponse`).
pub static ENTRY_RESPONSE: Schema = Schema {
    fields: &[f(1, "entry", Ty::Msg(&ENTRY_INFO))],
};

#[derive(Debug, Serialize)]
struct ListDirResponse {
    entries: Vec<EntryInfo>,
}

/// Mirrors [`ListDirResponse`].
pub static LIST_DIR_RESPONSE: Schema = Schema {
    fields: &[rep(1, "entries", Ty::Msg(&ENTRY_INFO))],
};

#[derive(Debug, Serialize)]
struct Empty {}

/// Request and response schemas of `filesystem.Filesystem/<method>` (the
/// `Empty` structs' schema is [`EMPTY`]).
pub fn schemas(method: &str) -> Option<(&'static Schema, &'static Schema)> {
    Some(match method {
        "Stat" | "MakeDir" => (&PATH_REQUEST, &ENTRY_RESPONSE),
        "Remove" => (&PATH_REQUEST, &EMPTY),
        "Move" => (&MOVE_REQUEST, &ENTRY_RESPONSE),
        "ListDir" => (&LIST_DIR_REQUEST, &LIST_DIR_RESPONSE),
        "WatchDir" => (&WATCH_REQUEST, &WATCH_DIR_RESPONSE),
        "CreateWatcher" => (&WATCH_REQUEST, &WATCHER_ID),
        "GetWatcherEvents" => (&WATCHER_ID, &WATCHER_EVENTS),
        "RemoveWatcher" => (&WATCHER_ID, &EMPTY),
        _ => return None,
    })
}

/// Dispatches one `filesystem.Filesystem` call.
pub async fn handle(method: &str, ctx: Result<Ctx>, wire: &Wire, body: Body) -> Option<Response> {
    let resp = match method {
        "Stat" => wire.unary_response(unary(ctx, wire, body, stat).await),
        "MakeDir" => wire.unary_response(unary(ctx, wire, body, make_dir).await),
        "Move" => wire.unary_response(unary(ctx, wire, body, move_entry).await),
        "ListDir" => wire.unary_response(unary(ctx, wire, body, list_dir).await),
        "Remove" => wire.unary_response(unary(ctx, wire, body, remove).await),
        "CreateWatcher" => wire.unary_response(unary(ctx, wire, body, watch::create_watcher).await),
        "GetWatcherEvents" => {
            wire.unary_response(unary(ctx, wire, body, watch::get_watcher_events).await)
        }
        "RemoveWatcher" => wire.unary_response(unary(ctx, wire, body, watch::remove_watcher).await),
        "WatchDir" => match ctx {
            Ok(ctx) => match wire.read_stream_request(body).await {
                Ok(req) => watch::watch_dir(ctx, wire, req).await,
                Err(e) => wire.stream_error(e),
            },
            Err(e) => wire.stream_error(e),
        },
        _ => return None,
    };
    Some(resp)
}

/// Resolves a request path for the caller; an empty path is refused.
pub fn resolve(ctx: &Ctx, path: &str) -> Result<PathBuf> {
    if path.is_empty() {
        return Err(EnvdError::InvalidArgument("path is empty".into()));
    }
    ctx.user
        .resolve(path, ctx.envd.defaults().workdir.as_deref())
}

async fn stat(ctx: Ctx, req: PathRequest) -> Result<EntryResponse> {
    let path = resolve(&ctx, &req.path)?;
    blocking(move || {
        Ok(EntryResponse {
            entry: entry_info(&path, &mut Names::default())?,
        })
    })
    .await
}

async fn make_dir(ctx: Ctx, req: PathRequest) -> Result<EntryResponse> {
    let path = resolve(&ctx, &req.path)?;
    let owner = ctx.user.owner();
    blocking(move || {
        match std::fs::metadata(&path) {
            Ok(m) if m.is_dir() => {
                return Err(EnvdError::AlreadyExists(format!(
                    "directory already exists: {}",
                    path.display()
                )))
            }
            Ok(_) => {
                return Err(EnvdError::InvalidArgument(format!(
                    "path already exists but it is not a directory: {}",
                    path.display()
                )))
            }
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(EnvdError::io(&e, path.display()))
            }
            Err(_) => {}
        }
        ensure_dirs(&path, owner)?;
        Ok(EntryResponse {
            entry: entry_info(&path, &mut Names::default())?,
        })
    })
    .await
}

async fn move_entry(ctx: Ctx, req: MoveRequest) -> Result<EntryResponse> {
    let src = resolve(&ctx, &req.source)?;
    let dst = resolve(&ctx, &req.destination)?;
    let owner = ctx.user.owner();
    blocking(move || {
        std::fs::symlink_metadata(&src).map_err(|e| EnvdError::io(&e, src.display()))?;
        if let Some(parent) = dst.parent() {
            ensure_dirs(parent, owner)?;
        }
        std::fs::rename(&src, &dst).map_err(|e| {
            EnvdError::io(&e, format!("moving {} to {}", src.display(), dst.display()))
        })?;
        Ok(EntryResponse {
            entry: entry_info(&dst, &mut Names::default())?,
        })
    })
    .await
}

/// Removes a file or a whole tree. A path that does not exist is already
/// removed: that succeeds, as in envd.
async fn remove(ctx: Ctx, req: PathRequest) -> Result<Empty> {
    let path = resolve(&ctx, &req.path)?;
    blocking(move || {
        let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
        let meta = match std::fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if gone(&e) => return Ok(Empty {}),
            Err(e) => return Err(EnvdError::io(&e, path.display())),
        };
        let r = if meta.is_dir() {
            std::fs::remove_dir_all(&path)
        } else {
            std::fs::remove_file(&path)
        };
        match r {
            Err(e) if !gone(&e) => return Err(EnvdError::io(&e, path.display())),
            _ => {}
        }
        Ok(Empty {})
    })
    .await
}

async fn list_dir(ctx: Ctx, req: ListDirRequest) -> Result<ListDirResponse> {
    let path = resolve(&ctx, &req.path)?;
    let depth = req.depth.max(1);
    blocking(move || {
        // A symlink to a directory lists the directory.
        let meta = std::fs::metadata(&path).map_err(|e| EnvdError::io(&e, path.display()))?;
        if !meta.is_dir() {
            return Err(EnvdError::InvalidArgument(format!(
                "path {} is not a directory",
                path.display()
            )));
        }
        let mut entries = Vec::new();
        walk(&path, depth, &mut Names::default(), &mut entries)?;
        Ok(ListDirResponse { entries })
    })
    .await
}

/// Lists `dir` and, while `depth` allows, its subdirectories (not through
/// symlinks). Unreadable subdirectories are skipped; an unreadable `dir`
/// itself is an error.
fn walk(dir: &Path, depth: u32, names: &mut Names, out: &mut Vec<EntryInfo>) -> Result<()> {
    let rd = std::fs::read_dir(dir).map_err(|e| EnvdError::io(&e, dir.display()))?;
    let mut children: Vec<_> = rd.filter_map(|e| e.ok()).collect();
    children.sort_by_key(|e| e.file_name());
    for child in children {
        let path = child.path();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        out.push(entry::entry_from_meta(&path, &meta, names));
        if depth > 1 && meta.is_dir() {
            let _ = walk(&path, depth - 1, names, out);
        }
    }
    Ok(())
}

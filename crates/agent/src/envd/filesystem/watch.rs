//! Directory watches on inotify: the `WatchDir` stream and the polled
//! watchers (`CreateWatcher` / `GetWatcherEvents` / `RemoveWatcher`).
//!
//! Event names are relative to the watched directory; types follow
//! fsnotify, which real envd uses (IN_CREATE and IN_MOVED_TO are CREATE,
//! IN_MODIFY is WRITE, IN_DELETE is REMOVE, IN_MOVED_FROM is RENAME,
//! IN_ATTRIB is CHMOD). A recursive watch adds every subdirectory, also
//! the ones created while it runs.

use std::collections::{HashMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::response::Response;
use futures::StreamExt;
use inotify::{EventMask, Inotify, WatchDescriptor, WatchMask, Watches};
use serde::{Deserialize, Serialize};

use super::entry::{entry_info, EntryInfo, Names, ENTRY_INFO};
use crate::envd::error::{EnvdError, Result};
use crate::envd::protobin::{f, rep, Schema, Ty, EMPTY};
use crate::envd::rpc::{Ctx, Wire};
use crate::envd::user::blocking;

/// Events a polled watcher keeps until they are fetched (oldest dropped).
const MAX_PENDING_EVENTS: usize = 10_000;
/// A polled watcher nobody has asked for events this long is removed (a
/// client that never calls RemoveWatcher must not leak inotify instances,
/// of which a user gets 128 by default).
const WATCHER_IDLE_LIMIT: Duration = Duration::from_secs(600);

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatchRequest {
    #[serde(default)]
    path: String,
    #[serde(default)]
    recursive: bool,
    #[serde(default, alias = "include_entry")]
    include_entry: bool,
    #[serde(default, alias = "allow_network_mounts")]
    allow_network_mounts: bool,
}

/// Mirrors [`WatchRequest`] (`WatchDirRequest` and `CreateWatcherRequest`).
pub static WATCH_REQUEST: Schema = Schema {
    fields: &[
        f(1, "path", Ty::Str),
        f(2, "recursive", Ty::Bool),
        f(3, "includeEntry", Ty::Bool),
        f(4, "allowNetworkMounts", Ty::Bool),
    ],
};

#[derive(Debug, Clone, Serialize)]
pub struct FilesystemEvent {
    name: String,
    #[serde(rename = "type")]
    event_type: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    entry: Option<EntryInfo>,
}

/// `enum EventType`: the values of [`FilesystemEvent`]'s `type` (see
/// `event_type`).
const EVENT_TYPE: &[(&str, i64)] = &[
    ("EVENT_TYPE_UNSPECIFIED", 0),
    ("EVENT_TYPE_CREATE", 1),
    ("EVENT_TYPE_WRITE", 2),
    ("EVENT_TYPE_REMOVE", 3),
    ("EVENT_TYPE_RENAME", 4),
    ("EVENT_TYPE_CHMOD", 5),
];

/// Mirrors [`FilesystemEvent`].
pub static FS_EVENT: Schema = Schema {
    fields: &[
        f(1, "name", Ty::Str),
        f(2, "type", Ty::Enum(EVENT_TYPE)),
        f(3, "entry", Ty::Msg(&ENTRY_INFO)),
    ],
};

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
#[allow(clippy::large_enum_variant)] // built one at a time, never stored
enum WatchDirResponse {
    Start {},
    Filesystem(FilesystemEvent),
    Keepalive {},
}

/// Mirrors [`WatchDirResponse`] (a oneof).
pub static WATCH_DIR_RESPONSE: Schema = Schema {
    fields: &[
        f(1, "start", Ty::Msg(&EMPTY)),
        f(2, "filesystem", Ty::Msg(&FS_EVENT)),
        f(3, "keepalive", Ty::Msg(&EMPTY)),
    ],
};

#[derive(Debug, Serialize)]
struct EventWrapper<'a> {
    #[serde(flatten)]
    event: &'a WatchDirResponse,
}

const MASK: WatchMask = WatchMask::CREATE
    .union(WatchMask::MODIFY)
    .union(WatchMask::DELETE)
    .union(WatchMask::MOVED_FROM)
    .union(WatchMask::MOVED_TO)
    .union(WatchMask::ATTRIB)
    .union(WatchMask::DELETE_SELF);

fn event_type(mask: EventMask) -> Option<&'static str> {
    if mask.intersects(EventMask::CREATE | EventMask::MOVED_TO) {
        Some("EVENT_TYPE_CREATE")
    } else if mask.contains(EventMask::MODIFY) {
        Some("EVENT_TYPE_WRITE")
    } else if mask.intersects(EventMask::DELETE | EventMask::DELETE_SELF) {
        Some("EVENT_TYPE_REMOVE")
    } else if mask.contains(EventMask::MOVED_FROM) {
        Some("EVENT_TYPE_RENAME")
    } else if mask.contains(EventMask::ATTRIB) {
        Some("EVENT_TYPE_CHMOD")
    } else {
        None
    }
}

/// Filesystems whose events inotify cannot see reliably.
#[allow(clippy::unnecessary_cast)] // f_type's integer type differs between libcs
fn is_network_fs(path: &Path) -> bool {
    const NETWORK: [i64; 6] = [
        0x6969,
        0x517B,
        0xFF53_4D42u32 as i64,
        0xFE53_4D42u32 as i64,
        0x6573_5546,
        0x0102_1997,
    ];
    nix::sys::statfs::statfs(path)
        .map(|s| NETWORK.contains(&(s.filesystem_type().0 as i64)))
        .unwrap_or(false)
}

/// One inotify instance over a directory (and its subdirectories).
struct DirWatch {
    root: PathBuf,
    recursive: bool,
    include_entry: bool,
    watches: Watches,
    dirs: HashMap<WatchDescriptor, PathBuf>,
    stream: inotify::EventStream<Vec<u8>>,
}

impl DirWatch {
    async fn open(ctx: &Ctx, req: &WatchRequest) -> Result<DirWatch> {
        let root = super::resolve(ctx, &req.path)?;
        let check = root.clone();
        blocking(move || {
            let meta = std::fs::metadata(&check).map_err(|e| EnvdError::io(&e, check.display()))?;
            if !meta.is_dir() {
                return Err(EnvdError::InvalidArgument(format!(
                    "path {} is not a directory",
                    check.display()
                )));
            }
            std::fs::read_dir(&check).map_err(|e| EnvdError::io(&e, check.display()))?;
            Ok(())
        })
        .await?;
        if !req.allow_network_mounts && is_network_fs(&root) {
            return Err(EnvdError::InvalidArgument(format!(
                "{} is on a network filesystem; set allow_network_mounts to watch it",
                root.display()
            )));
        }
        let inotify = Inotify::init().map_err(|e| EnvdError::Internal(format!("inotify: {e}")))?;
        let stream = inotify
            .into_event_stream(vec![0u8; 64 << 10])
            .map_err(|e| EnvdError::Internal(format!("inotify: {e}")))?;
        let mut w = DirWatch {
            root: root.clone(),
            recursive: req.recursive,
            include_entry: req.include_entry,
            watches: stream.watches(),
            dirs: HashMap::new(),
            stream,
        };
        let wd = w
            .watches
            .add(&root, MASK)
            .map_err(|e| EnvdError::io(&e, root.display()))?;
        w.dirs.insert(wd, root.clone());
        if w.recursive {
            w.add_tree(&root, &mut Vec::new());
        }
        Ok(w)
    }

    /// Watches every directory under `dir` (best effort); `found` gets
    /// every entry seen under it.
    fn add_tree(&mut self, dir: &Path, found: &mut Vec<PathBuf>) {
        let Ok(rd) = std::fs::read_dir(dir) else {
            return;
        };
        for child in rd.flatten() {
            let p = child.path();
            found.push(p.clone());
            if child.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                if let Ok(wd) = self.watches.add(&p, MASK) {
                    self.dirs.insert(wd, p.clone());
                    self.add_tree(&p, found);
                }
            }
        }
    }

    fn event(&self, full: &Path, event_type: &'static str) -> FilesystemEvent {
        let name = full.strip_prefix(&self.root).unwrap_or(Path::new(""));
        FilesystemEvent {
            name: name.to_string_lossy().into_owned(),
            event_type,
            entry: if self.include_entry {
                entry_info(full, &mut Names::default()).ok()
            } else {
                None
            },
        }
    }

    /// The next batch of events; an error when the watch broke.
    async fn next(&mut self) -> Result<Vec<FilesystemEvent>> {
        loop {
            let ev = match self.stream.next().await {
                Some(Ok(ev)) => ev,
                Some(Err(e)) => {
                    return Err(EnvdError::Internal(format!("reading inotify events: {e}")))
                }
                None => return Err(EnvdError::Internal("inotify stream ended".into())),
            };
            if ev.mask.contains(EventMask::Q_OVERFLOW) {
                tracing::warn!(root = %self.root.display(), "inotify queue overflowed; events were lost");
                continue;
            }
            if ev.mask.contains(EventMask::IGNORED) {
                self.dirs.remove(&ev.wd);
                continue;
            }
            let Some(dir) = self.dirs.get(&ev.wd).cloned() else {
                continue;
            };
            let full = match &ev.name {
                Some(n) => dir.join(n),
                None => dir.clone(),
            };
            // DELETE_SELF of a subdirectory duplicates the parent's DELETE.
            if ev.mask.contains(EventMask::DELETE_SELF) && dir != self.root {
                continue;
            }
            // A directory made while the watch runs is watched too. What
            // was made in it before its watch was added is reported as
            // created, so nested paths are not lost to that race (one may
            // then be reported twice).
            let mut found = Vec::new();
            if self.recursive
                && ev.mask.contains(EventMask::ISDIR)
                && ev.mask.intersects(EventMask::CREATE | EventMask::MOVED_TO)
            {
                if let Ok(wd) = self.watches.add(&full, MASK) {
                    self.dirs.insert(wd, full.clone());
                    self.add_tree(&full, &mut found);
                }
            }
            let Some(event_type) = event_type(ev.mask) else {
                continue;
            };
            let mut events = vec![self.event(&full, event_type)];
            events.extend(found.iter().map(|p| self.event(p, "EVENT_TYPE_CREATE")));
            return Ok(events);
        }
    }
}

/// `WatchDir`: `start`, then events (and keepalives) until the client
/// leaves or the deadline passes.
pub async fn watch_dir(ctx: Ctx, wire: &Wire, req: WatchRequest) -> Response {
    let mut watch = match DirWatch::open(&ctx, &req).await {
        Ok(w) => w,
        Err(e) => return wire.stream_error(e),
    };
    let (tx, resp) = wire.stream_response();
    let keepalive = ctx
        .keepalive
        .unwrap_or(Duration::from_secs(3600 * 24 * 365));
    let deadline = ctx.timeout.map(|d| tokio::time::Instant::now() + d);
    tokio::spawn(async move {
        let send = |m: WatchDirResponse| {
            let tx = &tx;
            async move { tx.send(&EventWrapper { event: &m }).await }
        };
        if send(WatchDirResponse::Start {}).await.is_err() {
            return;
        }
        loop {
            let result = tokio::select! {
                r = watch.next() => Some(r),
                _ = tokio::time::sleep(keepalive) => None,
                _ = async { match deadline { Some(d) => tokio::time::sleep_until(d).await, None => std::future::pending().await } } => {
                    tx.finish(Err(EnvdError::DeadlineExceeded("watch deadline exceeded".into()))).await;
                    return;
                }
                _ = tx.closed() => return,
            };
            match result {
                None => {
                    if send(WatchDirResponse::Keepalive {}).await.is_err() {
                        return;
                    }
                }
                Some(Ok(events)) => {
                    for ev in events {
                        if send(WatchDirResponse::Filesystem(ev)).await.is_err() {
                            return;
                        }
                    }
                }
                Some(Err(e)) => {
                    tx.finish(Err(e)).await;
                    return;
                }
            }
        }
    });
    resp
}

struct Watcher {
    events: Mutex<VecDeque<FilesystemEvent>>,
    last_poll: Mutex<tokio::time::Instant>,
    error: Mutex<Option<EnvdError>>,
    task: tokio::task::JoinHandle<()>,
}

/// The polled watchers, by id.
#[derive(Default)]
pub struct Watchers {
    map: Mutex<HashMap<String, Arc<Watcher>>>,
    next: std::sync::atomic::AtomicU64,
}

impl Watchers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Watcher>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn new_id(&self) -> String {
        use std::hash::{BuildHasher, Hasher};
        let n = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(n);
        format!("w{n}-{:016x}", h.finish())
    }
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CreateWatcherResponse {
    watcher_id: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WatcherRequest {
    #[serde(default, alias = "watcher_id")]
    watcher_id: String,
}

/// Mirrors [`CreateWatcherResponse`] and [`WatcherRequest`]
/// (`GetWatcherEventsRequest` and `RemoveWatcherRequest`).
pub static WATCHER_ID: Schema = Schema {
    fields: &[f(1, "watcherId", Ty::Str)],
};

#[derive(Debug, Serialize)]
pub struct GetWatcherEventsResponse {
    events: Vec<FilesystemEvent>,
}

/// Mirrors [`GetWatcherEventsResponse`].
pub static WATCHER_EVENTS: Schema = Schema {
    fields: &[rep(1, "events", Ty::Msg(&FS_EVENT))],
};

#[derive(Debug, Serialize)]
pub struct Empty {}

pub async fn create_watcher(ctx: Ctx, req: WatchRequest) -> Result<CreateWatcherResponse> {
    let mut watch = DirWatch::open(&ctx, &req).await?;
    let id = ctx.envd.watchers.new_id();
    let envd = Arc::downgrade(&ctx.envd);
    let task_id = id.clone();
    let watcher = Arc::new_cyclic(|weak: &std::sync::Weak<Watcher>| {
        let weak = weak.clone();
        let task = tokio::spawn(async move {
            let mut idle_check = tokio::time::interval(WATCHER_IDLE_LIMIT / 10);
            loop {
                let r = tokio::select! {
                    r = watch.next() => r,
                    _ = idle_check.tick() => {
                        let Some(w) = weak.upgrade() else { return };
                        let idle = w.last_poll.lock().unwrap_or_else(|e| e.into_inner()).elapsed();
                        if idle >= WATCHER_IDLE_LIMIT {
                            tracing::info!(watcher = %task_id, "removing a watcher nobody polls");
                            if let Some(envd) = envd.upgrade() {
                                envd.watchers.lock().remove(&task_id);
                            }
                            return;
                        }
                        continue;
                    }
                };
                let Some(w) = weak.upgrade() else { return };
                match r {
                    Ok(events) => {
                        let mut q = w.events.lock().unwrap_or_else(|e| e.into_inner());
                        q.extend(events);
                        while q.len() > MAX_PENDING_EVENTS {
                            q.pop_front();
                        }
                    }
                    Err(e) => {
                        *w.error.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                        return;
                    }
                }
            }
        });
        Watcher {
            events: Mutex::new(VecDeque::new()),
            last_poll: Mutex::new(tokio::time::Instant::now()),
            error: Mutex::new(None),
            task,
        }
    });
    ctx.envd.watchers.lock().insert(id.clone(), watcher);
    Ok(CreateWatcherResponse { watcher_id: id })
}

fn find(ctx: &Ctx, id: &str) -> Result<Arc<Watcher>> {
    ctx.envd
        .watchers
        .lock()
        .get(id)
        .cloned()
        .ok_or_else(|| EnvdError::NotFound(format!("watcher {id:?} not found")))
}

pub async fn get_watcher_events(ctx: Ctx, req: WatcherRequest) -> Result<GetWatcherEventsResponse> {
    let w = find(&ctx, &req.watcher_id)?;
    *w.last_poll.lock().unwrap_or_else(|e| e.into_inner()) = tokio::time::Instant::now();
    let events: Vec<_> = w
        .events
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .drain(..)
        .collect();
    if events.is_empty() {
        if let Some(e) = w.error.lock().unwrap_or_else(|e| e.into_inner()).clone() {
            return Err(e);
        }
    }
    Ok(GetWatcherEventsResponse { events })
}

pub async fn remove_watcher(ctx: Ctx, req: WatcherRequest) -> Result<Empty> {
    let w = ctx
        .envd
        .watchers
        .lock()
        .remove(&req.watcher_id)
        .ok_or_else(|| EnvdError::NotFound(format!("watcher {:?} not found", req.watcher_id)))?;
    w.task.abort();
    Ok(Empty {})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masks_map_like_fsnotify() {
        assert_eq!(event_type(EventMask::CREATE), Some("EVENT_TYPE_CREATE"));
        assert_eq!(
            event_type(EventMask::MOVED_TO | EventMask::ISDIR),
            Some("EVENT_TYPE_CREATE")
        );
        assert_eq!(event_type(EventMask::MODIFY), Some("EVENT_TYPE_WRITE"));
        assert_eq!(event_type(EventMask::DELETE), Some("EVENT_TYPE_REMOVE"));
        assert_eq!(event_type(EventMask::MOVED_FROM), Some("EVENT_TYPE_RENAME"));
        assert_eq!(event_type(EventMask::ATTRIB), Some("EVENT_TYPE_CHMOD"));
        assert_eq!(event_type(EventMask::ACCESS), None);
    }

    #[test]
    fn responses_serialize_as_oneofs() {
        let ev = WatchDirResponse::Filesystem(FilesystemEvent {
            name: "a/b".into(),
            event_type: "EVENT_TYPE_CREATE",
            entry: None,
        });
        assert_eq!(
            serde_json::to_string(&EventWrapper { event: &ev }).unwrap(),
            r#"{"filesystem":{"name":"a/b","type":"EVENT_TYPE_CREATE"}}"#
        );
        assert_eq!(
            serde_json::to_string(&EventWrapper {
                event: &WatchDirResponse::Start {}
            })
            .unwrap(),
            r#"{"start":{}}"#
        );
    }
}

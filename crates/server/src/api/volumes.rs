//! E2B's volume routes: `/volumes` (API key, team scoped) and the content
//! API `/volumecontent/{id}/…` (the volume's token as `Authorization:
//! Bearer`). The logic is in [`crate::volumes`]; these only translate.

use std::sync::Arc;

use axum::extract::{FromRequestParts, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use http::request::Parts;
use http::StatusCode;
use serde::Deserialize;
use serde_json::json;
use tokio::io::AsyncWriteExt;

use super::extract::{Path, Query};
use super::{ApiError, Authed};
use crate::db::VolumeRow;
use crate::state::AppState;
use crate::volumes::content::{Owner, VolPath};
use crate::volumes::VolumeError;

impl From<VolumeError> for ApiError {
    fn from(e: VolumeError) -> Self {
        let status = match &e {
            VolumeError::NotFound(_) | VolumeError::PathNotFound(_) => StatusCode::NOT_FOUND,
            VolumeError::Exists(_) | VolumeError::PathExists(_) | VolumeError::InUse { .. } => {
                StatusCode::CONFLICT
            }
            VolumeError::BadName(_) | VolumeError::BadPath { .. } => StatusCode::BAD_REQUEST,
            VolumeError::Full { .. } => StatusCode::INSUFFICIENT_STORAGE,
            VolumeError::Db(_) | VolumeError::Io { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status == StatusCode::INTERNAL_SERVER_ERROR {
            tracing::error!("volumes: {e}");
        }
        ApiError::new(status, e.to_string())
    }
}

/// Runs `f` off the async runtime (file system calls block).
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, VolumeError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?
        .map_err(ApiError::from)
}

/// Runs `f` on volume `row`'s content, off the async runtime.
async fn in_volume<T: Send + 'static>(
    s: &AppState,
    row: VolumeRow,
    f: impl FnOnce(&crate::volumes::content::Content<'_>) -> Result<T, VolumeError> + Send + 'static,
) -> Result<T, ApiError> {
    let v = s.volumes.clone();
    blocking(move || f(&v.content(&row)?)).await
}

fn with_token(v: &VolumeRow) -> serde_json::Value {
    json!({ "volumeID": v.id, "name": v.name, "token": v.token })
}

#[derive(Deserialize)]
pub struct NewVolume {
    name: String,
}

/// `POST /volumes`.
pub async fn create(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    super::JsonBody(req): super::JsonBody<NewVolume>,
) -> Result<Response, ApiError> {
    let v = s.volumes.clone();
    let row = blocking(move || v.create(&key.team, &req.name)).await?;
    tracing::info!(volume = %row.id, name = %row.name, team = %row.team, "volume created");
    Ok((StatusCode::CREATED, Json(with_token(&row))).into_response())
}

/// `GET /volumes`.
pub async fn list(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
) -> Result<Json<serde_json::Value>, ApiError> {
    let rows = s.volumes.list(&key.team)?;
    Ok(Json(json!(rows
        .iter()
        .map(|v| json!({ "volumeID": v.id, "name": v.name }))
        .collect::<Vec<_>>())))
}

/// `GET /volumes/{id}`.
pub async fn get(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<serde_json::Value>, ApiError> {
    Ok(Json(with_token(&s.volumes.get(&key.team, &id)?)))
}

/// `DELETE /volumes/{id}`.
pub async fn destroy(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    let (v, team, which) = (s.volumes.clone(), key.team.clone(), id.clone());
    if !blocking(move || v.destroy(&team, &which)).await? {
        return Err(VolumeError::NotFound(id).into());
    }
    tracing::info!(volume = %id, team = %key.team, "volume destroyed");
    Ok(StatusCode::NO_CONTENT)
}

/// A content call with the token of the volume in its path.
pub struct ByToken(VolumeRow);

impl FromRequestParts<Arc<AppState>> for ByToken {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, ApiError> {
        // A cluster node takes content calls only from its gateways.
        if let Some(secret) = &state.cluster_secret {
            crate::cluster::gateway_team(secret, &parts.headers).map_err(|_| {
                ApiError::unauthorized(
                    "this server is a cluster node: send volume calls to a tine gateway",
                )
            })?;
        }
        let Path(params) =
            Path::<std::collections::HashMap<String, String>>::from_request_parts(parts, state)
                .await?;
        let id = params.get("id").cloned().unwrap_or_default();
        let token = super::bearer_of(&parts.headers).ok_or_else(|| {
            ApiError::unauthorized("missing volume token: send it as Authorization: Bearer")
        })?;
        match state.volumes.by_token(&id, token) {
            Ok(row) => Ok(ByToken(row)),
            // An unknown volume and a wrong token look the same.
            Err(VolumeError::NotFound(_)) => Err(ApiError::unauthorized(format!(
                "no volume {id} with this token"
            ))),
            Err(e) => Err(e.into()),
        }
    }
}

#[derive(Deserialize)]
pub struct PathQuery {
    path: String,
    depth: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
    force: Option<bool>,
}

impl PathQuery {
    fn path(&self) -> Result<VolPath, ApiError> {
        Ok(VolPath::parse(&self.path)?)
    }
    fn owner(&self) -> Owner {
        Owner {
            uid: self.uid,
            gid: self.gid,
            mode: self.mode,
        }
    }
}

/// `GET /volumecontent/{id}/file`: the file's bytes.
pub async fn read_file(
    ByToken(row): ByToken,
    State(s): State<Arc<AppState>>,
    Query(q): Query<PathQuery>,
) -> Result<Response, ApiError> {
    let path = q.path()?;
    let file = in_volume(&s, row, move |c| c.read(&path)).await?;
    let stream = tokio_util::io::ReaderStream::new(tokio::fs::File::from_std(file));
    Ok((
        [(http::header::CONTENT_TYPE, "application/octet-stream")],
        axum::body::Body::from_stream(stream),
    )
        .into_response())
}

/// `PUT /volumecontent/{id}/file`: the body becomes the file (written
/// aside and renamed into place: a reader sees the old file or the new).
pub async fn write_file(
    ByToken(row): ByToken,
    State(s): State<Arc<AppState>>,
    Query(q): Query<PathQuery>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let path = q.path()?;
    let owner = q.owner();
    let upload = s.volumes.upload_path(&row.id);
    let full = |detail: String| {
        ApiError::from(VolumeError::Full {
            id: row.id.clone(),
            detail,
        })
    };
    let received = async {
        let mut f = tokio::fs::File::create(&upload)
            .await
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        let mut stream = body.into_data_stream();
        let mut n: u64 = 0;
        while let Some(chunk) = stream.next().await {
            let chunk =
                chunk.map_err(|e| ApiError::bad_request(format!("reading the body: {e}")))?;
            n += chunk.len() as u64;
            // The room is checked exactly at the commit (the upload may
            // replace a file); this stops one that can never fit.
            if n > row.max_bytes {
                return Err(full(format!(
                    "the upload is over its {} bytes",
                    row.max_bytes
                )));
            }
            f.write_all(&chunk)
                .await
                .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        }
        f.sync_all()
            .await
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        Ok(())
    }
    .await;
    if let Err(e) = received {
        let _ = tokio::fs::remove_file(&upload).await;
        // The rest of the body was not read (an upload past the volume's
        // room stops there): the connection cannot carry another request,
        // and a client that is not told would send its next one on it.
        let mut resp = e.into_response();
        resp.headers_mut().insert(
            http::header::CONNECTION,
            http::HeaderValue::from_static("close"),
        );
        return Ok(resp);
    }
    let entry = in_volume(&s, row, move |c| c.commit(&upload, &path, owner)).await?;
    Ok((StatusCode::CREATED, Json(entry)).into_response())
}

/// `GET /volumecontent/{id}/dir`.
pub async fn list_dir(
    ByToken(row): ByToken,
    State(s): State<Arc<AppState>>,
    Query(q): Query<PathQuery>,
) -> Result<Response, ApiError> {
    let path = q.path()?;
    let depth = q.depth.unwrap_or(1).min(64);
    let entries = in_volume(&s, row, move |c| c.list(&path, depth)).await?;
    Ok(Json(entries).into_response())
}

/// `POST /volumecontent/{id}/dir` (`force`: make the parents too).
pub async fn make_dir(
    ByToken(row): ByToken,
    State(s): State<Arc<AppState>>,
    Query(q): Query<PathQuery>,
) -> Result<Response, ApiError> {
    let path = q.path()?;
    let (owner, parents) = (q.owner(), q.force.unwrap_or(false));
    let entry = in_volume(&s, row, move |c| c.mkdir(&path, owner, parents)).await?;
    Ok((StatusCode::CREATED, Json(entry)).into_response())
}

/// `GET /volumecontent/{id}/path`.
pub async fn stat(
    ByToken(row): ByToken,
    State(s): State<Arc<AppState>>,
    Query(q): Query<PathQuery>,
) -> Result<Response, ApiError> {
    let path = q.path()?;
    let entry = in_volume(&s, row, move |c| c.stat(&path)).await?;
    Ok(Json(entry).into_response())
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    uid: Option<u32>,
    gid: Option<u32>,
    mode: Option<u32>,
}

/// `PATCH /volumecontent/{id}/path`: owner and mode.
pub async fn update(
    ByToken(row): ByToken,
    State(s): State<Arc<AppState>>,
    Query(q): Query<PathQuery>,
    super::JsonBody(m): super::JsonBody<Metadata>,
) -> Result<Response, ApiError> {
    let path = q.path()?;
    let owner = Owner {
        uid: m.uid,
        gid: m.gid,
        mode: m.mode,
    };
    let entry = in_volume(&s, row, move |c| c.update(&path, owner)).await?;
    Ok(Json(entry).into_response())
}

/// `DELETE /volumecontent/{id}/path`.
pub async fn remove(
    ByToken(row): ByToken,
    State(s): State<Arc<AppState>>,
    Query(q): Query<PathQuery>,
) -> Result<StatusCode, ApiError> {
    let path = q.path()?;
    in_volume(&s, row, move |c| c.remove(&path)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// The `volumeMounts` of a create: each names a volume of the team (400
/// naming the first that does not) and an absolute path of its own.
pub fn mounts_of(
    s: &AppState,
    team: &str,
    mounts: &serde_json::Value,
) -> Result<Vec<crate::volumes::VolumeMount>, ApiError> {
    #[derive(Deserialize)]
    struct Mount {
        name: String,
        path: String,
    }
    let mounts: Vec<Mount> = serde_json::from_value(mounts.clone())
        .map_err(|e| ApiError::bad_request(format!("invalid volumeMounts: {e}")))?;
    let max = crate::volumes::nfs::MAX_MOUNTS;
    if mounts.len() > max {
        return Err(ApiError::bad_request(format!(
            "volumeMounts: at most {max} mounts a sandbox"
        )));
    }
    let mut out: Vec<crate::volumes::VolumeMount> = Vec::new();
    for m in mounts {
        let path = mount_path(&m.path).map_err(|why| {
            ApiError::bad_request(format!("volumeMounts: path {:?} {why}", m.path))
        })?;
        if out.iter().any(|o| o.path == path) {
            return Err(ApiError::bad_request(format!(
                "volumeMounts: two volumes at {path}"
            )));
        }
        let row = match s.volumes.get(team, &m.name) {
            Ok(row) => row,
            Err(VolumeError::NotFound(_)) => {
                return Err(ApiError::bad_request(format!(
                    "volumeMounts: no volume named {:?} (for {})",
                    m.name, m.path
                )))
            }
            Err(e) => return Err(e.into()),
        };
        out.push(crate::volumes::VolumeMount {
            volume_id: row.id,
            name: row.name,
            path,
        });
    }
    Ok(out)
}

/// `path` as a mount point: absolute, normalized, not `/` and not in the
/// guest's kernel file systems.
fn mount_path(path: &str) -> Result<String, &'static str> {
    if !path.starts_with('/') {
        return Err("is not absolute");
    }
    if path.len() > 1024 || path.contains('\0') {
        return Err("is too long or has a NUL byte");
    }
    let mut parts = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => return Err("has '..'"),
            c => parts.push(c),
        }
    }
    match parts.first() {
        None => Err("is the guest's root"),
        Some(&("proc" | "sys" | "dev" | "run")) => Err("is in a kernel file system"),
        Some(_) => Ok(format!("/{}", parts.join("/"))),
    }
}

#[cfg(test)]
mod tests {
    use super::mount_path;

    #[test]
    fn mount_paths() {
        assert_eq!(mount_path("/mnt//data/").unwrap(), "/mnt/data");
        assert_eq!(mount_path("/mnt/./data").unwrap(), "/mnt/data");
        for bad in ["mnt", "/", "//", "/mnt/../etc", "/proc/x", "/dev", "/a\0b"] {
            assert!(mount_path(bad).is_err(), "{bad}");
        }
    }
}

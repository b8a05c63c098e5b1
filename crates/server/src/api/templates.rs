//! Template routes of E2B's Template API: requesting a build, uploading
//! build contexts, starting a build and following it, aliases and tags.
//! Handlers only translate; builds live in `crate::builds`.
//!
//! The Python SDK accepts only the exact success status of each route
//! (202 for `POST /v3/templates`, 201 for the upload link and for tags).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::{HeaderMap, StatusCode};
use serde::Deserialize;

use super::extract::{Path, Query};
use super::{json_body, ApiError, Authed, JsonBody};
use crate::builds::{BuildError, StartRequest};
use crate::db::{BuildRow, DbError};
use crate::model::rfc3339;
use crate::state::AppState;

/// How long an upload URL stays valid.
const UPLOAD_URL_TTL: std::time::Duration = std::time::Duration::from_secs(3600);

impl From<BuildError> for ApiError {
    fn from(e: BuildError) -> Self {
        let status = match &e {
            BuildError::NotFound(_) => StatusCode::NOT_FOUND,
            BuildError::Invalid(_) => StatusCode::BAD_REQUEST,
            BuildError::Conflict(_) => StatusCode::CONFLICT,
            BuildError::Db(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        ApiError::new(status, e.to_string())
    }
}

fn db_err(e: DbError) -> ApiError {
    ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())
}

/// 404 unless `template` (a name, `name:tag`, or a snapshot id) is shared
/// or belongs to `team`: another team's template answers as an unknown one.
pub(super) fn check_visible(s: &AppState, team: &str, template: &str) -> Result<(), ApiError> {
    match owner(s, template)? {
        Some(t) if t != team => Err(ApiError::not_found(format!(
            "template '{template}' not found"
        ))),
        _ => Ok(()),
    }
}

/// The team owning `template` (`None`: shared, or unknown).
fn owner(s: &AppState, template: &str) -> Result<Option<String>, ApiError> {
    let db = s.manager.db();
    let name = template.split(':').next().unwrap_or(template);
    match db.get_snapshot(template).map_err(db_err)? {
        Some(row) => db.snapshot_team(&row).map_err(db_err),
        None => db.template_team(name).map_err(db_err),
    }
}

/// [`check_visible`], and 403 if `template` exists and is shared but
/// `team` is not the default one: shared templates (built with the CLI,
/// such as `base`, or before teams) are the operator's, whose keys are
/// the default team's; no other team deletes, re-tags or builds over them.
pub(super) fn check_owned(s: &AppState, team: &str, template: &str) -> Result<(), ApiError> {
    check_visible(s, team, template)?;
    if team == crate::db::DEFAULT_TEAM {
        return Ok(());
    }
    let name = template.split(':').next().unwrap_or(template);
    let exists = s.manager.templates().exists(name)
        || s.manager
            .db()
            .get_snapshot(template)
            .map_err(db_err)?
            .is_some();
    if owner(s, template)?.is_none() && exists {
        return Err(ApiError::new(
            StatusCode::FORBIDDEN,
            format!("template '{template}' is shared: only the default team changes it"),
        ));
    }
    Ok(())
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestBody {
    name: Option<String>,
    alias: Option<String>,
    #[serde(default)]
    tags: Vec<String>,
    cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    memory_mb: Option<u32>,
}

/// `POST /v3/templates`: register a build (`Template.build` first).
pub async fn request_build(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    JsonBody(b): JsonBody<RequestBody>,
) -> Result<Response, ApiError> {
    let name = b
        .name
        .or(b.alias)
        .ok_or_else(|| ApiError::bad_request("name is required"))?;
    let machine = crate::sandboxes::limits::machine(&s.manager.config, b.cpu_count, b.memory_mb)?;
    // Template names are one namespace: another team's name, or a shared
    // template's, is taken.
    if check_owned(&s, &key.team, &name).is_err() {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            format!("template name '{name}' is not available"),
        ));
    }
    let build = s.builds.request(&name, b.tags, machine)?;
    s.builds
        .db()
        .set_build_team(&build.id, &key.team)
        .map_err(db_err)?;
    let body = serde_json::json!({
        "templateID": build.template,
        "buildID": build.id,
        "public": false,
        "names": [build.template],
        "aliases": [build.template],
        "tags": build.tags,
    });
    Ok((StatusCode::ACCEPTED, Json(body)).into_response())
}

/// `GET /templates/{id}/files/{hash}`: whether the server has the files
/// of a `COPY`, and if not where to upload them.
pub async fn file_link(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Path((template, hash)): Path<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    check_visible(&s, &key.team, &template)?;
    if !crate::builds::steps::valid_hash(&hash) {
        return Err(ApiError::bad_request(format!(
            "files hash {hash:?} is not a sha256 hex digest"
        )));
    }
    if !s.builds.known(&template)? && !s.manager.templates().exists(&template) {
        return Err(ApiError::not_found(format!(
            "template {template} not found"
        )));
    }
    // The team's own files only: another team's upload under the same
    // (public) hash is never this team's.
    let present = s.builds.files().digest(&key.team, &hash).is_some();
    let mut body = serde_json::json!({ "present": present });
    if !present {
        let host = headers
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .ok_or_else(|| ApiError::bad_request("a Host header is required"))?;
        body["url"] = format!(
            "http://{host}{}",
            s.builds
                .files()
                .upload_path(&key.team, &hash, UPLOAD_URL_TTL)
        )
        .into();
    }
    Ok((StatusCode::CREATED, Json(body)).into_response())
}

#[derive(Deserialize)]
pub struct UploadQuery {
    team: Option<String>,
    expires: Option<u64>,
    signature: Option<String>,
}

/// `PUT /build-files/{hash}?team=…&expires=…&signature=…`: the upload URL
/// of `file_link` (signed for one team, so it needs no API key).
pub async fn upload(
    State(s): State<Arc<AppState>>,
    Path(hash): Path<String>,
    Query(q): Query<UploadQuery>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    use crate::builds::files::FilesError;
    let files = s.builds.files();
    let (Some(team), Some(expires), Some(sig)) = (q.team, q.expires, q.signature) else {
        return Err(ApiError::unauthorized("upload URL is not signed"));
    };
    let status = |e: &FilesError| match e {
        FilesError::BadSignature => StatusCode::UNAUTHORIZED,
        FilesError::BadHash(_) | FilesError::NotTar(_) | FilesError::Body(_) => {
            StatusCode::BAD_REQUEST
        }
        FilesError::TooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        FilesError::Io(_) => StatusCode::INTERNAL_SERVER_ERROR,
    };
    let result = async {
        files.verify(&team, &hash, expires, &sig)?;
        files.receive(&team, &hash, body.into_data_stream()).await
    }
    .await;
    match result {
        Ok(digest) => {
            tracing::info!(%team, files_hash = %hash, %digest, "build context uploaded");
            Ok(StatusCode::OK.into_response())
        }
        Err(e) => Err(ApiError::new(status(&e), e.to_string())),
    }
}

/// `POST /v2/templates/{id}/builds/{buildID}`: start the build.
pub async fn start_build(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Path((template, build_id)): Path<(String, String)>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    check_owned(&s, &key.team, &template)?;
    let req: StartRequest = json_body(body, 4 * s.manager.config.max_body_bytes).await?;
    if let Some(from) = &req.from_template {
        // Another team's template is as unknown as a missing one.
        check_visible(&s, &key.team, from).map_err(|_| {
            ApiError::bad_request(format!("fromTemplate: template {from:?} not found"))
        })?;
    }
    s.builds.start(&template, &build_id, &key.team, req)?;
    Ok(StatusCode::ACCEPTED.into_response())
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusQuery {
    logs_offset: Option<usize>,
    limit: Option<usize>,
}

/// `GET /templates/{id}/builds/{buildID}/status`: the build's status and
/// its log from `logsOffset` on.
pub async fn build_status(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Path((template, build_id)): Path<(String, String)>,
    Query(q): Query<StatusQuery>,
) -> Result<Response, ApiError> {
    check_visible(&s, &key.team, &template)?;
    let build = s.builds.get(&template, &build_id)?;
    let entries = s.builds.logs(
        &build_id,
        q.logs_offset.unwrap_or(0),
        q.limit.unwrap_or(100).clamp(1, 1000),
    );
    let log_entries: Vec<_> = entries
        .iter()
        .map(|e| serde_json::json!({ "timestamp": e.timestamp, "level": e.level.as_str(), "message": e.message }))
        .collect();
    let logs: Vec<_> = entries.iter().map(|e| e.message.clone()).collect();
    let mut body = serde_json::json!({
        "templateID": build.template,
        "buildID": build.id,
        "status": build.status.as_str(),
        "logs": logs,
        "logEntries": log_entries,
    });
    if let Some(message) = &build.reason {
        body["reason"] = serde_json::json!({ "message": message, "step": build.reason_step });
    }
    Ok(Json(body).into_response())
}

/// `GET /templates/aliases/{alias}`: `Template.exists`.
pub async fn alias(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Path(alias): Path<String>,
) -> Result<Response, ApiError> {
    check_visible(&s, &key.team, &alias)?;
    if !s.manager.templates().exists(&alias) {
        return Err(ApiError::not_found(format!("template {alias} not found")));
    }
    Ok(Json(serde_json::json!({ "templateID": alias, "public": false })).into_response())
}

fn build_out(b: &BuildRow) -> serde_json::Value {
    serde_json::json!({
        "buildID": b.id,
        "status": b.status.as_str(),
        "createdAt": rfc3339(b.created_ms),
        "updatedAt": rfc3339(b.finished_ms.unwrap_or(b.created_ms)),
        "finishedAt": b.finished_ms.map(rfc3339),
        "cpuCount": b.cpu_count,
        "memoryMB": b.memory_mb,
    })
}

#[derive(Deserialize)]
pub struct RecentQuery {
    limit: Option<usize>,
}

/// `GET /builds?limit=` (tine's own route; the console's build list):
/// the team's newest builds of every template, failed ones included.
pub async fn recent_builds(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Query(q): Query<RecentQuery>,
) -> Result<Response, ApiError> {
    let limit = q.limit.unwrap_or(50).clamp(1, 500);
    let builds = s
        .builds
        .db()
        .recent_builds(&key.team, limit)
        .map_err(db_err)?;
    let out: Vec<_> = builds
        .iter()
        .map(|b| {
            let mut v = build_out(b);
            v["templateID"] = b.template.clone().into();
            v["reason"] = b.reason.clone().into();
            v["reasonStep"] = b.reason_step.clone().into();
            v
        })
        .collect();
    Ok(Json(out).into_response())
}

/// `GET /templates/{id}`: a template and its builds.
pub async fn get_template(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Path(template): Path<String>,
) -> Result<Response, ApiError> {
    check_visible(&s, &key.team, &template)?;
    let builds = s.builds.db().list_builds(&template).map_err(db_err)?;
    let exists = s.manager.templates().exists(&template);
    if builds.is_empty() && !exists {
        return Err(ApiError::not_found(format!(
            "template {template} not found"
        )));
    }
    let created = builds.last().map_or(0, |b| b.created_ms);
    Ok(Json(serde_json::json!({
        "templateID": template,
        "public": false,
        "aliases": [template],
        "names": [template],
        "createdAt": rfc3339(created),
        "updatedAt": rfc3339(builds.first().map_or(created, |b| b.finished_ms.unwrap_or(b.created_ms))),
        "lastSpawnedAt": null,
        "spawnCount": 0,
        "builds": builds.iter().map(build_out).collect::<Vec<_>>(),
    }))
    .into_response())
}

#[derive(Deserialize)]
pub struct AssignTags {
    target: String,
    tags: Vec<String>,
}

/// `POST /templates/tags`: point tags of a template at the build `target`
/// (`name` or `name:tag`) names.
pub async fn assign_tags(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    JsonBody(b): JsonBody<AssignTags>,
) -> Result<Response, ApiError> {
    let name = b.target.split(':').next().unwrap_or_default().to_string();
    check_owned(&s, &key.team, &name)?;
    let row = s
        .manager
        .templates()
        .find(&b.target)
        .map_err(crate::sandboxes::SandboxError::from)?
        .ok_or_else(|| ApiError::not_found(format!("template {} not found", b.target)))?;
    if b.tags.is_empty() {
        return Err(ApiError::bad_request("tags must not be empty"));
    }
    let build_id = s.builds.db().build_of_snapshot(&row.id).map_err(db_err)?;
    for tag in &b.tags {
        if !crate::builds::valid_tag(tag) {
            return Err(ApiError::bad_request(format!("invalid tag {tag:?}")));
        }
    }
    for tag in &b.tags {
        s.builds
            .db()
            .set_tag(&name, tag, &row.id, &build_id)
            .map_err(db_err)?;
    }
    Ok((
        StatusCode::CREATED,
        Json(serde_json::json!({ "tags": b.tags, "buildID": build_id })),
    )
        .into_response())
}

#[derive(Deserialize)]
pub struct RemoveTags {
    name: String,
    tags: Vec<String>,
}

/// `DELETE /templates/tags`.
pub async fn remove_tags(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    JsonBody(b): JsonBody<RemoveTags>,
) -> Result<Response, ApiError> {
    let name = b.name.split(':').next().unwrap_or_default();
    check_owned(&s, &key.team, name)?;
    for tag in &b.tags {
        if !s.builds.db().delete_tag(name, tag).map_err(db_err)? {
            return Err(ApiError::not_found(format!(
                "template {name} has no tag {tag}"
            )));
        }
    }
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `GET /templates/{id}/tags`.
pub async fn list_tags(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Path(template): Path<String>,
) -> Result<Response, ApiError> {
    check_visible(&s, &key.team, &template)?;
    let name = template.split(':').next().unwrap_or_default();
    let tags = s.builds.db().tags(name).map_err(db_err)?;
    if tags.is_empty() && !s.manager.templates().exists(name) {
        return Err(ApiError::not_found(format!("template {name} not found")));
    }
    let out: Vec<_> = tags
        .into_iter()
        .map(|(tag, _, build, at)| {
            serde_json::json!({ "tag": tag, "buildID": build, "createdAt": rfc3339(at) })
        })
        .collect();
    Ok(Json(out).into_response())
}

/// `GET /templates`: one entry per template name.
pub async fn list_templates(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
) -> Result<Response, ApiError> {
    let db = s.manager.db();
    let rows = db
        .list_templates()
        .map_err(crate::sandboxes::SandboxError::from)?;
    let mut out: Vec<serde_json::Value> = Vec::new();
    for r in rows {
        if db
            .snapshot_team(&r)
            .ok()
            .flatten()
            .is_some_and(|t| t != key.team)
        {
            continue;
        }
        let name = r.names.first().cloned().unwrap_or_default();
        out.push(serde_json::json!({
            "templateID": name,
            "buildID": r.id,
            "aliases": [name],
            "cpuCount": r.cpu_count,
            "memoryMB": r.memory_mb,
            "public": false,
            "createdAt": rfc3339(r.created_ms),
            "updatedAt": rfc3339(r.created_ms),
            "buildStatus": "ready",
            "envdVersion": crate::sandboxes::ENVD_VERSION,
        }));
    }
    Ok(Json(out).into_response())
}

/// `DELETE /templates/{id}`: the SDK's `delete_snapshot`.
pub async fn delete_snapshot(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    check_owned(&s, &key.team, &id)?;
    // A template's builds go with it; one that is running must end first.
    s.builds.check_not_building(&id)?;
    match s.manager.delete_snapshot(&id) {
        Ok(()) => {
            s.builds.forget(&id)?;
            if let Some(c) = &s.captures {
                c.forget(&id).await;
            }
        }
        // Registered (`POST /v3/templates`) but never built: only builds.
        Err(crate::sandboxes::SandboxError::NotFound(what)) => {
            if s.builds.forget(&id)? == 0 {
                return Err(crate::sandboxes::SandboxError::NotFound(what).into());
            }
        }
        Err(e) => return Err(e.into()),
    }
    Ok(StatusCode::NO_CONTENT)
}

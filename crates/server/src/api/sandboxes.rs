//! E2B REST routes for sandboxes (the E2B REST API; see docs/api.md). Handlers parse
//! and shape JSON; the work is in [`crate::sandboxes::Manager`].

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use http::{HeaderMap, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};

use super::{json_body, ApiError, Authed};
use crate::db::ListFilter;
use crate::model::{SandboxRecord, SandboxState};
use crate::sandboxes::CreateRequest;
use crate::state::AppState;

pub(super) fn rfc3339(ms: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000)
        .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap_or_default()
}

/// `Sandbox`: what create (and connect) return.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SandboxOut {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    client_id: String,
    alias: Option<String>,
    envd_version: String,
    envd_access_token: String,
    traffic_access_token: Option<String>,
    domain: String,
}

/// `SandboxDetail` / `ListedSandbox`.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct DetailOut {
    #[serde(rename = "templateID")]
    template_id: String,
    alias: Option<String>,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    client_id: String,
    started_at: String,
    end_at: String,
    envd_version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    envd_access_token: Option<String>,
    cpu_count: u32,
    #[serde(rename = "memoryMB")]
    memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    disk_size_mb: u32,
    metadata: BTreeMap<String, String>,
    state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    domain: Option<String>,
    allow_internet_access: bool,
    network: crate::network::NetworkPolicy,
    lifecycle: LifecycleOut,
}

/// `SandboxLifecycle` of a detail.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct LifecycleOut {
    on_timeout: &'static str,
    auto_resume: bool,
}

fn detail(r: SandboxRecord, with_secrets: Option<&str>) -> DetailOut {
    DetailOut {
        template_id: r.template_id,
        alias: r.alias,
        sandbox_id: r.id,
        client_id: r.client_id,
        started_at: rfc3339(r.started_at_ms),
        end_at: rfc3339(r.end_at_ms),
        envd_version: r.envd_version,
        envd_access_token: with_secrets.map(|_| r.envd_access_token),
        cpu_count: r.cpu_count,
        memory_mb: r.memory_mb,
        disk_size_mb: r.disk_size_mb,
        metadata: r.metadata,
        state: r.state.e2b().unwrap_or("running"),
        domain: with_secrets.map(str::to_string),
        allow_internet_access: !r
            .network
            .deny_out
            .iter()
            .flatten()
            .any(|d| d == crate::network::policy::ALL_TRAFFIC),
        network: r.network,
        lifecycle: LifecycleOut {
            on_timeout: if r.auto_pause { "pause" } else { "kill" },
            auto_resume: r.lifecycle.auto_resume,
        },
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<i64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    auto_pause: Option<bool>,
    /// False: the pause at timeout keeps only the disk.
    auto_pause_memory: Option<bool>,
    auto_resume: Option<AutoResume>,
    cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    memory_mb: Option<u32>,
    /// The SDKs send this one in snake_case.
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    network: Option<serde_json::Value>,
    /// Features tine does not have: refused rather than ignored, so a
    /// sandbox never starts without what it was asked to have.
    volume_mounts: Option<serde_json::Value>,
    mcp: Option<serde_json::Value>,
    iam: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct AutoResume {
    #[serde(default)]
    enabled: bool,
}

/// `null`, `{}` or `[]`: what an SDK sends for an unset option.
fn is_empty_json(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Null => true,
        serde_json::Value::Object(m) => m.is_empty(),
        serde_json::Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

/// The lifecycle a create asks for.
fn lifecycle_of(req: &NewSandbox) -> Result<crate::model::Lifecycle, ApiError> {
    let l = crate::model::Lifecycle {
        auto_resume: req.auto_resume.as_ref().is_some_and(|a| a.enabled),
        auto_pause_disk_only: req.auto_pause_memory == Some(false),
        paused_disk_only: false,
    };
    if l.auto_resume && l.auto_pause_disk_only {
        return Err(ApiError::bad_request(
            "autoResume cannot be combined with autoPauseMemory: false: a sandbox paused \
             without its memory must be resumed explicitly (connect)",
        ));
    }
    Ok(l)
}

/// `POST /v2/sandboxes` (and v1): with an `Idempotency-Key`, a retry gets
/// the sandbox the first attempt made.
pub async fn create(
    Authed(api_key): Authed,
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let bytes = super::body_bytes(body, s.manager.config.max_body_bytes).await?;
    let attempt = || async {
        let rec = create_sandbox(&s, &bytes).await?;
        let out = serde_json::to_value(sandbox_out(rec, &s.domain))
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        Ok((StatusCode::CREATED, out))
    };
    let (status, out) = match super::idempotency::key_of(&headers)? {
        Some(key) => {
            s.idempotency
                .run(&api_key.id, &key, &bytes, attempt)
                .await?
        }
        None => attempt().await?,
    };
    Ok((status, Json(out)).into_response())
}

async fn create_sandbox(s: &AppState, body: &[u8]) -> Result<SandboxRecord, ApiError> {
    let req: NewSandbox = super::parse_json(body)?;
    for (field, value, why) in [
        ("volumeMounts", &req.volume_mounts, "tine has no volumes"),
        ("mcp", &req.mcp, "tine has no MCP gateway"),
        ("iam", &req.iam, "tine has no secrets or header transforms"),
    ] {
        if value.as_ref().is_some_and(|v| !is_empty_json(v)) {
            return Err(ApiError::bad_request(format!(
                "{field} is not supported: {why}"
            )));
        }
    }
    let lifecycle = lifecycle_of(&req)?;
    let network = super::network::from_create(req.network, req.allow_internet_access)?;
    Ok(s.manager
        .create(CreateRequest {
            template_id: req
                .template_id
                .unwrap_or_else(|| crate::templates::DEFAULT_TEMPLATE.into()),
            timeout_secs: req.timeout,
            metadata: req.metadata.unwrap_or_default(),
            env_vars: req.env_vars.unwrap_or_default(),
            auto_pause: req.auto_pause.unwrap_or(false),
            lifecycle,
            cpu_count: req.cpu_count,
            memory_mb: req.memory_mb,
            network,
        })
        .await?)
}

fn sandbox_out(rec: SandboxRecord, domain: &str) -> SandboxOut {
    SandboxOut {
        template_id: rec.template_id,
        sandbox_id: rec.id,
        client_id: rec.client_id,
        alias: rec.alias,
        envd_version: rec.envd_version,
        envd_access_token: rec.envd_access_token,
        traffic_access_token: rec.traffic_token,
        domain: domain.to_string(),
    }
}

pub async fn get_one(
    _: Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let rec = s.manager.get(&id)?;
    Ok(Json(detail(rec, Some(&s.domain))).into_response())
}

pub async fn kill(
    _: Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    s.manager.kill(&id, "killed through the API").await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct TimeoutBody {
    timeout: i64,
}

pub async fn set_timeout(
    _: Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: axum::body::Body,
) -> Result<StatusCode, ApiError> {
    let b: TimeoutBody = json_body(body, s.manager.config.max_body_bytes).await?;
    s.manager.set_timeout(&id, b.timeout)?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct RefreshBody {
    duration: Option<i64>,
}

/// Extends the time to live by `duration` seconds (default 60) from now.
pub async fn refresh(
    _: Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: axum::body::Body,
) -> Result<StatusCode, ApiError> {
    let b: RefreshBody = json_body(body, s.manager.config.max_body_bytes).await?;
    let d = b.duration.unwrap_or(60);
    if !(0..=3600).contains(&d) {
        return Err(ApiError::bad_request(
            "duration must be between 0 and 3600 seconds",
        ));
    }
    s.manager.set_timeout(&id, d)?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
pub struct MetricsQuery {
    /// Unix seconds.
    start: Option<i64>,
    end: Option<i64>,
}

/// SDKs before 2.12 send milliseconds: no time in seconds is that large
/// (1e11 s is in the year 5138).
fn unix_seconds(t: i64) -> i64 {
    if t.abs() >= 100_000_000_000 {
        t / 1000
    } else {
        t
    }
}

/// `GET /sandboxes/{id}/metrics?start=&end=`: the samples in that range.
pub async fn metrics(
    _: Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    q: Result<Query<MetricsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) =
        q.map_err(|e| ApiError::bad_request(format!("start and end are Unix seconds: {e}")))?;
    let q = MetricsQuery {
        start: q.start.map(unix_seconds),
        end: q.end.map(unix_seconds),
    };
    if let (Some(a), Some(b)) = (q.start, q.end) {
        if a > b {
            return Err(ApiError::bad_request("start is after end"));
        }
    }
    let m = s.manager.metrics(&id, q.start, q.end).await?;
    Ok(Json(m).into_response())
}

#[derive(Deserialize)]
pub struct LogsQuery {
    start: Option<i64>,
    limit: Option<usize>,
}

pub async fn logs(
    _: Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(q): Query<LogsQuery>,
) -> Result<Response, ApiError> {
    let text = s.manager.console_log(&id)?;
    let rec = s.manager.get(&id)?;
    let ts = rfc3339(rec.started_at_ms);
    let limit = q.limit.unwrap_or(1000);
    let lines: Vec<&str> = text
        .lines()
        .skip(q.start.unwrap_or(0).max(0) as usize)
        .take(limit)
        .collect();
    let logs: Vec<_> = lines
        .iter()
        .map(|l| serde_json::json!({ "timestamp": ts, "line": l }))
        .collect();
    let entries: Vec<_> = lines
        .iter()
        .map(
            |l| serde_json::json!({ "timestamp": ts, "level": "info", "message": l, "fields": {} }),
        )
        .collect();
    Ok(Json(serde_json::json!({ "logs": logs, "logEntries": entries })).into_response())
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ListQuery {
    metadata: Option<String>,
    state: Option<String>,
    template: Option<String>,
    started_after: Option<String>,
    started_before: Option<String>,
    order: Option<String>,
    limit: Option<usize>,
    next_token: Option<String>,
}

const MAX_PAGE: usize = 1000;

fn parse_filter(q: &ListQuery, default_states: &[SandboxState]) -> Result<ListFilter, ApiError> {
    let mut f = ListFilter {
        limit: q.limit.unwrap_or(100).clamp(1, MAX_PAGE),
        ..Default::default()
    };
    f.states = match q.state.as_deref().filter(|s| !s.is_empty()) {
        None => default_states.to_vec(),
        Some(list) => list
            .split(',')
            .map(|s| match s.trim() {
                "running" => Ok(SandboxState::Running),
                "paused" => Ok(SandboxState::Paused),
                other => Err(ApiError::bad_request(format!(
                    "unknown state {other:?} (running, paused)"
                ))),
            })
            .collect::<Result<_, _>>()?,
    };
    if let Some(m) = q.metadata.as_deref().filter(|m| !m.is_empty()) {
        // The SDKs percent-encode each key and value, join them as a query
        // string (encoding them again) and send that as one parameter (a
        // third time). Axum undid the last, this undoes the other two.
        let pairs: Vec<(String, String)> = serde_urlencoded::from_str(m)
            .map_err(|e| ApiError::bad_request(format!("bad metadata filter: {e}")))?;
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .map(|c| c.into_owned())
                .map_err(|_| ApiError::bad_request("metadata filter is not UTF-8"))
        };
        for (k, v) in pairs {
            f.metadata.insert(decode(&k)?, decode(&v)?);
        }
    }
    f.template = q.template.clone().filter(|t| !t.is_empty());
    f.started_after_ms = parse_time("startedAfter", q.started_after.as_deref())?;
    f.started_before_ms = parse_time("startedBefore", q.started_before.as_deref())?;
    // Newest first unless asked otherwise, as E2B lists.
    f.descending = match q.order.as_deref() {
        Some("asc") => false,
        None | Some("") | Some("desc") => true,
        Some(o) => {
            return Err(ApiError::bad_request(format!(
                "order must be asc or desc, got {o:?}"
            )))
        }
    };
    if let Some(tok) = q.next_token.as_deref().filter(|t| !t.is_empty()) {
        f.after =
            Some(decode_token(tok).ok_or_else(|| ApiError::bad_request("invalid nextToken"))?);
    }
    Ok(f)
}

/// An RFC 3339 time in a query, as Unix milliseconds.
fn parse_time(name: &str, value: Option<&str>) -> Result<Option<i64>, ApiError> {
    let Some(t) = value.filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    let at = time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
        .map_err(|_| ApiError::bad_request(format!("{name} must be RFC 3339, got {t:?}")))?;
    Ok(Some((at.unix_timestamp_nanos() / 1_000_000) as i64))
}

fn encode_token(r: &SandboxRecord) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("{}:{}", r.started_at_ms, r.id))
}

fn decode_token(t: &str) -> Option<(i64, String)> {
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(t)
        .ok()?;
    let s = String::from_utf8(raw).ok()?;
    let (ms, id) = s.split_once(':')?;
    Some((ms.parse().ok()?, id.to_string()))
}

async fn list(s: &AppState, q: ListQuery, paged: bool) -> Result<Response, ApiError> {
    let defaults = [SandboxState::Running, SandboxState::Paused];
    let mut f = parse_filter(&q, if paged { &defaults } else { &defaults[..1] })?;
    let page = f.limit;
    if paged {
        f.limit = page + 1; // one more tells whether there is a next page
    } else {
        f.limit = usize::MAX >> 1;
    }
    let mut rows = s.manager.list(&f)?;
    let mut headers = HeaderMap::new();
    if paged && rows.len() > page {
        rows.truncate(page);
        if let Some(last) = rows.last() {
            headers.insert(
                "x-next-token",
                HeaderValue::from_str(&encode_token(last)).expect("base64 is a valid header"),
            );
        }
    }
    let out: Vec<DetailOut> = rows.into_iter().map(|r| detail(r, None)).collect();
    Ok((headers, Json(out)).into_response())
}

pub async fn list_v2(
    _: Authed,
    State(s): State<Arc<AppState>>,
    Query(q): Query<ListQuery>,
) -> Result<Response, ApiError> {
    list(&s, q, true).await
}

pub async fn list_v1(
    _: Authed,
    State(s): State<Arc<AppState>>,
    Query(q): Query<ListQuery>,
) -> Result<Response, ApiError> {
    list(&s, q, false).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paging_tokens_round_trip_and_reject_garbage() {
        let mut r = test_record();
        r.started_at_ms = 1234;
        r.id = "iabc".into();
        assert_eq!(decode_token(&encode_token(&r)), Some((1234, "iabc".into())));
        assert_eq!(decode_token("!!!"), None);
        assert_eq!(decode_token("bm90aGluZw"), None); // "nothing": no colon
    }

    #[test]
    fn metadata_filter_is_decoded_once_more() {
        // What arrives after the query string's own decoding, for
        // metadata {"k y/é": "a&b=c %", "env": "prod"} (seen on the wire).
        let q = ListQuery {
            metadata: Some("k%2520y%2F%25C3%25A9=a%2526b%253Dc%2520%2525&env=prod".into()),
            ..Default::default()
        };
        let f = parse_filter(&q, &[SandboxState::Running]).unwrap();
        assert_eq!(f.metadata.get("k y/é").map(String::as_str), Some("a&b=c %"));
        assert_eq!(f.metadata.get("env").map(String::as_str), Some("prod"));
        let bad = ListQuery {
            state: Some("running,zombie".into()),
            ..Default::default()
        };
        assert!(parse_filter(&bad, &[]).is_err());
    }

    #[test]
    fn snapshot_names_match_with_or_without_their_tag() {
        let names = vec!["snap:v1".to_string(), "other".to_string()];
        assert!(has_name(&names, "snap"));
        assert!(has_name(&names, "snap:v1"));
        assert!(!has_name(&names, "snap:v2"));
        assert!(has_name(&names, "other"));
        assert!(!has_name(&names, "sna"));
    }

    #[test]
    fn lists_are_newest_first_and_bounded_in_time() {
        let q = ListQuery {
            started_before: Some("2026-12-03T10:00:00Z".into()),
            ..Default::default()
        };
        let f = parse_filter(&q, &[]).unwrap();
        assert!(f.descending);
        assert_eq!(f.started_before_ms, Some(1_796_292_000_000));
        let asc = ListQuery {
            order: Some("asc".into()),
            started_after: Some("yesterday".into()),
            ..Default::default()
        };
        assert!(parse_filter(&asc, &[]).is_err());
    }

    fn test_record() -> SandboxRecord {
        SandboxRecord {
            id: String::new(),
            template_id: "base".into(),
            alias: None,
            client_id: "tine".into(),
            state: SandboxState::Running,
            metadata: BTreeMap::new(),
            env_vars: BTreeMap::new(),
            cpu_count: 1,
            memory_mb: 256,
            disk_size_mb: 0,
            envd_version: crate::sandboxes::ENVD_VERSION.into(),
            envd_access_token: "t".into(),
            started_at_ms: 0,
            end_at_ms: 0,
            auto_pause: false,
            error: None,
            network: Default::default(),
            traffic_token: None,
            lifecycle: Default::default(),
        }
    }
}

/// `{memory?, requireHealthyGuest?}`: `memory: false` keeps only the
/// disk; either that or `requireHealthyGuest` refuses the pause (503, the
/// sandbox keeps running) while the agent does not answer.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PauseBody {
    memory: Option<bool>,
    require_healthy_guest: Option<bool>,
}

pub async fn pause(
    _: Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: axum::body::Body,
) -> Result<StatusCode, ApiError> {
    let b: PauseBody = json_body(body, s.manager.config.max_body_bytes).await?;
    s.manager
        .pause_with(
            &id,
            b.memory.unwrap_or(true),
            b.require_healthy_guest.unwrap_or(false),
        )
        .await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct ConnectBody {
    timeout: Option<i64>,
    /// False (`on_resume="reboot"`): cold-boot a paused sandbox from its
    /// disk instead of restoring its memory.
    memory: Option<bool>,
}

/// `connect` / `resume`: 200 when it was running, 201 when it was resumed.
pub async fn connect(
    _: Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let b: ConnectBody = json_body(body, s.manager.config.max_body_bytes).await?;
    let (rec, resumed) = s
        .manager
        .connect(&id, b.timeout, b.memory.unwrap_or(true))
        .await?;
    let status = if resumed {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(sandbox_out(rec, &s.domain))).into_response())
}

#[derive(Deserialize)]
struct SnapshotBody {
    name: Option<String>,
    /// False asks for a filesystem-only snapshot, which tine does not make.
    memory: Option<bool>,
}

pub async fn create_snapshot(
    _: Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let b: SnapshotBody = json_body(body, s.manager.config.max_body_bytes).await?;
    if b.memory == Some(false) {
        return Err(ApiError::bad_request(
            "filesystem-only snapshots (memory: false) are not supported: a snapshot holds memory too; \
             pause with memory: false keeps only the disk",
        ));
    }
    let row = s.manager.snapshot(&id, b.name).await?;
    Ok((
        StatusCode::CREATED,
        Json(serde_json::json!({ "snapshotID": row.id, "names": row.names })),
    )
        .into_response())
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotsQuery {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
    /// Only snapshots with this name (with or without its `:tag`).
    name: Option<String>,
    limit: Option<usize>,
    next_token: Option<String>,
}

/// Whether one of a snapshot's names is `wanted` (`name` also matches
/// `name:tag`).
fn has_name(names: &[String], wanted: &str) -> bool {
    names.iter().any(|n| {
        n == wanted
            || (!wanted.contains(':') && n.split_once(':').is_some_and(|(base, _)| base == wanted))
    })
}

pub async fn list_snapshots(
    _: Authed,
    State(s): State<Arc<AppState>>,
    Query(q): Query<SnapshotsQuery>,
) -> Result<Response, ApiError> {
    let mut rows = s
        .manager
        .list_snapshots(q.sandbox_id.as_deref().filter(|x| !x.is_empty()))?;
    if let Some(name) = q.name.as_deref().filter(|n| !n.is_empty()) {
        rows.retain(|r| has_name(&r.names, name));
    }
    let skip = match q.next_token.as_deref().filter(|t| !t.is_empty()) {
        Some(t) => t
            .parse::<usize>()
            .map_err(|_| ApiError::bad_request("invalid nextToken"))?,
        None => 0,
    };
    let limit = q.limit.unwrap_or(100).clamp(1, MAX_PAGE);
    let page: Vec<_> = rows
        .iter()
        .skip(skip)
        .take(limit)
        .map(|r| serde_json::json!({ "snapshotID": r.id, "names": r.names }))
        .collect();
    let mut headers = HeaderMap::new();
    if skip + limit < rows.len() {
        headers.insert(
            "x-next-token",
            HeaderValue::from_str(&(skip + limit).to_string()).expect("digits"),
        );
    }
    Ok((headers, Json(page)).into_response())
}

/// `DELETE /templates/{id}`: the SDK's `delete_snapshot`.
pub async fn delete_snapshot(
    _: Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    s.manager.delete_snapshot(&id)?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
struct ForkBody {
    timeout: Option<i64>,
    count: Option<i64>,
}

pub async fn fork(
    _: Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let b: ForkBody = json_body(body, s.manager.config.max_body_bytes).await?;
    let results = s.manager.fork(&id, b.count.unwrap_or(1), b.timeout).await?;
    let out: Vec<serde_json::Value> = results
        .into_iter()
        .map(|r| match r {
            Ok(rec) => serde_json::json!({ "sandbox": sandbox_out(rec, &s.domain) }),
            Err(e) => {
                let e = ApiError::from(e);
                serde_json::json!({ "error": { "code": e.status.as_u16(), "message": e.message } })
            }
        })
        .collect();
    Ok((StatusCode::CREATED, Json(out)).into_response())
}

/// `GET /templates`: one entry per template name.
pub async fn list_templates(
    _: Authed,
    State(s): State<Arc<AppState>>,
) -> Result<Response, ApiError> {
    let rows = s
        .manager
        .db()
        .list_templates()
        .map_err(crate::sandboxes::SandboxError::from)?;
    let mut out: Vec<serde_json::Value> = Vec::new();
    for r in rows {
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

//! Metrics, logs and lifecycle events of a sandbox.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;

use super::super::extract::Query;
use super::super::{ApiError, Owned};
use super::rfc3339;
use crate::state::AppState;

#[derive(Deserialize)]
pub struct MetricsQuery {
    /// Unix seconds.
    start: Option<i64>,
    end: Option<i64>,
}

/// SDKs before 2.12 send milliseconds: no time in seconds is that large
/// (1e11 s is in the year 5138).
fn unix_seconds(t: i64) -> i64 {
    // (`unsigned_abs`: `abs` of i64::MIN overflows.)
    if t.unsigned_abs() >= 100_000_000_000 {
        t / 1000
    } else {
        t
    }
}

/// `GET /sandboxes/{id}/metrics?start=&end=`: the samples in that range.
pub async fn metrics(
    Owned { id, .. }: Owned,
    State(s): State<Arc<AppState>>,
    q: Result<Query<MetricsQuery>, ApiError>,
) -> Result<Response, ApiError> {
    let Query(q) = q.map_err(|e| {
        ApiError::bad_request(format!("start and end are Unix seconds: {}", e.message))
    })?;
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
    Owned { id, .. }: Owned,
    State(s): State<Arc<AppState>>,
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

/// `GET /sandboxes/{id}/events` (tine's own route; the console reads it):
/// the sandbox's lifecycle as recorded, oldest first.
pub async fn events(
    Owned { id, .. }: Owned,
    State(s): State<Arc<AppState>>,
) -> Result<Response, ApiError> {
    let events = s
        .manager
        .db()
        .events(&id)
        .map_err(crate::sandboxes::SandboxError::from)?;
    let out: Vec<_> = events
        .into_iter()
        .map(|e| serde_json::json!({ "timestamp": rfc3339(e.at_ms), "kind": e.kind, "detail": e.detail }))
        .collect();
    Ok(Json(out).into_response())
}

//! Pause, connect (resume), snapshots and fork.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::StatusCode;
use serde::Deserialize;

use super::super::extract::Path;
use super::super::{ApiError, Authed, JsonBody, Owned};
use super::sandbox_out;
use crate::state::AppState;

/// `{memory?, requireHealthyGuest?}`: `memory: false` keeps only the
/// disk; either that or `requireHealthyGuest` refuses the pause (503, the
/// sandbox keeps running) while the agent does not answer.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PauseBody {
    memory: Option<bool>,
    require_healthy_guest: Option<bool>,
}

pub async fn pause(
    Owned { id, .. }: Owned,
    State(s): State<Arc<AppState>>,
    JsonBody(b): JsonBody<PauseBody>,
) -> Result<StatusCode, ApiError> {
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
pub struct ConnectBody {
    timeout: Option<i64>,
    /// False (`on_resume="reboot"`): cold-boot a paused sandbox from its
    /// disk instead of restoring its memory.
    memory: Option<bool>,
}

/// `connect` / `resume`: 200 when it was running, 201 when it was resumed.
///
/// On a cluster node, a gateway that could not resume a paused sandbox on
/// its own node (down, or full) sends the connect here with
/// [`crate::cluster::ADOPT_HEADER`]: the sandbox is adopted from the
/// capture its node pushed, then resumed as any.
pub async fn connect(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: http::HeaderMap,
    JsonBody(b): JsonBody<ConnectBody>,
) -> Result<Response, ApiError> {
    if let Some(c) = s
        .captures
        .as_ref()
        .filter(|_| headers.contains_key(crate::cluster::ADOPT_HEADER))
    {
        c.adopt(s.manager.db(), &key.team, &id)
            .await
            .map_err(|e| ApiError::new(StatusCode::BAD_GATEWAY, e.to_string()))?;
    }
    let Owned { id, .. } = Owned::check(&s, key, id)?;
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
pub struct SnapshotBody {
    name: Option<String>,
    /// False asks for a filesystem-only snapshot, which tine does not make.
    memory: Option<bool>,
}

pub async fn create_snapshot(
    Owned { id, .. }: Owned,
    State(s): State<Arc<AppState>>,
    JsonBody(b): JsonBody<SnapshotBody>,
) -> Result<Response, ApiError> {
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
pub struct ForkBody {
    timeout: Option<i64>,
    count: Option<i64>,
}

/// `POST /sandboxes/{id}/fork`: `{count, timeout}` children, each a
/// `{"sandbox": …}` or an `{"error": …}`. Through a cluster's gateway the
/// children that do not fit on the source's node start on others
/// ([`crate::cluster::spread`]): the source's node answers with an
/// `{"elsewhere": {capture, count}}` entry for them, and the gateway sends
/// each other node the fork with [`crate::cluster::FORK_FROM_HEADER`].
pub async fn fork(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: http::HeaderMap,
    JsonBody(b): JsonBody<ForkBody>,
) -> Result<Response, ApiError> {
    use crate::cluster::{spread, FORK_FROM_HEADER, SPREAD_HEADER};
    let count = b.count.unwrap_or(1);
    let spread_err = |e: spread::SpreadError| match e {
        spread::SpreadError::Sandbox(e) => ApiError::from(e),
        spread::SpreadError::Capture(e) => ApiError::new(StatusCode::BAD_GATEWAY, e.to_string()),
    };
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    let captures = s.captures.as_ref();
    if let (Some(c), Some(capture)) = (captures, header(FORK_FROM_HEADER)) {
        let results =
            spread::fork_elsewhere(&s.manager, c, &key.team, &id, capture, count, b.timeout)
                .await
                .map_err(spread_err)?;
        return Ok(fork_answer(&s, results, None));
    }
    let Owned { id, .. } = Owned::check(&s, key, id)?;
    if let (Some(c), Some(_)) = (captures, header(SPREAD_HEADER)) {
        let (results, elsewhere) = spread::fork_here(&s.manager, c, &id, count, b.timeout)
            .await
            .map_err(spread_err)?;
        return Ok(fork_answer(&s, results, elsewhere));
    }
    let results = s.manager.fork(&id, count, b.timeout).await?;
    Ok(fork_answer(&s, results, None))
}

fn fork_answer(
    s: &AppState,
    results: Vec<crate::sandboxes::ForkResult>,
    elsewhere: Option<crate::cluster::spread::Elsewhere>,
) -> Response {
    let mut out: Vec<serde_json::Value> = results
        .into_iter()
        .map(|r| match r {
            Ok(rec) => serde_json::json!({ "sandbox": sandbox_out(rec, &s.domain) }),
            Err(e) => {
                let e = ApiError::from(e);
                serde_json::json!({ "error": { "code": e.status.as_u16(), "message": e.message } })
            }
        })
        .collect();
    if let Some(e) = elsewhere {
        out.push(serde_json::json!({ "elsewhere": e }));
    }
    (StatusCode::CREATED, Json(out)).into_response()
}

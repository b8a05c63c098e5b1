//! Calls about one sandbox, sent to its node (what they changed written
//! to the catalog at once), and its `connect` / `resume` on another node
//! when its own is down or full.

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, Method, StatusCode};

use super::super::forward::ForwardError;
use super::super::{place, Gateway};
use super::refresh::refresh;
use super::refused;
use crate::api::ApiError;
use crate::cluster::catalog::ClusterKey;

pub(super) async fn by_id(
    g: &Gateway,
    key: &ClusterKey,
    id: String,
    req: Request,
) -> Result<Response, ApiError> {
    let not_found = || ApiError::from(crate::sandboxes::SandboxError::NotFound(id.clone()));
    let (node, team) = g.locate(&id).await?.ok_or_else(not_found)?;
    if team != key.team {
        return Err(not_found());
    }
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    if method == Method::POST && (path.ends_with("/connect") || path.ends_with("/resume")) {
        return resume(g, key, &id, &node, req).await;
    }
    let (parts, body) = req.into_parts();
    let bytes = crate::api::body_bytes(body, g.cfg.max_body_bytes).await?;
    let again = || http::Request::from_parts(parts.clone(), Body::from(bytes.clone()));
    let mut n = g.node(&node).await.ok_or_else(|| {
        ApiError::unavailable(format!(
            "sandbox {id} is on node {node}, which is not registered"
        ))
    })?;
    if method == Method::POST && path.ends_with("/fork") {
        return super::super::fork::fork(g, key, &id, &n, parts, bytes).await;
    }
    let first = g.to_node(&n, &key.team, again()).await;
    // Unreachable, or no longer there: the route may be stale (another
    // gateway resumed the sandbox on another node), so once more where
    // the catalog says it is now.
    let stale = match &first {
        Ok(r) => r.status() == StatusCode::NOT_FOUND,
        Err(e) => matches!(e, ForwardError::Unreachable(..)),
    };
    let moved = if stale {
        g.forget(&id);
        match g.locate(&id).await? {
            Some((now, _)) if now != node => g.node(&now).await,
            _ => None,
        }
    } else {
        None
    };
    let sent = match moved {
        Some(m) => {
            n = m;
            g.to_node(&n, &key.team, again()).await
        }
        None => first,
    };
    let resp = match sent {
        Ok(r) => r,
        Err(e) => return Ok(e.into_response()),
    };
    let status = resp.status();
    let action = path.rsplit('/').next().unwrap_or_default();
    match (&method, action) {
        (&Method::DELETE, _) if status.is_success() || status == StatusCode::NOT_FOUND => {
            g.forget(&id);
            if let Err(e) = g.catalog.remove(&id).await {
                tracing::warn!(sandbox = %id, "catalog: {e}");
            }
            Ok(resp)
        }
        (&Method::GET, a) if a == id && status.is_success() => {
            // Names the node: an extra field the SDKs ignore.
            let (parts, body) = resp.into_parts();
            let bytes = axum::body::to_bytes(body, 1 << 20)
                .await
                .map_err(|e| ApiError::unavailable(e.to_string()))?;
            let mut v: serde_json::Value =
                serde_json::from_slice(&bytes).map_err(|e| ApiError::unavailable(e.to_string()))?;
            if let Some(o) = v.as_object_mut() {
                o.insert("nodeID".into(), n.id.clone().into());
            }
            let mut parts = parts;
            parts.headers.remove(http::header::CONTENT_LENGTH);
            Ok(Response::from_parts(parts, Body::from(v.to_string())))
        }
        (&Method::POST, "snapshots") if status.is_success() => {
            // Placement sends creates from it to this node at once.
            let (parts, body) = resp.into_parts();
            let bytes = axum::body::to_bytes(body, 1 << 20)
                .await
                .map_err(|e| ApiError::unavailable(e.to_string()))?;
            let names = snapshot_names(&bytes);
            if let Err(e) = g.catalog.add_templates(&n.id, &names).await {
                tracing::warn!(snapshot = ?names, "catalog: {e}");
            }
            g.read_nodes().await;
            Ok(Response::from_parts(parts, Body::from(bytes)))
        }
        (&Method::POST | &Method::PUT, "pause" | "timeout" | "refreshes" | "network")
            if status.is_success() =>
        {
            refresh(g, &n, &key.team, &id, None).await;
            Ok(resp)
        }
        _ => Ok(resp),
    }
}

/// Whether a node answered that it has no room (for the resume of a
/// paused sandbox: another node may adopt it).
fn full(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::TOO_MANY_REQUESTS | StatusCode::INSUFFICIENT_STORAGE
    )
}

/// `connect` / `resume` of sandbox `id`: at its own node `node`; when that
/// node is down or has no room, at another node that adopts the sandbox
/// from the pause capture its node pushed (durable pause) and resumes it
/// there. Without such a capture the first failure is the answer.
async fn resume(
    g: &Gateway,
    key: &ClusterKey,
    id: &str,
    node: &str,
    req: Request,
) -> Result<Response, ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = crate::api::body_bytes(body, g.cfg.max_body_bytes).await?;
    let again = || http::Request::from_parts(parts.clone(), Body::from(bytes.clone()));
    // Where the catalog says it is now: another gateway may have resumed
    // it on another node.
    g.forget(id);
    let node = match g.locate(id).await? {
        Some((now, _)) => now,
        None => node.to_string(),
    };
    let node = node.as_str();
    let first = match g.node(node).await {
        Some(n) => match g.to_node(&n, &key.team, again()).await {
            Ok(resp) if !full(resp.status()) => {
                if resp.status().is_success() {
                    refresh(g, &n, &key.team, id, None).await;
                }
                return Ok(resp);
            }
            Ok(resp) => resp,
            Err(e @ ForwardError::Failed(..)) => return Ok(e.into_response()),
            Err(e) => e.into_response(),
        },
        None => ApiError::unavailable(format!(
            "sandbox {id} is on node {node}, which is not registered"
        ))
        .into_response(),
    };
    // Only a sandbox the catalog knows as paused: one that runs on a node
    // that is down lives on with its VMs, and comes back with it.
    match g.catalog.is_paused(id).await {
        Ok(true) => {}
        Ok(false) => return Ok(first),
        Err(e) => {
            tracing::warn!(sandbox = %id, "catalog: {e}");
            return Ok(first);
        }
    }
    tracing::info!(sandbox = %id, node, status = %first.status(), "resuming on another node");
    let mut tried = vec![node.to_string()];
    for _ in 0..2 {
        let nodes = g.nodes().await;
        let Some(n) =
            place::choose(&nodes, "", g.grace_ms(), &tried, crate::ids::random_index).cloned()
        else {
            break;
        };
        tried.push(n.id.clone());
        let mut req = again();
        req.headers_mut()
            .insert(crate::cluster::ADOPT_HEADER, HeaderValue::from_static("1"));
        match g.to_node(&n, &key.team, req).await {
            Ok(resp) if resp.status().is_success() => {
                g.remember(id, &n.id, &key.team);
                refresh(g, &n, &key.team, id, None).await;
                return Ok(resp);
            }
            // No capture of it was pushed: the first failure stands.
            Ok(resp) if resp.status() == StatusCode::NOT_FOUND => break,
            Ok(resp) if refused(resp.status()) => continue,
            Ok(resp) => return Ok(resp),
            Err(e @ ForwardError::Failed(..)) => return Ok(e.into_response()),
            Err(e) => tracing::warn!(sandbox = %id, "resume elsewhere: {e}"),
        }
    }
    Ok(first)
}

/// A snapshot's id and names, from its create answer
/// (`{"snapshotID": ..., "names": [...]}`).
fn snapshot_names(bytes: &[u8]) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_slice(bytes).unwrap_or_default();
    let id = v.get("snapshotID").and_then(|i| i.as_str());
    let names = v.get("names").and_then(|n| n.as_array());
    id.into_iter()
        .chain(names.into_iter().flatten().filter_map(|n| n.as_str()))
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshots_answer_gives_its_id_and_names() {
        let b = br#"{"snapshotID":"snap1","names":["team/x:latest","x"]}"#;
        assert_eq!(snapshot_names(b), ["snap1", "team/x:latest", "x"]);
        assert!(snapshot_names(b"not json").is_empty());
    }
}

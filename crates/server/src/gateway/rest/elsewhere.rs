//! What is not about one sandbox: templates, builds, snapshots, sent to
//! the nodes that hold them or asked of every node.

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, Method, StatusCode};

use super::super::forward::ForwardError;
use super::super::{place, Gateway};
use super::query_of;
use crate::api::ApiError;
use crate::cluster::catalog::{ClusterKey, Node};

/// Templates, builds, snapshots. `GET /snapshots` asks every node (a
/// snapshot lives where its sandbox did); a template or snapshot by id
/// goes to the node that holds it; the rest (builds, new templates) to the
/// template node, the healthy node first by id: templates built through a
/// gateway are built there, and placement sends their sandboxes there.
pub(super) async fn elsewhere(
    g: &Gateway,
    key: &ClusterKey,
    req: Request,
) -> Result<Response, ApiError> {
    let nodes = g.nodes().await;
    let up: Vec<&Node> = nodes
        .iter()
        .filter(|n| place::healthy(n, g.grace_ms()))
        .collect();
    let first = *up
        .first()
        .ok_or_else(|| ApiError::unavailable("no node of the cluster is up"))?;
    let path = req.uri().path().to_string();
    if req.method() == Method::GET && path == "/snapshots" {
        return snapshots(g, key, &up, query_of(&req)).await;
    }
    let id = path
        .strip_prefix("/templates/")
        .and_then(|rest| rest.split('/').next())
        .unwrap_or_default()
        .to_string();
    let holders: Vec<&Node> = up
        .iter()
        .filter(|n| !id.is_empty() && n.status.templates.contains(&id))
        .copied()
        .collect();
    if req.method() == Method::DELETE && holders.len() > 1 {
        return delete_everywhere(g, key, &id, &holders, req).await;
    }
    if holders.is_empty() && req.method() == Method::GET && up.len() > 1 {
        return ask_around(g, key, &up, req).await;
    }
    let resp = g
        .to_node(holders.first().copied().unwrap_or(first), &key.team, req)
        .await
        .unwrap_or_else(ForwardError::into_response);
    Ok(resp)
}

/// A GET that no node is known to hold (a build's status, say): the up
/// nodes in turn until one does not answer 404. The template node is
/// the first healthy one by id, which changes when a node comes back,
/// so the node a build started on may no longer be the first.
async fn ask_around(
    g: &Gateway,
    key: &ClusterKey,
    up: &[&Node],
    req: Request,
) -> Result<Response, ApiError> {
    let (parts, _) = req.into_parts();
    let mut first = None;
    for n in up {
        let again = http::Request::from_parts(parts.clone(), Body::empty());
        let r = g
            .to_node(n, &key.team, again)
            .await
            .unwrap_or_else(ForwardError::into_response);
        if r.status() != StatusCode::NOT_FOUND {
            return Ok(r);
        }
        first.get_or_insert(r);
    }
    Ok(first.expect("up is not empty"))
}

/// `DELETE /templates/{id}` of a snapshot held by several nodes (its own
/// and those that pulled it from the registry): deleted on each; the
/// first answer that is not a success, else the first, goes back.
async fn delete_everywhere(
    g: &Gateway,
    key: &ClusterKey,
    id: &str,
    holders: &[&Node],
    req: Request,
) -> Result<Response, ApiError> {
    let (parts, _) = req.into_parts();
    let mut answers = Vec::new();
    for n in holders {
        let again = http::Request::from_parts(parts.clone(), Body::empty());
        answers.push(
            g.to_node(n, &key.team, again)
                .await
                .unwrap_or_else(ForwardError::into_response),
        );
    }
    if answers.iter().all(|r| r.status().is_success()) {
        if let Err(e) = crate::cluster::captures::forget(&g.catalog, id).await {
            tracing::warn!(snapshot = id, "forgetting the capture: {e}");
        }
    }
    let i = answers
        .iter()
        .position(|r| !r.status().is_success())
        .unwrap_or(0);
    Ok(answers.swap_remove(i))
}

/// `GET /snapshots` across nodes: each node's whole list, merged, then
/// paged as one node pages (`nextToken` = how many were skipped).
async fn snapshots(
    g: &Gateway,
    key: &ClusterKey,
    up: &[&Node],
    query: String,
) -> Result<Response, ApiError> {
    let mut q: Vec<(String, String)> = serde_urlencoded::from_str(&query)
        .map_err(|e| ApiError::bad_request(format!("bad query: {e}")))?;
    let take = |q: &mut Vec<(String, String)>, k: &str| {
        let v = q.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
        q.retain(|(key, _)| key != k);
        v
    };
    let limit = match take(&mut q, "limit") {
        Some(l) => l
            .parse::<usize>()
            .map_err(|_| ApiError::bad_request("invalid limit"))?,
        None => 100,
    }
    .clamp(1, 1000);
    let skip = match take(&mut q, "nextToken").filter(|t| !t.is_empty()) {
        Some(t) => t
            .parse::<usize>()
            .map_err(|_| ApiError::bad_request("invalid nextToken"))?,
        None => 0,
    };
    let sandbox_filter = q
        .iter()
        .find(|(k, _)| k == "sandboxID")
        .map(|(_, v)| v.clone());
    let name_filter = q.iter().find(|(k, _)| k == "name").map(|(_, v)| v.clone());
    q.push(("limit".into(), "1000".into()));
    let each = serde_urlencoded::to_string(&q).unwrap_or_default();
    let mut all: Vec<serde_json::Value> = Vec::new();
    for n in up {
        let mut token: Option<String> = None;
        loop {
            let mut uri = format!("/snapshots?{each}");
            if let Some(t) = &token {
                uri += &format!("&nextToken={t}");
            }
            let req = http::Request::get(uri)
                .body(Body::empty())
                .expect("a valid request");
            // A node that went down since the last heartbeat: what it
            // pushed is listed from the catalog below.
            let resp = match g.to_node(n, &key.team, req).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(node = %n.id, "listing snapshots: {e}");
                    break;
                }
            };
            if !resp.status().is_success() {
                return Ok(resp);
            }
            token = resp
                .headers()
                .get("x-next-token")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let bytes = axum::body::to_bytes(resp.into_body(), 64 << 20)
                .await
                .map_err(|e| ApiError::unavailable(e.to_string()))?;
            let page: Vec<serde_json::Value> =
                serde_json::from_slice(&bytes).map_err(|e| ApiError::unavailable(e.to_string()))?;
            all.extend(page);
            if token.is_none() {
                break;
            }
        }
    }
    // Snapshots that only nodes now down hold: from the catalog (they
    // restore anywhere, pulled from the registry).
    let pushed = crate::cluster::captures::snapshots_of(&g.catalog, &key.team)
        .await
        .map_err(|e| ApiError::unavailable(e.to_string()))?;
    for (id, names, sandbox) in pushed {
        let wanted = sandbox_filter
            .as_deref()
            .is_none_or(|s| s.is_empty() || s == sandbox)
            && name_filter
                .as_deref()
                .is_none_or(|n| n.is_empty() || crate::model::has_name(&names, n));
        if wanted {
            all.push(serde_json::json!({ "snapshotID": id, "names": names }));
        }
    }
    // A snapshot pulled by other nodes (or also in the catalog) is listed
    // once.
    let mut seen = std::collections::HashSet::new();
    all.retain(|v| seen.insert(v["snapshotID"].to_string()));
    let page: Vec<serde_json::Value> = all.iter().skip(skip).take(limit).cloned().collect();
    let mut headers = http::HeaderMap::new();
    if skip + page.len() < all.len() {
        headers.insert(
            "x-next-token",
            HeaderValue::from_str(&(skip + page.len()).to_string()).expect("digits"),
        );
    }
    Ok((headers, axum::Json(page)).into_response())
}

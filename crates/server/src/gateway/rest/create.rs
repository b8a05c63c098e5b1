//! `POST /sandboxes`: a create placed on a node (where its volumes are,
//! else where placement chooses), once more on another node when the first
//! refused before making anything.

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use http::StatusCode;

use super::super::forward::ForwardError;
use super::super::{place, Gateway};
use super::refresh::{refresh, row_of};
use super::refused;
use crate::api::ApiError;
use crate::cluster::catalog::ClusterKey;

pub(super) async fn create(
    g: &Gateway,
    key: &ClusterKey,
    req: Request,
) -> Result<Response, ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = crate::api::body_bytes(body, g.cfg.max_body_bytes).await?;
    let template = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| {
            v.get("templateID")
                .and_then(|t| t.as_str())
                .map(str::to_string)
        })
        .unwrap_or_else(|| "base".to_string());
    let idem = parts
        .headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    // A sandbox that mounts volumes runs on their node.
    let pinned = super::super::volumes::mounts_node(g, &key.team, &bytes).await?;
    let mut tried: Vec<String> = Vec::new();
    let mut last: Option<Response> = None;
    // One try and, when a node refused before making anything, one more
    // on another node; nodes that cannot be reached (down within the
    // grace, so still listed) are skipped without counting.
    let mut refusals = 0;
    while refusals < 2 {
        let mut nodes = g.nodes_holding(&template).await;
        if let Some(p) = &pinned {
            nodes.retain(|n| n.id == *p);
        }
        let Some(mut n) = place::choose(
            &nodes,
            &template,
            g.grace_ms(),
            &tried,
            crate::ids::random_index,
        )
        .cloned() else {
            break;
        };
        tried.push(n.id.clone());
        // The same Idempotency-Key goes where its first attempt went; that
        // node's own idempotency answers with the sandbox it made.
        let mut first = true;
        if let Some(k) = &idem {
            let at = g
                .catalog
                .claim_idempotency(&key.team, k, &n.id)
                .await
                .map_err(|e| ApiError::unavailable(format!("creates wait for the catalog: {e}")))?;
            if at != n.id {
                if tried.contains(&at) {
                    // Tried already: no other node may answer for it.
                    break;
                }
                first = false;
                n = nodes.iter().find(|x| x.id == at).cloned().ok_or_else(|| {
                    ApiError::unavailable(format!(
                        "this Idempotency-Key's create went to node {at}, which is gone"
                    ))
                })?;
                tried.push(at);
            }
        }
        let reservation = if first {
            match g
                .catalog
                .reserve(&key.team, g.cfg.team_max(&key.team), &n.id)
                .await
            {
                Ok(Some(r)) => Some(r),
                Ok(None) => {
                    if let Some(k) = &idem {
                        let _ = g.catalog.unclaim_idempotency(&key.team, k, &n.id).await;
                    }
                    return Err(ApiError::new(
                        StatusCode::TOO_MANY_REQUESTS,
                        format!(
                            "team {} has reached its max_sandboxes across the cluster",
                            key.team
                        ),
                    ));
                }
                Err(e) => {
                    return Err(ApiError::unavailable(format!(
                        "creates wait for the catalog: {e}"
                    )))
                }
            }
        } else {
            None
        };
        // Undo the reservation and (for a first attempt) the key's claim.
        let undo = || async {
            if let Some(r) = &reservation {
                let _ = g.catalog.release(r).await;
            }
            if let (true, Some(k)) = (first, &idem) {
                let _ = g.catalog.unclaim_idempotency(&key.team, k, &n.id).await;
            }
        };
        let again = http::Request::from_parts(parts.clone(), Body::from(bytes.clone()));
        let resp = match g.to_node(&n, &key.team, again).await {
            Ok(r) => r,
            Err(e @ ForwardError::Unreachable(..)) => {
                tracing::warn!("create: {e}; trying another node");
                undo().await;
                last = Some(e.into_response());
                continue;
            }
            Err(e) => {
                if let Some(r) = &reservation {
                    let _ = g.catalog.release(r).await;
                }
                return Ok(e.into_response());
            }
        };
        if refused(resp.status()) {
            undo().await;
            last = Some(resp);
            refusals += 1;
            continue;
        }
        if !resp.status().is_success() {
            undo().await;
            return Ok(resp);
        }
        let (mut rparts, rbody) = resp.into_parts();
        let mut out = axum::body::to_bytes(rbody, 1 << 20)
            .await
            .map_err(|e| ApiError::unavailable(format!("reading node {}'s answer: {e}", n.id)))?;
        let mut v = serde_json::from_slice::<serde_json::Value>(&out).ok();
        let id = v
            .as_ref()
            .and_then(|v| v.get("sandboxID")?.as_str().map(str::to_string));
        if let Some(id) = id {
            g.remember(&id, &n.id, &key.team);
            // The node's answer carries the sandbox as lists show it; an
            // older node's does not, and it is read back.
            let listed = v
                .as_mut()
                .and_then(|v| v.as_object_mut()?.remove(crate::api::LISTED_FIELD));
            match listed.and_then(|l| row_of(&key.team, l)) {
                Some(row) => {
                    if let Err(e) = g.catalog.put(&n.id, &row, reservation.as_deref()).await {
                        tracing::warn!(sandbox = %id, "catalog: {e}");
                    }
                    out = serde_json::to_vec(&v).unwrap_or_default().into();
                    rparts.headers.remove(http::header::CONTENT_LENGTH);
                }
                None => refresh(g, &n, &key.team, &id, reservation.as_deref()).await,
            }
        }
        return Ok(Response::from_parts(rparts, Body::from(out)));
    }
    Ok(last.unwrap_or_else(|| match &pinned {
        Some(p) => ApiError::unavailable(format!(
            "node {p}, which holds the volumes to mount, is down or has no room now"
        ))
        .into_response(),
        None => ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "no node of the cluster has room for a sandbox now",
        )
        .into_response(),
    }))
}

//! The REST API through a gateway: creates placed on a node, calls about a
//! sandbox sent to its node (and what they changed written to the catalog
//! at once), lists from the catalog, the rest (templates, builds,
//! snapshots) to the template node.

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, Method, StatusCode};

use super::forward::ForwardError;
use super::{place, Gateway};
use crate::api::ApiError;
use crate::cluster::catalog::{ClusterKey, Node, SandboxRow};

pub async fn route(g: &Gateway, key: ClusterKey, req: Request) -> Result<Response, ApiError> {
    let path = req.uri().path().to_string();
    match (req.method().clone(), path.as_str()) {
        (Method::POST, "/sandboxes" | "/v2/sandboxes") => create(g, &key, req).await,
        (Method::GET, "/sandboxes") => list(g, &key, query_of(&req), false).await,
        (Method::GET, "/v2/sandboxes") => list(g, &key, query_of(&req), true).await,
        (Method::GET, "/hosts") => Ok(hosts(g).await),
        (_, p) if super::volumes::handles(p) => super::volumes::route(g, &key, req).await,
        // A cluster's secrets are in the catalog: any node serves them.
        (_, p) if p == "/secrets" || p.starts_with("/secrets/") => any_up(g, &key, req).await,
        _ => match sandbox_of(&path) {
            Some(id) => by_id(g, &key, id.to_string(), req).await,
            None => elsewhere(g, &key, req).await,
        },
    }
}

fn query_of(req: &Request) -> String {
    req.uri().query().unwrap_or_default().to_string()
}

/// The sandbox a path is about: `/sandboxes/{id}[/…]`, `/v2/sandboxes/{id}/…`.
fn sandbox_of(path: &str) -> Option<&str> {
    let rest = path
        .strip_prefix("/v2/sandboxes/")
        .or_else(|| path.strip_prefix("/sandboxes/"))?;
    let id = rest.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

/// `GET /hosts`: every node of the cluster as the catalog knows it (the
/// console's host page).
async fn hosts(g: &Gateway) -> Response {
    let out: Vec<_> = g
        .nodes()
        .await
        .iter()
        .map(|n| {
            serde_json::json!({
                "nodeID": n.id,
                "address": n.status.address,
                "up": place::healthy(n, g.grace_ms()),
                "heartbeatAgeMs": n.silent_ms,
                "cores": n.status.cores,
                "capacity": n.status.capacity,
                "live": n.status.live,
                "memoryFreeMB": n.status.memory_free_mb,
                "diskFreeMB": n.status.disk_free_mb,
                "version": n.status.version,
            })
        })
        .collect();
    axum::Json(out).into_response()
}

/// `req` to the first up node (for what every node serves alike).
async fn any_up(g: &Gateway, key: &ClusterKey, req: Request) -> Result<Response, ApiError> {
    let nodes = g.nodes().await;
    let n = nodes
        .iter()
        .find(|n| place::healthy(n, g.grace_ms()))
        .ok_or_else(|| unavailable("no node of the cluster is up"))?;
    Ok(g.to_node(n, &key.team, req)
        .await
        .unwrap_or_else(ForwardError::into_response))
}

pub(super) fn unavailable(message: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::SERVICE_UNAVAILABLE, message)
}

/// Statuses with which a node refuses a create before making anything:
/// the gateway may try another node.
fn refused(status: StatusCode) -> bool {
    matches!(
        status,
        StatusCode::TOO_MANY_REQUESTS
            | StatusCode::INSUFFICIENT_STORAGE
            | StatusCode::SERVICE_UNAVAILABLE
    )
}

async fn create(g: &Gateway, key: &ClusterKey, req: Request) -> Result<Response, ApiError> {
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
    let pinned = super::volumes::mounts_node(g, &key.team, &bytes).await?;
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
                .map_err(|e| unavailable(format!("creates wait for the catalog: {e}")))?;
            if at != n.id {
                if tried.contains(&at) {
                    // Tried already: no other node may answer for it.
                    break;
                }
                first = false;
                n = nodes.iter().find(|x| x.id == at).cloned().ok_or_else(|| {
                    unavailable(format!(
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
                Err(e) => return Err(unavailable(format!("creates wait for the catalog: {e}"))),
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
            .map_err(|e| unavailable(format!("reading node {}'s answer: {e}", n.id)))?;
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
        Some(p) => unavailable(format!(
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

/// Read sandbox `id` from its node and write it to the catalog (or mark it
/// gone); failures only log: the node's next full list heals the catalog.
async fn refresh(g: &Gateway, n: &Node, team: &str, id: &str, reservation: Option<&str>) {
    let req = http::Request::get(format!("/sandboxes/{id}"))
        .body(Body::empty())
        .expect("a valid request");
    let resp = match g.to_node(n, team, req).await {
        Ok(r) => r,
        Err(e) => return tracing::warn!(sandbox = %id, "refreshing the catalog: {e}"),
    };
    if resp.status() == StatusCode::NOT_FOUND {
        g.forget(id);
        if let Err(e) = g.catalog.remove(id).await {
            tracing::warn!(sandbox = %id, "catalog: {e}");
        }
        return;
    }
    let Ok(bytes) = axum::body::to_bytes(resp.into_body(), 1 << 20).await else {
        return;
    };
    let Some(row) = serde_json::from_slice(&bytes)
        .ok()
        .and_then(|v| row_of(team, v))
    else {
        return tracing::warn!(sandbox = %id, "refreshing the catalog: the node's answer is not a sandbox");
    };
    if let Err(e) = g.catalog.put(&n.id, &row, reservation).await {
        tracing::warn!(sandbox = %id, "catalog: {e}");
    }
}

/// A catalog row from a node's `GET /sandboxes/{id}` (secrets dropped).
fn row_of(team: &str, mut v: serde_json::Value) -> Option<SandboxRow> {
    let o = v.as_object_mut()?;
    o.remove("envdAccessToken");
    o.remove("domain");
    let started = o.get("startedAt")?.as_str()?;
    let started_ms =
        time::OffsetDateTime::parse(started, &time::format_description::well_known::Rfc3339)
            .ok()?
            .unix_timestamp_nanos()
            / 1_000_000;
    Some(SandboxRow {
        id: o.get("sandboxID")?.as_str()?.to_string(),
        team: team.to_string(),
        state: o.get("state")?.as_str()?.to_string(),
        template_id: o.get("templateID")?.as_str()?.to_string(),
        started_ms: started_ms as i64,
        metadata: serde_json::from_value(o.get("metadata")?.clone()).unwrap_or_default(),
        detail: v,
    })
}

async fn by_id(
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
        unavailable(format!(
            "sandbox {id} is on node {node}, which is not registered"
        ))
    })?;
    if method == Method::POST && path.ends_with("/fork") {
        return super::fork::fork(g, key, &id, &n, parts, bytes).await;
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
                .map_err(|e| unavailable(e.to_string()))?;
            let mut v: serde_json::Value =
                serde_json::from_slice(&bytes).map_err(|e| unavailable(e.to_string()))?;
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
                .map_err(|e| unavailable(e.to_string()))?;
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
        None => unavailable(format!(
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

/// Fork children a node started (entries of its fork answer): routed to
/// it and written to the catalog.
pub(super) async fn note_children(
    g: &Gateway,
    n: &Node,
    team: &str,
    entries: &[serde_json::Value],
) {
    for child in children(entries) {
        g.remember(&child, &n.id, team);
        refresh(g, n, team, &child, None).await;
    }
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

/// The sandbox ids in a fork's answer (`[{"sandbox": {...}} | {"error": ...}]`).
fn children(entries: &[serde_json::Value]) -> Vec<String> {
    entries
        .iter()
        .filter_map(|e| e.get("sandbox")?.get("sandboxID")?.as_str())
        .map(str::to_string)
        .collect()
}

async fn list(
    g: &Gateway,
    key: &ClusterKey,
    query: String,
    paged: bool,
) -> Result<Response, ApiError> {
    let f = crate::api::list_filter(&query, paged)?;
    let page = f.limit;
    let nodes = g.nodes().await;
    let down: Vec<String> = nodes
        .iter()
        .filter(|n| !place::healthy(n, g.grace_ms()))
        .map(|n| n.id.clone())
        .collect();
    let q = crate::cluster::catalog::ListQuery {
        team: key.team.clone(),
        states: f.states.iter().map(|s| s.as_str().to_string()).collect(),
        metadata: f.metadata,
        template: f.template,
        started_after_ms: f.started_after_ms,
        started_before_ms: f.started_before_ms,
        after: f.after,
        descending: f.descending,
        limit: if paged { page + 1 } else { usize::MAX >> 1 },
        down_nodes: down,
    };
    let mut rows = g
        .catalog
        .list(&q)
        .await
        .map_err(|e| unavailable(e.to_string()))?;
    let mut headers = http::HeaderMap::new();
    if paged && rows.len() > page {
        rows.truncate(page);
        if let Some(last) = rows.last() {
            headers.insert(
                "x-next-token",
                HeaderValue::from_str(&crate::api::page_token(last.started_ms, &last.id))
                    .expect("base64 is a valid header"),
            );
        }
    }
    let out: Vec<serde_json::Value> = rows.into_iter().map(|r| r.detail).collect();
    Ok((headers, axum::Json(out)).into_response())
}

/// Templates, builds, snapshots. `GET /snapshots` asks every node (a
/// snapshot lives where its sandbox did); a template or snapshot by id
/// goes to the node that holds it; the rest (builds, new templates) to the
/// template node, the healthy node first by id: templates built through a
/// gateway are built there, and placement sends their sandboxes there.
async fn elsewhere(g: &Gateway, key: &ClusterKey, req: Request) -> Result<Response, ApiError> {
    let nodes = g.nodes().await;
    let up: Vec<&Node> = nodes
        .iter()
        .filter(|n| place::healthy(n, g.grace_ms()))
        .collect();
    let first = *up
        .first()
        .ok_or_else(|| unavailable("no node of the cluster is up"))?;
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
                .map_err(|e| unavailable(e.to_string()))?;
            let page: Vec<serde_json::Value> =
                serde_json::from_slice(&bytes).map_err(|e| unavailable(e.to_string()))?;
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
        .map_err(|e| unavailable(e.to_string()))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_their_sandbox() {
        assert_eq!(sandbox_of("/sandboxes/i123"), Some("i123"));
        assert_eq!(sandbox_of("/sandboxes/i123/pause"), Some("i123"));
        assert_eq!(sandbox_of("/v2/sandboxes/i123/logs"), Some("i123"));
        assert_eq!(sandbox_of("/sandboxes"), None);
        assert_eq!(sandbox_of("/sandboxes/"), None);
        assert_eq!(sandbox_of("/templates/x"), None);
    }

    #[test]
    fn a_nodes_detail_becomes_a_row_without_secrets() {
        let v = serde_json::json!({
            "sandboxID": "i1", "templateID": "base", "state": "running",
            "startedAt": "2026-12-06T03:00:00Z", "metadata": {"k": "v"},
            "envdAccessToken": "secret", "domain": "d",
        });
        let r = row_of("t", v).unwrap();
        assert_eq!(
            (r.id.as_str(), r.team.as_str(), r.state.as_str()),
            ("i1", "t", "running")
        );
        assert_eq!(r.started_ms, 1_796_526_000_000);
        assert_eq!(r.metadata.get("k").map(String::as_str), Some("v"));
        assert!(r.detail.get("envdAccessToken").is_none() && r.detail.get("domain").is_none());
        assert!(row_of("t", serde_json::json!({"sandboxID": "i1"})).is_none());
    }

    #[test]
    fn a_snapshots_answer_gives_its_id_and_names() {
        let b = br#"{"snapshotID":"snap1","names":["team/x:latest","x"]}"#;
        assert_eq!(snapshot_names(b), ["snap1", "team/x:latest", "x"]);
        assert!(snapshot_names(b"not json").is_empty());
    }

    #[test]
    fn fork_answers_name_their_children() {
        let a: Vec<serde_json::Value> = serde_json::from_str(
            r#"[{"sandbox":{"sandboxID":"a"}},{"error":{"code":429}},{"sandbox":{"sandboxID":"b"}}]"#,
        )
        .unwrap();
        assert_eq!(children(&a), vec!["a", "b"]);
        assert!(children(&[]).is_empty());
    }
}

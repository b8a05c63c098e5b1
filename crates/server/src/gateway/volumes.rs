//! Volumes through a gateway. A volume's files live on the node that made
//! it; the catalog (`tine_volumes`) says which, and a gateway sends every
//! call about the volume there: `/volumes/{id}` with the caller's team, and
//! the content API (`/volumecontent/{id}/…`, which carries the volume's
//! token instead of an API key) as it came, token included. A volume whose
//! node is down answers 503 until the node is back.

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use http::{Method, StatusCode};

use super::forward::ForwardError;
use super::{place, Gateway};
use crate::api::ApiError;
use crate::cluster::catalog::ClusterKey;
use crate::cluster::volumes::VolumePlace;

/// The volume a content call names: `/volumecontent/{id}/…`.
pub(super) fn content_volume(path: &str) -> Option<&str> {
    let id = path.strip_prefix("/volumecontent/")?.split('/').next()?;
    (!id.is_empty()).then_some(id)
}

fn catalog_down(e: impl std::fmt::Display) -> ApiError {
    ApiError::unavailable(format!("volumes wait for the catalog: {e}"))
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("volume {id} not found"))
}

fn sent(r: Result<Response, ForwardError>) -> Response {
    r.unwrap_or_else(ForwardError::into_response)
}

/// A content call, before any API key is asked for: to the volume's node
/// with its token. An unknown volume looks like a wrong token (401).
pub(super) async fn content(g: &Gateway, id: &str, req: Request) -> Response {
    let v = match g.catalog.volume_by_id(id).await {
        Ok(Some(v)) => v,
        Ok(None) => {
            return ApiError::unauthorized(format!("no volume {id} with this token"))
                .into_response()
        }
        Err(e) => return catalog_down(e).into_response(),
    };
    match g.node(&v.node).await {
        Some(n) => sent(g.to_node_with_token(&n, &v.team, req).await),
        None => node_gone(&v).into_response(),
    }
}

fn node_gone(v: &VolumePlace) -> ApiError {
    ApiError::unavailable(format!(
        "volume {} is on node {}, which is not registered",
        v.id, v.node
    ))
}

/// Whether `path` is `/volumes` or `/volumes/{id}`.
pub(super) fn handles(path: &str) -> bool {
    path == "/volumes"
        || path
            .strip_prefix("/volumes/")
            .is_some_and(|id| !id.is_empty() && !id.contains('/'))
}

/// `/volumes` and `/volumes/{id}` ([`handles`]).
pub(super) async fn route(
    g: &Gateway,
    key: &ClusterKey,
    req: Request,
) -> Result<Response, ApiError> {
    let path = req.uri().path().to_string();
    let method = req.method().clone();
    match path.strip_prefix("/volumes/") {
        None => match method {
            Method::POST => create(g, key, req).await,
            Method::GET => list(g, key).await,
            _ => Err(ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("{method} is not allowed on /volumes"),
            )),
        },
        Some(id) => by_id(g, key, id, req).await,
    }
}

async fn list(g: &Gateway, key: &ClusterKey) -> Result<Response, ApiError> {
    let vols = g.catalog.volumes(&key.team).await.map_err(catalog_down)?;
    let out: Vec<serde_json::Value> = vols
        .iter()
        .map(|v| serde_json::json!({ "volumeID": v.id, "name": v.name }))
        .collect();
    Ok(axum::Json(out).into_response())
}

/// Made on a healthy node (the freest of two picked at random), then
/// recorded; a name another gateway recorded first meanwhile is 409 and
/// the new volume is removed again.
async fn create(g: &Gateway, key: &ClusterKey, req: Request) -> Result<Response, ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = crate::api::body_bytes(body, g.cfg.max_body_bytes).await?;
    let name = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v.get("name")?.as_str().map(str::to_string));
    if let Some(name) = &name {
        if g.catalog
            .volume(&key.team, name)
            .await
            .map_err(catalog_down)?
            .is_some()
        {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                format!("a volume named {name:?} exists already"),
            ));
        }
    }
    let nodes = g.nodes().await;
    let n = place::choose(&nodes, "", g.grace_ms(), &[], crate::ids::random_index)
        .cloned()
        .ok_or_else(|| ApiError::unavailable("no node of the cluster is up"))?;
    let resp = g
        .to_node(
            &n,
            &key.team,
            http::Request::from_parts(parts, Body::from(bytes)),
        )
        .await
        .map_err(|e| ApiError::unavailable(e.to_string()))?;
    if resp.status() != StatusCode::CREATED {
        return Ok(resp);
    }
    let (rparts, rbody) = resp.into_parts();
    let out = axum::body::to_bytes(rbody, 1 << 20)
        .await
        .map_err(|e| ApiError::unavailable(format!("reading node {}'s answer: {e}", n.id)))?;
    let made: serde_json::Value = serde_json::from_slice(&out)
        .map_err(|e| ApiError::unavailable(format!("node {}'s answer: {e}", n.id)))?;
    let field = |k: &str| {
        made.get(k)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_string()
    };
    let v = VolumePlace {
        id: field("volumeID"),
        team: key.team.clone(),
        name: field("name"),
        node: n.id.clone(),
    };
    let recorded = g.catalog.add_volume(&v).await;
    if !matches!(recorded, Ok(true)) {
        let undo = http::Request::builder()
            .method(Method::DELETE)
            .uri(format!("/volumes/{}", v.id))
            .body(Body::empty())
            .expect("a valid request");
        let _ = g.to_node(&n, &key.team, undo).await;
        return Err(match recorded {
            Ok(_) => ApiError::new(
                StatusCode::CONFLICT,
                format!("a volume named {:?} exists already", v.name),
            ),
            Err(e) => catalog_down(e),
        });
    }
    tracing::info!(volume = %v.id, node = %v.node, team = %v.team, "volume created");
    Ok(Response::from_parts(rparts, Body::from(out)))
}

async fn by_id(
    g: &Gateway,
    key: &ClusterKey,
    id: &str,
    req: Request,
) -> Result<Response, ApiError> {
    let v = g
        .catalog
        .volume(&key.team, id)
        .await
        .map_err(catalog_down)?
        .ok_or_else(|| not_found(id))?;
    let n = g.node(&v.node).await.ok_or_else(|| node_gone(&v))?;
    let delete = req.method() == Method::DELETE;
    let resp = g
        .to_node(&n, &key.team, req)
        .await
        .map_err(|e| ApiError::unavailable(e.to_string()))?;
    // Gone from its node (now, or before): gone from the catalog.
    if delete
        && matches!(
            resp.status(),
            StatusCode::NO_CONTENT | StatusCode::NOT_FOUND
        )
    {
        g.catalog.remove_volume(&v.id).await.map_err(catalog_down)?;
    }
    Ok(resp)
}

/// The node a create with `volumeMounts` (in `body`) must go to: the one
/// that holds its volumes (all of one node, else 400; an unknown name is
/// 400 as on a node). `None`: the create mounts nothing.
pub(super) async fn mounts_node(
    g: &Gateway,
    team: &str,
    body: &[u8],
) -> Result<Option<String>, ApiError> {
    let names: Vec<String> = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("volumeMounts")?.as_array().cloned())
        .unwrap_or_default()
        .iter()
        .filter_map(|m| Some(m.get("name")?.as_str()?.to_string()))
        .collect();
    let mut node: Option<(String, String)> = None;
    for name in names {
        let v = g
            .catalog
            .volume(team, &name)
            .await
            .map_err(catalog_down)?
            .ok_or_else(|| {
                ApiError::bad_request(format!("volumeMounts: no volume named {name:?}"))
            })?;
        match &node {
            Some((n, first)) if *n != v.node => {
                return Err(ApiError::bad_request(format!(
                    "volumeMounts: volumes {first:?} and {name:?} live on different hosts \
                     ({n} and {}); a sandbox mounts volumes of one host",
                    v.node
                )))
            }
            Some(_) => {}
            None => node = Some((v.node, name)),
        }
    }
    Ok(node.map(|(n, _)| n))
}

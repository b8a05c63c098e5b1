//! The REST API through a gateway: creates placed on a node, calls about a
//! sandbox sent to its node (and what they changed written to the catalog
//! at once), lists from the catalog, the rest (templates, builds,
//! snapshots) to the template node.
//!
//! The parts:
//! - `create`: a create placed on a node, tried on another when refused;
//! - `by_id`: a call about a sandbox sent to its node, and `connect` /
//!   `resume` on another node when its own is down or full;
//! - `refresh`: what a node answered about a sandbox written to the
//!   catalog;
//! - `list`: a team's sandboxes listed from the catalog;
//! - `elsewhere`: templates, builds and snapshots.

mod by_id;
mod create;
mod elsewhere;
mod list;
mod refresh;

pub(super) use refresh::note_children;

use by_id::by_id;
use create::create;
use elsewhere::elsewhere;
use list::list;

use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use http::{Method, StatusCode};

use super::forward::ForwardError;
use super::{place, Gateway};
use crate::api::ApiError;
use crate::cluster::catalog::ClusterKey;

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
        .ok_or_else(|| ApiError::unavailable("no node of the cluster is up"))?;
    Ok(g.to_node(n, &key.team, req)
        .await
        .unwrap_or_else(ForwardError::into_response))
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
}

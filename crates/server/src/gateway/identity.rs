//! Workload identity behind gateways: each node signs its sandboxes'
//! tokens with keys of its own, so a gateway's `/.well-known/jwks.json`
//! is every up node's keys together, and its discovery document is a
//! node's (every node's `[identity] issuer` names the gateways' URL). No
//! API key: relying parties read them.

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use http::StatusCode;

use super::{forward, place, Gateway};

/// Bytes of one node's key set the gateway reads at most.
const MAX_JWKS: usize = 1 << 20;

pub async fn well_known(g: &Gateway, req: Request) -> Response {
    if req.uri().path() != "/.well-known/jwks.json" {
        return g.any_node(req).await;
    }
    let mut keys: Vec<serde_json::Value> = Vec::new();
    let mut answered = 0;
    for n in g
        .nodes()
        .await
        .iter()
        .filter(|n| place::healthy(n, g.grace_ms()))
    {
        let ask = http::Request::get("/.well-known/jwks.json").body(Body::empty());
        let Ok(ask) = ask else { continue };
        let Ok(resp) = forward::forward(&g.client, &n.id, &n.status.address, ask, &[], &[]).await
        else {
            continue;
        };
        if !resp.status().is_success() {
            continue;
        }
        let Ok(bytes) = axum::body::to_bytes(resp.into_body(), MAX_JWKS).await else {
            continue;
        };
        let Ok(set) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
            continue;
        };
        answered += 1;
        for k in set["keys"].as_array().into_iter().flatten() {
            if !keys.iter().any(|o| o["kid"] == k["kid"]) {
                keys.push(k.clone());
            }
        }
    }
    if answered == 0 {
        return crate::api::ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no node of the cluster answered for its keys",
        )
        .into_response();
    }
    (
        [(http::header::CACHE_CONTROL, "max-age=60")],
        axum::Json(serde_json::json!({ "keys": keys })),
    )
        .into_response()
}

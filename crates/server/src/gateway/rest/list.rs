//! `GET /sandboxes`, `GET /v2/sandboxes`: a team's sandboxes across nodes,
//! from the catalog.

use axum::response::{IntoResponse, Response};
use http::HeaderValue;

use super::super::{place, Gateway};
use crate::api::ApiError;
use crate::cluster::catalog::ClusterKey;

pub(super) async fn list(
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
        .map_err(|e| ApiError::unavailable(e.to_string()))?;
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

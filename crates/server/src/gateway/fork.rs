//! A fork through a gateway: sent to the source's node, which starts what
//! fits there; when it answers that some children did not fit (its fork
//! capture pushed to the registry: [`crate::cluster::spread`]), the rest go
//! to other nodes by their free room, all at once, and the answer lists
//! every child in one list as a single node's fork does.

use axum::body::Body;
use axum::response::Response;
use futures::future::join_all;
use http::{HeaderValue, StatusCode};

use super::{place, rest, Gateway};
use crate::api::ApiError;
use crate::cluster::catalog::{ClusterKey, Node};
use crate::cluster::spread::Elsewhere;
use crate::cluster::{FORK_FROM_HEADER, SPREAD_HEADER};

/// How children not yet placed are split over `nodes` (already filtered):
/// the freest first, each taking what it has room for. What no node has
/// room for is left over.
pub fn plan(nodes: &[Node], count: usize) -> (Vec<(Node, usize)>, usize) {
    let mut open: Vec<&Node> = nodes.iter().filter(|n| place::free(n) > 0).collect();
    open.sort_by_key(|n| std::cmp::Reverse(place::free(n)));
    let mut left = count;
    let mut out = Vec::new();
    for n in open {
        if left == 0 {
            break;
        }
        let c = place::free(n).min(left);
        out.push((n.clone(), c));
        left -= c;
    }
    (out, left)
}

fn child_error(code: StatusCode, message: &str) -> serde_json::Value {
    serde_json::json!({ "error": { "code": code.as_u16(), "message": message } })
}

/// Fork sandbox `id` (on node `n`) with the request `parts` and `body`.
pub async fn fork(
    g: &Gateway,
    key: &ClusterKey,
    id: &str,
    n: &Node,
    parts: http::request::Parts,
    body: bytes::Bytes,
) -> Result<Response, ApiError> {
    let mut req = http::Request::from_parts(parts.clone(), Body::from(body.clone()));
    req.headers_mut()
        .insert(SPREAD_HEADER, HeaderValue::from_static("1"));
    let resp = match g.to_node(n, &key.team, req).await {
        Ok(r) => r,
        Err(e) => return Ok(e.into_response()),
    };
    if !resp.status().is_success() {
        return Ok(resp);
    }
    let (rparts, rbody) = resp.into_parts();
    let bytes = axum::body::to_bytes(rbody, 16 << 20)
        .await
        .map_err(|e| ApiError::unavailable(e.to_string()))?;
    let mut entries: Vec<serde_json::Value> = serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::unavailable(format!("node {}'s fork answer: {e}", n.id)))?;
    let elsewhere: Option<Elsewhere> = entries
        .iter()
        .position(|e| e.get("elsewhere").is_some())
        .map(|i| entries.remove(i))
        .and_then(|e| serde_json::from_value(e["elsewhere"].clone()).ok());
    rest::note_children(g, n, &key.team, &entries).await;
    if let Some(rest_of) = elsewhere {
        entries.extend(elsewhere_children(g, key, id, n, &parts, &body, &rest_of).await);
        if let Err(e) = crate::cluster::captures::forget(&g.catalog, &rest_of.capture).await {
            tracing::warn!(capture = %rest_of.capture, "catalog: {e}");
        }
    }
    let mut rparts = rparts;
    rparts.headers.remove(http::header::CONTENT_LENGTH);
    Ok(Response::from_parts(
        rparts,
        Body::from(serde_json::to_vec(&entries).unwrap_or_default()),
    ))
}

/// The children of `rest_of` started on nodes other than `source`.
async fn elsewhere_children(
    g: &Gateway,
    key: &ClusterKey,
    id: &str,
    source: &Node,
    parts: &http::request::Parts,
    body: &bytes::Bytes,
    rest_of: &Elsewhere,
) -> Vec<serde_json::Value> {
    let timeout = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("timeout").cloned());
    let nodes: Vec<Node> = g
        .nodes()
        .await
        .into_iter()
        .filter(|x| x.id != source.id && place::healthy(x, g.grace_ms()))
        .collect();
    let (plan, left) = plan(&nodes, rest_of.count);
    tracing::info!(
        sandbox = %id,
        capture = %rest_of.capture,
        nodes = plan.len(),
        left,
        "fork: {} children on other nodes",
        rest_of.count
    );
    let sends = plan.iter().map(|(x, c)| {
        let mut b = serde_json::json!({ "count": c });
        if let Some(t) = &timeout {
            b["timeout"] = t.clone();
        }
        let mut req =
            http::Request::from_parts(parts.clone(), Body::from(serde_json::to_vec(&b).unwrap()));
        req.headers_mut().remove(http::header::CONTENT_LENGTH);
        if let Ok(v) = HeaderValue::from_str(&rest_of.capture) {
            req.headers_mut().insert(FORK_FROM_HEADER, v);
        }
        async move {
            let failed = |code, msg: String| vec![child_error(code, &msg); *c];
            let resp = match g.to_node(x, &key.team, req).await {
                Ok(r) => r,
                Err(e) => return failed(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
            };
            let status = resp.status();
            let bytes = match axum::body::to_bytes(resp.into_body(), 16 << 20).await {
                Ok(b) => b,
                Err(e) => return failed(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
            };
            if !status.is_success() {
                let msg = serde_json::from_slice::<serde_json::Value>(&bytes)
                    .ok()
                    .and_then(|v| v["message"].as_str().map(str::to_string))
                    .unwrap_or_else(|| format!("node {} answered {status}", x.id));
                return failed(status, msg);
            }
            let entries: Vec<serde_json::Value> =
                serde_json::from_slice(&bytes).unwrap_or_else(|e| {
                    vec![
                        child_error(
                            StatusCode::SERVICE_UNAVAILABLE,
                            &format!("node {}'s fork answer: {e}", x.id)
                        );
                        *c
                    ]
                });
            rest::note_children(g, x, &key.team, &entries).await;
            entries
        }
    });
    let mut out: Vec<serde_json::Value> = join_all(sends).await.into_iter().flatten().collect();
    out.extend(
        std::iter::repeat_with(|| {
            child_error(
                StatusCode::TOO_MANY_REQUESTS,
                "no node of the cluster had room for this child",
            )
        })
        .take(left),
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::catalog::NodeStatus;

    fn node(id: &str, capacity: usize, live: usize) -> Node {
        Node {
            id: id.into(),
            status: NodeStatus {
                capacity,
                live,
                ..Default::default()
            },
            silent_ms: 0,
            reserved: 0,
            placed: 0,
        }
    }

    #[test]
    fn children_go_to_the_freest_nodes_first_and_what_does_not_fit_is_left() {
        let nodes = vec![node("a", 10, 8), node("b", 10, 0), node("c", 10, 10)];
        let (p, left) = plan(&nodes, 5);
        assert_eq!(p.len(), 1);
        assert_eq!((p[0].0.id.as_str(), p[0].1), ("b", 5));
        assert_eq!(left, 0);
        let (p, left) = plan(&nodes, 13);
        let got: Vec<(&str, usize)> = p.iter().map(|(n, c)| (n.id.as_str(), *c)).collect();
        assert_eq!(got, vec![("b", 10), ("a", 2)]);
        assert_eq!(left, 1);
        assert_eq!(plan(&[], 3).1, 3);
    }
}

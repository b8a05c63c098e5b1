//! What a node answered about a sandbox (or a fork's children), written
//! to the catalog.

use axum::body::Body;
use http::StatusCode;

use super::super::Gateway;
use crate::cluster::catalog::{Node, SandboxRow};

/// Read sandbox `id` from its node and write it to the catalog (or mark it
/// gone); failures only log: the node's next full list heals the catalog.
pub(super) async fn refresh(
    g: &Gateway,
    n: &Node,
    team: &str,
    id: &str,
    reservation: Option<&str>,
) {
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
pub(super) fn row_of(team: &str, mut v: serde_json::Value) -> Option<SandboxRow> {
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

/// Fork children a node started (entries of its fork answer): routed to
/// it and written to the catalog.
pub(in crate::gateway) async fn note_children(
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

/// The sandbox ids in a fork's answer (`[{"sandbox": {...}} | {"error": ...}]`).
fn children(entries: &[serde_json::Value]) -> Vec<String> {
    entries
        .iter()
        .filter_map(|e| e.get("sandbox")?.get("sandboxID")?.as_str())
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn fork_answers_name_their_children() {
        let a: Vec<serde_json::Value> = serde_json::from_str(
            r#"[{"sandbox":{"sandboxID":"a"}},{"error":{"code":429}},{"sandbox":{"sandboxID":"b"}}]"#,
        )
        .unwrap();
        assert_eq!(children(&a), vec!["a", "b"]);
        assert!(children(&[]).is_empty());
    }
}

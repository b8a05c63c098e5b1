//! Listing: sandboxes (paged, filtered, newest first), snapshots and
//! templates.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use base64::Engine as _;
use http::{HeaderMap, HeaderValue};
use serde::Deserialize;

use super::super::extract::Query;
use super::super::{ApiError, Authed};
use super::{detail, DetailOut};
use crate::db::ListFilter;
use crate::model::{SandboxRecord, SandboxState};
use crate::state::AppState;

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
pub struct ListQuery {
    metadata: Option<String>,
    state: Option<String>,
    template: Option<String>,
    started_after: Option<String>,
    started_before: Option<String>,
    order: Option<String>,
    limit: Option<usize>,
    next_token: Option<String>,
}

const MAX_PAGE: usize = 1000;

fn parse_filter(q: &ListQuery, default_states: &[SandboxState]) -> Result<ListFilter, ApiError> {
    let mut f = ListFilter {
        limit: q.limit.unwrap_or(100).clamp(1, MAX_PAGE),
        ..Default::default()
    };
    f.states = match q.state.as_deref().filter(|s| !s.is_empty()) {
        None => default_states.to_vec(),
        Some(list) => list
            .split(',')
            .map(|s| match s.trim() {
                "running" => Ok(SandboxState::Running),
                "paused" => Ok(SandboxState::Paused),
                other => Err(ApiError::bad_request(format!(
                    "unknown state {other:?} (running, paused)"
                ))),
            })
            .collect::<Result<_, _>>()?,
    };
    if let Some(m) = q.metadata.as_deref().filter(|m| !m.is_empty()) {
        // The SDKs percent-encode each key and value, join them as a query
        // string (encoding them again) and send that as one parameter (a
        // third time). Axum undid the last, this undoes the other two.
        let pairs: Vec<(String, String)> = serde_urlencoded::from_str(m)
            .map_err(|e| ApiError::bad_request(format!("bad metadata filter: {e}")))?;
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .map(|c| c.into_owned())
                .map_err(|_| ApiError::bad_request("metadata filter is not UTF-8"))
        };
        for (k, v) in pairs {
            f.metadata.insert(decode(&k)?, decode(&v)?);
        }
    }
    f.template = q.template.clone().filter(|t| !t.is_empty());
    f.started_after_ms = parse_time("startedAfter", q.started_after.as_deref())?;
    f.started_before_ms = parse_time("startedBefore", q.started_before.as_deref())?;
    // Newest first unless asked otherwise, as E2B lists.
    f.descending = match q.order.as_deref() {
        Some("asc") => false,
        None | Some("") | Some("desc") => true,
        Some(o) => {
            return Err(ApiError::bad_request(format!(
                "order must be asc or desc, got {o:?}"
            )))
        }
    };
    if let Some(tok) = q.next_token.as_deref().filter(|t| !t.is_empty()) {
        f.after =
            Some(decode_token(tok).ok_or_else(|| ApiError::bad_request("invalid nextToken"))?);
    }
    Ok(f)
}

/// An RFC 3339 time in a query, as Unix milliseconds.
fn parse_time(name: &str, value: Option<&str>) -> Result<Option<i64>, ApiError> {
    let Some(t) = value.filter(|t| !t.is_empty()) else {
        return Ok(None);
    };
    let at = time::OffsetDateTime::parse(t, &time::format_description::well_known::Rfc3339)
        .map_err(|_| ApiError::bad_request(format!("{name} must be RFC 3339, got {t:?}")))?;
    Ok(Some((at.unix_timestamp_nanos() / 1_000_000) as i64))
}

fn encode_token(r: &SandboxRecord) -> String {
    page_token(r.started_at_ms, &r.id)
}

/// The `x-next-token` after the row `(created or started ms, id)` (sandbox
/// and secret lists page alike).
pub fn page_token(started_ms: i64, id: &str) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("{started_ms}:{id}"))
}

/// The filter of a list call's query string, as this API parses it (a
/// gateway lists from the catalog with the same rules). `paged`: the v2
/// list (running and paused by default) rather than v1 (running).
pub fn list_filter(query: &str, paged: bool) -> Result<ListFilter, ApiError> {
    let q: ListQuery = serde_urlencoded::from_str(query)
        .map_err(|e| ApiError::bad_request(format!("bad query: {e}")))?;
    let defaults = [SandboxState::Running, SandboxState::Paused];
    parse_filter(&q, if paged { &defaults } else { &defaults[..1] })
}

/// What [`page_token`] made.
pub(crate) fn decode_token(t: &str) -> Option<(i64, String)> {
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(t)
        .ok()?;
    let s = String::from_utf8(raw).ok()?;
    let (ms, id) = s.split_once(':')?;
    Some((ms.parse().ok()?, id.to_string()))
}

async fn list(s: &AppState, team: &str, q: ListQuery, paged: bool) -> Result<Response, ApiError> {
    let defaults = [SandboxState::Running, SandboxState::Paused];
    let mut f = parse_filter(&q, if paged { &defaults } else { &defaults[..1] })?;
    f.team = Some(team.to_string());
    let page = f.limit;
    if paged {
        f.limit = page + 1; // one more tells whether there is a next page
    } else {
        f.limit = usize::MAX >> 1;
    }
    let mut rows = s.manager.list(&f)?;
    let mut headers = HeaderMap::new();
    if paged && rows.len() > page {
        rows.truncate(page);
        if let Some(last) = rows.last() {
            headers.insert(
                "x-next-token",
                HeaderValue::from_str(&encode_token(last)).expect("base64 is a valid header"),
            );
        }
    }
    let out: Vec<DetailOut> = rows.into_iter().map(|r| detail(r, None)).collect();
    Ok((headers, Json(out)).into_response())
}

pub async fn list_v2(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Query(q): Query<ListQuery>,
) -> Result<Response, ApiError> {
    list(&s, &key.team, q, true).await
}

pub async fn list_v1(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Query(q): Query<ListQuery>,
) -> Result<Response, ApiError> {
    list(&s, &key.team, q, false).await
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SnapshotsQuery {
    #[serde(rename = "sandboxID")]
    sandbox_id: Option<String>,
    /// Only snapshots with this name (with or without its `:tag`).
    name: Option<String>,
    limit: Option<usize>,
    next_token: Option<String>,
}

pub async fn list_snapshots(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Query(q): Query<SnapshotsQuery>,
) -> Result<Response, ApiError> {
    let mut rows = s
        .manager
        .list_snapshots(q.sandbox_id.as_deref().filter(|x| !x.is_empty()))?;
    let db = s.manager.db();
    rows.retain(|r| {
        db.snapshot_team(r)
            .ok()
            .flatten()
            .is_none_or(|t| t == key.team)
    });
    if let Some(name) = q.name.as_deref().filter(|n| !n.is_empty()) {
        rows.retain(|r| crate::model::has_name(&r.names, name));
    }
    let skip = match q.next_token.as_deref().filter(|t| !t.is_empty()) {
        Some(t) => t
            .parse::<usize>()
            .map_err(|_| ApiError::bad_request("invalid nextToken"))?,
        None => 0,
    };
    let limit = q.limit.unwrap_or(100).clamp(1, MAX_PAGE);
    let page: Vec<_> = rows
        .iter()
        .skip(skip)
        .take(limit)
        .map(|r| serde_json::json!({ "snapshotID": r.id, "names": r.names }))
        .collect();
    let mut headers = HeaderMap::new();
    if skip + limit < rows.len() {
        headers.insert(
            "x-next-token",
            HeaderValue::from_str(&(skip + limit).to_string()).expect("digits"),
        );
    }
    Ok((headers, Json(page)).into_response())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    #[test]
    fn paging_tokens_round_trip_and_reject_garbage() {
        let mut r = test_record();
        r.started_at_ms = 1234;
        r.id = "iabc".into();
        assert_eq!(decode_token(&encode_token(&r)), Some((1234, "iabc".into())));
        assert_eq!(decode_token("!!!"), None);
        assert_eq!(decode_token("bm90aGluZw"), None); // "nothing": no colon
    }

    #[test]
    fn metadata_filter_is_decoded_once_more() {
        // What arrives after the query string's own decoding, for
        // metadata {"k y/é": "a&b=c %", "env": "prod"} (seen on the wire).
        let q = ListQuery {
            metadata: Some("k%2520y%2F%25C3%25A9=a%2526b%253Dc%2520%2525&env=prod".into()),
            ..Default::default()
        };
        let f = parse_filter(&q, &[SandboxState::Running]).unwrap();
        assert_eq!(f.metadata.get("k y/é").map(String::as_str), Some("a&b=c %"));
        assert_eq!(f.metadata.get("env").map(String::as_str), Some("prod"));
        let bad = ListQuery {
            state: Some("running,zombie".into()),
            ..Default::default()
        };
        assert!(parse_filter(&bad, &[]).is_err());
    }

    #[test]
    fn lists_are_newest_first_and_bounded_in_time() {
        let q = ListQuery {
            started_before: Some("2026-12-03T10:00:00Z".into()),
            ..Default::default()
        };
        let f = parse_filter(&q, &[]).unwrap();
        assert!(f.descending);
        assert_eq!(f.started_before_ms, Some(1_796_292_000_000));
        let asc = ListQuery {
            order: Some("asc".into()),
            started_after: Some("yesterday".into()),
            ..Default::default()
        };
        assert!(parse_filter(&asc, &[]).is_err());
    }

    fn test_record() -> SandboxRecord {
        SandboxRecord {
            id: String::new(),
            template_id: "base".into(),
            alias: None,
            client_id: "tine".into(),
            state: SandboxState::Running,
            metadata: BTreeMap::new(),
            env_vars: BTreeMap::new(),
            cpu_count: 1,
            memory_mb: 256,
            disk_size_mb: 0,
            envd_version: crate::sandboxes::ENVD_VERSION.into(),
            envd_access_token: "t".into(),
            started_at_ms: 0,
            end_at_ms: 0,
            auto_pause: false,
            error: None,
            network: Default::default(),
            traffic_token: None,
            lifecycle: Default::default(),
            team: "default".into(),
            volume_mounts: Vec::new(),
            iam: Default::default(),
        }
    }
}

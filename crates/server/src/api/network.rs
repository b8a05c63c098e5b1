//! A sandbox's network policy through the E2B API: the `network` and
//! `allow_internet_access` fields of create, and `PUT
//! /sandboxes/{id}/network` (`Sandbox.update_network`). The rules are in
//! [`crate::network`].

use std::sync::Arc;

use axum::extract::State;
use http::StatusCode;
use serde::Deserialize;

use super::{json_body, ApiError, Owned};
use crate::network::policy::{NetworkPolicy, Unsupported};
use crate::state::AppState;

/// The policy a create request states, checked; `None` when it states
/// none.
pub(super) fn from_create(
    network: Option<serde_json::Value>,
    allow_internet_access: Option<bool>,
) -> Result<Option<NetworkPolicy>, ApiError> {
    if network.as_ref().is_none_or(|v| v.is_null()) && allow_internet_access.is_none() {
        return Ok(None);
    }
    let value = network
        .filter(|v| !v.is_null())
        .unwrap_or_else(|| serde_json::json!({}));
    let (policy, unsupported) = parse(value)?;
    let (policy, _) = policy
        .from_request(allow_internet_access, &unsupported)
        .map_err(ApiError::bad_request)?;
    Ok(Some(policy))
}

fn parse(value: serde_json::Value) -> Result<(NetworkPolicy, Unsupported), ApiError> {
    let bad = |e: serde_json::Error| ApiError::bad_request(format!("invalid network: {e}"));
    let policy: NetworkPolicy = serde_json::from_value(value.clone()).map_err(bad)?;
    let unsupported: Unsupported = serde_json::from_value(value).map_err(bad)?;
    Ok((policy, unsupported))
}

/// `SandboxNetworkUpdateConfig`.
#[derive(Deserialize)]
struct UpdateBody {
    #[serde(default)]
    allow_internet_access: Option<bool>,
    #[serde(flatten)]
    rest: serde_json::Map<String, serde_json::Value>,
}

/// Replace the sandbox's egress rules (what the body leaves out is
/// cleared); who may reach its ports stays as it was created.
pub async fn update(
    Owned { id, .. }: Owned,
    State(s): State<Arc<AppState>>,
    body: axum::body::Body,
) -> Result<StatusCode, ApiError> {
    let b: UpdateBody = json_body(body, s.manager.config.max_body_bytes).await?;
    let (mut policy, unsupported) = parse(serde_json::Value::Object(b.rest))?;
    // Inbound settings are not part of an update.
    policy.allow_public_traffic = None;
    policy.mask_request_host = None;
    policy.https_ports = None;
    let (policy, _) = policy
        .from_request(b.allow_internet_access, &unsupported)
        .map_err(ApiError::bad_request)?;
    s.manager.update_network(&id, policy).await?;
    Ok(StatusCode::NO_CONTENT)
}

//! A sandbox's network policy through the E2B API: the `network` and
//! `allow_internet_access` fields of create, and `PUT
//! /sandboxes/{id}/network` (`Sandbox.update_network`). The rules are in
//! [`crate::network`].

use std::sync::Arc;

use axum::extract::State;
use http::StatusCode;
use serde::Deserialize;

use super::{ApiError, JsonBody, Owned};
use crate::network::policy::NetworkPolicy;
use crate::state::AppState;

/// The policy a create request states, checked; `None` when it states
/// none.
pub(super) async fn from_create(
    s: &AppState,
    network: Option<serde_json::Value>,
    allow_internet_access: Option<bool>,
) -> Result<Option<NetworkPolicy>, ApiError> {
    if network.as_ref().is_none_or(|v| v.is_null()) && allow_internet_access.is_none() {
        return Ok(None);
    }
    let value = network
        .filter(|v| !v.is_null())
        .unwrap_or_else(|| serde_json::json!({}));
    let (policy, _) = parse(value)?
        .from_request(allow_internet_access)
        .map_err(ApiError::bad_request)?;
    check_proxy(s, &policy).await?;
    Ok(Some(policy))
}

fn parse(value: serde_json::Value) -> Result<NetworkPolicy, ApiError> {
    serde_json::from_value(value)
        .map_err(|e| ApiError::bad_request(format!("invalid network: {e}")))
}

/// An egress proxy must resolve, to the internet, before the sandbox
/// (or its new policy) exists.
async fn check_proxy(s: &AppState, policy: &NetworkPolicy) -> Result<(), ApiError> {
    if let Some(p) = &policy.egress_proxy {
        s.manager
            .network()
            .check_proxy(p)
            .await
            .map_err(ApiError::bad_request)?;
    }
    Ok(())
}

/// `SandboxNetworkUpdateConfig`.
#[derive(Deserialize)]
pub struct UpdateBody {
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
    JsonBody(b): JsonBody<UpdateBody>,
) -> Result<StatusCode, ApiError> {
    let mut policy = parse(serde_json::Value::Object(b.rest))?;
    // Inbound settings are not part of an update.
    policy.allow_public_traffic = None;
    policy.mask_request_host = None;
    policy.https_ports = None;
    let (policy, _) = policy
        .from_request(b.allow_internet_access)
        .map_err(ApiError::bad_request)?;
    check_proxy(&s, &policy).await?;
    s.manager.update_network(&id, policy).await?;
    Ok(StatusCode::NO_CONTENT)
}

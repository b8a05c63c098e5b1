//! E2B REST routes for sandboxes (the E2B REST API; see docs/api.md). Handlers parse
//! and shape JSON; the work is in [`crate::sandboxes::Manager`].
//!
//! Here: the shapes of a sandbox, create, info, kill, timeouts; `list`:
//! listing sandboxes, snapshots and templates; `captures`: pause,
//! connect, snapshots, fork; `observe`: metrics and logs.

mod captures;
mod list;
mod observe;

pub use captures::{connect, create_snapshot, fork, pause};
pub(crate) use list::decode_token;
pub use list::{list_filter, list_snapshots, list_v1, list_v2, page_token};
pub use observe::{events, logs, metrics};

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::{HeaderMap, StatusCode};
use serde::{Deserialize, Serialize};

use super::{ApiError, Authed, JsonBody, Owned};
use crate::model::SandboxRecord;
use crate::sandboxes::CreateRequest;
use crate::state::AppState;

pub(crate) use crate::model::rfc3339;

/// `Sandbox`: what create (and connect) return.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct SandboxOut {
    #[serde(rename = "templateID")]
    template_id: String,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    client_id: String,
    alias: Option<String>,
    envd_version: String,
    envd_access_token: String,
    traffic_access_token: Option<String>,
    domain: String,
}

/// `SandboxDetail` / `ListedSandbox`.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct DetailOut {
    #[serde(rename = "templateID")]
    template_id: String,
    alias: Option<String>,
    #[serde(rename = "sandboxID")]
    sandbox_id: String,
    #[serde(rename = "clientID")]
    client_id: String,
    started_at: String,
    end_at: String,
    envd_version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    envd_access_token: Option<String>,
    cpu_count: u32,
    #[serde(rename = "memoryMB")]
    memory_mb: u32,
    #[serde(rename = "diskSizeMB")]
    disk_size_mb: u32,
    metadata: BTreeMap<String, String>,
    state: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    domain: Option<String>,
    allow_internet_access: bool,
    network: crate::network::NetworkPolicy,
    lifecycle: LifecycleOut,
    volume_mounts: Vec<MountOut>,
}

/// `SandboxVolumeMount` of a detail.
#[derive(Serialize)]
struct MountOut {
    name: String,
    path: String,
}

/// `SandboxLifecycle` of a detail.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct LifecycleOut {
    on_timeout: &'static str,
    auto_resume: bool,
}

/// The field of a cluster node's create answer that carries [`listed`].
pub const LISTED_FIELD: &str = "tineListed";

/// A sandbox as `GET /v2/sandboxes` lists it (no secrets): what a node in
/// a cluster publishes of it to the catalog.
pub fn listed(r: SandboxRecord) -> serde_json::Value {
    serde_json::to_value(detail(r, None)).unwrap_or_default()
}

fn detail(r: SandboxRecord, with_secrets: Option<&str>) -> DetailOut {
    DetailOut {
        template_id: r.template_id,
        alias: r.alias,
        sandbox_id: r.id,
        client_id: r.client_id,
        started_at: rfc3339(r.started_at_ms),
        end_at: rfc3339(r.end_at_ms),
        envd_version: r.envd_version,
        envd_access_token: with_secrets.map(|_| r.envd_access_token),
        cpu_count: r.cpu_count,
        memory_mb: r.memory_mb,
        disk_size_mb: r.disk_size_mb,
        metadata: r.metadata,
        state: r.state.e2b().unwrap_or("running"),
        domain: with_secrets.map(str::to_string),
        allow_internet_access: !r
            .network
            .deny_out
            .iter()
            .flatten()
            .any(|d| d == crate::network::policy::ALL_TRAFFIC),
        network: r.network.shown(),
        lifecycle: LifecycleOut {
            on_timeout: if r.auto_pause { "pause" } else { "kill" },
            auto_resume: r.lifecycle.auto_resume,
        },
        volume_mounts: r
            .volume_mounts
            .into_iter()
            .map(|m| MountOut {
                name: m.name,
                path: m.path,
            })
            .collect(),
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct NewSandbox {
    #[serde(rename = "templateID")]
    template_id: Option<String>,
    timeout: Option<i64>,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
    #[serde(default)]
    env_vars: Option<BTreeMap<String, String>>,
    auto_pause: Option<bool>,
    /// False: the pause at timeout keeps only the disk.
    auto_pause_memory: Option<bool>,
    auto_resume: Option<AutoResume>,
    cpu_count: Option<u32>,
    #[serde(rename = "memoryMB")]
    memory_mb: Option<u32>,
    /// The SDKs send this one in snake_case.
    #[serde(rename = "allow_internet_access")]
    allow_internet_access: Option<bool>,
    network: Option<serde_json::Value>,
    /// Features tine does not have: refused rather than ignored, so a
    /// sandbox never starts without what it was asked to have.
    volume_mounts: Option<serde_json::Value>,
    iam: Option<serde_json::Value>,
    /// The SDK's MCP config: an object, or null. The SDK itself starts the
    /// gateway in the sandbox (`mcp-gateway --config`, from the template
    /// `mcp-gateway`), so the server only checks its shape.
    mcp: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct AutoResume {
    #[serde(default)]
    enabled: bool,
}

/// `null`, `{}` or `[]`: what an SDK sends for an unset option.
fn is_empty_json(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Null => true,
        serde_json::Value::Object(m) => m.is_empty(),
        serde_json::Value::Array(a) => a.is_empty(),
        _ => false,
    }
}

/// The template `Sandbox.create(mcp=…)` starts from.
const MCP_TEMPLATE: &str = "mcp-gateway";
/// Why a create with `mcp` fails on a server without that template.
const MCP_MISSING: &str =
    "the template mcp-gateway (for Sandbox.create(mcp=...)) is not built on this \
     server yet: scripts/build-mcp-gateway.sh builds it; scripts/run.sh starts that build in the \
     background once the server listens, and its log ($TINE_DATA_DIR/mcp-gateway/build.log) \
     says how far it got or why it failed; try again when it has finished";

/// `mcp` is an object (the servers the SDK starts in the sandbox) or null.
fn check_mcp(mcp: Option<&serde_json::Value>) -> Result<(), ApiError> {
    match mcp {
        None | Some(serde_json::Value::Null | serde_json::Value::Object(_)) => Ok(()),
        Some(_) => Err(ApiError::bad_request(
            "mcp must be an object of MCP server configs (or null)",
        )),
    }
}

/// The lifecycle a create asks for.
fn lifecycle_of(req: &NewSandbox) -> Result<crate::model::Lifecycle, ApiError> {
    let l = crate::model::Lifecycle {
        auto_resume: req.auto_resume.as_ref().is_some_and(|a| a.enabled),
        auto_pause_disk_only: req.auto_pause_memory == Some(false),
        paused_disk_only: false,
    };
    if l.auto_resume && l.auto_pause_disk_only {
        return Err(ApiError::bad_request(
            "autoResume cannot be combined with autoPauseMemory: false: a sandbox paused \
             without its memory must be resumed explicitly (connect)",
        ));
    }
    Ok(l)
}

/// `POST /v2/sandboxes` (and v1): with an `Idempotency-Key`, a retry gets
/// the sandbox the first attempt made.
pub async fn create(
    Authed(api_key): Authed,
    State(s): State<Arc<AppState>>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Response, ApiError> {
    let bytes = super::body_bytes(body, s.manager.config.max_body_bytes).await?;
    let attempt = || async {
        let rec = create_sandbox(&s, &api_key.team, &bytes).await?;
        // A cluster node hands its gateway the sandbox as lists show it,
        // for the catalog (the gateway takes the field out).
        let listed_now = s.cluster_secret.as_ref().map(|_| listed(rec.clone()));
        let mut out = serde_json::to_value(sandbox_out(rec, &s.domain))
            .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))?;
        if let (Some(l), Some(o)) = (listed_now, out.as_object_mut()) {
            o.insert(LISTED_FIELD.into(), l);
        }
        Ok((StatusCode::CREATED, out))
    };
    let (status, out) = match super::idempotency::key_of(&headers)? {
        Some(key) => {
            s.idempotency
                .run(&api_key.id, &key, &bytes, attempt)
                .await?
        }
        None => attempt().await?,
    };
    Ok((status, Json(out)).into_response())
}

/// Secret placeholders are resolved only in `network.rules` headers, by
/// the egress proxy: in env vars or metadata they would reach the guest
/// (or listings) as text, so they are refused rather than left there.
fn no_placeholders(
    env_vars: Option<&BTreeMap<String, String>>,
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<(), ApiError> {
    use crate::network::transform::has_placeholder;
    for (field, map) in [("envVars", env_vars), ("metadata", metadata)] {
        for (k, v) in map.into_iter().flatten() {
            if has_placeholder(k) || has_placeholder(v) {
                return Err(ApiError::bad_request(format!(
                    "{field}[{k:?}]: secret placeholders (${{e2b.secrets.…}}) are resolved only \
                     in network.rules header transforms; the guest never gets a secret's value"
                )));
            }
        }
    }
    Ok(())
}

async fn create_sandbox(s: &AppState, team: &str, body: &[u8]) -> Result<SandboxRecord, ApiError> {
    let req: NewSandbox = super::parse_json(body)?;
    let volume_mounts = match req.volume_mounts.as_ref().filter(|v| !is_empty_json(v)) {
        Some(m) => super::volumes::mounts_of(s, team, m)?,
        None => Vec::new(),
    };
    let iam = match req.iam.as_ref().filter(|v| !v.is_null()) {
        Some(v) => crate::identity::parse_iam(v).map_err(ApiError::bad_request)?,
        None => Default::default(),
    };
    check_mcp(req.mcp.as_ref())?;
    no_placeholders(req.env_vars.as_ref(), req.metadata.as_ref())?;
    let lifecycle = lifecycle_of(&req)?;
    let network = super::network::from_create(s, req.network, req.allow_internet_access).await?;
    if let Some(n) = &network {
        n.check_tokens(&iam).map_err(ApiError::bad_request)?;
    }
    let template_id = req
        .template_id
        .unwrap_or_else(|| crate::templates::DEFAULT_TEMPLATE.into());
    // Only with captures, and only for what this node lacks: a snapshot
    // or template made on another node, pulled from the registry
    // (`ensure_local` leaves a snapshot id known here alone).
    if let Some(c) = s
        .captures
        .as_ref()
        .filter(|_| !s.manager.templates().exists(&template_id))
    {
        c.ensure_local(s.manager.db(), team, &template_id)
            .await
            .map_err(|e| ApiError::new(http::StatusCode::BAD_GATEWAY, e.to_string()))?;
    }
    if req.mcp.as_ref().is_some_and(|m| !m.is_null())
        && template_id == MCP_TEMPLATE
        && !s.manager.templates().exists(&template_id)
    {
        return Err(ApiError::not_found(MCP_MISSING));
    }
    super::templates::check_visible(s, team, &template_id)?;
    Ok(s.manager
        .create(CreateRequest {
            template_id,
            timeout_secs: req.timeout,
            metadata: req.metadata.unwrap_or_default(),
            env_vars: req.env_vars.unwrap_or_default(),
            auto_pause: req.auto_pause.unwrap_or(false),
            lifecycle,
            cpu_count: req.cpu_count,
            memory_mb: req.memory_mb,
            network,
            team: team.to_string(),
            volume_mounts,
            iam,
        })
        .await?)
}

fn sandbox_out(rec: SandboxRecord, domain: &str) -> SandboxOut {
    SandboxOut {
        template_id: rec.template_id,
        sandbox_id: rec.id,
        client_id: rec.client_id,
        alias: rec.alias,
        envd_version: rec.envd_version,
        envd_access_token: rec.envd_access_token,
        traffic_access_token: rec.traffic_token,
        domain: domain.to_string(),
    }
}

pub async fn get_one(
    Owned { id, .. }: Owned,
    State(s): State<Arc<AppState>>,
) -> Result<Response, ApiError> {
    let rec = s.manager.get(&id)?;
    Ok(Json(detail(rec, Some(&s.domain))).into_response())
}

pub async fn kill(
    Owned { id, .. }: Owned,
    State(s): State<Arc<AppState>>,
) -> Result<StatusCode, ApiError> {
    s.manager.kill(&id, "killed through the API").await?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
pub struct TimeoutBody {
    timeout: i64,
}

pub async fn set_timeout(
    Owned { id, .. }: Owned,
    State(s): State<Arc<AppState>>,
    JsonBody(b): JsonBody<TimeoutBody>,
) -> Result<StatusCode, ApiError> {
    s.manager.set_timeout(&id, b.timeout)?;
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Deserialize)]
pub struct RefreshBody {
    duration: Option<i64>,
}

/// Extends the time to live by `duration` seconds (default 60) from now.
pub async fn refresh(
    Owned { id, .. }: Owned,
    State(s): State<Arc<AppState>>,
    JsonBody(b): JsonBody<RefreshBody>,
) -> Result<StatusCode, ApiError> {
    let d = b.duration.unwrap_or(60);
    if !(0..=3600).contains(&d) {
        return Err(ApiError::bad_request(
            "duration must be between 0 and 3600 seconds",
        ));
    }
    s.manager.set_timeout(&id, d)?;
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mcp_is_an_object_or_null() {
        let req: NewSandbox =
            serde_json::from_str(r#"{"templateID":"mcp-gateway","mcp":{"time":{},"memory":{}}}"#)
                .unwrap();
        assert!(check_mcp(req.mcp.as_ref()).is_ok());
        for ok in ["null", "{}"] {
            let v: serde_json::Value = serde_json::from_str(ok).unwrap();
            assert!(check_mcp(Some(&v)).is_ok(), "{ok}");
        }
        assert!(check_mcp(None).is_ok());
        for bad in ["[]", "\"time\"", "3", "true"] {
            let v: serde_json::Value = serde_json::from_str(bad).unwrap();
            let e = check_mcp(Some(&v)).unwrap_err();
            assert!(
                e.message.contains("mcp must be an object"),
                "{bad}: {}",
                e.message
            );
            assert_eq!(e.status, StatusCode::BAD_REQUEST);
        }
    }
}

//! The envd-compatible API (what E2B's envd serves; see docs/api.md).
//!
//! Connect RPC services `process.Process` ([`process`]) and
//! `filesystem.Filesystem` ([`filesystem`]) on `POST /<pkg.Service>/<Method>`,
//! and the REST routes `/health`, `/files` ([`files`]), `/init`, `/envs`
//! and `/metrics` ([`host`]). [`auth`] checks the access token that `/init`
//! sets; [`user`] resolves who each call runs as.

mod auth;
mod error;
mod files;
mod filesystem;
mod host;
mod process;
mod proto;
mod protobin;
mod rpc;
#[cfg(test)]
mod tests;
mod time;
mod trust;
mod user;
mod volumes;
mod xattr;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;

use self::error::{EnvdError, Result};
use self::user::User;

/// The envd version advertised to the SDKs (one definition, shared with
/// the host: `tine_agent_client::ENVD_VERSION`).
pub const ENVD_VERSION: &str = tine_agent_client::ENVD_VERSION;

/// The user calls run as when they name none (E2B images have `user`).
pub const DEFAULT_USER: &str = "user";

/// What `/init` sets for every later call.
#[derive(Debug, Clone, Default)]
pub struct Defaults {
    pub env_vars: BTreeMap<String, String>,
    pub user: Option<String>,
    pub workdir: Option<PathBuf>,
}

/// The agent's shared state.
pub struct Envd {
    processes: process::Table,
    watchers: filesystem::Watchers,
    defaults: RwLock<Defaults>,
    auth: auth::AccessToken,
    cpu: std::sync::Mutex<Option<host::CpuSample>>,
}

impl Envd {
    pub fn new() -> Arc<Envd> {
        Arc::new(Envd {
            processes: process::Table::default(),
            watchers: filesystem::Watchers::default(),
            defaults: RwLock::new(Defaults::default()),
            auth: auth::AccessToken::default(),
            cpu: std::sync::Mutex::new(None),
        })
    }

    pub fn defaults(&self) -> Defaults {
        self.defaults
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The user a call runs as: `explicit` (a `username` query parameter),
    /// else `Authorization: Basic`, else the default user. When the default
    /// user does not exist (a developer's host), the agent's own user.
    pub fn user_from_headers(&self, headers: &HeaderMap, explicit: Option<&str>) -> Result<User> {
        if let Some(name) = explicit.filter(|n| !n.is_empty()) {
            return User::lookup(name);
        }
        if let Some(name) = rpc::basic_auth_user(headers)? {
            return User::lookup(&name);
        }
        let name = self
            .defaults()
            .user
            .unwrap_or_else(|| DEFAULT_USER.to_string());
        match User::lookup(&name) {
            Ok(u) => Ok(u),
            Err(EnvdError::Unauthenticated(_)) if name == DEFAULT_USER => User::current(),
            Err(e) => Err(e),
        }
    }
}

/// The whole API as a router (tests drive it without a socket).
pub fn router() -> Router {
    app(Envd::new())
}

pub fn app(envd: Arc<Envd>) -> Router {
    Router::new()
        .route("/health", get(|| async { StatusCode::NO_CONTENT }))
        .merge(files::routes())
        .merge(host::routes())
        .route("/{service}/{method}", post(rpc_call))
        .fallback(not_found)
        .layer(axum::middleware::from_fn_with_state(
            envd.clone(),
            auth::require_token,
        ))
        .with_state(envd)
}

async fn not_found() -> EnvdError {
    EnvdError::NotFound("no such route".into())
}

/// `POST /<pkg.Service>/<Method>`: an unknown service or method is
/// Connect's `unimplemented` with HTTP 404, as connect-go answers.
async fn rpc_call(
    State(envd): State<Arc<Envd>>,
    Path((service, method)): Path<(String, String)>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let ctx = rpc::Ctx::new(envd, &headers);
    let wire = rpc::Wire::new(&headers, schemas(&service, &method));
    let resp = match service.as_str() {
        "process.Process" => process::handle(&method, ctx, &wire, body).await,
        "filesystem.Filesystem" => filesystem::handle(&method, ctx, &wire, body).await,
        _ => None,
    };
    resp.unwrap_or_else(|| {
        let err = EnvdError::Unimplemented(format!("{service}/{method} is not implemented"));
        let mut resp = rpc::unary_error(&err);
        *resp.status_mut() = StatusCode::NOT_FOUND;
        resp
    })
}

/// Request and response schemas of `service/method` (protobuf calls).
/// The tables live next to each service's serde structs
/// ([`process::proto`] and [`filesystem`]), which use the codec's types
/// from [`protobin`]: this table is here, above both, so the codec does not
/// depend on the services.
fn schemas(
    service: &str,
    method: &str,
) -> Option<(&'static protobin::Schema, &'static protobin::Schema)> {
    match service {
        "process.Process" => process::proto::schemas(method),
        "filesystem.Filesystem" => filesystem::schemas(method),
        _ => None,
    }
}

/// Serve the API on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener) -> anyhow::Result<()> {
    tracing::info!(envd_version = ENVD_VERSION, "envd API ready");
    // Streamed answers (process output, PTY) are many small writes: send
    // each at once rather than after the host's delayed ACK (Nagle).
    use axum::serve::ListenerExt;
    let listener = listener.tap_io(|tcp| {
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::warn!(%e, "TCP_NODELAY");
        }
    });
    axum::serve(listener, router()).await?;
    Ok(())
}

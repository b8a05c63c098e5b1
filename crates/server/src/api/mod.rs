//! The REST surface: E2B-compatible routes (`sandboxes.rs`), the server's
//! own routes (`system.rs`), API-key auth and latency metrics. The proxy in
//! front of it is composed in `crate::app`.

mod error;
mod extract;
pub mod idempotency;
mod network;
mod sandboxes;
mod secrets;
mod system;
mod templates;
mod volumes;

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{FromRequestParts, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use http::request::Parts;
use serde::de::DeserializeOwned;

pub use error::ApiError;
pub use extract::JsonBody;
pub use sandboxes::{list_filter, listed, page_token, LISTED_FIELD};

use crate::db::ApiKey;
use crate::metrics::RouteLabels;
use crate::state::AppState;

/// Every REST route.
pub fn router(state: Arc<AppState>) -> Router {
    let mut routes = Router::new();
    if state.manager.config.console {
        routes = routes
            .route(crate::console::PREFIX, axum::routing::any(console))
            .route("/console/", axum::routing::any(console))
            .route("/console/{*rest}", axum::routing::any(console));
    }
    routes
        .route("/health", get(system::health))
        .route("/metrics", get(system::metrics))
        .route("/openapi.yaml", get(system::openapi))
        .route(
            "/.well-known/openid-configuration",
            get(system::oidc_discovery),
        )
        .route("/.well-known/jwks.json", get(system::jwks))
        .route(
            "/sandboxes",
            post(sandboxes::create).get(sandboxes::list_v1),
        )
        .route(
            "/v2/sandboxes",
            post(sandboxes::create).get(sandboxes::list_v2),
        )
        .route(
            "/sandboxes/{id}",
            get(sandboxes::get_one).delete(sandboxes::kill),
        )
        .route("/sandboxes/{id}/timeout", post(sandboxes::set_timeout))
        .route(
            "/sandboxes/{id}/network",
            axum::routing::put(network::update),
        )
        .route("/sandboxes/{id}/refreshes", post(sandboxes::refresh))
        .route("/sandboxes/{id}/metrics", get(sandboxes::metrics))
        .route("/sandboxes/{id}/logs", get(sandboxes::logs))
        .route("/sandboxes/{id}/events", get(sandboxes::events))
        .route("/hosts", get(system::hosts))
        .route("/v2/sandboxes/{id}/logs", get(sandboxes::logs))
        .route("/sandboxes/{id}/pause", post(sandboxes::pause))
        .route("/v2/sandboxes/{id}/connect", post(sandboxes::connect))
        .route("/sandboxes/{id}/connect", post(sandboxes::connect))
        .route("/sandboxes/{id}/resume", post(sandboxes::connect))
        .route(
            "/sandboxes/{id}/snapshots",
            post(sandboxes::create_snapshot),
        )
        .route("/snapshots", get(sandboxes::list_snapshots))
        .route("/templates", get(templates::list_templates))
        .route(
            "/templates/{id}",
            get(templates::get_template).delete(templates::delete_snapshot),
        )
        .route("/v3/templates", post(templates::request_build))
        .route("/builds", get(templates::recent_builds))
        .route("/templates/aliases/{alias}", get(templates::alias))
        .route(
            "/templates/tags",
            post(templates::assign_tags).delete(templates::remove_tags),
        )
        .route("/templates/{id}/tags", get(templates::list_tags))
        .route("/templates/{id}/files/{hash}", get(templates::file_link))
        .route("/build-files/{hash}", axum::routing::put(templates::upload))
        .route(
            "/v2/templates/{id}/builds/{build_id}",
            post(templates::start_build),
        )
        .route(
            "/templates/{id}/builds/{build_id}/status",
            get(templates::build_status),
        )
        .route("/sandboxes/{id}/fork", post(sandboxes::fork))
        .route("/secrets", post(secrets::create).get(secrets::list))
        .route(
            "/secrets/{id}",
            get(secrets::get)
                .post(secrets::update)
                .delete(secrets::destroy),
        )
        .route("/volumes", post(volumes::create).get(volumes::list))
        .route("/volumes/{id}", get(volumes::get).delete(volumes::destroy))
        .route(
            "/volumecontent/{id}/file",
            get(volumes::read_file).put(volumes::write_file),
        )
        .route(
            "/volumecontent/{id}/dir",
            get(volumes::list_dir).post(volumes::make_dir),
        )
        .route(
            "/volumecontent/{id}/path",
            get(volumes::stat)
                .patch(volumes::update)
                .delete(volumes::remove),
        )
        .fallback(system::not_found)
        .method_not_allowed_fallback(system::method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), observe))
        .with_state(state)
}

/// The web console's page and assets ([`crate::console`]).
async fn console(req: Request) -> Response {
    crate::console::respond(req.method(), req.uri().path())
}

/// Records the latency of every REST call by route.
async fn observe(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let method = req.method().to_string();
    let start = Instant::now();
    let resp = next.run(req).await;
    state
        .metrics
        .api_latency
        .get_or_create(&RouteLabels {
            method,
            route,
            status: resp.status().as_u16(),
        })
        .observe(start.elapsed().as_secs_f64());
    resp
}

/// A request with a valid API key (`X-API-KEY`, or `Authorization: Bearer`).
pub struct Authed(pub ApiKey);

impl FromRequestParts<Arc<AppState>> for Authed {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, ApiError> {
        if let Some(secret) = &state.cluster_secret {
            return gateway_key(secret, &parts.headers).map(Authed);
        }
        let key = api_key_of(&parts.headers)?;
        match state.manager.db().verify_key(key) {
            Ok(Some(k)) => Ok(Authed(k)),
            Ok(None) => Err(ApiError::unauthorized("invalid API key")),
            Err(e) => Err(ApiError::new(
                http::StatusCode::INTERNAL_SERVER_ERROR,
                e.to_string(),
            )),
        }
    }
}

/// The caller's API key: `X-API-KEY`, or `Authorization: Bearer` (the
/// server's and a cluster gateway's one reading of it).
pub fn api_key_of(headers: &http::HeaderMap) -> Result<&str, ApiError> {
    headers
        .get("x-api-key")
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .or_else(|| bearer_of(headers))
        .ok_or_else(|| ApiError::unauthorized("missing API key: send it as X-API-KEY"))
}

/// The token of `Authorization: Bearer <token>`.
pub fn bearer_of(headers: &http::HeaderMap) -> Option<&str> {
    headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// A node in a cluster takes calls only from its gateways, which name the
/// caller's team (their key was checked against the cluster's catalog).
fn gateway_key(secret: &str, headers: &http::HeaderMap) -> Result<ApiKey, ApiError> {
    use crate::cluster::Refusal;
    match crate::cluster::gateway_team(secret, headers) {
        Ok(team) => Ok(ApiKey {
            // Per team: what is scoped by key (idempotency keys) stays
            // within the team.
            id: format!("gateway:{team}"),
            name: "a cluster gateway".into(),
            prefix: String::new(),
            created_ms: 0,
            revoked_ms: None,
            team,
        }),
        Err(Refusal::NotFromGateway) => Err(ApiError::unauthorized(
            "this server is a cluster node: send API calls to a tine gateway, not to the node",
        )),
        Err(Refusal::WrongSecret) => Err(ApiError::unauthorized("wrong cluster secret")),
        Err(Refusal::NoTeam) => Err(ApiError::bad_request(
            "a gateway call without a valid x-tine-team header",
        )),
    }
}

/// A sandbox id from the path that belongs to the caller's team. Another
/// team's sandbox gets the same 404 as an unknown id, so ids cannot be
/// probed across teams.
pub struct Owned {
    pub id: String,
    pub key: ApiKey,
}

impl FromRequestParts<Arc<AppState>> for Owned {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &Arc<AppState>,
    ) -> Result<Self, ApiError> {
        let Authed(key) = Authed::from_request_parts(parts, state).await?;
        let axum::extract::Path(id) =
            axum::extract::Path::<String>::from_request_parts(parts, state)
                .await
                .map_err(|e| ApiError::bad_request(e.body_text()))?;
        Owned::check(state, key, id)
    }
}

impl Owned {
    /// Sandbox `id` if it belongs to `key`'s team.
    pub fn check(state: &AppState, key: ApiKey, id: String) -> Result<Self, ApiError> {
        match state.manager.db().sandbox_team(&id) {
            Ok(Some(team)) if team == key.team => Ok(Owned { id, key }),
            Ok(_) => Err(crate::sandboxes::SandboxError::NotFound(id).into()),
            Err(e) => Err(ApiError::new(
                http::StatusCode::INTERNAL_SERVER_ERROR,
                e.to_string(),
            )),
        }
    }
}

/// Read a JSON body of at most `max` bytes into `T`. An empty body is `{}`.
pub async fn json_body<T: DeserializeOwned>(
    body: axum::body::Body,
    max: usize,
) -> Result<T, ApiError> {
    parse_json(&body_bytes(body, max).await?)
}

/// A request body of at most `max` bytes (413 beyond).
pub async fn body_bytes(body: axum::body::Body, max: usize) -> Result<bytes::Bytes, ApiError> {
    axum::body::to_bytes(body, max).await.map_err(|_| {
        ApiError::new(
            http::StatusCode::PAYLOAD_TOO_LARGE,
            format!("request body larger than {max} bytes"),
        )
    })
}

/// A JSON body (an empty one is `{}`).
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    let bytes: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) {
        b"{}"
    } else {
        bytes
    };
    serde_json::from_slice(bytes)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON body: {e}")))
}

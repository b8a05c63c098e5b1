//! The server's own routes: health, Prometheus metrics, the OpenAPI
//! document, and JSON answers for unknown routes.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::response::IntoResponse;
use http::{header, StatusCode};

use super::{ApiError, Authed};
use crate::metrics::StateLabel;
use crate::state::AppState;

pub async fn health() -> impl IntoResponse {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        r#"{"status":"ok"}"#,
    )
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let m = &state.metrics;
    m.sandboxes
        .get_or_create(&StateLabel { state: "running" })
        .set(state.manager.live_count() as i64);
    let (capacity, admitted, pooled) = state.manager.capacity();
    m.set_capacity(
        capacity,
        state.manager.config.max_sandboxes,
        admitted,
        pooled,
    );
    m.set_host(&state.data_dir);
    if let Some(stats) = tine_image::nbd::daemon::read_stats(&state.data_dir) {
        m.set_image_cache(&stats);
    }
    if let Some(c) = &state.captures {
        m.set_captures(c.stats());
    }
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        m.render(),
    )
}

pub async fn openapi() -> impl IntoResponse {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/yaml")],
        include_str!("../../../../docs/openapi.yaml"),
    )
}

pub async fn not_found(req: Request) -> ApiError {
    ApiError::not_found(format!("no route {} {}", req.method(), req.uri().path()))
}

pub async fn method_not_allowed(req: Request) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{} is not allowed on {}", req.method(), req.uri().path()),
    )
}

/// `GET /.well-known/openid-configuration`: where relying parties find the
/// keys of workload identity tokens (no key needed: they are public).
pub async fn oidc_discovery(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    axum::Json(state.identity.discovery())
}

/// `GET /.well-known/jwks.json`: the keys workload identity tokens are
/// signed with (the current one and those retired while their tokens
/// live).
pub async fn jwks(State(state): State<Arc<AppState>>) -> impl IntoResponse {
    (
        [(header::CACHE_CONTROL, "max-age=60")],
        axum::Json(state.identity.jwks()),
    )
}

/// `GET /hosts` (tine's own route; the console's host page): this server
/// as a host. A gateway answers with every node of its cluster. Any key
/// may read it: it names no sandbox.
pub async fn hosts(Authed(_): Authed, State(state): State<Arc<AppState>>) -> impl IntoResponse {
    let config = &state.manager.config;
    let (capacity, admitted, _) = state.manager.capacity();
    let id = if config.cluster.enabled() {
        config.cluster.node_id_for(config.listen)
    } else {
        "local".to_string()
    };
    let disk_free_mb =
        crate::sandboxes::limits::disk_free_bytes(&state.data_dir).unwrap_or(0) >> 20;
    axum::Json(serde_json::json!([{
        "nodeID": id,
        "address": format!("http://{}", config.listen),
        "up": true,
        "heartbeatAgeMs": 0,
        "cores": capacity.cores,
        "capacity": capacity.sandboxes,
        "live": admitted,
        "memoryFreeMB": crate::sandboxes::limits::mem_available_mb().unwrap_or(0),
        "diskFreeMB": disk_free_mb,
        "version": env!("CARGO_PKG_VERSION"),
    }]))
}

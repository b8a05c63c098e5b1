//! E2B's secret routes (`/secrets`, API key, team scoped). Values go in
//! and never come out: every answer is the secret's metadata only. The
//! logic is in [`crate::secrets`]; these only translate.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::{HeaderMap, HeaderValue, StatusCode};
use serde::{Deserialize, Serialize};

use super::extract::{Path, Query};
use super::sandboxes::rfc3339;
use super::{ApiError, Authed};
use crate::db::SecretRow;
use crate::secrets::SecretError;
use crate::state::AppState;

/// Secrets one page holds at most (and by default, as the SDK asks).
const MAX_PAGE: usize = 100;

impl From<SecretError> for ApiError {
    fn from(e: SecretError) -> Self {
        let status = match &e {
            SecretError::NotFound(_) => StatusCode::NOT_FOUND,
            SecretError::Exists(_) | SecretError::Conflict(_) => StatusCode::CONFLICT,
            SecretError::BadName(_) | SecretError::BadValue(_) | SecretError::BadMetadata(_) => {
                StatusCode::BAD_REQUEST
            }
            SecretError::Db(_) | SecretError::Cipher(_) => StatusCode::INTERNAL_SERVER_ERROR,
            SecretError::Catalog(_) | SecretError::OtherKey => StatusCode::SERVICE_UNAVAILABLE,
        };
        if status.is_server_error() {
            tracing::error!("secrets: {e}");
        }
        ApiError::new(status, e.to_string())
    }
}

/// E2B's `Secret`: never the value.
#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SecretOut {
    #[serde(rename = "secretID")]
    secret_id: String,
    name: String,
    current_version: i64,
    metadata: BTreeMap<String, String>,
    created_at: String,
    updated_at: String,
}

fn out(r: SecretRow) -> SecretOut {
    SecretOut {
        secret_id: r.id,
        name: r.name,
        current_version: r.version,
        metadata: r.metadata,
        created_at: rfc3339(r.created_ms),
        updated_at: rfc3339(r.updated_ms),
    }
}

/// `NewSecret`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NewSecret {
    name: String,
    value: String,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
}

/// `SecretUpdate`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretUpdate {
    value: String,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
}

/// `POST /secrets`.
pub async fn create(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    super::JsonBody(req): super::JsonBody<NewSecret>,
) -> Result<Response, ApiError> {
    let row = s
        .secrets
        .create(
            &key.team,
            &req.name,
            &req.value,
            req.metadata.unwrap_or_default(),
        )
        .await?;
    tracing::info!(secret = %row.id, name = %row.name, team = %row.team, "secret created");
    Ok((StatusCode::CREATED, Json(out(row))).into_response())
}

/// `POST /secrets/{id}`: a new version.
pub async fn update(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    super::JsonBody(req): super::JsonBody<SecretUpdate>,
) -> Result<Json<SecretOut>, ApiError> {
    let row = s
        .secrets
        .update(&key.team, &id, &req.value, req.metadata)
        .await?;
    tracing::info!(secret = %row.id, version = row.version, team = %row.team, "secret updated");
    Ok(Json(out(row)))
}

/// `GET /secrets/{id}`.
pub async fn get(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<SecretOut>, ApiError> {
    Ok(Json(out(s.secrets.get(&key.team, &id).await?)))
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListQuery {
    #[serde(default)]
    limit: Option<usize>,
    #[serde(default)]
    next_token: Option<String>,
}

/// `GET /secrets`: a page, oldest first; `x-next-token` when more follow.
pub async fn list(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Query(q): Query<ListQuery>,
) -> Result<Response, ApiError> {
    let limit = q.limit.unwrap_or(MAX_PAGE);
    if !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::bad_request(format!(
            "limit must be 1-{MAX_PAGE}, got {limit}"
        )));
    }
    let after = match q.next_token.as_deref().filter(|t| !t.is_empty()) {
        Some(t) => Some(
            super::sandboxes::decode_token(t)
                .ok_or_else(|| ApiError::bad_request(format!("invalid nextToken {t:?}")))?,
        ),
        None => None,
    };
    let mut rows = s
        .secrets
        .list(
            &key.team,
            after.as_ref().map(|(ms, id)| (*ms, id.as_str())),
            limit + 1,
        )
        .await?;
    let mut headers = HeaderMap::new();
    if rows.len() > limit {
        rows.truncate(limit);
        if let Some(last) = rows.last() {
            headers.insert(
                "x-next-token",
                HeaderValue::from_str(&super::sandboxes::page_token(last.created_ms, &last.id))
                    .expect("base64 is a valid header"),
            );
        }
    }
    let body: Vec<SecretOut> = rows.into_iter().map(out).collect();
    Ok((headers, Json(body)).into_response())
}

/// `DELETE /secrets/{id}`.
pub async fn destroy(
    Authed(key): Authed,
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    if !s.secrets.destroy(&key.team, &id).await? {
        return Err(SecretError::NotFound(id).into());
    }
    tracing::info!(secret = %id, team = %key.team, "secret destroyed");
    Ok(StatusCode::NO_CONTENT)
}

//! axum's `Query` and `Path` with their rejections in the E2B error shape
//! (`{"code": 400, "message": ...}`): axum's own answer bad query strings
//! and undecodable path segments with `text/plain`, which the SDKs cannot
//! read. And [`JsonBody`], the request body as JSON with the server's size
//! limit.

use std::sync::Arc;

use axum::extract::{FromRequest, FromRequestParts, Request};
use http::request::Parts;
use serde::de::DeserializeOwned;

use super::ApiError;
use crate::state::AppState;

/// The request body as JSON, deserialized into `T`: at most
/// `max_body_bytes` (413 beyond), an empty body read as `{}`, anything
/// that is not `T` a 400 naming what is wrong. (Not axum's `Json`: it
/// wants a content type the SDKs do not always send, and answers in
/// `text/plain`.)
pub struct JsonBody<T>(pub T);

impl<T: DeserializeOwned> FromRequest<Arc<AppState>> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
        let max = state.manager.config.max_body_bytes;
        super::json_body(req.into_body(), max).await.map(JsonBody)
    }
}

/// The query string, deserialized into `T`.
pub struct Query<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Query(v)| Query(v))
            .map_err(|e| ApiError::bad_request(e.body_text()))
    }
}

/// The path parameters, deserialized into `T`.
pub struct Path<T>(pub T);

impl<T: DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        axum::extract::Path::<T>::from_request_parts(parts, state)
            .await
            .map(|axum::extract::Path(v)| Path(v))
            .map_err(|e| ApiError::bad_request(e.body_text()))
    }
}

//! `GET /files` and `POST /files` (placeholder while being written).
use std::sync::Arc;
use axum::Router;
use super::Envd;

pub fn routes() -> Router<Arc<Envd>> {
    Router::new()
}

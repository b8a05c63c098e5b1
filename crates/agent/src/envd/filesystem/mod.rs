//! `filesystem.Filesystem` (placeholder while being written).
use axum::body::Body;
use axum::http::HeaderMap;
use axum::response::Response;
use super::error::Result;
use super::rpc::Ctx;

#[derive(Default)]
pub struct Watchers {}

pub async fn handle(_method: &str, _ctx: Result<Ctx>, _headers: &HeaderMap, _body: Body) -> Option<Response> {
    None
}

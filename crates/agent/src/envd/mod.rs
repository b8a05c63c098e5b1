//! The envd-compatible API (see shared/design/E2B-COMPAT.md section C).
//!
//! Placeholder until the issue "Guest agent" lands: only `/health`.

use axum::{http::StatusCode, routing::get, Router};

pub fn router() -> Router {
    Router::new().route("/health", get(|| async { StatusCode::NO_CONTENT }))
}

/// Serve the API on `listener` until the process ends.
pub async fn serve(listener: tokio::net::TcpListener) -> anyhow::Result<()> {
    axum::serve(listener, router()).await?;
    Ok(())
}

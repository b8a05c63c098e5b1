//! The HTTP side: MCP over streamable HTTP at /mcp behind the bearer token,
//! and /health (no token) which the launcher polls.

use std::sync::Arc;

use axum::{
    extract::Request,
    http::{header, StatusCode},
    middleware::{self, Next},
    response::{IntoResponse, Response},
    routing::get,
    Router,
};
use rmcp::transport::streamable_http_server::{
    session::local::LocalSessionManager, StreamableHttpServerConfig, StreamableHttpService,
};

use crate::gateway::Gateway;

/// The app: `mcp` (any service) nested at /mcp behind `token`, and /health.
pub fn app(mcp: Router, token: String) -> Router {
    let token = Arc::new(token);
    let guarded = mcp.layer(middleware::from_fn(move |req: Request, next: Next| {
        let token = token.clone();
        async move { check(&token, req, next).await }
    }));
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .merge(guarded)
}

pub fn mcp_service(gw: Gateway) -> Router {
    // tine's proxy passes Host: 50005-<id>.<domain>; the token is the guard.
    let config = StreamableHttpServerConfig::default().disable_allowed_hosts();
    let service = StreamableHttpService::new(
        move || Ok(gw.clone()),
        LocalSessionManager::default().into(),
        config,
    );
    Router::new().nest_service("/mcp", service)
}

async fn check(token: &str, req: Request, next: Next) -> Response {
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(g) if same(g.as_bytes(), token.as_bytes()) => next.run(req).await,
        _ => (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer realm=\"MCP Gateway\"")],
            "Unauthorized\n",
        )
            .into_response(),
    }
}

/// Constant-time equality (the time depends on the lengths only).
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use tower::ServiceExt;

    async fn status(auth: Option<&str>, path: &str) -> (StatusCode, Option<String>) {
        let inner = Router::new().route("/mcp", get(|| async { "inner" }));
        let mut req = Request::builder().uri(path);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let r = app(inner, "s3cret".into())
            .oneshot(req.body(Body::empty()).unwrap())
            .await
            .unwrap();
        let www = r
            .headers()
            .get("www-authenticate")
            .map(|v| v.to_str().unwrap().to_string());
        (r.status(), www)
    }

    #[tokio::test]
    async fn bearer_token_guards_mcp_only() {
        assert_eq!(
            status(Some("Bearer s3cret"), "/mcp").await.0,
            StatusCode::OK
        );
        for bad in [
            None,
            Some("Bearer s3cre"),
            Some("Bearer s3cret2"),
            Some("s3cret"),
            Some("Basic s3cret"),
        ] {
            let (code, www) = status(bad, "/mcp").await;
            assert_eq!(code, StatusCode::UNAUTHORIZED, "{bad:?}");
            assert_eq!(www.as_deref(), Some("Bearer realm=\"MCP Gateway\""));
        }
        assert_eq!(status(None, "/health").await.0, StatusCode::OK);
    }

    #[test]
    fn constant_time_compare() {
        assert!(same(b"abc", b"abc"));
        assert!(!same(b"abc", b"abd"));
        assert!(!same(b"abc", b"abcd"));
    }
}

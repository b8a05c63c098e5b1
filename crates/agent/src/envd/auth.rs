//! The access token set by `/init`, the middleware that enforces it, and
//! signed `/files` URLs.
//!
//! Once a token is set every request needs `X-Access-Token` with it, except
//! `GET /health` and the `/files` routes, which may instead carry a
//! signature (checked by [`AccessToken::check_signature`] in the handler).

use std::sync::{Arc, RwLock};

use axum::extract::{Request, State};
use axum::http::{HeaderMap, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine;
use sha2::{Digest, Sha256};

use super::error::{EnvdError, Result};
use super::Envd;

pub const ACCESS_TOKEN_HEADER: &str = "x-access-token";

#[derive(Default)]
pub struct AccessToken {
    token: RwLock<Option<String>>,
}

/// Compares without an early exit so timing does not leak the token.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl AccessToken {
    pub fn get(&self) -> Option<String> {
        self.token.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Sets (or with `None`/empty, clears) the token.
    pub fn set(&self, token: Option<String>) {
        *self.token.write().unwrap_or_else(|e| e.into_inner()) = token.filter(|t| !t.is_empty());
    }

    /// `Some(true)` when the header carries the token, `Some(false)` when it
    /// carries something else, `None` when there is no header.
    fn header_matches(&self, token: &str, headers: &HeaderMap) -> Option<bool> {
        headers
            .get(ACCESS_TOKEN_HEADER)
            .map(|v| constant_time_eq(v.as_bytes(), token.as_bytes()))
    }

    /// Whether `headers` satisfy the token (always true when none is set).
    pub fn allows(&self, headers: &HeaderMap) -> bool {
        match self.get() {
            None => true,
            Some(t) => self.header_matches(&t, headers) == Some(true),
        }
    }

    /// Authorizes a `/files` request: the token header, or a signature of
    /// `path:operation:username:token[:expiration]` (as the SDKs compute it).
    pub fn check_signature(
        &self,
        headers: &HeaderMap,
        path: &str,
        operation: &str,
        username: Option<&str>,
        signature: Option<&str>,
        expiration: Option<i64>,
    ) -> Result<()> {
        let Some(token) = self.get() else {
            return Ok(());
        };
        let unauthorized = |m: &str| Err(EnvdError::Unauthenticated(m.to_string()));
        match self.header_matches(&token, headers) {
            Some(true) => return Ok(()),
            Some(false) => {
                return unauthorized("access token present in header but does not match")
            }
            None => {}
        }
        let Some(signature) = signature else {
            return unauthorized("missing signature query parameter");
        };
        let expected = sign(path, operation, username.unwrap_or(""), &token, expiration);
        if !constant_time_eq(expected.as_bytes(), signature.as_bytes()) {
            return unauthorized("invalid signature");
        }
        if let Some(exp) = expiration {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0);
            if exp < now {
                return unauthorized("signature is already expired");
            }
        }
        Ok(())
    }
}

/// `v1_` + unpadded base64 of sha256(`path:operation:user:token[:exp]`).
pub fn sign(
    path: &str,
    operation: &str,
    username: &str,
    token: &str,
    expiration: Option<i64>,
) -> String {
    let raw = match expiration {
        Some(exp) => format!("{path}:{operation}:{username}:{token}:{exp}"),
        None => format!("{path}:{operation}:{username}:{token}"),
    };
    let digest = Sha256::digest(raw.as_bytes());
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    )
}

/// Middleware: 401 JSON unless the request may pass.
pub async fn require_token(State(envd): State<Arc<Envd>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    let open = (req.method() == Method::GET && path == "/health") || path == "/files";
    if open || envd.auth.allows(req.headers()) {
        return next.run(req).await;
    }
    EnvdError::Unauthenticated(
        "unauthorized access, please provide a valid access token or method signing if supported"
            .into(),
    )
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn signature_matches_the_sdk_formula() {
        // Python: base64(sha256(b"/a:read::tok")).rstrip("=") with prefix v1_.
        let s = sign("/a", "read", "", "tok", None);
        assert_eq!(s, "v1_2/gNbgFPxFSqkheS/SD0NHlzA121E/nxkOtc/ovxeoI");
        let t = AccessToken::default();
        let h = HeaderMap::new();
        assert!(
            t.check_signature(&h, "/a", "read", None, None, None)
                .is_ok(),
            "no token: open"
        );
        t.set(Some("tok".into()));
        assert!(t
            .check_signature(&h, "/a", "read", None, Some(&s), None)
            .is_ok());
        assert!(t
            .check_signature(&h, "/a", "write", None, Some(&s), None)
            .is_err());
        assert!(t
            .check_signature(&h, "/b", "read", None, Some(&s), None)
            .is_err());
        assert!(t
            .check_signature(&h, "/a", "read", None, None, None)
            .is_err());
        let expired = sign("/a", "read", "", "tok", Some(1));
        assert!(t
            .check_signature(&h, "/a", "read", None, Some(&expired), Some(1))
            .is_err());
        let later = sign("/a", "read", "root", "tok", Some(4_000_000_000));
        assert!(t
            .check_signature(
                &h,
                "/a",
                "read",
                Some("root"),
                Some(&later),
                Some(4_000_000_000)
            )
            .is_ok());
        let mut good = HeaderMap::new();
        good.insert(ACCESS_TOKEN_HEADER, HeaderValue::from_static("tok"));
        assert!(t.allows(&good));
        assert!(!t.allows(&h));
        let mut bad = HeaderMap::new();
        bad.insert(ACCESS_TOKEN_HEADER, HeaderValue::from_static("nope"));
        assert!(!t.allows(&bad));
        assert!(t
            .check_signature(&bad, "/a", "read", None, Some(&s), None)
            .is_err());
    }
}

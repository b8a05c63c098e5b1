//! Signed `/files` URLs (`download_url` / `upload_url` of a `secure`
//! sandbox). The SDK signs `path:operation:user:token[:expiration]` with
//! the sandbox's access token; a URL it builds against `E2B_SANDBOX_URL`
//! names no sandbox, so the signature itself must find it.
//!
//! The answers are envd's: 401 with `missing signature`, `invalid
//! signature`, `invalid signature_expiration` or `signature is already
//! expired`. The signature is checked before the expiry, so a forger never
//! learns whether the expiry was the problem.

use axum::extract::Request;
use base64::Engine as _;
use sha2::{Digest, Sha256};

use super::same_secret;

/// The query of a `/files` request that carries a signature.
#[derive(Debug, PartialEq, Eq)]
pub struct SignedQuery {
    path: String,
    signature: String,
    username: String,
    expiration: Option<String>,
    operation: &'static str,
}

/// Why a signed request is refused (the message is envd's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    Missing,
    Invalid,
    BadExpiration,
    Expired,
}

impl Refusal {
    pub fn message(self) -> &'static str {
        match self {
            Refusal::Missing => "missing signature",
            Refusal::Invalid => "invalid signature",
            Refusal::BadExpiration => "invalid signature_expiration",
            Refusal::Expired => "signature is already expired",
        }
    }
}

/// Signature of a `/files` URL as the SDK makes it: `v1_` + unpadded
/// base64 of sha256(`path:operation:user:token[:expiration]`).
pub fn file_signature(
    path: &str,
    operation: &str,
    user: &str,
    token: &str,
    expiration: Option<&str>,
) -> String {
    let text = match expiration {
        Some(exp) => format!("{path}:{operation}:{user}:{token}:{exp}"),
        None => format!("{path}:{operation}:{user}:{token}"),
    };
    format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(Sha256::digest(text.as_bytes()))
    )
}

impl SignedQuery {
    /// The signed query of `req`, when it is a `GET` (read) or `POST`
    /// (write) of `/files`; `Err(Missing)` when that has no signature.
    pub fn of(req: &Request) -> Option<Result<Self, Refusal>> {
        if req.uri().path() != "/files" {
            return None;
        }
        let operation = match *req.method() {
            http::Method::GET => "read",
            http::Method::POST => "write",
            _ => return None,
        };
        let query: Vec<(String, String)> =
            serde_urlencoded::from_str(req.uri().query().unwrap_or("")).unwrap_or_default();
        let get = |k: &str| {
            query
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.clone())
        };
        let Some(signature) = get("signature") else {
            return Some(Err(Refusal::Missing));
        };
        Some(Ok(SignedQuery {
            path: get("path").unwrap_or_default(),
            signature,
            username: get("username").unwrap_or_default(),
            expiration: get("signature_expiration"),
            operation,
        }))
    }

    /// Whether `token` made this signature (constant time in the
    /// signature), whatever its expiry.
    pub fn signed_with(&self, token: &str) -> bool {
        let expected = file_signature(
            &self.path,
            self.operation,
            &self.username,
            token,
            self.expiration.as_deref(),
        );
        same_secret(expected.as_bytes(), self.signature.as_bytes())
    }

    /// Check the signature against `token` and the expiry against `now_s`
    /// (Unix seconds).
    pub fn check(&self, token: &str, now_s: i64) -> Result<(), Refusal> {
        if !self.signed_with(token) {
            return Err(Refusal::Invalid);
        }
        match self.expiration.as_deref().map(str::parse::<i64>) {
            None => Ok(()),
            Some(Err(_)) => Err(Refusal::BadExpiration),
            Some(Ok(exp)) if exp < now_s => Err(Refusal::Expired),
            Some(Ok(_)) => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(method: &str, uri: &str) -> Request {
        Request::builder()
            .method(method)
            .uri(uri)
            .body(axum::body::Body::empty())
            .unwrap()
    }

    fn url(op: &str, path: &str, exp: Option<i64>) -> String {
        let exp_s = exp.map(|e| e.to_string());
        let sig = file_signature(path, op, "user", "tok", exp_s.as_deref());
        let mut q = vec![("path", path.to_string()), ("username", "user".into())];
        q.push(("signature", sig));
        if let Some(e) = exp_s {
            q.push(("signature_expiration", e));
        }
        format!("/files?{}", serde_urlencoded::to_string(q).unwrap())
    }

    #[test]
    fn signature_matches_the_sdk_formula() {
        // Python SDK: "v1_" + base64(sha256(b"/a:read::tok")).rstrip("=").
        assert_eq!(
            file_signature("/a", "read", "", "tok", None),
            "v1_2/gNbgFPxFSqkheS/SD0NHlzA121E/nxkOtc/ovxeoI"
        );
    }

    #[test]
    fn signatures_are_checked_before_their_expiry() {
        let now = 1_000;
        let q = |m, u: &str| SignedQuery::of(&req(m, u)).unwrap().unwrap();
        assert_eq!(
            q("GET", &url("read", "/a b", None)).check("tok", now),
            Ok(())
        );
        assert_eq!(
            q("GET", &url("read", "/a", Some(2_000))).check("tok", now),
            Ok(())
        );
        assert_eq!(
            q("GET", &url("read", "/a", Some(999))).check("tok", now),
            Err(Refusal::Expired)
        );
        // Another token, or a read signature used to write: invalid, even
        // when it is also expired.
        assert_eq!(
            q("GET", &url("read", "/a", Some(999))).check("other", now),
            Err(Refusal::Invalid)
        );
        assert_eq!(
            q("POST", &url("read", "/a", None)).check("tok", now),
            Err(Refusal::Invalid)
        );
        let bad_exp = "/files?path=%2Fa&signature=x&signature_expiration=soon";
        assert_eq!(q("GET", bad_exp).check("tok", now), Err(Refusal::Invalid));
        assert_eq!(
            SignedQuery::of(&req("GET", "/files?path=a")).unwrap(),
            Err(Refusal::Missing)
        );
        assert!(SignedQuery::of(&req("PUT", "/files?signature=x")).is_none());
        assert!(SignedQuery::of(&req("GET", "/filesx?signature=x")).is_none());
    }
}

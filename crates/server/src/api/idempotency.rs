//! `Idempotency-Key` on create: the SDKs retry a create that failed in
//! flight (a timeout, a dropped connection) with the same key, and must get
//! the sandbox the first attempt made, not a second one.
//!
//! Per API key, a key remembers the request it came with (a hash of the
//! body) and, once it succeeded, the response. The same key with the same
//! body replays that response (a retry still in flight waits for the first
//! attempt); with another body it is 409. A create that failed does not
//! hold its key, so it can be retried. Keys are kept for 24 hours, in
//! memory (a restart forgets them), at most [`MAX_KEYS`] at once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::StatusCode;
use sha2::{Digest, Sha256};

use super::ApiError;

/// How long a key is remembered.
const KEEP: Duration = Duration::from_secs(24 * 3600);
/// Keys remembered at once; beyond it the oldest go first.
const MAX_KEYS: usize = 100_000;

/// The response a key replays.
pub type Stored = (StatusCode, serde_json::Value);

struct Entry {
    body: [u8; 32],
    at: Instant,
    /// Held while an attempt runs; holds the response once one succeeded.
    done: tokio::sync::Mutex<Option<Stored>>,
}

#[derive(Default)]
pub struct Idempotency {
    entries: Mutex<HashMap<(String, String), Arc<Entry>>>,
}

/// The header's key, if any: 1 to 255 lowercase letters, digits, hyphens
/// (what the SDKs allow).
pub fn key_of(headers: &http::HeaderMap) -> Result<Option<String>, ApiError> {
    let Some(v) = headers.get("idempotency-key") else {
        return Ok(None);
    };
    let k = v.to_str().unwrap_or("");
    let valid = (1..=255).contains(&k.len())
        && k.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    if !valid {
        return Err(ApiError::bad_request(
            "Idempotency-Key must be 1-255 lowercase letters, digits or hyphens",
        ));
    }
    Ok(Some(k.to_string()))
}

impl Idempotency {
    /// Run `create` once per (`api_key`, `key`): a repeat with the same
    /// `body` gets the first success's response.
    pub async fn run<F, Fut>(
        &self,
        api_key: &str,
        key: &str,
        body: &[u8],
        create: F,
    ) -> Result<Stored, ApiError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<Stored, ApiError>>,
    {
        let hash: [u8; 32] = Sha256::digest(body).into();
        let entry = {
            let mut map = self.entries.lock().unwrap_or_else(|e| e.into_inner());
            map.retain(|_, e| e.at.elapsed() < KEEP);
            if map.len() >= MAX_KEYS {
                if let Some(oldest) = map.iter().min_by_key(|(_, e)| e.at).map(|(k, _)| k.clone()) {
                    map.remove(&oldest);
                }
            }
            map.entry((api_key.to_string(), key.to_string()))
                .or_insert_with(|| {
                    Arc::new(Entry {
                        body: hash,
                        at: Instant::now(),
                        done: tokio::sync::Mutex::new(None),
                    })
                })
                .clone()
        };
        if entry.body != hash {
            return Err(ApiError::new(
                StatusCode::CONFLICT,
                format!("Idempotency-Key {key:?} was used with another request"),
            ));
        }
        let mut done = entry.done.lock().await;
        if let Some(stored) = done.as_ref() {
            return Ok(stored.clone());
        }
        let out = create().await?;
        *done = Some(out.clone());
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn a_key_creates_once_and_replays_and_a_failure_frees_it() {
        let idem = Idempotency::default();
        let calls = AtomicUsize::new(0);
        let ok = || async {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            Ok((StatusCode::CREATED, serde_json::json!({ "n": n })))
        };
        let first = idem.run("k1", "abc", b"{}", ok).await.unwrap();
        let again = idem.run("k1", "abc", b"{}", ok).await.unwrap();
        assert_eq!(first, again);
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        // Another API key has its own keys.
        idem.run("k2", "abc", b"{}", ok).await.unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 2);
        // The same key with another body.
        let e = idem.run("k1", "abc", b"{\"x\":1}", ok).await.unwrap_err();
        assert_eq!(e.status, StatusCode::CONFLICT);
        // A failed attempt does not hold the key.
        let fail = || async { Err(ApiError::new(StatusCode::TOO_MANY_REQUESTS, "full")) };
        assert!(idem.run("k1", "retry", b"{}", fail).await.is_err());
        idem.run("k1", "retry", b"{}", ok).await.unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn keys_are_checked_as_the_sdks_make_them() {
        let mut h = http::HeaderMap::new();
        assert_eq!(key_of(&h).unwrap(), None);
        h.insert("idempotency-key", "a-1b".parse().unwrap());
        assert_eq!(key_of(&h).unwrap().as_deref(), Some("a-1b"));
        h.insert("idempotency-key", "Bad Key".parse().unwrap());
        assert!(key_of(&h).is_err());
    }
}

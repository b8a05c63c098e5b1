//! Workload identity (E2B's `iam`): short-lived JWTs that tine signs for a
//! sandbox, minted by its egress proxy when a header transform names one
//! (`${e2b.identity.tokens.<name>}`), so code in the sandbox uses the
//! identity without ever holding a token it could keep. A relying party
//! (a cloud's STS, a service of one's own) verifies them with the keys
//! published at `/.well-known/jwks.json`, found through the OIDC
//! discovery document at `/.well-known/openid-configuration`.
//!
//! Tokens are JWT-SVIDs: ES256, `sub` the sandbox's SPIFFE ID
//! (`spiffe://<trust domain>/team/<team>/sandbox/<id>`), `aud` what the
//! sandbox's `iam` asked, `iss` the configured issuer, `exp` a few minutes
//! on. The signing key rotates (`key_rotation_hours`); a retired key stays
//! published until every token it signed has expired.
//!
//! ```text
//! <data>/identity/<created ms>-<kid>.p8   a signing key (PKCS#8, 0600)
//! ```

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::RwLock;

use base64::Engine;
use ring::rand::SystemRandom;
use ring::signature::{EcdsaKeyPair, KeyPair, ECDSA_P256_SHA256_FIXED_SIGNING};
use serde::{Deserialize, Serialize};
use serde_json::json;

/// The only token type tine (and E2B's API today) issues.
pub const JWT_SVID: &str = "JWT-SVID";
/// Tokens one sandbox may register, and bytes of an audience.
pub const MAX_TOKENS: usize = 16;
pub const MAX_AUDIENCE: usize = 1024;
/// How long a new key is published before it signs (JWKS caches).
const PUBLISH_AHEAD_MS: i64 = 10 * 60 * 1000;

/// `[identity]` in the server's config.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct IdentityConfig {
    /// `iss` of every token, and where relying parties find
    /// `/.well-known/openid-configuration` (default: `http://<listen>`).
    pub issuer: Option<String>,
    /// The SPIFFE trust domain of `sub`.
    pub trust_domain: String,
    /// How long a token is valid.
    pub token_ttl_secs: u64,
    /// How often the signing key is replaced.
    pub key_rotation_hours: u64,
}

impl Default for IdentityConfig {
    fn default() -> Self {
        Self {
            issuer: None,
            trust_domain: "tine.local".into(),
            token_ttl_secs: 300,
            key_rotation_hours: 24,
        }
    }
}

impl IdentityConfig {
    pub fn validate(&self) -> Result<(), String> {
        if let Some(i) = &self.issuer {
            if !(i.starts_with("https://") || i.starts_with("http://")) || i.ends_with('/') {
                return Err(format!(
                    "identity.issuer {i:?} must be an http(s) URL without a trailing slash"
                ));
            }
        }
        let td = &self.trust_domain;
        if td.is_empty()
            || !td
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        {
            return Err(format!(
                "identity.trust_domain {td:?} must be lowercase letters, digits, '.' and '-'"
            ));
        }
        if self.token_ttl_secs == 0 || self.key_rotation_hours == 0 {
            return Err("identity.token_ttl_secs and key_rotation_hours must be over 0".into());
        }
        Ok(())
    }
}

/// One token a sandbox registered (`iam.tokens.<name>`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TokenSpec {
    pub audience: String,
    pub token_type: String,
}

/// A sandbox's `iam`: token name → what to mint.
pub type Iam = BTreeMap<String, TokenSpec>;

/// Check a create request's `iam` (`{"tokens": {name: {audience,
/// tokenType}}}`).
pub fn parse_iam(v: &serde_json::Value) -> Result<Iam, String> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        #[serde(default)]
        tokens: Option<BTreeMap<String, TokenSpec>>,
    }
    let b: Body = serde_json::from_value(v.clone()).map_err(|e| format!("invalid iam: {e}"))?;
    let tokens = b.tokens.unwrap_or_default();
    if tokens.len() > MAX_TOKENS {
        return Err(format!(
            "iam.tokens has {}; at most {MAX_TOKENS}",
            tokens.len()
        ));
    }
    for (name, spec) in &tokens {
        if !crate::secrets::valid_name(name) {
            return Err(format!(
                "iam.tokens: {name:?} is not usable: a token name is 1-255 bytes without '{{', '}}' or control characters"
            ));
        }
        if spec.audience.is_empty()
            || spec.audience.len() > MAX_AUDIENCE
            || spec.audience.chars().any(char::is_control)
        {
            return Err(format!(
                "iam.tokens[{name:?}].audience must be 1-{MAX_AUDIENCE} bytes without control characters"
            ));
        }
        if spec.token_type != JWT_SVID {
            return Err(format!(
                "iam.tokens[{name:?}].tokenType {:?}: tine issues {JWT_SVID:?} only",
                spec.token_type
            ));
        }
    }
    Ok(tokens)
}

#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("identity keys in {dir}: {detail}")]
    Keys { dir: PathBuf, detail: String },
    #[error("signing a token failed")]
    Sign,
}

struct SigningKey {
    kid: String,
    created_ms: i64,
    pair: EcdsaKeyPair,
}

pub struct Identity {
    dir: PathBuf,
    issuer: String,
    trust_domain: String,
    ttl_secs: i64,
    rotate_ms: i64,
    /// Newest last.
    keys: RwLock<Vec<SigningKey>>,
    rng: SystemRandom,
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

impl Identity {
    /// The keys kept in `dir` (one made when none is fresh).
    pub fn open(
        dir: &Path,
        cfg: &IdentityConfig,
        default_issuer: String,
    ) -> Result<Self, IdentityError> {
        let err = |detail: String| IdentityError::Keys {
            dir: dir.to_path_buf(),
            detail,
        };
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|e| err(e.to_string()))?;
        }
        let mut keys = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(|e| err(e.to_string()))? {
            let path = entry.map_err(|e| err(e.to_string()))?.path();
            let Some(stem) = path
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_suffix(".p8"))
            else {
                continue;
            };
            let Some((ms, kid)) = stem.split_once('-') else {
                continue;
            };
            let Ok(created_ms) = ms.parse::<i64>() else {
                continue;
            };
            let der = std::fs::read(&path).map_err(|e| err(e.to_string()))?;
            let pair = EcdsaKeyPair::from_pkcs8(
                &ECDSA_P256_SHA256_FIXED_SIGNING,
                &der,
                &SystemRandom::new(),
            )
            .map_err(|e| err(format!("{}: {e}", path.display())))?;
            keys.push(SigningKey {
                kid: kid.to_string(),
                created_ms,
                pair,
            });
        }
        keys.sort_by_key(|k| k.created_ms);
        let id = Self {
            dir: dir.to_path_buf(),
            issuer: cfg.issuer.clone().unwrap_or(default_issuer),
            trust_domain: cfg.trust_domain.clone(),
            ttl_secs: cfg.token_ttl_secs as i64,
            rotate_ms: cfg.key_rotation_hours as i64 * 3_600_000,
            keys: RwLock::new(keys),
            rng: SystemRandom::new(),
        };
        id.rotate(crate::db::now_ms())?;
        Ok(id)
    }

    /// Make a new key when the newest is due, and forget keys no token
    /// still valid was signed with.
    fn rotate(&self, now_ms: i64) -> Result<(), IdentityError> {
        // The next key is made ahead of its turn, so it is published
        // before it signs.
        let due_at = (self.rotate_ms - PUBLISH_AHEAD_MS).max(PUBLISH_AHEAD_MS);
        let due = {
            let keys = self.keys.read().unwrap_or_else(|e| e.into_inner());
            keys.last().is_none_or(|k| now_ms - k.created_ms >= due_at)
        };
        if !due {
            return Ok(());
        }
        let mut keys = self.keys.write().unwrap_or_else(|e| e.into_inner());
        if keys.last().is_some_and(|k| now_ms - k.created_ms < due_at) {
            return Ok(()); // another caller rotated
        }
        let err = |detail: String| IdentityError::Keys {
            dir: self.dir.clone(),
            detail,
        };
        let pkcs8 = EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, &self.rng)
            .map_err(|e| err(e.to_string()))?;
        let pair =
            EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_FIXED_SIGNING, pkcs8.as_ref(), &self.rng)
                .map_err(|e| err(e.to_string()))?;
        let kid = {
            use sha2::Digest;
            b64(&sha2::Sha256::digest(pair.public_key().as_ref())[..12])
        };
        let path = self.dir.join(format!("{now_ms}-{kid}.p8"));
        crate::tls::write_private(&path, pkcs8.as_ref(), 0o600).map_err(|e| err(e.to_string()))?;
        tracing::info!(kid, "new workload identity signing key");
        keys.push(SigningKey {
            kid,
            created_ms: now_ms,
            pair,
        });
        // A key retired (a newer one exists) longer ago than a token lives
        // verifies nothing any more.
        let ttl_ms = self.ttl_secs * 1000 + PUBLISH_AHEAD_MS;
        let mut i = 0;
        while i + 1 < keys.len() {
            let retired_at = keys[i + 1].created_ms;
            if now_ms - retired_at > ttl_ms + 60_000 {
                let k = keys.remove(i);
                let _ =
                    std::fs::remove_file(self.dir.join(format!("{}-{}.p8", k.created_ms, k.kid)));
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    pub fn issuer(&self) -> &str {
        &self.issuer
    }

    /// The SPIFFE ID of sandbox `sandbox` of `team`.
    pub fn subject(&self, team: &str, sandbox: &str) -> String {
        format!(
            "spiffe://{}/team/{team}/sandbox/{sandbox}",
            self.trust_domain
        )
    }

    /// A token for sandbox `sandbox` of `team`, for `audience`.
    pub fn mint(&self, team: &str, sandbox: &str, audience: &str) -> Result<String, IdentityError> {
        let now_ms = crate::db::now_ms();
        self.rotate(now_ms)?;
        let now = now_ms / 1000;
        let keys = self.keys.read().unwrap_or_else(|e| e.into_inner());
        // The newest key that relying parties have had time to fetch (the
        // only one, on a first start).
        let key = keys
            .iter()
            .rev()
            .find(|k| now_ms - k.created_ms >= PUBLISH_AHEAD_MS)
            .or_else(|| keys.last())
            .ok_or(IdentityError::Sign)?;
        let header = json!({"alg": "ES256", "typ": "JWT", "kid": key.kid});
        let claims = json!({
            "iss": self.issuer,
            "sub": self.subject(team, sandbox),
            "aud": audience,
            "iat": now,
            "nbf": now - 5,
            "exp": now + self.ttl_secs,
            "jti": crate::ids::random_hex(16),
        });
        let signing_input = format!(
            "{}.{}",
            b64(header.to_string().as_bytes()),
            b64(claims.to_string().as_bytes())
        );
        let sig = key
            .pair
            .sign(&self.rng, signing_input.as_bytes())
            .map_err(|_| IdentityError::Sign)?;
        Ok(format!("{signing_input}.{}", b64(sig.as_ref())))
    }

    /// The public keys, as a JWK set.
    pub fn jwks(&self) -> serde_json::Value {
        let keys = self.keys.read().unwrap_or_else(|e| e.into_inner());
        let list: Vec<_> = keys
            .iter()
            .map(|k| {
                // Uncompressed point: 0x04 || x || y.
                let p = k.pair.public_key().as_ref();
                json!({
                    "kty": "EC", "crv": "P-256", "alg": "ES256", "use": "sig",
                    "kid": k.kid, "x": b64(&p[1..33]), "y": b64(&p[33..65]),
                })
            })
            .collect();
        json!({ "keys": list })
    }

    /// The OIDC discovery document.
    pub fn discovery(&self) -> serde_json::Value {
        json!({
            "issuer": self.issuer,
            "jwks_uri": format!("{}/.well-known/jwks.json", self.issuer),
            "id_token_signing_alg_values_supported": ["ES256"],
            "response_types_supported": ["id_token"],
            "subject_types_supported": ["public"],
            "claims_supported": ["iss", "sub", "aud", "exp", "iat", "nbf", "jti"],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> IdentityConfig {
        IdentityConfig {
            issuer: Some("http://127.0.0.1:3000".into()),
            ..Default::default()
        }
    }

    fn part(t: &str, i: usize) -> serde_json::Value {
        let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(t.split('.').nth(i).unwrap())
            .unwrap();
        serde_json::from_slice(&raw).unwrap()
    }

    #[test]
    fn tokens_verify_with_the_published_key_and_keys_rotate() {
        let dir = tempfile::tempdir().unwrap();
        let id = Identity::open(dir.path(), &cfg(), "unused".into()).unwrap();
        let t = id.mint("team-a", "isb1", "sts.example").unwrap();
        let (h, c) = (part(&t, 0), part(&t, 1));
        assert_eq!(h["alg"], "ES256");
        assert_eq!(c["aud"], "sts.example");
        assert_eq!(c["sub"], "spiffe://tine.local/team/team-a/sandbox/isb1");
        assert_eq!(c["iss"], "http://127.0.0.1:3000");
        assert_eq!(c["exp"].as_i64().unwrap() - c["iat"].as_i64().unwrap(), 300);
        // The signature verifies with the JWK of its kid.
        let jwks = id.jwks();
        let jwk = &jwks["keys"][0];
        assert_eq!(jwk["kid"], h["kid"]);
        let d = |s: &serde_json::Value| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(s.as_str().unwrap())
                .unwrap()
        };
        let mut point = vec![4u8];
        point.extend(d(&jwk["x"]));
        point.extend(d(&jwk["y"]));
        let (input, sig) = t.rsplit_once('.').unwrap();
        let key = ring::signature::UnparsedPublicKey::new(
            &ring::signature::ECDSA_P256_SHA256_FIXED,
            point,
        );
        let sig = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(sig)
            .unwrap();
        key.verify(input.as_bytes(), &sig).expect("verifies");
        let mut bent = sig.clone();
        bent[3] ^= 1;
        assert!(key.verify(input.as_bytes(), &bent).is_err());
        // Kept across restarts; a due rotation adds a key and keeps the old
        // one published while its tokens live.
        let again = Identity::open(dir.path(), &cfg(), "unused".into()).unwrap();
        assert_eq!(again.jwks(), jwks);
        let later = crate::db::now_ms() + 25 * 3_600_000;
        again.rotate(later).unwrap();
        assert_eq!(again.jwks()["keys"].as_array().unwrap().len(), 2);
        again.rotate(later + 25 * 3_600_000).unwrap();
        assert_eq!(
            again.jwks()["keys"].as_array().unwrap().len(),
            2,
            "the oldest is gone"
        );
    }

    #[test]
    fn iam_requests_are_checked() {
        let ok = parse_iam(
            &json!({"tokens": {"aws": {"audience": "sts.amazonaws.com", "tokenType": "JWT-SVID"}}}),
        )
        .unwrap();
        assert_eq!(ok["aws"].audience, "sts.amazonaws.com");
        for (v, needle) in [
            (
                json!({"tokens": {"a{b": {"audience": "x", "tokenType": "JWT-SVID"}}}),
                "not usable",
            ),
            (
                json!({"tokens": {"a": {"audience": "", "tokenType": "JWT-SVID"}}}),
                "audience",
            ),
            (
                json!({"tokens": {"a": {"audience": "x", "tokenType": "X509-SVID"}}}),
                "JWT-SVID",
            ),
            (json!({"tokens": {"a": {"audience": "x"}}}), "invalid iam"),
            (json!({"other": 1}), "invalid iam"),
        ] {
            let e = parse_iam(&v).unwrap_err();
            assert!(e.contains(needle), "{v}: {e}");
        }
        assert!(IdentityConfig {
            issuer: Some("ftp://x".into()),
            ..Default::default()
        }
        .validate()
        .is_err());
        assert!(IdentityConfig {
            trust_domain: "A B".into(),
            ..Default::default()
        }
        .validate()
        .is_err());
    }
}

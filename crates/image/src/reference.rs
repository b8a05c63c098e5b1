//! Image references (`python:3.12`, `127.0.0.1:5000/team/app@sha256:…`)
//! and the registries that are spoken to over plain HTTP.

use std::net::IpAddr;

use oci_client::Reference;

use crate::{ImageError, Result};

/// A parsed image reference.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageRef {
    inner: Reference,
}

impl ImageRef {
    pub fn parse(s: &str) -> Result<Self> {
        let inner: Reference = s.trim().parse().map_err(|e| ImageError::Reference {
            reference: s.to_string(),
            detail: format!("{e}"),
        })?;
        Ok(Self { inner })
    }

    /// The registry as named (`docker.io`, `127.0.0.1:5000`).
    pub fn registry(&self) -> &str {
        self.inner.registry()
    }

    /// The registry host that is actually contacted (Docker Hub's is
    /// `index.docker.io`).
    pub fn resolved_registry(&self) -> &str {
        self.inner.resolve_registry()
    }

    pub fn oci(&self) -> &Reference {
        &self.inner
    }

    /// The same repository, tag and digest at another registry (a mirror).
    pub fn at_registry(&self, registry: &str) -> Result<Self> {
        let mut s = format!("{registry}/{}", self.inner.repository());
        if let Some(tag) = self.inner.tag() {
            s.push_str(&format!(":{tag}"));
        }
        if let Some(digest) = self.inner.digest() {
            s.push_str(&format!("@{digest}"));
        }
        Self::parse(&s)
    }

    /// The canonical text: registry, repository and tag or digest.
    pub fn canonical(&self) -> String {
        self.inner.whole()
    }
}

impl std::fmt::Display for ImageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.canonical())
    }
}

/// Whether `registry` (`host` or `host:port`) is on loopback: such
/// registries are spoken to over plain HTTP, as Docker does for
/// 127.0.0.0/8.
pub fn is_loopback(registry: &str) -> bool {
    let host = match registry.strip_prefix('[') {
        Some(rest) => rest.split(']').next().unwrap_or(rest),
        None => registry.rsplit_once(':').map_or(registry, |(h, _)| h),
    };
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_parse_and_name_their_registry() {
        let r = ImageRef::parse("python:3.12").unwrap();
        assert_eq!(r.registry(), "docker.io");
        assert_eq!(r.canonical(), "docker.io/library/python:3.12");
        let r = ImageRef::parse("127.0.0.1:5000/team/app:v1").unwrap();
        assert_eq!(r.registry(), "127.0.0.1:5000");
        assert!(ImageRef::parse("has space:tag").is_err());
        assert!(ImageRef::parse("app:bad!tag").is_err());
        assert!(ImageRef::parse("").is_err());
        let m = ImageRef::parse("ubuntu:22.04")
            .unwrap()
            .at_registry("127.0.0.1:5000")
            .unwrap();
        assert_eq!(m.canonical(), "127.0.0.1:5000/library/ubuntu:22.04");
    }

    #[test]
    fn loopback_registries() {
        assert!(is_loopback("127.0.0.1:5000"));
        assert!(is_loopback("127.8.9.1"));
        assert!(is_loopback("localhost:5000"));
        assert!(is_loopback("[::1]:5000"));
        assert!(!is_loopback("docker.io"));
        assert!(!is_loopback("10.0.0.1:5000"));
        assert!(!is_loopback("registry.example:443"));
    }
}

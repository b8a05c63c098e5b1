//! The one crypto provider of every rustls configuration the server
//! builds: ring (also what `tine_image` installs as rustls' process
//! default for its registry client). No imports from the crate: a leaf.

use std::sync::{Arc, OnceLock};

use tokio_rustls::rustls::crypto::CryptoProvider;

/// ring's provider, made once and shared.
pub fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(tokio_rustls::rustls::crypto::ring::default_provider()))
        .clone()
}

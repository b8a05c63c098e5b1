//! VM driver (placeholder).

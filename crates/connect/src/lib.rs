//! Connect RPC protocol pieces (framing, end-of-stream, error codes).
//!
//! Owned by the envd work (issue "Guest agent"); this file is a placeholder
//! until that lands.

//! Connect RPC protocol pieces shared by tine's agent (server side) and host
//! tools (client side).
//!
//! Only what the E2B SDKs use is here: the JSON codec, the streaming
//! envelope (flag byte + 4-byte big-endian length), the end-of-stream
//! message and the error codes with their HTTP statuses. See
//! <https://connectrpc.com/docs/protocol>.
//!
//! Client side in three calls: [`encode_message`] builds a request envelope,
//! [`Decoder`] splits a response body into [`Frame`]s, and [`Frame::End`]
//! carries the parsed [`EndStream`] whose `error` is the call's outcome
//! ([`Error::from_unary_response`] reads a failed unary call). A server that
//! accepts compressed messages reads raw [`Envelope`]s with
//! [`Decoder::next_envelope`] instead.

mod code;
mod envelope;
mod error;

pub use code::Code;
pub use envelope::{
    encode_end_stream, encode_envelope, encode_message, parse_end_stream, Decoder, Envelope, Frame,
    FrameError, FLAG_COMPRESSED, FLAG_END_STREAM,
};
pub use error::{EndStream, Error};

/// Content type of unary JSON calls.
pub const CONTENT_TYPE_UNARY_JSON: &str = "application/json";
/// Content type of streaming JSON calls (both directions).
pub const CONTENT_TYPE_STREAM_JSON: &str = "application/connect+json";
/// Header carrying the call deadline in milliseconds.
pub const HEADER_TIMEOUT_MS: &str = "connect-timeout-ms";
/// Header carrying the protocol version (`1`) on unary calls.
pub const HEADER_PROTOCOL_VERSION: &str = "connect-protocol-version";

/// Parses a `Connect-Timeout-Ms` value: at most 10 ASCII digits (the spec's
/// limit). `None` for anything else, which callers treat as "no deadline".
pub fn parse_timeout_ms(value: &str) -> Option<u64> {
    let v = value.trim();
    if v.is_empty() || v.len() > 10 || !v.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    v.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_header() {
        assert_eq!(parse_timeout_ms("60000"), Some(60000));
        assert_eq!(parse_timeout_ms(" 5 "), Some(5));
        assert_eq!(parse_timeout_ms("-1"), None);
        assert_eq!(parse_timeout_ms("12345678901"), None);
        assert_eq!(parse_timeout_ms(""), None);
    }
}

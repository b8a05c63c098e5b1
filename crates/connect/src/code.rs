//! Connect error codes and their HTTP statuses.

use std::fmt;

/// A Connect error code (the same set as gRPC's, spelled in snake case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Code {
    Canceled,
    Unknown,
    InvalidArgument,
    DeadlineExceeded,
    NotFound,
    AlreadyExists,
    PermissionDenied,
    ResourceExhausted,
    FailedPrecondition,
    Aborted,
    OutOfRange,
    Unimplemented,
    Internal,
    Unavailable,
    DataLoss,
    Unauthenticated,
}

const ALL: [Code; 16] = [
    Code::Canceled,
    Code::Unknown,
    Code::InvalidArgument,
    Code::DeadlineExceeded,
    Code::NotFound,
    Code::AlreadyExists,
    Code::PermissionDenied,
    Code::ResourceExhausted,
    Code::FailedPrecondition,
    Code::Aborted,
    Code::OutOfRange,
    Code::Unimplemented,
    Code::Internal,
    Code::Unavailable,
    Code::DataLoss,
    Code::Unauthenticated,
];

impl Code {
    /// The wire name, e.g. `not_found`.
    pub fn as_str(self) -> &'static str {
        match self {
            Code::Canceled => "canceled",
            Code::Unknown => "unknown",
            Code::InvalidArgument => "invalid_argument",
            Code::DeadlineExceeded => "deadline_exceeded",
            Code::NotFound => "not_found",
            Code::AlreadyExists => "already_exists",
            Code::PermissionDenied => "permission_denied",
            Code::ResourceExhausted => "resource_exhausted",
            Code::FailedPrecondition => "failed_precondition",
            Code::Aborted => "aborted",
            Code::OutOfRange => "out_of_range",
            Code::Unimplemented => "unimplemented",
            Code::Internal => "internal",
            Code::Unavailable => "unavailable",
            Code::DataLoss => "data_loss",
            Code::Unauthenticated => "unauthenticated",
        }
    }

    /// Parses a wire name; `None` for names the protocol does not define.
    pub fn from_name(name: &str) -> Option<Code> {
        ALL.into_iter().find(|c| c.as_str() == name)
    }

    /// The HTTP status a unary error response (or a failed stream that
    /// never started) carries, per the Connect protocol.
    pub fn http_status(self) -> u16 {
        match self {
            Code::Canceled => 499,
            Code::Unknown | Code::Internal | Code::DataLoss => 500,
            Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => 400,
            Code::DeadlineExceeded => 504,
            Code::NotFound => 404,
            Code::AlreadyExists | Code::Aborted => 409,
            Code::PermissionDenied => 403,
            Code::ResourceExhausted => 429,
            Code::Unimplemented => 501,
            Code::Unavailable => 503,
            Code::Unauthenticated => 401,
        }
    }

    /// The code a client infers from an HTTP status when the body is not a
    /// Connect error (the protocol's "HTTP to error code" table).
    pub fn from_http_status(status: u16) -> Code {
        match status {
            400 => Code::Internal,
            401 => Code::Unauthenticated,
            403 => Code::PermissionDenied,
            404 => Code::Unimplemented,
            429 | 502 | 503 | 504 => Code::Unavailable,
            _ => Code::Unknown,
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl serde::Serialize for Code {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for Code {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let name = String::deserialize(d)?;
        // Unknown names become `unknown`, as the protocol tells clients to do.
        Ok(Code::from_name(&name).unwrap_or(Code::Unknown))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for c in ALL {
            assert_eq!(Code::from_name(c.as_str()), Some(c));
        }
        assert_eq!(Code::from_name("bogus"), None);
    }

    #[test]
    fn statuses_match_the_protocol() {
        assert_eq!(Code::NotFound.http_status(), 404);
        assert_eq!(Code::AlreadyExists.http_status(), 409);
        assert_eq!(Code::InvalidArgument.http_status(), 400);
        assert_eq!(Code::FailedPrecondition.http_status(), 400);
        assert_eq!(Code::Unauthenticated.http_status(), 401);
        assert_eq!(Code::PermissionDenied.http_status(), 403);
        assert_eq!(Code::ResourceExhausted.http_status(), 429);
        assert_eq!(Code::Unavailable.http_status(), 503);
        assert_eq!(Code::DeadlineExceeded.http_status(), 504);
        assert_eq!(Code::Unimplemented.http_status(), 501);
        assert_eq!(Code::Internal.http_status(), 500);
        assert_eq!(Code::from_http_status(404), Code::Unimplemented);
        assert_eq!(Code::from_http_status(401), Code::Unauthenticated);
        assert_eq!(Code::from_http_status(418), Code::Unknown);
    }

    #[test]
    fn serde_uses_wire_names() {
        assert_eq!(
            serde_json::to_string(&Code::NotFound).unwrap(),
            "\"not_found\""
        );
        let c: Code = serde_json::from_str("\"whatever\"").unwrap();
        assert_eq!(c, Code::Unknown);
    }
}

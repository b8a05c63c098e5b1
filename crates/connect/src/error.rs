//! Connect errors and the end-of-stream message.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::Code;

/// A Connect error: the JSON body of a failed unary call, or the `error`
/// of an end-of-stream message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{code}: {message}")]
pub struct Error {
    pub code: Code,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub message: String,
}

impl Error {
    pub fn new(code: Code, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    /// The JSON body of a unary error response.
    pub fn to_json(&self) -> Vec<u8> {
        // Serializing a struct of a string and an enum cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Reads a unary error response: the body's Connect error if it is one,
    /// else a code inferred from the HTTP status.
    pub fn from_unary_response(status: u16, body: &[u8]) -> Self {
        match serde_json::from_slice::<Error>(body) {
            Ok(err) => err,
            Err(_) => Error::new(
                Code::from_http_status(status),
                String::from_utf8_lossy(body).into_owned(),
            ),
        }
    }
}

/// The payload of the last frame of every stream.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EndStream {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<Error>,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub metadata: BTreeMap<String, Vec<String>>,
}

impl EndStream {
    pub fn ok() -> Self {
        Self::default()
    }

    pub fn err(error: Error) -> Self {
        Self {
            error: Some(error),
            metadata: BTreeMap::new(),
        }
    }

    /// Turns the end of a stream into the call's outcome.
    pub fn into_result(self) -> Result<(), Error> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_json() {
        let e = Error::new(Code::NotFound, "no such file");
        assert_eq!(
            String::from_utf8(e.to_json()).unwrap(),
            r#"{"code":"not_found","message":"no such file"}"#
        );
        assert_eq!(Error::from_unary_response(404, &e.to_json()), e);
        let plain = Error::from_unary_response(404, b"404 page not found");
        assert_eq!(plain.code, Code::Unimplemented);
    }

    #[test]
    fn end_stream_json() {
        assert_eq!(serde_json::to_string(&EndStream::ok()).unwrap(), "{}");
        let end = EndStream::err(Error::new(Code::DeadlineExceeded, "too slow"));
        let json = serde_json::to_string(&end).unwrap();
        assert_eq!(
            json,
            r#"{"error":{"code":"deadline_exceeded","message":"too slow"}}"#
        );
        let back: EndStream = serde_json::from_str(&json).unwrap();
        assert_eq!(back.into_result().unwrap_err().code, Code::DeadlineExceeded);
        let with_meta: EndStream =
            serde_json::from_str(r#"{"metadata":{"a":["1","2"]},"extra":true}"#).unwrap();
        assert_eq!(with_meta.metadata["a"], vec!["1", "2"]);
    }
}

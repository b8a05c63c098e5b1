//! The one error type of the envd API and the one place it is mapped to
//! Connect codes (RPC) and HTTP statuses (REST routes).

use std::io;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use tine_connect::Code;

#[derive(Debug, Clone, thiserror::Error)]
pub enum EnvdError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Unimplemented(String),
    /// No space left on the device (or quota): 507 on REST routes.
    #[error("{0}")]
    NoSpace(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("{0}")]
    Internal(String),
}

impl EnvdError {
    /// An I/O error on `what` (usually a path), classified by its errno.
    pub fn io(err: &io::Error, what: impl std::fmt::Display) -> Self {
        let msg = format!("{what}: {err}");
        match err.raw_os_error() {
            Some(libc::ENOENT) => Self::NotFound(msg),
            Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => {
                Self::PermissionDenied(msg)
            }
            Some(libc::EEXIST) | Some(libc::ENOTEMPTY) => Self::AlreadyExists(msg),
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => Self::NoSpace(msg),
            Some(libc::ENOTDIR)
            | Some(libc::EISDIR)
            | Some(libc::EINVAL)
            | Some(libc::ENAMETOOLONG)
            | Some(libc::ELOOP)
            | Some(libc::EXDEV) => Self::InvalidArgument(msg),
            _ => Self::Internal(msg),
        }
    }

    pub fn code(&self) -> Code {
        match self {
            Self::InvalidArgument(_) => Code::InvalidArgument,
            Self::NotFound(_) => Code::NotFound,
            Self::AlreadyExists(_) => Code::AlreadyExists,
            Self::PermissionDenied(_) => Code::PermissionDenied,
            Self::Unauthenticated(_) => Code::Unauthenticated,
            Self::FailedPrecondition(_) => Code::FailedPrecondition,
            Self::Unimplemented(_) => Code::Unimplemented,
            Self::NoSpace(_) => Code::ResourceExhausted,
            Self::DeadlineExceeded(_) => Code::DeadlineExceeded,
            Self::UnsupportedMediaType(_) => Code::Unknown,
            Self::Internal(_) => Code::Internal,
        }
    }

    /// Status on the REST routes (`/files`, `/init`, ...), whose clients map
    /// 400/401/404/507 to distinct exceptions.
    pub fn http_status(&self) -> StatusCode {
        match self {
            Self::InvalidArgument(_) | Self::FailedPrecondition(_) => StatusCode::BAD_REQUEST,
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::AlreadyExists(_) => StatusCode::CONFLICT,
            Self::PermissionDenied(_) => StatusCode::FORBIDDEN,
            Self::Unauthenticated(_) => StatusCode::UNAUTHORIZED,
            Self::Unimplemented(_) => StatusCode::NOT_IMPLEMENTED,
            Self::NoSpace(_) => StatusCode::INSUFFICIENT_STORAGE,
            Self::DeadlineExceeded(_) => StatusCode::GATEWAY_TIMEOUT,
            Self::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn to_connect(&self) -> tine_connect::Error {
        tine_connect::Error::new(self.code(), self.to_string())
    }
}

/// REST error response: `{"code": <status>, "message": ...}`.
impl IntoResponse for EnvdError {
    fn into_response(self) -> Response {
        let status = self.http_status();
        if let Self::Internal(msg) = &self {
            tracing::warn!(%msg, "internal error");
        }
        let body = serde_json::json!({ "code": status.as_u16(), "message": self.to_string() });
        (status, axum::Json(body)).into_response()
    }
}

pub type Result<T, E = EnvdError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_errors_are_classified() {
        let e = |n| EnvdError::io(&io::Error::from_raw_os_error(n), "/x");
        assert_eq!(e(libc::ENOENT).code(), Code::NotFound);
        assert_eq!(e(libc::EACCES).code(), Code::PermissionDenied);
        assert_eq!(e(libc::EEXIST).code(), Code::AlreadyExists);
        assert_eq!(
            e(libc::ENOSPC).http_status(),
            StatusCode::INSUFFICIENT_STORAGE
        );
        assert_eq!(e(libc::ENOTDIR).http_status(), StatusCode::BAD_REQUEST);
        assert_eq!(e(libc::EIO).code(), Code::Internal);
        assert!(e(libc::ENOENT).to_string().starts_with("/x: "));
    }
}

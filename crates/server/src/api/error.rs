//! The E2B error shape: `{"code": <HTTP status>, "message": "..."}` with
//! the same status on the response. The Python SDK crashes on any other
//! body for an error status, so every error path goes through here.

use axum::response::{IntoResponse, Response};
use http::{header, StatusCode};

use crate::sandboxes::SandboxError;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, message)
    }
    pub fn unauthorized(message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, message)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "code": self.status.as_u16(), "message": self.message });
        (
            self.status,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response()
    }
}

impl From<SandboxError> for ApiError {
    fn from(e: SandboxError) -> Self {
        let status = match &e {
            SandboxError::NotFound(_) => StatusCode::NOT_FOUND,
            SandboxError::Template(crate::templates::TemplateError::NotFound(_)) => {
                StatusCode::NOT_FOUND
            }
            SandboxError::Template(crate::templates::TemplateError::Invalid(_)) => {
                StatusCode::BAD_REQUEST
            }
            SandboxError::InvalidArgument(_) => StatusCode::BAD_REQUEST,
            SandboxError::Conflict(_) => StatusCode::CONFLICT,
            SandboxError::Capacity(_) => StatusCode::TOO_MANY_REQUESTS,
            SandboxError::Template(_) | SandboxError::Vm { .. } | SandboxError::Db(_) => {
                tracing::error!("{e}");
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        Self::new(status, e.to_string())
    }
}

//! The E2B error shape: `{"code": <HTTP status>, "message": "..."}` with
//! the same status on the response. The Python SDK crashes on any other
//! body for an error status, so every error path goes through here.

use axum::response::{IntoResponse, Response};
use http::{header, StatusCode};

use crate::sandboxes::SandboxError;
use crate::templates::TemplateError;

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
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
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

/// The status for a VM driver error of kind `kind`.
fn vm_status(kind: tine_vmm::ErrorKind) -> StatusCode {
    use tine_vmm::ErrorKind;
    match kind {
        ErrorKind::NotFound => StatusCode::NOT_FOUND,
        ErrorKind::InvalidState => StatusCode::CONFLICT,
        ErrorKind::NoSpace => StatusCode::INSUFFICIENT_STORAGE,
        ErrorKind::Timeout => StatusCode::GATEWAY_TIMEOUT,
        ErrorKind::Guest => StatusCode::BAD_GATEWAY,
        ErrorKind::Damaged | ErrorKind::Host => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn template_status(e: &TemplateError) -> StatusCode {
    match e {
        TemplateError::NotFound(_) => StatusCode::NOT_FOUND,
        TemplateError::Invalid(_) => StatusCode::BAD_REQUEST,
        TemplateError::TooManyShapes(_) => StatusCode::TOO_MANY_REQUESTS,
        TemplateError::Vm { source, .. } => vm_status(source.kind()),
        TemplateError::Build { .. } | TemplateError::Agent { .. } | TemplateError::Db(_) => {
            StatusCode::INTERNAL_SERVER_ERROR
        }
    }
}

/// Every sandbox error's status, in this one place.
impl From<SandboxError> for ApiError {
    fn from(e: SandboxError) -> Self {
        let status = match &e {
            SandboxError::NotFound(_) => StatusCode::NOT_FOUND,
            SandboxError::Template(t) => template_status(t),
            SandboxError::InvalidArgument(_) => StatusCode::BAD_REQUEST,
            SandboxError::Conflict(_) => StatusCode::CONFLICT,
            SandboxError::Capacity(_)
            | SandboxError::TeamLimit(_)
            | SandboxError::HostMemory(_) => StatusCode::TOO_MANY_REQUESTS,
            SandboxError::HostDisk(_) => StatusCode::INSUFFICIENT_STORAGE,
            SandboxError::GuestUnresponsive { .. } => StatusCode::SERVICE_UNAVAILABLE,
            SandboxError::Unreadable { .. } => StatusCode::BAD_GATEWAY,
            SandboxError::Vm { source, .. } => vm_status(source.kind()),
            SandboxError::Network { source, .. }
                if matches!(**source, crate::network::NetworkError::Invalid(_)) =>
            {
                StatusCode::BAD_REQUEST
            }
            SandboxError::Agent { .. }
            | SandboxError::Network { .. }
            | SandboxError::Volumes { .. }
            | SandboxError::Inconsistent { .. }
            | SandboxError::Db(_) => StatusCode::INTERNAL_SERVER_ERROR,
        };
        if status.is_server_error() {
            tracing::error!("{e}");
        }
        Self::new(status, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_errors_keep_their_kind() {
        let vm = |source| SandboxError::Vm {
            id: "s".into(),
            context: "restore",
            source: Box::new(source),
        };
        let missing = tine_vmm::Error::NotFound {
            what: "snapshot",
            id: "x".into(),
        };
        assert_eq!(ApiError::from(vm(missing)).status, StatusCode::NOT_FOUND);
        let busy = tine_vmm::Error::InvalidState {
            vm: "s".into(),
            state: "stopped",
            op: "pause",
        };
        assert_eq!(ApiError::from(vm(busy)).status, StatusCode::CONFLICT);
        let host_mem = SandboxError::HostMemory("low".into());
        assert_eq!(
            ApiError::from(host_mem).status,
            StatusCode::TOO_MANY_REQUESTS
        );
        let host_disk = SandboxError::HostDisk("full".into());
        assert_eq!(
            ApiError::from(host_disk).status,
            StatusCode::INSUFFICIENT_STORAGE
        );
        let damaged = tine_vmm::Error::Snapshot {
            path: "/x".into(),
            detail: "RAM layer: short".into(),
        };
        let e = ApiError::from(vm(damaged));
        assert_eq!(e.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(e.message.contains("RAM layer: short"), "{}", e.message);
        // A full disk is 507 (28: ENOSPC, 5: EIO on Linux).
        let full = tine_vmm::Error::Io {
            context: "writing the RAM layer".into(),
            source: std::io::Error::from_raw_os_error(28),
        };
        assert_eq!(
            ApiError::from(vm(full)).status,
            StatusCode::INSUFFICIENT_STORAGE
        );
        let other = tine_vmm::Error::Io {
            context: "x".into(),
            source: std::io::Error::from_raw_os_error(5),
        };
        assert_eq!(
            ApiError::from(vm(other)).status,
            StatusCode::INTERNAL_SERVER_ERROR
        );
        // A guest that does not come up in time is 504; one whose QEMU
        // died, 502.
        let slow = tine_vmm::Error::NotReady {
            vm: "s".into(),
            secs: 30,
            console: String::new(),
        };
        assert_eq!(ApiError::from(vm(slow)).status, StatusCode::GATEWAY_TIMEOUT);
        let died = tine_vmm::Error::QemuExited {
            vm: "s".into(),
            status: "signal 9".into(),
            during: "during boot",
            qemu_log: String::new(),
            console: String::new(),
        };
        assert_eq!(ApiError::from(vm(died)).status, StatusCode::BAD_GATEWAY);
    }
}

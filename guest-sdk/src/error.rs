//! The one error type a [`Handler`](crate::Handler) returns.
//!
//! Every error knows its HTTP status and a stable `snake_case` code; the
//! response body is `{"error":{"code":"…","message":"…"}}` (see
//! [`Response::error`](crate::Response::error)). The message is for people:
//! clients should match on the code.

use crate::centerface::DecodeError;
use crate::face_detect;
use crate::http::HttpError;
use crate::image::ImageError;

/// Anything that can go wrong while handling a request.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request itself is wrong (method, body, parameters, form).
    #[error(transparent)]
    Http(#[from] HttpError),
    /// The image cannot be decoded, is too large, or cannot be encoded.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// The host's `infer` call failed.
    #[error(transparent)]
    Infer(#[from] InferError),
    /// The model's outputs do not have the expected shape.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// An error defined by the handler itself.
    #[error("{message}")]
    Custom {
        /// HTTP status of the response.
        status: u16,
        /// Stable `snake_case` code for clients.
        code: &'static str,
        /// Human-readable text.
        message: String,
    },
}

impl Error {
    /// A handler-defined error with its own status and code.
    pub fn custom(status: u16, code: &'static str, message: impl Into<String>) -> Self {
        Self::Custom { status, code, message: message.into() }
    }

    /// The HTTP status this error answers with.
    pub fn status(&self) -> u16 {
        match self {
            Self::Http(e) => e.status(),
            Self::Image(e) => e.status(),
            Self::Infer(e) => e.status(),
            Self::Decode(e) => e.status(),
            Self::Custom { status, .. } => *status,
        }
    }

    /// The stable `snake_case` code of this error.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Http(e) => e.code(),
            Self::Image(e) => e.code(),
            Self::Infer(e) => e.code(),
            Self::Decode(e) => e.code(),
            Self::Custom { code, .. } => code,
        }
    }

    /// Headers the response must carry besides the JSON body
    /// (`Allow` for 405, `Retry-After` for 503).
    pub fn headers(&self) -> Vec<(String, String)> {
        match self {
            Self::Http(HttpError::MethodNotAllowed { allowed, .. }) => {
                vec![("allow".into(), allowed.join(", "))]
            }
            Self::Infer(InferError::Overloaded) => vec![("retry-after".into(), "1".into())],
            _ => Vec::new(),
        }
    }
}

/// Why the host's `face-detect.infer` failed (the WIT `error` variant).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InferError {
    /// The tensor does not match the model's input (400).
    #[error("the host rejected the input tensor: {0}")]
    InvalidInput(String),
    /// The host serves no model of that name to this tenant (404: the
    /// model asked for, by the request or the handler, is not there, or
    /// the tenant's limit `models` leaves it out).
    #[error("the host serves no model {0}")]
    UnknownModel(String),
    /// The host's queues are full (503, `Retry-After: 1`).
    #[error("the face detector is overloaded; retry in a second")]
    Overloaded,
    /// The request's deadline passed before its batch ran (504).
    #[error("the request's deadline passed before the face detector ran")]
    DeadlineExceeded,
    /// The request used up its calls to `infer` (429).
    #[error("quota exceeded: {0}")]
    QuotaExceeded(String),
    /// The inference engine failed (500).
    #[error("the face detector failed: {0}")]
    Backend(String),
}

impl InferError {
    /// The HTTP status this error answers with.
    pub fn status(&self) -> u16 {
        match self {
            Self::InvalidInput(_) => 400,
            Self::UnknownModel(_) => 404,
            Self::Backend(_) => 500,
            Self::Overloaded => 503,
            Self::DeadlineExceeded => 504,
            Self::QuotaExceeded(_) => 429,
        }
    }

    /// The stable `snake_case` code of this error.
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidInput(_) => "invalid_input",
            Self::UnknownModel(_) => "unknown_model",
            Self::Overloaded => "overloaded",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::QuotaExceeded(_) => "quota_exceeded",
            Self::Backend(_) => "backend_error",
        }
    }
}

impl From<face_detect::Error> for InferError {
    fn from(error: face_detect::Error) -> Self {
        use face_detect::Error as E;
        match error {
            E::InvalidInput(m) => Self::InvalidInput(m),
            E::UnknownModel(m) => Self::UnknownModel(m),
            E::Overloaded => Self::Overloaded,
            E::DeadlineExceeded => Self::DeadlineExceeded,
            E::QuotaExceeded(m) => Self::QuotaExceeded(m),
            E::Backend(m) => Self::Backend(m),
        }
    }
}

impl From<face_detect::Error> for Error {
    fn from(error: face_detect::Error) -> Self {
        Self::Infer(error.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn infer_errors_map_to_the_contracted_statuses() {
        let cases = [
            (face_detect::Error::InvalidInput("x".into()), 400, "invalid_input"),
            (face_detect::Error::UnknownModel("x".into()), 404, "unknown_model"),
            (face_detect::Error::Overloaded, 503, "overloaded"),
            (face_detect::Error::DeadlineExceeded, 504, "deadline_exceeded"),
            (face_detect::Error::QuotaExceeded("x".into()), 429, "quota_exceeded"),
            (face_detect::Error::Backend("x".into()), 500, "backend_error"),
        ];
        for (wit, status, code) in cases {
            let error = Error::from(wit);
            assert_eq!((error.status(), error.code()), (status, code));
        }
    }

    #[test]
    fn overloaded_carries_retry_after_and_405_carries_allow() {
        let overloaded = Error::from(face_detect::Error::Overloaded);
        assert_eq!(overloaded.headers(), vec![("retry-after".to_string(), "1".to_string())]);
        let method = Error::from(HttpError::MethodNotAllowed { method: "GET".into(), allowed: vec!["POST".into()] });
        assert_eq!(method.status(), 405);
        assert_eq!(method.headers(), vec![("allow".to_string(), "POST".to_string())]);
    }
}

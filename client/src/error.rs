//! The error every client call returns.

use felix_wire::{ErrorCode, WireError};

/// Why a call failed.
///
/// [`ClientError::Server`] is the broker's own answer (a typed
/// [`ErrorCode`] and a human message). Every other variant is raised on the
/// client side, before a request was sent or while waiting for its answer.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The broker refused the request.
    #[error("{code}: {message}")]
    Server {
        code: ErrorCode,
        message: String,
        /// The broker said it did nothing of the request (see
        /// [`ClientError::not_applied`]).
        not_applied: bool,
    },
    /// A broker of a cluster that does not lead the shard refused the
    /// request (`not_leader`), naming the client address of the broker
    /// that does when it knows one. [`crate::ClusterClient`] follows it.
    /// A publish so refused was never proposed (`not_applied`); other
    /// requests may have been partly carried out before the broker found it
    /// no longer leads (a poll's claims, say).
    #[error("not_leader: {message}")]
    NotLeader {
        leader: Option<String>,
        message: String,
        /// The broker said it did nothing of the request.
        not_applied: bool,
    },
    /// Connecting to the broker, or talking to it, failed.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// No answer within the request timeout (plus any wait the request
    /// asked the broker for), or no connection within the connect timeout.
    /// The request may or may not have been applied.
    #[error("timed out waiting for the broker")]
    Timeout,
    /// The connection was lost while the request was in flight. The request
    /// may or may not have been applied; it is not resent automatically.
    #[error("connection to the broker was lost before the answer arrived; the request may or may not have been applied")]
    Disconnected,
    /// The broker did not advertise the feature the call needs, so the
    /// client refused to send it.
    #[error("unsupported by this broker: {0}")]
    Unsupported(String),
    /// The broker sent something this client cannot make sense of.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The call's arguments were refused before anything was sent.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

impl ClientError {
    /// The broker's error code, for [`ClientError::Server`]; `None` for
    /// errors raised on the client side.
    pub fn code(&self) -> Option<ErrorCode> {
        match self {
            ClientError::Server { code, .. } => Some(*code),
            ClientError::NotLeader { .. } => Some(ErrorCode::NotLeader),
            _ => None,
        }
    }

    /// Whether the request certainly did nothing, so that sending it again
    /// cannot apply it twice: the broker refused it before doing anything
    /// of it and said so (a publish refused so stored none of its records,
    /// a refused `not_leader` included), or the client never sent it
    /// ([`ClientError::Unsupported`], [`ClientError::InvalidArgument`]).
    ///
    /// `false` means the outcome is not known from the error alone: a lost
    /// connection, a timeout, or a refusal that can come after part of the
    /// work, such as `unavailable` from a shard that stopped while writing
    /// the records. (Brokers that predate the flag never set it.)
    pub fn not_applied(&self) -> bool {
        match self {
            ClientError::Server { not_applied, .. }
            | ClientError::NotLeader { not_applied, .. } => *not_applied,
            ClientError::Unsupported(_) | ClientError::InvalidArgument(_) => true,
            _ => false,
        }
    }

    /// This error, as the error of a request it kept from being sent (a
    /// lookup the request needed failed): nothing of that request was
    /// applied, which a server error can say.
    pub(crate) fn unsent(self) -> Self {
        match self {
            ClientError::Server { code, message, .. } => ClientError::Server {
                code,
                message,
                not_applied: true,
            },
            ClientError::NotLeader {
                leader, message, ..
            } => ClientError::NotLeader {
                leader,
                message,
                not_applied: true,
            },
            other => other,
        }
    }

    /// This error for a call carried out in part (on another shard): not
    /// "nothing done", whatever the failing part said.
    pub(crate) fn partly_done(self) -> Self {
        match self {
            ClientError::Server { code, message, .. } => ClientError::Server {
                code,
                message,
                not_applied: false,
            },
            ClientError::NotLeader {
                leader, message, ..
            } => ClientError::NotLeader {
                leader,
                message,
                not_applied: false,
            },
            other => other,
        }
    }

    /// This error with `note` after its message, in parentheses (where
    /// it has a message of its own: a timeout or a lost connection keeps
    /// its fixed one).
    pub(crate) fn noted(self, note: &str) -> Self {
        match self {
            ClientError::Server {
                code,
                message,
                not_applied,
            } => ClientError::Server {
                code,
                message: format!("{message} ({note})"),
                not_applied,
            },
            ClientError::NotLeader {
                leader,
                message,
                not_applied,
            } => ClientError::NotLeader {
                leader,
                message: format!("{message} ({note})"),
                not_applied,
            },
            ClientError::Io(e) => {
                ClientError::Io(std::io::Error::new(e.kind(), format!("{e} ({note})")))
            }
            ClientError::Unsupported(m) => ClientError::Unsupported(format!("{m} ({note})")),
            ClientError::Protocol(m) => ClientError::Protocol(format!("{m} ({note})")),
            ClientError::InvalidArgument(m) => {
                ClientError::InvalidArgument(format!("{m} ({note})"))
            }
            other => other,
        }
    }

    /// A short snake_case name for the error: the broker's code (such as
    /// `not_found` or `stale_claim`) for a server error, otherwise one of
    /// `io`, `timeout`, `disconnected`, `unsupported`, `protocol`,
    /// `invalid_argument`. Used by the `felix` CLI's `error: <code>: ...`.
    pub fn kind(&self) -> &'static str {
        match self {
            ClientError::Server { code, .. } => code.as_str(),
            ClientError::NotLeader { .. } => ErrorCode::NotLeader.as_str(),
            ClientError::Io(_) => "io",
            ClientError::Timeout => "timeout",
            ClientError::Disconnected => "disconnected",
            ClientError::Unsupported(_) => "unsupported",
            ClientError::Protocol(_) => "protocol",
            ClientError::InvalidArgument(_) => "invalid_argument",
        }
    }

    /// The error text without the kind prefix: the broker's message for a
    /// server error, otherwise the error's description.
    pub fn message(&self) -> String {
        match self {
            ClientError::Server { message, .. } | ClientError::NotLeader { message, .. } => {
                message.clone()
            }
            ClientError::Io(e) => e.to_string(),
            ClientError::Unsupported(m)
            | ClientError::Protocol(m)
            | ClientError::InvalidArgument(m) => m.clone(),
            other => other.to_string(),
        }
    }
}

impl From<WireError> for ClientError {
    fn from(e: WireError) -> ClientError {
        if e.code == ErrorCode::NotLeader {
            return ClientError::NotLeader {
                leader: e.leader,
                message: e.message,
                not_applied: e.not_applied,
            };
        }
        ClientError::Server {
            code: e.code,
            message: e.message,
            not_applied: e.not_applied,
        }
    }
}

/// Shorthand for results of client calls.
pub type Result<T, E = ClientError> = std::result::Result<T, E>;

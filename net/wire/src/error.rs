//! Error codes carried in [`Response::Error`](crate::Response::Error), and
//! the error a decoder returns for bytes it cannot accept.

use std::fmt;

/// Why the broker refused a request. Stable numbers: never renumber, only
/// append.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorCode {
    /// The request was malformed or its arguments make no sense.
    InvalidRequest = 1,
    /// The stream, shard, group or record does not exist.
    NotFound = 2,
    /// The stream or group already exists.
    AlreadyExists = 3,
    /// The shard lives on another core; [`WireError::core`] names it.
    WrongCore = 4,
    /// The broker does not support this request, version or feature.
    Unsupported = 5,
    /// A frame, record or batch is over a size limit.
    TooLarge = 6,
    /// The broker cannot serve this now (shutting down, shard stopped).
    Unavailable = 7,
    /// Missing or bad credentials (a refused HELLO, after which the
    /// connection is closed), or a call the principal holds no permission
    /// for (the connection stays open).
    Unauthorized = 8,
    /// A group ack/nack/extend named a claim that is no longer held (it
    /// expired and was handed to someone else, or the attempt count differs).
    StaleClaim = 9,
    /// This broker is not the leader for the shard.
    NotLeader = 10,
    /// A bug or an I/O failure inside the broker.
    Internal = 11,
    /// Overloaded; retry after backing off.
    Busy = 12,
}

impl ErrorCode {
    /// Every code, in numeric order.
    pub const ALL: [ErrorCode; 12] = [
        ErrorCode::InvalidRequest,
        ErrorCode::NotFound,
        ErrorCode::AlreadyExists,
        ErrorCode::WrongCore,
        ErrorCode::Unsupported,
        ErrorCode::TooLarge,
        ErrorCode::Unavailable,
        ErrorCode::Unauthorized,
        ErrorCode::StaleClaim,
        ErrorCode::NotLeader,
        ErrorCode::Internal,
        ErrorCode::Busy,
    ];

    /// The snake_case name used in logs, metrics labels and the CLI.
    pub fn as_str(&self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::NotFound => "not_found",
            ErrorCode::AlreadyExists => "already_exists",
            ErrorCode::WrongCore => "wrong_core",
            ErrorCode::Unsupported => "unsupported",
            ErrorCode::TooLarge => "too_large",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::Unauthorized => "unauthorized",
            ErrorCode::StaleClaim => "stale_claim",
            ErrorCode::NotLeader => "not_leader",
            ErrorCode::Internal => "internal",
            ErrorCode::Busy => "busy",
        }
    }

    /// The code's number on the wire.
    pub fn as_u16(self) -> u16 {
        self as u16
    }

    /// The code with this number, if this crate knows it.
    pub fn from_u16(v: u16) -> Option<ErrorCode> {
        ErrorCode::ALL.iter().copied().find(|c| *c as u16 == v)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error answer from the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireError {
    pub code: ErrorCode,
    /// Human-readable detail. Not meant to be parsed.
    pub message: String,
    /// For [`ErrorCode::WrongCore`]: the core that owns the shard.
    pub core: Option<u32>,
    /// For [`ErrorCode::NotLeader`]: the client address of the broker that
    /// leads the shard, when the answering broker knows it. (On the wire
    /// only in `not_leader` errors, which brokers send only in a cluster.)
    pub leader: Option<String>,
    /// The broker refused the request before doing anything of it (a
    /// publish refused whole: none of its records stored), so sending it
    /// again cannot apply it twice. `false` says nothing either way: many
    /// codes mean a refusal by themselves, while `unavailable` or
    /// `internal` can come after part of the work (a shard stopped while
    /// its records were being written). A trailing field, on the wire only
    /// when set and only to a client that negotiated
    /// [`FEATURE_ERROR_NOT_APPLIED`](crate::FEATURE_ERROR_NOT_APPLIED).
    pub not_applied: bool,
}

impl WireError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> WireError {
        WireError {
            code,
            message: message.into(),
            core: None,
            leader: None,
            not_applied: false,
        }
    }

    /// An error for a request refused before anything of it was done
    /// (see [`WireError::not_applied`]).
    pub fn refused(code: ErrorCode, message: impl Into<String>) -> WireError {
        WireError {
            not_applied: true,
            ..WireError::new(code, message)
        }
    }

    /// A [`ErrorCode::WrongCore`] error pointing at `core`.
    pub fn wrong_core(core: u32, message: impl Into<String>) -> WireError {
        WireError {
            code: ErrorCode::WrongCore,
            message: message.into(),
            core: Some(core),
            leader: None,
            not_applied: false,
        }
    }

    /// A [`ErrorCode::NotLeader`] error naming the leader's client address,
    /// if known.
    pub fn not_leader(leader: Option<String>, message: impl Into<String>) -> WireError {
        WireError {
            code: ErrorCode::NotLeader,
            message: message.into(),
            core: None,
            leader,
            not_applied: false,
        }
    }
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code, self.message)?;
        if let Some(core) = self.core {
            write!(f, " (core {core})")?;
        }
        if let Some(leader) = &self.leader {
            write!(f, " (leader {leader})")?;
        }
        Ok(())
    }
}

impl std::error::Error for WireError {}

/// Why bytes could not be decoded into a message.
///
/// Two kinds of failure need telling apart by a read loop:
///
/// * **Framing errors** ([`DecodeError::request_id`] is `None`): the length
///   prefix itself is unacceptable ([`DecodeError::TooLarge`], or too short to
///   hold a header). Nothing was consumed and the byte stream cannot be
///   resynchronised: drop the connection.
/// * **Body errors** ([`DecodeError::Body`]): the header was readable and the
///   whole frame was within the cap and buffered, but its kind, flags, opcode
///   or body were bad. The frame's bytes *have* been consumed, so the
///   connection is still in sync; a broker should answer `request_id` with
///   [`DecodeError::to_wire_error`] and carry on.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The length prefix is over the receiver's limit.
    #[error("frame declares {declared} bytes, over the limit of {max}")]
    TooLarge { declared: u32, max: u32 },
    /// A field ran past the end of the frame, or a count promises more
    /// elements than the remaining bytes could hold.
    #[error("truncated {what}")]
    Truncated { what: &'static str },
    /// The frame kind is not the one this decoder reads (a response sent to
    /// a broker, say) or not a known kind at all.
    #[error("unexpected frame kind {0}")]
    BadKind(u8),
    /// No message of this kind has this opcode.
    #[error("unknown opcode {0:#04x}")]
    UnknownOpcode(u8),
    /// A string field is not UTF-8.
    #[error("{what} is not valid UTF-8")]
    BadUtf8 { what: &'static str },
    /// A field holds a value outside its domain (an enum tag, a presence
    /// byte other than 0 or 1, non-zero flags, a frame length shorter than
    /// the header).
    #[error("invalid {what}")]
    BadValue { what: &'static str },
    /// A list holds more elements than any message may
    /// ([`MAX_ITEMS_PER_VEC`](crate::MAX_ITEMS_PER_VEC)).
    #[error("{what}: {count} elements, over the limit of {max}")]
    TooMany {
        what: &'static str,
        count: usize,
        max: usize,
    },
    /// The body decoded but bytes were left over.
    #[error("trailing bytes after message body")]
    TrailingBytes,
    /// The frame was consumed but its contents were bad; `reason` says how.
    #[error("bad frame (request id {request_id}, opcode {opcode:#04x}): {reason}")]
    Body {
        request_id: u64,
        opcode: u8,
        reason: Box<DecodeError>,
    },
}

impl DecodeError {
    /// The request id of the offending frame, when its header could be read
    /// and the frame was consumed. `None` means the stream is out of sync.
    pub fn request_id(&self) -> Option<u64> {
        match self {
            DecodeError::Body { request_id, .. } => Some(*request_id),
            _ => None,
        }
    }

    /// The opcode of the offending frame, when its header could be read.
    pub fn opcode(&self) -> Option<u8> {
        match self {
            DecodeError::Body { opcode, .. } => Some(*opcode),
            _ => None,
        }
    }

    /// The underlying cause, unwrapping [`DecodeError::Body`].
    pub fn reason(&self) -> &DecodeError {
        match self {
            DecodeError::Body { reason, .. } => reason,
            other => other,
        }
    }

    /// True when the connection cannot continue (nothing was consumed and
    /// the byte stream cannot be resynchronised).
    pub fn is_fatal(&self) -> bool {
        self.request_id().is_none()
    }

    /// The error a broker should send back for this failure: `unsupported`
    /// for an unknown opcode (a newer client talking to an older broker),
    /// `too_large` for an over-limit frame, `invalid_request` otherwise.
    pub fn to_wire_error(&self) -> WireError {
        let code = match self.reason() {
            DecodeError::UnknownOpcode(_) => ErrorCode::Unsupported,
            DecodeError::TooLarge { .. } | DecodeError::TooMany { .. } => ErrorCode::TooLarge,
            _ => ErrorCode::InvalidRequest,
        };
        WireError::new(code, self.reason().to_string())
    }

    pub(crate) fn in_frame(self, request_id: u64, opcode: u8) -> DecodeError {
        DecodeError::Body {
            request_id,
            opcode,
            reason: Box::new(self),
        }
    }
}

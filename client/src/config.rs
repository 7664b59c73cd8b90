//! Client settings.

use std::time::Duration;

/// How a [`Client`](crate::Client) connects and behaves.
///
/// Build one with struct update syntax so new fields keep compiling:
///
/// ```
/// use std::time::Duration;
/// use felix_client::ClientConfig;
///
/// let config = ClientConfig {
///     ack_on_commit: true,
///     request_timeout: Duration::from_secs(10),
///     ..ClientConfig::default()
/// };
/// assert!(config.ack_on_commit);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientConfig {
    /// Sent in HELLO; shows up in the broker's logs.
    pub client_name: String,
    /// Limit on opening a TCP connection and completing HELLO.
    pub connect_timeout: Duration,
    /// Limit on waiting for an answer. A request that asks the broker to
    /// wait (a long poll, a read with `wait`) gets that wait on top.
    pub request_timeout: Duration,
    /// Ask for commit acknowledgements: a publish is answered only once
    /// its records are durable ([`AckMode::Durable`](crate::AckMode)).
    /// Otherwise the broker's configured default applies. Needs a broker that
    /// advertises [`FEATURE_PUBLISH_ACK_MODE`](crate::FEATURE_PUBLISH_ACK_MODE);
    /// publishes to one that does not are refused rather than acknowledged
    /// on the broker's terms without a word.
    pub ack_on_commit: bool,
    /// Largest response frame this client accepts. A read or poll answer can
    /// hold the broker's read cap (about 4 MiB) plus one record as large as
    /// the broker's request frame cap, so keep this well above both.
    pub max_frame_bytes: u32,
    /// First delay before reconnecting after a failed connection attempt.
    pub reconnect_backoff_initial: Duration,
    /// The delay doubles after each failure up to this.
    pub reconnect_backoff_max: Duration,
    /// Authentication token sent in HELLO. A broker with a tokens file
    /// requires one it lists (the connection then acts as its principal);
    /// a broker without one refuses any token. A refused HELLO fails
    /// `connect` with `unauthorized`.
    pub token: Option<String>,
}

impl Default for ClientConfig {
    fn default() -> ClientConfig {
        ClientConfig {
            client_name: concat!("felix-client-rs/", env!("CARGO_PKG_VERSION")).to_string(),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(30),
            ack_on_commit: false,
            max_frame_bytes: 64 << 20,
            reconnect_backoff_initial: Duration::from_millis(100),
            reconnect_backoff_max: Duration::from_secs(5),
            token: None,
        }
    }
}

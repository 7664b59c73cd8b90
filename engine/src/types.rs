//! Strong types shared by the engine: offsets, shard ids, stream names.

use std::fmt;

/// A record's position in its shard's log. Per shard, dense, never reused.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Offset(pub u64);

impl Offset {
    pub const ZERO: Offset = Offset(0);

    /// Past any offset a log can reach (2^62: four quintillion records).
    /// Offsets read from disk above it are damage, so offset arithmetic
    /// (a batch's end is its base plus at most 2^32) never overflows.
    pub const LIMIT: Offset = Offset(1 << 62);

    #[inline]
    pub fn get(self) -> u64 {
        self.0
    }

    #[inline]
    pub fn next(self) -> Offset {
        Offset(self.0 + 1)
    }

    #[inline]
    pub fn plus(self, n: u64) -> Offset {
        Offset(self.0 + n)
    }
}

impl fmt::Debug for Offset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "@{}", self.0)
    }
}

impl fmt::Display for Offset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Index of a shard within its stream.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct ShardId(pub u32);

/// Index of a core (executor) in the broker, `0..cores`.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug, Default)]
pub struct CoreId(pub u32);

/// Longest tenant, namespace or stream name, in bytes.
pub const NAME_MAX_BYTES: usize = 128;

/// Why a name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("{what} name is empty; names are 1-{NAME_MAX_BYTES} bytes of [A-Za-z0-9._-]")]
    Empty { what: &'static str },
    #[error("{what} name is {len} bytes; the limit is {NAME_MAX_BYTES}")]
    TooLong { what: &'static str, len: usize },
    #[error("{what} name {name:?} has {bad:?}; names use only [A-Za-z0-9._-]")]
    BadChar {
        what: &'static str,
        name: String,
        bad: char,
    },
    #[error("{what} name may not be {name:?}")]
    Reserved { what: &'static str, name: String },
    #[error("stream path {0:?} must be tenant/namespace/stream")]
    BadPath(String),
}

/// Check one path component: 1-128 bytes of `[A-Za-z0-9._-]`, not `.` or `..`.
pub fn validate_name(what: &'static str, name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty { what });
    }
    if name.len() > NAME_MAX_BYTES {
        return Err(NameError::TooLong {
            what,
            len: name.len(),
        });
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(NameError::BadChar {
            what,
            name: name.to_string(),
            bad,
        });
    }
    if name == "." || name == ".." {
        return Err(NameError::Reserved {
            what,
            name: name.to_string(),
        });
    }
    Ok(())
}

/// `tenant/namespace/stream`, each part validated.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamName {
    tenant: String,
    namespace: String,
    stream: String,
}

impl StreamName {
    pub fn new(tenant: &str, namespace: &str, stream: &str) -> Result<Self, NameError> {
        validate_name("tenant", tenant)?;
        // Tenants are directories of the data directory, beside its lock
        // and its cluster membership.
        if [crate::catalog::LOCK_FILE, crate::catalog::CLUSTER_FILE].contains(&tenant) {
            return Err(NameError::Reserved {
                what: "tenant",
                name: tenant.to_string(),
            });
        }
        validate_name("namespace", namespace)?;
        validate_name("stream", stream)?;
        Ok(StreamName {
            tenant: tenant.to_string(),
            namespace: namespace.to_string(),
            stream: stream.to_string(),
        })
    }

    /// Parse `tenant/namespace/stream`.
    pub fn parse(path: &str) -> Result<Self, NameError> {
        let mut parts = path.split('/');
        match (parts.next(), parts.next(), parts.next(), parts.next()) {
            (Some(t), Some(n), Some(s), None) => StreamName::new(t, n, s),
            _ => Err(NameError::BadPath(path.to_string())),
        }
    }

    pub fn tenant(&self) -> &str {
        &self.tenant
    }
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
    pub fn stream(&self) -> &str {
        &self.stream
    }
}

impl fmt::Display for StreamName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.tenant, self.namespace, self.stream)
    }
}

impl fmt::Debug for StreamName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

/// A shard of a stream: the unit a core owns.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
pub struct ShardKey {
    pub stream: StreamName,
    pub shard: ShardId,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_validated() {
        assert!(StreamName::parse("t1/default/jobs").is_ok());
        assert!(StreamName::parse("t1/default").is_err());
        assert!(StreamName::parse("t1/default/jobs/x").is_err());
        // The data directory's lock file is where such a tenant would go.
        assert!(StreamName::parse("felix.lock/default/jobs").is_err());
        assert!(StreamName::parse("t1/felix.lock/jobs").is_ok());
        assert!(StreamName::parse("t1//jobs").is_err());
        assert!(StreamName::parse("t1/de fault/jobs").is_err());
        assert!(StreamName::parse("t1/../jobs").is_err());
        assert!(StreamName::new(&"a".repeat(128), "n", "s").is_ok());
        assert!(StreamName::new(&"a".repeat(129), "n", "s").is_err());
        assert!(StreamName::parse("t1/ns/é").is_err());
    }
}

//! Authentication: which principal a connection acts as.
//!
//! With `security.tokens_file` set, a connection's HELLO must carry a token
//! the file lists, and the connection acts as that token's principal (a
//! consumer group's member names belong to it). The file holds SHA-256
//! digests, never the tokens themselves. Without the file every connection
//! is the anonymous principal, and a HELLO that carries a token is refused
//! rather than silently treated as anonymous.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// What the broker checks connections and calls against: the tokens file
/// and the permissions file, as last read (at start, then on SIGHUP).
#[derive(Debug, Default)]
pub(crate) struct Security {
    pub tokens: Option<Tokens>,
    pub acl: Option<crate::acl::Acl>,
}

impl Security {
    /// Read the files the configuration names, logging what they hold.
    pub(crate) fn load(config: &crate::config::Config) -> Result<Security, String> {
        let tokens = config
            .tokens_file
            .as_deref()
            .map(Tokens::load)
            .transpose()?;
        let acl = config
            .acl_file
            .as_deref()
            .map(crate::acl::Acl::load)
            .transpose()?;
        match (&tokens, &config.tokens_file) {
            (Some(t), Some(path)) => {
                tracing::info!(tokens = t.len(), file = %path.display(), "connections must authenticate")
            }
            _ => tracing::info!(
                "no authentication (security.tokens_file is empty): every connection is the anonymous principal"
            ),
        }
        if let (Some(a), Some(path)) = (&acl, &config.acl_file) {
            tracing::info!(grants = a.len(), file = %path.display(), "permissions enforced");
            for p in a.principals() {
                let known = match &tokens {
                    Some(t) => t.has_principal(p),
                    None => p == ANONYMOUS,
                };
                if !known {
                    tracing::warn!(
                        "security.acl_file grants to {p:?}, which no connection can be (not in \
                         security.tokens_file{})",
                        if tokens.is_none() {
                            ", which is empty: every connection is anonymous"
                        } else {
                            ""
                        }
                    );
                }
            }
        }
        Ok(Security { tokens, acl })
    }
}

/// The principal of a broker without authentication.
pub(crate) const ANONYMOUS: &str = "anonymous";

/// Longest token accepted, in bytes (checked before hashing).
const MAX_TOKEN_BYTES: usize = 1024;

/// Longest principal name accepted, in bytes.
const MAX_PRINCIPAL_BYTES: usize = 128;

/// The tokens a broker accepts, by the SHA-256 of each.
#[derive(Debug, Default)]
pub(crate) struct Tokens {
    by_digest: HashMap<[u8; 32], Arc<str>>,
}

impl Tokens {
    /// Read a tokens file: one `PRINCIPAL SHA256-HEX` per line; blank lines
    /// and `#` comments are skipped. A principal may have several tokens
    /// (to rotate them); a digest may name one principal only.
    pub(crate) fn load(path: &Path) -> Result<Tokens, String> {
        load_file(path, "security.tokens_file", Tokens::parse)
    }

    pub(crate) fn parse(text: &str) -> Result<Tokens, String> {
        let mut by_digest: HashMap<[u8; 32], Arc<str>> = HashMap::new();
        for (n, line) in content_lines(text) {
            let mut fields = line.split_whitespace();
            // `sha256sum` prints `HEX  -`: the `-` (its standard input) may
            // be pasted along.
            let (Some(principal), Some(hex), None | Some("-"), None) =
                (fields.next(), fields.next(), fields.next(), fields.next())
            else {
                return Err(format!(
                    "line {n}: expected `PRINCIPAL SHA256-HEX`, found {line:?} (# starts a \
                     comment)"
                ));
            };
            if principal.len() > MAX_PRINCIPAL_BYTES {
                return Err(format!(
                    "line {n}: a principal name is at most {MAX_PRINCIPAL_BYTES} bytes"
                ));
            }
            if principal == "*" {
                // The permissions file could grant it nothing of its own.
                return Err(format!(
                    "line {n}: `*` cannot name a principal: in the permissions file it \
                     means every principal"
                ));
            }
            let digest = parse_digest(hex).ok_or_else(|| {
                format!(
                    "line {n}: {hex:?} is not a SHA-256 digest (64 hex digits, as \
                     `printf %s TOKEN | sha256sum` prints)"
                )
            })?;
            match by_digest.get(&digest) {
                // The same line twice: harmless.
                Some(other) if &**other == principal => {}
                Some(other) => {
                    return Err(format!(
                        "line {n}: this token's digest is already listed for {other:?}"
                    ));
                }
                None => {
                    by_digest.insert(digest, Arc::from(principal));
                }
            }
        }
        if by_digest.is_empty() {
            return Err(
                "lists no tokens (no connection could authenticate); to run without \
                 authentication, leave security.tokens_file empty"
                    .into(),
            );
        }
        Ok(Tokens { by_digest })
    }

    /// How many tokens are listed.
    pub(crate) fn len(&self) -> usize {
        self.by_digest.len()
    }

    /// Does some token name `principal`?
    pub(crate) fn has_principal(&self, principal: &str) -> bool {
        self.by_digest.values().any(|p| &**p == principal)
    }
}

/// Read a security file and parse it; errors name `setting` and the path.
pub(crate) fn load_file<T>(
    path: &Path,
    setting: &str,
    parse: impl FnOnce(&str) -> Result<T, String>,
) -> Result<T, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {setting} {}: {e}", path.display()))?;
    parse(&text).map_err(|e| format!("{setting} {}: {e}", path.display()))
}

/// The lines of a security file that say something, numbered from 1: a
/// leading BOM, `#` comments and surrounding blanks gone, empty lines
/// skipped.
pub(crate) fn content_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    text.lines()
        .enumerate()
        .map(|(i, line)| (i + 1, line.split('#').next().unwrap_or("").trim()))
        .filter(|(_, line)| !line.is_empty())
}

fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in hex.as_bytes().chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

/// The principal a HELLO's `token` makes the connection, or why it is
/// refused (`unauthorized`).
pub(crate) fn authenticate(
    tokens: Option<&Tokens>,
    token: Option<&str>,
) -> Result<Arc<str>, String> {
    match (tokens, token) {
        (None, None) => Ok(Arc::from(ANONYMOUS)),
        (None, Some(_)) => Err("this broker does not authenticate connections (no \
             security.tokens_file); connect without a token"
            .into()),
        (Some(_), None) => Err("this broker requires a token in HELLO".into()),
        (Some(_), Some(token)) if token.len() > MAX_TOKEN_BYTES => {
            Err(format!("a token is at most {MAX_TOKEN_BYTES} bytes"))
        }
        (Some(t), Some(token)) => {
            let digest: [u8; 32] = Sha256::digest(token.as_bytes()).into();
            t.by_digest
                .get(&digest)
                .cloned()
                .ok_or_else(|| "unknown token".to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex_of(token: &str) -> String {
        Sha256::digest(token.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    #[test]
    fn tokens_map_to_their_principals() {
        let text = format!(
            "# who may connect\n\nalice {}\nbob {}  # rotated below\nbob {}\n",
            hex_of("a-secret"),
            hex_of("b-old"),
            hex_of("b-new").to_uppercase()
        );
        let t = Tokens::parse(&text).unwrap();
        assert_eq!(t.len(), 3);
        assert!(authenticate(Some(&t), Some(&"x".repeat(2000)))
            .unwrap_err()
            .contains("at most 1024 bytes"));
        assert_eq!(&*authenticate(Some(&t), Some("a-secret")).unwrap(), "alice");
        assert_eq!(&*authenticate(Some(&t), Some("b-old")).unwrap(), "bob");
        assert_eq!(&*authenticate(Some(&t), Some("b-new")).unwrap(), "bob");
        assert_eq!(
            authenticate(Some(&t), Some("a-secreT")).unwrap_err(),
            "unknown token"
        );
        assert!(authenticate(Some(&t), None)
            .unwrap_err()
            .contains("requires a token"));
        assert_eq!(&*authenticate(None, None).unwrap(), ANONYMOUS);
        assert!(authenticate(None, Some("x"))
            .unwrap_err()
            .contains("does not authenticate"));
    }

    #[test]
    fn bom_crlf_tabs_and_repeated_lines_are_fine() {
        let text = format!(
            "\u{feff}alice\t{}\r\n# comment\r\nalice {}  -\r\n",
            hex_of("a"),
            hex_of("a")
        );
        let t = Tokens::parse(&text).unwrap();
        assert_eq!(t.len(), 1);
        assert_eq!(&*authenticate(Some(&t), Some("a")).unwrap(), "alice");
    }

    #[test]
    fn a_bad_tokens_file_names_its_line() {
        let good = hex_of("t");
        for (text, wants) in [
            ("alice\n".to_string(), "line 1: expected"),
            (format!("alice {good} extra\n"), "line 1: expected"),
            (
                "\nalice abc\n".to_string(),
                "line 2: \"abc\" is not a SHA-256",
            ),
            (format!("alice {}\n", "g".repeat(64)), "is not a SHA-256"),
            (
                format!("alice {good}\nbob {good}\n"),
                "line 2: this token's digest is already listed for \"alice\"",
            ),
            (format!("{} {good}\n", "p".repeat(129)), "at most 128 bytes"),
            (format!("* {good}\n"), "line 1: `*` cannot name a principal"),
            ("# nobody\n".to_string(), "lists no tokens"),
            (format!("al#ice {good}\n"), "(# starts a comment)"),
            (format!("alice +{}\n", &good[1..]), "is not a SHA-256"),
        ] {
            let e = Tokens::parse(&text).unwrap_err();
            assert!(e.contains(wants), "{text:?}: {e}");
        }
    }
}

//! Push tokens: the bearer tokens that let a partner push its feed to
//! ingest. They never come from the config file itself; a partner names a
//! file (`push_tokens_file`) or an environment variable (`push_tokens_env`)
//! that holds them. This module owns the text formats of both and what a
//! valid token is; reading the file (and re-reading it when it changes) is
//! the ingest service's job.

use std::fmt;

/// The shortest token accepted: anything shorter can be guessed.
pub const MIN_PUSH_TOKEN_BYTES: usize = 16;

/// One push token. Its `Debug` never shows the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct PushToken(String);

impl PushToken {
    /// The secret itself, to compare a request's credentials with.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for PushToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PushToken(*** {} bytes)", self.0.len())
    }
}

/// Why a token list was refused. The messages say where the bad token is
/// (`line 3`, `token 2`), never what it is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PushTokenError {
    #[error(
        "{at}: a push token must be at least {MIN_PUSH_TOKEN_BYTES} bytes long (this one has {len})"
    )]
    TooShort { at: String, len: usize },
    #[error("{at}: a push token is printable ASCII with no spaces (one token a line)")]
    BadCharacter { at: String },
}

/// The tokens of a `push_tokens_file`: one a line; blank lines and lines
/// starting with `#` are ignored; CRLF line ends and surrounding spaces are
/// allowed. Several tokens are valid at once (rotation: add the new one,
/// move the partner to it, remove the old one).
pub fn parse_push_tokens_file(text: &str) -> Result<Vec<PushToken>, PushTokenError> {
    let mut tokens = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        tokens.push(token(line, || format!("line {}", i + 1))?);
    }
    Ok(tokens)
}

/// The tokens of a `push_tokens_env` variable: separated by commas or
/// whitespace; empty entries are ignored.
pub fn parse_push_tokens_list(value: &str) -> Result<Vec<PushToken>, PushTokenError> {
    value
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|t| !t.is_empty())
        .enumerate()
        .map(|(i, t)| token(t, || format!("token {}", i + 1)))
        .collect()
}

fn token(text: &str, at: impl Fn() -> String) -> Result<PushToken, PushTokenError> {
    // What a client can send in `Authorization: Bearer <token>` as is.
    if !text.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(PushTokenError::BadCharacter { at: at() });
    }
    if text.len() < MIN_PUSH_TOKEN_BYTES {
        return Err(PushTokenError::TooShort { at: at(), len: text.len() });
    }
    Ok(PushToken(text.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secrets(tokens: &[PushToken]) -> Vec<&str> {
        tokens.iter().map(PushToken::expose).collect()
    }

    #[test]
    fn a_file_has_one_token_a_line_with_comments_and_blank_lines() {
        let text = "# flowers, rotated 2024-05\r\n\r\n  old-0123456789abcdef  \r\n#new-one-is-below-0000\r\nnew-0123456789abcdef\n\n";
        let tokens = parse_push_tokens_file(text).expect("valid");
        assert_eq!(secrets(&tokens), ["old-0123456789abcdef", "new-0123456789abcdef"]);
        assert_eq!(parse_push_tokens_file("").expect("empty"), []);
        assert_eq!(parse_push_tokens_file("# only a comment\n").expect("comment"), []);
    }

    #[test]
    fn short_or_odd_tokens_are_refused_without_showing_them() {
        let err = parse_push_tokens_file("0123456789abcdef0\nshort-secret\n").expect_err("short");
        assert_eq!(err, PushTokenError::TooShort { at: "line 2".into(), len: 12 });
        let message = err.to_string();
        assert!(message.contains("line 2") && message.contains("at least 16"), "{message}");
        assert!(!message.contains("short-secret"), "the token is printed: {message}");

        let err = parse_push_tokens_file("0123456789abcdef 0123456789abcdef").expect_err("a space");
        assert_eq!(err, PushTokenError::BadCharacter { at: "line 1".into() });
        let err = parse_push_tokens_file("0123456789abcdéf0").expect_err("not ASCII");
        assert!(!err.to_string().contains("0123456789"), "{err}");
        // Exactly the minimum is enough.
        assert_eq!(parse_push_tokens_file("0123456789abcdef").expect("16 bytes").len(), 1);
    }

    #[test]
    fn an_environment_value_is_split_on_commas_and_whitespace() {
        let tokens = parse_push_tokens_list(
            " a-0123456789abcdef,b-0123456789abcdef\n c-0123456789abcdef,, ",
        )
        .expect("valid");
        assert_eq!(
            secrets(&tokens),
            ["a-0123456789abcdef", "b-0123456789abcdef", "c-0123456789abcdef"]
        );
        let err = parse_push_tokens_list("a-0123456789abcdef,tiny").expect_err("short");
        assert_eq!(err, PushTokenError::TooShort { at: "token 2".into(), len: 4 });
        assert_eq!(parse_push_tokens_list("").expect("empty"), []);
    }

    #[test]
    fn debug_output_hides_the_secret() {
        let tokens = parse_push_tokens_list("s3cret-0123456789abcdef").expect("valid");
        let shown = format!("{tokens:?}");
        assert!(!shown.contains("s3cret"), "{shown}");
    }
}

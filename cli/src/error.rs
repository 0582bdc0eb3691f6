//! Why a verb failed, as far as a script calling `shelfsync` must tell
//! cases apart: [`CliError`] and the exit code of each. A verb returns
//! `anyhow::Error`; the failures a caller acts on carry a `CliError` in
//! their chain (as the error itself or as a context), found by
//! [`exit_code`]. Everything else exits 1.

use async_nats::{RequestErrorKind, client::RequestError};

/// The exit codes, as `shelfsync --help` lists them.
pub const EXIT_CODES: &str = "\
Exit codes:
  0  success
  1  any other failure (an import that failed, a replica that reported an error, ...)
  2  bad input: a usage error, invalid settings, a request storage refused as malformed
  3  not found: no such record, partner, dead letter or held sweep; a stream that does not exist
  4  timeout: a wait, keyframe, sweep, rebase or redrive that did not finish in time
  5  unavailable: NATS, Redis or storage not reachable (connection refused, no responders)";

/// A failure that maps to its own exit code. The message is what the
/// operator reads; the cause, when there is one, is chained under it.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// Usage or settings the CLI or storage refused (exit 2).
    #[error("{0}")]
    BadInput(String),
    /// What was asked for does not exist (exit 3).
    #[error("{0}")]
    NotFound(String),
    /// Something did not finish within the time given (exit 4).
    #[error("{0}")]
    Timeout(String),
    /// A server or service cannot be reached (exit 5).
    #[error("{0}")]
    Unavailable(String),
}

impl CliError {
    pub fn code(&self) -> u8 {
        match self {
            CliError::BadInput(_) => 2,
            CliError::NotFound(_) => 3,
            CliError::Timeout(_) => 4,
            CliError::Unavailable(_) => 5,
        }
    }
}

/// The exit code of a verb's error: that of the outermost [`CliError`] in
/// its chain, 1 when there is none.
pub fn exit_code(err: &anyhow::Error) -> u8 {
    err.downcast_ref::<CliError>().map_or(1, CliError::code)
}

/// A failed core NATS request to a service as a [`CliError`]: nobody
/// listening or the connection gone is "unavailable", no reply in time a
/// timeout.
pub fn request_failed(err: RequestError, subject: &str, who: &str) -> anyhow::Error {
    let kind = err.kind();
    let e = anyhow::Error::new(err);
    match kind {
        RequestErrorKind::NoResponders => e.context(CliError::Unavailable(format!(
            "no {who} is listening on {subject} (is it running?)"
        ))),
        RequestErrorKind::TimedOut => {
            e.context(CliError::Timeout(format!("no answer from {who} on {subject} in time")))
        }
        _ => e.context(CliError::Unavailable(format!("cannot ask {who} on {subject}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use anyhow::Context as _;

    #[test]
    fn the_code_is_found_under_contexts() {
        let err: anyhow::Result<()> = Err(CliError::NotFound("record".into()).into());
        let err = err.context("while reading").context("get").expect_err("an error");
        assert_eq!(exit_code(&err), 3);
        assert_eq!(format!("{err:#}"), "get: while reading: record");

        let io = std::io::Error::other("refused");
        let err = anyhow::Error::new(io).context(CliError::Unavailable("NATS".into()));
        assert_eq!(exit_code(&err), 5);
        assert_eq!(format!("{err:#}"), "NATS: refused");

        assert_eq!(exit_code(&anyhow::anyhow!("plain")), 1);
    }
}

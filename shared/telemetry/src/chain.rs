//! An error as a log field: the error and its causes, each once. An error is
//! logged once, where it is handled, with its cause chain
//! (`error = %chain(&e)`); errors shown to users (replies, HTTP bodies, the
//! CLI) keep a self-contained `Display`, so a cause a message already quotes
//! is not repeated.

use std::error::Error;
use std::fmt;

/// `outer: cause: deeper cause`, skipping a cause whose text the line
/// already holds (a message that quotes its source, as many do).
pub struct Chain<'a>(&'a (dyn Error + 'static));

/// The cause chain of `e`, for a log field or a message.
pub fn chain<'a>(e: &'a (dyn Error + 'static)) -> Chain<'a> {
    Chain(e)
}

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut line = self.0.to_string();
        let mut cause = self.0.source();
        while let Some(c) = cause {
            let text = c.to_string();
            if !text.is_empty() && !line.contains(&text) {
                line.push_str(": ");
                line.push_str(&text);
            }
            cause = c.source();
        }
        f.write_str(&line)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("{msg}")]
    struct E {
        msg: String,
        #[source]
        source: Option<Box<E>>,
    }

    fn e(msg: &str, source: Option<E>) -> E {
        E { msg: msg.into(), source: source.map(Box::new) }
    }

    #[test]
    fn every_cause_comes_once() {
        let io = e("connection refused", None);
        // A message that names its cause, and one that does not.
        let quoting = e("redis: connection refused", Some(io));
        let outer = e("batch not applied", Some(quoting));
        assert_eq!(chain(&outer).to_string(), "batch not applied: redis: connection refused");
        let plain = e("cannot read the feed", Some(e("disk full", None)));
        assert_eq!(chain(&plain).to_string(), "cannot read the feed: disk full");
        let anyhow = anyhow::Error::from(plain).context("import");
        assert_eq!(chain(anyhow.as_ref()).to_string(), "import: cannot read the feed: disk full");
    }
}

//! Where a feed comes from: a file, an HTTP(S) URL fetched with a
//! conditional GET (ETag / Last-Modified), or a stream pushed to us. Opens
//! the source and hands back a byte stream; never parses.

use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::time::SystemTime;

use futures::TryStreamExt;
use reqwest::StatusCode;
use reqwest::header::{ETAG, HeaderMap, IF_MODIFIED_SINCE, IF_NONE_MATCH, LAST_MODIFIED};
use shelfsync_telemetry::chain;
use tokio::io::AsyncRead;
use tokio_util::io::{StreamReader, SyncIoBridge};

use crate::report::ImportError;

/// A feed to import.
pub enum Source {
    File(PathBuf),
    Url(String),
    /// Any byte stream (the push endpoint's request body, a pipe, a test).
    Stream(Box<dyn AsyncRead + Send + Unpin>),
}

impl Source {
    /// `http(s)://…` is a URL; `file://…` or anything else is a path.
    pub fn parse(s: &str) -> Source {
        if s.starts_with("http://") || s.starts_with("https://") {
            Source::Url(s.to_string())
        } else {
            Source::File(s.strip_prefix("file://").unwrap_or(s).into())
        }
    }

    /// For reports and errors.
    pub fn describe(&self) -> String {
        match self {
            Source::File(path) => path.display().to_string(),
            Source::Url(url) => url.clone(),
            Source::Stream(_) => "stream".into(),
        }
    }

    /// The path of a file source.
    pub fn file(&self) -> Option<&Path> {
        match self {
            Source::File(path) => Some(path),
            _ => None,
        }
    }
}

/// A file's inode (a file replaced by rename is a new one), modification
/// time and size: a file whose signature is unchanged was not written.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub struct FileSignature {
    inode: u64,
    modified: Option<SystemTime>,
    len: u64,
}

impl FileSignature {
    /// The signature of the file at `path`; `None` without a path, or for
    /// a file that cannot be looked at (opening it then says why).
    pub async fn of(path: Option<&Path>) -> Option<Self> {
        use std::os::unix::fs::MetadataExt as _;
        let meta = tokio::fs::metadata(path?).await.ok()?;
        Some(Self { inode: meta.ino(), modified: meta.modified().ok(), len: meta.len() })
    }
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Source({})", self.describe())
    }
}

/// HTTP cache validators of the last successful import of a URL.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Validators {
    pub etag: Option<String>,
    pub last_modified: Option<String>,
}

/// An opened feed: a blocking reader, for the parser thread.
pub(crate) type FeedReader = Box<dyn Read + Send>;

pub(crate) enum Opened {
    /// HTTP 304: the feed did not change since `known`.
    Unchanged,
    /// The feed, and the validators to store once it is imported.
    Feed(FeedReader, Validators),
}

/// Opens `source`; for a URL, asks only for a feed newer than `known`.
/// Must be called inside the Tokio runtime (the async-to-sync bridge binds
/// to it).
pub(crate) async fn open(
    source: Source,
    http: &reqwest::Client,
    known: &Validators,
) -> Result<Opened, ImportError> {
    let what = source.describe();
    let failed = |detail: String| ImportError::Source { what: what.clone(), detail };
    match source {
        Source::File(path) => {
            let file =
                tokio::fs::File::open(&path).await.map_err(|e| failed(chain(&e).to_string()))?;
            Ok(Opened::Feed(Box::new(file.into_std().await), Validators::default()))
        }
        Source::Stream(stream) => {
            Ok(Opened::Feed(Box::new(SyncIoBridge::new(stream)), Validators::default()))
        }
        Source::Url(url) => {
            let mut request = http.get(&url);
            if let Some(etag) = &known.etag {
                request = request.header(IF_NONE_MATCH, etag);
            }
            if let Some(date) = &known.last_modified {
                request = request.header(IF_MODIFIED_SINCE, date);
            }
            let response = request.send().await.map_err(|e| failed(chain(&e).to_string()))?;
            let status = response.status();
            if status == StatusCode::NOT_MODIFIED {
                return Ok(Opened::Unchanged);
            }
            if !status.is_success() {
                return Err(failed(format!("HTTP status {status}")));
            }
            let fresh = validators(response.headers());
            let body =
                response.bytes_stream().map_err(|e| std::io::Error::other(chain(&e).to_string()));
            let body: Pin<Box<dyn futures::Stream<Item = _> + Send>> = Box::pin(body);
            Ok(Opened::Feed(Box::new(SyncIoBridge::new(StreamReader::new(body))), fresh))
        }
    }
}

fn validators(headers: &HeaderMap) -> Validators {
    let get = |name| headers.get(name).and_then(|v| v.to_str().ok()).map(String::from);
    Validators { etag: get(ETAG), last_modified: get(LAST_MODIFIED) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse_by_scheme() {
        assert!(
            matches!(Source::parse("https://x.example/feed"), Source::Url(u) if u == "https://x.example/feed")
        );
        assert!(matches!(Source::parse("http://x"), Source::Url(_)));
        assert!(
            matches!(Source::parse("file:///tmp/f.json"), Source::File(p) if p.as_os_str() == "/tmp/f.json")
        );
        assert!(
            matches!(Source::parse("feeds/f.json"), Source::File(p) if p.as_os_str() == "feeds/f.json")
        );
    }
}

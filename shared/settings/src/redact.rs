//! Secrets kept out of what is printed: settings are shown
//! (`shelfsync config check`) and URLs logged, but a password never is.

use serde::Serializer;

/// Serializes a secret as `***` (when set): settings are printed
/// (`shelfsync config check`) but a secret never is.
pub(crate) fn redacted<S: Serializer>(secret: &Option<String>, s: S) -> Result<S::Ok, S::Error> {
    match secret {
        Some(_) => s.serialize_str("***"),
        None => s.serialize_none(),
    }
}

/// Serializes a URL with the password in its userinfo replaced by `***`.
pub(crate) fn redacted_url<S: Serializer>(url: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&redact_url(url))
}

/// A server URL (or comma-separated list) fit for logs and errors: any
/// password in it is replaced by `***`.
pub fn redact_url(url: &str) -> String {
    url.split(',')
        .map(|u| {
            let Some((scheme, rest)) = u.split_once("://") else { return u.to_string() };
            let Some((userinfo, host)) = rest.rsplit_once('@') else { return u.to_string() };
            let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
            if userinfo.contains(':') {
                format!("{scheme}://{user}:***@{host}")
            } else if scheme.starts_with("redis") || scheme.starts_with("nats") {
                // A lone userinfo may be a token or a password.
                format!("{scheme}://***@{host}")
            } else {
                u.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(",")
}

//! Who may push a partner's feed: each partner's bearer tokens, from its
//! `push_tokens_file` (re-read whenever the file changes, so a mounted
//! secret rotates with no restart; removing the file revokes them, and a
//! file put back is read again) and its `push_tokens_env` variable (read
//! at start); the check of a request's `Authorization` header against every
//! token of every partner in constant time; and the refusals: their answer,
//! their metric and their log line, once per address, partner and reason.
//! It never logs nor returns a token, and knows nothing of feeds.

use std::collections::HashSet;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use anyhow::{anyhow, bail};
use axum::Json;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use sha2::{Digest as _, Sha256};
use shelfsync_service::FileSignature;
use shelfsync_settings::{
    IngestSettings, PartnerSettings, PushToken, parse_push_tokens_file, parse_push_tokens_list,
};
use subtle::{Choice, ConstantTimeEq};
use tracing::{info, warn};

use crate::metrics;

/// The `WWW-Authenticate` challenge of every 401.
const CHALLENGE: &str = r#"Bearer realm="shelfsync-ingest""#;

/// Distinct (address, partner, reason) refusals remembered so each is logged
/// once; past this many the memory starts over (a flood of addresses must
/// not grow it without bound).
const LOGGED_MAX: usize = 4096;

/// The `partner` label (and log field) of a refusal for a name that is not
/// configured: the path is the caller's, and must not create label values.
const UNKNOWN: &str = "unknown";

/// Tokens are kept and compared as SHA-256 digests: every comparison is of
/// 32 bytes, so its time says nothing of a token's length either.
type Digest = [u8; 32];

fn digest(token: &str) -> Digest {
    Sha256::digest(token.as_bytes()).into()
}

/// Why a push was refused; [`Refusal::reason`] is the metric's label.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Refusal {
    /// No `Authorization` header (401).
    MissingToken,
    /// An `Authorization` header that is not `Bearer <token>` (401).
    MalformedHeader,
    /// A token no partner has (401).
    InvalidToken,
    /// A valid token, a partner that is not configured (404).
    UnknownPartner,
    /// A valid token, a partner with no token source configured (403).
    PushDisabled,
    /// Another partner's token (403).
    OtherPartner,
    /// A body over the partner's `max_push_bytes` (413).
    TooLarge,
}

impl Refusal {
    pub(crate) fn reason(self) -> &'static str {
        match self {
            Refusal::MissingToken => "missing_token",
            Refusal::MalformedHeader => "malformed_header",
            Refusal::InvalidToken => "invalid_token",
            Refusal::UnknownPartner => "unknown_partner",
            Refusal::PushDisabled => "push_disabled",
            Refusal::OtherPartner => "other_partner",
            Refusal::TooLarge => "too_large",
        }
    }

    fn status(self) -> StatusCode {
        match self {
            Refusal::MissingToken | Refusal::MalformedHeader | Refusal::InvalidToken => {
                StatusCode::UNAUTHORIZED
            }
            Refusal::UnknownPartner => StatusCode::NOT_FOUND,
            Refusal::PushDisabled | Refusal::OtherPartner => StatusCode::FORBIDDEN,
            Refusal::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
        }
    }

    /// What the caller is told. Before authentication it says nothing about
    /// the partner (not even whether it exists).
    fn message(self, partner: &str) -> String {
        match self {
            Refusal::MissingToken => {
                "credentials required: send `Authorization: Bearer <token>`".into()
            }
            Refusal::MalformedHeader => {
                "malformed `Authorization` header: expected `Bearer <token>`".into()
            }
            Refusal::InvalidToken => "the token is not valid".into(),
            Refusal::UnknownPartner => format!("unknown partner `{partner}`"),
            Refusal::PushDisabled => format!(
                "push is disabled for partner `{partner}`: it has no push tokens \
                 (set `push_tokens_file` or `push_tokens_env` in its [[partners]] entry)"
            ),
            Refusal::OtherPartner => format!("the token is not valid for partner `{partner}`"),
            Refusal::TooLarge => format!("the body is over partner `{partner}`'s push limit"),
        }
    }
}

/// Reads and parses a tokens file. The signature is taken first: a change
/// during the read shows at the next look.
fn read_tokens_file(path: &Path) -> Result<(FileSignature, Vec<PushToken>), String> {
    let sig = FileSignature::of(path).map_err(|e| e.to_string())?;
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let tokens = parse_push_tokens_file(&text).map_err(|e| e.to_string())?;
    Ok((sig, tokens))
}

struct TokenFile {
    path: PathBuf,
    state: Mutex<FileState>,
}

struct FileState {
    /// Of the file the tokens were last read from; `None` once it is gone.
    signature: Option<FileSignature>,
    tokens: Vec<Digest>,
    /// The last look failed (and was logged): it is logged again only
    /// after a good read.
    failing: bool,
}

impl TokenFile {
    fn state(&self) -> MutexGuard<'_, FileState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Re-reads the file if it changed. A file that no longer exists revokes
    /// its tokens (removing a partner's tokens file is how its push is
    /// switched off at once); one that cannot be read or parsed keeps the
    /// last good tokens (a half-written edit must not lock the partner out).
    fn refresh(&self, partner: &str) {
        let mut state = self.state();
        match FileSignature::of(&self.path) {
            Ok(sig) if Some(sig) == state.signature => {
                state.failing = false;
                return;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if state.signature.is_some() {
                    warn!(partner, file = %self.path.display(),
                        "push tokens file removed: its tokens are revoked");
                }
                *state = FileState { signature: None, tokens: Vec::new(), failing: false };
                return;
            }
            _ => {}
        }
        match read_tokens_file(&self.path) {
            Ok((signature, tokens)) => {
                info!(partner, file = %self.path.display(), tokens = tokens.len(), "push tokens reloaded");
                *state = FileState {
                    signature: Some(signature),
                    tokens: tokens.iter().map(|t| digest(t.expose())).collect(),
                    failing: false,
                };
            }
            Err(error) => {
                if !state.failing {
                    warn!(partner, file = %self.path.display(), %error,
                        "cannot reload push tokens: the last good ones stay valid");
                }
                state.failing = true;
            }
        }
    }
}

struct PartnerTokens {
    name: String,
    /// A token source is configured (else push is disabled).
    enabled: bool,
    /// From `push_tokens_env`, read at start.
    env: Vec<Digest>,
    file: Option<TokenFile>,
}

/// Every partner's push tokens.
pub(crate) struct PushAuth {
    partners: Vec<PartnerTokens>,
    logged: Mutex<HashSet<(IpAddr, String, Refusal)>>,
}

impl PushAuth {
    /// Reads every partner's tokens, `env` looking up environment
    /// variables. A named variable that is not set, a file that cannot be
    /// read, a token under 16 bytes, or a token two partners share is an
    /// error: ingest does not start on a half-right configuration.
    pub(crate) fn load(
        partner_settings: &[PartnerSettings],
        ingest: &IngestSettings,
        env: impl Fn(&str) -> Option<String>,
    ) -> anyhow::Result<PushAuth> {
        let mut partners = Vec::new();
        for p in partner_settings {
            let name = &p.name;
            let env_tokens = match &p.push_tokens_env {
                None => Vec::new(),
                Some(var) => {
                    let value = env(var).ok_or_else(|| {
                        anyhow!("partner `{name}`: push_tokens_env names `{var}`, which is not set")
                    })?;
                    parse_push_tokens_list(&value)
                        .map_err(|e| anyhow!("partner `{name}`: push_tokens_env `{var}`: {e}"))?
                }
            };
            let file = match &p.push_tokens_file {
                None => None,
                Some(path) => {
                    let (signature, tokens) = read_tokens_file(path).map_err(|e| {
                        anyhow!("partner `{name}`: push_tokens_file {}: {e}", path.display())
                    })?;
                    let tokens = tokens.iter().map(|t| digest(t.expose())).collect();
                    let state = Mutex::new(FileState {
                        signature: Some(signature),
                        tokens,
                        failing: false,
                    });
                    Some(TokenFile { path: path.clone(), state })
                }
            };
            let env = env_tokens.iter().map(|t| digest(t.expose())).collect();
            let tokens = PartnerTokens { name: name.clone(), enabled: p.push_enabled(), env, file };
            let count =
                tokens.env.len() + tokens.file.as_ref().map_or(0, |f| f.state().tokens.len());
            if tokens.enabled {
                info!(partner = %name, tokens = count, limit_bytes = p.push_limit(ingest),
                    "push enabled");
            } else {
                info!(partner = %name, "push disabled (no push_tokens_file nor push_tokens_env)");
            }
            partners.push(tokens);
        }
        // One token, one partner: a shared token would let each push the
        // other's feed.
        let mut owners = std::collections::HashMap::new();
        for p in &partners {
            let file = p.file.as_ref().map(|f| f.state().tokens.clone()).unwrap_or_default();
            for d in p.env.iter().chain(&file) {
                if let Some(other) = owners.insert(*d, p.name.as_str())
                    && other != p.name
                {
                    bail!("partners `{other}` and `{}` share a push token", p.name);
                }
            }
        }
        Ok(PushAuth { partners, logged: Mutex::new(HashSet::new()) })
    }

    /// Whether the request's credentials allow pushing `partner`'s feed.
    /// Reads changed token files, so it blocks (run it off the runtime).
    ///
    /// The order leaks the least: without a token valid for some partner,
    /// the caller learns nothing about `partner` (401 whether or not it
    /// exists); only then unknown (404), disabled or another partner's
    /// (403).
    pub(crate) fn check(&self, headers: &HeaderMap, partner: &str) -> Result<(), Refusal> {
        let token = bearer(headers)?;
        let presented = digest(token);
        let mut valid_for = Vec::with_capacity(self.partners.len());
        for p in &self.partners {
            if let Some(file) = &p.file {
                file.refresh(&p.name);
            }
            let file = p.file.as_ref().map(|f| f.state().tokens.clone()).unwrap_or_default();
            // Every token is compared, with no early exit: the time taken
            // does not depend on which one (if any) matches.
            let mut matched = Choice::from(0);
            for known in p.env.iter().chain(&file) {
                matched |= presented[..].ct_eq(&known[..]);
            }
            valid_for.push(bool::from(matched));
        }
        if !valid_for.iter().any(|v| *v) {
            return Err(Refusal::InvalidToken);
        }
        let Some(target) = self.partners.iter().position(|p| p.name == partner) else {
            return Err(Refusal::UnknownPartner);
        };
        if !self.partners[target].enabled {
            return Err(Refusal::PushDisabled);
        }
        if !valid_for[target] {
            return Err(Refusal::OtherPartner);
        }
        Ok(())
    }

    /// The answer to a refused push: counted, logged once per (address,
    /// partner, reason), a JSON error, and the challenge on a 401.
    pub(crate) fn refuse(&self, remote: IpAddr, partner: &str, refusal: Refusal) -> Response {
        self.refuse_with(remote, partner, refusal, refusal.message(partner))
    }

    /// As [`PushAuth::refuse`] with a message of the caller's.
    pub(crate) fn refuse_with(
        &self,
        remote: IpAddr,
        partner: &str,
        refusal: Refusal,
        message: String,
    ) -> Response {
        let label = if self.partners.iter().any(|p| p.name == partner) { partner } else { UNKNOWN };
        metrics::push_refused(label, refusal.reason());
        if self.first_time(remote, label, refusal) {
            warn!(%remote, partner = label, reason = refusal.reason(),
                "push refused (logged once per address, partner and reason)");
        }
        let status = refusal.status();
        let mut response = (status, Json(json!({ "error": message }))).into_response();
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static(CHALLENGE));
        }
        response
    }

    fn first_time(&self, remote: IpAddr, partner: &str, refusal: Refusal) -> bool {
        let mut logged = self.logged.lock().unwrap_or_else(|e| e.into_inner());
        if logged.len() >= LOGGED_MAX {
            logged.clear();
        }
        logged.insert((remote, partner.to_string(), refusal))
    }
}

/// The token of an `Authorization: Bearer <token>` header (the scheme in
/// any case, as HTTP allows).
fn bearer(headers: &HeaderMap) -> Result<&str, Refusal> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let Some(value) = values.next() else {
        return Err(Refusal::MissingToken);
    };
    if values.next().is_some() {
        return Err(Refusal::MalformedHeader);
    }
    let value = value.to_str().map_err(|_| Refusal::MalformedHeader)?;
    let (scheme, token) = value.trim().split_once(' ').ok_or(Refusal::MalformedHeader)?;
    let token = token.trim_start();
    if !scheme.eq_ignore_ascii_case("bearer")
        || token.is_empty()
        || !token.bytes().all(|b| b.is_ascii_graphic())
    {
        return Err(Refusal::MalformedHeader);
    }
    Ok(token)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for v in values {
            map.append(header::AUTHORIZATION, HeaderValue::from_str(v).expect("header value"));
        }
        map
    }

    #[test]
    fn only_one_bearer_header_with_one_token_is_read() {
        assert_eq!(bearer(&headers(&[])), Err(Refusal::MissingToken));
        assert_eq!(bearer(&headers(&["Bearer abc"])), Ok("abc"));
        assert_eq!(bearer(&headers(&["bearer   abc "])), Ok("abc"));
        for bad in ["Bearer", "Bearer ", "Basic YWxhZGRpbjpvcGVuc2VzYW1l", "Bearer a b", "abc"] {
            assert_eq!(bearer(&headers(&[bad])), Err(Refusal::MalformedHeader), "{bad:?}");
        }
        assert_eq!(bearer(&headers(&["Bearer a", "Bearer b"])), Err(Refusal::MalformedHeader));
    }

    #[test]
    fn a_refusal_is_logged_once_per_address_partner_and_reason() {
        let auth = PushAuth { partners: Vec::new(), logged: Mutex::new(HashSet::new()) };
        let (a, b): (IpAddr, IpAddr) = ([127, 0, 0, 1].into(), [127, 0, 0, 2].into());
        assert!(auth.first_time(a, "p", Refusal::InvalidToken));
        assert!(!auth.first_time(a, "p", Refusal::InvalidToken));
        assert!(auth.first_time(b, "p", Refusal::InvalidToken));
        assert!(auth.first_time(a, "q", Refusal::InvalidToken));
        assert!(auth.first_time(a, "p", Refusal::MissingToken));
    }
}

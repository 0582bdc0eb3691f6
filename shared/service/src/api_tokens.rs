//! Bearer tokens for a service's HTTP API: read from a file (one token a
//! line, re-read when it changes; removing the file revokes its tokens) and
//! an environment variable (read at start), the same formats as ingest's
//! push tokens; never from a settings file. [`protect`] puts the check in
//! front of an API's routes: 401 (with a challenge) without a bearer
//! token, 403 with one that is not valid. Tokens are kept and compared as
//! SHA-256 digests in constant time, and never logged.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context as _, anyhow};
use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use sha2::{Digest as _, Sha256};
use shelfsync_settings::{parse_push_tokens_file, parse_push_tokens_list};
use subtle::{Choice, ConstantTimeEq};
use tracing::{info, warn};

use crate::FileSignature;

type Digest = [u8; 32];

fn digest(token: &str) -> Digest {
    Sha256::digest(token.as_bytes()).into()
}

fn read_file(path: &Path) -> anyhow::Result<(FileSignature, Vec<Digest>)> {
    let sig = FileSignature::of(path)?;
    let text = std::fs::read_to_string(path)?;
    let tokens = parse_push_tokens_file(&text)?;
    Ok((sig, tokens.iter().map(|t| digest(t.expose())).collect()))
}

struct FileTokens {
    path: PathBuf,
    /// The file's version last read (`None`: gone) and its tokens.
    state: Mutex<(Option<FileSignature>, Vec<Digest>)>,
}

/// The tokens an API accepts.
pub struct ApiTokens {
    /// Named in the 401 challenge and the logs (`shelfsync-storage`, ...).
    realm: String,
    env: Vec<Digest>,
    file: Option<FileTokens>,
}

impl ApiTokens {
    /// [`ApiTokens::load`] for an HTTP API, from the process's environment:
    /// shared by its handlers; `None` when the API is open.
    pub fn load_for_api(
        realm: &str,
        file: Option<&Path>,
        env_var: Option<&str>,
    ) -> anyhow::Result<Option<Arc<ApiTokens>>> {
        Ok(ApiTokens::load(realm, file, env_var, |var| std::env::var(var).ok())
            .context("the HTTP API's tokens")?
            .map(Arc::new))
    }

    /// The tokens of `file` and of the variable `env_var` (looked up with
    /// `env`); `None` when neither is configured (the API is open). A file
    /// that cannot be read, a variable that is not set, or a token under 16
    /// bytes is an error: the service does not start half protected.
    pub fn load(
        realm: &str,
        file: Option<&Path>,
        env_var: Option<&str>,
        env: impl Fn(&str) -> Option<String>,
    ) -> anyhow::Result<Option<ApiTokens>> {
        if file.is_none() && env_var.is_none() {
            return Ok(None);
        }
        let env = match env_var {
            None => Vec::new(),
            Some(var) => {
                let value = env(var)
                    .ok_or_else(|| anyhow!("read_tokens_env names `{var}`, which is not set"))?;
                let tokens = parse_push_tokens_list(&value)
                    .map_err(|e| anyhow!("read_tokens_env `{var}`: {e}"))?;
                tokens.iter().map(|t| digest(t.expose())).collect()
            }
        };
        let file = match file {
            None => None,
            Some(path) => {
                let (sig, tokens) = read_file(path)
                    .with_context(|| format!("read_tokens_file {}", path.display()))?;
                Some(FileTokens {
                    path: path.to_path_buf(),
                    state: Mutex::new((Some(sig), tokens)),
                })
            }
        };
        let tokens = ApiTokens { realm: realm.to_string(), env, file };
        info!(realm, "the HTTP API asks for a bearer token");
        Ok(Some(tokens))
    }

    /// Tokens that accept nothing: for an API whose tokens cannot be read.
    pub fn none(realm: &str) -> ApiTokens {
        ApiTokens { realm: realm.to_string(), env: Vec::new(), file: None }
    }

    /// The file's tokens now: re-read if it changed, none once it is gone,
    /// the last good ones if it cannot be read or parsed.
    fn file_tokens(&self) -> Vec<Digest> {
        let Some(file) = &self.file else { return Vec::new() };
        let mut state = file.state.lock().unwrap_or_else(|e| e.into_inner());
        match FileSignature::of(&file.path) {
            Ok(sig) if Some(sig) == state.0 => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                if state.0.is_some() {
                    warn!(realm = %self.realm, file = %file.path.display(),
                        "API tokens file removed: its tokens are revoked");
                }
                *state = (None, Vec::new());
            }
            _ => match read_file(&file.path) {
                Ok(read) => {
                    info!(realm = %self.realm, file = %file.path.display(), tokens = read.1.len(),
                        "API tokens reloaded");
                    *state = (Some(read.0), read.1);
                }
                Err(e) => warn!(realm = %self.realm, file = %file.path.display(), error = %e,
                    "cannot reload the API tokens: the last good ones stay valid"),
            },
        }
        state.1.clone()
    }

    /// 401 without a bearer token (or a malformed header), 403 with one
    /// that is not valid.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), StatusCode> {
        let token = bearer(headers).ok_or(StatusCode::UNAUTHORIZED)?;
        let presented = digest(token);
        let mut matched = Choice::from(0);
        for known in self.env.iter().chain(&self.file_tokens()) {
            matched |= presented[..].ct_eq(&known[..]);
        }
        if bool::from(matched) { Ok(()) } else { Err(StatusCode::FORBIDDEN) }
    }
}

/// The token of the one `Authorization: Bearer <token>` header.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let (scheme, token) = value.to_str().ok()?.trim().split_once(' ')?;
    let token = token.trim_start();
    let ok = scheme.eq_ignore_ascii_case("bearer")
        && !token.is_empty()
        && token.bytes().all(|b| b.is_ascii_graphic());
    ok.then_some(token)
}

/// `router` with every route asking for one of `tokens` (none: as it is).
/// Merge the probes and `/metrics` after, so that they stay open.
pub fn protect(router: Router, tokens: Option<Arc<ApiTokens>>) -> Router {
    match tokens {
        None => router,
        Some(tokens) => router.route_layer(middleware::from_fn_with_state(tokens, guard)),
    }
}

async fn guard(State(tokens): State<Arc<ApiTokens>>, request: Request, next: Next) -> Response {
    match tokens.check(request.headers()) {
        Ok(()) => next.run(request).await,
        Err(status) => {
            let message = match status {
                StatusCode::UNAUTHORIZED => {
                    "credentials required: send `Authorization: Bearer <token>`"
                }
                _ => "the token is not valid",
            };
            let mut response =
                (status, axum::Json(serde_json::json!({ "error": message }))).into_response();
            if status == StatusCode::UNAUTHORIZED
                && let Ok(challenge) =
                    HeaderValue::from_str(&format!("Bearer realm=\"{}\"", tokens.realm))
            {
                response.headers_mut().insert(header::WWW_AUTHENTICATE, challenge);
            }
            response
        }
    }
}

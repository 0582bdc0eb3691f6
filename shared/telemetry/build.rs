//! The git commit the binaries are built from, when it is cheap to know,
//! as `SHELFSYNC_REVISION` for `option_env!` (the `vcs.ref.head.revision`
//! of every span's resource, the `revision` label of
//! `shelfsync_build_info`):
//!
//! - `SHELFSYNC_GIT_COMMIT` in the build's environment wins (an image build
//!   has no `.git`: `docker build --build-arg SHELFSYNC_GIT_COMMIT=…`);
//! - else a release build in a git checkout asks git, and is built again
//!   when HEAD moves;
//! - else (debug builds) nothing: a commit would otherwise rebuild this
//!   crate and every crate above it, which is all of the workspace.

use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=SHELFSYNC_GIT_COMMIT");
    let given = std::env::var("SHELFSYNC_GIT_COMMIT").ok().map(|v| v.trim().to_string());
    let revision = match given.filter(|v| !v.is_empty()) {
        Some(v) => Some(v),
        None if std::env::var("PROFILE").as_deref() == Ok("release") => git_head(),
        None => None,
    };
    if let Some(revision) = revision {
        println!("cargo:rustc-env=SHELFSYNC_REVISION={revision}");
    }
}

/// HEAD's commit, with the files that move when HEAD does to watch; `None`
/// outside a git checkout or without git.
fn git_head() -> Option<String> {
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git").args(args).output().ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let commit =
        git(&["rev-parse", "HEAD"]).filter(|c| c.chars().all(|c| c.is_ascii_hexdigit()))?;
    if let (Some(dir), Some(common)) =
        (git(&["rev-parse", "--git-dir"]), git(&["rev-parse", "--git-common-dir"]))
    {
        let mut watched =
            vec![Path::new(&dir).join("HEAD"), Path::new(&common).join("packed-refs")];
        if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watched.push(Path::new(&common).join(branch));
        }
        // A path that does not exist would make cargo run this every build.
        for path in watched.iter().filter(|p| p.exists()) {
            println!("cargo:rerun-if-changed={}", path.display());
        }
    }
    Some(commit)
}

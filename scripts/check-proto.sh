#!/usr/bin/env bash
# Checks the wire contract, proto/shelfsync/v1/shelfsync.proto, with buf (proto/buf.yaml):
#
#   buf lint       the rules buf.yaml names (STANDARD, and a comment on every message and enum)
#   buf breaking   against the last released contract, proto/releases/<version>/ (the newest
#                  version), in the FILE category: a field renumbered, renamed, retyped or removed
#                  without `reserved`, a message or enum value renamed... fails
#
# Releasing the contract: copy proto/shelfsync into proto/releases/<new version>/ and say what
# changed in CHANGELOG.md. Changing a release's copy afterwards is never right.
#
# buf comes from scripts/install-deps.sh ($VENV/buf, npm's @bufbuild/buf as pinned by
# scripts/buf/package-lock.json), installed when missing; SHELFSYNC_BUF names another one.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

log() { printf '[proto] %s\n' "$*" >&2; }

TARGET=${CARGO_TARGET_DIR:-target}
case $TARGET in /*) ;; *) TARGET=$ROOT/$TARGET ;; esac
VENV=${SHELFSYNC_VENV:-$TARGET/venv}
case $VENV in /*) ;; *) VENV=$ROOT/$VENV ;; esac
BUF=${SHELFSYNC_BUF:-$VENV/buf/node_modules/.bin/buf}
if ! [ -x "$BUF" ]; then scripts/install-deps.sh >/dev/null; fi

release=$(find proto/releases -mindepth 1 -maxdepth 1 -type d -name 'v*' | sort -V | tail -1)
[ -n "$release" ] || { log "no released contract in proto/releases/"; exit 1; }
# The release lies inside proto/'s buf workspace, which buf refuses as the other side of a
# comparison: compare against a copy outside it.
baseline=$(mktemp -d)
trap 'rm -rf "$baseline"' EXIT
cp -R "$release/." "$baseline/"

log "buf $("$BUF" --version): lint"
(cd proto && "$BUF" lint)
log "buf breaking against ${release#proto/releases/}"
(cd proto && "$BUF" breaking --against "$baseline")

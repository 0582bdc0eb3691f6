#!/usr/bin/env bash
# Runs the tests of the consumer kits for other languages against the workspace's built binaries:
#
#   kits/python      pytest (golden vectors, generated code current, the kit against real servers)
#   kits/typescript  node --test (golden vectors, the example consumer against real servers)
#
# Both start their own nats-server and redis-server on free loopback ports and the real
# shelfsync-storage and shelfsync CLI per test (never 4222 / 6379). Build those first:
# `cargo build --workspace --bins` (scripts/test.sh does).
#
# Installs what is missing, idempotently: the virtualenv and nats-server (scripts/install-deps.sh),
# the Python kit with its test extra into the virtualenv (${SHELFSYNC_VENV:-${CARGO_TARGET_DIR:-target}/venv};
# its dependencies again only when kits/python/pyproject.toml changed, the kit itself every run),
# Debian's nodejs and npm when there is no node (as root or through `sudo -n`), and
# kits/typescript's packages with `npm ci` (again only when package-lock.json changed; the download
# cache in $VENV/npm-cache).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

log() { printf '[kits] %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

TARGET=${CARGO_TARGET_DIR:-target}
case $TARGET in /*) ;; *) TARGET=$ROOT/$TARGET ;; esac
VENV=${SHELFSYNC_VENV:-$TARGET/venv}
case $VENV in /*) ;; *) VENV=$ROOT/$VENV ;; esac

# The virtualenv and nats-server 2.14.6 (the version of the Rust tests and the deployments).
SHELFSYNC_NATS_SERVER=$(scripts/install-deps.sh)
export SHELFSYNC_NATS_SERVER
export SHELFSYNC_BIN_DIR=${SHELFSYNC_BIN_DIR:-$TARGET/debug}
for bin in shelfsync shelfsync-storage; do
  [ -x "$SHELFSYNC_BIN_DIR/$bin" ] || die "$SHELFSYNC_BIN_DIR/$bin is missing: cargo build --workspace --bins first"
done

# --- Python ---------------------------------------------------------------------------------------

PY=$VENV/bin/python
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@" || die "pip install $* failed"; }
stamp=$VENV/.kits-python-pyproject
if ! cmp -s kits/python/pyproject.toml "$stamp"; then
  log "pip install kits/python[test] (into $VENV)"
  pip_install "./kits/python[test]"
  cp kits/python/pyproject.toml "$stamp"
else
  # The kit itself, as a user installs it (not editable), every run: its code may have changed.
  pip_install --no-deps --force-reinstall ./kits/python
fi

# --- Node -----------------------------------------------------------------------------------------

if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  SUDO=()
  if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO=(sudo -n); else
      die "node and npm are missing: install Debian's nodejs and npm (as root), or Node.js >= 20"
    fi
  fi
  log "apt-get install nodejs npm"
  "${SUDO[@]}" apt-get update -qq >/dev/null || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends nodejs npm \
    >/dev/null || die "apt-get install nodejs npm failed"
fi
node_major=$(node -p 'process.versions.node.split(".")[0]')
[ "$node_major" -ge 18 ] || die "node $(node --version) is too old: the TypeScript kit needs Node.js >= 18 (tested on 20)"

ts=kits/typescript
if ! cmp -s "$ts/package-lock.json" "$ts/node_modules/.package-lock.json.kits-stamp" \
    || ! [ -d "$ts/node_modules/@nats-io/jetstream" ]; then
  log "npm ci in $ts (cache: $VENV/npm-cache)"
  (cd "$ts" && npm ci --no-audit --no-fund --no-update-notifier --loglevel=error \
    --cache "$VENV/npm-cache" >&2) || die "npm ci in $ts failed"
  cp "$ts/package-lock.json" "$ts/node_modules/.package-lock.json.kits-stamp"
fi

# --- the tests ------------------------------------------------------------------------------------

# tests/test_codegen.py checks that the committed protobuf module is current.
log "python kit: pytest"
(cd kits/python && "$PY" -m pytest -q -p no:cacheprovider)
log "typescript example consumer: node --test"
(cd "$ts" && npm test --silent)

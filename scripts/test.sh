#!/usr/bin/env bash
# Runs every test of the suite: unit and property tests, and the
# cross-service tests that start their own nats-server and redis-server on
# free loopback ports (never the ones on 4222/6379).
set -euo pipefail
cd "$(dirname "$0")/.."

NATS=$(scripts/install-deps.sh)
export SHELFSYNC_NATS_SERVER="$NATS"

# The house rules, checked first: a rule CI does not check drifts within days.
cargo fmt --all --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
# The wire contract: buf lint, and buf breaking against the last released contract.
scripts/check-proto.sh

# Binaries first: crash tests run the real shelfsync-storage.
cargo build --workspace --bins
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --no-fail-fast
else
  echo "[test] cargo-nextest not found; using cargo test" >&2
  cargo test --workspace --no-fail-fast
fi
scripts/test-kits.sh # the consumer kits for Python and TypeScript (kits/), against the binaries built above
# The benchmark harness in its quick profile, so it cannot rot (CI checks
# that it runs, not its numbers; docs/PERFORMANCE.md has the real figures).
cargo run --quiet -p shelfsync-bench -- --quick --out "${CARGO_TARGET_DIR:-target}/bench-quick"
if [ -x scripts/validate-deploy.sh ]; then scripts/validate-deploy.sh; fi

#!/usr/bin/env bash
# The suite's main job, locally: builds, starts private nats-server and
# redis-server (unless NATS_URL / REDIS_URL are set), runs storage and ingest,
# imports a generated dump, re-imports it unchanged, re-imports it with 1%
# churn, sends a price-only feed, and prints what flowed: records in, changes
# out, bytes in vs out.
#
# Size: DEMO_PLACES (default 100) x DEMO_ITEMS (default 1000) records.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PLACES=${DEMO_PLACES:-100}
ITEMS=${DEMO_ITEMS:-1000}

log() { printf '[demo] %s\n' "$*" >&2; }

NATS_BIN=$(scripts/install-deps.sh)
for tool in curl python3; do
  command -v "$tool" >/dev/null || { log "installing $tool"; apt-get update -qq >/dev/null; apt-get install -y -qq "$tool" >/dev/null; }
done

log "building (release)"
cargo build --release --bins --quiet
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release
DEMO=$ROOT/target/demo
rm -rf "$DEMO"
mkdir -p "$DEMO"

PIDS=()
cleanup() {
  # Newest first: the services drain while NATS and Redis are still up; a
  # process that has not stopped 10 s after SIGTERM is killed.
  local i p
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    p=${PIDS[i]}
    kill "$p" 2>/dev/null || continue
    for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
  done
  wait 2>/dev/null || true
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_port() { # host port what
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  log "$3 did not start; see $DEMO/*.log"; exit 1
}

if [ -z "${NATS_URL:-}" ]; then
  port=$(free_port)
  "$NATS_BIN" -a 127.0.0.1 -p "$port" -js -sd "$DEMO/nats" >"$DEMO/nats.log" 2>&1 &
  PIDS+=($!)
  wait_port 127.0.0.1 "$port" nats-server
  NATS_URL=nats://127.0.0.1:$port
  log "nats-server $("$NATS_BIN" --version | awk '{print $2}') on $NATS_URL"
fi
if [ -z "${REDIS_URL:-}" ]; then
  port=$(free_port)
  redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$DEMO" \
    >"$DEMO/redis.log" 2>&1 &
  PIDS+=($!)
  wait_port 127.0.0.1 "$port" redis-server
  REDIS_URL=redis://127.0.0.1:$port
  log "redis-server $(redis-server --version | awk '{print $3}') on $REDIS_URL"
fi

STORAGE_PORT=$(free_port)
INGEST_PORT=$(free_port)
# The push endpoint takes a partner's feed only with one of its tokens: one
# random token per partner, in a file (as a mounted secret would be).
for partner in flowers flowers-prices; do
  python3 -c 'import secrets; print(secrets.token_urlsafe(32))' >"$DEMO/$partner.tokens"
done
CONFIG=$DEMO/shelfsync.toml
cat >"$CONFIG" <<EOF
[nats]
url = "$NATS_URL"
prefix = "demo"
[redis]
url = "$REDIS_URL"
namespace = "demo"
[storage]
partitions = 16
http_listen = "127.0.0.1:$STORAGE_PORT"
[ingest]
listen = "127.0.0.1:$INGEST_PORT"
[telemetry]
log_level = "warn"

[[partners]]
name = "flowers"
brand_id = 7
kind = "full"
fields = ["title", "category", "price", "old_price", "currency", "stock", "images", "description"]
push_tokens_file = "$DEMO/flowers.tokens"

[[partners]]
name = "flowers-prices"
brand_id = 7
kind = "delta"
fields = ["price", "old_price"]
push_tokens_file = "$DEMO/flowers-prices.tokens"
EOF
export SHELFSYNC_CONFIG=$CONFIG
# Settings come from the file only, whatever this shell exports.
unset SHELFSYNC__NATS__URL SHELFSYNC__REDIS__URL SHELFSYNC__NATS__PREFIX || true

"$BIN/shelfsync" setup >/dev/null
"$BIN/shelfsync-storage" --config "$CONFIG" >"$DEMO/storage.log" 2>&1 &
PIDS+=($!)
"$BIN/shelfsync-ingest" --config "$CONFIG" >"$DEMO/ingest.log" 2>&1 &
PIDS+=($!)
wait_port 127.0.0.1 "$STORAGE_PORT" shelfsync-storage
wait_port 127.0.0.1 "$INGEST_PORT" shelfsync-ingest

log "generating feeds: $PLACES places x $ITEMS items"
gen() { "$BIN/shelfsync" gen-feed --brand 7 --places "$PLACES" --items "$ITEMS" --seed 42 "$@" 2>/dev/null; }
gen --out "$DEMO/base.json"
gen --churn 0.01 --churn-seed 1 --out "$DEMO/churn.json"
gen --churn 0.01 --churn-seed 2 --variant price --out "$DEMO/prices.json"

stats() { curl -sf "http://127.0.0.1:$STORAGE_PORT/v1/stats"; }
ROWS=$DEMO/rows.jsonl
: >"$ROWS"
step() { # title partner file
  local before after report
  before=$(stats)
  report=$(curl -sf -X POST --data-binary @"$3" -H 'content-type: application/json' \
    -H "authorization: Bearer $(cat "$DEMO/$2.tokens")" \
    "http://127.0.0.1:$INGEST_PORT/v1/partners/$2/feed") || { log "import failed: $report"; exit 1; }
  "$BIN/shelfsync" wait --timeout 300s >/dev/null
  after=$(stats)
  python3 - "$1" "$before" "$after" "$report" >>"$ROWS" <<'PY'
import json, sys
title, before, after, report = sys.argv[1], *map(json.loads, sys.argv[2:])
d = lambda k: after[k] - before[k]
print(json.dumps({"step": title, "records": report["items"], "bytes_in": report["bytes_in"],
                  "rejected": report["rejected_total"], "sweeps": report["sweeps"],
                  "changes": d("changes"), "unchanged": d("unchanged"),
                  "change_bytes": d("change_bytes"), "ms": report["duration_ms"]}))
PY
  log "$1: done"
}

step "initial import" flowers "$DEMO/base.json"
step "identical re-import" flowers "$DEMO/base.json"
step "re-import, 1% churn" flowers "$DEMO/churn.json"
step "price-only feed, 1% churn" flowers-prices "$DEMO/prices.json"

python3 - "$ROWS" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
mb = lambda b: f"{b / 1e6:.2f} MB"
print()
print(f"{'step':<28}{'records in':>12}{'bytes in':>12}{'changes out':>13}{'bytes out':>12}{'out/in':>9}{'import':>10}")
for r in rows:
    ratio = 100 * r["change_bytes"] / r["bytes_in"] if r["bytes_in"] else 0
    print(f"{r['step']:<28}{r['records']:>12,}{mb(r['bytes_in']):>12}{r['changes']:>13,}"
          f"{mb(r['change_bytes']):>12}{ratio:>8.2f}%{r['ms'] / 1000:>9.2f}s")
print()
print("changes out = records whose data, state, absent or deleted really changed;")
print("bytes out   = ChangeBatch payloads published (each change carries the record before and after).")
PY
log "logs and feeds in $DEMO"
echo
echo "one change, as a consumer sees it:"
"$BIN/shelfsync" tail --from-start --limit 1 | head -c 1500
echo

#!/usr/bin/env bash
# The suite's main job, locally, in one command: installs what is missing (scripts/install-deps.sh),
# builds the binaries (profile `demo-bin`: release at opt-level 1, about half the cold build
# time), starts private nats-server and redis-server under target/demo/ (unless NATS_URL /
# REDIS_URL are set) and every service against them — storage, ingest,
# validator, aggregator, recommender, picks — then:
#
#   1. imports a generated dump, re-imports it unchanged, re-imports it with 1% churn, sends a
#      price-only feed, and prints what flowed: records in, changes out, bytes in vs out;
#   2. imports a small hand-written dump of another brand, whose price feed carries a typo (a price
#      a hundred times too low), and shows what the other services made of it: the validator
#      hiding the bad price, a master card's minimum price per region (the aggregator), a place's
#      top offers (the recommender), the discounted picks (the example service), and how to see
#      an import's trace.
#
# Stops everything it started when it exits, however it exits; a re-run starts afresh (and first
# stops what a killed earlier run left behind). Size of step 1: DEMO_PLACES (default 100) x
# DEMO_ITEMS (default 1000) records. Logs, feeds and settings stay in target/demo/.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PLACES=${DEMO_PLACES:-100}
ITEMS=${DEMO_ITEMS:-1000}
DEMO=$ROOT/target/demo

log() { printf '[demo] %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

NATS_BIN=$(scripts/install-deps.sh)
REDIS_BIN=${SHELFSYNC_REDIS_SERVER:-redis-server}

SERVICES=(storage ingest validator aggregator recommender picks)
log "building (profile demo-bin): the CLI and ${SERVICES[*]} (the first build takes minutes)"
build_args=(--bin shelfsync)
for s in "${SERVICES[@]}"; do build_args+=(--bin "shelfsync-$s"); done
cargo build --profile demo-bin --quiet "${build_args[@]}"
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/demo-bin

# --- processes ------------------------------------------------------------------------------------
# Every process runs with target/demo as its working directory, and its pid goes to
# target/demo/pids: what a run killed with SIGKILL left behind is recognised by both and stopped
# by the next run (a pid reused by another process has another working directory).

PIDS=()
stop() { # pids..., newest first: services drain while NATS and Redis are still up
  local i p
  for ((i = $#; i >= 1; i--)); do
    p=${!i}
    kill "$p" 2>/dev/null || continue
    for _ in $(seq 1 100); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
  done
}
cleanup() {
  stop "${PIDS[@]}"
  wait 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

stop_leftovers() {
  [ -f "$DEMO/pids" ] || return 0
  local left=() pid
  while read -r pid; do
    if [ "$(readlink "/proc/$pid/cwd" 2>/dev/null)" = "$DEMO" ]; then left+=("$pid"); fi
  done <"$DEMO/pids"
  if [ ${#left[@]} -gt 0 ]; then
    log "stopping ${#left[@]} processes an earlier run left behind"
    stop "${left[@]}"
  fi
}
stop_leftovers
rm -rf "$DEMO"
mkdir -p "$DEMO"

start() { # name command...: runs in the background, output in target/demo/<name>.log
  local name=$1
  shift
  (cd "$DEMO" && exec "$@") >"$DEMO/$name.log" 2>&1 &
  PIDS+=($!)
  echo $! >>"$DEMO/pids"
}

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
wait_port() { # port what
  for _ in $(seq 1 100); do
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  die "$2 did not start; see $DEMO/$2.log"
}
quiet() { # command...: its output only when it fails
  local out
  out=$("$@" 2>&1) || { printf '%s\n' "$out" >&2; return 1; }
}
http_ok() { curl -sf -o /dev/null "http://127.0.0.1:$1$2"; }
wait_ready() { # name port: /readyz answers 200 (connected; the feed services: bootstrapped)
  for _ in $(seq 1 600); do
    if http_ok "$2" /readyz; then return 0; fi
    sleep 0.1
  done
  die "$1 not ready after 60 s; see $DEMO/$1.log"
}

# --- servers --------------------------------------------------------------------------------------

NATS_MONITOR=""
PREFIX=demo
if [ -z "${NATS_URL:-}" ]; then
  port=$(free_port)
  monitor=$(free_port)
  start nats "$NATS_BIN" -a 127.0.0.1 -p "$port" -m "$monitor" -js -sd "$DEMO/nats"
  wait_port "$port" nats
  NATS_URL=nats://127.0.0.1:$port
  NATS_MONITOR=http://127.0.0.1:$monitor
  log "nats-server $("$NATS_BIN" --version | awk '{print $2}') on $NATS_URL"
else
  # Someone else's server keeps what earlier runs left: a prefix of its own gives this run empty
  # streams and keys.
  PREFIX=demo$(date +%s)
  NATS_MONITOR=${NATS_MONITOR_URL:-}
  log "using NATS_URL=$NATS_URL with the streams ${PREFIX^^}_* (and Redis keys $PREFIX:*)"
fi
if [ -z "${REDIS_URL:-}" ]; then
  port=$(free_port)
  start redis "$REDIS_BIN" --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$DEMO"
  wait_port "$port" redis
  REDIS_URL=redis://127.0.0.1:$port
  log "redis-server $("$REDIS_BIN" --version | awk '{print $3}') on $REDIS_URL"
fi

# --- settings -------------------------------------------------------------------------------------

declare -A PORT
for s in "${SERVICES[@]}"; do PORT[$s]=$(free_port); done
# The push endpoint takes a partner's feed only with one of its tokens: one random token per
# partner, in a file (as a mounted secret would be).
PARTNERS=(flowers flowers-prices bouquets bouquets-prices)
for partner in "${PARTNERS[@]}"; do
  python3 -c 'import secrets; print(secrets.token_urlsafe(32))' >"$DEMO/$partner.tokens"
done
# One partner's table in the settings file: name, brand, kind, the fields it owns (quoted, comma
# separated), and its tokens file from above.
partner() {
  printf '\n[[partners]]\nname = "%s"\nbrand_id = %s\nkind = "%s"\n' "$1" "$2" "$3"
  printf 'fields = [%s]\npush_tokens_file = "%s"\n' "$4" "$DEMO/$1.tokens"
}
CONFIG=$DEMO/shelfsync.toml
cat >"$CONFIG" <<EOF
[nats]
url = "$NATS_URL"
prefix = "$PREFIX"
[redis]
url = "$REDIS_URL"
namespace = "$PREFIX"
[storage]
partitions = 16
http_listen = "127.0.0.1:${PORT[storage]}"
[ingest]
listen = "127.0.0.1:${PORT[ingest]}"
[validator]
http_listen = "127.0.0.1:${PORT[validator]}"
[aggregator]
http_listen = "127.0.0.1:${PORT[aggregator]}"
[recommender]
http_listen = "127.0.0.1:${PORT[recommender]}"
[telemetry]
log_level = "warn"

# The region directory of the master cards: brand 8's shops; every other place is in "default".
[[aggregator.places]]
brand_id = 8
place_id = 1
region = "moscow"
[[aggregator.places]]
brand_id = 8
place_id = 2
region = "moscow"
[[aggregator.places]]
brand_id = 8
place_id = 3
region = "spb"

$(partner flowers 7 full \
  '"title", "category", "price", "old_price", "currency", "stock", "images", "description"')
$(partner flowers-prices 7 delta '"price", "old_price"')
$(partner bouquets 8 full '"title", "category", "price", "old_price", "currency", "stock"')
$(partner bouquets-prices 8 delta '"price", "old_price"')
EOF
export SHELFSYNC_CONFIG=$CONFIG
# Settings come from the file only, whatever this shell exports.
while read -r var; do unset "$var"; done < <(env | sed -n 's/^\(SHELFSYNC__[A-Z0-9_]*\)=.*/\1/p')

# --- services -------------------------------------------------------------------------------------

quiet "$BIN/shelfsync" setup
for s in "${SERVICES[@]}"; do
  if [ "$s" = picks ]; then
    start picks "$BIN/shelfsync-picks" --config "$CONFIG" --listen "127.0.0.1:${PORT[picks]}"
  else
    start "$s" "$BIN/shelfsync-$s" --config "$CONFIG"
  fi
done
for s in "${SERVICES[@]}"; do wait_ready "$s" "${PORT[$s]}"; done
log "running: ${SERVICES[*]}"

# Waits until everything sent so far has gone through: storage applied every command, and every
# consumer of the change stream (validator, aggregator, recommender, picks) has handled every
# change — twice in a row, since a consumer's work (the validator's hide) may be a new command.
# The consumers' lag comes from the NATS server's monitoring endpoint; without one (someone
# else's NATS_URL and no NATS_MONITOR_URL), a short pause stands in for it.
settle() {
  local calm=0
  for _ in $(seq 1 600); do
    quiet "$BIN/shelfsync" wait --timeout 300s
    if [ -z "$NATS_MONITOR" ]; then sleep 2; calm=$((calm + 1)); [ $calm -lt 2 ] || return 0; continue; fi
    if curl -sf "$NATS_MONITOR/jsz?consumers=true" | python3 -c '
import json, sys
stream = sys.argv[1]
busy = [c for a in json.load(sys.stdin).get("account_details", [])
        for s in a.get("stream_detail", []) if s["name"] == stream
        for c in s.get("consumer_detail", [])
        if c.get("num_pending", 0) or c.get("num_ack_pending", 0)]
sys.exit(1 if busy else 0)' "${PREFIX^^}_CHANGES"; then
      calm=$((calm + 1))
      [ $calm -lt 2 ] || return 0
    else
      calm=0
    fi
    sleep 0.2
  done
  die "the change stream's consumers still have work after 2 minutes; see $DEMO/*.log"
}

push() { # partner file: the import report (JSON) on stdout
  curl -sf -X POST --data-binary @"$2" -H 'content-type: application/json' \
    -H "authorization: Bearer $(cat "$DEMO/$1.tokens")" \
    "http://127.0.0.1:${PORT[ingest]}/v1/partners/$1/feed" || die "pushing $2 to $1 failed; see $DEMO/ingest.log"
}

# --- 1. what flows --------------------------------------------------------------------------------

log "generating feeds: $PLACES places x $ITEMS items"
gen() { "$BIN/shelfsync" gen-feed --brand 7 --places "$PLACES" --items "$ITEMS" --seed 42 "$@" 2>/dev/null; }
gen --out "$DEMO/base.json"
gen --churn 0.01 --churn-seed 1 --out "$DEMO/churn.json"
gen --churn 0.01 --churn-seed 2 --variant price --out "$DEMO/prices.json"

stats() { curl -sf "http://127.0.0.1:${PORT[storage]}/v1/stats"; }
ROWS=$DEMO/rows.jsonl
: >"$ROWS"
step() { # title partner file
  local before after report
  before=$(stats)
  report=$(push "$2" "$3")
  quiet "$BIN/shelfsync" wait --timeout 300s
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
echo
echo "one change, as a consumer sees it (shelfsync tail --from-start --limit 1):"
"$BIN/shelfsync" tail --from-start --limit 1 | head -c 1500
echo

# --- 2. what the services make of it --------------------------------------------------------------

# Brand 8: three shops (1 and 2 in Moscow, 3 in St Petersburg) selling the same bouquets; prices
# in kopecks.
cat >"$DEMO/bouquets.json" <<'EOF'
{"brand_id": 8, "places": [
  {"place_id": 1, "items": [
    {"id": "rose-25", "title": "25 red roses", "category": "roses", "price": 249000, "old_price": 299000, "currency": "RUB", "stock": 12},
    {"id": "tulip-15", "title": "15 tulips", "category": "tulips", "price": 129000, "currency": "RUB", "stock": 30},
    {"id": "peony-7", "title": "7 pink peonies", "category": "peonies", "price": 319000, "old_price": 399000, "currency": "RUB", "stock": 5},
    {"id": "lily-5", "title": "5 white lilies", "category": "lilies", "price": 189000, "currency": "RUB", "stock": 0}]},
  {"place_id": 2, "items": [
    {"id": "rose-25", "title": "25 red roses", "category": "roses", "price": 229000, "old_price": 259000, "currency": "RUB", "stock": 4},
    {"id": "tulip-15", "title": "15 tulips", "category": "tulips", "price": 119000, "old_price": 149000, "currency": "RUB", "stock": 8},
    {"id": "peony-7", "title": "7 pink peonies", "category": "peonies", "price": 339000, "currency": "RUB", "stock": 2}]},
  {"place_id": 3, "items": [
    {"id": "rose-25", "title": "25 red roses", "category": "roses", "price": 209000, "currency": "RUB", "stock": 9},
    {"id": "tulip-15", "title": "15 tulips", "category": "tulips", "price": 139000, "currency": "RUB", "stock": 20},
    {"id": "lily-5", "title": "5 white lilies", "category": "lilies", "price": 179000, "old_price": 219000, "currency": "RUB", "stock": 6}]}]}
EOF
# The next price feed of shop 2: tulips on sale, and a typo: roses at 22.90 instead of 2 290.00.
cat >"$DEMO/bouquets-prices.json" <<'EOF'
{"brand_id": 8, "places": [
  {"place_id": 2, "items": [
    {"id": "rose-25", "price": 2290, "old_price": 259000},
    {"id": "tulip-15", "price": 109000, "old_price": 149000}]}]}
EOF

api() { curl -s "http://127.0.0.1:${PORT[$1]}$2"; } # service path: the JSON it answers (404s too)
card() { api aggregator "/v1/cards/$1/$2"; }

log "importing brand 8's bouquets"
push bouquets "$DEMO/bouquets.json" >/dev/null
settle
card_before=$(card moscow rose-25)
record_before=$("$BIN/shelfsync" get 8 2 rose-25)
log "sending brand 8's price feed (with a typo)"
push bouquets-prices "$DEMO/bouquets-prices.json" >/dev/null
settle

SHOW=$DEMO/showcase
mkdir -p "$SHOW"
printf '%s' "$record_before" >"$SHOW/record-before.json"
"$BIN/shelfsync" get 8 2 rose-25 >"$SHOW/record-after.json"
printf '%s' "$card_before" >"$SHOW/card-before.json"
for region in moscow spb; do card "$region" rose-25 >"$SHOW/card-$region.json"; done
api recommender "/v1/top/7/1?limit=5" >"$SHOW/top.json"
for place in 1 2; do api picks "/v1/picks/8/$place" >"$SHOW/picks-$place.json"; done

python3 - "$SHOW" "${PORT[aggregator]}" "${PORT[recommender]}" "${PORT[picks]}" <<'PY' \
  || die "the validator did not hide the bad price; see $DEMO/validator.log"
import json, pathlib, sys
show, agg, rec, picks = pathlib.Path(sys.argv[1]), *sys.argv[2:]
load = lambda name: json.loads((show / name).read_text() or "null")

def money(kopecks, currency="RUB"):
    return f"{kopecks / 100:,.2f}".replace(",", " ") + f" {currency}"

def product(record):
    return record.get("data") or {}

def state(record):
    return record.get("state") or {}

def card_line(region, card):
    if not card or card.get("min_price") is None:
        return f"    {region:<8} no offer qualifies"
    where = card.get("cheapest") or {}
    n = card.get("offers", 0)
    return (f"    {region:<8} {money(card['min_price'], card.get('currency') or 'RUB'):>14}  "
            f"cheapest at shop {where.get('place_id')} ({n} offer{'s' if n != 1 else ''} in stock and visible)")

print()
print("what the other services made of it: brand 8, three shops selling the same bouquets")
print("(1 and 2 in Moscow, 3 in St Petersburg); then shop 2's price feed puts its 25 roses at")
print("22.90 instead of 2 290.00.")
print()
before, after = load("record-before.json"), load("record-after.json")
st = state(after)
hidden = bool(st.get("hidden"))
print("validator    shelfsync get 8 2 rose-25")
print(f"    price {money(product(before).get('price', 0))} -> {money(product(after).get('price', 0))}: "
      + (f"HIDDEN by {st.get('decided_by')}, \"{'; '.join(st.get('reasons') or [])}\"" if hidden
         else "still visible: the validator did not hide it (see target/demo/validator.log)"))
print()
print(f"aggregator   master card rose-25, minimum price per region (GET :{agg}/v1/cards/<region>/rose-25)")
print("  before the price feed:")
print(card_line("moscow", load("card-before.json")))
print("  after it" + (" (the hidden offer no longer counts):" if hidden else ":"))
for region in ("moscow", "spb"):
    print(card_line(region, load(f"card-{region}.json")))
print()
print(f"recommender  top 5 of brand 7, shop 1 (GET :{rec}/v1/top/7/1?limit=5): deepest discount first")
for item in load("top.json") or []:
    old = f"was {money(item['old_price'])}" if item.get("old_price") else ""
    print(f"    {item['product_id']:<12} {item.get('category', ''):<14} {money(item['price']):>14}  "
          f"{old:<18} -{100 * item.get('discount', 0):.0f}%  stock {item.get('stock')}")
print()
shop2 = load("picks-2.json") or []
print(f"picks        discounted picks of brand 8 (GET :{picks}/v1/picks/8/<shop>), the example service")
print("             of docs/SUBSCRIBING.md; shop 2's roses at -99% are "
      + ("among them" if any(p["product_id"] == "rose-25" for p in shop2) else "not among them: hidden"))
for place in (1, 2):
    items = load(f"picks-{place}.json") or []
    print(f"  shop {place}: " + ("; ".join(
        f"{p['title']} {money(p['price'])} (was {money(p['old_price'])}, -{p['discount_pct']:.0f}%)" for p in items)
        or "none"))
sys.exit(0 if hidden else 1)
PY

echo
if [ -n "${OTEL_EXPORTER_OTLP_ENDPOINT:-}" ]; then
  echo "trace        every service exported its spans to $OTEL_EXPORTER_OTLP_ENDPOINT: in Jaeger, search"
  echo "             service shelfsync-ingest, operation ingest.import (one import is one trace)"
else
  echo "trace        to see an import as one trace (ingest -> storage -> validator, aggregator, ...):"
  echo "               docker compose -f compose/compose.yaml up -d jaeger"
  echo "               OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 bash scripts/demo.sh"
  echo "             then http://127.0.0.1:16686, service shelfsync-ingest, operation ingest.import"
  echo "             (any OTLP collector works; docs/TRACING.md)"
fi
echo
log "logs, feeds and settings in $DEMO; stopping everything"

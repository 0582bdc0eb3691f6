"""The live run: the real binaries against a loopback nats-server with the compose permissions
and a redis-server."""
import json
import os
import pathlib
import re
import subprocess
import time
import urllib.error
import urllib.request

import yaml

from .compose import COMPOSE_CONFIG
from .core import NATS_SERVER, ROOT, SERVICES, TMP, check, free_port, run, skip, tool, wait_for_port
from .nats_checks import nats_env_defaults
from .redisacl import acl_env
from .settings_schema import PENDING_KEYS, SCHEMA


def live_config_files(dest):
    """compose/config/*.toml for a run on this machine: the secrets' paths point at the dev token
    files of compose/secrets, and keys shared/settings does not have yet are left out."""
    unknown = {k for (struct, k) in PENDING_KEYS if k not in (SCHEMA or {}).get(struct, {})}
    compose = yaml.safe_load((ROOT / "compose/compose.yaml").read_text())
    secret_file = {name: ROOT / "compose" / str(spec["file"]).split(":-")[-1].rstrip("}")
                   for name, spec in (compose.get("secrets") or {}).items()}
    out = {}
    for src in sorted((ROOT / "compose/config").glob("*.toml")):
        lines = []
        for line in src.read_text().splitlines():
            m = re.match(r"\s*(\w+)\s*=", line)
            if m and m.group(1) in unknown:
                continue
            line = re.sub(r'"/run/secrets/([\w-]+)"', lambda m: json.dumps(str(secret_file[m.group(1)])), line)
            lines.append(line)
        (dest / src.name).write_text("\n".join(lines) + "\n")
        out[src.name] = dest / src.name
    return out, not unknown & {"push_tokens_file"}


def first_token(path):
    for line in pathlib.Path(path).read_text().splitlines():
        if line.strip() and not line.strip().startswith("#"):
            return line.strip()
    return ""

def find_bin_dir():
    names = ["shelfsync", *(b for (b, _, _, _) in SERVICES.values())]
    if os.environ.get("SHELFSYNC_BIN_DIR"):
        dirs = [pathlib.Path(os.environ["SHELFSYNC_BIN_DIR"])]
    else:
        target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
        dirs = [target / "release", target / "debug"]
    found = [d for d in dirs if all((d / n).is_file() and os.access(d / n, os.X_OK) for n in names)]
    if not found:
        return None
    return max(found, key=lambda d: max((d / n).stat().st_mtime for n in names))


def http_status(port, path):
    import urllib.request
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status
    except Exception as e:  # noqa: BLE001
        return getattr(e, "code", None)


def check_live():
    """The real binaries against a nats-server with the compose permissions: setup, every
    service, a pushed import, keyframe bootstrap, the CLI; no permission violation anywhere."""
    bins = find_bin_dir()
    redis = tool("redis-server")
    if not (bins and redis and NATS_SERVER):
        skip("live run", f"needs built binaries ({bins or 'none found: cargo build --bins'}), redis-server ({redis or 'missing'}) and nats-server")
        return
    env_pw = nats_env_defaults()
    nport, rport = free_port(), free_port()
    store = TMP / "live-js"
    store.mkdir(parents=True, exist_ok=True)
    conf = TMP / "live-nats.conf"
    conf.write_text(re.sub(r"(store_dir\s*[:=]\s*)\S+", lambda m: m.group(1) + json.dumps(str(store)),
                           (ROOT / "compose/nats/nats.conf").read_text()))
    logs = TMP / "live-logs"
    logs.mkdir(exist_ok=True)
    procs = {}
    # The caller's own SHELFSYNC*/OTEL_*/NATS_URL/REDIS_URL must not leak into the run.
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SHELFSYNC", "OTEL_")) and k not in ("NATS_URL", "REDIS_URL")}

    def start(name, cmd, env=None):
        out = open(logs / f"{name}.log", "w")
        procs[name] = subprocess.Popen(cmd, env={**clean, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                                       cwd=TMP)
        return procs[name]

    errors = []
    summary = []
    notes = []
    config_dir = TMP / "live-config"
    config_dir.mkdir(exist_ok=True)
    files, tokens_enforced = live_config_files(config_dir)

    def config_of(name):
        return ":".join(str(files[f]) for f in COMPOSE_CONFIG[name])

    tokens = {p: first_token(ROOT / f"compose/secrets/{p}-push.dev-tokens") for p in ("flowers", "flowers-prices")}
    redis_pw = acl_env()
    base_env = {
        "SHELFSYNC_CONFIG": config_of("setup"),
        "SHELFSYNC__NATS__URL": f"nats://127.0.0.1:{nport}",
        "RUST_LOG": "info",
    }
    # Each workload logs in to Redis as its own ACL user (the CLI as `cli`); the validator and
    # the recommender use no Redis and get no credentials.
    redis_user = {"admin": "cli", "storage": "storage", "ingest": "ingest", "aggregator": "aggregator"}

    def redis_url(user):
        ru = redis_user.get(user)
        cred = f"{ru}:{redis_pw[f'REDIS_{ru.upper()}_PASSWORD']}@" if ru else ""
        return f"redis://{cred}127.0.0.1:{rport}"

    def env_for(user, extra=None):
        return {**base_env, "SHELFSYNC__REDIS__URL": redis_url(user),
                "SHELFSYNC__NATS__USER": user, "SHELFSYNC__NATS__INBOX_PREFIX": f"_INBOX_{user}",
                "SHELFSYNC__NATS__PASSWORD": env_pw[f"NATS_{user.upper()}_PASSWORD"], **(extra or {})}

    def cli(args, timeout=90):
        r = run([str(bins / "shelfsync"), *args], env={**clean, **env_for("admin")}, timeout=timeout)
        if r.returncode != 0:
            errors.append(f"shelfsync {' '.join(args)} failed ({r.returncode}): {(r.stderr or r.stdout)[-800:]}")
        return r

    try:
        start("nats", [NATS_SERVER, "-c", str(conf), "-a", "127.0.0.1", "-p", str(nport), "-m", str(free_port())], env_pw)
        # Redis with the shipped ACL users (compose/redis/start-redis.sh renders users.acl).
        start("redis", ["sh", str(ROOT / "compose/redis/start-redis.sh"), "--port", str(rport), "--bind", "127.0.0.1",
                        "--save", "", "--appendonly", "no", "--dir", str(TMP)],
              {**redis_pw, "REDIS_ACL_FILE": str(TMP / "live-users.acl")})
        deadline = time.time() + 15
        for port in (nport, rport):
            if not wait_for_port(port, deadline):
                raise RuntimeError(f"port {port} did not open")
        cli(["setup"])
        ports = {}
        for name, (binary, _, listen, user) in SERVICES.items():
            ports[name] = free_port()
            start(name, [str(bins / binary)], env_for(user, {listen: f"127.0.0.1:{ports[name]}",
                                                              "SHELFSYNC_CONFIG": config_of(name)}))
        # storage, ingest and validator are ready once connected; then an import flows through
        want = ["storage", "ingest", "validator"]
        deadline = time.time() + 60
        while want and time.time() < deadline:
            want = [n for n in want if http_status(ports[n], "/readyz") != 200]
            for n, p in procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{n} exited with {p.returncode}: {(logs / f'{n}.log').read_text()[-1500:]}")
            time.sleep(0.3)
        if want:
            errors.append(f"not ready after 60 s: {want}")
        feed = TMP / "feed.json"
        run([str(bins / "shelfsync"), "gen-feed", "--places", "3", "--items", "40", "--out", str(feed)])
        push = f"http://127.0.0.1:{ports['ingest']}/v1/partners/flowers/feed"
        if tokens_enforced:
            # No token, another partner's token: refused, nothing imported.
            for headers, want in (({}, 401), ({"Authorization": f"Bearer {tokens['flowers-prices']}"}, 403)):
                try:
                    urllib.request.urlopen(urllib.request.Request(push, data=b"{}", method="POST", headers=headers), timeout=30)
                    errors.append(f"a push with {headers or 'no token'} was accepted")
                except urllib.error.HTTPError as e:
                    if e.code != want:
                        errors.append(f"a push with {headers or 'no token'} got {e.code}, expected {want}")
                    else:
                        summary.append(f"{want} without a valid token")
        req = urllib.request.Request(push, data=feed.read_bytes(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {tokens['flowers']}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                summary.append(f"import report {len(r.read())} bytes")
        except Exception as e:  # noqa: BLE001
            errors.append(f"push import failed: {e} {getattr(e, 'read', lambda: b'')().decode()[:500]}")
        cli(["wait", "--timeout", "60s"])
        # the keyframe consumers bootstrap (they ask storage for a keyframe when none exists)
        want = ["aggregator", "recommender"]
        deadline = time.time() + 90
        while want and time.time() < deadline:
            want = [n for n in want if http_status(ports[n], "/readyz") != 200]
            time.sleep(0.5)
        if want:
            errors.append(f"not ready (bootstrapped) after 90 s: {want}")
        # a price of 0 from the price feed: the validator must hide the record (its CAS PATCH
        # goes through NATS as a command, storage applies it)
        bad = json.dumps({"brand_id": 7, "places": [{"place_id": 1, "items": [{"id": "sku-1-1", "price": 0}]}]})
        req = urllib.request.Request(f"http://127.0.0.1:{ports['ingest']}/v1/partners/flowers-prices/feed",
                                     data=bad.encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {tokens['flowers-prices']}"})
        try:
            urllib.request.urlopen(req, timeout=30).read()
        except Exception as e:  # noqa: BLE001
            errors.append(f"price-feed push failed: {e}")
        deadline = time.time() + 30
        hidden = False
        while time.time() < deadline and not hidden:
            cli(["wait", "--timeout", "30s"])
            r = run([str(bins / "shelfsync"), "get", "7", "1", "sku-1-1"], env={**clean, **env_for("admin")}, timeout=30)
            hidden = bool(re.search(r'"hidden"\s*:\s*true', r.stdout))
            if not hidden:
                time.sleep(0.5)
        if hidden:
            summary.append("validator hid a price-0 record")
        else:
            errors.append("the validator did not hide sku-1-1 after a price of 0 (its command did not land?)")
        cli(["keyframe", "--timeout", "60s"])
        cli(["tail", "--from-start", "--limit", "1"])
        cli(["wait", "--timeout", "60s"])
        r = cli(["stats", "--json"])
        try:
            streams = json.loads(r.stdout).get("streams", {})
            changes = (streams.get("changes") or {}).get("last_seq", 0)
            summary.append(f"{changes} change messages, {(streams.get('aggregates') or {}).get('last_seq', 0)} aggregate messages")
            if not changes:
                errors.append(f"the import produced no change message: {r.stdout[:500]}")
        except (ValueError, AttributeError):
            errors.append(f"shelfsync stats --json: not JSON: {r.stdout[:300]}")
        if http_status(ports["recommender"], "/v1/top/7/1") != 200:
            errors.append("recommender: GET /v1/top/7/1 did not answer 200")
        # /metrics on every service's HTTP port (what Prometheus scrapes)
        no_metrics = [n for n in SERVICES if http_status(ports[n], "/metrics") != 200]
        if no_metrics:  # being added service by service: a note, not a failure
            notes.append(f"NOTE  live run: no /metrics yet on {', '.join(no_metrics)} (Prometheus will see them down)")
        time.sleep(1)  # let validator / aggregator / recommender consume the last changes
    except Exception as e:  # noqa: BLE001
        errors.append(str(e))
    finally:
        for name in reversed(list(procs)):
            p = procs[name]
            if p.poll() is None:
                p.terminate()
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
    for name in procs:
        text = (logs / f"{name}.log").read_text(errors="replace")
        for line in text.splitlines():
            if "Violation" in line or "permissions violation" in line.lower() or "NOPERM" in line:
                errors.append(f"{name}: {line.strip()[:300]}")
    check(f"live run ({bins}): setup, every service, push import ({', '.join(summary) or '?'}), keyframe "
          "bootstrap, CLI, every workload as its own Redis ACL user, no NATS permission violation, no NOPERM", errors)
    for n in notes:
        print(n, flush=True)
    if errors:
        for name in procs:
            print(f"      --- {name}.log (tail)")
            for line in (logs / f"{name}.log").read_text(errors="replace").splitlines()[-8:]:
                print(f"      {line[:200]}")


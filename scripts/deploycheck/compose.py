"""compose/: the compose-spec schema and cross-checks of services, builds, health checks, env."""
import os

import yaml

from .core import ROOT, SERVICES, check, fail, rel, run, tool
from .dockerfile import dockerfile_stages
from .natsconf import NatsConf
from .settings_schema import SCHEMA, env_key_errors, toml_file
from .sizes import docker_size, nats_size, redis_size

NATS_VERSION = os.environ.get("NATS_VERSION", "2.14.6")
# The settings files each container reads, in order (SHELFSYNC_CONFIG): the common file, plus
# the one of the workload that alone reads it.
COMPOSE_CONFIG = {
    "setup": ["shelfsync.toml", "storage.toml", "ingest.toml"],
    "storage": ["shelfsync.toml", "storage.toml"],
    "ingest": ["shelfsync.toml", "ingest.toml"],
    "validator": ["shelfsync.toml"],
    "aggregator": ["shelfsync.toml"],
    "recommender": ["shelfsync.toml"],
}
STREAM_LIMITS = ("cmd", "changes", "keyframes", "aggregates", "rejects")


def stream_limit_errors(common, account_max_file, server_max_file, where):
    """The streams' max_bytes are reserved out of the account's and the server's file storage
    when they are created: they must fit, and CMD must have a limit."""
    nats = common.get("nats", {})
    limits = {s: int(nats.get(f"{s}_max_bytes", 0)) for s in STREAM_LIMITS}
    errors = []
    if not limits["cmd"]:
        errors.append(f"{where}: nats.cmd_max_bytes must be set (a full command stream must refuse, not grow)")
    unlimited = [s for s, v in limits.items() if not v]
    if unlimited:
        errors.append(f"{where}: nats.{'/'.join(unlimited)}_max_bytes unlimited: set every stream's limit")
    total = sum(limits.values())
    if account_max_file is not None and total > account_max_file:
        errors.append(f"{where}: the streams' max_bytes add up to {total} > the account's max_file {account_max_file}")
    if server_max_file is not None and (account_max_file or total) > server_max_file:
        errors.append(f"{where}: {account_max_file or total} bytes for the account > the server's max_file_store {server_max_file}")
    return errors

def check_compose():
    path = ROOT / "compose/compose.yaml"
    cj = tool("check-jsonschema")
    if cj:
        r = run([cj, "--builtin-schema", "vendor.compose-spec", str(path)])
        check("compose/compose.yaml: compose-spec schema (check-jsonschema)", [] if r.returncode == 0 else [r.stdout + r.stderr])
    else:
        fail("compose/compose.yaml: check-jsonschema is not available")
    for team in sorted((ROOT / "compose/teams").glob("*/compose.yaml")):
        if cj:
            r = run([cj, "--builtin-schema", "vendor.compose-spec", str(team)])
            check(f"{rel(team)}: compose-spec schema (check-jsonschema)", [] if r.returncode == 0 else [r.stdout + r.stderr])
    doc = yaml.safe_load(path.read_text())
    services = doc.get("services", {})
    stages = dockerfile_stages()
    nats_env = services.get("nats", {}).get("environment", {})
    errors = []
    for infra in ("nats", "redis", "jaeger", "prometheus", "grafana", "setup"):
        if infra not in services:
            errors.append(f"no service `{infra}`")
    for name, svc in services.items():
        for dep, cond in (svc.get("depends_on") or {}).items():
            if dep not in services:
                errors.append(f"{name}: depends_on unknown service {dep}")
            elif cond.get("condition") == "service_healthy" and "healthcheck" not in services[dep]:
                errors.append(f"{name}: waits for {dep} to be healthy, but {dep} has no healthcheck")
        for vol in svc.get("volumes") or []:
            src = vol.split(":")[0] if isinstance(vol, str) else vol.get("source", "")
            if src.startswith(".") and not (path.parent / src).exists():
                errors.append(f"{name}: mounts {src}, which does not exist")
        env = svc.get("environment") or {}
        for key in env:
            if SCHEMA is not None:
                errors += [f"{name}: {e}" for e in env_key_errors(key)]
    # the shelfsync services
    for name in ["setup", *SERVICES]:
        svc = services.get(name)
        if not svc:
            errors.append(f"no service `{name}`")
            continue
        env = svc.get("environment") or {}
        build = svc.get("build") or {}
        target = "cli" if name == "setup" else name
        if build.get("dockerfile") != "Dockerfile" or build.get("target") != target or target not in stages:
            errors.append(f"{name}: must build ../Dockerfile target `{target}`")
        for k in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME", "SHELFSYNC__NATS__URL",
                  "SHELFSYNC__NATS__USER", "SHELFSYNC__NATS__PASSWORD", "SHELFSYNC_CONFIG"):
            if k not in env:
                errors.append(f"{name}: {k} is not set")
        # Its settings files: the ones it reads, mounted read-only where SHELFSYNC_CONFIG says.
        mounts = {}
        for vol in svc.get("volumes") or []:
            if isinstance(vol, str) and vol.count(":") >= 1:
                src, dst = vol.split(":")[:2]
                mounts[dst] = src
        want = [f"/etc/shelfsync/{f}" for f in COMPOSE_CONFIG.get(name, [])]
        have = str(env.get("SHELFSYNC_CONFIG", "")).split(":")
        if have != want:
            errors.append(f"{name}: SHELFSYNC_CONFIG must be {':'.join(want)} (got {':'.join(have)})")
        for dst in want:
            if mounts.get(dst) != f"./config/{dst.rsplit('/', 1)[1]}":
                errors.append(f"{name}: {dst} is not mounted from ./config")
        for dst in mounts:
            if dst.startswith("/etc/shelfsync/") and dst not in want:
                errors.append(f"{name}: mounts {dst}, which it does not read")
        if "SHELFSYNC__STORAGE__REPLICAS" in env:
            errors.append(f"{name}: SHELFSYNC__STORAGE__REPLICAS belongs in config/storage.toml")
        if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") != "http://jaeger:4317":
            errors.append(f"{name}: OTEL_EXPORTER_OTLP_ENDPOINT must be http://jaeger:4317")
        user = env.get("SHELFSYNC__NATS__USER")
        pw_var = f"NATS_{str(user).upper()}_PASSWORD"
        if pw_var not in nats_env:
            errors.append(f"{name}: NATS user {user} has no password in the nats service")
        elif env.get("SHELFSYNC__NATS__PASSWORD") != nats_env[pw_var]:
            errors.append(f"{name}: SHELFSYNC__NATS__PASSWORD ({env.get('SHELFSYNC__NATS__PASSWORD')}) differs from the server's {pw_var} ({nats_env[pw_var]})")
        if env.get("SHELFSYNC__NATS__INBOX_PREFIX") != f"_INBOX_{user}":
            errors.append(f"{name}: SHELFSYNC__NATS__INBOX_PREFIX must be _INBOX_{user} (the only inboxes its NATS user may read)")
        if name == "setup":
            if user != "admin" or svc.get("restart") != "no":
                errors.append("setup: one-shot (restart: \"no\") as NATS user admin")
            continue
        binary, port, listen, nats_user = SERVICES[name]
        if user != nats_user:
            errors.append(f"{name}: NATS user must be {nats_user}")
        if env.get(listen) != f"0.0.0.0:{port}":
            errors.append(f"{name}: {listen} must be 0.0.0.0:{port}")
        hc = (svc.get("healthcheck") or {}).get("test", [])
        if hc[:3] != ["CMD", "shelfsync-healthcheck", str(port)]:
            errors.append(f"{name}: healthcheck must run shelfsync-healthcheck {port}")
        deps = svc.get("depends_on") or {}
        if deps.get("setup", {}).get("condition") != "service_completed_successfully":
            errors.append(f"{name}: must wait for setup to complete")
        if svc.get("read_only") is not True or "ALL" not in (svc.get("cap_drop") or []):
            errors.append(f"{name}: read_only root and cap_drop ALL")
    check("compose/compose.yaml: services, builds, healthchecks, depends_on, env, config files, NATS users", errors)
    check_compose_durability(doc)
    check_compose_push_tokens(doc)

    # Prometheus scrapes every service on its HTTP port
    prom = yaml.safe_load((ROOT / "compose/prometheus/prometheus.yml").read_text())
    targets = {t for job in prom.get("scrape_configs", []) for sc in job.get("static_configs", [])
               for t in sc.get("targets", [])}
    jobs = {job["job_name"] for job in prom.get("scrape_configs", [])}
    errors = [f"no scrape target {n}:{p}" for n, (_, p, _, _) in SERVICES.items() if f"{n}:{p}" not in targets]
    errors += [f"no scrape job shelfsync-{n} (the alerts expect that name)" for n in SERVICES if f"shelfsync-{n}" not in jobs]
    for job, target in (("nats", "nats-exporter:7777"), ("redis", "redis-exporter:9121")):
        if job not in jobs or target not in targets:
            errors.append(f"no scrape job {job} of {target} (the JetStream and Redis memory alerts)")
    exporter = [str(c) for c in services.get("nats-exporter", {}).get("command", [])]
    if "-prefix=nats" not in exporter or "-jsz=all" not in exporter:
        errors.append("nats-exporter: -prefix=nats -jsz=all (the metric names of the Helm chart's exporter)")
    check("compose/prometheus/prometheus.yml: every service scraped", errors)
    ds = yaml.safe_load((ROOT / "compose/grafana/provisioning/datasources/datasources.yaml").read_text())
    dash = yaml.safe_load((ROOT / "compose/grafana/provisioning/dashboards/dashboards.yaml").read_text())
    errors = []
    if not any(d.get("type") == "prometheus" and d.get("url") == "http://prometheus:9090" for d in ds.get("datasources", [])):
        errors.append("no Prometheus datasource at http://prometheus:9090")
    paths = [p["options"]["path"] for p in dash.get("providers", [])]
    mounted = [v.split(":")[1] for v in services["grafana"].get("volumes", []) if isinstance(v, str)]
    if not any(m.startswith(p) for p in paths for m in mounted):
        errors.append("the dashboard provider path is not where the dashboard is mounted")
    check("compose/grafana: provisioned datasource and dashboard", errors)




def flag(command, name):
    """The value after `--name` in a command list."""
    if f"--{name}" in command:
        i = command.index(f"--{name}")
        return str(command[i + 1]) if i + 1 < len(command) else None
    return None


def check_compose_durability(doc):
    """One node of each: NATS fsyncs before acking, Redis fsyncs its AOF at every write, takes no
    RDB snapshots besides, and has a maxmemory well under the container's memory limit, never
    evicting."""
    services = doc.get("services", {})
    errors = []
    image = services.get("nats", {}).get("image", "")
    if image != f"nats:{NATS_VERSION}-alpine":
        errors.append(f"nats: image {image}, expected nats:{NATS_VERSION}-alpine (the version everything is tested with)")
    redis = services.get("redis", {})
    cmd = [str(c) for c in redis.get("command", [])]
    if "/data" not in " ".join(redis.get("volumes", [])):
        errors.append("redis: its data on a volume")
    for key, want in (("appendonly", "yes"), ("appendfsync", "always"), ("maxmemory-policy", "noeviction")):
        if flag(cmd, key) != want:
            errors.append(f"redis: --{key} {want} (got {flag(cmd, key)})")
    if flag(cmd, "save") != "":
        errors.append(f'redis: --save "" (no RDB snapshots on top of the fsynced AOF; got {flag(cmd, "save")})')
    maxmemory, limit = flag(cmd, "maxmemory"), redis.get("mem_limit")
    if not maxmemory or not limit:
        errors.append("redis: --maxmemory and mem_limit must both be set")
    elif redis_size(maxmemory) > 0.75 * docker_size(limit):
        errors.append(f"redis: maxmemory {maxmemory} leaves too little of mem_limit {limit} for an AOF rewrite's fork (at most 75%)")
    env = {**{k: "x" for k in ("NATS_ADMIN_PASSWORD", "NATS_INGEST_PASSWORD", "NATS_STORAGE_PASSWORD",
                                "NATS_VALIDATOR_PASSWORD", "NATS_AGGREGATOR_PASSWORD",
                                "NATS_RECOMMENDER_PASSWORD", "NATS_SYS_PASSWORD")}}
    try:
        conf = NatsConf((ROOT / "compose/nats/nats.conf").read_text(), env).parse()
    except Exception as e:  # noqa: BLE001
        fail("compose: durability", f"compose/nats/nats.conf: {e}")
        return
    js = conf.get("jetstream", {})
    if js.get("sync_interval") != "always":
        errors.append("compose/nats/nats.conf: jetstream.sync_interval must be `always` (one server: no replica covers a host crash)")
    account = conf.get("accounts", {}).get("SHELFSYNC", {}).get("jetstream", {})
    try:
        common = toml_file(ROOT / "compose/config/shelfsync.toml")
        errors += stream_limit_errors(common, nats_size(account["max_file"]) if "max_file" in account else None,
                                      nats_size(js["max_file_store"]) if "max_file_store" in js else None,
                                      "compose")
        if not account.get("max_file"):
            errors.append("compose/nats/nats.conf: the SHELFSYNC account needs jetstream.max_file")
        if int(common.get("nats", {}).get("stream_replicas", 1)) != 1:
            errors.append("compose: one NATS server, nats.stream_replicas = 1")
    except Exception as e:  # noqa: BLE001
        errors.append(f"stream limits: {e}")
    check("compose: durability (NATS sync always, Redis AOF always + maxmemory, stream limits fit JetStream's)", errors)


def check_compose_push_tokens(doc):
    """Every partner's push_tokens_file is a secret mounted into ingest, and nowhere else."""
    services = doc.get("services", {})
    secrets = doc.get("secrets", {}) or {}
    errors = []
    ingest = services.get("ingest", {})
    mounted = {(s if isinstance(s, str) else s.get("source")): (s if isinstance(s, str) else s.get("target", s.get("source")))
               for s in ingest.get("secrets", []) or []}
    ingest_toml = ROOT / "compose/config/ingest.toml"
    if not ingest_toml.exists():
        fail("compose: push tokens", "compose/config/ingest.toml (the partners) does not exist")
        return
    partners = toml_file(ingest_toml).get("partners", [])
    for p in partners:
        path = p.get("push_tokens_file", "")
        name = path.rsplit("/", 1)[-1]
        if not path.startswith("/run/secrets/") or name not in mounted.values():
            errors.append(f"partner {p['name']}: push_tokens_file {path or '(unset)'} is not a secret mounted into ingest")
            continue
        source = next(k for k, v in mounted.items() if v == name)
        spec = secrets.get(source, {})
        default = str(spec.get("file", "")).split(":-")[-1].rstrip("}")
        if not default or not (ROOT / "compose" / default).is_file():
            errors.append(f"secret {source}: its default file {default or '?'} does not exist")
        elif "DEV ONLY" not in (ROOT / "compose" / default).read_text():
            errors.append(f"secret {source}: the committed default file must say it is DEV ONLY")
    readers = {"storage", "aggregator", "recommender"}
    for name, svc in services.items():
        names = {(s if isinstance(s, str) else s.get("source")) for s in svc.get("secrets", []) or []}
        push = {n for n in names if n.endswith("-push")}
        if name != "ingest" and push:
            errors.append(f"{name}: mounts push tokens {sorted(push)}; only ingest reads them")
        if name in readers:
            env = svc.get("environment", {}) or {}
            key = f"SHELFSYNC__{name.upper()}__READ_TOKENS_FILE"
            if "read-api" not in names or env.get(key) != "/run/secrets/read-api":
                errors.append(f"{name}: its read API's tokens: the secret read-api and {key}=/run/secrets/read-api")
        elif "read-api" in names:
            errors.append(f"{name}: mounts the read API tokens, which only storage, aggregator and recommender check")
    spec = secrets.get("read-api", {})
    default = str(spec.get("file", "")).split(":-")[-1].rstrip("}")
    if not default or not (ROOT / "compose" / default).is_file() or "DEV ONLY" not in (ROOT / "compose" / default).read_text():
        errors.append("secret read-api: a committed default file that says it is DEV ONLY")
    check("compose: push tokens are secret files mounted into ingest only, read API tokens into the read APIs "
          "(dev defaults marked)", errors)

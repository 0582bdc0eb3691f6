"""Alert rules and the dashboard: promtool, metric names against the code, runbook sections."""
import json
import re

import yaml

from .core import PROMTOOL, ROOT, TMP, check, fail, note, rel, run, skip

# Where runbook_url points: a placeholder base URL that a platform replaces with where it serves
# these docs (docs/OPERATE.md, "Alerts"); the part after `#` is a section of docs/OPERATE.md.
RUNBOOK_BASE = "https://shelfsync.example/docs/OPERATE.md"
# Metrics the alerts use that the code is about to export (being written now): a NOTE, not a
# failure, until shared/telemetry defines them.
PENDING_METRICS = set()
# Metrics of the exporters the alerts and the dashboard may use (names as scraped, with the
# prefixes compose/ and the NATS Helm chart give them). prometheus-nats-exporter 0.16.0 with
# -prefix=nats -jsz=all (collector/jsz.go: nats_server_*, nats_stream_*, nats_consumer_*, labels
# account, stream_name, consumer_name, is_consumer_leader, ...); redis_exporter.
EXTERNAL_METRICS = {
    "nats_server_total_message_bytes", "nats_server_max_storage",
    "nats_consumer_num_pending", "nats_consumer_num_ack_pending", "nats_consumer_num_redelivered",
    "nats_consumer_num_waiting", "nats_consumer_delivered_consumer_seq", "nats_consumer_delivered_stream_seq",
    "nats_consumer_ack_floor_consumer_seq", "nats_consumer_ack_floor_stream_seq",
    "redis_memory_used_bytes", "redis_memory_max_bytes",
}
RULE_TESTS = ROOT / "k8s/base/monitoring/shelfsync-alerts.test.yaml"


def github_anchor(heading):
    """The anchor GitHub gives a Markdown heading."""
    a = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return a.replace(" ", "-")

def known_metrics():
    f = ROOT / "shared/telemetry/src/metrics.rs"
    names = set(re.findall(r'"(shelfsync_[a-z0-9_]+)"', f.read_text())) if f.exists() else set()
    return names or {
        "shelfsync_commands_applied_total", "shelfsync_commands_unchanged_total", "shelfsync_changes_emitted_total",
        "shelfsync_cas_conflicts_total", "shelfsync_rejects_total", "shelfsync_batch_seconds",
        "shelfsync_freshness_seconds", "shelfsync_consumer_lag", "shelfsync_outbox_depth",
        "shelfsync_keyframe_seconds", "shelfsync_ingest_items_total", "shelfsync_ingest_bytes_total",
        "shelfsync_feed_drift_repairs_total"}


def used_metrics(text):
    out = set()
    for m in re.findall(r"\bshelfsync_[a-z0-9_]+", text):
        out.add(re.sub(r"_(bucket|sum|count)$", "", m))
    return out


def used_external_metrics(text):
    """nats_* and redis_* metric names a query uses (not label values such as redis_exporter:
    a name followed by `{`, `[`, `)`, whitespace or an operator)."""
    return set(re.findall(r"\b((?:nats|redis)_[a-z0-9_]*[a-z0-9])\b(?=\s*[{\[)/*+\-<>=!,]|\s*$)", text, re.M))


def check_monitoring():
    alerts_path = ROOT / "k8s/base/monitoring/shelfsync-alerts.yaml"
    dash_path = ROOT / "k8s/base/monitoring/shelfsync-dashboard.json"
    known = known_metrics()
    if PROMTOOL:
        r = run([PROMTOOL, "check", "rules", str(alerts_path)])
        check(f"{rel(alerts_path)}: promtool check rules", [] if r.returncode == 0 else [r.stdout + r.stderr])
        r = run([PROMTOOL, "test", "rules", str(RULE_TESTS)], cwd=RULE_TESTS.parent)
        check(f"{rel(RULE_TESTS)}: promtool test rules", [] if r.returncode == 0 else [r.stdout + r.stderr])
        prom = (ROOT / "compose/prometheus/prometheus.yml").read_text().replace(
            "/etc/prometheus/rules/*.yaml", str(alerts_path))
        (TMP / "prometheus.yml").write_text(prom)
        r = run([PROMTOOL, "check", "config", "--syntax-only", str(TMP / "prometheus.yml")])
        if r.returncode != 0 and "unknown long flag" in r.stderr:
            r = run([PROMTOOL, "check", "config", str(TMP / "prometheus.yml")])
        check("compose/prometheus/prometheus.yml: promtool check config", [] if r.returncode == 0 else [r.stdout + r.stderr])
    else:
        skip("promtool checks", "promtool not installed (apt-get install prometheus)")
    rules = yaml.safe_load(alerts_path.read_text())
    text = alerts_path.read_text()
    unknown = used_metrics(text) - known
    errors = [f"unknown metric {m}" for m in sorted(unknown - PENDING_METRICS)]
    exprs_text = "\n".join(r["expr"] for g in rules["groups"] for r in g["rules"])
    errors += [f"unknown exporter metric {m} (not in deploycheck's EXTERNAL_METRICS)"
               for m in sorted(used_external_metrics(exprs_text) - EXTERNAL_METRICS)]
    for m in sorted(unknown & PENDING_METRICS):
        note(f"NOTE  alerts use {m}, which the code does not export yet (pending: being added)")
    for m in sorted(PENDING_METRICS & known):
        note(f"NOTE  {m} is exported now: drop it from deploycheck's PENDING_METRICS")
    operate_path = ROOT / "docs/OPERATE.md"
    operate = operate_path.read_text() if operate_path.exists() else ""
    anchors = {github_anchor(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*$", operate, re.M)}
    for g in rules["groups"]:
        for r in g["rules"]:
            if "alert" not in r:
                continue
            if r.get("labels", {}).get("severity") not in ("critical", "warning", "info"):
                errors.append(f"{r['alert']}: severity label")
            if f"### {r['alert'].lower()}" not in operate.lower():
                errors.append(f"{r['alert']}: no `### {r['alert']}` section in docs/OPERATE.md")
            url = r.get("annotations", {}).get("runbook_url", "")
            if not url.startswith(RUNBOOK_BASE + "#") or url.split("#", 1)[1] not in anchors:
                errors.append(f"{r['alert']}: runbook_url must be {RUNBOOK_BASE}#<a section of docs/OPERATE.md> (got {url or 'none'})")
            if "runbook" in r.get("annotations", {}):
                errors.append(f"{r['alert']}: the annotation is runbook_url")
    check(f"{rel(alerts_path)}: metric names, severities, runbook_url to a section of docs/OPERATE.md", errors)
    from .rules import PROMETHEUS_RULE, prometheus_rule
    want = prometheus_rule(alerts_path.read_text())
    have = PROMETHEUS_RULE.read_text() if PROMETHEUS_RULE.exists() else ""
    check(f"{rel(PROMETHEUS_RULE)}: generated from the rule file, up to date",
          [] if have == want else ["differs: run `PYTHONPATH=scripts python3 -m deploycheck.rules`"])
    try:
        dash = json.loads(dash_path.read_text())
    except Exception as e:  # noqa: BLE001
        fail(f"{rel(dash_path)}: JSON", e)
        return
    errors = []
    exprs = []
    for p in dash.get("panels", []):
        if p.get("type") == "row":
            continue
        if p.get("datasource", {}).get("uid") != "${datasource}":
            errors.append(f"panel {p.get('title')}: datasource must be the ${{datasource}} variable")
        for t in p.get("targets", []):
            if not t.get("expr"):
                errors.append(f"panel {p.get('title')}: empty query")
            exprs.append(t.get("expr", ""))
    errors += [f"unknown metric {m}" for m in sorted(used_metrics("\n".join(exprs)) - known)]
    errors += [f"unknown exporter metric {m} (not in deploycheck's EXTERNAL_METRICS)"
               for m in sorted(used_external_metrics("\n".join(exprs)) - EXTERNAL_METRICS)]
    wanted = ["shelfsync_commands_applied_total", "shelfsync_changes_emitted_total", "shelfsync_commands_unchanged_total",
              "shelfsync_freshness_seconds", "shelfsync_consumer_lag", "shelfsync_cas_conflicts_total",
              "shelfsync_rejects_total", "shelfsync_outbox_depth", "shelfsync_keyframe_seconds"]
    errors += [f"no panel uses {m}" for m in wanted if m not in used_metrics("\n".join(exprs))]
    if not any(v.get("type") == "datasource" and v.get("name") == "datasource" for v in dash.get("templating", {}).get("list", [])):
        errors.append("no `datasource` template variable")
    check(f"{rel(dash_path)}: panels, queries, metric names", errors)




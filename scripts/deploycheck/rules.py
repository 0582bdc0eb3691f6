"""The PrometheusRule of k8s/components/prometheus-operator, generated from the plain rule file
k8s/base/monitoring/shelfsync-alerts.yaml (the one source of the rules).

    PYTHONPATH=scripts python3 -m deploycheck.rules    # rewrites the PrometheusRule
"""
import sys

import yaml

from .core import ROOT

RULE_FILE = ROOT / "k8s/base/monitoring/shelfsync-alerts.yaml"
PROMETHEUS_RULE = ROOT / "k8s/components/prometheus-operator/prometheusrule.yaml"
HEADER = """\
# GENERATED from k8s/base/monitoring/shelfsync-alerts.yaml by
# `PYTHONPATH=scripts python3 -m deploycheck.rules`: edit that file, then run this again
# (scripts/validate-deploy.sh fails when the two differ). The label `role: alert-rules` is for
# your Prometheus's ruleSelector; add the one your Prometheus selects on if it differs.
"""


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (PromQL) as literal blocks, as the rule file writes them."""


def _str(dumper, value):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def prometheus_rule(rule_file_text):
    rules = yaml.safe_load(rule_file_text)
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "shelfsync", "labels": {"role": "alert-rules"}},
        "spec": {"groups": rules["groups"]},
    }
    return HEADER + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100)


def main():
    PROMETHEUS_RULE.parent.mkdir(parents=True, exist_ok=True)
    PROMETHEUS_RULE.write_text(prometheus_rule(RULE_FILE.read_text()))
    print(f"wrote {PROMETHEUS_RULE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

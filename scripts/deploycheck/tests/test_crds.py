"""Prometheus Operator objects are checked strictly against the operator's CRD schemas: the
objects k8s/ ships pass, and broken ones (an unknown field anywhere, a wrong type, a value outside
an enum, a missing required field, an unknown kind) fail with the field's path. All cases go
through one Node.js run (setUpClass), as validate-deploy's check does."""
import copy
import unittest

import yaml

from deploycheck import crds
from deploycheck.core import ROOT

MONITOR = {
    "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": {"name": "m"},
    "spec": {"selector": {"matchLabels": {"a": "b"}},
             "podMetricsEndpoints": [{"port": "http", "path": "/metrics",
                                      "relabelings": [{"targetLabel": "job", "replacement": "x"}]}]},
}
RULE = {
    "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule", "metadata": {"name": "r"},
    "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "up == 0", "for": "5m",
                                                  "labels": {"severity": "warning"},
                                                  "annotations": {"runbook_url": "https://x"}}]}]},
}
SERVICE_MONITOR = {
    "apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "s"},
    "spec": {"selector": {"matchLabels": {"a": "b"}},
             "endpoints": [{"port": "web", "interval": "30s",
                            "tlsConfig": {"ca": {"secret": {"name": "ca", "key": "ca.crt"}}}}]},
}
COMPONENT = ROOT / "k8s/components/prometheus-operator"


def shipped():
    """The monitoring objects of k8s/components/prometheus-operator, as written."""
    docs = []
    for f in ("podmonitors.yaml", "prometheusrule.yaml"):
        docs += [d for d in yaml.safe_load_all((COMPONENT / f).read_text()) if d]
    return docs


def broken(doc, edit):
    out = copy.deepcopy(doc)
    edit(out)
    return out


def _set(path, value):
    """An edit setting doc[path...] = value."""
    def edit(doc):
        node = doc
        for p in path[:-1]:
            node = node[p]
        node[path[-1]] = value
    return edit


def _delete(path):
    def edit(doc):
        node = doc
        for p in path[:-1]:
            node = node[p]
        del node[path[-1]]
    return edit


SHIPPED = shipped()
NATS_MONITOR = next(d for d in SHIPPED if d["metadata"]["name"] == "shelfsync-nats")
CASES = {
    "monitor": MONITOR,
    "rule": RULE,
    "service_monitor": SERVICE_MONITOR,
    "unknown_field": {**MONITOR, "spec": {**MONITOR["spec"], "podMetricsEndpoints": [{"port": "http", "scrapeEvery": "5s"}]}},
    "wrong_type": {**RULE, "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "x", "for": 5}]}]}},
    # Broken copies of what k8s/ ships.
    "two_typos_deep": broken(broken(NATS_MONITOR, _set(["spec", "podMetricsEndpoints", 0, "relabelings", 0, "replacment"], "nats")),
                             _set(["metadata", "lables"], {"a": "b"})),
    "bad_enum": broken(NATS_MONITOR, _set(["spec", "podMetricsEndpoints", 0, "scheme"], "gopher")),
    "wrong_type_in_shipped_rule": broken(next(d for d in SHIPPED if d["kind"] == "PrometheusRule"),
                                         _set(["spec", "groups", 1, "rules", 0, "labels"], ["severity"])),
    "missing_required": broken(RULE, _delete(["spec", "groups", 0, "name"])),
    "service_monitor_unknown_nested": broken(SERVICE_MONITOR, _set(["spec", "endpoints", 0, "tlsConfig", "ca", "secret", "optinal"], True)),
    "unknown_kind": {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitoring", "metadata": {"name": "x"}, "spec": {}},
    "unknown_version": {**MONITOR, "apiVersion": "monitoring.coreos.com/v2"},
}


@unittest.skipUnless(crds.available(), f"CRD check unavailable: {crds.unavailable()}")
class CrdsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        names = list(CASES)
        found = crds.errors([CASES[n] for n in names] + SHIPPED)
        cls.errors = dict(zip(names, found))
        cls.shipped_errors = found[len(names):]

    def test_valid_objects_pass(self):
        self.assertEqual(self.errors["monitor"], [])
        self.assertEqual(self.errors["rule"], [])
        self.assertEqual(self.errors["service_monitor"], [])

    def test_the_shipped_objects_pass(self):
        self.assertEqual(len(SHIPPED), 5)
        self.assertEqual([e for found in self.shipped_errors for e in found], [])

    def test_an_unknown_field_is_an_error(self):
        errors = self.errors["unknown_field"]
        self.assertEqual(len(errors), 1, errors)
        self.assertIn("scrapeEvery", errors[0])

    def test_a_wrong_type_is_an_error(self):
        self.assertTrue(any("for" in e for e in self.errors["wrong_type"]), self.errors["wrong_type"])

    def test_every_unknown_field_is_reported_with_its_path(self):
        self.assertEqual(sorted(self.errors["two_typos_deep"]), [
            "PodMonitor shelfsync-nats: metadata.lables: unknown field (the CRD schema does not declare it)",
            "PodMonitor shelfsync-nats: spec.podMetricsEndpoints.0.relabelings.0.replacment: "
            "unknown field (the CRD schema does not declare it)",
        ])
        self.assertEqual(len(self.errors["service_monitor_unknown_nested"]), 1)
        self.assertIn("spec.endpoints.0.tlsConfig.ca.secret.optinal: unknown field",
                      self.errors["service_monitor_unknown_nested"][0])

    def test_values_outside_the_schema_are_errors(self):
        self.assertEqual(len(self.errors["bad_enum"]), 1, self.errors["bad_enum"])
        self.assertIn("spec.podMetricsEndpoints.0.scheme: must be equal to one of the allowed values", self.errors["bad_enum"][0])
        self.assertTrue(any("spec.groups.1.rules.0.labels: must be object" in e
                            for e in self.errors["wrong_type_in_shipped_rule"]), self.errors["wrong_type_in_shipped_rule"])
        self.assertTrue(any("spec.groups.0.name: must have required property" in e
                            for e in self.errors["missing_required"]), self.errors["missing_required"])

    def test_a_kind_without_a_crd_is_an_error(self):
        self.assertIn("no CRD schema for monitoring.coreos.com/v1 PodMonitoring", self.errors["unknown_kind"][0])
        self.assertIn("no CRD schema for monitoring.coreos.com/v2 PodMonitor", self.errors["unknown_version"][0])


if __name__ == "__main__":
    unittest.main()

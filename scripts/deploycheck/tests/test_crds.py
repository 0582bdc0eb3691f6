"""Prometheus Operator objects are checked strictly against the CRD schemas."""
import unittest

from deploycheck import crds

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


@unittest.skipUnless(crds.available(), "cloudcoil-models-prometheus-operator is not installed")
class CrdsTest(unittest.TestCase):
    def test_valid_objects_pass(self):
        self.assertEqual(crds.errors_of(MONITOR), [])
        self.assertEqual(crds.errors_of(RULE), [])

    def test_an_unknown_field_is_an_error(self):
        bad = {**MONITOR, "spec": {**MONITOR["spec"], "podMetricsEndpoints": [{"port": "http", "scrapeEvery": "5s"}]}}
        errors = crds.errors_of(bad)
        self.assertEqual(len(errors), 1, errors)
        self.assertIn("scrapeEvery", errors[0])

    def test_a_wrong_type_is_an_error(self):
        bad = {**RULE, "spec": {"groups": [{"name": "g", "rules": [{"alert": "A", "expr": "x", "for": 5}]}]}}
        self.assertTrue(any("for" in e for e in crds.errors_of(bad)), crds.errors_of(bad))


if __name__ == "__main__":
    unittest.main()

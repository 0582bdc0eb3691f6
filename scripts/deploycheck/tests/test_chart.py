"""The NATS chart's config is reproduced from the values, and chart keys are checked."""
import json
import unittest

from deploycheck.nats_checks import chart_conf, chart_key_errors


class ChartTest(unittest.TestCase):
    def test_rendered_config_carries_jetstream_cluster_and_merges(self):
        values = {"config": {
            "cluster": {"enabled": True, "replicas": 3},
            "jetstream": {"enabled": True, "fileStore": {"enabled": True, "maxSize": "10Gi"},
                          "memoryStore": {"enabled": True, "maxSize": "1Gi"},
                          "merge": {"sync_interval": "always"}},
            "merge": {"system_account": "SYS"}}}
        text, conf = chart_conf(values, "/data/jetstream", cluster=True)
        self.assertEqual(conf["jetstream"]["store_dir"], "/data/jetstream")
        self.assertEqual(conf["jetstream"]["sync_interval"], "always")
        self.assertEqual(len(conf["cluster"]["routes"]), 3)
        self.assertEqual(conf["system_account"], "SYS")
        # "<< X >>" values are written unquoted, as the chart does.
        self.assertIn('"max_file_store": 10Gi', text)
        self.assertNotIn("<<", text)
        json.dumps(conf)

    def test_typos_of_chart_keys_are_caught(self):
        self.assertEqual(chart_key_errors({"config": {"jetstream": {"fileStore": {"pvc": {"size": "1Gi"}}}}}), [])
        errors = chart_key_errors({"config": {"jetstream": {"fileStorage": {}}}})
        self.assertEqual(errors, ["config.jetstream.fileStorage: not a key of the NATS chart"])


if __name__ == "__main__":
    unittest.main()

"""The Kubernetes policy checks pass on the overlays as shipped and catch what they are for:
each test breaks one thing in a rendered overlay and expects the error naming it."""
import copy
import unittest

import yaml

from deploycheck import core
from deploycheck.k8s import k8s_policy, kustomize

RENDERED = {}


def rendered(overlay):
    if overlay not in RENDERED:
        RENDERED[overlay] = [d for d in yaml.safe_load_all(kustomize(overlay)) if d]
    return copy.deepcopy(RENDERED[overlay])


def find(docs, kind, name):
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"].startswith(name))


def container(workload, name):
    pod = workload["spec"]["template"]["spec"]
    return next(c for c in [*pod.get("initContainers", []), *pod["containers"]] if c["name"] == name)


@unittest.skipUnless(core.KUBECTL, "no kubectl")
class K8sPolicyTest(unittest.TestCase):
    def errors(self, docs, overlay="k8s/overlays/dev"):
        return "\n".join(k8s_policy(docs, overlay))

    def test_both_overlays_pass(self):
        for overlay in ("k8s/overlays/dev", "k8s/overlays/prod"):
            self.assertEqual(k8s_policy(rendered(overlay), overlay), [], overlay)

    def test_without_default_deny(self):
        docs = [d for d in rendered("k8s/overlays/dev") if d["metadata"]["name"] != "shelfsync-default-deny"]
        self.assertIn("no default-deny NetworkPolicy", self.errors(docs))

    def test_a_workload_that_cannot_reach_nats(self):
        docs = rendered("k8s/overlays/dev")
        np = find(docs, "NetworkPolicy", "shelfsync-to-nats-and-collector")
        np["spec"]["podSelector"]["matchExpressions"][0]["values"].remove("validator")
        self.assertIn("validator cannot reach NATS on 4222", self.errors(docs))

    def test_ingest_egress_to_private_ranges(self):
        docs = rendered("k8s/overlays/dev")
        np = find(docs, "NetworkPolicy", "shelfsync-ingest")
        np["spec"]["egress"][0]["to"][0]["ipBlock"]["except"] = []
        self.assertIn("must except the private and link-local ranges", self.errors(docs))

    def test_a_writable_root_file_system(self):
        docs = rendered("k8s/overlays/dev")
        container(find(docs, "StatefulSet", "shelfsync-storage"), "setup")["securityContext"]["readOnlyRootFilesystem"] = False
        self.assertIn("shelfsync-storage/setup: readOnlyRootFilesystem", self.errors(docs))

    def test_namespace_not_restricted(self):
        docs = rendered("k8s/overlays/prod")
        find(docs, "Namespace", "shelfsync")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] = "baseline"
        self.assertIn("enforces Pod Security `restricted`", self.errors(docs, "k8s/overlays/prod"))

    def test_storage_replicas_out_of_step(self):
        docs = rendered("k8s/overlays/prod")
        find(docs, "StatefulSet", "shelfsync-storage")["spec"]["replicas"] = 5
        self.assertIn("must equal the StatefulSet's spec.replicas (5)", self.errors(docs, "k8s/overlays/prod"))

    def test_a_consumer_that_mounts_storage_settings(self):
        docs = rendered("k8s/overlays/dev")
        rec = find(docs, "Deployment", "shelfsync-recommender")
        storage_cm = find(docs, "ConfigMap", "shelfsync-storage-config")["metadata"]["name"]
        vol = rec["spec"]["template"]["spec"]["volumes"][0]
        rec["spec"]["template"]["spec"]["volumes"][0] = {
            "name": vol["name"], "projected": {"sources": [{"configMap": vol["configMap"]},
                                                           {"configMap": {"name": storage_cm}}]}}
        self.assertIn("shelfsync-recommender/recommender: mounts ['shelfsync-config', 'shelfsync-storage-config']",
                      self.errors(docs))

    def test_a_setup_job_is_refused(self):
        docs = rendered("k8s/overlays/dev")
        job = {"apiVersion": "batch/v1", "kind": "Job",
               "metadata": {"name": "shelfsync-setup", "namespace": "shelfsync-dev"},
               "spec": {"template": {"metadata": {}, "spec": copy.deepcopy(
                   find(docs, "StatefulSet", "shelfsync-storage")["spec"]["template"]["spec"])}}}
        self.assertIn("a setup Job: its pod template is immutable", self.errors(docs + [job]))

    def test_push_tokens_through_a_subpath(self):
        docs = rendered("k8s/overlays/dev")
        ingest = container(find(docs, "Deployment", "shelfsync-ingest"), "ingest")
        mount = next(m for m in ingest["volumeMounts"] if m["name"] == "push-tokens")
        mount["subPath"] = "flowers"
        self.assertIn("without subPath", self.errors(docs))

    def test_push_tokens_mounted_elsewhere(self):
        docs = rendered("k8s/overlays/dev")
        pod = find(docs, "Deployment", "shelfsync-validator")["spec"]["template"]["spec"]
        pod["volumes"].append({"name": "t", "secret": {"secretName": "shelfsync-push-flowers"}})
        self.assertIn("only ingest reads push tokens", self.errors(docs))

    def test_redis_fsync_every_second(self):
        docs = rendered("k8s/overlays/prod")
        cm = find(docs, "ConfigMap", "shelfsync-redis-config")
        cm["data"]["redis.conf"] = cm["data"]["redis.conf"].replace("appendfsync always", "appendfsync everysec")
        self.assertIn("redis.conf: appendfsync always", self.errors(docs, "k8s/overlays/prod"))

    def test_redis_with_rdb_snapshots(self):
        docs = rendered("k8s/overlays/prod")
        cm = find(docs, "ConfigMap", "shelfsync-redis-config")
        cm["data"]["redis.conf"] = cm["data"]["redis.conf"].replace('save ""', "save 60 10000")
        self.assertIn('redis.conf: save ""', self.errors(docs, "k8s/overlays/prod"))

    def test_streams_larger_than_the_account(self):
        docs = rendered("k8s/overlays/dev")
        env = find(docs, "ConfigMap", "shelfsync-env")
        env["data"]["SHELFSYNC__NATS__CHANGES_MAX_BYTES"] = str(8 * 1024**3)
        self.assertIn("add up to", self.errors(docs))

    def test_prod_streams_need_three_replicas(self):
        docs = rendered("k8s/overlays/prod")
        del find(docs, "ConfigMap", "shelfsync-env")["data"]["SHELFSYNC__NATS__STREAM_REPLICAS"]
        self.assertIn("nats.stream_replicas must be 3", self.errors(docs, "k8s/overlays/prod"))

    def test_a_collector_pipeline_with_an_undefined_exporter(self):
        docs = rendered("k8s/overlays/dev")
        cm = find(docs, "ConfigMap", "shelfsync-otel-collector")
        conf = yaml.safe_load(cm["data"]["config.yaml"])
        conf["service"]["pipelines"]["traces"]["exporters"] = ["otlp/elsewhere"]
        cm["data"]["config.yaml"] = yaml.safe_dump(conf)
        self.assertIn("uses exporter otlp/elsewhere, which is not defined", self.errors(docs))


if __name__ == "__main__":
    unittest.main()

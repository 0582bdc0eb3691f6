"""Sizes are read with each tool's own units (measured against nats-server 2.14.6 for NATS)."""
import unittest

from deploycheck.sizes import docker_size, k8s_quantity, nats_size, redis_size


class SizesTest(unittest.TestCase):
    def test_nats_units(self):
        # What nats-server reports as max_storage for each spelling.
        self.assertEqual(nats_size("20GB"), 21474836480)
        self.assertEqual(nats_size("20GiB"), 21474836480)
        self.assertEqual(nats_size("20G"), 20000000000)
        self.assertEqual(nats_size("10Gi"), 10737418240)
        self.assertEqual(nats_size("256Mi"), 268435456)
        self.assertEqual(nats_size(4096), 4096)

    def test_kubernetes_redis_and_compose_units(self):
        self.assertEqual(k8s_quantity("2Gi"), 2 * 1024**3)
        self.assertEqual(k8s_quantity("512M"), 512 * 1000**2)
        self.assertEqual(redis_size("1200mb"), 1200 * 1024**2)
        self.assertEqual(redis_size("1200m"), 1200 * 1000**2)
        self.assertEqual(docker_size("2g"), 2 * 1024**3)
        with self.assertRaises(ValueError):
            k8s_quantity("2GiB")


if __name__ == "__main__":
    unittest.main()

"""The compose checks: stream limits against JetStream's, durability flags."""
import contextlib
import io
import unittest

import yaml

from deploycheck import core
from deploycheck.compose import check_compose_durability, flag, stream_limit_errors


def limits(**kw):
    nats = {f"{s}_max_bytes": kw.get(s, 1) for s in ("cmd", "changes", "keyframes", "aggregates", "rejects")}
    return {"nats": nats}


class StreamLimitsTest(unittest.TestCase):
    def test_limits_that_fit(self):
        self.assertEqual(stream_limit_errors(limits(), 10, 20, "x"), [])

    def test_an_unlimited_command_stream(self):
        errors = stream_limit_errors(limits(cmd=0), 10, 20, "x")
        self.assertTrue(any("cmd_max_bytes must be set" in e for e in errors), errors)

    def test_more_than_the_account_or_the_server(self):
        self.assertTrue(any("account" in e for e in stream_limit_errors(limits(changes=100), 10, 200, "x")))
        self.assertTrue(any("max_file_store" in e for e in stream_limit_errors(limits(), 30, 20, "x")))


class DurabilityTest(unittest.TestCase):
    def run_check(self, doc):
        before = len(core.FAILS)
        with contextlib.redirect_stdout(io.StringIO()):
            check_compose_durability(doc)
        return core.FAILS[before:]

    def test_the_shipped_compose_file_passes(self):
        doc = yaml.safe_load((core.ROOT / "compose/compose.yaml").read_text())
        self.assertEqual(self.run_check(doc), [])

    def test_redis_without_fsync_always_or_with_maxmemory_near_its_limit(self):
        doc = yaml.safe_load((core.ROOT / "compose/compose.yaml").read_text())
        cmd = doc["services"]["redis"]["command"]
        cmd[cmd.index("--appendfsync") + 1] = "everysec"
        self.assertEqual(len(self.run_check(doc)), 1)
        self.assertEqual(flag(cmd, "appendfsync"), "everysec")
        doc = yaml.safe_load((core.ROOT / "compose/compose.yaml").read_text())
        doc["services"]["redis"]["mem_limit"] = "1300m"
        self.assertEqual(len(self.run_check(doc)), 1)
        core.FAILS.clear()

    def test_redis_with_rdb_snapshots(self):
        doc = yaml.safe_load((core.ROOT / "compose/compose.yaml").read_text())
        cmd = doc["services"]["redis"]["command"]
        self.assertEqual(flag(cmd, "save"), "")
        cmd[cmd.index("--save") + 1] = "60 10000"
        self.assertEqual(len(self.run_check(doc)), 1)
        del cmd[cmd.index("--save"):cmd.index("--save") + 2]
        self.assertEqual(len(self.run_check(doc)), 1, "Redis' default save points")
        core.FAILS.clear()


if __name__ == "__main__":
    unittest.main()

"""The NATS config parser reads what the deployment files write."""
import unittest

from deploycheck.natsconf import NatsConf, norm_permissions

CONF = """
# comment
listen: 0.0.0.0:4222
jetstream { store_dir: /data, max_file_store: 20GB }
RO = { publish: { allow: ["a.>", 'b.*'] }, subscribe: "_INBOX.>" }
accounts {
  APP: {
    jetstream: { max_file: 10GB }
    users: [ { user: app, password: $APP_PW, permissions: $RO } ]
  }
}
system_account: SYS
debug = true
n: 42
"""


class NatsConfTest(unittest.TestCase):
    def test_maps_arrays_variables_and_scalars(self):
        conf = NatsConf(CONF, {"APP_PW": "secret"}).parse()
        self.assertEqual(conf["listen"], "0.0.0.0:4222")
        self.assertEqual(conf["jetstream"], {"store_dir": "/data", "max_file_store": "20GB"})
        user = conf["accounts"]["APP"]["users"][0]
        self.assertEqual(user["password"], "secret")
        self.assertEqual(user["permissions"]["publish"]["allow"], ["a.>", "b.*"])
        self.assertIs(conf["debug"], True)
        self.assertEqual(conf["n"], 42)
        self.assertEqual(conf["system_account"], "SYS")

    def test_an_undefined_variable_is_an_error(self):
        with self.assertRaisesRegex(ValueError, r"\$APP_PW is not defined"):
            NatsConf(CONF, {}).parse()

    def test_permissions_are_normalised_for_comparison(self):
        conf = NatsConf(CONF, {"APP_PW": "x"}).parse()
        perms = norm_permissions(conf["accounts"]["APP"]["users"])
        self.assertEqual(perms["app"]["publish"], {"allow": ["a.>", "b.*"], "deny": []})
        self.assertEqual(perms["app"]["subscribe"], {"allow": ["_INBOX.>"], "deny": []})
        self.assertIs(perms["app"]["allow_responses"], False)


if __name__ == "__main__":
    unittest.main()

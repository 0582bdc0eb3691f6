"""The settings shape is read from shared/settings, and files and variables are checked
against it."""
import unittest

from deploycheck.settings_schema import SCHEMA, env_key_errors, toml_key_errors


class SettingsSchemaTest(unittest.TestCase):
    def test_the_schema_is_read_from_the_source(self):
        self.assertIsNotNone(SCHEMA)
        self.assertIn("nats", SCHEMA["Settings"])
        self.assertIn("prefix", SCHEMA["NatsSettings"])
        self.assertIn("partitions", SCHEMA["StorageSettings"])
        self.assertEqual(SCHEMA["Settings"]["partners"], "Vec<PartnerSettings>")

    def test_unknown_keys_are_reported_with_their_path(self):
        errors = toml_key_errors({"nats": {"prefix": "x", "prefx": "y"},
                                  "partners": [{"name": "a", "bogus": 1}]})
        self.assertEqual(len(errors), 2, errors)
        self.assertTrue(errors[0].startswith("nats.prefx: not a setting"), errors)
        self.assertTrue(errors[1].startswith("partners[0].bogus: not a setting"), errors)
        self.assertEqual(toml_key_errors({"storage": {"partitions": 8}}), [])

    def test_environment_keys_must_name_a_setting(self):
        self.assertEqual(env_key_errors("SHELFSYNC__NATS__URL"), [])
        self.assertEqual(env_key_errors("OTEL_SERVICE_NAME"), [])
        self.assertEqual(len(env_key_errors("SHELFSYNC__NATS__URLS")), 1)
        self.assertEqual(len(env_key_errors("SHELFSYNC__NOPE__X")), 1)


if __name__ == "__main__":
    unittest.main()

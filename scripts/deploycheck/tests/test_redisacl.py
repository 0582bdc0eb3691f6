import unittest
from unittest import mock

from deploycheck import redisacl


class RedisAclTest(unittest.TestCase):
    def test_the_shipped_files_agree(self):
        self.assertEqual(redisacl.config_errors(), [])

    def test_comments_are_not_rules(self):
        self.assertEqual(redisacl.rules("# a\n\nuser x on\n  \n# b\n"), ["user x on"])

    def test_a_k8s_acl_that_differs_is_found(self):
        data = dict(redisacl.k8s_redis_config())
        data["users.acl"] = data["users.acl"].replace("+xlen", "+xlen +xadd")
        with mock.patch.object(redisacl, "k8s_redis_config", return_value=data):
            self.assertIn("the ACL users of compose/redis/users.acl and k8s/base/redis.yaml (users.acl) differ",
                          redisacl.config_errors())

    def test_a_user_with_every_command_is_refused(self):
        acl = (redisacl.ROOT / "compose/redis/users.acl").read_text().replace("+ping +select +xlen", "+@all")
        data = dict(redisacl.k8s_redis_config(), **{"users.acl": acl})
        real = redisacl.ROOT / "compose/redis/users.acl"
        with mock.patch.object(redisacl, "k8s_redis_config", return_value=data), \
                mock.patch.object(type(real), "read_text", lambda p, *a, **k: acl if p.name == "users.acl"
                                  else open(p).read()):
            self.assertIn("users.acl: user cli has +@all/allcommands/nopass", redisacl.config_errors())


if __name__ == "__main__":
    unittest.main()

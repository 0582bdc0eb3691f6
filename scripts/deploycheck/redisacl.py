"""Redis ACL users: compose/redis/users.acl and the one in k8s/base/redis.yaml agree (and so do
the start scripts that render them), each service connects as its own user, and every user's
allowed and refused commands and keys are probed against a real redis-server started with the
shipped ACL (through the shipped start script)."""
import os
import pathlib
import socket
import subprocess
import time

import yaml

from .core import ROOT, TMP, check, fail, free_port, skip, stop, tool, wait_for_port

ACL_USERS = ["storage", "ingest", "aggregator", "cli", "reader", "exporter"]
NS = "ss"  # redis.namespace the key patterns are written for


def acl_env():
    return {f"REDIS_{u.upper()}_PASSWORD": f"validate-redis-{u}-pw" for u in ACL_USERS}


def rules(text):
    """The ACL lines of a users.acl (comments and blank lines are not Redis's)."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def code(text):
    """A shell script without its comments."""
    return [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def k8s_redis_config():
    for doc in yaml.safe_load_all((ROOT / "k8s/base/redis.yaml").read_text()):
        if doc and doc.get("kind") == "ConfigMap" and doc["metadata"]["name"] == "shelfsync-redis-config":
            return doc.get("data", {})
    return {}


class Resp:
    """A bare RESP2 client: enough to log in and probe permissions."""

    def __init__(self, port, user=None, password=None):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.buf = b""
        self.auth = self.call("AUTH", user, password) if user else None

    def close(self):
        self.sock.close()

    def _line(self):
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _read(self):
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind in (b"+", b"-"):
            return ("err " if kind == b"-" else "") + rest.decode()
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                self.buf += self.sock.recv(65536)
            data, self.buf = self.buf[:n], self.buf[n + 2:]
            return data.decode(errors="replace")
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self._read() for _ in range(n)]
        raise ValueError(f"unexpected reply {line!r}")

    def call(self, *args):
        out = f"*{len(args)}\r\n".encode()
        for a in args:
            b = str(a).encode()
            out += f"${len(b)}\r\n".encode() + b + b"\r\n"
        self.sock.sendall(out)
        return self._read()


R = f"{{{NS}:p3}}:r:7:42"  # a record hash
OBX = f"{{{NS}:p0}}:obx"
ING = f"{NS}:ingest:flowers:reports"
LEASE = f"{{{NS}:ingest:flowers}}:lease"
AGG = f"{{{NS}:agg:cat:7:42}}:view"
DANGER = [("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "SET", "appendonly", "no"), ("KEYS", "*"),
          ("SAVE",), ("REPLICAOF", "NO", "ONE"), ("CLIENT", "KILL", "ID", "1"), ("SHUTDOWN", "NOSAVE"), ("ACL", "SETUSER", "x", "on"),
          ("SCRIPT", "FLUSH"), ("FUNCTION", "FLUSH"), ("MONITOR",)]

# (user) -> allowed commands, refused commands (each refused with NOPERM)
MATRIX = {
    "storage": dict(
        ok=[("HSET", R, "sku", "x"), ("HMGET", R, "sku"), ("HSCAN", R, "0"), ("XADD", OBX, "*", "e", "x"),
            ("XLEN", OBX), ("SET", f"{{{NS}:p0}}:seq", "1"), ("WAIT", "0", "1"), ("EVALSHA", "0" * 40, "0")],
        no=[*DANGER, ("SET", ING, "x"), ("GET", LEASE), ("HSET", AGG, "a", "1"), ("SET", "other", "x"),
            ("PUBLISH", "c", "x")],
    ),
    "ingest": dict(
        ok=[("LPUSH", ING, "{}"), ("LRANGE", ING, "0", "-1"), ("SET", LEASE, "h", "NX", "PX", "1000"),
            ("ZADD", f"{NS}:ingest:flowers:places", "1", "9"), ("GET", f"{NS}:ingest:flowers:etag")],
        no=[*DANGER, ("XADD", OBX, "*", "e", "x"), ("HSET", R, "sku", "x"), ("HGET", R, "sku"), ("DEL", OBX),
            ("SET", f"{{{NS}:p0}}:seq", "9"), ("HSET", AGG, "a", "1"), ("XLEN", OBX)],
    ),
    "aggregator": dict(
        ok=[("HSET", AGG, "a", "1"), ("SADD", f"{{{NS}:agg}}:dirty", "x"), ("ZADD", f"{{{NS}:agg:card:n:p}}:z", "1", "a")],
        no=[*DANGER, ("HSET", R, "sku", "x"), ("HGET", R, "sku"), ("XADD", OBX, "*", "e", "x"), ("SET", ING, "x")],
    ),
    "cli": dict(
        ok=[("XLEN", OBX), ("PING",)],
        no=[*DANGER, ("XADD", OBX, "*", "e", "x"), ("DEL", OBX), ("HGET", R, "sku"), ("GET", ING)],
    ),
    "reader": dict(
        ok=[("HGET", R, "sku"), ("XLEN", OBX), ("GET", ING), ("SCAN", "0"), ("INFO", "memory")],
        no=[*DANGER, ("SET", ING, "x"), ("HSET", R, "sku", "x"), ("DEL", OBX), ("XADD", OBX, "*", "e", "x")],
    ),
    "exporter": dict(
        ok=[("INFO",), ("PING",), ("CONFIG", "GET", "maxmemory")],
        no=[*DANGER, ("GET", ING), ("HGET", R, "sku"), ("DEL", OBX)],
    ),
}


def config_errors():
    errors = []
    compose_acl = (ROOT / "compose/redis/users.acl").read_text()
    data = k8s_redis_config()
    if rules(compose_acl) != rules(data.get("users.acl", "")):
        errors.append("the ACL users of compose/redis/users.acl and k8s/base/redis.yaml (users.acl) differ")
    if code((ROOT / "compose/redis/start-redis.sh").read_text()) != code(data.get("start-redis.sh", "")):
        errors.append("compose/redis/start-redis.sh and k8s/base/redis.yaml (start-redis.sh) differ")
    names = [r.split()[1] for r in rules(compose_acl)]
    if names[:1] != ["default"] or "off" not in rules(compose_acl)[0].split():
        errors.append("users.acl: the default user must come first, off")
    for u in ACL_USERS:
        if u not in names:
            errors.append(f"users.acl: no user {u}")
    for r in rules(compose_acl):
        words = r.split()
        if words[1] != "default" and f">${{REDIS_{words[1].upper()}_PASSWORD}}" not in words:
            errors.append(f"users.acl: user {words[1]}'s password must be ${{REDIS_{words[1].upper()}_PASSWORD}}")
        if "+@all" in words or "allcommands" in words or "nopass" in words:
            errors.append(f"users.acl: user {words[1]} has +@all/allcommands/nopass")
    # compose: who connects as whom
    doc = yaml.safe_load((ROOT / "compose/compose.yaml").read_text())
    services = doc.get("services", {})
    redis_env = services.get("redis", {}).get("environment", {})
    for svc, user in (("storage", "storage"), ("ingest", "ingest"), ("aggregator", "aggregator"), ("setup", "cli")):
        url = str(services.get(svc, {}).get("environment", {}).get("SHELFSYNC__REDIS__URL", ""))
        var = f"REDIS_{user.upper()}_PASSWORD"
        if not url.startswith(f"redis://{user}:") or f"${{{var}:-" not in url:
            errors.append(f"compose {svc}: SHELFSYNC__REDIS__URL must log in as Redis user {user} with ${var} (got {url})")
        elif var not in redis_env or str(redis_env[var]) not in url:
            errors.append(f"compose {svc}: its Redis password default differs from the redis service's {var}")
    for svc in ("validator", "recommender"):
        if "SHELFSYNC__REDIS__URL" in services.get(svc, {}).get("environment", {}):
            errors.append(f"compose {svc}: uses no Redis, needs no Redis credentials")
    cmd = [str(c) for c in services.get("redis", {}).get("command", [])]
    if "/etc/redis/start-redis.sh" not in cmd or "--requirepass" in cmd:
        errors.append("compose redis: started by /etc/redis/start-redis.sh (the ACL users), no --requirepass")
    # k8s: the Secret key of each workload's user
    for f, user in (("storage", "storage"), ("ingest", "ingest"), ("aggregator", "aggregator"), ("cli", "cli")):
        text = (ROOT / f"k8s/base/{f}.yaml").read_text()
        if f"redis://{user}:$(REDIS_PASSWORD)@" not in text or f"key: {user}-password}}" not in text:
            errors.append(f"k8s {f}: Redis user {user}, password from shelfsync-redis key {user}-password")
    return errors


def probe_errors():
    redis = tool("redis-server")
    if not redis:
        return None
    env = acl_env()
    port = free_port()
    d = TMP / "redis-acl"
    d.mkdir(exist_ok=True)
    log = d / "redis.log"
    proc = subprocess.Popen(["sh", str(ROOT / "compose/redis/start-redis.sh"), "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(d)],
                            env={**os.environ, **env, "REDIS_ACL_FILE": str(d / "users.acl")},
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    errors = []
    try:
        if not wait_for_port(port, time.time() + 10, proc):
            return [f"redis-server with the shipped ACL did not start: {log.read_text()[-1500:]}"]
        anon = Resp(port)
        if not str(anon.call("GET", "x")).startswith("err NOAUTH"):
            errors.append("the default user is on: an unauthenticated GET was not refused")
        anon.close()
        for user, pw in (("default", ""), ("storage", "wrong")):
            c = Resp(port, user, pw)
            if not str(c.auth).startswith("err WRONGPASS"):
                errors.append(f"AUTH {user} with a wrong password: {c.auth}")
            c.close()
        for user, spec in MATRIX.items():
            c = Resp(port, user, env[f"REDIS_{user.upper()}_PASSWORD"])
            if c.auth != "OK":
                errors.append(f"{user}: cannot log in: {c.auth}")
                continue
            for cmd in spec["ok"]:
                r = c.call(*cmd)
                if isinstance(r, str) and r.startswith("err NOPERM"):
                    errors.append(f"{user} must be allowed: {' '.join(cmd)} ({r})")
            for cmd in spec["no"]:
                r = c.call(*cmd) if cmd[0] != "MONITOR" else c.call("MONITOR")
                if not (isinstance(r, str) and r.startswith("err NOPERM")):
                    errors.append(f"{user} must be refused (NOPERM): {' '.join(cmd)} (got {r!r})")
                    if cmd[0] in ("MONITOR", "SHUTDOWN"):
                        break
            c.close()
    finally:
        stop(proc)
    return errors


def check_redis_acl():
    try:
        check("Redis ACL: compose/redis/users.acl == k8s/base/redis.yaml, one user per service, who logs in as whom",
              config_errors())
    except Exception as e:  # noqa: BLE001
        fail("Redis ACL: configuration", e)
    errors = probe_errors()
    if errors is None:
        skip("Redis ACL users: probes against a live redis-server", "no redis-server")
    else:
        check("Redis ACL users: allowed and refused (NOPERM) commands and keys, probed against a live redis-server "
              "started by the shipped start script", errors)

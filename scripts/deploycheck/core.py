"""What every check shares: where the repository is, the tools the shell script found, the
report (one OK / FAIL / SKIP line per check) and small helpers. Owns no check itself."""
import atexit
import os
import pathlib
import shutil
import socket
import subprocess
import tempfile
import time

ROOT = pathlib.Path(os.environ.get("ROOT") or pathlib.Path(__file__).resolve().parents[2])
KUBECTL = os.environ.get("KUBECTL") or ""
NATS_SERVER = os.environ.get("NATS_SERVER") or ""
PROMTOOL = os.environ.get("PROMTOOL") or ""
FAILS = []
PASSED = []
TMP = pathlib.Path(tempfile.mkdtemp(prefix="shelfsync-validate-"))
atexit.register(shutil.rmtree, TMP, ignore_errors=True)


def ok(what):
    PASSED.append(what)
    print(f"OK    {what}", flush=True)


def fail(what, detail=""):
    FAILS.append(what)
    print(f"FAIL  {what}", flush=True)
    for line in str(detail).strip().splitlines()[:40]:
        print(f"      {line}", flush=True)


def skip(what, why):
    print(f"SKIP  {what}: {why}", flush=True)


def check(what, errors):
    if errors:
        fail(what, "\n".join(errors))
    else:
        ok(what)


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def tool(name):
    return shutil.which(name) or ""


def rel(p):
    return str(pathlib.Path(p).relative_to(ROOT))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deep_merge(a, b):
    out = dict(a)
    for k, v in (b or {}).items():
        out[k] = deep_merge(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


SERVICES = {  # name -> (binary, HTTP port, listen setting, NATS user)
    "ingest": ("shelfsync-ingest", 8080, "SHELFSYNC__INGEST__LISTEN", "ingest"),
    "storage": ("shelfsync-storage", 8081, "SHELFSYNC__STORAGE__HTTP_LISTEN", "storage"),
    "validator": ("shelfsync-validator", 8082, "SHELFSYNC__VALIDATOR__HTTP_LISTEN", "validator"),
    "aggregator": ("shelfsync-aggregator", 8083, "SHELFSYNC__AGGREGATOR__HTTP_LISTEN", "aggregator"),
    "recommender": ("shelfsync-recommender", 8084, "SHELFSYNC__RECOMMENDER__HTTP_LISTEN", "recommender"),
}
PREFIX = "shelfsync"
NATS_USERS = ["admin", "ingest", "storage", "validator", "aggregator", "recommender"]



NOTES = []


def note(text):
    """Something to know that is not a failure (printed once, at the end)."""
    if text not in NOTES:
        NOTES.append(text)


def wait_for_port(port, deadline, proc=None):
    """Waits until something listens on 127.0.0.1:`port`. False once `time.time()` passes
    `deadline` or `proc` (when given) has exited."""
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return True
        except OSError:
            if (proc is not None and proc.poll() is not None) or time.time() > deadline:
                return False
            time.sleep(0.1)


def stop(proc, timeout=10):
    """Terminates `proc` and waits for it; kills it if it has not exited after `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()

"""What the kit's tests run against: a private nats-server (JetStream) and
redis-server on free loopback ports for the test session, and per test its own
prefix and namespace, the real `shelfsync-storage` binary and the `shelfsync`
CLI configured through `SHELFSYNC__...` variables (as shared/testkit and
tests/src do for the Rust tests). Never the servers on 4222 / 6379.

Binaries: `SHELFSYNC_NATS_SERVER` (else what scripts/install-deps.sh prints),
`SHELFSYNC_REDIS_SERVER` (else `redis-server` on PATH), and the workspace's
binaries in `SHELFSYNC_BIN_DIR` (else `$CARGO_TARGET_DIR/debug`, else
`target/debug`): build them with `cargo build --workspace --bins`.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pathlib
import secrets
import shutil
import socket
import string
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections import defaultdict
from typing import Awaitable, Callable, Dict, Iterable, List, Optional, Tuple, Union

import nats
from nats.js.errors import NotFoundError

from shelfsync_kit import Subjects, partition_of, pb

REPO = pathlib.Path(__file__).resolve().parents[3]
PARTITIONS = 4
#: How long a test waits for the pipeline to settle.
SETTLE = 30.0


def _bin_dir() -> pathlib.Path:
    if os.environ.get("SHELFSYNC_BIN_DIR"):
        return pathlib.Path(os.environ["SHELFSYNC_BIN_DIR"])
    target = os.environ.get("CARGO_TARGET_DIR")
    base = pathlib.Path(target) if target else REPO / "target"
    if not base.is_absolute():
        base = REPO / base
    return base / "debug"


def workspace_bin(name: str) -> str:
    path = _bin_dir() / name
    if not path.is_file():
        raise RuntimeError(f"{path} not found: run `cargo build --workspace --bins` first")
    return str(path)


def nats_server_bin() -> str:
    if os.environ.get("SHELFSYNC_NATS_SERVER"):
        return os.environ["SHELFSYNC_NATS_SERVER"]
    out = subprocess.run([str(REPO / "scripts" / "install-deps.sh")], check=True,
                         stdout=subprocess.PIPE, text=True)
    return out.stdout.strip().splitlines()[-1]


def redis_server_bin() -> str:
    found = os.environ.get("SHELFSYNC_REDIS_SERVER") or shutil.which("redis-server")
    if not found:
        raise RuntimeError("redis-server not found: install it or set SHELFSYNC_REDIS_SERVER")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unique_name() -> str:
    """`t` + 10 random lowercase alphanumerics: valid in subjects, stream names
    and Redis keys (as shelfsync_testkit::unique_name)."""
    alphabet = string.ascii_lowercase + string.digits
    return "t" + "".join(secrets.choice(alphabet) for _ in range(10))


def _wait_until(what: str, probe: Callable[[], bool], proc: subprocess.Popen, log: pathlib.Path,
                timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}):\n{_tail(log)}")
        try:
            if probe():
                return
        except OSError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"{what} not ready after {timeout}s:\n{_tail(log)}")


def _tail(log: pathlib.Path) -> str:
    try:
        return log.read_text(errors="replace")[-3000:]
    except OSError:
        return "(no log)"


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class Server:
    """One child process we started, stopped on `stop()` (by its own handle)."""

    def __init__(self, proc: subprocess.Popen, dir: tempfile.TemporaryDirectory, url: str,
                 log: pathlib.Path) -> None:
        self.proc, self.dir, self.url, self.log = proc, dir, url, log

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.dir.cleanup()


def start_nats() -> Server:
    binary = nats_server_bin()
    for _ in range(3):
        tmp = tempfile.TemporaryDirectory(prefix="kit-nats-")
        port, monitor = free_port(), free_port()
        log = pathlib.Path(tmp.name) / "nats.log"
        proc = subprocess.Popen(
            [binary, "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor), "-js",
             "-sd", str(pathlib.Path(tmp.name) / "js"), "-l", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

        def ready() -> bool:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                info = s.recv(4096).decode(errors="replace")
            return ('"jetstream":true' in info
                    and _http_status(f"http://127.0.0.1:{monitor}/healthz") == 200)

        server = Server(proc, tmp, f"nats://127.0.0.1:{port}", log)
        try:
            _wait_until("nats-server", ready, proc, log)
            return server
        except RuntimeError:
            server.stop()  # most likely a port taken meanwhile: try others
    raise RuntimeError("nats-server did not start")


def start_redis() -> Server:
    binary = redis_server_bin()
    for _ in range(3):
        tmp = tempfile.TemporaryDirectory(prefix="kit-redis-")
        port = free_port()
        log = pathlib.Path(tmp.name) / "redis.log"
        proc = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp.name,
             "--save", "", "--appendonly", "no", "--daemonize", "no", "--logfile", str(log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

        def ready() -> bool:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")

        server = Server(proc, tmp, f"redis://127.0.0.1:{port}", log)
        try:
            _wait_until("redis-server", ready, proc, log)
            return server
        except RuntimeError:
            server.stop()
    raise RuntimeError("redis-server did not start")


async def eventually(what: str, cond: Callable[[], Union[bool, Awaitable[bool]]],
                     timeout: float = SETTLE) -> None:
    """Polls `cond` every 20 ms until it holds; fails the test with `what` after
    `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        ok = cond()
        if inspect.isawaitable(ok):
            ok = await ok
        if ok:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.02)


def patch(brand: int, place: int, product_id: str, price: int, stock: int = 1,
          title: str = "t") -> pb.Command:
    data = pb.Product(title=title, price=price, stock=stock, currency="EUR")
    return pb.Command(key=pb.RecordKey(brand_id=brand, place_id=place, product_id=product_id),
                      kind=pb.COMMAND_KIND_PATCH, data=data.SerializeToString())


def delete(brand: int, place: int, product_id: str) -> pb.Command:
    return pb.Command(key=pb.RecordKey(brand_id=brand, place_id=place, product_id=product_id),
                      kind=pb.COMMAND_KIND_DELETE)


class Stack:
    """One test's deployment: its prefix and namespace on the session's servers,
    the real storage binary, the CLI, and a NATS connection."""

    def __init__(self, nats_url: str, redis_url: str, extra_env: Dict[str, str]) -> None:
        self.prefix = unique_name()
        self.subjects = Subjects(self.prefix)
        self.http = f"127.0.0.1:{free_port()}"
        self.env = {
            "SHELFSYNC__NATS__URL": nats_url,
            "SHELFSYNC__NATS__PREFIX": self.prefix,
            "SHELFSYNC__REDIS__URL": redis_url,
            "SHELFSYNC__REDIS__NAMESPACE": self.prefix,
            "SHELFSYNC__STORAGE__PARTITIONS": str(PARTITIONS),
            "SHELFSYNC__STORAGE__ACK_WAIT": "5000ms",
            "SHELFSYNC__STORAGE__RETRY_DELAY": "100ms",
            # No scheduled keyframes: a test asks for the ones it wants.
            "SHELFSYNC__STORAGE__KEYFRAME_SCHEDULE": "",
            "SHELFSYNC__STORAGE__HTTP_LISTEN": self.http,
            "SHELFSYNC__INGEST__LISTEN": "127.0.0.1:0",
            "RUST_LOG": "warn",
            **extra_env,
        }
        self.storage: Optional[subprocess.Popen] = None
        self.storage_log = tempfile.NamedTemporaryFile(prefix="kit-storage-", suffix=".log",
                                                       delete=False)
        self.nc: Optional[nats.NATS] = None
        self._msg = 0

    def cli(self, *args: str, timeout: float = SETTLE) -> str:
        """Runs the `shelfsync` CLI with this test's settings (nothing else from
        the environment); returns its stdout."""
        out = subprocess.run([workspace_bin("shelfsync"), *args], env=self.env, timeout=timeout,
                             stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if out.returncode != 0:
            raise AssertionError(f"shelfsync {' '.join(args)} failed ({out.returncode}):\n"
                                 f"{out.stdout}\n{out.stderr}")
        return out.stdout

    async def start(self) -> None:
        await asyncio.to_thread(self.cli, "setup")
        self.storage = subprocess.Popen([workspace_bin("shelfsync-storage")], env=self.env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=self.storage_log)
        await eventually("storage to be ready",
                         lambda: asyncio.to_thread(self._storage_ready))
        self.nc = await nats.connect(self.env["SHELFSYNC__NATS__URL"], name="kit-test")
        self.js = self.nc.jetstream()
        self.jsm = self.nc.jsm()

    def _storage_ready(self) -> bool:
        if self.storage is not None and self.storage.poll() is not None:
            raise AssertionError(f"storage exited ({self.storage.returncode}):\n"
                                 f"{_tail(pathlib.Path(self.storage_log.name))}")
        try:
            return _http_status(f"http://{self.http}/readyz") == 200
        except OSError:
            return False

    async def stop(self) -> None:
        if self.nc is not None:
            await self.nc.close()
        if self.storage is not None and self.storage.poll() is None:
            self.storage.terminate()
            try:
                await asyncio.to_thread(self.storage.wait, 15)
            except subprocess.TimeoutExpired:
                self.storage.kill()
                self.storage.wait()
        self.storage_log.close()
        os.unlink(self.storage_log.name)

    # --- writing ---------------------------------------------------------------

    async def send(self, commands: Iterable[pb.Command]) -> None:
        """Publishes commands as one `CommandBatch` per partition on
        `<prefix>.cmd.<partition>`, with `Nats-Msg-Id` and `Shelfsync-Type`."""
        by_partition: Dict[int, List[pb.Command]] = defaultdict(list)
        for c in commands:
            by_partition[partition_of(c.key.brand_id, c.key.place_id, PARTITIONS)].append(c)
        for partition, cmds in sorted(by_partition.items()):
            for i in range(0, len(cmds), 1000):
                batch = pb.CommandBatch(partition=partition, commands=cmds[i:i + 1000],
                                        origin=pb.Origin(source="kit-test"))
                self._msg += 1
                await self.js.publish(
                    self.subjects.cmd(partition), batch.SerializeToString(),
                    headers={"Nats-Msg-Id": f"kit-test:{uuid.uuid4()}",
                             "Shelfsync-Type": "shelfsync.v1.CommandBatch"})

    async def write(self, brand: int, places: Iterable[int], items: int, price_base: int,
                    prefix: str = "sku") -> None:
        await self.send(patch(brand, p, f"{prefix}-{i}", price_base + i)
                        for p in places for i in range(items))

    async def wait_applied(self) -> None:
        """Until storage applied every command sent (CMD is a work queue: an
        applied command is acked, hence gone) and published its changes."""
        async def empty() -> bool:
            info = await self.jsm.stream_info(self.subjects.cmd_stream())
            return info.state.messages == 0
        await eventually("storage to apply every command", empty)

    # --- reading ---------------------------------------------------------------

    async def changes_last_seq(self) -> int:
        return (await self.jsm.stream_info(self.subjects.changes_stream())).state.last_seq

    async def keyframe(self) -> str:
        """`shelfsync keyframe`: every place, waits for storage's reply."""
        return await asyncio.to_thread(self.cli, "keyframe")

    async def records(self, brand: int, place: int) -> Dict[str, pb.Record]:
        """Every record storage holds for a place (tombstones included), read
        through its read API (`<prefix>.read.place`, cursor pages)."""
        out: Dict[str, pb.Record] = {}
        cursor = ""
        while True:
            req = pb.ReadRequest(brand_id=brand, place_id=place, cursor=cursor, limit=1000)
            resp = await self.nc.request(self.subjects.read("place"), req.SerializeToString(),
                                         timeout=10)
            reply = pb.ReadReply.FromString(resp.data)
            assert not reply.error, reply.error
            for r in reply.records:
                out[r.key.product_id] = r
            cursor = reply.next_cursor
            if not cursor:
                return out

    async def consumer_delivered(self, name: str) -> Tuple[int, int, int]:
        """(delivered stream sequence, pending, ack pending) of a durable consumer."""
        try:
            info = await self.jsm.consumer_info(self.subjects.changes_stream(), name)
        except NotFoundError:
            return (0, 0, 0)
        return (info.delivered.stream_seq or 0, info.num_pending or 0, info.num_ack_pending or 0)


class Mirror:
    """A handler that mirrors storage's records (the simplest possible service),
    and remembers every version it was handed, to catch a double apply."""

    def __init__(self) -> None:
        self.records: Dict[Tuple[int, int, str], pb.Record] = {}
        self.applied: List[Tuple[int, int, str, int]] = []
        self.kinds: Dict[str, int] = defaultdict(int)
        self.resets: List[Tuple[int, int]] = []
        #: product ids whose next apply fails once, transiently.
        self.fail_once: set = set()
        self.failures = 0

    async def apply(self, updates) -> None:
        from shelfsync_kit import TransientError

        for u in updates:
            if u.product_id in self.fail_once:
                self.fail_once.discard(u.product_id)
                self.failures += 1
                raise TransientError("injected")
        for u in updates:
            k = (u.key.brand_id, u.key.place_id, u.product_id)
            self.records[k] = u.after
            self.applied.append((*k, u.updated_at))
            self.kinds[u.kind.value] += 1

    async def reset_place(self, place) -> None:
        self.resets.append((place.brand_id, place.place_id))
        for k in [k for k in self.records if (k[0], k[1]) == tuple(place)]:
            del self.records[k]

    def updated_at(self, brand: int, place: int, product_id: str) -> Optional[int]:
        r = self.records.get((brand, place, product_id))
        return None if r is None else r.updated_at

    def of_place(self, brand: int, place: int) -> Dict[str, int]:
        return {k[2]: r.updated_at for k, r in self.records.items() if k[:2] == (brand, place)}

    def assert_applied_once(self) -> None:
        seen = set()
        for a in self.applied:
            assert a not in seen, f"{a} was handed to the handler twice"
            seen.add(a)

    async def equals_storage(self, stack: Stack, brand: int, places: Iterable[int]) -> bool:
        for place in places:
            stored = {pid: r.updated_at for pid, r in (await stack.records(brand, place)).items()}
            if self.of_place(brand, place) != stored:
                return False
        return True

    async def assert_equals_storage(self, stack: Stack, brand: int, places: Iterable[int]) -> None:
        for place in places:
            stored = {pid: r.updated_at for pid, r in (await stack.records(brand, place)).items()}
            mine = self.of_place(brand, place)
            assert mine == stored, f"place {brand}:{place}: the mirror differs from storage"
            for pid, r in (await stack.records(brand, place)).items():
                assert self.records[(brand, place, pid)].SerializeToString() == \
                    r.SerializeToString(), f"{pid}: record bytes differ"

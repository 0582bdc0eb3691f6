"""A bare NATS protocol client and the matrix of what every shelfsync user must and must not be
allowed to do, probed against a real nats-server."""
import json
import os
import pathlib
import re
import socket
import subprocess
import time

from .core import NATS_SERVER, NATS_USERS, PREFIX, TMP, free_port, stop, wait_for_port

class Raw:
    """A bare NATS protocol client: enough to log in and probe permissions (verbose mode makes
    the server answer +OK or -ERR to every PUB and SUB)."""

    def __init__(self, port, user=None, password=None):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.buf = b""
        self.msgs = []
        line = self.line()
        if not line.startswith("INFO"):
            raise RuntimeError(f"unexpected greeting {line!r}")
        connect = {"verbose": True, "pedantic": False, "lang": "validate", "version": "0",
                   "protocol": 1, "headers": True, "no_responders": True}
        if user is not None:
            connect.update(user=user, **{"pass": password})
        self.errors = self.exchange("CONNECT " + json.dumps(connect) + "\r\n")

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def line(self):
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed by the server")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line.decode()

    def payload(self, n):
        while len(self.buf) < n + 2:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed by the server")
            self.buf += chunk
        data, self.buf = self.buf[:n], self.buf[n + 2:]
        return data

    def exchange(self, ops):
        """Sends ops then PING; returns the -ERR lines received before PONG."""
        self.sock.sendall((ops + "PING\r\n").encode())
        errors = []
        while True:
            try:
                line = self.line()
            except ConnectionError:
                errors.append("-ERR connection closed")
                return errors
            if line == "PONG":
                return errors
            if line.startswith("-ERR"):
                errors.append(line)
            elif line.startswith("MSG ") or line.startswith("HMSG "):
                parts = line.split()
                size = int(parts[-1])
                self.payload(size)
                reply = parts[3] if len(parts) == (5 if parts[0] == "MSG" else 6) else None
                self.msgs.append((parts[1], reply))
            # +OK, PING, INFO: nothing to do

    def pub(self, subject, reply=None):
        return not self.exchange(f"PUB {subject}{' ' + reply if reply else ''} 0\r\n\r\n")

    def sub(self, subject, sid, queue=None):
        return not self.exchange(f"SUB {subject}{' ' + queue if queue else ''} {sid}\r\n")


CMD, CHG, KF, AGG, REJ = (f"SHELFSYNC_{x}" for x in ("CMD", "CHANGES", "KEYFRAMES", "AGGREGATES", "REJECTS"))
ACK = "1.10.3.1700000000000000000.0"  # delivered.stream_seq.consumer_seq.timestamp.pending
CHG_FILTER = f"{PREFIX}.changes.*.*"


def consumer_api(stream, name, filt):
    """`filt` None: a consumer with several filter subjects, created on the subject without one."""
    create = f"$JS.API.CONSUMER.CREATE.{stream}.{name}" + (f".{filt}" if filt else "")
    return [f"$JS.API.CONSUMER.INFO.{stream}.{name}", create,
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{name}", f"$JS.ACK.{stream}.{name}.{ACK}"]


def consumer_takeover(stream, name, filt):
    """What would let a user steal or disturb another service's consumer (reading its info is
    harmless and allowed)."""
    return consumer_api(stream, name, filt)[1:]


KF_READ = [f"$JS.API.STREAM.INFO.{KF}", f"$JS.API.DIRECT.GET.{KF}",
           f"$JS.API.DIRECT.GET.{KF}.{PREFIX}.keyframes.7.42",
           # a feed's drift repair re-reads a place's changes
           f"$JS.API.STREAM.MSG.GET.{CHG}"]
# The recommender's consumers: one per running instance, the first free of recommender-0 … -31.
REC_SLOTS = ["recommender-0", "recommender-31"]
STREAMS = (CMD, CHG, KF, AGG, REJ)
# Stream configuration has one writer, admin (`shelfsync setup`): nobody else may create, update
# or delete a stream; the services that verify it at start may read it.
STREAM_WRITES = [f"$JS.API.STREAM.{op}.{s}" for s in STREAMS for op in ("CREATE", "UPDATE", "DELETE")]
STREAM_INFOS = [f"$JS.API.STREAM.INFO.{s}" for s in STREAMS]
# Operator-only requests: only admin may publish them.
CTL_ADMIN = [f"{PREFIX}.ctl.rebase", f"{PREFIX}.ctl.redrive"]
READS = [f"{PREFIX}.read.get", f"{PREFIX}.read.batch", f"{PREFIX}.read.place", f"{PREFIX}.read.dead"]


def inbox(user):
    """The reply inboxes of `user` (settings nats.inbox_prefix = _INBOX_<user>)."""
    return f"_INBOX_{user}"


def other_inboxes(user):
    """Inboxes `user` must not be able to listen on: the shared default and every other user's."""
    return ["_INBOX.>", "_INBOX.x.y", *(f"{inbox(u)}.>" for u in NATS_USERS if u != user)]


# What every user must be able to do (from the code: shared/bus, shared/feed, services/*), and
# what it must not.
MATRIX = {
    "admin": dict(
        pub_ok=[f"$JS.API.STREAM.CREATE.{CMD}", f"$JS.API.STREAM.UPDATE.{CHG}", f"$JS.API.STREAM.INFO.{KF}",
                f"$JS.API.STREAM.DELETE.{AGG}", f"$JS.API.CONSUMER.CREATE.{CHG}",
                f"$JS.API.CONSUMER.INFO.{CMD}.storage-p0", f"{PREFIX}.cmd.0", f"{PREFIX}.cmd.0.sweep",
                f"{PREFIX}.rejects.7.0", f"{PREFIX}.ctl.keyframe", *CTL_ADMIN, *READS, f"{PREFIX}.read.sweeps",
                f"{PREFIX}.recommend.top"],
        pub_no=[f"{PREFIX}.changes.7.42", f"{PREFIX}.keyframes.7.42", f"{PREFIX}.aggregates.cards.north"],
        sub_ok=[f"{inbox('admin')}.x.y", f"{PREFIX}.changes.>", f"{PREFIX}.rejects.>"],
        sub_no=["$JS.API.>", ">", *other_inboxes("admin")],
    ),
    "ingest": dict(
        pub_ok=[f"{PREFIX}.cmd.0", f"{PREFIX}.cmd.63", f"{PREFIX}.cmd.63.sweep", f"{PREFIX}.rejects.7.0",
                f"{PREFIX}.read.sweeps"],
        pub_no=[f"{PREFIX}.changes.7.42", f"{PREFIX}.keyframes.7.42", f"{PREFIX}.aggregates.cards.north",
                f"{PREFIX}.ctl.keyframe", *CTL_ADMIN, *READS, *STREAM_WRITES, *STREAM_INFOS, "$JS.API.INFO",
                f"$JS.API.STREAM.PURGE.{CMD}", f"$JS.API.CONSUMER.CREATE.{CMD}.storage-p0.{PREFIX}.cmd.0",
                "_INBOX.unsolicited"],
        sub_ok=[f"{inbox('ingest')}.x.y"],
        sub_no=[f"{PREFIX}.cmd.0", f"{PREFIX}.changes.>", *other_inboxes("ingest")],
    ),
    "storage": dict(
        # Its consumers of CMD go without acks: it purges what it applied, and asks the stream
        # what comes next on a subject (a direct get; the leader, MSG.GET, when replicated).
        pub_ok=[*STREAM_INFOS, *consumer_api(CMD, "storage-p5-r0-x", f"{PREFIX}.cmd.5")[:3],
                *consumer_api(CMD, "storage-p5-r0-x-sweeps", f"{PREFIX}.cmd.5.sweep")[:3],
                f"$JS.API.CONSUMER.DELETE.{CMD}.storage-p5-r0-x", f"$JS.API.STREAM.PURGE.{CMD}",
                f"$JS.API.STREAM.PURGE.{KF}", f"$JS.API.DIRECT.GET.{CMD}", f"$JS.API.STREAM.MSG.GET.{CMD}",
                f"{PREFIX}.changes.7.42", f"{PREFIX}.keyframes.7.42", f"{PREFIX}.rejects.7.42"],
        pub_no=[f"{PREFIX}.cmd.5", f"{PREFIX}.cmd.5.sweep", f"{PREFIX}.aggregates.cards.north",
                f"{PREFIX}.ctl.keyframe", *CTL_ADMIN, *READS, *STREAM_WRITES, "$JS.API.INFO",
                f"$JS.API.STREAM.PURGE.{CHG}", f"$JS.ACK.{CMD}.storage-p5-r0-x.{ACK}",
                f"$JS.API.CONSUMER.CREATE.{CMD}.storage-p5.{PREFIX}.changes.>",
                f"$JS.API.CONSUMER.CREATE.{CMD}.storage-p5",  # a consumer without a filter
                *consumer_takeover(CHG, "validator", CHG_FILTER), "_INBOX.unsolicited"],
        sub_ok=[f"{inbox('storage')}.x.y", f"{PREFIX}.ctl.keyframe", f"{PREFIX}.ctl.rebase", f"{PREFIX}.read.get"],
        sub_no=[f"{PREFIX}.cmd.5", f"{PREFIX}.changes.>", f"{PREFIX}.recommend.top", *other_inboxes("storage")],
    ),
    "validator": dict(
        pub_ok=[f"$JS.API.STREAM.INFO.{CHG}", *consumer_api(CHG, "validator", CHG_FILTER),
                *KF_READ, f"{PREFIX}.cmd.17"],
        pub_no=[f"{PREFIX}.cmd.17.sweep", f"{PREFIX}.changes.7.42", f"{PREFIX}.keyframes.7.42", f"{PREFIX}.rejects.7.42",
                f"{PREFIX}.aggregates.cards.north", f"{PREFIX}.ctl.keyframe", *CTL_ADMIN, *READS,
                f"{PREFIX}.read.sweeps", *STREAM_WRITES, f"$JS.API.STREAM.INFO.{CMD}",
                f"$JS.API.CONSUMER.DELETE.{CHG}.validator",
                *consumer_takeover(CHG, "aggregator", CHG_FILTER), *consumer_takeover(CMD, "storage-p0-r0-x", f"{PREFIX}.cmd.0"),
                f"$JS.API.STREAM.PURGE.{KF}", "_INBOX.unsolicited"],
        sub_ok=[f"{inbox('validator')}.x.y"],
        sub_no=[f"{PREFIX}.changes.>", f"{PREFIX}.read.get", *other_inboxes("validator")],
    ),
    "aggregator": dict(
        pub_ok=[*STREAM_INFOS, *consumer_api(CHG, "aggregator", CHG_FILTER),
                f"$JS.API.CONSUMER.DELETE.{CHG}.aggregator",
                *KF_READ, f"{PREFIX}.ctl.keyframe", f"{PREFIX}.aggregates.cards.north",
                f"{PREFIX}.aggregates.categories.7.42"],
        pub_no=[f"{PREFIX}.cmd.0", f"{PREFIX}.cmd.0.sweep", f"{PREFIX}.changes.7.42", f"{PREFIX}.keyframes.7.42",
                *CTL_ADMIN, *READS, f"{PREFIX}.read.sweeps", *STREAM_WRITES, "$JS.API.INFO",
                *consumer_takeover(CHG, "validator", CHG_FILTER), f"$JS.API.CONSUMER.DELETE.{CHG}.validator",
                f"$JS.API.STREAM.PURGE.{KF}", "_INBOX.unsolicited"],
        sub_ok=[f"{inbox('aggregator')}.x.y"],
        sub_no=[f"{PREFIX}.changes.>", *other_inboxes("aggregator")],
    ),
    "recommender": dict(
        pub_ok=[f"$JS.API.STREAM.INFO.{CHG}", *KF_READ, f"{PREFIX}.ctl.keyframe",
                *[s for rec in REC_SLOTS for s in [*consumer_api(CHG, rec, CHG_FILTER),
                                                   f"$JS.API.CONSUMER.DELETE.{CHG}.{rec}"]]],
        pub_no=[f"{PREFIX}.cmd.0", f"{PREFIX}.cmd.0.sweep", f"{PREFIX}.changes.7.42", f"{PREFIX}.keyframes.7.42",
                f"{PREFIX}.aggregates.cards.north", *CTL_ADMIN, *READS, *STREAM_WRITES,
                *consumer_takeover(CHG, "validator", CHG_FILTER),
                *consumer_takeover(CHG, "aggregator", CHG_FILTER), f"$JS.API.CONSUMER.DELETE.{CHG}.validator",
                f"$JS.API.CONSUMER.DELETE.{CHG}.aggregator", *consumer_takeover(CMD, "storage-p0-r0-x", f"{PREFIX}.cmd.0"),
                # a consumer team's, a name past the slots, any other name: none is its own
                *[s for other in ["picks", "picks-0", "recommender-32", "recommender", "x"]
                  for s in [*consumer_api(CHG, other, CHG_FILTER), f"$JS.API.CONSUMER.DELETE.{CHG}.{other}"]],
                f"$JS.API.STREAM.PURGE.{KF}", "_INBOX.unsolicited"],
        sub_ok=[f"{inbox('recommender')}.x.y", (f"{PREFIX}.recommend.top", "recommender")],
        sub_no=[f"{PREFIX}.changes.>", f"{PREFIX}.read.get", *other_inboxes("recommender")],
    ),
}


def probe_permissions(label, conf_path, env):
    """Runs a nats-server with the config on loopback (its JetStream store moved to a temporary
    directory) and probes every user's rights."""
    port, http = free_port(), free_port()
    store = TMP / f"js-{label}"
    store.mkdir(parents=True, exist_ok=True)
    conf = TMP / f"probe-{label}.conf"
    conf.write_text(re.sub(r'("?store_dir"?\s*[:=]\s*)("[^"]*"|\S+)', lambda m: m.group(1) + json.dumps(str(store)),
                           pathlib.Path(conf_path).read_text()))
    log = TMP / f"nats-{label}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([NATS_SERVER, "-c", str(conf), "-a", "127.0.0.1", "-p", str(port),
                                 "-m", str(http)], env={**os.environ, **env},
                                stdout=out, stderr=subprocess.STDOUT)
    errors = []
    try:
        if not wait_for_port(port, time.time() + 10, proc):
            return [f"nats-server did not start: {log.read_text()[-2000:]}"]
        passwords = {u: env[f"NATS_{u.upper()}_PASSWORD"] for u in NATS_USERS}
        # Logins: anonymous and wrong passwords are refused.
        # The system account's user logs in (server administration).
        c = Raw(port, "sys", env["NATS_SYS_PASSWORD"])
        if c.errors:
            errors.append(f"sys: cannot log in: {c.errors}")
        c.close()
        for user, pw in [(None, None), ("storage", "wrong-password"), ("nobody", "x")]:
            c = Raw(port, user, pw)
            if not any("Authorization Violation" in e for e in c.errors):
                errors.append(f"login {user or 'anonymous'}/{pw}: accepted, should be refused")
            c.close()
        for user, spec in MATRIX.items():
            c = Raw(port, user, passwords[user])
            if c.errors:
                errors.append(f"{user}: cannot log in: {c.errors}")
                continue
            for s in spec["pub_ok"]:
                if not c.pub(s):
                    errors.append(f"{user} must be allowed to publish {s}")
            for s in spec["pub_no"]:
                if c.pub(s):
                    errors.append(f"{user} must NOT be allowed to publish {s}")
            for i, s in enumerate(spec["sub_ok"]):
                subject, queue = s if isinstance(s, tuple) else (s, None)
                if not c.sub(subject, f"ok{i}", queue):
                    errors.append(f"{user} must be allowed to subscribe to {subject}")
            for i, s in enumerate(spec["sub_no"]):
                if c.sub(s, f"no{i}"):
                    errors.append(f"{user} must NOT be allowed to subscribe to {s}")
            c.close()
        # Request/reply through allow_responses: storage answers a read request from admin,
        # recommender a top-N request; neither may publish to an inbox nobody asked from.
        for responder, subject, queue in [("storage", f"{PREFIX}.read.get", "storage-read"),
                                          ("recommender", f"{PREFIX}.recommend.top", "recommender")]:
            srv, cli = Raw(port, responder, passwords[responder]), Raw(port, "admin", passwords["admin"])
            srv.sub(subject, "1", queue)
            cli.sub(f"{inbox('admin')}.validate.>", "1")
            cli.pub(subject, reply=f"{inbox('admin')}.validate.r1")
            srv.exchange("")
            replies = [r for (_, r) in srv.msgs if r]
            if replies != [f"{inbox('admin')}.validate.r1"]:
                errors.append(f"{responder} did not receive the request on {subject} ({srv.msgs})")
            elif not srv.pub(f"{inbox('admin')}.validate.r1"):
                errors.append(f"{responder} may not reply to a request it received (allow_responses)")
            else:
                cli.exchange("")
                if not any(s == f"{inbox('admin')}.validate.r1" for (s, _) in cli.msgs):
                    errors.append(f"the requester did not get {responder}'s reply")
            srv.close()
            cli.close()
    finally:
        stop(proc)
    return errors



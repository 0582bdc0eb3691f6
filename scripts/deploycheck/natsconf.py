"""A parser for the NATS server configuration format (the subset the deployment files use)."""
import json
import re

class NatsConf:
    """Parser for the NATS configuration format (the subset the deployment files use: maps,
    arrays, quoted and bare strings, numbers, booleans, $variables from the file or the env)."""

    def __init__(self, text, env):
        self.s, self.i, self.env, self.vars = text, 0, env, {}

    def error(self, msg):
        line = self.s.count("\n", 0, self.i) + 1
        raise ValueError(f"line {line}: {msg}")

    def skip(self, newlines=True):
        while self.i < len(self.s):
            c = self.s[self.i]
            if c in " \t\r" or (newlines and c in "\n,;"):
                self.i += 1
            elif c == "#" or self.s.startswith("//", self.i):
                while self.i < len(self.s) and self.s[self.i] != "\n":
                    self.i += 1
            else:
                break

    def parse(self):
        return self.map_body(None)

    def map_body(self, end):
        out = {}
        while True:
            self.skip()
            if self.i >= len(self.s):
                if end is None:
                    return out
                self.error("unterminated map")
            if end and self.s[self.i] == end:
                self.i += 1
                return out
            key = self.key()
            self.skip(newlines=False)
            if self.i < len(self.s) and self.s[self.i] in ":=":
                self.i += 1
            value = self.value()
            out[key] = value
            self.vars[key] = value

    def key(self):
        if self.s[self.i] in "\"'":
            return self.quoted()
        m = re.compile(r"[^\s:=]+").match(self.s, self.i)
        if not m:
            self.error("key expected")
        self.i = m.end()
        return m.group(0)

    def quoted(self):
        q = self.s[self.i]
        j = self.s.index(q, self.i + 1)
        v = self.s[self.i + 1:j]
        self.i = j + 1
        return v

    def value(self):
        self.skip(newlines=False)
        c = self.s[self.i]
        if c == "{":
            self.i += 1
            return self.map_body("}")
        if c == "[":
            self.i += 1
            arr = []
            while True:
                self.skip()
                if self.s[self.i] == "]":
                    self.i += 1
                    return arr
                arr.append(self.value())
        if c in "\"'":
            return self.quoted()
        m = re.compile(r"[^\s,;\]\}]+").match(self.s, self.i)
        tok = m.group(0)
        self.i = m.end()
        if tok.startswith("$"):
            name = tok[1:]
            if name in self.vars:
                return self.vars[name]
            if name in self.env:
                return self.env[name]
            self.error(f"variable ${name} is not defined")
        if tok in ("true", "false"):
            return tok == "true"
        if re.fullmatch(r"-?\d+", tok):
            return int(tok)
        return tok


def norm_permissions(users):
    """user -> {publish: {allow, deny}, subscribe: {allow, deny}, allow_responses}"""
    out = {}
    for u in users:
        perms = u.get("permissions", {}) or {}
        entry = {}
        for kind in ("publish", "subscribe"):
            p = perms.get(kind, {})
            if isinstance(p, (list, str)):
                p = {"allow": p}
            entry[kind] = {k: sorted([p[k]] if isinstance(p.get(k), str) else p.get(k, [])) for k in ("allow", "deny")}
        ar = perms.get("allow_responses", False)
        entry["allow_responses"] = ar if isinstance(ar, bool) else json.dumps(ar, sort_keys=True)
        out[u["user"]] = entry
    return out



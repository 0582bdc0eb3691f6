"""The shape of shared/settings (struct -> field -> type), read from its source, and checks of
TOML files and SHELFSYNC__* variables against it."""
import re

try:
    import tomllib
except ImportError:  # Python < 3.11
    tomllib = None

from .core import PREFIX, ROOT, check, fail, skip

# The shape of the settings, read from the source of shared/settings (lib.rs and its section
# modules, shared/settings/src/*.rs): struct name -> field -> type.
def settings_schema():
    files = sorted((ROOT / "shared/settings/src").glob("*.rs"))
    if not files:
        return None
    src = "\n".join(f.read_text() for f in files)
    structs = {}
    for m in re.finditer(r"pub struct (\w+)\s*\{(.*?)\n\}", src, re.S):
        fields = {}
        for f in re.finditer(r"^\s*pub (\w+):\s*([^\n]+?),?\s*$", m.group(2), re.M):
            fields[f.group(1)] = f.group(2).strip().rstrip(",")
        structs[m.group(1)] = fields
    return structs if "Settings" in structs else None


SCHEMA = settings_schema()


def inner_type(t):
    while True:
        m = re.fullmatch(r"(?:Option|Vec)<(.*)>", t.strip())
        if not m:
            return t.strip()
        t = m.group(1)


# Keys the deployment files already set for code that is being written now: accepted with a
# NOTE while shared/settings does not have them yet, an error-free no-op once it has. The live
# run leaves them out of the files it gives the binaries until then.
PENDING_KEYS = set()
PENDING_SEEN = set()


def pending_known():
    """Pending keys the settings now have (the list above can lose them)."""
    return sorted(f"{s}.{k}" for (s, k) in PENDING_KEYS if k in (SCHEMA or {}).get(s, {}))


def toml_key_errors(data, struct="Settings", path=""):
    errors = []
    fields = SCHEMA.get(struct, {})
    for key, value in data.items():
        if key not in fields:
            if (struct, key) in PENDING_KEYS:
                PENDING_SEEN.add(f"{struct}.{key}")
                continue
            errors.append(f"{path}{key}: not a setting (struct {struct} has {', '.join(sorted(fields))})")
            continue
        sub = inner_type(fields[key])
        if sub in SCHEMA:
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if isinstance(item, dict):
                    where = f"{path}{key}[{i}]." if isinstance(value, list) else f"{path}{key}."
                    errors += toml_key_errors(item, sub, where)
    return errors


def strip_pending(data, struct="Settings"):
    """A copy of a settings document without the pending keys the code does not know yet."""
    fields = SCHEMA.get(struct, {})
    out = {}
    for key, value in data.items():
        if key not in fields and (struct, key) in PENDING_KEYS:
            continue
        sub = inner_type(fields.get(key, ""))
        if sub in SCHEMA and isinstance(value, dict):
            value = strip_pending(value, sub)
        elif sub in SCHEMA and isinstance(value, list):
            value = [strip_pending(v, sub) if isinstance(v, dict) else v for v in value]
        out[key] = value
    return out


def env_key_errors(name):
    """SHELFSYNC__SECTION__KEY must name a real setting."""
    if not name.startswith("SHELFSYNC__"):
        return []
    parts = name[len("SHELFSYNC__"):].lower().split("__")
    struct = "Settings"
    for i, part in enumerate(parts):
        fields = SCHEMA.get(struct, {})
        if part not in fields:
            return [f"{name}: `{'.'.join(parts[:i + 1])}` is not a setting"]
        struct = inner_type(fields[part])
    return []


# What each workload reads, by section: the settings files it mounts must hold nothing else, so
# that a change of one part (a partner, storage's own settings) restarts only the workloads that
# read it. "common" is the file every workload mounts.
FILE_SECTIONS = {
    "shelfsync.toml": {"nats", "redis", "storage.partitions", "telemetry"},
    "storage.toml": {"storage", "redis.wait_replicas", "redis.wait_timeout"},
    "ingest.toml": {"partners", "ingest"},
}


def section_errors(name, data):
    allowed = FILE_SECTIONS.get(name)
    if allowed is None:
        return [f"{name}: not one of the settings files {sorted(FILE_SECTIONS)}"]
    errors = []
    for section, value in data.items():
        if section in allowed:
            continue
        keys = value.keys() if isinstance(value, dict) else []
        stray = [k for k in keys if f"{section}.{k}" not in allowed]
        if not keys or stray:
            errors.append(f"{name}: [{section}] {', '.join(stray) or ''} belongs in another file "
                          f"(this one holds {', '.join(sorted(allowed))})")
    return errors


def settings_files():
    return sorted([*ROOT.glob("compose/config/*.toml"), *ROOT.glob("k8s/base/config/*.toml")])


def toml_file(path):
    return tomllib.loads(path.read_text())


def check_settings_files():
    if SCHEMA is None:
        skip("settings files", "shared/settings/src/*.rs not found or not parseable")
        return
    if tomllib is None:
        skip("settings files", "Python >= 3.11 (tomllib) needed")
        return
    for path in settings_files():
        f = str(path.relative_to(ROOT))
        errors = []
        try:
            data = toml_file(path)
        except Exception as e:  # noqa: BLE001
            fail(f"{f}: TOML", e)
            continue
        errors += toml_key_errors(data)
        errors += section_errors(path.name, data)
        if data.get("nats", {}).get("prefix", PREFIX) != PREFIX:
            errors.append(f"nats.prefix must be `{PREFIX}`: the NATS permissions are written for it")
        if "url" in data.get("redis", {}) and "@" in data["redis"]["url"]:
            errors.append("redis.url carries a password: set it through env from a Secret")
        for p in data.get("partners", []):
            for k in ("name", "brand_id", "kind"):
                if k not in p:
                    errors.append(f"partner {p.get('name', '?')}: `{k}` is required")
            if not (p.get("push_tokens_file") or p.get("push_tokens_env")):
                errors.append(f"partner {p.get('name', '?')}: push_tokens_file (or push_tokens_env) is not set")
            for k in ("push_tokens", "tokens", "token"):
                if k in p:
                    errors.append(f"partner {p.get('name', '?')}: tokens never go into a settings file")
        check(f"{f}: keys are settings of shared/settings, in the file of the workloads that read them", errors)

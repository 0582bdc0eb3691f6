"""Sizes as the deployment files write them, in bytes: nats-server's ("20GiB", "20GB" are
1024-based, "20G" is 1000-based, "10Gi"), Kubernetes quantities ("2Gi", "512M") and Redis's
("1200mb" is 1024-based, "1200m" 1000-based)."""
import re

_NATS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
         "kb": 1024, "mb": 1024**2, "gb": 1024**3, "tb": 1024**4,
         "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4,
         "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_K8S = {"": 1, "k": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
        "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4}


def _split(text):
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m:
        raise ValueError(f"not a size: {text!r}")
    return float(m.group(1)), m.group(2)


def nats_size(text):
    if isinstance(text, int):
        return text
    n, unit = _split(text)
    if unit.lower() not in _NATS:
        raise ValueError(f"unknown nats-server size unit in {text!r}")
    return int(n * _NATS[unit.lower()])


def redis_size(text):
    if isinstance(text, int):
        return text
    n, unit = _split(text)
    units = {"": 1, "k": 1000, "kb": 1024, "m": 1000**2, "mb": 1024**2, "g": 1000**3, "gb": 1024**3}
    if unit.lower() not in units:
        raise ValueError(f"unknown Redis size unit in {text!r}")
    return int(n * units[unit.lower()])


def k8s_quantity(text):
    if isinstance(text, int):
        return text
    n, unit = _split(text)
    if unit not in _K8S:
        raise ValueError(f"unknown Kubernetes quantity suffix in {text!r}")
    return int(n * _K8S[unit])


def docker_size(text):
    """compose's mem_limit: b, k, m, g (all 1024-based)."""
    if isinstance(text, int):
        return text
    n, unit = _split(text)
    units = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2, "g": 1024**3, "gb": 1024**3}
    if unit.lower() not in units:
        raise ValueError(f"unknown compose size unit in {text!r}")
    return int(n * units[unit.lower()])

"""Prometheus Operator objects (PodMonitor, ServiceMonitor, PrometheusRule, ...) and KEDA objects
(ScaledObject) against their own CRD schemas, strictly: an object field the CRD does not declare is an error, as
`kubectl apply --validate=strict` makes it.

Why not kubernetes-validate: it validates only against the schemas it ships (Kubernetes' built-in
kinds) and takes no CRD; an unknown kind is a warning there, not an error. Why npm: no registry
reached here ships the operator's CRD YAML, but the npm package
@kubernetes-models/prometheus-operator 5.0.1 was generated from the CRDs of operator release
v0.90.1 (validators compiled from their openAPIV3Schema, and TypeScript declarations of it); the
npm package @kubernetes-models/keda 2.0.0 the same way from KEDA's API types (keda.sh/v1alpha1,
github.com/kedacore/keda/v2/apis/keda/v1alpha1). crdcheck/check.mjs runs them under Node.js; `scripts/install-deps.sh --deploy-tools` installs
them, pinned by crdcheck/package-lock.json, into the virtualenv's directory crdcheck/."""
import json
import os
import pathlib
import shutil
import subprocess

from .core import ROOT

OPERATOR_VERSION = "v0.90.1"  # the CRDs the pinned npm package was generated from
SCRIPT = pathlib.Path(__file__).resolve().parent / "crdcheck" / "check.mjs"
PACKAGE = "@kubernetes-models/prometheus-operator"
KEDA_PACKAGE = "@kubernetes-models/keda"
# API group -> the npm package with its CRD schemas (the same map as crdcheck/check.mjs).
PACKAGES = {"monitoring.coreos.com": PACKAGE, "keda.sh": KEDA_PACKAGE}


def is_custom(doc):
    """An object of a CRD this check knows (and kubernetes-validate does not)."""
    return str(doc.get("apiVersion", "")).split("/")[0] in PACKAGES
MIN_NODE = 18  # ES modules, structuredClone


def deps_dir():
    """Where install-deps put the npm packages: CRDCHECK_DIR, else beside the virtualenv the
    shell scripts use (SHELFSYNC_VENV, ${CARGO_TARGET_DIR:-target}/venv)."""
    if os.environ.get("CRDCHECK_DIR"):
        return pathlib.Path(os.environ["CRDCHECK_DIR"])
    venv = os.environ.get("SHELFSYNC_VENV") or os.path.join(os.environ.get("CARGO_TARGET_DIR") or "target", "venv")
    venv = pathlib.Path(venv)
    return (venv if venv.is_absolute() else ROOT / venv) / "crdcheck"


def _node_major(node):
    try:
        out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout
        return int(out.strip().lstrip("v").split(".")[0])
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def unavailable():
    """Why the check cannot run here (None: it can)."""
    node = shutil.which("node")
    if not node:
        return "no node (Node.js) on PATH (scripts/install-deps.sh --deploy-tools installs Debian's nodejs)"
    major = _node_major(node)
    if major is None or major < MIN_NODE:
        return f"node {major} is older than {MIN_NODE}"
    for package in PACKAGES.values():
        if not (deps_dir() / "node_modules" / package / "package.json").is_file():
            return f"{package} is not installed in {deps_dir()} (scripts/install-deps.sh --deploy-tools)"
    return None


def available():
    return unavailable() is None


def _label(doc):
    return f"{doc.get('kind')} {(doc.get('metadata') or {}).get('name')}"


def errors(docs):
    """Validation errors of each object, in order (an empty list: valid). One Node.js run for all."""
    r = subprocess.run(["node", str(SCRIPT), str(deps_dir())], input=json.dumps(docs),
                       capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"crdcheck/check.mjs failed: {r.stderr.strip() or r.stdout.strip()}")
    results = json.loads(r.stdout)
    return [[f"{_label(d)}: {e['path']}: {e['message'][:300]}" for e in found] for d, found in zip(docs, results)]


def errors_of(doc):
    """Validation errors of one object (an empty list: valid)."""
    return errors([doc])[0]

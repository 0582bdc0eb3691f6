"""Prometheus Operator objects (PodMonitor, ServiceMonitor, PrometheusRule) against the
operator's CRD schemas. kubernetes-validate knows only the built-in kinds; the schemas here come
from the PyPI package cloudcoil-models-prometheus-operator (models generated from the
operator's CRDs), made strict: an object property the CRD does not define is an error, as
`kubectl apply --validate=strict` would make it."""
import copy

KINDS = ("PodMonitor", "ServiceMonitor", "PrometheusRule")


def _strict(node):
    if isinstance(node, dict):
        if "properties" in node and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for v in node.values():
            _strict(v)
    elif isinstance(node, list):
        for v in node:
            _strict(v)
    return node


_SCHEMAS = {}


def schema(kind):
    """The strict JSON schema of a kind, or None when the models are not installed."""
    if kind not in _SCHEMAS:
        try:
            from cloudcoil.models.prometheus_operator import v1
        except ImportError:
            return None
        model = getattr(v1, kind)
        _SCHEMAS[kind] = _strict(copy.deepcopy(model.model_json_schema(by_alias=True, mode="validation")))
    return _SCHEMAS[kind]


def available():
    return schema("PrometheusRule") is not None


def errors_of(doc):
    """Validation errors of one object (an empty list: valid)."""
    import jsonschema

    s = schema(doc.get("kind"))
    if s is None:
        return [f"{doc.get('kind')}: no schema"]
    if doc.get("apiVersion") != "monitoring.coreos.com/v1":
        return [f"{doc.get('kind')} {doc.get('metadata', {}).get('name')}: apiVersion must be monitoring.coreos.com/v1"]
    validator = jsonschema.Draft202012Validator(s)
    out = []
    for e in sorted(validator.iter_errors(doc), key=lambda e: list(e.absolute_path)):
        where = ".".join(str(p) for p in e.absolute_path) or "(root)"
        out.append(f"{doc['kind']} {doc.get('metadata', {}).get('name')}: {where}: {e.message[:300]}")
    return out

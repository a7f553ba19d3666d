"""Reading deploy/k8s for its tests: the manifests, the kept CRD schemas (made strict the way
the API server's pruning and strict field validation treat unknown fields), Kubernetes'
$(VAR) expansion of container args, and the metric names inside PromQL expressions."""

from __future__ import annotations

import copy
import functools
import json
import re
import time
from pathlib import Path

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
SCHEMAS = K8S / "schemas"
KUBERNETES_VERSION = "1.31"  # kubernetes-validate's schemas to check the core kinds against

_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# a metric name of jaxserve's own namespaces; PromQL allows ':' in metric names
_METRIC = re.compile(r"(?<![\w:])((?:vllm|jaxserve):[A-Za-z_:][A-Za-z0-9_:]*)")


@functools.cache
def manifests() -> tuple[tuple[str, dict], ...]:
    """(path under deploy/k8s, document) of every YAML manifest, the kept schemas aside
    (read once: copy a document before changing it)."""
    found = []
    for path in sorted(K8S.rglob("*.yaml")):
        if SCHEMAS in path.parents:
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((str(path.relative_to(K8S)), doc))
    return tuple(found)


def find(kind: str, name: str | None = None) -> dict:
    """The one manifest of `kind` (and `name`)."""
    docs = [d for _, d in manifests()
            if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(docs) == 1, f"expected one {kind} {name or ''}, found {len(docs)}"
    return docs[0]


def dashboard() -> dict:
    return json.loads((K8S / "monitoring" / "grafana-dashboard.json").read_text())


@functools.cache
def crd_kinds() -> dict[str, Path]:
    """kind → the kept CRD file that defines it."""
    kinds = {}
    for path in sorted(SCHEMAS.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                kinds[doc["spec"]["names"]["kind"]] = path
    return kinds


@functools.cache
def crd_schema(api_version: str, kind: str) -> dict:
    """The strict openAPIV3Schema that the kept CRD of `kind` serves for `api_version`
    (checked against JSON Schema's metaschema)."""
    for doc in yaml.safe_load_all(crd_kinds()[kind].read_text()):
        if not doc or doc.get("kind") != "CustomResourceDefinition":
            continue
        group = doc["spec"]["group"]
        for version in doc["spec"]["versions"]:
            if f"{group}/{version['name']}" == api_version and version["served"]:
                schema = strict(version["schema"]["openAPIV3Schema"])
                jsonschema.Draft202012Validator.check_schema(schema)
                return schema
    raise LookupError(f"the kept {kind} CRD serves no {api_version}")


def strict(schema: dict) -> dict:
    """`schema` with unknown fields rejected wherever the CRD lists an object's properties
    (the API server drops such fields, or refuses them under strict field validation),
    except where it says x-kubernetes-preserve-unknown-fields; patterns in Python's syntax."""
    schema = copy.deepcopy(schema)

    def visit(node):
        if not isinstance(node, dict):
            return
        if "pattern" in node:  # Go's RE2 takes "^(?i)..."; Python wants the flags first
            node["pattern"] = re.sub(r"^\^(\(\?[a-z]+\))", r"\1^", node["pattern"])
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False
        for child in node.get("properties", {}).values():
            visit(child)
        for key in ("items", "additionalProperties"):
            visit(node.get(key))
        for key in ("anyOf", "allOf", "oneOf"):
            for child in node.get(key, []):
                visit(child)

    visit(schema)
    return schema


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' expansion of $(NAME) in a container's command and args; here a name
    missing from `env` is an error (Kubernetes would pass it on verbatim)."""
    def value(match):
        if match.group(1) not in env:
            raise KeyError(f"$({match.group(1)}) is not in the container's environment")
        return env[match.group(1)]
    return [_VAR.sub(value, arg) for arg in args]


def metric_names(expr: str) -> set[str]:
    """The vllm:* and jaxserve:* metric names a PromQL expression reads."""
    return set(_METRIC.findall(expr))


def promql_expressions() -> dict[str, str]:
    """where → PromQL, for every query in the dashboard, the alert rules and the autoscaler."""
    exprs = {}
    board = dashboard()
    for panel in board["panels"]:
        for target in panel["targets"]:
            exprs[f"dashboard {panel['title']!r} {target['refId']}"] = target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            exprs[f"dashboard variable {variable['name']}"] = variable["query"]["query"]
    for group in find("PrometheusRule")["spec"]["groups"]:
        for rule in group["rules"]:
            exprs[f"rule {rule.get('alert') or rule.get('record')}"] = str(rule["expr"])
    for trigger in find("ScaledObject")["spec"]["triggers"]:
        exprs[f"ScaledObject trigger {trigger['type']}"] = trigger["metadata"]["query"]
    return exprs


def wait_until(condition, timeout: float, message, interval: float = 0.1) -> None:
    """Poll `condition` until it holds; after `timeout` seconds fail with `message()`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(interval)
    raise AssertionError(message())

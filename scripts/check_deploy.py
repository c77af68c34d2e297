#!/usr/bin/env python3
"""Checks deploy/: the Kubernetes manifests and the Grafana dashboard.

- Every manifest parses as YAML and each built-in resource validates against Kubernetes' own
  schemas (strict: unknown fields are errors), through kubernetes-validate; the
  ServiceMonitor (a CRD, which has no schema there) against the fields of the Prometheus
  Operator's ServiceMonitor that it uses.
- The pieces fit: the Service selects the DaemonSet's pods and targets a port they declare, the
  ServiceMonitor selects the Service and scrapes a port it names, the exporter gets the host's
  pid namespace and a read-only /dev/shm.
- The dashboard parses, and every PromQL expression in it names only metrics that
  `cistern export --list-metrics` lists, groups and joins only on labels those metrics carry
  (or `node`, which the ServiceMonitor adds).

Usage: check_deploy.py METRICS_LIST DEPLOY_DIR (scripts/check-deploy.sh runs it).
"""

import glob
import json
import os
import re
import sys

import kubernetes_validate
import jsonschema
import yaml

KUBERNETES_VERSION = "1.30.0"
# Labels Prometheus or the ServiceMonitor put on every series.
TARGET_LABELS = {"node", "instance", "job"}

errors = []


def fail(msg):
    errors.append(msg)


# ------------------------------------------------------------------------------------------
# PromQL


PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
    "bool", "offset", "inf", "nan",
}


def promql_parts(expr):
    """The metric names an expression selects, and the labels it groups or joins on and
    matches in selectors: (metrics, labels)."""
    labels = set()
    # Strings first (they may hold anything), then label matchers, ranges, grouping clauses.
    no_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    for block in re.findall(r"\{([^}]*)\}", no_strings):
        labels.update(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)", block))
    s = re.sub(r"\{[^}]*\}", " ", no_strings)
    s = re.sub(r"\[[^\]]*\]", " ", s)
    for clause in re.findall(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", s
    ):
        labels.update(x.strip() for x in clause.split(",") if x.strip())
    s = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    metrics = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", s):
        name = m.group(0)
        rest = s[m.end():].lstrip()
        if rest.startswith("("):
            continue  # a function or an aggregation
        if name.lower() in PROMQL_KEYWORDS:
            continue
        if m.start() > 0 and (s[m.start() - 1].isdigit() or s[m.start() - 1] == "."):
            continue  # a number's exponent or a duration's unit
        metrics.add(name)
    return metrics, labels


def self_test():
    m, l = promql_parts(
        'sum by (namespace, pod) (rate(cistern_a_bytes{node=~"$node", x="a{b}"}[5m])) '
        '- on(UUID) group_left cistern_b_bytes * 1e3 or vector(0)'
    )
    assert m == {"cistern_a_bytes", "cistern_b_bytes"}, m
    assert l == {"namespace", "pod", "node", "x", "UUID"}, l
    m, _ = promql_parts("count(cistern_c == 1) and on(pid) bogus_metric")
    assert m == {"cistern_c", "bogus_metric"}, m


def dashboard_exprs(node, where="dashboard"):
    """Every PromQL expression in a dashboard: panel targets (nested rows included) and
    query variables."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k == "expr" and isinstance(v, str):
                yield where, v
            elif k == "definition" and isinstance(v, str):
                # label_values(metric, label): the metric and the label.
                m = re.fullmatch(r"\s*label_values\(\s*([a-zA-Z_:][\w:]*)\s*,\s*(\w+)\s*\)\s*", v)
                if m:
                    yield where, '%s{%s=""}' % (m.group(1), m.group(2))
                else:
                    yield where, v
            else:
                title = node.get("title") if isinstance(node.get("title"), str) else None
                yield from dashboard_exprs(v, title or where)
    elif isinstance(node, list):
        for v in node:
            yield from dashboard_exprs(v, where)


def check_dashboard(path, metrics):
    with open(path) as f:
        dash = json.load(f)
    all_labels = set(TARGET_LABELS)
    for labels in metrics.values():
        all_labels |= labels
    exprs = list(dashboard_exprs(dash))
    if not exprs:
        fail(f"{path}: no PromQL expression found")
    for where, expr in exprs:
        names, labels = promql_parts(expr)
        if not names:
            fail(f"{path}: panel {where!r}: {expr!r} selects no metric")
        for n in names:
            if n not in metrics:
                fail(f"{path}: panel {where!r}: {n} is not a metric cistern export emits")
        for lab in labels:
            if lab not in all_labels:
                fail(f"{path}: panel {where!r}: label {lab!r} is on no metric cistern export emits")
    ids = [p.get("id") for p in dash.get("panels", [])]
    if len(ids) != len(set(ids)):
        fail(f"{path}: panel ids repeat: {ids}")
    for p in dash.get("panels", []):
        if p.get("type") != "row" and "datasource" not in p:
            fail(f"{path}: panel {p.get('title')!r} names no data source")
    return len(exprs)


# ------------------------------------------------------------------------------------------
# Kubernetes

SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}
                    },
                    "additionalProperties": False,
                },
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "jobLabel": {"type": "string"},
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                            "scrapeTimeout": {"type": "string", "pattern": "^([0-9]+(ms|s|m|h))+$"},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "sourceLabels": {"type": "array", "items": {"type": "string"}},
                                        "separator": {"type": "string"},
                                        "targetLabel": {"type": "string"},
                                        "regex": {"type": "string"},
                                        "replacement": {"type": "string"},
                                        "modulus": {"type": "integer"},
                                        "action": {
                                            "enum": [
                                                "replace", "keep", "drop", "hashmod", "labelmap",
                                                "labeldrop", "labelkeep", "lowercase", "uppercase",
                                                "keepequal", "dropequal",
                                            ]
                                        },
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


def subset(small, big):
    return all(big.get(k) == v for k, v in (small or {}).items())


def check_manifests(deploy):
    docs = []
    files = sorted(glob.glob(os.path.join(deploy, "kubernetes", "*.yaml")))
    if not files:
        fail(f"{deploy}/kubernetes: no manifests")
    for path in files:
        with open(path) as f:
            try:
                loaded = [d for d in yaml.safe_load_all(f) if d is not None]
            except yaml.YAMLError as e:
                fail(f"{path}: not YAML: {e}")
                continue
        for d in loaded:
            docs.append((path, d))
            if d.get("kind") == "ServiceMonitor":
                try:
                    jsonschema.validate(d, SERVICE_MONITOR_SCHEMA)
                except jsonschema.ValidationError as e:
                    fail(f"{path}: ServiceMonitor: {e.message} at {list(e.absolute_path)}")
                continue
            try:
                kubernetes_validate.validate(d, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as e:
                fail(f"{path}: {d.get('kind')} {d.get('metadata', {}).get('name')}: "
                     f"{e.message} at {'.'.join(str(p) for p in e.path)}")
            except kubernetes_validate.SchemaNotFoundError as e:
                fail(f"{path}: {e.message}")

    def one(kind):
        found = [d for _, d in docs if d.get("kind") == kind]
        if len(found) != 1:
            fail(f"expected one {kind}, found {len(found)}")
            return None
        return found[0]

    ds, svc, sm = one("DaemonSet"), one("Service"), one("ServiceMonitor")
    if not (ds and svc and sm):
        return len(docs)
    pod = ds["spec"]["template"]
    if not subset(ds["spec"]["selector"].get("matchLabels"), pod["metadata"].get("labels", {})):
        fail("DaemonSet: its selector does not select its own pods")
    if not pod["spec"].get("hostPID"):
        fail("DaemonSet: hostPID must be true (records and NVML name host pids)")
    container = pod["spec"]["containers"][0]
    if container.get("args", [])[:1] != ["export"]:
        fail("DaemonSet: the container must run `cistern export`")
    shm_volumes = {v["name"] for v in pod["spec"].get("volumes", [])
                   if v.get("hostPath", {}).get("path") == "/dev/shm"}
    mounts = [m for m in container.get("volumeMounts", []) if m["name"] in shm_volumes]
    if not mounts or not all(m.get("readOnly") for m in mounts):
        fail("DaemonSet: the host's /dev/shm must be mounted, read-only")
    ports = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    if not subset(svc["spec"].get("selector"), pod["metadata"].get("labels", {})):
        fail("Service: its selector does not select the DaemonSet's pods")
    svc_ports = {p.get("name") for p in svc["spec"]["ports"]}
    for p in svc["spec"]["ports"]:
        t = p.get("targetPort")
        if isinstance(t, str) and t not in ports:
            fail(f"Service: targetPort {t!r} is not a port of the DaemonSet's container")
    if not subset(sm["spec"]["selector"].get("matchLabels"), svc["metadata"].get("labels", {})):
        fail("ServiceMonitor: its selector does not select the Service")
    names = sm["spec"].get("namespaceSelector", {}).get("matchNames")
    if names is not None and svc["metadata"].get("namespace") not in names:
        fail("ServiceMonitor: its namespaceSelector leaves out the Service's namespace")
    for e in sm["spec"]["endpoints"]:
        if e.get("port") not in svc_ports:
            fail(f"ServiceMonitor: endpoint port {e.get('port')!r} is not a port of the Service")
        if e.get("path", "/metrics") != "/metrics":
            fail("ServiceMonitor: the exporter serves /metrics")
    return len(docs)


def read_metrics(path):
    """`cistern export --list-metrics`: name, type, labels, help, tab-separated."""
    metrics = {}
    with open(path) as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) != 4:
                continue
            labels = {x.strip().rstrip("?") for x in parts[2].split(",") if x.strip()}
            metrics[parts[0]] = labels
    return metrics


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    self_test()
    metrics = read_metrics(sys.argv[1])
    if len(metrics) < 10:
        print(f"check-deploy: {sys.argv[1]} lists {len(metrics)} metrics: is it "
              "`cistern export --list-metrics`?", file=sys.stderr)
        return 2
    deploy = sys.argv[2]
    n_docs = check_manifests(deploy)
    n_exprs = 0
    dashboards = sorted(glob.glob(os.path.join(deploy, "grafana", "*.json")))
    if not dashboards:
        fail(f"{deploy}/grafana: no dashboard")
    for d in dashboards:
        n_exprs += check_dashboard(d, metrics)
    for e in errors:
        print(f"check-deploy: {e}", file=sys.stderr)
    if errors:
        return 1
    print(f"check-deploy: {n_docs} Kubernetes resources valid (schemas of Kubernetes "
          f"{KUBERNETES_VERSION}); {n_exprs} PromQL expressions in {len(dashboards)} "
          f"dashboard(s) name only the exporter's {len(metrics)} metrics")
    return 0


if __name__ == "__main__":
    sys.exit(main())

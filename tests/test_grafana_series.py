"""The Grafana dashboards (deploy/grafana) and Prometheus rules (deploy/prometheus/rules.yml) query
series the services really export.

The series are collected from the services' own Prometheus registries: every module of
`services` is imported (each registers its metrics as it does in its process) and the simulated
engine's registry is built (it exports SGLang's `sglang:*` names, as SGLang does). Each panel's
PromQL is read for the metric names it selects, the label names it matches on and the labels it
groups by; every one must exist. Recording rules' names count as series, the way Prometheus makes
them.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

ROOT = Path(__file__).resolve().parents[1]
DASHBOARDS = sorted((ROOT / "deploy" / "grafana").glob("*.json"))
RULES = ROOT / "deploy" / "prometheus" / "rules.yml"
SCRAPE_LABELS = {"instance", "job"}  # added by Prometheus to every scraped series
# Series the rules read that no inferbus service exports: Prometheus' own and kube-state-metrics'.
OTHERS = {"up": {"job", "instance"},
          "kube_pod_container_status_last_terminated_exitcode": {"namespace", "pod", "container", "reason"}}

_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_count", "_sum", "_created"),
             "summary": ("", "_count", "_sum", "_created"), "gauge": ("",), "info": ("_info",), "enum": ("",)}


def _wrappers(registry: CollectorRegistry) -> list[MetricWrapperBase]:
    return [c for c in registry._collector_to_names if isinstance(c, MetricWrapperBase)]  # noqa: SLF001


def exported_series() -> dict[str, set[str]]:
    """Every series name the services export, with its label names (`le` on buckets)."""
    import services

    for module in pkgutil.walk_packages(services.__path__, "services."):
        importlib.import_module(module.name)
    from services.sim_engine.metrics import EngineMetrics

    engine = EngineMetrics("model")  # a registry per engine, as each engine process has
    series: dict[str, set[str]] = {}
    for registry in (REGISTRY, engine.registry):
        for metric in _wrappers(registry):
            name, kind, labels = metric._name, metric._type, set(metric._labelnames)  # noqa: SLF001
            for suffix in _SUFFIXES[kind]:
                full = name + suffix
                series.setdefault(full, set()).update(labels | ({"le"} if suffix == "_bucket" else set()))
    return series


def recorded_series() -> dict[str, set[str]]:
    """The recording rules' series (their labels: whatever their expression keeps, not checked)."""
    rules = yaml.safe_load(RULES.read_text())
    return {rule["record"]: set() for group in rules["groups"] for rule in group["rules"] if "record" in rule}


_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
             "inf", "nan"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_IDENT = re.compile(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])")


def parse(expr: str) -> tuple[set[str], dict[str, set[str]], set[str]]:
    """(metric names, label names matched per metric, labels grouped by) of a PromQL expression
    (Grafana's `$variables` taken as they are)."""
    text = _STRING.sub('""', expr)
    matched: dict[str, set[str]] = {}
    for name, body in _SELECTOR.findall(text):
        matched.setdefault(name, set()).update(_MATCHER.findall(body))
    grouped = {label.strip() for _, labels in _GROUPING.findall(text) for label in labels.split(",") if label.strip()}
    text = _GROUPING.sub(" ", text)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    names = set()
    for match in _IDENT.finditer(text):
        word = match.group(1)
        following = text[match.end():].lstrip()
        if following.startswith("(") or word.lower() in _KEYWORDS or word.startswith("$"):
            continue  # a function, an aggregation or a keyword
        names.add(word)
    return names, matched, grouped


def dashboard_queries() -> list[tuple[str, str, str]]:
    found = []
    for path in DASHBOARDS:
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                found.append((path.name, panel.get("title", "?"), target["expr"]))
        for variable in dashboard.get("templating", {}).get("list", []):
            query = variable.get("query")
            text = query.get("query", "") if isinstance(query, dict) else str(query or "")
            for metric in re.findall(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*(\w+)\s*\)", text):
                found.append((path.name, f"variable {variable['name']}", f"{metric[0]}{{{metric[1]}=\"\"}}"))
    return found


def rule_queries() -> list[tuple[str, str, str]]:
    rules = yaml.safe_load(RULES.read_text())
    return [(RULES.name, rule.get("record") or rule.get("alert"), rule["expr"])
            for group in rules["groups"] for rule in group["rules"]]


def problems_of(queries: list[tuple[str, str, str]], series: dict[str, set[str]]) -> list[str]:
    problems = []
    for where, title, expr in queries:
        names, matched, grouped = parse(expr)
        for name in sorted(names - set(series)):
            problems.append(f"{where}: {title}: no service exports `{name}`")
        for name, labels in matched.items():
            if name in series and series[name]:
                for label in sorted(labels - series[name] - SCRAPE_LABELS):
                    problems.append(f"{where}: {title}: `{name}` has no label `{label}` ({sorted(series[name])})")
        known = set().union(*(series.get(name, set()) for name in names)) | SCRAPE_LABELS
        if all(series.get(name) for name in names):  # recorded series' labels are not known here
            for label in sorted(grouped - known):
                problems.append(f"{where}: {title}: groups by `{label}`, which none of {sorted(names)} has")
    return problems


@pytest.fixture(scope="module")
def series() -> dict[str, set[str]]:
    return {**exported_series(), **recorded_series(), **OTHERS}


def test_every_dashboard_panel_queries_series_the_services_export(series: dict[str, set[str]]) -> None:
    queries = dashboard_queries()
    assert len(queries) > 40
    problems = problems_of(queries, series)
    assert not problems, "\n".join(problems)


def test_every_prometheus_rule_queries_series_the_services_export(series: dict[str, set[str]]) -> None:
    problems = problems_of(rule_queries(), series)
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_misnamed_series_and_label(series: dict[str, set[str]]) -> None:
    """The check itself: names, matchers and groupings that do not exist are found."""
    good = 'sum by (le, model) (rate(inferbus_ttft_seconds_bucket{band="premium"}[5m]))'
    assert problems_of([("x", "good", good)], series) == []
    assert problems_of([("x", "t", "rate(inferbus_ttft_secs_bucket[5m])")], series)
    assert problems_of([("x", "t", 'rate(inferbus_requests_total{code="500"}[5m])')], series)
    assert problems_of([("x", "t", "sum by (tenant) (rate(inferbus_requests_total[5m]))")], series)
    assert problems_of([("x", "t", "sglang:num_waiting_reqs")], series)
    # functions, keywords, variables and label values are not series
    names, _, grouped = parse('histogram_quantile(0.9, sum by (le) (rate(x_bucket{a=~"b|c"}[$__rate_interval]))) '
                              '> bool 0.8 and on (instance) y offset 5m')
    assert names == {"x_bucket", "y"} and grouped == {"le", "instance"}


def test_the_slo_buckets_of_the_console_are_the_gateways() -> None:
    """The console stores the TTFT and TPOT histograms per bucket index: its bounds must be the gateway's."""
    from services.gateway import metrics
    from services.gateway.console import slo

    assert tuple(metrics.TTFT._upper_bounds[:-1]) == slo.LATENCY_BOUNDS  # noqa: SLF001
    assert tuple(metrics.TPOT._upper_bounds[:-1]) == slo.TPOT_BOUNDS  # noqa: SLF001

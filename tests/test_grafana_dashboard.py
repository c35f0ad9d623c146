"""Every metric the Grafana dashboard (configs/grafana-dashboard.json) queries exists."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from tests.cluster import client, running_cluster, wait_until_idle
from tests.metrics import names

DASHBOARD = Path(__file__).parent.parent / "configs" / "grafana-dashboard.json"

_SUFFIXES = re.compile(r"_(bucket|sum|count|total|created)$")
_KEYWORDS = frozenset(
    {"and", "or", "unless", "offset", "bool", "on", "ignoring", "group_left", "group_right"}
)


def _exprs(node: object) -> list[str]:
    """Every ``expr`` in the dashboard, however deeply its panels nest."""
    if isinstance(node, dict):
        found = [node["expr"]] if isinstance(node.get("expr"), str) else []
        return found + [e for value in node.values() for e in _exprs(value)]
    if isinstance(node, list):
        return [e for item in node for e in _exprs(item)]
    return []


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, labels, ranges left out)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)  # strings: label values
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", text)  # grouping labels
    found = set()
    for match in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        name = match.group()
        rest = text[match.end() :].lstrip()
        if rest.startswith("(") or name in _KEYWORDS:
            continue  # a function or an aggregation
        found.add(name)
    return found


def test_metric_names_are_read_from_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le, model) (rate(pdtrio_x_seconds_bucket{job=~"$j"}'
        "[$__rate_interval]))) / on (model) sum(pdtrio_y_total) and pdtrio_z"
    )
    assert metric_names(expr) == {"pdtrio_x_seconds_bucket", "pdtrio_y_total", "pdtrio_z"}


async def test_every_metric_the_dashboard_names_exists() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = _exprs(dashboard)
    assert len(exprs) >= 20
    wanted = {_SUFFIXES.sub("", name) for expr in exprs for name in metric_names(expr)}
    assert wanted and all(name.startswith("pdtrio_") for name in wanted), wanted
    async with running_cluster(decode_step_s=0.001) as cluster:
        async with client(cluster) as http:
            for stream in (True, False):
                response = await http.post(
                    "/v1/completions",
                    json={"model": "synthetic", "prompt": "hi", "max_tokens": 4, "stream": stream},
                )
                assert response.status_code == 200
            await wait_until_idle(cluster)
            scraped = names((await http.get("/metrics")).text)
        async with httpx.AsyncClient() as http:
            for worker in cluster.workers:
                scraped |= names((await http.get(f"{worker.url}/metrics")).text)
    missing = sorted(wanted - scraped)
    assert not missing, f"the dashboard queries metrics nobody exports: {missing}"

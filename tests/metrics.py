"""Reading a /metrics answer in tests: samples by name and labels (Prometheus text format)."""

from __future__ import annotations

from collections import Counter

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Every sample: its name (with any _total/_bucket suffix), labels and value."""
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def value(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
    return sum(v for n, found, v in samples(text) if n == name and labels.items() <= found.items())


def by_labels(text: str, name: str, *keys: str) -> dict[tuple[str, ...], float]:
    """``name``'s non-zero samples summed by the values of ``keys``."""
    totals: Counter[tuple[str, ...]] = Counter()
    for n, labels, v in samples(text):
        if n == name and v:
            totals[tuple(labels.get(key, "") for key in keys)] += v
    return dict(totals)


def names(text: str) -> set[str]:
    """The metric families' names (``pdtrio_requests`` for ``pdtrio_requests_total``)."""
    return {family.name for family in text_string_to_metric_families(text)}

"""A /metrics endpoint read with Prometheus' own parser, for the tests: a counter's samples are
`<name>_total` and `<name>_created` (a timestamp), so summing every line that starts with a name counts the
timestamp too."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def exposition(address: str) -> str:
    """The /metrics endpoint's text as served."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        return response.read().decode()


def scrape(address: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a /metrics endpoint, keyed by (name, sorted labels)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(exposition(address))
        for sample in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    """One sample's value (0 when absent): `name` as exposed, e.g. a counter's `..._total`."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum of a sample over the label values not given in `labels`."""
    wanted = set(labels.items())
    return sum(v for (sample, have), v in samples.items() if sample == name and wanted <= set(have))


def by_label(samples: dict, name: str, label: str) -> dict[str, float]:
    """A sample's values by the value of one of its labels (e.g. a per-worker gauge by worker)."""
    return {dict(have)[label]: v for (sample, have), v in samples.items() if sample == name}

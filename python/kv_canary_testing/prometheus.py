"""sglang's ``/metrics`` (``--enable-metrics``) read by tests and benchmarks, over loopback."""

from __future__ import annotations

import re

import requests


def sglang_counter(base_url: str, name: str) -> float:
    """The sum of a Prometheus counter over its labels, from sglang's /metrics."""
    session = requests.Session()
    session.trust_env = False  # loopback only
    text = session.get(f"{base_url}/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))

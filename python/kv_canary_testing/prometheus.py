"""Prometheus for tests and benchmarks: sglang's ``/metrics`` (``--enable-metrics``) read over loopback, and a real
``prometheus`` process (Debian's package) scraping a test server with the shipped alert rules loaded."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import requests

from kv_canary_testing.server import free_port


def sglang_counter(base_url: str, name: str) -> float:
    """The sum of a Prometheus counter over its labels, from sglang's /metrics."""
    session = requests.Session()
    session.trust_env = False  # loopback only
    text = session.get(f"{base_url}/metrics", timeout=30).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def prometheus_missing_reason() -> Optional[str]:
    """Why no Prometheus server can run here (None when it can)."""
    if shutil.which("prometheus") is None:
        return ("the prometheus binary is not installed (Debian: apt-get install prometheus; .ci/run installs it "
                "when it runs as root with apt-get)")
    return None


class PrometheusServer:
    """A ``prometheus`` process on 127.0.0.1 scraping ``targets`` every ``interval`` and evaluating ``rule_files``
    as often; its config and TSDB in ``workdir``, its output in ``workdir/prometheus.log``."""

    def __init__(self, workdir: Path, targets: Sequence[str], rule_files: Sequence[Path] = (), interval: str = "1s"):
        self.workdir = Path(workdir)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.targets, self.rule_files, self.interval = list(targets), [Path(p) for p in rule_files], interval
        self.proc: Optional[subprocess.Popen] = None
        self._session = requests.Session()
        self._session.trust_env = False  # loopback only

    def config(self) -> str:
        rules = "".join(f"\n  - {p.resolve()}" for p in self.rule_files)
        targets = ", ".join(f"'{t}'" for t in self.targets)
        return (f"global:\n  scrape_interval: {self.interval}\n  evaluation_interval: {self.interval}\n"
                f"rule_files:{rules or ' []'}\n"
                f"scrape_configs:\n  - job_name: sglang\n    static_configs:\n      - targets: [{targets}]\n")

    def start(self, timeout: float = 60.0) -> "PrometheusServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(self.config())
        log = open(self.workdir / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1d"],
            stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited ({self.proc.returncode}): {self.log_tail()}")
            try:
                if self._session.get(self.base_url + "/-/ready", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready within {timeout}s: {self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)

    def log_tail(self, chars: int = 3000) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def api(self, path: str, **params) -> Dict:
        """GET /api/v1/PATH; the ``data`` of a successful answer, else RuntimeError with Prometheus' error."""
        r = self._session.get(f"{self.base_url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        if r.status_code != 200 or body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {r.status_code} {body.get('errorType')}: "
                               f"{body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> List[Dict]:
        """An instant query's result vector (or matrix/scalar as Prometheus returns it)."""
        return self.api("query", query=expr)["result"]

    def value(self, expr: str) -> Optional[float]:
        """The single sample an instant query returns (None when it returns none)."""
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def alerts(self, prefix: str = "") -> List[Dict]:
        """Active alerts (pending or firing) whose name starts with ``prefix``."""
        return [a for a in self.api("alerts")["alerts"] if a["labels"]["alertname"].startswith(prefix)]

    def rules(self) -> List[Dict]:
        return [r for g in self.api("rules")["groups"] for r in g["rules"]]

    def wait_for(self, what: str, check, timeout: float = 60.0, every: float = 0.5):
        """Poll ``check()`` until it returns something truthy (returned); RuntimeError naming ``what`` on timeout."""
        deadline = time.monotonic() + timeout
        while True:
            got = check()
            if got:
                return got
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus: {what}: not within {timeout}s")
            time.sleep(every)

"""A real Prometheus scrapes a running serve, and PromQL reads its latency histograms.

Needs the `prometheus` binary (Debian's package `prometheus`; .ci/run installs it where
it can); skipped without it.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from api.conftest import free_port

pytestmark = pytest.mark.prometheus

PROMETHEUS = shutil.which("prometheus")
SCRAPE_INTERVAL = "500ms"


@pytest.fixture
def prometheus(server, tmp_path: Path):
    if PROMETHEUS is None:
        pytest.skip("no prometheus binary (apt-get install prometheus)")
    target = server.url.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n"
        f"  scrape_interval: {SCRAPE_INTERVAL}\n"
        "scrape_configs:\n"
        "  - job_name: serve\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n"
    )
    port = free_port()
    log = (tmp_path / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _query(url, 'up{job="serve"}') == 1.0, "the first scrape", tmp_path)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
        log.close()


def _query(url: str, promql: str) -> float | None:
    """The single value of an instant query, None while it has none."""
    try:
        reply = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5).json()
    except httpx.TransportError:
        return None
    assert reply["status"] == "success", reply
    result = reply["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def _wait_for(ready, what: str, tmp_path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            log = (tmp_path / "prometheus.log").read_text(errors="replace")
            raise AssertionError(f"Prometheus: no {what} after {timeout_s:.0f} s:\n{log[-3000:]}")
        time.sleep(0.2)


def test_promql_reads_time_to_first_token_quantiles(server, prometheus, tmp_path):
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    slowest = 0.0
    for _ in range(4):
        start = time.perf_counter()
        assert httpx.post(f"{server.v1}/completions", json=body, timeout=60).status_code == 200
        slowest = max(slowest, time.perf_counter() - start)

    p50 = "histogram_quantile(0.5, sum by (le) (rate(serve_time_to_first_token_seconds_bucket[1m])))"

    def has_quantile() -> bool:
        value = _query(prometheus, p50)
        return value is not None and not math.isnan(value)

    _wait_for(has_quantile, "TTFT quantile", tmp_path)
    value = _query(prometheus, p50)
    assert value is not None
    # Within the histogram's buckets, and no later than the slowest whole request, up
    # to the bucket it falls in (histogram_quantile interpolates inside a bucket).
    assert 0 < value <= max(slowest, 0.25) * 4
    finished = 'sum(serve_request_success_total{finished_reason="length"})'
    _wait_for(lambda: (_query(prometheus, finished) or 0) >= 4, "count of 4 requests", tmp_path)

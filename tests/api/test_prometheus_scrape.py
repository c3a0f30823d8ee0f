"""A real Prometheus scrapes a running serve, and PromQL reads its latency histograms.

Needs the `prometheus` binary (Debian's package `prometheus`; .ci/run installs it where
it can); skipped without it.
"""

from __future__ import annotations

import json
import math
import re
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


@pytest.fixture(scope="module")
def prometheus_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("prometheus")


@pytest.fixture(scope="module")
def prometheus(server, prometheus_dir: Path):
    """A Prometheus scraping `server` every 500 ms, for this module's tests in turn."""
    if PROMETHEUS is None:
        pytest.skip("no prometheus binary (apt-get install prometheus)")
    tmp_path = prometheus_dir
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
        response = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5)
    except httpx.TransportError:
        return None
    if response.status_code == 503:  # "Service Unavailable": still opening its storage
        return None
    reply = response.json()
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


def test_promql_reads_time_to_first_token_quantiles(server, prometheus, prometheus_dir):
    tmp_path = prometheus_dir
    body = {"model": server.model, "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}
    slowest = 0.0
    for _ in range(4):
        start = time.perf_counter()
        assert httpx.post(f"{server.v1}/completions", json=body, timeout=60).status_code == 200
        slowest = max(slowest, time.perf_counter() - start)

    p50 = (
        "histogram_quantile(0.5, sum by (le) (rate(serve_time_to_first_token_seconds_bucket[1m])))"
    )

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


DASHBOARD = Path(__file__).resolve().parents[2] / "docker/grafana/dashboards/serve.json"


def test_every_dashboard_query_reads_serve_series(server, prometheus, prometheus_dir):
    """The Grafana dashboard's queries are valid PromQL over series serve exports: each
    one, with Grafana's variables filled in, answers with data from the scraped server."""
    body = {"model": server.model, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
    assert httpx.post(f"{server.v1}/completions", json=body, timeout=60).status_code == 200
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(exprs) >= 15
    names = {n for e in exprs for n in re.findall(r"\bserve_[a-z0-9_]+", e)}
    for wanted in (
        "serve_time_to_first_token_seconds_bucket",
        "serve_inter_token_latency_seconds_bucket",
        "serve_e2e_request_latency_seconds_bucket",
        "serve_num_requests_waiting",
        "serve_kv_cache_usage_perc",
        "serve_num_preemptions_total",
        "serve_generation_tokens_total",
    ):
        assert wanted in names, f"the dashboard shows no {wanted}"

    def unanswered() -> list[str]:
        empty = []
        for expr in exprs:
            promql = expr.replace("$__rate_interval", "1m").replace("$model_name", ".*")
            reply = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=5)
            assert reply.status_code == 200, f"{expr}: {reply.text}"  # valid PromQL
            if not reply.json()["data"]["result"]:
                empty.append(expr)
        return empty

    # Rates answer once two scrapes in the window have seen the series.
    _wait_for(lambda: not unanswered(), "answer to every dashboard query", prometheus_dir)

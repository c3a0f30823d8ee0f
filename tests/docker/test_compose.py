"""docker/compose.yaml wires serve, Prometheus and Grafana to files that exist and parse.

(That the dashboard's queries read real series is checked against a running Prometheus
in tests/api/test_prometheus_scrape.py.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DOCKER = Path(__file__).resolve().parents[2] / "docker"


def _compose() -> dict:
    return yaml.safe_load((DOCKER / "compose.yaml").read_text())


def test_compose_mounts_files_that_exist():
    services = _compose()["services"]
    assert set(services) == {"serve", "prometheus", "grafana"}
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):  # a bind mount, relative to docker/
                path = DOCKER / source
                # ./models is the user's to fill; the rest ship with the repo
                assert path.exists() or source == "./models", f"{name} mounts missing {source}"
    assert (DOCKER.parent / services["serve"]["build"]["dockerfile"]).exists()


def test_every_port_is_published_on_loopback_only():
    """The API has no key and Grafana the default password in this file: nothing of it
    may face the network until the user says so."""
    for name, service in _compose()["services"].items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_prometheus_scrapes_the_serve_service():
    config = yaml.safe_load((DOCKER / "prometheus/prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["serve:8000"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    # serve answers /metrics without a key only with --metrics-public
    assert "--metrics-public" in _compose()["services"]["serve"]["command"]


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="no promtool (apt-get install prometheus)"
)
def test_promtool_accepts_the_prometheus_config():
    result = subprocess.run(
        ["promtool", "check", "config", str(DOCKER / "prometheus/prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_provisions_the_dashboard_from_prometheus():
    datasources = yaml.safe_load(
        (DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((DOCKER / "grafana/provisioning/dashboards/serve.yaml").read_text())
    (provider,) = providers["providers"]
    grafana = _compose()["services"]["grafana"]
    # the provider's folder is where compose mounts the repo's dashboards
    assert any(v.endswith(f":{provider['options']['path']}:ro") for v in grafana["volumes"])
    dashboard = json.loads((DOCKER / "grafana/dashboards/serve.json").read_text())
    assert dashboard["uid"] and len(dashboard["panels"]) >= 8

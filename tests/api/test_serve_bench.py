"""`serve bench` against a running serve: the JSON it writes, and the plots drawn from it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from api.conftest import REPO_ROOT

from serve.bench.cli import main as bench
from serve.bench.plots import plot_latency_cdf, plot_sweep

# The tiny llama: a 512-token vocabulary whose first 3 ids are special.
TINY = ["--vocab-size", "512", "--min-token-id", "3", "--no-progress"]
SMALL = ["--num-requests", "5", "--min-prompt", "4", "--max-prompt", "12"]
SMALL += ["--min-output", "3", "--max-output", "6"]


@pytest.fixture(scope="module")
def sweep(server, tmp_path_factory):
    """A two-rate sweep through the `serve` command, as a user runs it."""
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "serve.api.cli", "bench", "--base-url", server.url]
    cmd += [*TINY, *SMALL, "--request-rate", "20,inf", "--output-dir", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Output token throughput" in done.stdout
    return out, json.loads((out / "results.json").read_text())


def test_a_sweep_writes_every_run_with_its_requests(sweep):
    _, result = sweep
    assert [run["request_rate"] for run in result["runs"]] == ["20", "inf"]
    for run in result["runs"]:
        requests, summary = run["requests"], run["summary"]
        assert len(requests) == 5
        assert summary["num_successful"] == 5 and summary["num_failed"] == 0
        asked = sum(r["num_requested_tokens"] for r in requests)
        assert summary["num_output_tokens"] == asked
        assert all(r["num_output_tokens"] == r["num_requested_tokens"] for r in requests)
        assert all(0 < r["ttft_s"] <= r["e2e_s"] for r in requests if r["ttft_s"] is not None)
        assert summary["e2e_ms"]["p50"] <= summary["e2e_ms"]["p99"]
    # the same seeded requests at every rate
    first, second = (run["requests"] for run in result["runs"])
    assert [r["num_prompt_tokens"] for r in first] == [r["num_prompt_tokens"] for r in second]
    assert "api_key" not in result["config"]


def test_the_plots_open_and_show_the_runs_numbers(sweep):
    from matplotlib.image import imread

    out, result = sweep
    assert imread(out / "sweep.png").shape[:2] == (800, 1200)
    assert imread(out / "latency_cdf.png").shape[:2] == (450, 1200)

    fig = plot_sweep([result])
    throughput_ax, ttft_ax = fig.axes[0], fig.axes[1]
    (line,) = throughput_ax.get_lines()
    runs = result["runs"]  # rate 20, then inf drawn at the rate it achieved
    xs = [20.0, runs[1]["summary"]["requests_per_s"]]
    order = sorted(range(2), key=lambda i: xs[i])
    assert list(line.get_xdata()) == pytest.approx([xs[i] for i in order])
    expected = [runs[i]["summary"]["output_tokens_per_s"] for i in order]
    assert list(line.get_ydata()) == pytest.approx(expected)
    p50 = next(ln for ln in ttft_ax.get_lines() if ln.get_label().endswith("p50"))
    assert list(p50.get_ydata()) == pytest.approx(
        [runs[i]["summary"]["ttft_ms"]["p50"] for i in order]
    )

    cdf = plot_latency_cdf([result])
    e2e_lines = cdf.axes[1].get_lines()
    assert len(e2e_lines) == 2
    ends = sorted(max(line.get_xdata()) for line in e2e_lines)
    slowest = sorted(max(r["e2e_s"] for r in run["requests"]) * 1000 for run in runs)
    assert ends == pytest.approx(slowest)
    assert all(line.get_ydata()[-1] == 1.0 for line in e2e_lines)


def test_compare_draws_two_runs_on_one_plot(sweep, tmp_path):
    out, result = sweep
    other = dict(result, label="other")
    other_path = tmp_path / "other.json"
    other_path.write_text(json.dumps(other))
    compared = tmp_path / "compared"
    assert (
        bench(
            ["--compare", str(out / "results.json"), str(other_path), "--output-dir", str(compared)]
        )
        == 0
    )
    assert (compared / "sweep.png").exists() and (compared / "latency_cdf.png").exists()
    labels = [line.get_label() for line in plot_sweep([result, other]).axes[0].get_lines()]
    assert labels == [result["label"], "other"]


def test_sharegpt_and_prefix_sets_run_against_the_server(server, tmp_path):
    conversations = [
        {
            "conversations": [
                {"from": "human", "value": f"Tell me about the number {i} please"},
                {"from": "gpt", "value": "It is a number that comes after the one before it."},
            ]
        }
        for i in range(3)
    ]
    data = tmp_path / "sharegpt.json"
    data.write_text(json.dumps(conversations))
    out = tmp_path / "sharegpt"
    args = ["--base-url", server.url, *TINY, "--dataset", "sharegpt", "--dataset-path", str(data)]
    assert bench([*args, "--num-requests", "3", "--output-dir", str(out), "--no-plots"]) == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["summary"]["num_successful"] == 3
    # prompt lengths as the server counted them (usage), the outputs as the replies' lengths
    assert all(r["num_prompt_tokens"] > 4 for r in run["requests"])
    assert len({r["num_requested_tokens"] for r in run["requests"]}) == 1

    out = tmp_path / "prefix"
    args = ["--base-url", server.url, *TINY, "--dataset", "prefix", "--num-requests", "4"]
    args += ["--num-prefixes", "2", "--prefix-len", "32", "--suffix-len", "4", "--max-output", "3"]
    assert bench([*args, "--output-dir", str(out), "--no-plots"]) == 0
    (run,) = json.loads((out / "results.json").read_text())["runs"]
    assert run["summary"]["num_successful"] == 4
    assert all(r["num_prompt_tokens"] == 36 for r in run["requests"])


def test_bad_arguments_get_a_message_not_a_traceback(server, tmp_path, capsys):
    assert bench(["--base-url", server.url, *TINY, "--dataset", "sharegpt"]) == 1
    assert "needs --dataset-path" in capsys.readouterr().err
    assert bench(["--base-url", "http://127.0.0.1:9", *TINY]) == 1
    assert "serve bench:" in capsys.readouterr().err
    too_long = ["--base-url", server.url, *TINY, "--max-prompt", "500", "--max-output", "100"]
    assert bench(too_long) == 1
    assert "past the server's context" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench(["--request-rate", "0"])

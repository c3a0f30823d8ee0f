"""`serve`'s engine flags as a user types them: each config field is a flag by its own name,
documented in `serve --help`, builds the same config as the `LLM(...)` keyword, and a bad
value stops `serve` at once with argparse's exit status 2 and a message naming the flag.
No model is loaded: every command line here fails, or stops at parsing."""

from __future__ import annotations

import signal
import socket
import sys

import pytest
from setting_examples import EXAMPLES, config_fields

from serve.api.cli import build_parser, main
from serve.api.engine_flags import engine_config_from_args
from serve.config import EngineConfig, GiB, engine_settings
from serve.engine.protocol import EngineStartError


def config_from(argv: list[str]) -> EngineConfig:
    return engine_config_from_args(build_parser().parse_args(argv))


@pytest.fixture
def run_serve(monkeypatch, capsys):
    """`serve ARGV` in this process: (exit status, stdout, stderr). main() installs a
    SIGTERM handler, put back afterwards."""
    monkeypatch.setenv("COLUMNS", "1000")  # one help line per flag, not wrapped
    monkeypatch.delenv("SERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    handler = signal.getsignal(signal.SIGTERM)

    def run(*argv: str) -> tuple[int, str, str]:
        try:
            with pytest.raises(SystemExit) as info:
                main(list(argv))
        finally:
            signal.signal(signal.SIGTERM, handler)
        out, err = capsys.readouterr()
        return info.value.code, out, err

    return run


def test_help_lists_every_config_field_as_a_flag_with_its_help(run_serve):
    code, out, _ = run_serve("--help")
    assert code == 0
    # Each flag's entry: its line, and the next when the help starts there (a long flag).
    lines = out.splitlines() + [""]
    entries = {
        line.split()[0].rstrip(","): line
        + lines[i + 1] * (not lines[i + 1].lstrip().startswith("-"))
        for i, line in enumerate(lines[:-1])
        if line.lstrip().startswith("--")
    }
    helps = {s.name: s.flag.help for s in engine_settings()}
    for _, name, _ in config_fields():
        option = "--" + name.replace("_", "-")
        assert option in entries, f"{option} is not in serve --help"
        assert helps[name].split("%(")[0] in entries[option]
    flat = " ".join(out.split())  # each flag's help on one line with the others
    assert "(default: None)" not in flat  # nothing to show
    for help in helps.values():  # a help that states its default is not told it again
        if "default" in help:
            assert " ".join(help.split()) + " (default:" not in flat


def test_command_line_builds_the_same_config_as_the_keywords():
    argv = [arg for example in EXAMPLES.values() for arg in example.argv]
    keywords = {name: example.value for name, example in EXAMPLES.items()}
    assert config_from(argv) == EngineConfig.create(**keywords)
    assert config_from([]) == EngineConfig.create() == EngineConfig()


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_each_flag_reaches_its_keyword(name):
    example = EXAMPLES[name]
    assert config_from(list(example.argv)) == EngineConfig.create(**{name: example.value})
    assert config_from(list(example.argv)) != EngineConfig()


def test_spellings_users_know():
    assert config_from(["-tp", "2"]) == config_from(["--tensor-parallel-size", "2"])
    assert config_from(["-tp", "2"]).parallel.executor_backend == "mp"
    cache = config_from(["--kv-cache-memory", "4GiB", "--swap-space", "0.5"]).cache
    assert cache.kv_cache_memory_bytes == 4 * GiB
    assert cache.swap_space_bytes == GiB // 2  # --swap-space is GiB, as in vLLM
    assert config_from(["--no-enable-prefix-caching"]).cache.enable_prefix_caching is False
    assert config_from(["--allow-pickle-weights"]).model.allow_pickle_weights is True
    # The step budget's default is the device's, resolved by the engine.
    assert config_from([]).scheduler.max_num_batched_tokens is None


def test_vllm_command_lines_parse(run_serve):
    """`vllm serve`'s spellings for what serve does anyway are accepted; auto tool choice
    still needs the parser that makes it work, as in vLLM."""
    args = build_parser().parse_args(
        ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--disable-log-requests"]
    )
    assert args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    assert args.disable_log_requests
    # The structured-output backend, in both of vLLM's forms, when it is serve's own.
    for argv in (
        ["--structured-outputs-config.backend", "xgrammar"],
        ["--structured-outputs-config", '{"backend": "auto"}'],
    ):
        assert config_from(argv) == config_from([])
    code, _, err = run_serve("--structured-outputs-config.backend", "guidance")
    assert code == 2 and "structured-outputs-config.backend: must be xgrammar or auto" in err
    code, _, err = run_serve("--enable-auto-tool-choice")
    assert code == 1
    assert "serve: error: --enable-auto-tool-choice needs --tool-call-parser" in err


def test_an_engine_that_dies_starting_is_one_error_line_not_a_traceback(run_serve, monkeypatch):
    def dies(args):
        raise EngineStartError("The engine core process exited while starting (killed by X).")

    monkeypatch.setattr("serve.api.cli._load", dies)
    code, _, err = run_serve()
    assert code == 1
    assert err == "serve: error: The engine core process exited while starting (killed by X).\n"


def test_host_defaults_to_serve_host_and_the_flag_wins(monkeypatch):
    monkeypatch.delenv("SERVE_HOST", raising=False)
    assert build_parser().parse_args([]).host == "127.0.0.1"
    monkeypatch.setenv("SERVE_HOST", "0.0.0.0")  # what the Docker image sets
    assert build_parser().parse_args([]).host == "0.0.0.0"
    assert build_parser().parse_args(["--host", "127.0.0.1"]).host == "127.0.0.1"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # Refused by argparse itself ...
        (["--block-size", "big"], "argument --block-size: invalid int value: 'big'"),
        (["--swap-space", "4GiB"], "argument --swap-space: invalid float value: '4GiB'"),
        (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),
        (["-tp", "two"], "argument --tensor-parallel-size/-tp: invalid int value: 'two'"),
        (
            ["--distributed-executor-backend", "slurm"],
            "argument --distributed-executor-backend: invalid choice: 'slurm'",
        ),
        # ... and by the config's checks, worded the same way.
        (
            ["--block-size", "24"],
            "argument --block-size: must be a power of two up to 256, got 24.",
        ),
        (["--device", "foo"], "argument --device: must be auto, cpu, cuda or cuda:N; got 'foo'."),
        # Flags in full only: the image's health check reads --port as written.
        (["--por", "8001"], "unrecognized arguments: --por 8001"),
        (
            ["--quantization", "bitsandbytes"],
            "argument --quantization: invalid choice: 'bitsandbytes' (choose from 'gptq', "
            "'awq', 'fp8', 'compressed-tensors', 'gptq_marlin', 'awq_marlin')",
        ),
        (
            ["--kv-cache-memory", "lots"],
            "argument --kv-cache-memory: must be a positive size like 4GiB or 512MiB, got 'lots'.",
        ),
        (["--max-num-seqs", "0"], "argument --max-num-seqs: must be positive, got 0."),
        (["-tp", "0"], "argument --tensor-parallel-size: must be positive, got 0."),
        (
            ["--load-format", "pt"],
            "argument --load-format: 'pt' loads pickled weights, which can run arbitrary code "
            "when loaded: add --allow-pickle-weights",
        ),
        (
            ["-tp", "2", "--distributed-executor-backend", "uniproc"],
            "argument --distributed-executor-backend: 'uniproc' runs one rank",
        ),
        (
            ["--speculative-config", "not json"],
            "argument --speculative-config: is not valid JSON: Expecting value",
        ),
        (["--port", "70000"], "argument --port: must be a TCP port, 1 to 65535, got 70000"),
        (["--port", "-1"], "argument --port: must be a TCP port, 1 to 65535, got -1"),
        (
            ["--chat-template", "chatml.jinja"],
            "argument --chat-template: no such file: chatml.jinja",
        ),
        (
            ["--chat-template", "{% for m in messages %}{{ m.content }}"],
            "argument --chat-template: not a valid Jinja template: Unexpected end of template",
        ),
    ],
)
def test_bad_values_stop_serve_with_the_flag_named(run_serve, argv, message):
    code, _, err = run_serve(*argv)
    assert code == 2
    assert err.startswith("usage: serve")
    assert f"serve: error: {message}" in err


def test_ray_backend_without_ray_stops_serve_saying_how_to_install_it(run_serve, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # what `import ray` sees when not installed
    code, _, err = run_serve("-tp", "2", "--distributed-executor-backend", "ray")
    assert code == 2
    assert (
        "serve: error: argument --distributed-executor-backend: 'ray' needs the ray package, "
        "which is not installed: pip install 'serve[ray]'"
    ) in err


def test_python_dash_m_serve_is_the_command_and_reaches_serve_bench():
    """`python -m serve` works whatever owns the `serve` script (ray's CLI shares the
    name); `serve bench` is the load tool's parser, not the server's."""
    import subprocess

    from api.conftest import REPO_ROOT

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "serve", *argv],
            capture_output=True,
            text=True,
            cwd=REPO_ROOT,
            timeout=120,
        )

    server = run("--help")
    assert server.returncode == 0 and "--max-num-seqs" in server.stdout
    bench = run("bench", "--help")
    assert bench.returncode == 0 and "--request-rate" in bench.stdout
    assert "--max-num-seqs" not in bench.stdout


def test_a_port_in_use_stops_serve_before_the_model_loads(run_serve, monkeypatch, tiny_llama):
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine started although the port was taken")

    monkeypatch.setattr("serve.engine.core_client.EngineCoreClient", no_engine)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, _, err = run_serve("--model", str(tiny_llama), "--port", str(port))
    assert code == 1
    assert err.startswith(f"serve: error: cannot listen on 127.0.0.1:{port}: ")
    assert "in use" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ssl-keyfile", "key.pem"], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-cert-reqs", "2"], "--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile"),
        (["--ssl-certfile", "/no/such/cert.pem"], "cannot use the TLS key or certificate"),
    ],
)
def test_tls_mistakes_stop_serve_before_the_model_loads(run_serve, argv, message):
    code, _, err = run_serve(*argv)
    assert code == 1
    assert err.startswith(f"serve: error: {message}")

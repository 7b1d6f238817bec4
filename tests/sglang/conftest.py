"""The contract suite's engine: real SGLang (`make test-sglang`) or the simulated engine (`make test`).

One engine per session (the last test restarts it). `make test-sglang` sets INFERBUS_CONTRACT_ENGINE=sglang and
INFERBUS_SGLANG_HOME to the environment `tests/sglang/install.sh` prepared (SGLang, the tiny
model and its adapters, the stand-in CUDA driver library); without them the same tests run
against `inferbus sim-engine`, so every behaviour the suite pins holds for both.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from inferbus.local.ports import free_port

HERE = Path(__file__).parent
SGLANG_VERSION = "0.5.23"
# The first start after an install compiles and caches a lot: 75 s on 2 idle cores, measured
# up to 334 s on 2 cores shared with other work.
START_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0
MAX_TOTAL_TOKENS = 4096
MAX_LORA_RANK = 8
# --max-loaded-loras (at least --max-loras-per-batch, 8 by default): the eviction contract loads one more.
MAX_LOADED_LORAS = 8


@dataclass
class Engine:
    kind: str  # "sglang" or "sim"
    url: str
    kv_events: str  # the ZMQ endpoint the engine's KV-cache events are published on
    model_dir: Path  # the served model's directory: tokenizer, chat template (ChatML), config
    lora_path: str  # a LoRA adapter the engine can load
    slow_lora_path: str  # one that takes a measurable time to load (0.2 s simulated, ~2 s on real SGLang here)
    bad_lora_path: str  # an adapter directory the engine must refuse (rank above --max-lora-rank)
    missing_lora_path: str  # where no adapter is
    argv: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def start(self) -> None:
        """Start the engine (again: the same port and flags, as an engine restarted in place)."""
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(self.argv, env=self.env, cwd=self.log.parent, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        wait_healthy(self, START_TIMEOUT_S)

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)


def engine_kind() -> str:
    kind = os.environ.get("INFERBUS_CONTRACT_ENGINE", "sim")
    if kind not in ("sim", "sglang"):
        raise pytest.UsageError(f"INFERBUS_CONTRACT_ENGINE must be sim or sglang, not {kind!r}")
    return kind


def sglang_paths() -> tuple[Path, Path]:
    """(SGLang's environment, the model directory built by modeldir.py for this source)."""
    home = os.environ.get("INFERBUS_SGLANG_HOME")
    if not home:
        raise pytest.UsageError("INFERBUS_SGLANG_HOME is not set: run the suite with `make test-sglang`")
    sources = (HERE / "modeldir.py").read_bytes() + (
        HERE.parent.parent / "inferbus" / "tokens" / "modeldir.py"
    ).read_bytes()
    digest = hashlib.sha256(sources).hexdigest()[:16]
    return Path(home), Path(home) / "models" / digest


def sglang_command(home: Path, models: Path, port: int, kv_events: str) -> tuple[list[str], dict[str, str]]:
    events = json.dumps({"publisher": "zmq", "endpoint": kv_events, "bind": True})
    argv = [
        str(home / "bin" / "python"), "-m", "sglang.launch_server",
        "--model-path", str(models / "model"), "--host", "127.0.0.1", "--port", str(port),
        "--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
        "--max-total-tokens", str(MAX_TOTAL_TOKENS), "--skip-server-warmup",
        "--enable-lora", "--lora-backend", "torch_native", "--max-lora-rank", str(MAX_LORA_RANK),
        "--lora-target-modules", "q_proj", "k_proj", "v_proj", "o_proj", "--max-loaded-loras", str(MAX_LOADED_LORAS),
        "--enable-metrics", "--constrained-json-disable-any-whitespace", "--kv-events-config", events,
        # Its torch rendezvous port from ours: SGLang's own pick (22000-29999, probed, bound later)
        # can meet a port our launcher handed out and its server has not bound yet.
        "--nccl-port", str(free_port()),
    ]
    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"  # without it --device cpu still takes GPU code paths
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(home / "cuda-stub"), env.get("LD_LIBRARY_PATH")]))
    env["PYTHONPATH"] = str(HERE / "site")  # sitecustomize.py: no pinned memory without a driver
    env.pop("VIRTUAL_ENV", None)
    return argv, env


def sim_command(port: int, kv_events: str, model_dir: Path) -> tuple[list[str], dict[str, str]]:
    events = json.dumps({"publisher": "zmq", "endpoint": kv_events, "bind": True})
    argv = [
        sys.executable, "-m", "tools.commands.main", "sim-engine", "--host", "127.0.0.1", "--port", str(port),
        "--model-dir", str(model_dir), "--block-size", "1",  # SGLang's page size on CPU
        "--kv-capacity-tokens", str(MAX_TOTAL_TOKENS), "--max-lora-rank", str(MAX_LORA_RANK),
        "--max-loaded-loras", str(MAX_LOADED_LORAS),
        "--kv-events-config", events,
    ]
    return argv, dict(os.environ)


def sim_adapter(directory: Path, rank: int) -> str:
    """An adapter directory as PEFT writes it, without weights (the simulator reads only its config)."""
    directory.mkdir(parents=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return str(directory)


def wait_healthy(engine: Engine, timeout: float) -> None:
    assert engine.process is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.process.poll() is not None:
            raise RuntimeError(f"{engine.kind} engine exited with {engine.process.returncode}:\n{engine.log_tail()}")
        try:
            if httpx.get(engine.url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{engine.kind} engine not healthy after {timeout:.0f} s:\n{engine.log_tail()}")


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the launcher (SGLang's stops its scheduler and detokenizer with it); whatever
    of its process group is left after the grace period is killed."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # the group is the launcher's own (start_new_session)
    except ProcessLookupError:
        pass
    process.wait()


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    kind = engine_kind()
    port = free_port()
    kv_events = f"tcp://127.0.0.1:{free_port()}"
    workdir = tmp_path_factory.mktemp(f"engine-{kind}")
    if kind == "sglang":
        home, models = sglang_paths()
        argv, env = sglang_command(home, models, port, kv_events)
        lora_path, bad_lora_path, missing = (
            str(models / "lora"),
            str(models / "bad-lora"),
            str(models / "no-such-adapter"),
        )
        slow_lora_path = str(models / "slow-lora")
        model_dir = models / "model"
    else:
        from inferbus.tokens.modeldir import build_model_dir

        model_dir = build_model_dir(workdir / "model", "chatml", model_max_length=4096)
        argv, env = sim_command(port, kv_events, model_dir)
        lora_path, bad_lora_path = sim_adapter(workdir / "lora", 4), sim_adapter(workdir / "bad-lora", 16)
        slow_lora_path = sim_adapter(workdir / "slow-lora", 8)  # priced by rank: 0.2 s
        missing = "missing/no-such-adapter"  # the simulator's convention for a path with nothing there
    running = Engine(
        kind,
        f"http://127.0.0.1:{port}",
        kv_events,
        model_dir,
        lora_path,
        slow_lora_path,
        bad_lora_path,
        missing,
        argv,
        env,
        workdir / "engine.log",
    )
    try:
        running.start()
        yield running
    finally:
        running.stop()

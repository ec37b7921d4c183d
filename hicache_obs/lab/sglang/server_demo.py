"""``hicache-obs demo --engine sglang``: SGLang's real server, instrumented, serving chat traffic.

The demo makes a tiny model, starts ``python -m sglang.launch_server`` with HiCache under
``hicache-obs instrument`` (this Python, on the CPU, with the stand-ins of
:mod:`.cpu_server`), sends multi-turn conversations over HTTP as clients would
(:class:`.server.Conversations`), serves each host-hit prompt again from nothing to check
the data, then stops the server and reads its rank folders back for the summary, the
audit and ``trace.json``.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import time
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache_obs._profiles import Profile
from hicache_obs.errors import ConfigError, IntegrationError
from hicache_obs.lab.sglang.server import (
    Conversations,
    ServerConfig,
    SGLangServer,
    Turn,
    free_port,
    make_model,
    metric_samples,
    recompute,
)

__all__ = ["MODEL_KINDS", "ServerDemo", "check_server_options", "require_server"]

MODEL_KINDS = {"tiny": "llama", "tiny_hybrid": "lfm2", "tiny_swa": "mellum"}
"""``--model`` -> the tiny model the server loads (:data:`.server.MODELS`)."""

_SERVER_MODULES = ("sglang", "uvicorn", "fastapi", "transformers")


def check_server_options(
    *, model: str, runtime: str | None, fault: str | None, io_backend: str, layout: str | None
) -> None:
    """Refuse what the server demo cannot honour; the message names the option and value."""
    if model not in MODEL_KINDS:
        raise ConfigError(f"--model {model}: the server demo serves {', '.join(MODEL_KINDS)}, not this model")
    if runtime not in (None, "cpu"):
        raise ConfigError(
            f"--runtime {runtime}: the server demo runs SGLang's server on this machine's CPU (runtime cpu); "
            "--engine sglang-controller drives SGLang's controller on a GPU"
        )
    if fault is not None:
        raise ConfigError(
            f"--fault {fault}: the server demo runs SGLang's code as released and injects nothing; "
            "the pre-#22940 bugs are in SGLang 0.5.10 (--engine sglang-controller with that release's python)"
        )
    if layout == "page_first_direct" and io_backend != "direct":
        raise ConfigError(f"--layout {layout}: SGLang copies it with --io-backend direct only, got {io_backend}")


def require_server() -> str:
    """The SGLang release whose server this Python can start; one line naming what is missing otherwise."""
    missing = [m for m in _SERVER_MODULES if importlib.util.find_spec(m) is None]
    if "sglang" in missing:
        raise IntegrationError(
            f"--engine sglang: SGLang is not installed for {sys.executable} "
            "(make sglang sglang-server builds it in .sglang/<release>/)"
        )
    if missing:
        raise IntegrationError(
            f"--engine sglang: SGLang's server cannot start from {sys.executable}: {', '.join(missing)} missing "
            "(make sglang-server installs what it needs)"
        )
    from hicache_obs.lab.sglang.harness import sglang_version

    return sglang_version() or "?"


@dataclass
class ServerDemo:
    """One run of the server demo: what it serves and where it writes."""

    model: str
    steps: int
    out: Path
    io_backend: str = "kernel"
    layout: str = "page_first"
    write_policy: str = "write_through"
    device_tokens: int = 1024
    seed: int = 0
    metrics_port: int = 0
    otlp_endpoint: str | None = None
    profile: Profile | None = None  # the ranks' (None: the launcher's default)
    say: Callable[[str], None] = lambda msg: None

    def server(self) -> SGLangServer:
        kind = MODEL_KINDS[self.model]
        config = ServerConfig(
            make_model(kind, self.out / "model", seed=self.seed),
            io_backend=self.io_backend,
            layout=self.layout,
            write_policy=self.write_policy,
            max_total_tokens=self.device_tokens,
            max_mamba_cache_size=48 if kind == "lfm2" else None,
        )
        return SGLangServer(
            config, self.out / "server.log", python=sys.executable, instrument_out=self.out,
            metrics_port=self.metrics_port or free_port(), otlp_endpoint=self.otlp_endpoint,
            profile=self.profile,
        )  # fmt: skip

    def conversations(self) -> Conversations:
        """Eight conversations whose documents overflow the device pool (host holds them)."""
        return Conversations(docs=8, doc_tokens=max(32, self.device_tokens // 6), seed=self.seed)

    def serve(self, server: SGLangServer, on_request: Callable[[int], None] = lambda n: None) -> list[Turn]:
        """``steps`` requests, conversation after conversation, turn after turn; ``on_request``
        gets the number served so far."""
        talk = self.conversations()
        turns: list[Turn] = []
        for number in range(math.ceil(self.steps / (talk.docs * talk.asks))):
            for t in talk.turn(server, number, limit=self.steps - len(turns)):
                turns.append(t)
                on_request(len(turns))
        return turns

    @staticmethod
    def settle(server: SGLangServer, timeout: float = 60.0) -> str:
        """``/metrics`` of rank 0 once every submitted transfer has ended and the event count
        has stopped moving (the tree's last writes are queued a step after the last answer)."""
        assert server.metrics_port is not None
        deadline = time.monotonic() + timeout
        last: tuple[float, ...] | None = None
        while True:
            text = server.metrics(server.metrics_port)
            ops = {
                s: sum(v for _, v in metric_samples(text, "hicache_operations_total", status=s))
                for s in ("submitted", "completed", "failed")
            }
            now = (*ops.values(), sum(v for _, v in metric_samples(text, "hicache_events_total")))
            if (now == last and ops["submitted"] == ops["completed"] + ops["failed"]) or time.monotonic() > deadline:
                return text
            last = now
            time.sleep(0.5)


def check_data(server: SGLangServer, turns: list[Turn]) -> dict[str, Any]:
    """Each host-served answer against the same prompt served from nothing (``/flush_cache`` first)."""
    served = [t for t in turns if t.cached_host > 0]
    fresh = recompute(server, served)
    mismatched = [i for i, (a, b) in enumerate(zip(served, fresh)) if a.output_ids != b.output_ids]
    return {
        "data_intact": not mismatched,
        "checked_requests": len(served),
        "mismatched_requests": len(mismatched),
        "host_hit_tokens": sum(t.cached_host for t in turns),
        "device_hit_tokens": sum(t.cached_device for t in turns),
        "prompt_tokens": sum(len(t.input_ids) for t in turns),
    }


def stopped_error(server: SGLangServer, exc: BaseException) -> IntegrationError:
    """What to say when the server died or refused a request mid-run."""
    what = f"{type(exc).__name__}: {exc}" if not isinstance(exc, urllib.error.HTTPError) else f"HTTP {exc.code}"
    return IntegrationError(f"--engine sglang: the server stopped serving ({what}); its log: {server.log_path}")

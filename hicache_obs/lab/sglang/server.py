"""SGLang's real server with HiCache, started, driven over HTTP and stopped (test support).

:func:`make_model` writes a tiny model (config and random weights, made here, nothing
downloaded) that SGLang loads as it would any checkpoint. :class:`SGLangServer` runs
``python -m sglang.launch_server`` on it, bound to 127.0.0.1 on a free port, on the CPU
with the stand-ins of :mod:`.cpu_server`, optionally under ``hicache-obs instrument``;
it is stopped by its process group, also when a test fails. :func:`prefix_reuse` sends
multi-turn traffic with shared prefixes so that KV is written to host, evicted from the
device and loaded back; :func:`recompute` serves the same prompts again from nothing
(``/flush_cache`` before each) for the comparison.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hicache_obs._profiles import Profile
from hicache_obs.errors import ConfigError, HiCacheError
from hicache_obs.lab.sglang import cpu_server

__all__ = [
    "MODELS",
    "SERVER_ARGS",
    "ServerConfig",
    "ServerFailed",
    "SGLangServer",
    "Conversations",
    "Turn",
    "free_port",
    "make_model",
    "metric_samples",
    "prefix_reuse",
    "recompute",
]

MODELS = {
    "llama": "KV only: a 2-layer Llama",
    "lfm2": "hybrid: an LFM2 with short-convolution layers (state in SGLang's Mamba pool) and attention layers",
    "mellum": "hybrid SWA: a Mellum with sliding-window layers (KV in SGLang's SWA pool) and full-attention layers",
    "nemotron_h": "hybrid Mamba2: a NemotronH with Mamba2 layers (SSM and conv state in SGLang's Mamba pool), "
    "an attention layer and an MLP layer",
}
"""The tiny models :func:`make_model` writes."""

SERVER_ARGS: dict[str, tuple[str, ...]] = {
    "nemotron_h": ("--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"),
}
"""Server arguments a kind needs on a CPU (:attr:`ServerConfig.extra`). NemotronH's default
Mamba prefix cache (``extra_buffer``) asserts a GPU-like platform (SGLang 0.5.23
``arg_groups/mamba_hook.py:120``); ``no_buffer`` asserts the overlap schedule is off (``:158``)."""

_VOCAB = 512


class ServerFailed(HiCacheError, RuntimeError):
    """The server did not come up, or died; the message names the stage and ends with its log tail."""


class _PortTaken(Exception):
    """The server could not bind its HTTP port: another process took it first."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_model(kind: str, folder: str | os.PathLike[str], *, seed: int = 0, init_std: float = 0.2) -> Path:
    """Write the tiny model ``kind`` (one of :data:`MODELS`) into ``folder``: a config and
    random float32 weights drawn with ``init_std``. Wide enough weights make the greedy
    output depend on the whole prompt, so a load that brought back wrong KV or state changes
    it. Needs ``transformers`` (SGLang's own dependency)."""
    if kind not in MODELS:
        raise ConfigError(f"model kind must be one of {', '.join(MODELS)}, got {kind!r}")
    import torch
    from transformers import AutoModelForCausalLM

    out = Path(folder)
    common = dict(
        vocab_size=_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if kind == "llama":
        from transformers import LlamaConfig

        config: Any = LlamaConfig(num_hidden_layers=2, **common)
    elif kind == "mellum":
        from transformers import MellumConfig

        # dense MLPs (no MoE kernels), a window far shorter than the conversations' documents
        config = MellumConfig(
            num_hidden_layers=4,
            layer_types=["sliding_attention", "full_attention"] * 2,
            mlp_layer_types=["dense"] * 4,
            sliding_window=64,
            head_dim=16,
            **common,
        )
    elif kind == "nemotron_h":
        from transformers import NemotronHConfig

        # mamba, attention, mamba, MLP; 4 Mamba2 heads of 16 in 2 groups, state 16
        config = NemotronHConfig(
            layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"],
            head_dim=16,
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=16,
            n_groups=2,
            conv_kernel=4,
            expand=1,
            chunk_size=64,
            **common,
        )
    else:
        from transformers import Lfm2Config

        config = Lfm2Config(
            num_hidden_layers=4,
            layer_types=["conv", "full_attention", "conv", "full_attention"],
            conv_L_cache=3,
            block_auto_adjust_ff_dim=False,
            block_ff_dim=128,
            **common,
        )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model.to(torch.float32).save_pretrained(out)
    if kind == "nemotron_h":
        _sglang_nemotron_h_config(out / "config.json")
    return out


_NEMOTRON_H_LEGACY = {
    "n_groups": "mamba_n_groups",
    "conv_kernel": "mamba_d_conv",
    "expand": "mamba_expand",
    "chunk_size": "mamba_chunk_size",
    "time_step_min": "mamba_dt_min",
    "time_step_max": "mamba_dt_max",
    "time_step_floor": "mamba_dt_init_floor",
    "use_conv_bias": "mamba_conv_bias",
}
_NEMOTRON_H_PATTERN = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}


def _sglang_nemotron_h_config(path: Path) -> None:
    """Rewrite transformers' NemotronH ``config.json`` so that SGLang 0.5.23's own
    ``NemotronHConfig`` reads the same model, and transformers still does: SGLang takes the
    Mamba fields under their legacy ``mamba_*`` names (transformers maps those back) and the
    layers as ``hybrid_override_pattern`` (it rejects transformers' layer names), yet its
    ``mamba2_cache_params`` reads ``n_groups``, so that key stays beside ``mamba_n_groups``.
    ``time_step_limit`` (default ``(0, inf)`` in both) and ``mtp_layers_block_type`` (no MTP
    layers) are dropped. ``time_step_min`` (used only to draw ``dt_bias``, done by now) becomes
    0: transformers' mixer clamps the prefill's ``dt`` at ``time_step_min``, SGLang's at 0
    (``mamba.py:639``), so with the default 0.001 the two models differ (logprobs by ~1e-2)."""
    c = json.loads(path.read_text())
    for new, legacy in _NEMOTRON_H_LEGACY.items():
        c[legacy] = c[new] if new == "n_groups" else c.pop(new)
    c["mamba_dt_min"] = 0.0
    c.pop("time_step_limit", None)
    c.pop("mtp_layers_block_type", None)
    c["hybrid_override_pattern"] = "".join(_NEMOTRON_H_PATTERN[t] for t in c.pop("layers_block_type"))
    path.write_text(json.dumps(c, indent=2) + "\n")


@dataclass(frozen=True)
class ServerConfig:
    """What one server runs: the model and SGLang's HiCache settings."""

    model: Path
    io_backend: str = "kernel"
    layout: str = "page_first"
    write_policy: str = "write_through"
    page_size: int = 1
    tp_size: int = 1
    max_total_tokens: int = 4096
    hicache_ratio: float = 2.0
    max_mamba_cache_size: int | None = None
    extra: tuple[str, ...] = ()

    def args(self, port: int) -> list[str]:
        """``sglang.launch_server``'s arguments for this configuration on ``port``."""
        args = [
            "--model-path", str(self.model),
            "--host", "127.0.0.1", "--port", str(port),
            "--device", "cpu", "--dtype", "float32",
            "--skip-tokenizer-init",
            "--attention-backend", "torch_native",
            "--disable-cuda-graph",
            "--max-total-tokens", str(self.max_total_tokens),
            "--page-size", str(self.page_size),
            "--tp-size", str(self.tp_size),
            "--enable-hierarchical-cache",
            "--hicache-ratio", str(self.hicache_ratio),
            "--hicache-io-backend", self.io_backend,
            "--hicache-mem-layout", self.layout,
            "--hicache-write-policy", self.write_policy,
            "--enable-metrics",
        ]  # fmt: skip
        if self.max_mamba_cache_size is not None:
            args += ["--max-mamba-cache-size", str(self.max_mamba_cache_size)]
        return args + list(self.extra)

    def label(self) -> str:
        return f"{self.model.name} {self.io_backend} {self.layout} {self.write_policy} page {self.page_size} tp {self.tp_size}"


@dataclass
class SGLangServer:
    """One ``sglang.launch_server`` process group. Use as a context manager: it is started on
    entry and stopped (by its process group) on exit, whatever happened."""

    config: ServerConfig
    log_path: Path
    python: str = sys.executable
    instrument_out: Path | None = None
    """Run under ``hicache-obs instrument --out`` this folder (None: not instrumented)."""
    metrics_port: int | None = None
    """``hicache-obs instrument --metrics-port``: rank N serves on this port + N."""
    otlp_endpoint: str | None = None
    """``hicache-obs instrument --otlp-endpoint``: where the spans go."""
    profile: Profile | None = None
    """``hicache-obs instrument --profile`` (and ``--audit-sample``): the ranks' (None: the launcher's default)."""
    fault_file: Path | None = None
    """While this file exists, loads copy nothing (:data:`.cpu_server.FAULT_ENV`)."""
    env: dict[str, str] = field(default_factory=dict)
    start_timeout: float = 300.0
    port: int = 0
    process: subprocess.Popen[bytes] | None = None

    @property
    def state_dir(self) -> Path:
        """Where the server's processes answer :meth:`allocator_state` requests."""
        return self.log_path.with_name(self.log_path.name + ".state")

    def allocator_state(self, processes: int = 1, timeout: float = 30.0) -> list[dict[str, Any]]:
        """Each controller's allocators as SGLang counts them (``size``, ``available``), read
        in the server's processes (:func:`.cpu_server.allocator_state`): one answer from each
        of ``processes`` scheduler processes, merged."""
        self._requests = getattr(self, "_requests", 0) + 1
        name = f"{self._requests:04d}"
        (self.state_dir / f"request-{name}").touch()
        deadline = time.monotonic() + timeout
        while True:
            answers = sorted(self.state_dir.glob(f"answer-{name}-*.json"))
            if len(answers) >= processes:
                break
            if time.monotonic() > deadline:
                raise ServerFailed(
                    f"allocator state: {len(answers)} of {processes} processes answered{self.log_tail()}"
                )
            time.sleep(0.05)
        out: list[dict[str, Any]] = []
        for a in answers:
            out.extend(json.loads(a.read_text()))
        return out

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        server = [self.python, "-m", "sglang.launch_server", *self.config.args(self.port)]
        if self.instrument_out is None:
            return server
        front = [self.python, "-m", "hicache_obs", "instrument", "--out", str(self.instrument_out)]
        if self.metrics_port is not None:
            front += ["--metrics-port", str(self.metrics_port)]
        if self.otlp_endpoint is not None:
            front += ["--otlp-endpoint", self.otlp_endpoint]
        if self.profile is not None:
            front += ["--profile", self.profile.name]
            if self.profile.name == "sampling":
                front += ["--audit-sample", repr(self.profile.audit_sample)]
        return [*front, "--", *server]

    #: How many ports :meth:`start` tries when another process took the one it picked.
    PORT_TRIES = 3

    def start(self) -> SGLangServer:
        """Start the server and wait until ``/health`` answers. A port :func:`free_port` picked
        can be taken by another process before the server binds it (SGLang's own processes pick
        ports too): that start is stopped and the next port tried, :data:`PORT_TRIES` in all.
        A port the caller gave is not replaced: that is a :class:`ServerFailed`."""
        if self.process is not None:
            raise ServerFailed("start: this server was started already")
        given = bool(self.port)
        for attempt in range(1, self.PORT_TRIES + 1):
            self.port = self.port or free_port()
            self._launch()
            try:
                self._wait_ready()
                return self
            except _PortTaken:
                self.stop()
                self.process = None
                if given or attempt == self.PORT_TRIES:
                    raise ServerFailed(
                        f"start ({self.config.label()}): port {self.port} was taken before the server bound it"
                        f"{'' if given else f' ({attempt} ports tried)'}{self.log_tail()}"
                    ) from None
                self.port = 0
        raise AssertionError("unreachable")  # pragma: no cover

    def _launch(self) -> None:
        env = cpu_server.server_environment()
        env[cpu_server.STATE_ENV] = str(self.state_dir)
        shutil.rmtree(self.state_dir, ignore_errors=True)  # no request or answer of an earlier server
        self.state_dir.mkdir(parents=True)
        # SGLang 0.5.11 derives a gRPC port of --port + 10000 and refuses to start when that
        # is above 65535 (server_args.py:1046), even with gRPC off; a free port above 55535
        # would do that. The variable is read by no other release.
        env.setdefault("SGLANG_GRPC_PORT", str(free_port()))
        env.update(self.env)
        if self.fault_file is not None:
            env[cpu_server.FAULT_ENV] = str(self.fault_file)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True,
            )  # fmt: skip

    def _port_taken(self) -> bool:
        """Whether the server's log says its HTTP port was in use when it tried to bind it (then
        whatever holds the port may accept ``/health`` and never answer)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return False
        return f"error while attempting to bind on address ('127.0.0.1', {self.port})" in text

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._port_taken():
                raise _PortTaken(self.port)
            code = self.process.poll() if self.process else None
            if code is not None:
                raise ServerFailed(f"start ({self.config.label()}): the server exited with {code}{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise ServerFailed(
            f"start ({self.config.label()}): not ready after {self.start_timeout:.0f} s{self.log_tail()}"
        )

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n--- server log tail ---\n" + "\n".join(text[-lines:])

    def stop(self, timeout: float = 30.0) -> int | None:
        """Stop the server as a user does: SIGTERM to the launcher, which shuts its schedulers
        down; whatever of its process group is still there after ``timeout`` gets SIGKILL."""
        p = self.process
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if not _group_gone(p.pid, 10.0 if p.poll() is not None else 0.0):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10.0)
            _group_gone(p.pid, 10.0)
        return p.returncode

    def __enter__(self) -> SGLangServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ HTTP
    def post(self, path: str, body: dict[str, Any] | None = None, timeout: float = 120.0) -> Any:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(body or {}).encode(), headers={"Content-Type": "application/json"},
            method="POST",
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
        try:
            return json.loads(raw)
        except ValueError:
            return raw.decode(errors="replace")

    def generate(self, input_ids: Sequence[int], max_new_tokens: int = 8) -> dict[str, Any]:
        """Greedy generation with the chosen tokens' logprobs."""
        return self.post(  # type: ignore[no-any-return]
            "/generate",
            {
                "input_ids": list(input_ids),
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
                "return_logprob": True,
            },
        )

    def flush_cache(self, timeout: float = 60.0) -> None:
        """``POST /flush_cache``, retried while SGLang refuses it (requests or transfers still running)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.post("/flush_cache")
                return
            except urllib.error.HTTPError as exc:
                if time.monotonic() > deadline:
                    raise ServerFailed(
                        f"/flush_cache still refused after {timeout:.0f} s: {exc}{self.log_tail()}"
                    ) from exc
                time.sleep(0.2)

    def metrics(self, port: int | None = None) -> str:
        """``/metrics`` of the server (default) or of ``127.0.0.1:port``."""
        url = f"http://127.0.0.1:{port}/metrics" if port is not None else self.url + "/metrics"
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.read().decode()  # type: ignore[no-any-return]


def _group_gone(pgid: int, timeout: float) -> bool:
    """Whether no process of group ``pgid`` is left, waiting up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def metric_samples(text: str, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    """The samples of metric ``name`` in Prometheus text ``text`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = []
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                out.append((dict(s.labels), float(s.value)))
    return out


@dataclass(frozen=True)
class Turn:
    """One request and what the server answered."""

    input_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    cached_tokens: int
    cached_device: int
    cached_host: int


def _turn(input_ids: Sequence[int], answer: dict[str, Any]) -> Turn:
    meta = answer["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    return Turn(
        input_ids=tuple(input_ids),
        output_ids=tuple(answer["output_ids"]),
        logprobs=tuple(float(lp[0]) for lp in meta.get("output_token_logprobs") or ()),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        cached_device=int(details.get("device") or 0),
        cached_host=int(details.get("host") or 0),
    )


@dataclass
class Conversations:
    """Multi-turn conversations over shared prefixes, as a chat client sends them: each
    starts from a document of ``doc_tokens`` tokens; each turn visits every conversation in
    order and asks ``asks`` questions of ``turn_tokens`` tokens in a row, each request being
    the whole history so far (earlier prompts and answers) plus the new question.

    With more conversations than the device pool holds, each one's KV (and, on a hybrid
    model, its state at the end of the last answer, where SGLang keeps one) is written to
    host, evicted, and loaded back at its next turn; the second question of a visit is the
    second hit ``write_through_selective`` waits for."""

    docs: int = 10
    doc_tokens: int = 600
    turn_tokens: int = 20
    asks: int = 2
    max_new_tokens: int = 8
    seed: int = 0
    history: list[list[int]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.history = [[rng.randrange(3, _VOCAB) for _ in range(self.doc_tokens)] for _ in range(self.docs)]

    def turn(self, server: SGLangServer, number: int, limit: int | None = None) -> list[Turn]:
        """Turn ``number`` of every conversation (the same number asks the same questions);
        at most ``limit`` requests."""
        out: list[Turn] = []
        for d, history in enumerate(self.history):
            for a in range(self.asks):
                if limit is not None and len(out) >= limit:
                    return out
                ask = random.Random(f"{self.seed}/{number}/{d}/{a}")
                ids = history + [ask.randrange(3, _VOCAB) for _ in range(self.turn_tokens)]
                t = _turn(ids, server.generate(ids, self.max_new_tokens))
                history[:] = ids + list(t.output_ids)
                out.append(t)
        return out


def prefix_reuse(server: SGLangServer, *, turns: Iterable[int] = range(2), **conversations: Any) -> list[Turn]:
    """``turns`` of new :class:`Conversations` (``conversations``: its fields)."""
    c = Conversations(**conversations)
    return [t for n in turns for t in c.turn(server, n)]


def recompute(server: SGLangServer, turns: Iterable[Turn], max_new_tokens: int = 8) -> list[Turn]:
    """Each turn's prompt served again with every cache emptied first (nothing reused)."""
    out = []
    for t in turns:
        server.flush_cache()
        out.append(_turn(t.input_ids, server.generate(t.input_ids, max_new_tokens)))
    return out

"""A server whose picked port another process took first is restarted on another port; a port
the caller gave is not replaced. A stand-in for ``python -m sglang.launch_server`` plays the
server: it binds ``--port`` as uvicorn does, or says so and hangs when that fails."""

from __future__ import annotations

import socket
import stat
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from hicache_obs.lab.sglang import server as srv

FAKE = textwrap.dedent(
    """\
    import http.server, socket, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    with open(sys.argv[0] + ".ports", "a") as f:
        print(port, file=f)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    try:
        http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
    except OSError as exc:  # as uvicorn says it, then the rest of the server lingers
        print(f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address "
              f"('127.0.0.1', {port}): address already in use", flush=True)
        time.sleep(600)
    """
)


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """An executable run as ``python -m sglang.launch_server ...``: it runs :data:`FAKE` itself."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE)
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def _holder() -> socket.socket:
    """A socket that holds a port and accepts connections it never answers."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    return s


@pytest.mark.timeout(120)
def test_a_port_taken_before_the_server_binds_it_is_replaced(
    fake_python: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = _holder()
    taken = held.getsockname()[1]
    picks = iter([taken])
    real = srv.free_port
    monkeypatch.setattr(srv, "free_port", lambda: next(picks, None) or real())
    server = srv.SGLangServer(srv.ServerConfig(tmp_path / "model"), tmp_path / "server.log", python=str(fake_python))
    try:
        with server:
            assert server.port != taken
            ports = [int(p) for p in (tmp_path / "fake_server.py.ports").read_text().split()]
            assert ports == [taken, server.port]  # the first start was stopped, the second serves
            first = server.process
            assert first is not None and first.poll() is None
        assert first.returncode is not None  # stopped by its process group on exit
    finally:
        held.close()


@pytest.mark.timeout(120)
def test_a_given_port_that_is_taken_is_one_clear_error(fake_python: Path, tmp_path: Path) -> None:
    held = _holder()
    taken = held.getsockname()[1]
    server = srv.SGLangServer(
        srv.ServerConfig(tmp_path / "model"), tmp_path / "server.log", python=str(fake_python), port=taken
    )
    try:
        with pytest.raises(srv.ServerFailed, match=f"port {taken} was taken before the server bound it"):
            server.start()
        assert server.process is None  # stopped, by its process group
        assert (tmp_path / "fake_server.py.ports").read_text().split() == [str(taken)]
    finally:
        server.stop()
        held.close()


def test_the_server_runs_its_ranks_at_the_profile_it_was_given(tmp_path: Path) -> None:
    from hicache_obs._profiles import resolve_profile

    def front(profile: Any) -> list[str]:
        cmd = srv.SGLangServer(
            srv.ServerConfig(tmp_path / "model"), tmp_path / "server.log", instrument_out=tmp_path, profile=profile
        ).command()
        return cmd[: cmd.index("--")]

    assert "--profile" not in front(None)  # the launcher's default
    assert front(resolve_profile("audit"))[-2:] == ["--profile", "audit"]
    assert front(resolve_profile("metrics", 0.05))[-4:] == ["--profile", "sampling", "--audit-sample", "0.05"]

"""A process killed mid-workload: its log replays up to the last complete line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hicache_obs.events import TransferCompleted, TransferFailed, TransferSubmitted
from hicache_obs.events._audit import audit
from hicache_obs.events._replay import replay

WORKER = r"""
import sys, torch
from hicache_obs.core import PoolTransfer
from hicache_obs.events import EventLog
from hicache_obs.events._store import open_store
from hicache_obs.testing import make_controller

log = EventLog()
open_store(log, sys.argv[1], max_bytes=1 << 16)
c = make_controller(log=log, device_size=1024)
pending = []
i = 0
while True:
    kv = c.alloc_device(32)
    mb = c.alloc_device(1, pool="mamba")
    host, tr = c.write(kv, node_id=i, pool_transfers=[PoolTransfer("mamba", device_indices=mb)])
    pending.append((kv, mb, host, tr))
    if len(pending) > 2:  # keep ops in flight while new ones are submitted
        c.poll_writes()
        kv, mb, host, tr = pending.pop(0)
        c.evict_device(kv); c.evict_device(mb, pool="mamba")
        c.evict_host(host); c.evict_host(tr[0].host_indices, pool="mamba")
    if i == 200:
        print("ready", flush=True)
    i += 1
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_mid_workload_replays_to_the_last_complete_line(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    assert proc.returncode == -signal.SIGKILL
    res = replay(tmp_path)
    assert len(res.events) > 1000
    assert len(res.torn_lines) <= 1
    assert [e.seq for e in res.events] == list(range(len(res.events)))
    submitted = {e.op for e in res.events if isinstance(e, TransferSubmitted)}
    finished = {e.op for e in res.events if isinstance(e, (TransferCompleted, TransferFailed))}
    findings = audit(res.events)
    assert {f.rule for f in findings} <= {"incomplete_operation"}
    assert sorted(f.op for f in findings) == sorted(submitted - finished)

"""A submission whose indices no op-level move touched is still an op in the log.

SGLang 0.5.17's hybrid controller skips ``move_hybrid_indices`` for a page_first kernel write
whose host pool group moves the indices per pool: the adapter, which takes the merged op from
that move, then takes it from the queued ops (their ids, indices and pool transfers). Here the
move is taken out of the adapter's sight on every pinned release (its hook removed after
instrumenting), so the copies run with no move reported.
"""

from __future__ import annotations

import pytest

from hicache_obs.core import ModelSpec
from hicache_obs.events import EventLog
from hicache_obs.events._audit import audit
from hicache_obs.events._schema import (
    IndicesMoved,
    OperationQueued,
    OperationsMerged,
    TransferCompleted,
    TransferSubmitted,
)
from hicache_obs.integrations.sglang import instrument

pytestmark = pytest.mark.needs_sglang


def test_writes_and_a_merged_load_without_a_move_are_submitted_and_completed() -> None:
    from hicache_obs.lab.sglang.harness import build_controller

    h = build_controller(ModelSpec.tiny(), io_backend="direct", layout="page_first_direct")
    log = EventLog()
    inst = instrument(h.controller, log=log)
    for name in inst._shape.move:  # the controller's move, as SGLang had it before the hook
        setattr(h.controller, name, getattr(h.controller, name).__wrapped__)
    page = h.spec.page_size
    hosts = []
    for node in range(3):  # each write starts at once: three ops of one request each
        host, _ = h.write(h.alloc_kv(page), node_id=node)
        hosts.append(host)
    assert h.reap(wait=True) == 3
    for node, host in enumerate(hosts):  # loads queue: one start merges the three
        h.load(host, node_id=node)
    h.controller.start_loading()
    assert h.reap(wait=True) == 1
    log.flush()
    events = log.events()
    queued = {d: [e.op for e in events if isinstance(e, OperationQueued) and e.direction == d] for d in ("d2h", "h2d")}
    merged = {d: [e for e in events if isinstance(e, OperationsMerged) and e.direction == d] for d in ("d2h", "h2d")}
    subs = {d: [e for e in events if isinstance(e, TransferSubmitted) and e.direction == d] for d in ("d2h", "h2d")}
    done = sorted(e.op for e in events if isinstance(e, TransferCompleted))
    assert [m.merged_ops for m in merged["d2h"]] == [(op,) for op in queued["d2h"]]
    assert [s.op for s in subs["d2h"]] == queued["d2h"]  # one op each, its own id
    (m,) = merged["h2d"]
    (load,) = subs["h2d"]
    assert m.merged_ops == tuple(queued["h2d"]) and len(queued["h2d"]) == 3
    assert load.op == m.op and m.op not in queued["h2d"]  # merge_ops made a new op, counted on
    assert done == sorted([*queued["d2h"], load.op])
    assert [dict(s.slots_by_pool) for s in subs["d2h"]] == [{"kv": page}] * 3
    assert dict(load.slots_by_pool) == {"kv": 3 * page}
    assert {(t.pool, t.role) for t in load.tensors} == {("kv", "host"), ("kv", "device")}
    assert not [e for e in events if isinstance(e, IndicesMoved)]
    assert audit(events) == [] and inst.errors == 0

"""``kernels.Installation``: what one install put in, and ``undo()`` taking out just that."""

from __future__ import annotations

import sys
import types

from hicache_obs.lab.sglang import kernels as K


def test_undo_takes_out_what_the_installation_put_in_and_leaves_what_replaced_it() -> None:
    inst = K.Installation()
    parent = types.ModuleType("hicache_test_parent")
    mine, theirs = types.ModuleType("hicache_test_parent.a"), types.ModuleType("hicache_test_parent.b")
    parent.a = mine  # type: ignore[attr-defined]
    parent.b = types.ModuleType("hicache_test_parent.b")  # type: ignore[attr-defined]
    inst.remember_attr(parent, "a", mine)
    inst.remember_attr(parent, "b", parent.b)  # type: ignore[attr-defined]
    parent.b = theirs  # type: ignore[attr-defined]  # replaced since: stays
    inst.stand_ins["hicache_test_parent.a"] = mine
    sys.modules["hicache_test_parent.a"] = mine
    bound = types.ModuleType("hicache_test_bound")
    bound.transfer_kv_per_layer = K.transfer_kv_per_layer  # type: ignore[attr-defined]
    bound.transfer_kv_direct = "theirs"  # type: ignore[attr-defined]  # not our op: stays
    inst.bound["hicache_test_bound"] = ["transfer_kv_per_layer", "transfer_kv_direct"]
    inst.remember_module(bound)
    try:
        inst.undo()
        assert "hicache_test_parent.a" not in sys.modules
        assert not hasattr(parent, "a") and parent.b is theirs  # type: ignore[attr-defined]
        assert not hasattr(bound, "transfer_kv_per_layer") and bound.transfer_kv_direct == "theirs"  # type: ignore[attr-defined]
        inst.undo()  # twice: nothing left to take out, nothing else touched
        assert parent.b is theirs and bound.transfer_kv_direct == "theirs"  # type: ignore[attr-defined]
    finally:
        sys.modules.pop("hicache_test_parent.a", None)


def test_a_module_gone_since_has_nothing_to_unbind() -> None:
    inst = K.Installation()
    gone = types.ModuleType("hicache_test_gone")
    inst.bound["hicache_test_gone"] = ["transfer_kv_per_layer"]
    inst.remember_module(gone)
    del gone  # held weakly: it dies here
    inst.undo()  # skips the dead reference (an AttributeError on None otherwise)

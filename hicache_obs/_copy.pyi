# The compiled copy loop (hicache_obs/_copy.c); see its source for the contract.
from typing import Any

def copy_runs(
    dst: int,
    src: int,
    runs: Any,  # a buffer of int64 triples
    swap: bool,
    layers: int,
    chunk: int,
    dst_slots: int,
    dst_slot_stride: int,
    dst_layer_stride: int,
    src_slots: int,
    src_slot_stride: int,
    src_layer_stride: int,
    /,
) -> None: ...

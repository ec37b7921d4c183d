"""The kernels package's table of launcher checks says what every op checks, and each op applies its row.

``checks.LAUNCHER_CHECKS`` holds, per ``kernel`` op, the checks its wrapper makes
around ``transfer_kv_launcher``'s. Here the table is held against the ops'
signatures (a row for every launched op, a layer-count check where there is a
``num_layers``, a heads check where there is a ``head_num``, the quota from the
environment where ``block_quota`` defaults to None), and every op is called with
each check's failing argument to see that it runs its own row. The package list
of ``pyproject.toml`` is held against the package folders, so that a
non-editable install carries ``kernels/``.
"""

from __future__ import annotations

import inspect
import pkgutil
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from hicache_obs.lab.sglang import kernels as K
from hicache_obs.lab.sglang.kernels import KernelCheckError
from hicache_obs.lab.sglang.kernels.checks import LAUNCHER_CHECKS

ROOT = Path(__file__).resolve().parents[3]
L = 3


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA, like the harness's device index tensors."""

    @property  # type: ignore[misc]
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def launched_ops() -> list[str]:
    """The kvcacheio ops that go through ``transfer_kv_launcher``: those with an ``item_size`` and a ``block_quota``."""
    return sorted(n for n, fn in K.KVCACHEIO_OPS.items() if {"item_size", "block_quota"} <= set(params(fn)))


def params(fn: Any) -> dict[str, inspect.Parameter]:
    return dict(inspect.signature(fn).parameters)


def arguments(op: str, **overrides: Any) -> dict[str, Any]:
    """Arguments every check passes, built from the parameter names; nothing gets copied past the checks tested."""
    buffer = torch.zeros(4096, dtype=torch.uint8)
    values: dict[str, Any] = {
        "src_indices": torch.tensor([0], dtype=torch.int64).as_subclass(FakeCuda),
        "dst_indices": torch.tensor([0], dtype=torch.int64).as_subclass(FakeCuda),
        "item_size": 8,
        "layer_id": 0,
        "src_layout_dim": 8 * L,
        "dst_layout_dim": 8 * L,
        "num_layers": L,
        "page_size": 1,
        "head_num": 1,
    }
    out: dict[str, Any] = {}
    for name in params(K.OPS[op]):
        if name in overrides:
            out[name] = overrides[name]
        elif name in values:
            out[name] = values[name]
        elif name.endswith("_layers"):  # a uint64 table of per-layer bases
            out[name] = torch.tensor([buffer.data_ptr()] * L, dtype=torch.uint64)
        elif name in ("block_quota", "num_warps_per_block"):
            continue  # the defaults
        else:  # src_k, dst_v, src, dst: a tensor side
            out[name] = buffer
    return out


def test_every_launched_op_has_one_row_and_the_row_matches_its_signature() -> None:
    assert sorted(LAUNCHER_CHECKS) == launched_ops()
    assert len(launched_ops()) == 10
    for op, row in LAUNCHER_CHECKS.items():
        p = params(K.OPS[op])
        assert (row.layers is not None) == ("num_layers" in p), op
        assert row.heads == ("head_num" in p and "page_size" in p), op
        assert row.quota_from_env == (p["block_quota"].default is None), op


@pytest.mark.parametrize("op", [op for op, row in sorted(LAUNCHER_CHECKS.items()) if row.layers is not None])
def test_the_layer_count_message_names_the_ops_first_table(op: str) -> None:
    first = next(iter(params(K.OPS[op])))
    assert first in ("src_k_layers", "src_layers")
    which = "source k tensor" if first == "src_k_layers" else "source tensor"
    assert LAUNCHER_CHECKS[op].layers == f"Number of layers in {which} does not match num_layers"
    short = torch.zeros(L - 1, dtype=torch.uint64)
    with pytest.raises(KernelCheckError, match=rf"^Number of layers in {which} does not match num_layers$"):
        K.OPS[op](**arguments(op, **{first: short}))


@pytest.mark.parametrize("op", launched_ops())
def test_each_op_checks_the_heads_where_its_row_says(op: str) -> None:
    if LAUNCHER_CHECKS[op].heads:
        with pytest.raises(
            KernelCheckError,
            match=r"^page_size=1 and head_num=0 must be positive: the page_head kernel divides by both$",
        ):
            K.OPS[op](**arguments(op, head_num=0))
    else:
        assert "head_num" not in params(K.OPS[op])
    K.OPS[op](**arguments(op, item_size=0))  # item_size 0: nothing copied, so no heads check either


@pytest.mark.parametrize("op", launched_ops())
def test_each_op_takes_block_quota_none_only_where_its_row_reads_the_environment(
    op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_HICACHE_BLOCK_QUOTA", "0")
    if LAUNCHER_CHECKS[op].quota_from_env:
        with pytest.raises(KernelCheckError, match=r"^block_quota=0 and num_warps_per_block=32 must be positive: "):
            K.OPS[op](**arguments(op, block_quota=None))
        monkeypatch.setenv("SGLANG_HICACHE_BLOCK_QUOTA", "3")
        K.OPS[op](**arguments(op, block_quota=None, item_size=0))
    else:
        with pytest.raises(TypeError, match=r"^block_quota must be an integer, got NoneType None$"):
            K.OPS[op](**arguments(op, block_quota=None))


def test_integer_arguments_name_the_argument_and_the_value() -> None:
    op = "transfer_kv_all_layer_lf_pf"
    with pytest.raises(TypeError, match=r"^num_layers must be an integer, got float 3\.0$"):
        K.OPS[op](**arguments(op, num_layers=3.0))
    with pytest.raises(TypeError, match=r"^dst_layout_dim must be an integer, got str '24'$"):
        K.OPS[op](**arguments(op, dst_layout_dim="24"))


def test_no_module_of_the_package_is_named_like_a_name_it_exports() -> None:
    # `import ...kernels.install as m` would give the function install, not a module of that name
    modules = {info.name for info in pkgutil.iter_modules(K.__path__)}
    assert modules == {"arguments", "checks", "installation", "kvcacheio", "mamba", "memory"}
    assert not modules & set(K.__all__)


def test_pyproject_lists_every_package_folder() -> None:
    block = re.search(r"^\[tool\.setuptools\]\npackages = \[(.*?)\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert block is not None
    listed = set(re.findall(r'"([\w.]+)"', block.group(1)))
    folders = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for p in (ROOT / "hicache_obs").rglob("__init__.py")
        if not re.search(r"(^|/)(_boot|__pycache__)(/|$)", p.parent.relative_to(ROOT).as_posix())
    }
    assert "hicache_obs.lab.sglang.kernels" in folders
    assert folders <= listed, f"packages a non-editable install would leave out: {sorted(folders - listed)}"

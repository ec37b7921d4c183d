"""SGLang's real HiCache bugs, each measured on the release that has it and the one that fixed it.

Each row of :data:`ROWS` is a bug SGLang shipped and later fixed. :func:`measure` runs the
row's workload on the SGLang release installed here, through SGLang's own tree cache (or,
for a row whose pool the trees here cannot carry, its controller calls), with every io
backend and host layout the release takes, and returns what the auditor found. The
results are committed per release (``bug_results/<release>.json``): ``test_bug_table.py``
measures them again under each release and compares; ``tests/docs/test_bugs_doc.py``
checks that ``docs/bugs.md`` is :func:`render` of them. Rewrite both with::

    HICACHE_REGENERATE_GOLDENS=1 make test     # each release's results
    python tests/integrations/sglang/bug_table.py --write   # docs/bugs.md
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "bug_results"
DOC = HERE.parents[2] / "docs" / "bugs.md"


@dataclass(frozen=True)
class Row:
    number: int
    fix: str  # SGLang's pull request
    bug: str  # the last release on PyPI with the bug
    fixed: str  # the release the table measures as fixed
    rule: str  # what hicache-obs reports
    what: str
    driver: str


ROWS = (
    Row(
        1,
        "#22940",
        "0.5.10",
        "0.5.11",
        "unrecorded_index",
        "hybrid pool (Mamba) index tensors neither moved to the device nor recorded on the transfer "
        "stream; with the kernel backend the copy refuses the host indices (`index_not_on_device`)",
        "the hybrid tree (HiMambaRadixCache), write_through, three conversations on a 128-token device pool",
    ),
    Row(
        2,
        "#24585",
        "0.5.12",
        "0.5.13",
        "slot_not_allocated",
        "UnifiedRadixCache under write_back demotes a node right after submitting its backup: the "
        "device slots the write still reads are freed (use after free); SGLang asserts at the next step",
        "UnifiedRadixCache (KV), write_back, six requests on a 128-token device pool",
    ),
    Row(
        3,
        "#27953",
        "0.5.13",
        "0.5.23",
        "pool_omitted",
        "on a hybrid model, the controller's own copies leave out the draft model's KV pool "
        "(speculative decoding): never backed up, stale after a load",
        "the hybrid tree (0.5.13: UnifiedRadixCache with a Mamba component) with a draft model's KV "
        "pool registered as the scheduler does, the three conversations of row 1",
    ),
)


@dataclass
class Case:
    row: int
    release: str
    io_backend: str
    layout: str
    findings: dict[str, dict[str, int]] = field(default_factory=dict)  # rule -> pool -> count
    outcome: str = ""

    def key(self) -> tuple[int, str, str, str]:
        return (self.row, self.release, self.io_backend, self.layout)


BACKENDS = (
    ("direct", "page_first_direct"),
    ("direct", "layer_first"),
    ("kernel", "page_first"),
    ("kernel", "layer_first"),
)


def _counts(found: list[Any]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (rule, pool), n in sorted(Counter((f.rule, f.pool) for f in found).items()):
        out.setdefault(rule, {})[pool] = n
    return out


def _plain_events(log: Any) -> list[Any]:
    from hicache_obs.events._schema import AuditViolation

    log.flush()
    return [e for e in log.events() if not isinstance(e, AuditViolation)]


def _instrumented_hybrid_tree(io_backend: str, layout: str) -> tuple[Any, Any]:
    """SGLang's hybrid tree with its controller instrumented into a log; (None, None) for a
    layout the release's Mamba host pool refuses (0.5.2x asserts a page layout)."""
    from hicache_obs.core import ModelSpec
    from hicache_obs.events import EventLog
    from hicache_obs.integrations.sglang import instrument
    from hicache_obs.lab.sglang.tree import build_hybrid_tree

    try:
        t = build_hybrid_tree(ModelSpec.tiny_hybrid(), io_backend=io_backend, layout=layout)
    except AssertionError as exc:
        if "Unsupported layout" in str(exc):
            return None, None
        raise
    log = EventLog()
    instrument(t.controller, log=log)
    return t, log


def _row1(release: str, io_backend: str, layout: str) -> Case | None:
    from test_tree_hybrid import WORKLOAD

    from hicache_obs.events._audit import audit

    t, log = _instrumented_hybrid_tree(io_backend, layout)
    if t is None:
        return None
    outcome = "every request served, data intact"
    try:
        served = [t.serve(tokens) for tokens in WORKLOAD]
        t.step()
        if not all(s.data_ok and s.mamba_ok for s in served):
            outcome = "every request served, data NOT intact"
    except Exception as exc:
        outcome = f"the first backup raised {type(exc).__name__} out of the tree's insert"
    return Case(1, release, io_backend, layout, _counts(audit(_plain_events(log))), outcome)


def _row2(release: str, io_backend: str, layout: str) -> Case | None:
    from test_tree import WORKLOAD

    from hicache_obs.core import ModelSpec
    from hicache_obs.events import EventLog
    from hicache_obs.events._audit import audit
    from hicache_obs.integrations.sglang import instrument
    from hicache_obs.lab.sglang.tree import build_tree

    t = build_tree(ModelSpec.tiny(), io_backend=io_backend, layout=layout, device_size=128)
    log = EventLog()
    instrument(t.controller, log=log)
    outcome = "every request served, data intact"
    try:
        served = [t.serve(tokens) for tokens in WORKLOAD]
        t.step()
        if not all(s.data_ok for s in served):
            outcome = "every request served, data NOT intact"
    except AssertionError:
        outcome = "SGLang's own assertion at the next check_hicache_events"
    found = [f for f in audit(_plain_events(log)) if f.rule != "incomplete_operation" or outcome.startswith("every")]
    return Case(2, release, io_backend, layout, _counts(found), outcome)


def _row3(release: str, io_backend: str, layout: str) -> Case | None:
    from test_tree_hybrid import WORKLOAD

    from hicache_obs.events._audit import audit

    t, log = _instrumented_hybrid_tree(io_backend, layout)
    if t is None:
        return None
    t.add_draft()  # as the scheduler does: after the tree built the controller
    served = [t.serve(tokens) for tokens in WORKLOAD]
    t.step()
    if not all(s.data_ok and s.mamba_ok for s in served):
        outcome = "KV or Mamba data NOT intact"
    elif all(s.draft_ok for s in served):
        outcome = "every request served, draft KV intact"
    else:
        outcome = "every request served; the draft KV is stale after the first load back"
    return Case(3, release, io_backend, layout, _counts(audit(_plain_events(log))), outcome)


_MEASURE = {1: _row1, 2: _row2, 3: _row3}


def rows_for(release: str) -> list[Row]:
    """The rows this release is the buggy or the fixed release of."""
    return [r for r in ROWS if release in (r.bug, r.fixed)]


def measure(release: str) -> list[Case]:
    """Every row of this release, every io backend and layout it takes."""
    cases = []
    for row in rows_for(release):
        for io_backend, layout in BACKENDS:
            case = _MEASURE[row.number](release, io_backend, layout)
            if case is not None:
                cases.append(case)
    return cases


def results_path(release: str) -> Path:
    return RESULTS / f"{release}.json"


def load(release: str) -> list[Case]:
    data = json.loads(results_path(release).read_text())
    return [Case(**c) for c in data["cases"]]


def dump(release: str, cases: list[Case]) -> None:
    RESULTS.mkdir(exist_ok=True)
    text = json.dumps({"release": release, "cases": [asdict(c) for c in cases]}, indent=1, sort_keys=True)
    results_path(release).write_text(text + "\n")


def _findings(f: dict[str, dict[str, int]]) -> str:
    parts = [f"`{rule}` {pool} {n}" for rule, pools in f.items() for pool, n in pools.items()]
    return ", ".join(parts) or "none"


def render() -> str:
    """``docs/bugs.md``: the table of every row, from the committed results."""
    lines = [
        "# SGLang's HiCache bugs, as hicache-obs sees them",
        "",
        "<!-- Generated by tests/integrations/sglang/bug_table.py from bug_results/*.json, the",
        "     results the tests measured on each release: do not edit; see that module. -->",
        "",
        "Each row is a bug SGLang shipped in a release on PyPI and fixed in a later one. The",
        "workload runs on both releases, on this project's CPU harness. It runs through SGLang's",
        "own code as the scheduler calls it, with the adapter attached (`instrument()`). It runs",
        "with every io backend and host layout the release takes. The bug's release must show the",
        "row's rule. The fixing release must show no finding of any rule. The tests measure this",
        "again on every `make test` (`tests/integrations/sglang/test_bug_table.py`).",
        "",
        "The \"Fixed in\" column is the pinned release the table measures. Row 3's fix first ships",
        "in 0.5.14. The hybrid trees of 0.5.14 run the row's workload clean, with the draft KV",
        "intact (`make sglang-check`, `tests/integrations/sglang/test_tree_draft.py`).",
        "",
        "| row | SGLang fix | bug in | fixed in | rule | what goes wrong |",
        "|---|---|---|---|---|---|",
    ]
    for r in ROWS:
        lines.append(f"| {r.number} | {r.fix} | {r.bug} | {r.fixed} | `{r.rule}` | {r.what} |")
    for r in ROWS:
        lines += ["", f"## Row {r.number}: SGLang {r.fix}", "", f"Workload: {r.driver}.", ""]
        lines += ["| release | io backend | layout | findings (rule, pool, count) | outcome |", "|---|---|---|---|---|"]
        for release in (r.bug, r.fixed):
            for c in load(release):
                if c.row == r.number:
                    lines.append(f"| {release} | {c.io_backend} | {c.layout} | {_findings(c.findings)} | {c.outcome} |")
    lines += ["", *CORRUPTION, "", *NOT_ON_PYPI]
    return "\n".join(lines) + "\n"


#: Row 2's corruption itself, on the CPU (tests/integrations/sglang/test_cuda_semantics.py).
CORRUPTION = [
    "## Row 2's corruption, on the CPU",
    "",
    "On the CPU harness a copy runs when SGLang calls it. So 0.5.12 backs up the right rows, and",
    "only the log shows the use after free. With `deferred.cuda_semantics()`, the harness runs a",
    "side-stream copy when its stream is waited for, as late as a GPU may. Then 0.5.12's",
    "write-back of a demoted node copies the rows of the request that took the freed slots. It",
    "does so with both io backends and every layout, before SGLang's own assertion ends the run.",
    "0.5.13 serves the same workload under the same rules with every row intact, loads back",
    "included.",
    "",
    "Rows 1 and 3 need no such run. Row 1's direct copies read their indices at once, and its",
    "kernel copies refuse to start, so no copy reads a reused index. Row 3 never copies the",
    "draft at all. So its rows are stale on every schedule (the table's outcome).",
]

#: The bugs of the same class that SGLang fixed before any release shipped them: no release to
#: measure, so the tests put the fault in by hand (tests/integrations/sglang/test_misplaced_indices.py).
NOT_ON_PYPI = [
    "## Fixed before a release",
    "",
    "SGLang #23427 was a regression of #22940's first fix, fixed before any release on PyPI.",
    "The hybrid controller moved a Mamba transfer's host indices to the GPU in place, in the",
    "tree's own transfer record. The host eviction later handed those GPU indices to the Mamba",
    "host pool's free, which crashed on the device mismatch.",
    "",
    "The rule `misplaced_indices` reports a free (or an allocation's `last_loc`) handed indices",
    "on another device than the pool's free lists. It reports it before the call runs, from the",
    "tensor's device alone. On every pinned release, the tests hand the Mamba host pool's free a",
    "transfer's indices on the device, and a device pool's free host indices. Every clean run of",
    "the table above is also clean of this rule.",
]


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/integrations/sglang/bug_table.py --write")
    DOC.write_text(render())
    print(f"wrote {DOC}")

"""The radix tree of cached prefixes: its nodes, the prefix match, linking and unlinking.

A request asks for the first chunks of one document, then a unique suffix. Each
document chunk is one node, found by its :class:`DocSlot`; the node of chunk ``k``
is a child of the node of chunk ``k - 1``. A suffix is a node below the last chunk
that no later request matches. A node holds, per pool, its index tensors on the
device and on the host, the data the workload wrote there, and its LRU state.
Freeing a node's slots is the caller's (:mod:`.eviction`); the tree only links.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hicache_obs.core._controller import ANCHOR

__all__ = ["Indices", "Data", "DocSlot", "RadixNode", "RadixTree"]

Indices = dict[str, torch.Tensor]  # pool -> index tensor
Data = dict[str, dict[str, torch.Tensor]]  # pool -> plane -> (layers, n, *item)


@dataclass(frozen=True, slots=True)
class DocSlot:
    """Where a document chunk sits: the ``chunk``-th node of ``document``'s chain."""

    document: int
    chunk: int


class RadixNode:
    """One cached chunk or suffix: its slots per tier, the data written there, its LRU state."""

    __slots__ = (
        "id",
        "parent",
        "children",
        "slot",
        "tokens",
        "sizes",
        "data",
        "device",
        "host",
        "pending_host",
        "loading",
        "stale",
        "hits",
        "last_used",
        "lock",
        "alive",
    )

    def __init__(self, node_id: int, parent: RadixNode | None, slot: DocSlot | None, sizes: dict[str, int]) -> None:
        self.id = node_id
        self.parent = parent
        self.children: list[RadixNode] = []
        self.slot = slot  # None for a suffix
        self.sizes = sizes  # pool -> slots
        self.tokens = sizes[ANCHOR]
        self.data: Data = {}
        self.device: Indices | None = None
        self.host: Indices | None = None
        self.pending_host: Indices | None = None  # host slots of a write in flight
        self.loading = False
        self.stale = False  # host indices kept after they were freed (use-after-free caller bug)
        self.hits = 0
        self.last_used = 0
        self.lock = 0  # requests using the node now: it cannot be evicted
        self.alive = True


class RadixTree:
    """Every live node by id, and each document's chain of chunk nodes."""

    def __init__(self, documents: int, chunks_per_document: int) -> None:
        self.nodes: dict[int, RadixNode] = {}
        self.doc_nodes: list[list[RadixNode | None]] = [[None] * chunks_per_document for _ in range(documents)]
        self._next_id = 0

    def match(self, document: int, depth: int) -> list[RadixNode]:
        """The cached part of ``depth`` chunks of ``document``: its chain up to the first chunk not in the tree."""
        path: list[RadixNode] = []
        chain = self.doc_nodes[document]
        for k in range(depth):
            node = chain[k]
            if node is None:
                break
            path.append(node)
        return path

    def add(self, parent: RadixNode | None, slot: DocSlot | None, sizes: dict[str, int]) -> RadixNode:
        """A new node (the next id) below ``parent``, at ``slot`` when it is a document chunk."""
        node = RadixNode(self._next_id, parent, slot, sizes)
        self._next_id += 1
        if parent is not None:
            parent.children.append(node)
        if slot is not None:
            self.doc_nodes[slot.document][slot.chunk] = node
        self.nodes[node.id] = node
        return node

    def unlink(self, node: RadixNode) -> None:
        """Take ``node`` out of the tree; it is dead from now on (its slots are the caller's to free)."""
        node.alive = False
        if node.parent is not None and node in node.parent.children:
            node.parent.children.remove(node)
        slot = node.slot
        if slot is not None and self.doc_nodes[slot.document][slot.chunk] is node:
            self.doc_nodes[slot.document][slot.chunk] = None
        self.nodes.pop(node.id, None)

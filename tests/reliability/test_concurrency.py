"""Several threads write and load while an ack poller runs and a scraper reads /metrics."""

from __future__ import annotations

import threading
import time
import urllib.request

import torch
from prometheus_client.parser import text_string_to_metric_families

from hicache_obs.core import HybridCacheController, ModelSpec, PoolTransfer
from hicache_obs.events import TransferCompleted, TransferSubmitted
from hicache_obs.events._audit import Auditor
from hicache_obs.events._replay import replay
from hicache_obs.exporters._prometheus import PrometheusSink, start_metrics_server

THREADS = 4
ROUNDS = 25
TOKENS = 32


def _scrape(url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def test_threads_submitting_while_polling_and_scraping_lose_nothing() -> None:
    c = HybridCacheController(ModelSpec.tiny_hybrid(), runtime="sim", device_size=1024)
    auditor = Auditor().attach(c.log)
    sink = PrometheusSink(log=c.log)
    c.log.add_sink(sink)
    server, port = start_metrics_server(sink.registry)
    url = f"http://127.0.0.1:{port}/metrics"
    done: dict[int, threading.Event] = {}
    done_lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    scrapes = [0]
    mismatches: list[int] = []

    def waiter(node: int) -> threading.Event:
        with done_lock:
            return done.setdefault(node, threading.Event())

    def poller() -> None:
        try:
            while not stop.is_set():
                for ack in c.poll_writes() + c.poll_loads():
                    assert ack.ok, ack.error
                    for node in ack.node_ids:
                        waiter(node * 2 + (ack.direction == "h2d")).set()
                time.sleep(0.0005)
        except BaseException as exc:  # surfaced by the test body
            errors.append(exc)

    def scraper() -> None:
        try:
            while not stop.is_set():
                _scrape(url)
                scrapes[0] += 1
                time.sleep(0.01)
        except BaseException as exc:
            errors.append(exc)

    def worker(w: int) -> None:
        try:
            g = torch.Generator().manual_seed(w)
            for r in range(ROUNDS):
                node = w * 1000 + r
                kv = c.alloc_device(TOKENS)
                mb = c.alloc_device(1, pool="mamba")
                assert kv is not None and mb is not None
                want = {n: torch.randn((p.shape[0], TOKENS, *p.shape[2:]), generator=g).to(p.dtype)
                        for n, p in c.device_pool().planes.items()}
                c.device_pool().write_slots(kv, want)
                res = c.write(kv, node_id=node, pool_transfers=[PoolTransfer("mamba", device_indices=mb)])
                assert res is not None
                host, tr = res
                assert waiter(node * 2).wait(30), "write never acked"
                c.evict_device(kv)
                c.evict_device(mb, pool="mamba")
                got = c.load(host, node_id=node, pool_transfers=[PoolTransfer("mamba", host_indices=tr[0].host_indices)])
                assert got is not None
                dev, tr2 = got
                c.start_loading()
                assert waiter(node * 2 + 1).wait(30), "load never acked"
                back = c.device_pool().read_slots(dev)
                if not all(torch.equal(back[k], want[k]) for k in want):
                    mismatches.append(node)
                c.evict_device(dev)
                c.evict_device(tr2[0].device_indices, pool="mamba")
                c.evict_host(host)
                c.evict_host(tr[0].host_indices, pool="mamba")
        except BaseException as exc:
            errors.append(exc)

    bg = [threading.Thread(target=poller), threading.Thread(target=scraper)]
    workers = [threading.Thread(target=worker, args=(w,)) for w in range(THREADS)]
    for t in bg + workers:
        t.start()
    for t in workers:
        t.join(120)
    stop.set()
    for t in bg:
        t.join(30)
    c.log.flush()
    final = _scrape(url)
    server.stop()
    c.close()

    assert not errors, errors
    assert not mismatches, f"data differs for nodes {mismatches}"
    assert scrapes[0] >= 2
    events = c.log.events()
    # no lost or duplicated seq
    assert [e.seq for e in events] == list(range(len(events)))
    # bookkeeping equals the replay of the log, and nothing leaked
    assert replay(events).state.snapshot() == c.state.snapshot()
    assert all(t.used == 0 for t in c.state.tables.values())
    assert auditor.finish() == []
    # counters equal the events
    completed = [e for e in events if isinstance(e, TransferCompleted)]
    submitted = {e.op: e for e in events if isinstance(e, TransferSubmitted)}
    for d in ("d2h", "h2d"):
        n = sum(1 for e in completed if e.direction == d)
        assert final[("hicache_operations_total", frozenset({("direction", d), ("status", "completed")}))] == n
        for pool in ("kv", "mamba"):
            slots = sum(dict(submitted[e.op].slots_by_pool).get(pool, 0) for e in completed if e.direction == d)
            assert slots == THREADS * ROUNDS * (TOKENS if pool == "kv" else 1)
            assert final[("hicache_transfer_slots_total", frozenset({("pool", pool), ("direction", d)}))] == slots
    assert final[("hicache_events_dropped_total", frozenset({("sink", sink.name)}))] == 0

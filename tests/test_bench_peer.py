"""scripts/bench_peer.py: the estimate's arithmetic, and its Flax-free rows on a 4x2 mesh."""

import importlib.util
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

import redcoast as rc

SCRIPT = Path(__file__).parent.parent / "scripts" / "bench_peer.py"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("bench_peer", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_peer"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules["bench_peer"]


def test_ring_factors(bench: ModuleType) -> None:
    seconds = bench.collective_seconds
    # 1 GB over 4 devices at 100 GB/s
    assert math.isclose(seconds("all-reduce", 1e9, 4, 100e9), 2 * 0.75 * 1e9 / 100e9)
    assert math.isclose(seconds("all-gather", 1e9, 4, 100e9), 0.75 * 1e9 / 100e9)
    # a reduce-scatter's result is one of the 4 shards it reduces
    assert math.isclose(seconds("reduce-scatter", 0.25e9, 4, 100e9), 0.75 * 1e9 / 100e9)
    assert math.isclose(seconds("collective-permute", 1e9, 2, 100e9), 1e9 / 100e9)
    assert seconds("all-reduce", 1e9, 1, 100e9) == 0.0


def test_estimate_groups_by_axis(bench: ModuleType) -> None:
    a100 = next(a for a in bench.ACCELERATORS if a.name.startswith("A100"))
    found = [
        ["all-reduce", "data", 300e6],  # over 2 devices: 300 MB at 300 GB/s
        ["all-reduce", "model", 300e6],  # over 4 devices: 450 MB
        ["all-gather", "both", 800e6],  # over 8 devices: 700 MB
        ["all-reduce", "none", 1e12],  # a group of one moves nothing
    ]
    out = bench.estimate(a100.flops_per_s * 1e-3, found, 2, 4, a100)
    assert math.isclose(out["compute_ms"], 1.0)
    comm = (300e6 + 450e6 + 700e6) / a100.link_bytes_per_s * 1e3
    assert math.isclose(out["comm_ms"], comm)
    assert math.isclose(out["step_ms"], 1.0 + comm)


@pytest.mark.slow
def test_flax_free_rows_train(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench, "COMPILES", 1)
    mesh = rc.make_mesh(2)
    ids = bench.text_ids()
    rows = [
        bench.redcoast_row(mesh, ids, fsdp=False),
        bench.hand_row(mesh, ids),
        bench.plain_row(mesh, ids),
    ]
    first = [r.first_loss for r in rows]
    last = [r.run(3) for r in rows]
    # The same model, data and optimizer: the same numbers, and the loss falls.
    for f, s in zip(first[1:], last[1:], strict=True):
        assert math.isclose(first[0], f, rel_tol=1e-5)
        assert math.isclose(last[0], s, rel_tol=1e-4)
    assert last[0] < first[0] - 0.5
    tp, hand, plain = (bench.analyse(r, mesh) for r in rows)
    # The dataflow plan is Megatron-LM's layout: the same model-axis traffic.
    assert tp["collectives"]["model"]["bytes"] == hand["collectives"]["model"]["bytes"]
    assert tp["collectives"]["model"]["bytes"] == plain["collectives"]["model"]["bytes"]
    assert tp["state_bytes"] == hand["state_bytes"] == plain["state_bytes"]

"""The shard stream under a real `accelerate launch` of 2 processes x 2 data-loader workers (CPU, gloo).

One launch of tests/vit_mpp/stream_probe.py reads three shard sets: uneven shards, fewer shards than processes x
workers, and the uneven set again over http from a loopback server. The per-rank JSON it writes is checked here.
"""

from __future__ import annotations

import collections
import json

import pytest

from tests.helpers.processes import launch
from tests.helpers.servers import serve_directory
from tests.helpers.shards import write_shard_set

# 36 train samples in 6 uneven shards: the global batch 2 ranks x 2 workers x 3 = 12 divides it.
UNEVEN = {"train": [7, 1, 12, 4, 9, 3], "val": [5, 2, 4]}
FEW = {"train": [24], "val": [7]}  # one shard for 4 workers in all
EPOCHS = 3


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Run the probe once under `accelerate launch`; returns ({set name: [rank0, rank1]}, stderr)."""
    root = tmp_path_factory.mktemp("launch")
    uneven = write_shard_set(root / "uneven", UNEVEN, size=8)
    few = write_shard_set(root / "few", FEW, size=8)
    out = root / "out"
    with serve_directory(uneven) as url:
        # The timeout is the hang detector: unequal step counts would block a collective forever.
        result = launch("tests/vit_mpp/stream_probe.py", str(out), f"uneven={uneven}", f"few={few}", f"http={url}",
                        "--workers", "2", "--batch", "3", "--epochs", str(EPOCHS), timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    sets = {name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(2)]
            for name in ("uneven", "few", "http")}
    return sets, result.stderr


def keys(split: str, n: int) -> collections.Counter:
    return collections.Counter(f"{split}_{i:06d}" for i in range(n))


@pytest.mark.parametrize("name, layout", [("uneven", UNEVEN), ("few", FEW), ("http", UNEVEN)])
def test_train_equal_steps_every_sample_once_new_order_each_epoch(launched, name, layout):
    ranks = launched[0][name]
    n = sum(layout["train"])
    orders = []
    for epoch in range(EPOCHS):
        steps = [r["train"][epoch]["steps_all_ranks"] for r in ranks]
        assert steps[0] == steps[1] == [EPOCHS * n // (2 * 3)] * 2  # both ranks ran the same steps (gathered)
        seen = [k for r in ranks for k in r["train"][epoch]["keys"]]  # the keys read in this epoch of the set
        assert collections.Counter(seen) == keys("train", n)  # every sample exactly once
        orders.append(seen)
    assert orders[0] != orders[1] and orders[1] != orders[2] and orders[0] != orders[2]


@pytest.mark.parametrize("name, layout", [("uneven", UNEVEN), ("few", FEW), ("http", UNEVEN)])
def test_eval_each_key_once_and_metrics_across_ranks(launched, name, layout):
    ranks = launched[0][name]
    n = sum(layout["val"])
    assert ranks[0]["val"]["batches_all_ranks"] == ranks[1]["val"]["batches_all_ranks"]
    assert len(set(ranks[0]["val"]["batches_all_ranks"])) == 1  # same batch count on every rank
    seen = [k for r in ranks for k in r["val"]["keys"]]
    assert collections.Counter(seen) == keys("val", n)
    labels = [i % 3 for i in range(n)]  # write_shard_set labels sample i with i % 3
    expected = [n, sum(labels), labels.count(0)]
    for r in ranks:
        assert r["val"]["reduced"] == expected  # reduce(sum) of valid counts, label sums, label-0 hits
        assert r["val"]["gathered_labels"] == sorted(labels)  # gather_for_metrics + the valid mask


def test_fewer_shards_than_workers_warns_once_per_split_on_rank_0(launched):
    stderr = launched[1]
    warnings = [ln for ln in stderr.splitlines() if "shards are read by several workers" in ln]
    # few: train (1 shard) and val (1 shard); uneven/http: val (3 shards < 4 workers); printed by rank 0 only.
    assert len(warnings) == 4, stderr
    assert sum("(split 'train') has 1 shard(s) for 2 process(es) x 2 worker(s)" in w for w in warnings) == 1

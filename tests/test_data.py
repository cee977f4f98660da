"""data.py: shuffling, this process's rows, collate checks, global batches, padding."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc
from redcoast.train.data import collate_examples, epoch_order, global_batch_size, process_rows


def collate_fn(examples):
    return {
        "x": np.stack([e["x"] for e in examples]),
        "id": np.array([e["id"] for e in examples], np.int32),
    }


def _examples(n):
    return [{"x": np.full(3, i, np.float32), "id": i} for i in range(n)]


def test_epoch_order_is_shared_per_seed_and_epoch():
    a = epoch_order(100, seed=3, epoch=0)
    assert sorted(a.tolist()) == list(range(100))
    np.testing.assert_array_equal(a, epoch_order(100, seed=3, epoch=0))
    assert not np.array_equal(a, epoch_order(100, seed=3, epoch=1))
    assert not np.array_equal(a, epoch_order(100, seed=4, epoch=0))
    np.testing.assert_array_equal(epoch_order(5, seed=0, epoch=0, shuffle=False), np.arange(5))


def test_train_batches_are_global_shuffled_and_drop_the_last_partial_batch():
    mesh = rc.make_mesh(2)  # 4 data shards
    out = list(rc.batches(_examples(20), collate_fn=collate_fn, mesh=mesh, batch_size=8, epoch=1))
    assert len(out) == 2
    order = epoch_order(20, seed=0, epoch=1)
    for i, batch in enumerate(out):
        assert isinstance(batch, rc.Batch) and batch.n_valid == 8
        np.testing.assert_array_equal(batch.indices, order[i * 8 : (i + 1) * 8])
        ids = batch.arrays["id"]
        assert ids.shape == (8,) and batch.arrays["x"].shape == (8, 3)
        assert ids.sharding.is_equivalent_to(NamedSharding(mesh, P("data")), 1)
        np.testing.assert_array_equal(np.asarray(ids), batch.indices)


def test_eval_batches_keep_order_and_pad_the_last_batch():
    mesh = rc.make_mesh(1)
    out = list(
        rc.batches(
            _examples(19),
            collate_fn=collate_fn,
            mesh=mesh,
            batch_size=8,
            shuffle=False,
            drop_last=False,
        )
    )
    assert [b.n_valid for b in out] == [8, 8, 3]
    np.testing.assert_array_equal(out[2].indices, [16, 17, 18] + [18] * 5)
    np.testing.assert_array_equal(np.concatenate([b.indices[: b.n_valid] for b in out]), range(19))


def test_one_process_holds_every_row_and_sizes_multiply():
    mesh = rc.make_mesh(4)
    np.testing.assert_array_equal(process_rows(mesh, 6), np.arange(6))
    assert global_batch_size(mesh, 3, 4) == 3 * 2 * 4
    assert global_batch_size(mesh, 3, 4, split_rows=False) == 3 * 4  # context parallelism
    with pytest.raises(ValueError, match="per_device_batch_size must be a positive int"):
        global_batch_size(mesh, 0)


def test_whole_rows_reach_every_device_for_context_parallelism():
    # 3 rows on 8 data shards: no split of the rows, every device holds all of them.
    mesh = rc.make_mesh(1)
    (batch,) = rc.batches(
        _examples(3), collate_fn=collate_fn, mesh=mesh, batch_size=3, split_rows=False
    )
    for x in batch.arrays.values():
        assert x.shape[0] == 3 and x.sharding.is_fully_replicated


def test_batch_size_that_does_not_divide_the_data_shards_is_a_clear_error():
    with pytest.raises(ValueError, match="12 rows does not divide across the mesh's 8 data shards"):
        next(rc.batches(_examples(40), collate_fn=collate_fn, mesh=rc.make_mesh(1), batch_size=12))


def test_empty_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="example sequence is empty"):
        next(rc.batches([], collate_fn=collate_fn, mesh=rc.make_mesh(1), batch_size=8))


def test_collate_fn_must_return_a_dict_of_arrays_sharing_the_batch_axis():
    def as_list(examples):
        return [e["x"] for e in examples]

    with pytest.raises(
        TypeError, match=r"collate_fn \(as_list\) must return a dict.*4 examples.*list"
    ):
        collate_examples(as_list, _examples(4))

    def short_labels(examples):
        return {"x": np.stack([e["x"] for e in examples]), "y": np.zeros(len(examples) - 1)}

    with pytest.raises(ValueError, match=r"short_labels.*given 4 examples.*'y': \(3,\)"):
        collate_examples(short_labels, _examples(4))

    def ragged(examples):
        return {"x": [list(range(e["id"] + 1)) for e in examples]}

    with pytest.raises(ValueError, match=r"collate_fn \(ragged\) returned a ragged value for 'x'"):
        collate_examples(ragged, _examples(4))

    def scalar(examples):
        return {"n": len(examples)}

    with pytest.raises(ValueError, match=r"leading axis is 4; it returned shapes \{'n': \(\)\}"):
        collate_examples(scalar, _examples(4))
    # The same check guards every batch that batches() builds.
    with pytest.raises(TypeError, match="must return a dict"):
        next(rc.batches(_examples(16), collate_fn=as_list, mesh=rc.make_mesh(1), batch_size=8))
    assert jax.device_count() == 8

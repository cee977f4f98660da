"""Checkpoints: any mesh to any mesh, readable without redcoast, and loud about damage."""

import json
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import safetensors.numpy
import xxhash
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tiny import TinyGPT

import redcoast as rc
from redcoast.checkpoint._io import CheckpointError

IDS = jnp.zeros((2, 8), jnp.int32)


def make() -> TinyGPT:
    return TinyGPT(hidden=64, heads=8, key=jax.random.key(0))


def specs_for(model: TinyGPT, n: int) -> object:
    return rc.sharding_plan(model, n, example_call=lambda m: jax.vmap(m)(IDS)).specs


def arrays(tree: object) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(eqx.filter(tree, eqx.is_array))]


def assert_tree_equal(a: object, b: object) -> None:
    for x, y in zip(arrays(a), arrays(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, TinyGPT, object]:
    model = make()
    mesh = rc.make_mesh(4)  # 2 x 4
    sharded = rc.place(model, mesh, specs=specs_for(model, 4))
    opt = optax.adam(1e-3)
    opt_state = jax.jit(opt.init)(eqx.filter(sharded, eqx.is_inexact_array))
    path = rc.save_checkpoint(
        tmp_path / "ckpt",
        model=sharded,
        opt_state=opt_state,
        step=7,
        epoch=1,
        metrics={"loss": np.float32(1.5)},
    )
    return path, model, opt_state


def test_save_at_2x4_load_at_1x8_and_on_one_device(saved: tuple[Path, TinyGPT, object]) -> None:
    path, model, _ = saved
    like = make()
    mesh8 = rc.make_mesh(8)
    specs8 = specs_for(like, 8)
    ckpt = rc.load_checkpoint(path, like=like, mesh=mesh8, specs=specs8)
    assert ckpt.step == 7 and ckpt.state["epoch"] == 1 and ckpt.state["metrics"] == {"loss": 1.5}
    assert_tree_equal(ckpt.model, model)
    got = jax.tree_util.tree_leaves(eqx.filter(ckpt.model, eqx.is_array))
    want = jax.tree_util.tree_leaves(specs8, is_leaf=lambda x: isinstance(x, P))
    for leaf, spec in zip(got, want, strict=True):
        assert leaf.sharding == NamedSharding(mesh8, spec)
    single = rc.load_checkpoint(path, like=like)
    assert_tree_equal(single.model, model)
    assert all(
        len(x.devices()) == 1
        for x in jax.tree_util.tree_leaves(eqx.filter(single.model, eqx.is_array))
    )


def test_optimizer_state_round_trips_and_follows_the_parameters(
    saved: tuple[Path, TinyGPT, object],
) -> None:
    path, _, opt_state = saved
    like = make()
    opt_like = optax.adam(1e-3).init(eqx.filter(like, eqx.is_inexact_array))
    mesh = rc.make_mesh(2)
    specs = specs_for(like, 2)
    ckpt = rc.load_checkpoint(path, like=like, opt_state_like=opt_like, mesh=mesh, specs=specs)
    assert_tree_equal(ckpt.opt_state, opt_state)
    mu = ckpt.opt_state[0].mu  # type: ignore[index]
    assert mu.blocks[0].mlp.fc_in.weight.sharding.spec == P("model", None)


def test_readable_with_plain_safetensors_and_json(saved: tuple[Path, TinyGPT, object]) -> None:
    path, model, _ = saved
    tensors = safetensors.numpy.load_file(str(path / "model.safetensors"))
    assert set(tensors) >= {"embed.weight", "blocks.0.attn.query_proj.weight"}
    np.testing.assert_array_equal(
        tensors["blocks.1.mlp.fc_out.weight"], model.blocks[1].mlp.fc_out.weight
    )
    opt = safetensors.numpy.load_file(str(path / "optimizer.safetensors"))
    assert "0.mu.embed.weight" in opt
    state = json.loads((path / "state.json").read_text())
    assert state["step"] == 7
    assert state["specs"]["blocks.0.mlp.fc_in.weight"] == ["model", None]


def test_large_models_are_split_into_indexed_files(tmp_path: Path) -> None:
    model = make()
    path = rc.save_checkpoint(tmp_path / "c", model=model, step=0, max_shard_bytes=20_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0].startswith("model-00001-of-")
    merged = {}
    for name in files:
        merged.update(safetensors.numpy.load_file(str(path / name)))
    assert set(merged) == set(index["weight_map"])
    assert_tree_equal(rc.load_checkpoint(path, like=make()).model, model)


def test_keys_and_bfloat16_round_trip(tmp_path: Path) -> None:
    tree = {"key": jax.random.key(3), "w": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3)}
    path = rc.save_checkpoint(tmp_path / "k", model=tree, step=1)
    like = {"key": jax.random.key(0), "w": jnp.zeros((2, 3), jnp.bfloat16)}
    got = rc.load_checkpoint(path, like=like).model
    assert jnp.array_equal(jax.random.key_data(got["key"]), jax.random.key_data(tree["key"]))
    assert got["w"].dtype == jnp.bfloat16 and jnp.array_equal(got["w"], tree["w"])
    cast = rc.load_checkpoint(path, like={**like, "w": jnp.zeros((2, 3))}, dtype=jnp.float16)
    assert cast.model["w"].dtype == jnp.float16


def test_overwrite_and_no_leftovers_after_a_failed_save(tmp_path: Path) -> None:
    model = make()
    rc.save_checkpoint(tmp_path / "c", model=model, step=1)
    rc.save_checkpoint(tmp_path / "c", model=model, step=2)
    assert rc.load_checkpoint(tmp_path / "c", like=model).step == 2
    with pytest.raises(TypeError, match=r"state\.json cannot hold"):
        rc.save_checkpoint(tmp_path / "d", model=model, step=3, note=object())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


# ----------------------------------------------------------------------------- damage


def test_missing_file(saved: tuple[Path, TinyGPT, object]) -> None:
    path, _, _ = saved
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model.safetensors: missing"):
        rc.load_checkpoint(path, like=make())


def test_truncated_file(saved: tuple[Path, TinyGPT, object]) -> None:
    path, _, _ = saved
    file = path / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"model.safetensors: truncated; 'ln_f.bias' ends at"):
        rc.load_checkpoint(path, like=make())


def test_missing_and_extra_keys(saved: tuple[Path, TinyGPT, object]) -> None:
    path, _, _ = saved
    bigger = TinyGPT(hidden=64, heads=8, layers=3, key=jax.random.key(0))
    with pytest.raises(CheckpointError, match=r"missing \['blocks.2.attn"):
        rc.load_checkpoint(path, like=bigger)
    smaller = TinyGPT(hidden=64, heads=8, layers=1, key=jax.random.key(0))
    with pytest.raises(CheckpointError, match=r"unexpected \['blocks.1.attn"):
        rc.load_checkpoint(path, like=smaller)


def test_shape_mismatch(saved: tuple[Path, TinyGPT, object]) -> None:
    path, _, _ = saved
    wider = TinyGPT(vocab=128, hidden=64, heads=8, key=jax.random.key(0))
    with pytest.raises(
        CheckpointError, match=r"'embed.weight' has shape \(64, 64\), `like` has \(128, 64\)"
    ):
        rc.load_checkpoint(path, like=wider)


def test_future_format_and_incomplete_folder(saved: tuple[Path, TinyGPT, object]) -> None:
    path, _, _ = saved
    state = json.loads((path / "state.json").read_text())
    (path / "state.json").write_text(json.dumps({**state, "version": 99}))
    with pytest.raises(CheckpointError, match="format version 99 is newer"):
        rc.load_checkpoint(path, like=make())
    (path / "state.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete redcoast checkpoint"):
        rc.load_checkpoint(path, like=make())


def test_state_json_holds_the_xxh3_of_each_tensor(saved: tuple[Path, TinyGPT, object]) -> None:
    path, _, _ = saved
    state = json.loads((path / "state.json").read_text())
    assert state["checksum"] == "xxh3_64" and state["version"] == 2
    for group, stem in [("model", "model"), ("optimizer", "optimizer")]:
        tensors = safetensors.numpy.load_file(str(path / f"{stem}.safetensors"))
        assert set(state["checksums"][group]) == set(tensors)
        for key, value in tensors.items():
            want = xxhash.xxh3_64_hexdigest(np.ascontiguousarray(value).tobytes())
            assert state["checksums"][group][key] == want, key


def test_a_version_1_checkpoint_without_checksums_still_loads(
    saved: tuple[Path, TinyGPT, object],
) -> None:
    path, model, _ = saved
    state = json.loads((path / "state.json").read_text())
    del state["checksum"], state["checksums"]
    (path / "state.json").write_text(json.dumps({**state, "version": 1}))
    assert_tree_equal(rc.load_checkpoint(path, like=make()).model, model)
    (path / "state.json").write_text(json.dumps({**state, "version": 2}))
    with pytest.raises(CheckpointError, match="checksums are missing"):
        rc.load_checkpoint(path, like=make())


def test_checksums_of_another_kind_are_refused(saved: tuple[Path, TinyGPT, object]) -> None:
    path, model, _ = saved
    state = json.loads((path / "state.json").read_text())
    (path / "state.json").write_text(json.dumps({**state, "checksum": "crc32"}))
    with pytest.raises(CheckpointError, match="checksum 'crc32' is not 'xxh3_64'"):
        rc.load_checkpoint(path, like=make())
    assert_tree_equal(rc.load_checkpoint(path, like=make(), verify=False).model, model)

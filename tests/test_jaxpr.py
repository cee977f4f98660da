"""What redcoast reads from jaxprs (`_jaxpr.py`), on equations the installed JAX traces;
and what the dataflow interpreter does with an equation it cannot read.

Each reader test names the primitive, so a JAX release that renames one or moves a
param fails here, by name, before it turns a plan into a note.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import redcoast as rc
from redcoast.nn import dense, normalise
from redcoast.parallel import _jaxpr
from redcoast.parallel._dataflow import RULES, trace_dataflow
from redcoast.parallel._jaxpr import UnknownLayout
from redcoast.parallel.fsdp import GATHERED, remat_policy

X = jnp.ones((3, 8))
W = jnp.ones((8, 8))
STACK = jnp.ones((2, 8, 8))


def eqn_of(names: tuple[str, ...] | str, fn: Callable[..., Any], *args: Any) -> Any:
    """The first equation of `fn`'s top-level jaxpr whose primitive is one of `names`."""
    names = (names,) if isinstance(names, str) else names
    jaxpr = _jaxpr.open_jaxpr(jax.make_jaxpr(fn)(*args))
    assert jaxpr is not None
    found = [e for e in jaxpr.eqns if _jaxpr.name(e) in names]
    seen = sorted({_jaxpr.name(e) for e in jaxpr.eqns})
    assert found, f"JAX {jax.__version__} traced no {names} equation; it traced {seen}"
    return found[0]


def test_scan() -> None:
    def fn(w: jax.Array, x: jax.Array, c: jax.Array) -> Any:
        def body(h: Any, wi: jax.Array) -> Any:
            return (jnp.tanh(h[0] @ wi + c), h[0]), h[1].sum()

        return jax.lax.scan(body, (x, x), w)

    eqn = eqn_of(_jaxpr.SCAN, fn, STACK, X, jnp.ones(8))
    loop = _jaxpr.scan_loop(eqn)
    assert (loop.skip, loop.n_consts, loop.n_carry) == (0, 1, 2), eqn.params.keys()
    assert (len(loop.body.invars), len(loop.body.outvars)) == (4, 3)
    assert loop.body.invars[3].aval.shape == (8, 8)  # one slice of the stacked xs


def test_while() -> None:
    def fn(x: jax.Array, n: jax.Array) -> Any:
        return jax.lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1, s[1] @ W), (0, x))

    eqn = eqn_of(_jaxpr.WHILE, fn, X, jnp.int32(3))
    loop = _jaxpr.while_loop(eqn)
    assert (loop.skip, loop.n_carry) == (1, 2), eqn.params.keys()
    assert len(loop.body.invars) == loop.n_consts + 2 and len(loop.body.outvars) == 2


def test_cond() -> None:
    def fn(i: jax.Array, x: jax.Array) -> Any:
        return jax.lax.switch(i, [lambda a: a @ W, jnp.tanh, jnp.sin], x)

    branches = _jaxpr.cond_branches(eqn_of(_jaxpr.COND, fn, 1, X))
    assert len(branches) == 3 and all(len(b.outvars) == 1 for b in branches)


@jax.custom_vjp
def _twice(x: jax.Array) -> jax.Array:
    return 2 * x


_twice.defvjp(lambda x: (2 * x, None), lambda _, g: (2 * g,))

CALL_SITES: dict[str, Callable[[jax.Array], Any]] = {
    "jit": jax.jit(lambda x: x @ W),
    "remat2": jax.checkpoint(lambda x: jnp.sin(x) @ W),
    "custom_jvp_call": jax.nn.relu,
    "custom_vjp_call": _twice,
}


@pytest.mark.parametrize("name", sorted(CALL_SITES))
def test_calls(name: str) -> None:
    eqn = eqn_of(name, CALL_SITES[name], X)
    body = _jaxpr.called_jaxpr(eqn)
    assert len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars)


def test_every_call_primitive_jax_exports_is_known() -> None:
    prims = jcore.primitives
    for attr in ("jit_p", "closed_call_p", "remat_p", "custom_jvp_call_p", "custom_vjp_call_p"):
        name = getattr(prims, attr).name
        assert name in _jaxpr.CALLS, f"JAX {jax.__version__} calls {attr} {name!r}"
        assert RULES[name].__name__ == "call"
    # closed_call's param, as JAX builds the equation (no public API traces one).
    inner = _jaxpr.open_jaxpr(jax.make_jaxpr(jnp.sin)(X))
    eqn = types.SimpleNamespace(
        primitive=prims.closed_call_p,
        params={"call_jaxpr": inner},
        invars=inner.invars,
        outvars=inner.outvars,
    )
    assert _jaxpr.called_jaxpr(eqn) is inner


def test_zoo_norm_is_a_custom_vjp_call_the_walk_follows() -> None:
    norm = eqx.nn.LayerNorm(8)
    eqn = eqn_of("custom_vjp_call", lambda x: normalise(norm, x), X)
    assert "rsqrt" in [_jaxpr.name(e) for e in _jaxpr.called_jaxpr(eqn).eqns]


def test_zoo_projection_is_a_dot_general_of_the_weight() -> None:
    """What the rules read as a Linear: a `dot_general` whose operand is the weight."""
    layer = eqx.nn.Linear(8, 8, use_bias=False, key=jax.random.key(0))
    jaxpr = jax.make_jaxpr(lambda w, x: dense(eqx.tree_at(lambda m: m.weight, layer, w), x))
    closed = jaxpr(W, X).jaxpr
    dots = [e for e in closed.eqns if _jaxpr.name(e) in _jaxpr.DOT_GENERAL]
    assert len(dots) == 1 and dots[0].invars[1] is closed.invars[0], closed
    assert _jaxpr.dot_dimensions(dots[0]) == (((1,), (1,)), ((), ()))


def test_dot_general() -> None:
    eqn = eqn_of(_jaxpr.DOT_GENERAL, lambda a, b: jnp.einsum("etd,edf->etf", a, b), STACK, STACK)
    assert _jaxpr.dot_dimensions(eqn) == (((2,), (1,)), ((0,), (0,)))


def test_conv_general_dilated() -> None:
    def fn(x: jax.Array, k: jax.Array) -> jax.Array:
        return jax.lax.conv_general_dilated(
            x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    eqn = eqn_of(_jaxpr.CONV, fn, jnp.ones((1, 6, 6, 3)), jnp.ones((2, 2, 3, 5)))
    assert _jaxpr.conv_channels(eqn) == (3, 2, 3)


def test_transpose_squeeze_broadcast_in_dim() -> None:
    perm = eqn_of(_jaxpr.TRANSPOSE, lambda a: a.transpose(2, 0, 1), STACK)
    assert _jaxpr.transpose_permutation(perm) == (2, 0, 1)
    squeeze = eqn_of(_jaxpr.SQUEEZE, lambda a: a[:, :1].squeeze(-2), STACK)
    assert _jaxpr.squeeze_dimensions(squeeze) == (1,)
    bcast = eqn_of(_jaxpr.BROADCAST_IN_DIM, lambda a: jnp.broadcast_to(a, (4, 3, 8)), X)
    assert _jaxpr.broadcast_dimensions(bcast) == (1, 2)


def test_names_the_rules_match_on() -> None:
    def fn(t: jax.Array, i: jax.Array) -> Any:
        return t[jnp.asarray([1, 2])], jax.lax.dynamic_index_in_dim(t, i), t.reshape(2, 64)[:, 1:]

    traced = jax.make_jaxpr(fn)(STACK, 1)
    names: set[str] = set()

    def collect(jaxpr: Any) -> None:
        for e in jaxpr.eqns:
            names.add(_jaxpr.name(e))
            if _jaxpr.name(e) in _jaxpr.CALLS:
                collect(_jaxpr.called_jaxpr(e))

    collect(_jaxpr.open_jaxpr(traced))
    for group in (_jaxpr.GATHER, _jaxpr.DYNAMIC_SLICE, _jaxpr.RESHAPE, _jaxpr.SLICE):
        assert names & set(group), f"JAX {jax.__version__} traced none of {group}: {names}"


def test_combiners_are_no_calls() -> None:
    scatter = eqn_of(
        ("scatter-add", "scatter_add"), lambda x: jnp.zeros(9).at[jnp.arange(3)].add(x), X[0, :3]
    )
    assert not _jaxpr.has_sub_jaxprs(scatter)
    assert _jaxpr.has_sub_jaxprs(eqn_of("jit", CALL_SITES["jit"], X))


def test_checkpoint_name_and_sharding_constraint_as_remat_policies_see_them() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    seen: list[tuple[str | None, bool]] = []

    def policy(prim: Any, *_: Any, **params: Any) -> bool:
        seen.append((_jaxpr.checkpoint_name(prim, params), _jaxpr.is_sharding_constraint(prim)))
        return False

    def fn(x: jax.Array) -> jax.Array:
        y = jax.lax.with_sharding_constraint(
            checkpoint_name(x * 2, GATHERED), NamedSharding(mesh, P())
        )
        return jnp.sin(y).sum()

    jax.grad(jax.checkpoint(fn, policy=policy))(X)
    assert (GATHERED, False) in seen and (None, True) in seen
    # FSDP's policy keeps everything but the gathered weight and its layout change.
    prims = jcore.primitives
    assert not remat_policy()(prims.name_p, name=GATHERED)
    assert remat_policy()(prims.name_p, name="projection")
    assert not remat_policy()(prims.sharding_constraint_p)


# ------------------------------------------------------------ what the walk cannot read


def test_readers_name_what_they_could_not_read() -> None:
    eqn = eqn_of(
        _jaxpr.SCAN, lambda w, x: jax.lax.scan(lambda h, wi: (h @ wi, None), x, w), STACK, X
    )
    bare = types.SimpleNamespace(
        primitive=eqn.primitive,
        params={"jaxpr": eqn.params["jaxpr"]},
        invars=eqn.invars,
        outvars=eqn.outvars,
    )
    with pytest.raises(UnknownLayout, match=r"scan: neither num_consts/num_carry nor .*ft_in"):
        _jaxpr.scan_loop(bare)
    dot = eqn_of(_jaxpr.DOT_GENERAL, jnp.matmul, X, W)
    with pytest.raises(UnknownLayout, match="dot_general: no dimension_numbers"):
        _jaxpr.dot_dimensions(
            types.SimpleNamespace(primitive=dot.primitive, params={}, invars=dot.invars)
        )


def _primitive(name: str) -> jcore.Primitive:
    """A primitive no JAX release has (or `scan` without its params): x, w -> x's shape."""
    prim = jcore.Primitive(name)
    prim.def_abstract_eval(lambda x, *_, **__: x)
    return prim


class ThreeLayers(eqx.Module):
    """`up` (8 -> 16), then an equation the walk cannot read with `mid`, then `down`."""

    up: eqx.nn.Linear
    mid: jax.Array
    down: eqx.nn.Linear
    opaque: Callable[[jax.Array, jax.Array], jax.Array] = eqx.field(static=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.opaque(jax.nn.relu(self.up(x)), self.mid))


BODY = jax.make_jaxpr(lambda h, w: (h @ w,))(jnp.ones(16), jnp.ones((16, 16)))
MYSTERY = _primitive("mystery_call")
FAKE_SCAN = _primitive("scan")
OPAQUE = {
    # A higher-order primitive the interpreter has no rule for.
    "mystery_call": (lambda h, w: MYSTERY.bind(h, w, body=BODY), "no rule follows its sub-jaxprs"),
    # `scan` as a future JAX might lay it out: neither num_consts nor ft_in.
    "scan": (lambda h, w: FAKE_SCAN.bind(h, w, jaxpr=BODY, length=1), "neither num_consts"),
}


@pytest.mark.parametrize("name", sorted(OPAQUE))
def test_an_equation_the_walk_cannot_read_replicates_what_it_touches(name: str) -> None:
    opaque, why = OPAQUE[name]
    keys = jax.random.split(jax.random.key(0), 2)
    model = ThreeLayers(
        eqx.nn.Linear(8, 16, key=keys[0]),
        jnp.ones((16, 16)),
        eqx.nn.Linear(16, 8, key=keys[1]),
        opaque,
    )
    flow = trace_dataflow(lambda m: m(X[0]), model)
    assert why in flow.opaque[name] and flow.touched == {2: name}
    plan = rc.sharding_plan(model, 2, example_call=lambda m: m(X[0]))
    specs = {leaf.path: (leaf.spec, leaf.reason) for leaf in plan.leaves}
    assert specs["mid"] == (
        P(),
        f"replicated: read by `{name}`, which the dataflow interpreter cannot follow",
    )
    # The activations it passes on still carry `up`'s split, so `down` is its row partner.
    assert specs["up.weight"][0] == P("model", None) and specs["down.weight"][0] == P(None, "model")
    text = str(plan)
    note = next(
        line for line in text.splitlines() if f"`{name}`" in line and line.startswith("note: ")
    )
    assert (
        why in note and "1 weight(s) it reads are replicated (mid)" in note and "overrides=" in note
    )
    # An override still wins over the conservative rule.
    forced = rc.sharding_plan(
        model, 2, example_call=lambda m: m(X[0]), overrides={"mid": P("model")}
    )
    assert next(leaf.spec for leaf in forced.leaves if leaf.path == "mid") == P("model")

"""Reinforcement learning: PPO (Schulman et al. 2017) on gymnax's CartPole-v1.

PPO owns its loop: each iteration steps `n_envs` environments `n_steps` times in one
jitted `lax.scan`, acting with `pred_fn`, computes GAE advantages, then makes
`update_epochs` passes over the transitions with `rc.batches` and `rc.train_step`
(`loss_fn` is the clipped surrogate). Reports the final sampling policy's mean return.
"""

import equinox as eqx
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, PRNGKeyArray

import redcoast as rc

ENV, ENV_PARAMS = gymnax.make("CartPole-v1")
GAMMA, LAMBDA, CLIP = 0.99, 0.95, 0.2


class ActorCritic(eqx.Module):
    actor: eqx.nn.MLP  # observation -> action logits
    critic: eqx.nn.MLP  # observation -> value


def collate_fn(transitions: list[dict]) -> dict[str, np.ndarray]:
    return {k: np.stack([t[k] for t in transitions]) for k in transitions[0]}


def loss_fn(model: ActorCritic, batch: dict[str, Array], key: PRNGKeyArray) -> tuple:
    logp = jax.nn.log_softmax(jax.vmap(model.actor)(batch["obs"]))
    ratio = jnp.exp(logp[jnp.arange(len(logp)), batch["action"]] - batch["logp"])
    adv = (batch["advantage"] - batch["advantage"].mean()) / (batch["advantage"].std() + 1e-8)
    policy = -jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - CLIP, 1 + CLIP) * adv).mean()
    value = jnp.mean((jax.vmap(model.critic)(batch["obs"]) - batch["return"]) ** 2)
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1).mean()
    return policy + 0.5 * value - 0.01 * entropy, {"value_loss": value, "entropy": entropy}


def pred_fn(model: ActorCritic, batch: dict[str, Array], key: PRNGKeyArray) -> dict[str, Array]:
    logp = jax.nn.log_softmax(jax.vmap(model.actor)(batch["obs"]))
    action = jax.random.categorical(key, logp)
    value = jax.vmap(model.critic)(batch["obs"])
    return {"action": action, "logp": logp[jnp.arange(len(logp)), action], "value": value}


@eqx.filter_jit
def rollout(model: ActorCritic, carry: tuple, key: PRNGKeyArray, n_steps: int) -> tuple:
    """`n_steps` steps of each environment `(obs, state)` in `carry`, with GAE advantages."""

    def step(carry: tuple, key: PRNGKeyArray) -> tuple:
        obs, states = carry
        out = pred_fn(model, {"obs": obs}, key)
        keys = jax.random.split(jax.random.fold_in(key, 1), len(obs))
        obs2, states, reward, term, trunc, info = jax.vmap(ENV.step, (0, 0, 0, None))(
            keys, states, out["action"], ENV_PARAMS
        )
        # An episode cut by the time limit is bootstrapped with its last state's value.
        target = reward + GAMMA * trunc * jax.vmap(model.critic)(info["final_observation"])
        out.update(obs=obs, reward=reward, target=target, done=(term | trunc).astype(float))
        return (obs2, states), out

    def back(carry: tuple, t: dict) -> tuple:
        adv, next_value = carry
        delta = t["target"] + GAMMA * next_value * (1 - t["done"]) - t["value"]
        adv = delta + GAMMA * LAMBDA * (1 - t["done"]) * adv
        return (adv, t["value"]), adv

    carry, traj = jax.lax.scan(step, carry, jax.random.split(key, n_steps))
    last_value = jax.vmap(model.critic)(carry[0])
    _, adv = jax.lax.scan(back, (jnp.zeros_like(last_value), last_value), traj, reverse=True)
    return carry, {**traj, "advantage": adv, "return": adv + traj["value"]}


def reset(key: PRNGKeyArray, n: int) -> tuple:
    return jax.vmap(ENV.reset, (0, None))(jax.random.split(key, n), ENV_PARAMS)


def main(
    n_model_shards: int = 1,
    per_device_batch_size: int = 128,
    n_iterations: int = 200,
    n_envs: int = 32,
    n_steps: int = 128,
    update_epochs: int = 4,
    learning_rate: float = 1e-3,
    workdir: str | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Train with PPO and report the final policy's mean return.

    Args:
        n_model_shards: devices each model is split over; the rest split the minibatch.
        per_device_batch_size: transitions per data-parallel device per minibatch.
        n_iterations: rollout-and-update iterations.
        n_envs: environments run in parallel.
        n_steps: steps of each environment per rollout.
        update_epochs: passes over each rollout's transitions.
        learning_rate: initial Adam learning rate (linear decay to zero).
        workdir: where metrics.jsonl goes (one line per iteration).
        seed: initialisation, environments and actions.
    """
    mesh = rc.make_mesh(n_model_shards)
    batch_size = rc.global_batch_size(mesh, per_device_batch_size)
    n_updates = n_iterations * update_epochs * (n_envs * n_steps // batch_size)
    schedule = optax.linear_schedule(learning_rate, 0.0, n_updates)
    optimizer = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(schedule, eps=1e-5))
    k1, k2, k_env, k_run, k_eval = jax.random.split(jax.random.key(seed), 5)
    model = ActorCritic(
        eqx.nn.MLP(4, 2, 64, 2, activation=jnp.tanh, key=k1),
        eqx.nn.MLP(4, "scalar", 64, 2, activation=jnp.tanh, key=k2),
    )
    example = {"obs": jnp.zeros((2, 4))}
    model = rc.place(model, mesh, example_call=lambda m: pred_fn(m, example, k1))
    opt_state = optimizer.init(eqx.filter(model, eqx.is_inexact_array))
    step = rc.train_step(loss_fn, optimizer, mesh=mesh)
    log = rc.jsonl_logger(f"{workdir}/metrics.jsonl") if workdir else lambda *_: None
    data = {"collate_fn": collate_fn, "mesh": mesh, "batch_size": batch_size, "seed": seed}
    carry, n = reset(k_env, n_envs), 0
    for it in range(n_iterations):
        carry, traj = rollout(model, carry, jax.random.fold_in(k_run, it), n_steps)
        keep = ("obs", "action", "logp", "advantage", "return")
        flat = [np.asarray(traj[k]).reshape(-1, *traj[k].shape[2:]) for k in keep]
        transitions = [dict(zip(keep, row, strict=True)) for row in zip(*flat, strict=True)]
        for _ in range(update_epochs):
            for batch in rc.batches(transitions, epoch=n, **data):
                key = jax.random.fold_in(k_run, n)
                model, opt_state, metrics = step(model, opt_state, batch.arrays, key)
                n += 1
        episodes = float(traj["done"].sum())  # fewer as the pole stays up longer
        log({"episodes": episodes, **{k: float(v) for k, v in metrics.items()}}, n)
        if (it + 1) % max(1, n_iterations // 10) == 0:
            print(f"iteration {it + 1}: {episodes:.0f} episodes ended in {n_envs * n_steps} steps")
    # The return of the first episode in each of 100 fresh environments.
    _, traj = rollout(model, reset(k_eval, 100), k_eval, ENV_PARAMS.max_steps_in_episode)
    first = jnp.cumsum(traj["done"], axis=0) - traj["done"] == 0
    return {"mean_return": float((traj["reward"] * first).sum(0).mean())}


if __name__ == "__main__":
    main()

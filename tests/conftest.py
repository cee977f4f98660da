"""Every test sees 8 simulated CPU devices, patient with a machine busy compiling.

`LATER` names the repeats of slow checks that `nox -s slow` leaves to `nox -s
exhaustive`: each test below keeps cases in the slow session (other families, masks,
meshes), and these further cases run in the exhaustive one.
"""

import pytest

import redcoast as rc

rc.simulate_devices(8)

LATER = {
    "test_families.py::test_the_rules_give_megatrons_layout": [
        f"{name}-{fsdp}"
        for name, fsdp in [
            ("llama3", False),
            ("llama3", True),
            ("qwen2", False),
            ("qwen2", True),
            ("qwen3", True),
            ("mistral", False),
            ("mistral", True),
            ("gemma2", False),
            ("gemma3", False),
            ("gemma3", True),
            ("phi3", True),
        ]
    ],
    "test_families.py::test_cached_generation_equals_the_uncached_and_sampling_keeps_to_the_"
    "top_k": [
        "qwen2",
        "mistral",
    ],
    "test_context_parallel.py::test_the_ring_with_segments_windows_and_softcaps_equals_"
    "unsplit_attention": [
        "segments-ring-4-blockNone",
        "segments-all_gather-4-blockNone",
        "window-ring-4-blockNone",
        "window-all_gather-4-blockNone",
        "softcap-ring-4-blockNone",
        "softcap-ring-4-block4",
        "softcap-all_gather-4-blockNone",
        "window-ring-4-block4",
    ],
    "test_context_parallel.py::test_split_attention_and_its_gradients_equal_the_unsplit": [
        "ring-no-mask-full-4",
        "all_gather-no-mask-full-4",
        "all_gather-no-mask-causal-4",
        "all_gather-padding-full-4",
    ],
    "test_sharding.py::test_sharded_loss_and_grads_equal_unsharded": [
        "2-llama",
        "2-gptj",
        "2-mlp",
        "4-gptj",
        "8-gpt",
        "8-llama",
    ],
    "test_lora.py::test_sharded_lora_step_equals_unsharded": [
        "gpt2-2-False-False",
        "llama-2-False-False",
    ],
    "test_fsdp.py::test_encoder_decoders_gather_their_embeddings_as_the_decoders_do": ["bart-scan"],
    "test_resume.py::test_a_run_resumed_on_another_mesh_equals_one_never_interrupted": [
        "full-2x4-1",
        "full-1-8x1",
    ],
    "test_resume.py::test_sigkill_then_resume_equals_straight_run": ["9-8"],
    "test_attention.py::test_blockwise_equals_the_einsum_values_and_gradients": [
        "full",
        "window",
        "softcap",
        "segments-not-causal",
        "key-padding",
    ],
    "test_seq2seq.py::test_greedy_and_beam_search_equal_transformers": ["t5"],
    "test_examples.py::test_preference_tunes_a_checkpoint_on_docstring_pairs": ["simpo"],
    "test_context_zoo.py::test_the_step_equals_one_device_beside_every_other_split": [
        "gpt2-cp8-accumulate"
    ],
    "test_models_parallel.py::test_sharded_train_step_equals_unsharded": ["opt"],
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark `LATER`'s cases `exhaustive`; a case named there that its collected test
    does not have is an error (a renamed case would otherwise run in `slow` again)."""
    later = {f"{test}[{case}]" for test, cases in LATER.items() for case in cases}
    ids = {item.nodeid.removeprefix("tests/"): item for item in items}
    for node in later & ids.keys():
        ids[node].add_marker(pytest.mark.exhaustive)
    tests = {node.split("[")[0] for node in ids}
    unknown = sorted(n for n in later - ids.keys() if n.split("[")[0] in tests)
    if unknown:
        raise pytest.UsageError(f"tests/conftest.py LATER names cases not collected: {unknown}")

"""Every test sees 8 simulated CPU devices, patient with a machine busy compiling.

`LATER` names the repeats of slow checks that `nox -s slow` leaves to `nox -s
exhaustive`: each test below keeps cases in the slow session (other families, masks,
meshes), and these further cases run in the exhaustive one. `SLOW` names the longest
cases of the fast tests (seconds each), which `nox -s slow` runs, so that `nox -s tests`
stays within six minutes.
"""

import gc
from pathlib import Path

import jax
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
        "gpt2-4-True-False",
    ],
    "test_fsdp.py::test_encoder_decoders_gather_their_embeddings_as_the_decoders_do": [
        "bart-scan",
        "bart-unrolled",
    ],
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
    "test_models_parallel.py::test_sharded_train_step_equals_unsharded": ["opt"],
    # The control: XLA's own default ends the process (the [True] case is redcoast's).
    "test_faults.py::test_a_device_starved_for_a_minute_aborts_only_without_simulate_devices": [
        "False"
    ],
    "test_fsdp.py::test_fsdp_train_steps_equal_the_unsharded_steps": ["fsdp-gpt2"],
    "test_seq2seq.py::test_remat_and_fsdp_give_the_plain_steps_numbers": ["loop"],
    "test_seq2seq.py::test_sharded_train_step_equals_unsharded": ["bart"],
    "test_seq_parallel.py::test_sequence_parallel_step_equals_the_unsharded_step": ["llama-scan"],
    "test_plan.py::test_the_planners_peak_is_the_real_compiled_steps": ["tp"],
    "test_families.py::test_a_sharded_train_step_equals_one_device": [
        "mixtral-tp",
        "gemma3-tp-fsdp",
    ],
    "test_init.py::test_initial_loss_is_a_uniform_guess": ["opt", "gptj"],
    "test_rules.py::test_sharded_equals_unsharded": ["dit", "bert"],
    "test_context_zoo.py::test_the_step_equals_one_device_beside_every_other_split": [
        "gpt2-cp8-accumulate",
        "llama-cp2-tp4",
    ],
}


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs() -> object:
    """Drop the compiled programs when a test file ends in a process that holds many.
    Each XLA:CPU executable holds hundreds of memory mappings; a worker that keeps every
    program of a hundred slow tests reaches Linux's limit of 65,530
    (`vm.max_map_count`), where compiling the next one crashes the process."""
    yield
    maps = Path("/proc/self/maps")
    if maps.exists() and len(maps.read_text().splitlines()) > 30_000:
        jax.clear_caches()
        gc.collect()


SLOW = {
    "test_distributed.py::test_launch_command_line": [],
    "test_input_checks.py::test_writing_past_the_end_of_the_cache_raises": ["llama"],
    "test_lora.py::test_train_step_with_a_filter_equals_the_full_step_on_the_trainable_part": [],
    "test_lora.py::test_lora_trains_only_the_adapters_of_a_bfloat16_base": [],
    "test_lora.py::test_lora_layout_is_megatron_lms_with_megatron_style_lora": ["gpt2-2"],
    "test_models_parallel.py::test_sharded_train_step_equals_unsharded": ["gpt2"],
    "test_models_parallel.py::test_from_hf_onto_a_mesh_and_generate_under_predict": [],
    "test_progress.py::test_a_run_piped_to_a_file_prints_progress_while_it_runs": [],
    "test_any_model.py::test_the_planner_plans_it": ["how0"],
    "test_plan.py::test_cli_plans_lora_and_refuses_a_target_that_matches_nothing": [],
    "test_precision.py::test_attention_remat_keeps_the_gradients_and_drops_the_scores": ["llama"],
    "test_precision.py::test_pure_bf16_stores_and_trains_in_bfloat16": [],
    "test_preference.py::test_the_precomputed_reference_equals_the_live_one": [],
    "test_sharding.py::test_sharded_loss_and_grads_equal_unsharded": ["4-gpt"],
    "test_examples.py::test_demo_prints_the_plan_a_sample_and_metrics": [],
    "test_context_zoo.py::test_scanned_llama_on_4x2_with_two_rows_equals_one_device": [],
    "test_context_zoo.py::test_a_users_model_with_its_own_split_attention_equals_one_device": [],
    "test_any_model.py::test_sequence_parallelism_on_it_equals_one_device": [],
    "test_precision.py::test_from_hf_takes_the_remat_policy": [],
    "test_fsdp.py::test_fsdp_train_steps_equal_the_unsharded_steps": ["tp2xfsdp-llama-scan"],
    "test_resume.py::test_a_run_resumed_on_another_mesh_equals_one_never_interrupted": [
        "lora-8x1-2x4"
    ],
    "test_init.py::test_initial_loss_is_a_uniform_guess": ["gpt2"],
    "test_seq_parallel.py::test_dropout_keys_give_the_same_numbers_on_every_mesh": ["4"],
    "test_models_parallel.py::test_a_vocabulary_that_divides_nothing_is_padded_split_masked_"
    "and_saved_whole": ["gpt2"],
    "test_dense.py::test_backward_does_not_recompute_the_residual_stream": ["gpt2"],
    "test_lora.py::test_sharded_lora_step_equals_unsharded": ["gpt2-4-False-True"],
    "test_context_parallel.py::test_the_ring_with_segments_windows_and_softcaps_equals_"
    "unsplit_attention": ["all-ring-4-block4"],
    "test_precision.py::test_bf16_tracks_fp32_with_float32_master_weights": ["<lambda>0"],
    "test_rules.py::test_sharded_equals_unsharded": ["moe"],
    "test_sharding.py::test_compiled_traffic_matches_megatron_with_no_weight_all_gathers": ["gpt"],
    "test_quant.py::test_lora_wraps_a_quantized_base_trains_only_adapters_and_merges_back": ["nf4"],
    "test_quant.py::test_a_scanned_stack_decodes_one_layer_at_a_time": ["nf4"],
    "test_quant.py::test_a_qlora_run_resumes_step_exactly_and_refuses_another_base": [],
    "test_quant.py::test_nf4_equals_bitsandbytes": [],
    "test_quant.py::test_the_weight_decodes_tile_by_tile_forward_and_backward": ["int8"],
    "test_lora.py::test_resuming_lora_with_another_alpha_rank_dropout_or_targets_is_refused": [
        "whole_model",
        "trainable",
    ],
    "test_lora.py::test_lora_on_the_zoo_equals_its_merged_model": ["gpt2-False"],
    "test_text.py::test_two_processes_tokenizing_into_one_folder_both_succeed": [],
    "test_context_parallel.py::test_drop_in_for_the_zoo_attention_with_rotary_positions_and_"
    "grouped_heads": [],
    "test_input_checks.py::test_prompt_padding_may_be_any_integer": [],
    "test_precision.py::test_eval_and_predict_steps_run_in_the_policy": [],
    "test_step.py::test_metrics_report_lr_from_inject_hyperparams_and_from_schedule": [],
    "test_fit.py::test_nonfinite_loss_raises_naming_the_step_or_is_skipped": [],
    "test_faults.py::test_simulated_devices_are_patient_at_collectives": [],
    "test_input_checks.py::test_initialize_installs_nothing_process_wide_unless_asked": ["0-False"],
    "test_fit.py::test_lr_in_metrics_jsonl_follows_the_schedule_at_optimizer_steps": [],
    "test_fit.py::test_eval_every_and_final_evaluation": [],
}


def _named(table: dict[str, list[str]], ids: dict[str, pytest.Item], strict: bool) -> set[str]:
    """The node ids a table names: a test's cases, or the test itself for `[]`; when
    whole files are collected (`strict`), a name its test does not have is an error (a
    renamed case would otherwise run in another session again)."""
    named = {
        f"{test}[{case}]" if case else test
        for test, cases in table.items()
        for case in cases or [""]
    }
    tests = {node.split("[")[0] for node in ids}
    unknown = sorted(n for n in named - ids.keys() if n.split("[")[0] in tests)
    if unknown and strict:
        raise pytest.UsageError(f"tests/conftest.py names cases not collected: {unknown}")
    return named & ids.keys()


# The longest tests of each session (seconds here), started first: two workers
# (pytest-xdist) hand out tests in this order, and a long test handed out last keeps one
# worker busy after the other has finished.
LONGEST = (
    "test_readme.py::test_the_readme_runs_in_order_in_an_empty_folder",  # slow, 208
    "test_bench_peer.py::test_flax_free_rows_train",  # slow, 75
    "test_faults.py::test_a_device_starved_for_a_minute_aborts_only_without_simulate_devices",
    "test_quant.py::test_no_full_precision_weight_lives_in_the_compiled_step",  # slow, 42
    "test_examples.py::test_finetune_says_it_pretrains_its_base_for_base_steps_and_pretrained_"
    "makes_one",  # slow, 41
    "test_context_zoo.py::test_fit_and_predict_with_context_parallelism_equal_them_without",
    "test_plan.py::test_cli_plans_and_reports",  # slow, 38
    "test_examples.py::test_example_runs_through_the_cli",  # slow, 35 a case
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `LATER`'s cases `exhaustive` and `SLOW`'s `slow`; `LONGEST` first."""
    ids = {item.nodeid.removeprefix("tests/"): item for item in items}
    # Cases picked by node id (`file.py::test[case]`) leave the test's other cases out.
    strict = not any("::" in arg for arg in config.args)
    for node in _named(LATER, ids, strict):
        ids[node].add_marker(pytest.mark.exhaustive)
    for node in _named(SLOW, ids, strict):
        ids[node].add_marker(pytest.mark.slow)

    def rank(item: pytest.Item) -> int:
        test = item.nodeid.removeprefix("tests/").split("[")[0]
        return LONGEST.index(test) if test in LONGEST else len(LONGEST)

    items.sort(key=rank)  # stable: the rest keep their order

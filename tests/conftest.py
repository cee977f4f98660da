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
        "ring-padding-full-4",
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
        "llama-4-True-False",
    ],
    "test_fsdp.py::test_encoder_decoders_gather_their_embeddings_as_the_decoders_do": [
        "bart-scan",
        "bart-unrolled",
    ],
    "test_resume.py::test_a_run_resumed_on_another_mesh_equals_one_never_interrupted": [
        "full-2x4-1",
        "full-1-8x1",
        "lora-1-4x2",
        "accumulate-4x2-1",
    ],
    "test_resume.py::test_sigkill_then_resume_equals_straight_run": ["9-8"],
    "test_attention.py::test_blockwise_equals_the_einsum_values_and_gradients": [
        "full",
        "window",
        "softcap",
        "segments-not-causal",
        "key-padding",
        "bias",
        "segments",
    ],
    "test_examples.py::test_preference_tunes_a_checkpoint_on_docstring_pairs": ["simpo"],
    "test_models_parallel.py::test_sharded_train_step_equals_unsharded": ["opt", "llama", "gptj"],
    # A minute of waiting each: redcoast's patience (the [True] case; the slow tests check
    # the timeout it sets), and the control, XLA's own default ending the process.
    "test_faults.py::test_a_device_starved_for_a_minute_aborts_only_without_simulate_devices": [
        "True",
        "False",
    ],
    "test_fsdp.py::test_fsdp_train_steps_equal_the_unsharded_steps": [
        "fsdp-gpt2",
        "fsdp-llama-scan",
    ],
    "test_seq2seq.py::test_remat_and_fsdp_give_the_plain_steps_numbers": ["loop"],
    "test_seq2seq.py::test_sharded_train_step_equals_unsharded": ["bart"],
    "test_plan.py::test_the_planners_peak_is_the_real_compiled_steps": ["tp"],
    # Qwen3-MoE's experts (more, narrower, three a token, weights as drawn) run in the
    # slow session; Mixtral's, the same dispatch, here.
    "test_families.py::test_a_sharded_train_step_equals_one_device": [
        "mixtral-tp",
        "mixtral-tp-fsdp",
        "gemma3-tp-fsdp",
        "qwen3_moe-tp-fsdp",
    ],
    # Planned again beside other plans of the slow session: context parallelism (its CLI
    # line), LoRA (QLoRA's plan), attention remat and the attention option (the planner's
    # peak, compiled), the captioner (the vision-language models' plan).
    "test_plan.py::test_context_parallelism_plans_a_fraction_of_the_activations": [],
    "test_plan.py::test_a_lora_plan_keeps_optimizer_state_for_the_adapters_only": [],
    "test_plan.py::test_attention_remat_plans_under_fsdp_and_keeps_less": [],
    "test_plan.py::test_a_zoo_model_is_planned_with_the_attention_asked_for": [],
    "test_vision.py::test_the_planner_plans_the_captioner": [],
    # A vision model's sharded, FSDP and sequence-parallel steps: test_vlm's, in the slow
    # session (a tower and a decoder; the encoder-decoders' cross-attention: test_seq2seq).
    "test_vision.py::test_sharded_and_fsdp_train_steps_equal_one_device": [],
    # Moving between layouts: test_resume's runs resumed on another mesh do it too.
    "test_fsdp.py::test_checkpoints_move_between_fsdp_and_tensor_parallel_layouts": [],
    # bf16 beside fp32: test_bf16_tracks_fp32_with_float32_master_weights, in the slow session.
    "test_precision.py::test_bf16_step_hands_float32_gradients_close_to_fp32_ones_to_the_"
    "master_weights": [],
    # The split's fit, evaluate and predict: test_seq_parallel's steps, and fit with it in
    # test_families' options beside the split.
    "test_seq_parallel.py::test_fit_evaluate_and_predict_with_the_split_equal_them_without": [],
    "test_families.py::test_greedy_generation_equals_transformers": ["mixtral"],
    "test_families.py::test_scanned_layers_equal_transformers_and_write_back": ["mixtral"],
    "test_families.py::test_moe_loss_with_the_balancing_term_equals_transformers": ["mixtral"],
    "test_families.py::test_a_peft_adapter_round_trips_with_its_logits": ["qwen3_moe"],
    "test_moe.py::test_only_the_chosen_experts_compute_the_every_expert_numbers": ["mixtral"],
    "test_moe.py::test_experts_split_over_devices_equal_one_device": ["within-experts"],
    "test_deepseek.py::test_greedy_generation_equals_transformers": ["False"],
    "test_deepseek.py::test_the_rules_split_latent_attention_as_megatron_based_mla": [
        "mla-True",
        "q_proj-False",
    ],
    "test_rl.py::test_a_sharded_run_equals_one_device": ["lora"],
    "test_plan_targets.py::test_the_tpu_compiler_plans_a_grpo_step_with_lora": [],
    "test_rules.py::test_sharded_equals_unsharded": ["dit", "bert"],
    "test_context_zoo.py::test_the_step_equals_one_device_beside_every_other_split": [
        "gpt2-cp8-accumulate",
        "llama-cp2-tp4",
        "gpt2-cp4-tp2-sp",
    ],
    "test_examples.py::test_example_runs_through_the_cli": [
        "seq2seq",
        "text_to_image",
        "dp_sgd",
        "fedavg",
        "maml",
        "ppo",
    ],
    "test_examples.py::test_finetune_hands_back_a_folder_transformers_generates_from": [
        "text",
        "jsonl",
        "qlora",
    ],
    "test_any_model.py::test_the_planner_plans_it": ["how1", "how2"],
    "test_bench_peer.py::test_flax_free_rows_train": [],
    "test_fsdp.py::test_a_step_jitted_by_plain_jax_jit_gathers_as_redcoasts_own_step": ["unrolled"],
    "test_fsdp.py::test_fsdp_adds_no_model_axis_traffic_to_tensor_parallelism": ["unrolled"],
    "test_context_zoo.py::test_packed_documents_split_over_the_ring_equal_one_device": [
        "gpt2-cp4-tp2-sp"
    ],
    "test_families.py::test_context_parallelism_splits_windows_and_soft_caps": ["mistral"],
    "test_families.py::test_each_option_beside_the_split_equals_one_device": ["remat-full"],
    "test_init.py::test_initial_loss_is_a_uniform_guess": ["opt", "gptj", "llama"],
    "test_quant.py::test_sharded_qlora_step_equals_one_device": ["True"],
    "test_seq_parallel.py::test_sequence_parallel_step_equals_the_unsharded_step": [
        "llama-scan",
        "t5",
    ],
    "test_lora.py::test_lora_on_the_zoo_equals_its_merged_model": ["llama-True"],
    "test_lora.py::test_lora_layout_is_megatron_lms_with_megatron_style_lora": ["llama-2"],
    "test_models_parallel.py::test_a_vocabulary_that_divides_nothing_is_padded_split_masked_"
    "and_saved_whole": ["llama"],
    "test_seq2seq.py::test_greedy_and_beam_search_equal_transformers": ["t5", "t5-v1.1"],
    "test_input_checks.py::test_writing_past_the_end_of_the_cache_raises": ["gptj"],
    "test_dense.py::test_backward_does_not_recompute_the_residual_stream": ["llama"],
    "test_lora.py::test_resuming_lora_with_another_alpha_rank_dropout_or_targets_is_refused": [
        "trainable"
    ],
    "test_precision.py::test_attention_remat_keeps_the_gradients_and_drops_the_scores": ["t5"],
    "test_precision.py::test_bf16_under_accumulation_and_shard_map_gives_the_jit_steps_numbers": [],
    "test_any_model.py::test_context_parallelism_on_it_equals_one_device": [],
    "test_context_zoo.py::test_fit_and_predict_with_context_parallelism_equal_them_without": [],
    "test_plan_targets.py::test_on_the_tpu_compiler_a_scanned_stack_is_estimated_as_the_"
    "unrolled_one": [],
    "test_fit.py::test_dropout_losses_agree_on_one_device_8x1_and_2x4": [],
    "test_sampling.py::test_sampling_on_a_mesh_draws_what_one_device_draws": ["2-False"],
    "test_sampling.py::test_samples_follow_the_filtered_distribution": [],
    "test_deepseek.py::test_a_sharded_train_step_equals_one_device": [],
    "test_precision.py::test_full_remat_at_least_halves_the_compiled_steps_temporaries": [],
    "test_plan.py::test_the_cli_plans_context_parallelism": [],
    "test_plan.py::test_the_cli_plans_sequence_parallelism_with_fewer_activations": [],
    "test_plan_targets.py::test_a_dpo_plan_runs_both_answers_and_the_reference_without_its_"
    "adapters": [],
    "test_context_parallel.py::test_integer_mask_and_bfloat16_inputs": [],
    "multihost/test_multihost.py::test_a_run_resumed_on_another_process_count_equals_one_"
    "never_interrupted": ["lora-first1-then1"],
    "multihost/test_multihost.py::test_context_parallelism_over_two_processes_equals_the_rows_"
    "split_on_one": [],
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
    "test_lora.py::test_lora_layout_is_megatron_lms_with_megatron_style_lora": [
        "gpt2-2",
        "llama-4",
    ],
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
    "test_quant.py::test_a_scanned_stack_decodes_one_layer_at_a_time": ["nf4", "int8"],
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
    "test_rl.py::test_a_sharded_run_equals_one_device": ["tp-fsdp", "lora"],
    "test_sampling.py::test_sampling_on_a_mesh_draws_what_one_device_draws": ["2-False", "4-True"],
    "test_sampling.py::test_samples_follow_the_filtered_distribution": [],
    "test_plan.py::test_a_grpo_plans_train_step_is_the_real_rl_step": [],
    "test_plan.py::test_the_sampling_plan_holds_the_key_value_cache_and_decodes_step_by_step": [],
    "test_plan.py::test_the_longest_rl_prompt_leaves_room_for_the_completion": [],
    "test_plan.py::test_the_cli_plans_an_rl_step": [],
    "test_plan.py::test_a_kl_penalty_holds_a_frozen_bfloat16_copy_without_lora_and_none_with_"
    "it": [],
    "test_quant.py::test_from_hf_quantizes_each_layer_weight_as_it_is_read": ["False"],
    "test_fsdp.py::test_sharded_init_holds_only_shards_and_equals_the_model_built_whole": [],
    "test_rl_losses.py::test_dapo_is_the_steps_token_mean_however_the_step_splits_the_batch": [],
    "test_fit.py::test_digits_mlp_reaches_95_percent_through_fit_and_predict": [],
    "test_resume.py::test_sigterm_saves_a_complete_checkpoint_and_exits_cleanly": [],
    "test_moe.py::test_a_router_sending_everything_to_two_experts_runs_and_the_metrics_say_so": [],
    "test_moe.py::test_the_router_z_loss_is_st_moes_and_moe_lm_loss_adds_it": [],
    "test_chunked_logits.py::test_the_loss_in_chunks_equals_the_loss_on_the_whole_logits": [
        "gemma2-padded",
        "llama",
    ],
    "test_chunked_logits.py::test_the_planner_counts_the_chunks_and_they_hold_a_fraction_of_"
    "the_logits": [],
    "test_text.py::test_lm_loss_counts_only_the_masked_tokens": [],
    "test_sampling.py::test_a_prompts_samples_share_its_prefill_and_draw_as_separate_rows": [],
    "test_sampling.py::test_finished_rows_stop_costing_steps_and_draw_what_they_would_have": [],
    "test_moe.py::test_experts_split_over_devices_equal_one_device": ["experts"],
    "test_moe.py::test_only_the_chosen_experts_compute_the_every_expert_numbers": [
        "mixtral",
        "deepseek_v3",
    ],
    "test_deepseek.py::test_logits_equal_transformers_and_to_hf_is_read_back": [
        "mla-True",
        "halves-False",
    ],
    "test_deepseek.py::test_greedy_generation_equals_transformers": ["False", "True"],
    "test_deepseek.py::test_a_peft_adapter_on_both_stacks_round_trips_and_decodes": [],
    "test_deepseek.py::test_a_sharded_train_step_equals_one_device": [],
    "test_deepseek.py::test_the_rules_split_latent_attention_as_megatron_based_mla": [
        "mla-False",
        "mla-True",
        "q_proj-False",
    ],
    "test_eval.py::test_scores_equal_the_hf_backend": [],
    "test_eval.py::test_the_command_prints_the_table_and_writes_the_results": [],
    "test_eval.py::test_fit_scores_the_harness_tasks_on_the_live_model_beside_the_loss": [],
    # The fast tests' longest (5-18 s here), moved so that the README's test command stays
    # near 6 minutes.
    "test_eval.py::test_a_sharded_model_scores_as_one_device": [],
    "test_eval.py::test_continuations_in_rounds_equal_one_generation": [],
    "test_any_model.py::test_lora_on_it_trains_the_adapters_alike_on_a_mesh": [],
    "test_chunked_logits.py::test_a_decoder_is_its_output_head_on_its_hidden_states": [],
    "test_chunked_logits.py::test_bad_chunk_sizes_and_models_without_a_split_head": [],
    "test_init.py::test_parameter_statistics_match_transformers": ["llama", "gptj", "gpt2", "opt"],
    "test_deepseek.py::test_packed_documents_equal_separate_calls": [],
    "test_moe.py::test_bad_dispatches_and_routers_say_what_to_do": [],
    "test_models.py::test_greedy_equals_step_by_step_argmax_without_cache": [],
    "test_init.py::test_an_architecture_is_its_build_the_constructor_is_shared": [],
    "test_models.py::test_sampling_settings": [],
    "test_plan_targets.py::test_a_gpu_plan_attends_blockwise_where_cudnn_would_run": [],
    "test_plan_targets.py::test_the_cross_entropy_is_optaxs_in_float32_without_a_gather": [],
    "test_quant.py::test_bf16_compute_keeps_the_quantized_format": [],
    "test_moe.py::test_the_ragged_grouped_matmul_is_the_blocked_one": [],
    "test_moe.py::test_capacity_keeps_the_first_routings_of_each_expert_in_token_order": [],
    "test_fsdp.py::test_a_placed_model_says_how_to_move_it_to_one_device_and_unplace_does": [],
}


# The longest fast tests (3 s and more here, every case), which the newest JAX's run of
# the fast tests (`nox -s "jax_matrix(python='3.13', jax='0.12.0.1')"`) leaves out: they
# run once in CI, on the oldest pair (`nox -s tests`), and the rest on both.
ONCE = (
    "test_sampling.py::test_a_prompts_samples_share_its_prefill_and_draw_as_separate_rows",
    "test_text.py::test_lm_loss_counts_only_the_masked_tokens",
    "test_sampling.py::test_sampling_on_a_mesh_draws_what_one_device_draws",
    "test_sampling.py::test_finished_rows_stop_costing_steps_and_draw_what_they_would_have",
    "test_context_parallel.py::test_the_ring_passes_blocks_to_its_neighbour_and_gathers_nothing",
    "test_init.py::test_parameter_statistics_match_transformers",
    "test_quant.py::test_bf16_compute_keeps_the_quantized_format",
    "test_any_model.py::test_lora_on_it_trains_the_adapters_alike_on_a_mesh",
    "test_init.py::test_an_architecture_is_its_build_the_constructor_is_shared",
    "test_models.py::test_sampling_settings",
    "test_seq_parallel.py::test_where_the_split_comes_from_the_placement",
    "test_context_parallel.py::test_split_attention_and_its_gradients_equal_the_unsplit",
    "test_quant.py::test_quantized_forward_equals_the_dequantized_weights_forward",
    "test_quant.py::test_a_scanned_stack_decodes_one_layer_at_a_time",
    "test_plan_targets.py::test_a_gpu_plan_attends_blockwise_where_cudnn_would_run",
    "test_faults.py::test_generate_refuses_ids_that_would_wrap_and_empty_prompts",
    "test_faults.py::test_nan_gradients_under_a_finite_loss_raise_naming_the_step_or_are_skipped",
    "test_faults.py::test_removing_the_lock_file_lets_no_second_run_in",
    "test_models.py::test_greedy_equals_step_by_step_argmax_without_cache",
    "test_models.py::test_greedy_generation_equals_transformers",
    "test_step.py::test_shard_map_path_equals_jit_path",
    "test_distributed.py::test_launch_runs_processes_that_see_each_other",
    "test_vision.py::test_captioner_logits_equal_transformers",
    "test_sampling.py::test_a_model_of_the_users_own_samples_and_stops_once_every_row_has_ended",
    "test_quant.py::test_sharded_qlora_step_of_a_users_mlp_equals_one_device",
    "test_preference.py::test_dpo_and_ipo_equal_trls_dpo_trainer",
    "test_precision.py::test_remat_model_is_split_like_the_plain_one",
    "test_faults.py::test_kill_9_at_a_random_moment_of_a_save_loop",
    "test_plan_targets.py::test_the_cross_entropy_is_optaxs_in_float32_without_a_gather",
    "test_dense.py::test_normalise_values_and_gradients_equal_vmapped_norm",
    "test_faults.py::test_a_fresh_run_in_a_used_workdir_stops_and_loses_nothing",
    "test_step.py::test_eval_step_weights_out_padding_and_uses_inference_mode",
    "test_resume.py::test_checkpoint_options_need_a_workdir_and_a_matching_run",
    "test_preference.py::test_the_lora_reference_is_the_base_model_exactly",
    "test_faults.py::test_a_killed_holder_leaves_its_workdir_free_at_once",
    "test_any_model.py::test_the_rules_split_it_as_megatron_does",
    "test_sampling.py::test_prompts_padded_to_one_bucket_compile_once",
    "test_fsdp.py::test_a_placed_model_says_how_to_move_it_to_one_device_and_unplace_does",
    "test_sampling.py::test_the_draw_and_the_argmax_are_jax_own",
    "test_seq2seq.py::test_from_hf_logits_equal_transformers",
    "test_faults.py::test_fit_leaves_the_callers_model_and_opt_state_usable",
    "test_rules.py::test_stacked_experts_take_one_expert_axis",
    "test_rl_losses.py::test_policy_loss_and_its_gradient_equal_trls_grpo_trainer",
    "test_quant.py::test_round_trip_error_on_normal_weights",
    "test_faults.py::test_an_error_after_the_hand_over_carries_the_runs_last_state",
    "test_quant.py::test_the_weight_decodes_tile_by_tile_forward_and_backward",
    "test_input_checks.py::test_initialize_installs_nothing_process_wide_unless_asked",
    "test_input_checks.py::test_token_ids_outside_the_vocabulary_raise",
    "test_precision.py::test_remat_on_a_users_function_and_bad_names",
    "test_seq2seq.py::test_beam_search_equals_transformers",
    "test_step.py::test_updates_per_batch_are_that_many_steps_on_the_batch",
    "test_moe.py::test_routers_choose_what_transformers_routers_choose",
    "test_moe.py::test_the_ragged_grouped_matmul_is_the_blocked_one",
    "test_moe.py::test_only_the_chosen_experts_compute_the_every_expert_numbers",
    "test_moe.py::test_the_planner_counts_each_routing_once_in_a_ragged_dot",
    "test_vlm.py::test_towers_equal_transformers_at_every_layer_and_round_trip",
    "test_vlm.py::test_llava_equals_transformers_generates_alike_and_round_trips",
    "test_vlm.py::test_llava_checkpoints_of_each_spelling_load_alike",
    "test_vlm.py::test_bad_images_and_image_tokens_are_clear_errors",
    "test_vlm.py::test_the_rules_split_the_tower_the_projector_and_the_decoder_as_megatron_does",
    "test_vlm.py::test_a_decoder_given_new_tokens_keeps_its_logits_and_starts_them_at_the_mean",
    "test_gemma3_vision.py::test_logits_equal_transformers_with_the_images_bidirectional",
    "test_gemma3_vision.py::test_greedy_generation_from_images_equals_transformers",
    "test_gemma3_vision.py::test_to_hf_writes_the_checkpoint_back_and_transformers_loads_it",
    "test_gemma3_vision.py::test_transformers_4_names_load_alike",
    "test_gemma3_vision.py::test_a_wrong_number_of_image_tokens_is_an_error",
    "test_gemma3_vision.py::test_bad_configs_and_kernels_without_masks_are_errors",
    "test_gemma3_vision.py::test_a_model_built_in_code_writes_a_folder_transformers_loads",
    "test_vision_data.py::test_pixels_equal_transformers_image_processors",
    "test_vision_data.py::test_llava_rows_equal_the_processor_and_count_the_assistant_alone",
    "test_vision_data.py::test_gemma3_rows_equal_the_processor",
    "test_vision_data.py::test_rows_from_a_jsonl_file_give_a_llava_its_loss",
)


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


# Module fixtures that compile for tens of seconds: their tests go to one worker, which
# builds each once, where two workers would both build it.
SHARED_FIXTURES = {"rl_plans", "one_plan"}


# Before pytest-xdist's own hook, which reads the `xdist_group` marks.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `LATER`'s cases `exhaustive`, `SLOW`'s `slow` and `ONCE`'s `once`; group
    `SHARED_FIXTURES`' tests; `LONGEST` first."""
    ids = {item.nodeid.removeprefix("tests/"): item for item in items}
    # Cases picked by node id (`file.py::test[case]`) leave the test's other cases out.
    strict = not any("::" in arg for arg in config.args)
    for node in _named(LATER, ids, strict):
        ids[node].add_marker(pytest.mark.exhaustive)
    for node in _named(SLOW, ids, strict):
        ids[node].add_marker(pytest.mark.slow)
    for item in items:
        if item.nodeid.removeprefix("tests/").split("[")[0] in ONCE:
            item.add_marker(pytest.mark.once)
    for item in items:  # one worker builds a shared fixture once (`--dist loadgroup`)
        shared = SHARED_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        if shared:
            item.add_marker(pytest.mark.xdist_group(min(shared)))

    def rank(item: pytest.Item) -> int:
        test = item.nodeid.removeprefix("tests/").split("[")[0]
        return LONGEST.index(test) if test in LONGEST else len(LONGEST)

    items.sort(key=rank)  # stable: the rest keep their order

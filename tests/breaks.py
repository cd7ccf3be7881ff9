"""Deliberate breaks: each switches one mechanism off in a copy of the repository and runs the
tests aimed at it, which must then fail. A test that still passes with its mechanism gone does
not test the mechanism.

    python -m tests.breaks [--list] [NAME ...]

Each break is (name, file, text, replacement, tests); the text must occur once in the file
(text and replacement may be tuples: several edits of the one file).
The working tree is never touched. Exit status 1 when some break's tests passed.
"""

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

BREAKS = [
    (
        "FP8 projections of a gathered input drop its gradient",
        "angel_jax/layers/linear.py",
        "        return x, fp8.gather_quantized(x, layouts)",
        "        return jax.lax.stop_gradient(x), fp8.gather_quantized(x, layouts)",
        ["tests/test_fp8.py::test_fp8_matmuls_under_sequence_parallel_equal_one_device"],
    ),
    (
        "FP8 projections quantize the gathered input",
        "angel_jax/layers/linear.py",
        "    if fp8_matmul:\n        return x, fp8.gather_quantized(x, layouts)",
        "    if False:\n        return x, fp8.gather_quantized(x, layouts)",
        # Skipped without jax[cuda13] (the GPU compiler's collectives).
        [
            "tests/test_sequence_parallel.py::"
            "test_megatron_sequence_parallel_gathers_bf16_and_reduce_scatters_the_grads"
        ],
    ),
    (
        "ZeRO-3 params are gathered without pinning the cast to their stored split",
        "angel_jax/sharding.py",
        "    if zero is None:",
        "    if True:",
        # Skipped without jax[cuda13] (the GPU compiler's choice).
        ["tests/test_sequence_parallel.py::test_zero3_gathers_the_lm_head_in_the_compute_dtype"],
    ),
    (
        "the loss gathers the target logits across the vocabulary's split",
        "angel_jax/losses.py",
        "    vocab = jax.lax.broadcasted_iota(jnp.int32, logits_BTV.shape, logits_BTV.ndim - 1)\n"
        "    return jnp.sum(jnp.where(vocab == targets_BT[..., None], logits_BTV, 0), axis=-1)\n",
        "    return jnp.take_along_axis(logits_BTV, targets_BT[..., None], axis=-1)[..., 0]\n",
        [
            "tests/test_sequence_parallel.py::"
            "test_the_loss_picks_target_logits_where_the_vocabulary_is_split",
        ],
    ),
    (
        "the schedule's compute beside a collective hides none of it",
        "angel_jax/planning/schedule.py",
        "used = min(free[m], left)",
        "used = 0.0",
        [
            "tests/test_schedule.py::"
            "test_a_collective_is_hidden_by_the_compute_its_schedule_puts_beside_it",
            "tests/test_schedule.py::test_an_ops_time_hides_one_transfer_only",
            # Skipped without jax[cuda13].
            "tests/test_schedule.py::test_the_gpu_compiler_schedules_tensor_collectives_beside_compute",
        ],
    ),
    (
        "the cost model ignores the tensor collectives' share the schedule hides",
        "angel_jax/planning/cost_model.py",
        "tensor *= cal.tensor_exposed(tp) if system.tp_exposed is None else system.tp_exposed",
        "tensor *= system.tp_exposed or 1.0",
        ["tests/test_schedule.py::test_the_cost_model_shows_the_tensor_share_the_schedule_leaves"],
    ),
    (
        "the planner's meshes ignore sequence parallel's split of the sequence",
        "angel_jax/plan.py",
        "problem.seq_len % (tp * cp * per_split)",
        "problem.seq_len % (2 * cp)",
        ["tests/test_plan.py::test_every_planned_mesh_splits_the_sequence_as_the_trainer_requires"],
    ),
    (
        "sequence parallel's input gradient goes back through two plain constraints",
        "angel_jax/sharding.py",
        "    return _regather(x, split, whole)\n",
        "    x = jax.lax.with_sharding_constraint(x, split)\n"
        "    return jax.lax.with_sharding_constraint(x, whole)\n",
        [
            "tests/test_sequence_parallel.py::"
            "test_regathers_backward_pins_the_gradient_to_the_split_layout_only",
            # Skipped without jax[cuda13] (the GPU compiler's reduce-scatters).
            "tests/test_sequence_parallel.py::"
            "test_megatron_sequence_parallel_gathers_bf16_and_reduce_scatters_the_grads[True]",
        ],
    ),
    (
        "sequence parallel gathers the norm's output unpinned to its split layout",
        "angel_jax/sharding.py",
        "    return jax.lax.with_sharding_constraint("
        "jax.lax.with_sharding_constraint(x, split), whole)\n\n\ndef _regather_fwd",
        "    return jax.lax.with_sharding_constraint(x, whole)\n\n\ndef _regather_fwd",
        [  # Skipped without jax[cuda13]: XLA:CPU gathers float32 either way.
            "tests/test_sequence_parallel.py::"
            "test_megatron_sequence_parallel_gathers_bf16_and_reduce_scatters_the_grads"
        ],
    ),
    (
        "a mixture of experts' load counts one microbatch of the step",
        "angel_jax/metrics.py",
        "np.rint(value * microbatches)",
        "np.rint(value)",
        ["tests/test_moe_telemetry.py::test_topk_load_counts_every_assignment_of_the_step"],
    ),
    (
        "the router's entropy counts only the most likely expert",
        "angel_jax/layers/moe.py",
        "jnp.sum(probs_BTE * logits, axis=-1)",
        "jnp.max(logits, axis=-1)",
        ["tests/test_moe_telemetry.py::test_router_entropy_bounds"],
    ),
    (
        "the streamed update keys its programs by the unrolled layer's number",
        "angel_jax/offload/programs.py",
        '                re.sub(r"\\d+", "#", part),',
        "                part,",
        ["tests/test_offload_in_step.py::test_unrolled_layers_share_the_streamed_updates_programs"],
    ),
    (
        "the streamed update's groups straddle unrolled layers",
        "angel_jax/planning/groups.py",
        "            and parts[groups[-1][-1]] == parts[k]\n",
        "",
        ["tests/test_offload_in_step.py::test_unrolled_layers_share_the_streamed_updates_programs"],
    ),
    (
        "the update in the step never says that clipping holds it back",
        "angel_jax/steps.py",
        "        if self.setup.grad_clip > 0:\n            waits.append(",
        "        if False:\n            waits.append(",
        [
            "tests/test_offload_in_step.py::"
            "test_update_in_step_names_the_settings_that_hold_it_after_the_backward_pass"
        ],
    ),
    (
        "bert's attention counted as causal",
        "angel_jax/models/classic.py",
        '        return 2 * causal if self.family == "bert" else causal',
        "        return causal",
        ["tests/test_model.py::test_flops_per_token_counts_bidirectional_attention_whole"],
    ),
    (
        "the speculative update in the step clips with the norm",
        "angel_jax/steps.py",
        "        ok, used_scale = None, jnp.ones((), jnp.float32)",
        "        ok, used_scale = None, scale",
        ["tests/test_offload_in_step.py::test_speculative_update_in_step_never_waits_for_the_norm"],
    ),
    (
        "the speculative update in the step leaves out an anomalous step's update itself",
        "angel_jax/steps.py",
        "        ok, used_scale = None, jnp.ones((), jnp.float32)",
        "        used_scale = jnp.ones((), jnp.float32)",
        ["tests/test_offload_in_step.py::test_speculative_update_in_step_never_waits_for_the_norm"],
    ),
    (
        "an auto plan counts a speculating step's resident chunks once",
        "angel_jax/planning/placement.py",
        "        self.kept = 2 if self.speculative else 1",
        "        self.kept = 1",
        [
            "tests/test_offload_in_step.py::"
            "test_speculative_update_in_step_keeps_resident_chunks_twice_in_an_auto_plan"
        ],
    ),
    (
        "a redo leaves groups on their way home",
        "angel_jax/state_layout.py",
        "        beside_step=plan.copies_beside_step and not config.offload.update_in_step,",
        "        beside_step=plan.copies_beside_step,",
        ["tests/test_offload_in_step.py::test_speculative_update_in_step_equals_the_exact_one"],
    ),
    (
        "a speculated step that clipped keeps its speculated update",
        "angel_jax/steps.py",
        "        if jax.device_get(held):",
        "        if True:",
        ["tests/test_offload_in_step.py::test_speculative_update_in_step_equals_the_exact_one"],
    ),
    (
        "a step after a redone one speculates again",
        "angel_jax/steps.py",
        "        clipped = not skipped  #",
        "        clipped = False  #",
        ["tests/test_offload_in_step.py::test_speculative_update_in_step_equals_the_exact_one"],
    ),
    (
        "the exact program never hands back to speculation",
        "angel_jax/steps.py",
        "            clipped = bool(norm > clip and not skipped)",
        "            clipped = True",
        ["tests/test_offload_in_step.py::test_speculative_update_in_step_equals_the_exact_one"],
    ),
    (
        "the exact steps after a clipped speculating one compile at their first use",
        "angel_jax/steps.py",
        "        if self.runs_exact_steps:\n            speculating",
        "        if False:\n            speculating",
        [
            "tests/test_offload_in_step.py::"
            "test_speculative_update_compiles_its_exact_steps_before_anything_is_allocated"
        ],
    ),
    (
        "a skipped speculated step is updated again",
        "angel_jax/steps.py",
        "        if skipped:\n            return state.replace(step=step), metrics",
        "        if False:\n            return state.replace(step=step), metrics",
        [
            "tests/test_offload_in_step.py::test_speculative_update_in_step_keeps_an_anomalous_steps_state"
        ],
    ),
    (
        "the plan leaves out the old state a speculating step keeps",
        "angel_jax/planning/chunks.py",
        "        if speculative:\n",
        "        if False:\n",
        [
            "tests/test_offload_in_step.py::test_speculative_update_in_step_plans_the_old_state_it_keeps"
        ],
    ),
    (
        "the update in the step keeps XLA's default copies in flight",
        "angel_jax/steps.py",
        "        return self.program_lowered.compile(compiler_options=COPIES_IN_FLIGHT)",
        "        return self.program_lowered.compile()",
        # On a GPU (JAX_PLATFORMS=cuda); skipped elsewhere.
        ["tests/test_offload_in_step.py::test_update_in_step_copies_are_asynchronous_on_gpu"],
    ),
    (
        "the exact steps after a clipped speculating one keep XLA's default copies in flight",
        "angel_jax/steps.py",
        "        return self.exact_lowered.compile(compiler_options=COPIES_IN_FLIGHT)",
        "        return self.exact_lowered.compile()",
        # On a GPU (JAX_PLATFORMS=cuda); skipped elsewhere.
        ["tests/test_offload_in_step.py::test_update_in_step_copies_are_asynchronous_on_gpu"],
    ),
    (
        "the profile finds no backward pass",
        "experiments/profile_step.py",
        '    return "transpose(" in source_of(',
        '    return "transpose(" == source_of(',
        ["tests/test_experiments.py::test_the_summary_counts_copies_during_the_backward_pass"],
    ),
    (
        "the probe's unrolled fused program computes other math",
        "experiments/fused_update_probe.py",
        "            h = layer(h, w1, w2)\n        return jnp.sum(",
        "            h = layer(h, 2 * w1, w2)\n        return jnp.sum(",
        [
            "tests/test_experiments.py::"
            "test_the_fused_update_probe_checks_its_programs_against_their_parts"
        ],
    ),
    (
        "the update in the step takes the params' order",
        "angel_jax/steps.py",
        "    return sorted(range(len(chunks)), key=key)",
        "    return list(range(len(chunks)))",
        [
            "tests/test_offload_in_step.py::test_update_in_step_takes_the_chunks_in_the_backward_passes_order"
        ],
    ),
    (
        "the update in the step ignores the clipping scale",
        "angel_jax/offload/stream.py",
        "        new = optimizer.update_leaf(c.path, fetch_f32(grad) * scale, old[1], master)",
        "        new = optimizer.update_leaf(c.path, fetch_f32(grad), old[1], master)",
        ["tests/test_offload_in_step.py::test_update_in_step_equals_the_streamed_update"],
    ),
    (
        "the update in the step keeps an anomalous step's update",
        "angel_jax/offload/stream.py",
        "        if ok is not None:\n            new = jax.tree.map",
        "        if False:\n            new = jax.tree.map",
        ["tests/test_offload_in_step.py::test_update_in_step_leaves_out_an_anomalous_steps_update"],
    ),
    (
        "the update in the step is planned as the streamed one",
        "angel_jax/planning/chunks.py",
        "    if in_step:  # Held in the step's temporaries",
        "    if False:  # Held in the step's temporaries",
        [
            "tests/test_offload_in_step.py::test_update_in_step_plans_its_chunks_in_flight_beside_the_step"
        ],
    ),
    (
        "the update in the step holds every chunk at once",
        "angel_jax/offload/stream.py",
        "pipelined(one, inputs, in_flight)",
        "pipelined(one, inputs, len(inputs))",
        [
            "tests/test_offload_in_step.py::"
            "test_update_in_step_follows_the_order_and_bounds_the_chunks_on_the_device"
        ],
    ),
    (
        "the update in the step takes its chunks in the params' order",
        "angel_jax/offload/stream.py",
        '    assert all(c.layer is None for c in chunks), "the update',
        '    order = sorted(order)\n    assert all(c.layer is None for c in chunks), "the update',
        [
            "tests/test_offload_in_step.py::"
            "test_update_in_step_follows_the_order_and_bounds_the_chunks_on_the_device"
        ],
    ),
    (
        "the update in the step sends nothing home itself",
        "angel_jax/offload/stream.py",
        "        return new_compute, jax.tree.map(jax.device_put, new, home)",
        "        return new_compute, new",
        [
            "tests/test_offload_in_step.py::"
            "test_update_in_step_follows_the_order_and_bounds_the_chunks_on_the_device"
        ],
    ),
    (
        "the update in the step is the streamed one",
        "angel_jax/train.py",
        "        form = InStepUpdate if self.config.offload.update_in_step else OffloadedStep\n",
        "        form = OffloadedStep\n",
        [
            # The GPU test (its copy-start pairs) is skipped off a GPU.
            "tests/test_offload_in_step.py::test_update_in_step_copies_are_asynchronous_on_gpu",
            "tests/test_offload_in_step.py::test_update_in_step_equals_the_streamed_update",
        ],
    ),
    (
        "collectives in a loop's body not marked in_loop",
        "experiments/throughput.py",
        "                visit(callee, times * trips, in_loop or body)",
        "                visit(callee, times * trips, in_loop)",
        [
            "tests/test_experiments.py::test_collective_schedule_reads_how_xla_placed_each_collective"
        ],
    ),
    (
        "a conditional counts only its first branch",
        "experiments/throughput.py",
        "            parts = [produced(c) for c in callees]",
        "            parts = [produced(callees[0])]",
        ["tests/test_experiments.py::test_a_conditional_counts_its_branch_that_produces_the_most"],
    ),
    (
        "pipeline plan counts a batch through every layer",
        "angel_jax/planning/placement.py",
        '                pipeline.remat: {**none, "activations": int(pipeline.activation_bytes)}',
        "                pipeline.remat: activations.activation_bytes(inp, pipeline.remat)",
        ["tests/test_pipeline.py::test_the_zero_cache_plan_takes_the_stages_activations"],
    ),
    (
        "cuDNN ring blocks pass zero-size constants",
        "angel_jax/kernels.py",
        "    unused = q.reshape(-1)[:0]",
        "    unused = jnp.zeros(0, q.dtype)",
        # On a GPU (JAX_PLATFORMS=cuda); skipped elsewhere.
        ["tests/test_kernels.py::test_two_gpu_ring_step_of_a_scanned_stack_compiles"],
    ),
    (
        "the ring's output is not its named result",
        "angel_jax/parallel/attention.py",
        "    out, lse = checkpoint_name((out.astype(q.dtype), lse), ATTENTION_RESULTS)\n"
        "    return out, (q, k, v, out, lse)",
        "    named = checkpoint_name((out.astype(q.dtype), lse), ATTENTION_RESULTS)\n"
        "    return out.astype(q.dtype), (q, k, v, *named)",
        [
            "tests/test_sequence_parallel.py::"
            "test_remat_attention_keeps_the_rings_results_instead_of_running_it_again"
        ],
    ),
    (
        "attention policies keep no cuDNN forward",
        "angel_jax/remat.py",
        '    return prim.name == "dot_product_attention_fwd_wrapper"',
        "    return False",
        [
            # On a GPU (JAX_PLATFORMS=cuda; first, as the runner stops at the first failure);
            # skipped elsewhere.
            "tests/test_kernels.py::test_remat_attention_keeps_cudnns_forward_results",
            "tests/test_model.py::test_attention_policies_save_the_cudnn_forward_and_the_rings_results",
        ],
    ),
    (
        "remat auto tries its policies in the table's order",
        "angel_jax/planning/activations.py",
        "    return tuple(sorted(own, key=lambda r: recomputed(r, matmul_flops, attention_flops)))",
        "    return tuple(own)",
        [
            "tests/test_offload_planner.py::test_auto_remat_tries_the_policies_by_what_they_recompute"
        ],
    ),
    (
        "remat auto tries every remat on the device before the host's tier",
        "angel_jax/planning/activations.py",
        "    return sorted(pairs, key=cost)",
        "    return pairs",
        [
            "tests/test_offload_planner.py::test_auto_remat_weighs_the_inputs_copies_against_the_recompute_they_spare"
        ],
    ),
    (
        "the stage plan ignores a ring's attention results",
        "angel_jax/planning/stage_plan.py",
        "    return kept(remat, has_attention_results(cfg.attention, mesh_shape[CONTEXT]))",
        '    return kept(remat, cfg.attention == "cudnn")',
        ["tests/test_pipeline.py::test_a_rings_layer_keeps_what_the_memory_model_counts"],
    ),
    (
        "the planner counts a context axis of one as a ring",
        "angel_jax/remat.py",
        '    return attention == "cudnn" or context > 1',
        '    return attention == "cudnn" or context >= 1',
        [
            "tests/test_offload_planner.py::test_auto_remat_tries_the_policies_by_what_they_recompute"
        ],
    ),
    (
        "fp8 formats are 16-bit",
        "angel_jax/fp8.py",
        "E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2",
        "E4M3, E5M2 = jnp.float16, jnp.float16",
        ["tests/test_fp8.py"],
    ),
    (
        "ZeRO-2 grads not constrained",
        "angel_jax/grads.py",
        "        # The shardings' tree is a prefix of `grads`",
        "        return grads\n        # The shardings' tree is a prefix of `grads`",
        ["tests/test_train_parity.py::test_zero_stage_layouts"],
    ),
    (
        "ZeRO-3 params not split over data",
        "angel_jax/state_layout.py",
        '    param_sharding = sharding.named(mesh, specs("params"))',
        "    param_sharding = sharding.named(\n"
        "        mesh, sharding.state_specs(logical, abstract_params, mesh, rules, False)\n"
        "    )",
        ["tests/test_train_parity.py::test_zero_stage_layouts[3]"],
    ),
    (
        "ZeRO splits states over data only, not context and sequence",
        "angel_jax/mesh.py",
        "ZERO_AXES = (DATA, CONTEXT, SEQUENCE)",
        "ZERO_AXES = (DATA,)",
        ["tests/test_train_parity.py::test_zero_splits_over_context_and_sequence"],
    ),
    (
        "compiled memory not checked on a CPU",
        "angel_jax/planning/compiled.py",
        'return machine.backend() != "cpu" or device_gib <= 0',
        'return machine.backend() != "cpu"',
        [
            "tests/test_errors.py::test_cpu_plan_is_checked_against_the_compiled_step_before_allocating"
        ],
    ),
    (
        "out of memory exits 1",
        "angel_jax/launch.py",
        "        return monitor.EXIT_OUT_OF_MEMORY",
        "        return 1",
        ["tests/test_errors.py::test_out_of_memory_is_one_line_and_its_own_exit_status"],
    ),
    (
        "a stop signal does not save",
        "angel_jax/loop.py",
        "saving = ckpt is not None and (stopping or ckpt.should_save(step, t.steps))",
        "saving = ckpt is not None and ckpt.should_save(step, t.steps)",
        ["tests/test_resume.py::test_a_stop_signal_saves_the_step_and_resume_recomputes_nothing"],
    ),
    (
        "the trainer imports Llama",
        "angel_jax/train.py",
        "load_params, validate\n",
        "load_params, validate\nfrom angel_jax.models import llama  # noqa\n",
        ["tests/test_architecture.py"],
    ),
    (
        "the SSD tier does not probe for writes",
        "angel_jax/offload/ssd.py",
        "            tempfile.TemporaryFile(dir=self.directory).close()",
        "            pass",
        ["tests/test_ssd.py::test_read_only_directory_is_a_config_error"],
    ),
    (
        "dropless rows move by autodiff's scatters",
        "angel_jax/parallel/expert.py",
        "sorted_rows.defvjp(_sorted_rows_fwd, _sorted_rows_bwd)",
        "sorted_rows = lambda x, order, _: x.at[order // (order.size // x.shape[0])].get()",
        ["tests/test_moe.py::test_dropless_moves_rows_by_gathers_not_scatters"],
    ),
    (
        "checkpoint reasons keep object reprs",
        "angel_jax/checkpoint.py",
        '    while re.search(object_repr + "[^<>]*>", text):',
        "    while False:",
        ["tests/test_errors.py::test_checkpoint_reasons_are_short_whole_lines"],
    ),
    (
        "offload_dots recomputes instead of offloading",
        "angel_jax/remat.py",
        "names_which_can_be_offloaded=list(names),",
        "names_which_can_be_offloaded=[],",
        [
            "tests/test_offload.py::test_offloaded_activations_give_the_same_grads",
            # On a GPU (JAX_PLATFORMS=cuda); skipped elsewhere.
            "tests/test_offload.py::test_offloaded_activations_live_in_host_memory_on_gpu",
        ],
    ),
    (
        "split attention lets XLA gather the sequence",
        "angel_jax/parallel/attention.py",
        "    def local(q, k, v):\n        if ulysses:",
        "    if ring or ulysses:\n"
        "        return _local_attention(q, k, v, causal, implementation)\n\n"
        "    def local(q, k, v):\n        if ulysses:",
        [
            "tests/test_sequence_parallel.py::"
            "test_split_attention_moves_keys_and_values_by_its_collective_not_a_gather"
        ],
    ),
    (
        "pipeline stages pass activations by all-gathers",
        "angel_jax/parallel/pipeline.py",
        (
            "pin(jax.lax.ppermute(out, PIPELINE, [(i, (i + 1) % p) for i in range(p)]))",
            "pin(jax.lax.ppermute(d_x, PIPELINE, [(i, (i - 1) % p) for i in range(p)]))",
        ),
        (  # The same values: stage i takes stage i - 1's (forward) or i + 1's (backward).
            "pin(jnp.roll(jax.lax.all_gather(out, PIPELINE), 1, 0)[jax.lax.axis_index(PIPELINE)])",
            "pin(jnp.roll(jax.lax.all_gather(d_x, PIPELINE), -1, 0)[jax.lax.axis_index(PIPELINE)])",
        ),
        [
            "tests/test_pipeline.py::test_stages_hold_their_own_layers_and_pass_activations_by_collective_permute"
        ],
    ),
    (
        "capacity routers dispatch by an all-gather",
        "angel_jax/parallel/expert.py",
        "xs = jax.lax.all_to_all(xs, EXPERT, split_axis=1, concat_axis=0, tiled=True)",
        # The same values: from every rank, the slice of axis 1 that is this rank's experts'.
        "c = xs.shape[1] // jax.lax.axis_size(EXPERT)\n"
        "                g = jax.lax.all_gather(xs, EXPERT)\n"
        "                r = jax.lax.axis_index(EXPERT)\n"
        "                g = jax.lax.dynamic_slice_in_dim(g, r * c, c, 2)\n"
        "                xs = g.reshape(-1, *g.shape[2:])",
        ["tests/test_moe.py::test_expert_parallel_moves_tokens_by_the_router_s_collectives"],
    ),
    (
        "a resumed run starts again from scratch",
        "angel_jax/loop.py",
        # It still says it resumed: only the steps it runs tell.
        "    return exp.from_checkpointed(found.state), found.data_index",
        "    return exp.init_state(), 0",
        ["tests/test_resume.py::test_a_stop_signal_saves_the_step_and_resume_recomputes_nothing"],
    ),
    (
        "layer inputs stay on the device",
        "angel_jax/remat.py",
        "    if not input_on_host:\n        return policy",
        "    if True:\n        return policy",
        [
            "tests/test_offload.py::test_layer_inputs_in_host_memory_give_the_same_grads",
            # On a GPU (JAX_PLATFORMS=cuda); skipped elsewhere.
            "tests/test_offload.py::test_offloaded_activations_live_in_host_memory_on_gpu",
        ],
    ),
    (
        "the update does not wait for chunks to leave the device",
        "angel_jax/offload/moves.py",
        '    """Blocks until a chunk is home: its arrays ready, or its SSD writes done."""',
        '    """Blocks until a chunk is home: its arrays ready, or its SSD writes done."""\n'
        "    return",
        # On a GPU (JAX_PLATFORMS=cuda): the device's bytes in use; skipped elsewhere.
        ["tests/test_offload.py::test_update_holds_at_most_chunks_in_flight_in_device_memory"],
    ),
    (
        "the update fetches nothing before the step is dispatched",
        "angel_jax/offloaded_update.py",
        "        if self.delayed and self.pending is None:\n            return None\n",
        "        return None\n",
        [
            "tests/test_offload_delayed.py::"
            "test_update_fetches_its_first_chunks_before_the_step_is_dispatched"
        ],
    ),
    (
        "the update between microbatches writes the weights the later ones read",
        "angel_jax/offloaded_update.py",
        "            into_new=True,\n",
        "            into_new=False,\n",
        [
            "tests/test_offload_delayed.py::test_delayed_update_applies_each_steps_grads_a_step_late"
            "[False-kw2]"
        ],
    ),
    (
        "the waiting update runs after the step's microbatches, not between them",
        "angel_jax/offloaded_update.py",
        "            for _ in range(slots[j] if j < len(slots) else 0):\n",
        "            for _ in range(0):\n",
        [
            "tests/test_offload_delayed.py::test_delayed_update_runs_between_the_next_steps_microbatches"
        ],
    ),
    (
        "the plan leaves out the update's new compute copy beside the microbatches",
        "angel_jax/planning/chunks.py",
        '"new compute params": new_copy},',
        '"new compute params": 0},',
        [
            "tests/test_offload_delayed.py::"
            "test_update_between_microbatches_plans_its_chunks_and_new_compute_copy",
            "tests/test_offload_delayed.py::test_update_between_microbatches_holds_no_more_than_its_plan",
        ],
    ),
    (
        "the new compute copy counted whole at each chunk of a weight, not by its parts",
        "angel_jax/planning/groups.py",
        "[0] // weight_bytes[weights[k]][1] for k in ks)",
        "[0] for k in ks)",
        [
            "tests/test_offload_delayed.py::"
            "test_update_between_microbatches_takes_the_largest_slot_its_room_allows"
        ],
    ),
    (
        "the planner takes the even share's slot or none, not the largest that fits",
        "angel_jax/planning/chunks.py",
        "            if at_mid:\n",
        "            if False:\n",
        [
            "tests/test_offload_delayed.py::"
            "test_update_between_microbatches_takes_the_largest_slot_its_room_allows"
        ],
    ),
    (
        "build keeps the update after the step when the compiled step gives room back",
        "angel_jax/planning/settle.py",
        "    between = again.plan.update_between_microbatches and not",
        "    between = False and again.plan.update_between_microbatches and not",
        [
            "tests/test_offload_delayed.py::"
            "test_update_between_microbatches_taken_once_the_compiled_step_gives_room"
        ],
    ),
    (
        "the step's last program between microbatches is not checked in build",
        "angel_jax/steps.py",
        "            _ = self.finish_program\n",
        "            pass\n",
        [
            "tests/test_offload_delayed.py::"
            "test_update_between_microbatches_taken_once_the_compiled_step_gives_room"
        ],
    ),
    (
        "a plan made again compiles the program that ends the step again",
        "angel_jax/steps.py",
        "            self.finish_compiled = other.finish_compiled\n",
        "            pass\n",
        [
            "tests/test_offload_delayed.py::"
            "test_a_plan_made_again_between_microbatches_reuses_the_program_that_ends_the_step"
        ],
    ),
    (
        "a slot's group keeps its old host copies until its update has run",
        "angel_jax/offload/stream.py",
        "        if self.slot_bytes and old:\n",
        "        if False:\n",
        [
            "tests/test_offload_delayed.py::"
            "test_update_between_microbatches_frees_a_groups_host_copies_before_its_new_ones"
        ],
    ),
    (
        "chunks larger than a slot keep their place in the update between microbatches",
        "angel_jax/planning/groups.py",
        "    return first + [k for k, f in enumerate(fits) if not f]",
        "    return list(range(len(sizes)))",
        [
            "tests/test_offload_delayed.py::"
            "test_update_between_microbatches_runs_chunks_larger_than_a_slot_after_the_last_one"
        ],
    ),
    (
        "the update between microbatches counts only chunks larger than a slot as after them",
        "angel_jax/planning/chunks.py",
        "        after = sum(group_bytes[beside:])\n",
        "        after = sum(n for n in moved if n > slot)\n",
        [
            "tests/test_offload_delayed.py::"
            "test_update_between_microbatches_needs_most_of_the_update_beside_them"
        ],
    ),
    (
        "a group larger than a slot is fetched beside the last microbatch",
        "angel_jax/offload/stream.py",
        "        if nxt < len(update.groups) and (nxt < between or g >= between):",
        "        if nxt < len(update.groups):",
        [
            "tests/test_offload_delayed.py::"
            "test_update_between_microbatches_runs_chunks_larger_than_a_slot_after_the_last_one"
        ],
    ),
    (
        "a group larger than a slot stays beside the next step's first microbatch",
        "angel_jax/offload/stream.py",
        "        keep = update.leaving if update.beside_step and update.between_groups == n else 0",
        "        keep = update.leaving if update.beside_step else 0",
        [
            "tests/test_offload_delayed.py::"
            "test_update_between_microbatches_runs_chunks_larger_than_a_slot_after_the_last_one",
            "tests/test_offload_delayed.py::test_update_between_microbatches_holds_no_more_than_its_plan",
        ],
    ),
    (
        "a group larger than a slot is fetched before one goes home",
        "angel_jax/offload/stream.py",
        (
            "        if g not in fetched:  # Larger than a slot: fetched after the last "
            "microbatch.\n            update.homebound.make_room(fetched, update.in_flight)\n"
        ),
        "        if g not in fetched:\n",
        [
            "tests/test_offload_delayed.py::test_update_between_microbatches_holds_no_more_than_its_plan"
        ],
    ),
    (
        "the plan counts two slots after the microbatches, not the larger groups there",
        "angel_jax/planning/chunks.py",
        '            "update chunks": max([2 * slot, *pairs]),\n',
        '            "update chunks": 2 * slot,\n',
        [
            "tests/test_offload_delayed.py::test_update_between_microbatches_holds_no_more_than_its_plan"
        ],
    ),
    (
        "groups larger than a slot are dispatched between microbatches",
        "angel_jax/offload/stream.py",
        "        return [int(i < self.between_groups) for i in range(count)]",
        "        return [int(i < len(self.groups)) for i in range(count)]",
        [
            "tests/test_offload_delayed.py::"
            "test_update_between_microbatches_runs_chunks_larger_than_a_slot_after_the_last_one"
        ],
    ),
    (
        "the host's cores leave their chunks as they were",
        "angel_jax/offload/cpu.py",
        "        self.values[c.key] = (master, state)\n",
        "",
        ["tests/test_offload.py::test_hybrid_update_equals_on_device"],
    ),
    (
        "auto does not plan again when the compiled step outgrows the estimate",
        "angel_jax/train.py",
        "    if not (fit_compiled and",
        "    if True or not (fit_compiled and",
        [
            "tests/test_offload.py::test_auto_plans_again_with_the_compiled_steps_temporaries[outgrows]"
        ],
    ),
    (
        "room the compiled step leaves is not given back",
        "angel_jax/planning/settle.py",
        "    if excess >= 0 or not fills:",
        "    if True:",
        [
            "tests/test_offload.py::test_auto_plans_again_with_the_compiled_steps_temporaries[undershoots]"
        ],
    ),
    (
        "microbatch grads counted as lasting grads",
        "angel_jax/planning/plan.py",
        '    *ACTIVATIONS,\n    "microbatch grads",\n    "layers in flight",',
        '    *ACTIVATIONS,\n    "layers in flight",',
        [
            "tests/test_offload_planner.py::test_microbatch_grads_are_planned_in_the_steps_temporaries"
        ],
    ),
    (
        "update chunks not grouped",
        "angel_jax/planning/groups.py",
        "and total + size <= cap",
        "and total + size <= 0",
        ["tests/test_offload.py::test_update_moves_and_updates_chunks_in_groups"],
    ),
    (
        "buffers deleted while copies read them",
        "angel_jax/offload/moves.py",
        "ready = lambda xs: all(copy_done(x) for x in xs)",
        "ready = lambda xs: True",
        [
            "tests/test_offload.py::test_buffers_copies_read_are_deleted_only_when_the_copies_are_done"
        ],
    ),
    (
        "chunks beside the step counted as the update's",
        "angel_jax/planning/plan.py",
        (
            '    "chunks beside the step",\n    "chunks in the step",\n',
            'UPDATE_ONLY = ("update chunks",)',
        ),
        (
            '    "chunks in the step",\n',
            'UPDATE_ONLY = ("update chunks", "chunks beside the step")',
        ),
        [
            "tests/test_offload_planner.py::test_the_steps_activations_and_the_updates_chunks_are_not_counted_together",
            "tests/test_offload_planner.py::test_the_updates_groups_beside_the_step_are_the_plans",
        ],
    ),
    (
        "groups beside the step without room for them",
        "angel_jax/offload/stream.py",
        "        if not self.beside_step:\n            return {}\n",
        "",
        ["tests/test_offload_planner.py::test_the_updates_groups_beside_the_step_are_the_plans"],
    ),
    (
        "last update's groups left beside the step",
        "angel_jax/offload/moves.py",
        " or id(self.entries[0]) in older)",
        ")",
        [
            "tests/test_offload_planner.py::test_the_groups_left_beside_the_step_are_the_last_ones_and_do_not_pile_up"
        ],
    ),
    (
        "groups home dropped before the trim",
        "angel_jax/offload/stream.py",
        (
            "        keep = update.leaving if update.beside_step and update.between_groups == n "
            "else 0\n"
        ),
        (
            "        update.homebound.delete_ready()\n"
            "        keep = update.leaving if update.beside_step and update.between_groups == n "
            "else 0\n"
        ),
        [
            "tests/test_offload_planner.py::test_the_groups_left_beside_the_step_are_the_last_ones_and_do_not_pile_up"
        ],
    ),
    (
        "collectives in a loop counted once",
        "experiments/throughput.py",
        "            add(most, trips)",
        "            add(most, 1)",
        ["tests/test_experiments.py::test_collective_bytes_count_each_trip_of_a_scan"],
    ),
    (
        "async collectives counted at their start and their done",
        "experiments/throughput.py",
        '        if not re.search(r" async-(done|update)\\(", line):',
        "        if True:",
        ["tests/test_experiments.py::test_collective_bytes_count_an_async_collective_once"],
    ),
    (
        "auto remat's pick not given to the model",
        "angel_jax/planning/inputs.py",
        '    settings["remat"] = plan.remat\n',
        '    settings["remat"] = "none"\n',
        ["tests/test_offload_planner.py::test_auto_remat_is_the_fastest_that_fits"],
    ),
    (
        "auto remat not checked against the compiled step",
        "angel_jax/planning/settle.py",
        "    if not (built.plan.offloads_optimizer or picks_remat):",
        "    if not built.plan.offloads_optimizer:",
        [
            "tests/test_offload_planner.py::test_auto_remat_takes_the_next_when_the_compiled_step_outgrows_the_device"
        ],
    ),
    (
        "auto remat never tries a faster one",
        "angel_jax/planning/settle.py",
        "    return _with_a_faster_remat(inp, make, built, excess) if picks_remat and not extra "
        "else built",
        "    return built",
        [
            "tests/test_offload_planner.py::test_auto_remat_takes_a_faster_one_when_the_compiled_step_leaves_room"
        ],
    ),
    (
        "last update's groups not counted in flight",
        "angel_jax/offload/moves.py",
        "while self.entries and len(self.entries) + len(fetched) >= in_flight:",
        "while False:",
        [
            "tests/test_offload.py::test_buffers_copies_read_are_deleted_only_when_the_copies_are_done"
        ],
    ),
    (
        "a GPU allocator without a limit leaves the host's RAM as the device budget",
        "angel_jax/planning/tiers.py",
        '        if not device and first.platform != "cpu":',
        "        if False:",
        [
            "tests/test_offload_planner.py::test_a_gpu_allocator_without_a_limit_asks_for_the_device_budget"
        ],
    ),
    (
        "a benchmark re-run far under its record passes",
        "experiments/bench.py",
        "TOLERANCE = 0.05",
        "TOLERANCE = 0.5",
        ["tests/test_bench.py::test_the_bench_exits_1_on_a_regression_and_0_when_the_records_hold"],
    ),
    (
        "the pool replay frees each group's old host arrays before its new ones come",
        "angel_jax/planning/tiers.py",
        "                if arrays.old_first:\n",
        "                if True:\n",
        ["tests/test_pinned_pool.py::test_the_8b_record_is_advised_a_pool_that_the_replay_accepts"],
    ),
    (
        "the unrolled step's grads counted beside its activations",
        "angel_jax/planning/placement.py",
        '            grads_after_activations=name == "none" and self.unrolled,',
        "            grads_after_activations=False,",
        [
            "tests/test_memory_estimate.py::"
            "test_dropless_moe_plan_is_within_10_percent_of_its_compiled_step"
        ],
    ),
    (
        "the allocator trace leaves out the update's fetches",
        "angel_jax/offload/stream.py",
        "        dispatch.mark(dispatch.FETCHED_GROUP)\n",
        "",
        [
            "tests/test_experiments.py::"
            "test_dispatch_memory_is_recorded_at_each_dispatch_and_allocation_between_microbatches"
        ],
    ),
    (
        "the update between microbatches writes the new compute copy into new buffers",
        "angel_jax/offload/stream.py",
        "    return jax.jit(write_new_compute_copy, out_shardings=sharding, donate_argnums=0)\n"
        "\n\n@functools.cache\ndef _overwrite",
        "    return jax.jit(write_new_compute_copy, out_shardings=sharding)\n"
        "\n\n@functools.cache\ndef _overwrite",
        [
            "tests/test_offload_delayed.py::test_update_between_microbatches_keeps_the_compute_copys_buffers"
        ],
    ),
    (
        "split masters joined without their low halves",
        "angel_jax/offload/masters.py",
        "    low = low.astype(jnp.uint32)\n",
        "    low = jnp.zeros_like(low, jnp.uint32)\n",
        ["tests/test_offload_masters.py::test_split_masters_train_as_whole_ones"],
    ),
    (
        "split masters rounded to the nearest even (a tie's master lost)",
        "angel_jax/offload/masters.py",
        "    high = (bits + 0x8000) >> 16\n",
        "    high = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16\n",
        ["tests/test_offload_masters.py::test_halves_join_into_the_master_bit_for_bit"],
    ),
    (
        "split masters' halves read two evaluations of the master (no barrier)",
        "angel_jax/offload/masters.py",
        "    bits = jax.lax.optimization_barrier("
        "jax.lax.bitcast_convert_type(master, jnp.uint32))\n",
        "    bits = jax.lax.bitcast_convert_type(master, jnp.uint32)\n",
        [
            "tests/test_offload_masters.py::test_split_masters_train_as_whole_ones",
            "tests/test_offload_masters.py::test_both_halves_read_one_evaluation_of_the_master",
        ],
    ),
    (
        "the planner counts split masters whole",
        "angel_jax/planning/placement.py",
        "    chunk_lists[True] = [(key, m // 2, s) for key, m, s in chunk_lists[False]]\n",
        "    chunk_lists[True] = chunk_lists[False]\n",
        ["tests/test_offload_masters.py::test_split_masters_train_as_whole_ones"],
    ),
    (
        "the update keeps the old low halves of split masters",
        "angel_jax/offload/masters.py",
        "    return (low if home_dtype == LOW else master), compute\n",
        "    return (jnp.zeros_like(low) if home_dtype == LOW else master), compute\n",
        ["tests/test_offload_masters.py::test_split_masters_train_as_whole_ones"],
    ),
    (
        "AdamW's first moment kept in float32 whatever mu_dtype says",
        "angel_jax/optim/__init__.py",
        "else jnp.dtype(train.mu_dtype),",
        "else None,",
        [
            "tests/test_offload_masters.py::"
            "test_bfloat16_first_moment_is_held_and_moved_in_two_bytes"
        ],
    ),
    (
        "generation takes an offloaded checkpoint's host masters",
        "angel_jax/generate.py",
        "        if exp.offloaded:  # The masters are in host memory",
        "        if False:  # The masters are in host memory",
        ["tests/test_generate.py::test_generates_from_an_offloaded_checkpoint"],
    ),
    (
        "a checkpoint holds the host cores' split masters whole",
        "angel_jax/offload/state.py",
        "            split_numpy(m) if self.split_masters and c.tier == CPU else m\n",
        "            m\n",
        ["tests/test_offload_masters.py::test_split_masters_checkpoint_and_resume"],
    ),
    (
        "ssd_compress halves the whole optimizer state, bfloat16 leaves too",
        "angel_jax/planning/chunks.py",
        "        local_bytes(x) // (2 if x.dtype == np.float32 else 1) for x in",
        "        local_bytes(x) // 2 for x in",
        ["tests/test_offload_planner.py::test_compressed_ssd_state_halves_only_float32_leaves"],
    ),
    (
        "a second run takes a held workdir",
        "angel_jax/lock.py",
        "            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)\n",
        "",
        ["tests/test_errors.py::test_a_second_run_on_a_held_workdir_exits_2_naming_the_holder"],
    ),
    (
        "a failed asynchronous save goes unnoticed",
        "angel_jax/checkpoint.py",
        (
            "            self.manager.check_for_errors()\n",
            "            self.manager.wait_until_finished()\n        except",
        ),
        ("            pass\n", "            pass\n        except"),
        ["tests/test_errors.py::test_a_failed_save_stops_the_run_and_keeps_the_last_checkpoint"],
    ),
    (
        "a checkpoint is written without counting the free space",
        "angel_jax/checkpoint.py",
        "        if _everywhere(free >= need * SPACE_MARGIN):\n",
        "        if True:\n",
        [
            "tests/test_errors.py::"
            "test_a_checkpoint_larger_than_the_free_space_is_refused_before_it_is_written"
        ],
    ),
    (
        "orbax's report of a failed read is lost",
        "angel_jax/checkpoint.py",
        '        self.write(f"{what}:',
        '        (f"{what}:',
        ["tests/test_errors.py::test_cli_corrupt_checkpoint"],
    ),
    (
        "each emulated CPU device planned against the whole RAM",
        "angel_jax/planning/tiers.py",
        "        device = device or machine.host_available() // local_devices",
        "        device = device or machine.host_available()",
        ["tests/test_errors.py::test_emulated_cpu_devices_share_the_hosts_memory"],
    ),
    (
        "a resume restarts the data at batch 0",
        "angel_jax/loop.py",
        "    return exp.from_checkpointed(found.state), found.data_index",
        "    return exp.from_checkpointed(found.state), 0",
        ["tests/test_elastic_resume.py::test_data8_resumes_on_data4_tensor2"],
    ),
    (
        "a checkpoint of another layout is restored as it is",
        "angel_jax/checkpoint.py",
        "        as_is = _same_form(saved, reshard.layout)",
        "        as_is = True",
        [
            "tests/test_elastic_resume.py::test_pipeline_2_resumes_on_pipeline_1",
            "tests/test_elastic_resume.py::test_offloaded_resumes_on_the_device_and_back",
        ],
    ),
    (
        "a restore keeps the saved mesh's shardings",
        "angel_jax/checkpoint.py",
        "        target = abstract_state if as_is else",
        "        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if "
        'hasattr(x, "sharding") else x, abstract_state) if as_is else',
        ["tests/test_elastic_resume.py::test_fewer_devices_8_to_4_to_2"],
    ),
    (
        "a changed model is read before its shapes are compared",
        "angel_jax/checkpoint.py",
        "    if have == want:\n        return None",
        "    if True:\n        return None",
        ["tests/test_elastic_resume.py::test_a_resume_that_cannot_work_names_the_setting"],
    ),
    (
        "fine-tuning learns the prompt's tokens too",
        "angel_jax/losses.py",
        '            weights = weights & (f["loss_mask"][:, 1:] > 0)',
        "            pass",
        ["tests/test_sft.py::test_loss_ignores_prompt_targets"],
    ),
    (
        "packed chat data splits a conversation at every end-of-document id",
        "angel_jax/data/objectives.py",
        "    segments = [segments_ending_at(marks == END)] if packing else []",
        "    segments = [document_segments(tokens, eos_id)] if packing else []",
        ["tests/test_sft.py::test_packed_rows_number_conversations_from_the_mask_ends"],
    ),
    (
        "packed chat rows are cut every seq_len tokens, across conversations",
        "angel_jax/data/loader.py",
        "    if marks is not None and config.data.packing:",
        "    if False:",
        [
            "tests/test_sft.py::"
            "test_batches_hold_whole_conversations_with_their_mask_and_resume_at_any_index"
        ],
    ),
    (
        "the planner times a tensor shard's norm regions on the whole sequence",
        "angel_jax/planning/cost_model.py",
        "    eff = cal.efficiency(shape.layer_matmul_params() / tp, tp > 1)",
        "    eff = cal.efficiency(shape.layer_matmul_params() / tp)",
        ["tests/test_plan.py::test_sequence_parallel_calibration_splits_what_the_shard_runs_whole"],
    ),
    (
        "a profile's sequence-parallel correction skips the sizes it did not profile",
        "experiments/plan_calibrate.py",
        '                timed, r["rest_from"] = one - b + b / r["tp"], "a + b / tp"',
        '                timed, r["rest_from"] = r["layer_s"] - one / r["tp"], "a + b / tp"',
        [
            "tests/test_plan.py::"
            "test_a_profile_corrects_the_calibrations_points_for_sequence_parallel"
        ],
    ),
    (
        "the planner's FP8 gain is one figure for every shard size",
        "angel_jax/planning/cost_model.py",
        "        eff *= cal.fp8(shape.layer_matmul_params() / tp, tp > 1)",
        "        eff *= cal.fp8_speedup",
        ["tests/test_plan.py::test_fp8s_gain_follows_the_shard_size_where_timed_by_it"],
    ),
    (
        "auto picks JAX's grouped GEMMs whatever the model's widths",
        "angel_jax/kernels.py",
        "            missing[kernel] = (misfits or {}).get(kernel)",
        "            pass",
        [
            "tests/test_kernels.py::"
            "test_auto_passes_over_a_grouped_gemm_whose_tiles_the_shapes_do_not_fit"
        ],
    ),
    (
        "a pipeline stage's cuDNN attention is left to its partitioner",
        "angel_jax/layers/attention.py",
        'if in_a_stage and implementation == "cudnn" and mask_BTS',
        'if False and implementation == "cudnn" and mask_BTS',
        # Compiles for GPU devices: needs jax[cuda13] (BUILD.md); skipped elsewhere.
        ["tests/test_plan.py::test_pipeline_stages_compile_for_gpus_beside_split_axes"],
    ),
    (
        "a pipeline stage's embedding lookup is left to its partitioner",
        "angel_jax/layers/linear.py",
        "        if mesh is not None and in_partly_manual_region():",
        "        if False:",
        # Compiles for GPU devices: needs jax[cuda13] (BUILD.md); skipped elsewhere.
        ["tests/test_plan.py::test_pipeline_stages_compile_for_gpus_beside_split_axes"],
    ),
    (
        "the vocab-parallel lookup keeps every device's rows",
        "angel_jax/parallel/embedding.py",
        "        h_BTD = jnp.where(mine[..., None], h_BTD, jnp.zeros((), h_BTD.dtype))",
        "",
        ["tests/test_pipeline.py::test_vocab_parallel_take_is_take"],
    ),
    (
        "a stage stacks a chunk's layer grads before adding them to the accumulators",
        "angel_jax/parallel/pipeline.py",
        (
            "            return (d_h, jax.tree.map(add, grads, d_params)), None",
            "        (d_h, grads), _ = jax.lax.scan(body, (d_h, grads), xs, reverse=True)",
        ),
        (
            "            return (d_h, grads), d_params",
            "        (d_h, grads), d_layers = jax.lax.scan(body, (d_h, grads), xs, reverse=True)\n"
            "        grads = jax.tree.map(\n"
            "            lambda acc, d: acc.at[chunk].add(keep(d)), grads, d_layers\n"
            "        )",
        ),
        [
            "tests/test_pipeline.py::"
            "test_a_stage_adds_each_layers_grads_to_its_accumulators_in_the_layer_loop"
        ],
    ),
    (
        "the LoRA update moves the frozen base weights (a decay on them)",
        "angel_jax/optim/__init__.py",
        "            new_params = lora.with_adapters(every, new_params)",
        "            new_params = lora.with_adapters(\n"
        "                jax.tree.map(lambda p: p * (1 - 1e-4), every), new_params\n"
        "            )",
        ["tests/test_lora.py::test_base_weights_stay_bitwise_and_only_the_adapters_train"],
    ),
    (
        "the LoRA merge leaves out alpha / rank",
        "angel_jax/lora.py",
        "(kernel.astype(jnp.float32) + scale * delta)",
        "(kernel.astype(jnp.float32) + delta)",
        ["tests/test_lora.py::test_merged_model_computes_the_adapted_logits"],
    ),
    (
        "export reads a run with a config of its own, not the one the run recorded",
        "angel_jax/export.py",
        "        config = recorded_config(workdir, overrides)",
        '        config = load_config("tiny", overrides)',
        ["tests/test_export.py::test_export_imports_back_with_the_trained_logits"],
    ),
    (
        "generate reads a run with a config of its own, not the one the run recorded",
        "angel_jax/generate.py",
        "            config = recorded_config(args.checkpoint, overrides)",
        '            config = load_config("tiny", overrides)',
        ["tests/test_export.py::test_generate_reads_the_runs_recorded_config"],
    ),
    (
        "an export's weights stay private to their owner (0600)",
        "angel_jax/interop/hf.py",
        "            os.chmod(part, 0o644)",
        "            pass",
        ["tests/test_export.py::test_export_imports_back_with_the_trained_logits"],
    ),
    (
        "generation past the trained length says nothing",
        "angel_jax/generate.py",
        "    if length > trained:",
        "    if False:",
        ["tests/test_generate_cli.py::test_warns_once_past_the_trained_length"],
    ),
    (
        "generation drops the ids its tokenizer cannot decode",
        "angel_jax/generate.py",
        "            check_decoded(tokens[0, len(prompt[0]) :], vocab, tokenizer)",
        "            pass",
        ["tests/test_generate_cli.py::test_refuses_generated_ids_the_tokenizer_cannot_decode"],
    ),
    (
        "a bool setting takes any word",
        "angel_jax/config.py",
        '        raise ValueError("use true or false")',
        "        return bool(text)",
        ["tests/test_generate_cli.py::test_a_bool_setting_refuses_other_words"],
    ),
    (
        "a mesh short of XLA_FLAGS' devices gives no hint that jax started first",
        "angel_jax/mesh.py",
        "    if not asked or int(asked[1]) == num_devices",
        "    if True or int(asked[1]) == num_devices",
        [
            "tests/test_errors.py::"
            "test_a_mesh_short_of_the_flags_devices_says_jax_started_before_them"
        ],
    ),
    (
        "supervise passes a whole command line to the launcher as its flags",
        "angel_jax/supervise.py",
        "        self.command = command or [",
        "        self.command = [",
        ["tests/test_supervise.py::test_runs_a_whole_command_line_after_its_own_flags"],
    ),
    (
        "a run's other processes do not learn that process 0 found the workdir held",
        "angel_jax/lock.py",
        "    if jax.process_count() == 1:\n        return ok",
        "    if True:\n        return ok",
        ["tests/test_multiprocess.py::test_a_held_workdir_stops_every_process_of_a_second_run"],
    ),
    (
        "a described cluster is planned as one process holding every GPU",
        "angel_jax/machine.py",
        "    if _described and _described[2]:",
        "    if False:",
        ["tests/test_plan.py::test_a_described_cluster_plans_each_hosts_share"],
    ),
    (
        "a described GPU's kernels are picked by this machine's devices' compute capability",
        "angel_jax/machine.py",
        "    if _described and _described[3]:",
        "    if False:",
        [
            "tests/test_kernels.py::test_a_described_gpu_picks_cudnns_blocks_by_its_targets_compute_capability"
        ],
    ),
    (
        "a cluster compiled on a CPU is described without its GPU's compute capability",
        "angel_jax/plan.py",
        'machine.describe("gpu", host, hosts, _capability(target))',
        'machine.describe("gpu", host, hosts)',
        # Compiles for GPU devices: needs jax[cuda13] (BUILD.md); skipped elsewhere.
        ["tests/test_plan.py::test_a_context_ring_compiles_with_the_gpus_blocks"],
    ),
]


def copy_repo(target: pathlib.Path) -> None:
    """The tracked and untracked-but-not-ignored files, as git sees the working tree (without
    git, as on the GPU machine's copy: every file but the ignored folders')."""
    if (REPO / ".git").exists():
        files = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
    else:
        skip = {".whl", ".baselines", "runs", "__pycache__", ".pytest_cache", ".ruff_cache"}
        files = [
            str(f.relative_to(REPO))
            for f in REPO.rglob("*")
            if f.is_file() and not skip & set(f.relative_to(REPO).parts)
        ]
    for name in files:
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def run_break(name, path, text, replacement, tests) -> tuple[bool, float, str]:
    """(the tests failed, seconds, last output line) with the break applied in a copy."""
    with tempfile.TemporaryDirectory(prefix="angel-break-") as tmp:
        copy = pathlib.Path(tmp)
        copy_repo(copy)
        source = (copy / path).read_text()
        pairs = (text, replacement) if isinstance(text, tuple) else ((text,), (replacement,))
        edits = zip(*pairs, strict=True)
        for old, new in edits:
            if source.count(old) != 1:
                return False, 0.0, f"the text to break occurs {source.count(old)} times in {path}"
            source = source.replace(old, new)
        (copy / path).write_text(source)
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # conftest sets them.
        proc = subprocess.run(cmd, cwd=copy, capture_output=True, text=True, env=env)
        lines = (proc.stdout or proc.stderr).strip().splitlines()
        return proc.returncode != 0, time.perf_counter() - start, lines[-1] if lines else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--list", action="store_true", help="list the breaks and their tests")
    p.add_argument("names", nargs="*", help="breaks to run (a part of the name); default all")
    a = p.parse_args()
    chosen = [b for b in BREAKS if not a.names or any(n in b[0] for n in a.names)]
    if a.list:
        for name, path, _, _, tests in chosen:
            print(f"{name:<42} {path:<28} {' '.join(tests)}")
        return 0
    survived = 0
    for b in chosen:
        failed, seconds, last = run_break(*b)
        # Only skips (a GPU test off a GPU): the break is not tried here.
        untried = not failed and "skipped" in last and "passed" not in last
        survived += not failed and not untried
        verdict = (
            "red, as it must be" if failed else "not tried here" if untried else "STILL PASSES"
        )
        print(f"{b[0]:<42} {verdict:<20} {seconds:6.0f} s  {last}", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())

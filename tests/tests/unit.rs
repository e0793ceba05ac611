//! The unit tests of memattn, kernels-gpu and memattn-cli: the test modules of their sources,
//! compiled into each library by its feature `unit-tests` (so that the workspace's `cargo test`
//! builds each library once, not again for a unit-test harness) and run from here.
//! `every_unit_test_of_the_sources_runs_here` (one per crate) fails when a source gains a test
//! that its list lacks.

#[macro_use]
#[path = "../../ptx-vm/tests/unit_list.rs"]
mod unit_list;

/// A folder of the workspace.
fn src(dir: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(dir)
}

/// memattn's unit tests (attention, backward, context parallel, decode, the reference and the
/// verification).
mod memattn_units {
    unit_tests! {
        memattn;
        attn_alias: [nested_strides_are_one_to_one_and_shared_ones_are_not],
        attn_backward: [gradients_match_the_f64_reference, tensor_core_gradients_match_the_f64_reference, compact_backward_runs_where_shared_memory_is_small, varlen_gradients_match_the_f64_reference, atomic_dq_adds_survive_several_workers, deterministic_mode_is_bitwise_reproducible_and_right, the_workspace_is_stated_exactly, the_allocating_form_returns_verified_gradients, refusals_are_typed],
        attn_naive_backward: [naive_gradients_match_the_f64_reference, the_workspace_is_p_and_ds_exactly, refusals_are_typed],
        choice: [the_table_parses_and_each_timed_row_picks_the_faster_kernel, malformed_rows_are_refused_with_their_line, the_policy_picks_by_table_and_override],
        cp: [segments_cover_the_sequence_once, block_plans_reproduce_the_global_mask, overlap_model_orders_the_strategies, strategies_parse_and_print],
        cp_grouped: [a_ring_and_an_all_gather_pair_up, rendezvous_reports_a_group_that_would_hang, calls_that_do_not_pair_up_fail_instead_of_hanging],
        decode: [heuristic_matches_flash_attention_2_on_known_cases, the_benchmark_plan_fills_the_modelled_gpu, splits_keep_the_bytes_in_flight_within_one_wave, sizes_are_exact_and_refuse_what_does_not_fit, shape_rules_are_named, non_finite_sinks_are_refused_and_underflow_is_not_an_error, reference_with_a_sink_known_answer, fp8_reference_reads_the_bytes_and_scale_rules_are_named, decode_and_prefill_reference_rows_are_bit_identical, the_acceptance_rule_rejects_a_perturbed_decode_output, merge_reference_known_answers],
        dtype: [unit_roundoff_is_half_the_gap_after_one, rounding_and_bytes_round_trip],
        inputs: [parallel_generation_is_the_sequential_stream, kept_normals_are_the_stream_in_any_order_of_draws, bhsd_round_trip_and_strides_agree],
        layering_tests: [every_subfolder_is_read, module_layers_have_no_cycle, the_checker_sees_imports_and_cycles, no_command_line_flag_in_messages],
        memory: [flash_workspace_is_lse_only, sixteen_bit_tensors_take_two_bytes_lse_four],
        problem: [unmasked_pairs_match_brute_force, gqa_window_and_softcap_are_validated, lists_read_as_prose, zero_sizes_and_head_dims_are_named, dtype_picks_the_kernel_from_the_variant_table, narrow_windows_pick_the_narrow_tiles, alignment_is_checked_for_the_tensor_core_kernels, flops_halve_for_square_causal],
        ptx: [an_entry_module_keeps_one_entry_and_everything_else, every_committed_entry_makes_a_module_of_its_own, a_module_built_from_other_tiles_is_refused_before_launch, embedded_entries_are_the_variant_table],
        reference: [every_vector_level_gives_the_same_bits, hand_computed_two_keys, dots_have_the_bits_of_a_plain_sum, visible_keys_are_the_keys_the_rule_shows, window_ranges_match_the_rule_on_every_key, hand_computed_gqa_sinks_and_softcap, causal_bottom_right_masks_and_empty_rows, sample_is_distinct_sorted_and_seeded],
        reference_grad: [finite_differences_agree_on_every_option, a_wrong_derivative_is_caught, forward64_matches_the_reference],
        rng: [reproducible_and_roughly_normal, skipped_continues_the_same_stream],
        verify: [naive_rows_give_the_same_bits_at_every_vector_level, exact_copy_passes_and_masked_row_is_minus_inf, nan_unwritten_inf_and_wrong_values_fail, bf16_bound_is_twice_the_naive_in_dtype_baseline_with_floors, floor_keeps_an_exact_baseline_from_failing_a_rounded_result, f32_absolute_bounds_scale_with_magnitude, f32_relative_bounds_grow_with_the_scores],
        verify_underflow_tests: [a_correct_underflow_to_zero_passes_and_a_wrong_value_does_not],
        verify_row_local_tests: [one_large_head_does_not_hide_the_errors_of_the_others, row_scale_is_the_magnitude_of_the_values_averaged],
        verify_grad: [in_f32_it_is_the_reference_to_f32_accuracy, in_bf16_and_f16_it_costs_what_16_bit_rounding_costs, wrong_lengths_are_named, the_2x_rule_passes_a_good_16_bit_result_and_fails_a_bad_one, a_wrong_small_row_fails_though_the_whole_tensor_passes, where_the_exact_gradient_cancels_the_terms_set_the_scale, lse_infinities_must_agree],
    }

    #[test]
    fn every_unit_test_of_the_sources_runs_here() {
        crate::unit_list::check_listed(&crate::src("memattn/src"), LISTED, 60);
    }
}

/// kernels-gpu's host-side unit tests (ABI, tiles, masks, swizzles, the variant table, the
/// committed artifacts).
mod kernels_gpu_units {
    unit_tests! {
        kernels_gpu;
        abi: [to_bytes_is_the_repr_c_layout, bwd_to_bytes_is_the_repr_c_layout, naive_bwd_to_bytes_is_the_repr_c_layout, key_range_and_kv_head],
        artifacts: [the_recorded_digests_are_the_texts_digests, build_info_describes_the_committed_ptx, ptxas_report_round_trips_and_covers_every_kernel, the_sm90_module_records_cover_its_rows, the_timeline_module_has_the_timeline_rows, the_committed_ptx_exports_the_tables_tile_records, tile_records_parse_bytes_and_words],
        decode_abi: [splits_cover_every_key_once_in_whole_tiles, params_serialise_in_field_order, cache_rows_of_contiguous_and_paged_layouts],
        fp8: [decode_matches_the_definition_for_all_256_codes, encode_rounds_to_nearest_even_and_saturates],
        frag: [every_accumulator_element_is_held_once, ldmatrix_lanes_address_the_documented_matrices, row_max_mask_pack_and_scale_follow_the_layout],
        mask: [bottom_right_aligned_windows, matches_the_rule_key_by_key],
        softmax: [matches_the_two_pass_softmax_for_any_tiling, lazy_rescaling_matches_the_two_pass_softmax_and_skips_small_rises, softcap_is_tanh_and_saturates, tanh_has_a_small_relative_error_for_tiny_arguments, a_sink_joins_the_denominator_only, a_row_that_sees_nothing_gives_zero_and_minus_infinity],
        swizzle: [ldmatrix_phases_hit_eight_distinct_bank_groups, the_copy_plan_covers_every_chunk_once, xor_lane_addresses_agree_with_the_swizzle, tile_lanes_agree_with_the_swizzle_at_every_head_dim, lane_addresses_agree_with_the_swizzle, the_swizzle_permutes_chunks_within_a_row],
        variants: [the_backward_picks_its_main_kernel_by_shared_memory, lookups_find_exactly_the_table_rows, fp8_decode_rows_pair_an_fp8_forward_and_append_with_the_bf16_combine, backward_rows_and_their_geometry, naive_backward_rows_and_their_geometry, window_rules_choose_rows_and_fall_back_to_the_default, launch_geometry_derives_from_the_tile],
    }

    #[test]
    fn every_unit_test_of_the_sources_runs_here() {
        crate::unit_list::check_listed(&crate::src("kernels-gpu/src"), LISTED, 30);
    }
}

/// memattn-cli's unit tests (files, evidence, plans, charts, the backward's samples, ...).
mod memattn_cli_units {
    unit_tests! {
        memattn_cli;
        backward_run: [a_tensor_passes_within_the_bound_and_fails_past_it_or_on_nan, lse_infinities_must_agree, expected_bytes_name_every_buffer, a_short_sequence_is_held_to_its_own_scale, a_16_bit_run_is_held_to_twice_the_naive_backward, refusals_name_the_limit],
        backward_sample: [small_problems_varlen_and_all_are_checked_whole, a_training_sized_problem_is_sampled_within_the_budget, a_row_count_is_met_in_whole_slices_and_sinks_keep_every_batch, gathered_tensors_are_the_sampled_slices, the_reference_of_a_sample_is_the_whole_reference_there],
        charts: [axis_labels_read_as_units],
        evidence: [concurrent_appends_never_interleave, a_partial_last_line_does_not_glue_to_the_next_record, argv_changes_name_the_option],
        files: [atomic_write_replaces_whole_files_and_leaves_no_temporary, a_signal_during_an_atomic_write_removes_the_temporary_file, only_bounded_regular_files_are_read],
        harness: [repetitions_take_the_device_defaults_and_refuse_past_the_limit, every_repetition_is_poisoned_then_launched_and_the_measured_ones_timed, a_failing_body_still_closes_the_bracket_and_frees_its_buffers],
        layering_tests: [module_layers_have_no_cycle],
        plan: [kv_cache_counts_kv_heads_not_query_heads, windows_cap_the_cache_and_the_key_range, searches_find_the_edge, sizes_parse_with_units],
        report: [entries_label_is_compact, bytes_are_human],
        safetensors_io: [dtypes_map_to_safetensors_and_back],
        timeline: [stamps_become_spans_and_overflow_is_counted],
        timing: [medians],
    }

    #[test]
    fn every_unit_test_of_the_sources_runs_here() {
        crate::unit_list::check_listed(&crate::src("host/src"), LISTED, 20);
    }
}

/// The targets built with `test = false` (no unit-test build: the libraries whose tests run from
/// a `unit` runner, the command's binary, and the libraries without unit tests) have no test
/// module a `cargo test` would skip: the runners' tests are behind `unit-tests` (listed here
/// and in ptx-vm-tests), the others have none.
#[test]
fn no_unit_test_hides_in_a_target_cargo_test_does_not_build() {
    let root = src("");
    let mut found = Vec::new();
    let mut files = 0;
    for dir in
        ["memattn/src", "ptx-vm/src", "kernels-gpu/src", "host/src", "memattn-candle/src", "lessons/src", "tests/src"]
    {
        for file in unit_list::walk(&root.join(dir)) {
            files += 1;
            let text = std::fs::read_to_string(&file).unwrap();
            for (n, line) in text.lines().enumerate() {
                // `#[test]` deeper than one level is a macro's (tests/src's device_tests!).
                if line.trim_start().starts_with("#[cfg(test)]") || line == "#[test]" || line == "    #[test]" {
                    found.push(format!("{}:{}", file.strip_prefix(&root).unwrap_or(&file).display(), n + 1));
                }
            }
        }
    }
    assert!(files > 60, "only {files} source files read");
    assert!(found.is_empty(), "tests in targets with `test = false` (they would never run): {found:?}");
}

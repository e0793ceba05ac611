//! ptx-vm's unit tests: the `tests` module of each of its source files, compiled into the
//! library by its feature `unit-tests` (so that the workspace's `cargo test` optimises the VM
//! once) and run from here. `every_unit_test_of_the_sources_runs_here` fails when a source
//! gains a test that this list lacks.

#[macro_use]
mod unit_list;

unit_tests! {
    ptx_vm;
    banks: [consecutive_words_are_one_wavefront_and_a_stride_of_32_words_is_32, wide_accesses_go_in_half_and_quarter_warps],
    sectors: [a_stride_of_32_f32_is_one_sector_per_lane_and_unit_stride_is_four],
    exec: [ex2_of_a_full_warp_matches_exp2_lane_by_lane, #[ignore = "every 32-bit input: about 70 s in a release build"] ex2_every_pattern_matches_exp2, full_warp_fast_paths_match_the_general_functions, bf16_rounding_without_branches_matches_half, setp_fast_loops_match_compare, b32_address_check_and_gather_match_the_scalar_path, f32_warp_ops_match_the_lane_loops, guard_mask_takes_bit_0_of_every_lane, fma_fast_path_matches_portable],
    hopper: [encode_decode_round_trip_and_corruption, validation_follows_cu_tensor_map_encode_tiled, rows_clip_to_the_tensor],
    memcheck: [epoch_wrap_clears_old_stamps, fast_paths_match_access_lane_by_lane],
    num: [cvt_rn_bf16_f32_matches_cvt],
    parse: [next_special_finds_the_byte_and_counts_the_lines_before_it, skipping_a_block_ends_and_counts_lines_as_byte_by_byte],
    regalloc: [packed_kernels_give_the_bytes_of_the_program_as_written, loops_calls_and_divergent_paths_keep_their_values_when_packed],
    reginit: [a_register_written_on_some_paths_reads_zero_in_later_blocks, committed_kernels_ignore_the_registers_they_write_first],
    source: [the_one_pass_func_search_builds_the_plain_map, lines_map_to_the_last_loc_and_inlined_helpers_keep_the_kernel_line],
    swizzle: [chunks_of_row_r_move_by_r_modulo_the_pattern],
    tensor_core: [mma_m16n8k16_f16_and_bf16, mma_m16n8k8_f16_and_bf16, mma_rounds_once_to_f32, mma_sums_every_output_in_k_order_bit_for_bit, mma_rows_matches_mma_f32_acc_bit_for_bit, ldmatrix_plain_and_trans],
    wgmma: [descriptor_fields, fragment_maps_cover_the_tile_once],
}

/// Every unit test of the sources is in the list above (one left out would never run).
#[test]
fn every_unit_test_of_the_sources_runs_here() {
    unit_list::check_listed(&std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../src"), LISTED, 30);
}

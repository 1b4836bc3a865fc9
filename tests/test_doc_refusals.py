"""Every sentence of docs/*.md that promises a refusal ("refused", "refuses", "is an error", "raises") has a test.

:data:`REFUSALS` maps each such sentence (its page and a quoted fragment of it) to the test(s) that check the
promise. A new sentence with such a promise and no entry fails :func:`test_every_promised_refusal_has_an_entry`;
an entry whose fragment left the page, or whose test no longer exists, fails the others. :data:`GAPS` lists the
promises for which no test was found yet (what each promises); it may only shrink.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PROMISE = re.compile(r"\b(refused|refuses|is an error|raises)\b")

REFUSALS: list[tuple[str, str, list[str]]] = [
    # (page, fragment of the sentence, test node ids)
    (
        "diffusion.md",
        "Context parallelism is not implemented for VACE: a context_parallel_size above 1 is refused",
        ["tests/test_wan.py::test_fitting_wan_vace_with_context_parallelism_is_refused"],
    ),
    (
        "diffusion.md",
        "is refused naming the keys, before diffusers runs it",
        ["tests/test_wan.py::test_wan_inputs_the_model_cannot_take_are_refused_naming_the_keys"],
    ),
    (
        "checkpoints.md",
        "a `last` link whose checkpoint was deleted is refused before anything starts",
        [
            "tests/test_checkpoint_messages.py::test_resuming_from_a_last_link_whose_checkpoint_is_gone_is_refused_naming_link_and_target"
        ],
    ),
    (
        "checkpoints.md",
        "is refused from its size, before it is read",
        [
            "tests/test_ckpt_verify.py::test_a_manifest_above_its_documented_size_is_refused_before_it_is_read",
            "tests/test_ckpt_verify.py::test_a_manifest_listing_more_files_than_a_checkpoint_may_have_is_refused_before_any_is_checked",
        ],
    ),
    (
        "checkpoints.md",
        "Every converter refuses an existing output",
        [
            "tests/test_convert_cli.py::test_no_converter_writes_into_its_source_or_over_an_output",
            "tests/test_convert_cli.py::test_force_replaces_only_an_earlier_output_of_the_same_converter",
        ],
    ),
    (
        "checkpoints.md",
        "LoRA adapters and tensors outside the Transformers model are refused",
        [
            "tests/test_checkpoint_hf_format.py::test_the_names_are_save_pretrained_ones_and_what_has_none_is_refused",
            "tests/test_setup_refusals.py::test_a_combination_a_save_refuses_fails_at_setup_before_the_first_step",
        ],
    ),
    (
        "checkpoints.md",
        "with another `checkpoint_format` is refused when `fit` starts",
        [
            "tests/test_setup_refusals.py::test_a_combination_a_save_refuses_fails_at_setup_before_the_first_step",
            "tests/test_setup_refusals.py::test_a_url_dirpath_is_checked_only_for_what_it_cannot_take",
        ],
    ),
    (
        "checkpoints.md",
        "refuses a `.distcp` object the manifest does not list",
        ["tests/test_checkpoint_remote.py::test_a_foreign_or_missing_object_on_s3_is_a_clear_error"],
    ),
    (
        "checkpoints.md",
        "at a URL it is refused when the fit",
        ["tests/test_checkpoint_remote.py::test_save_last_link_at_an_s3_dirpath_is_one_line_from_the_cli"],
    ),
    (
        "cli.md",
        "A checkpoint saved from another model class is an error",
        ["tests/test_cli_errors.py::test_checkpoint_class_path_is_never_imported"],
    ),
    (
        "cli.md",
        "refuses a model that cannot fit in one line naming both sizes",
        ["tests/test_meta_build.py::test_fit_refuses_a_model_the_machine_cannot_hold_in_one_line"],
    ),
    (
        "cli.md",
        "what is not applicable, and what is refused",
        [
            "tests/test_migrate_mindspeed.py::test_unknown_and_megatron_model_configs_are_clear_errors",
            "tests/test_mindspeed_corpus.py::test_each_refusal_names_its_file_and_a_documented_reason",
        ],
    ),
    (
        "cli.md",
        "A provider DataLoader whose batch size differs from `--micro-batch-size` is refused at setup",
        ["tests/test_migrate.py::test_a_provider_loader_with_another_batch_size_than_the_launch_is_refused"],
    ),
    (
        "data.md",
        "or raises `DataError` naming the record with `strict: true`",
        ["tests/test_data.py::test_bad_records_are_skipped_counted_and_reported_or_raise_in_strict_mode"],
    ),
    (
        "data.md",
        "audio refused",
        ["tests/test_hf_data.py::test_config_errors_name_the_file_and_key"],  # dataset_param.attr.audios
    ),
    (
        "data.md",
        "in `dataloader_param` they are refused",
        ["tests/test_hf_data.py::test_config_errors_name_the_file_and_key"],  # dataloader_param.batch_size
    ),
    (
        "data.md",
        "Every key is honoured or refused by name",
        [
            "tests/test_hf_data.py::test_config_errors_name_the_file_and_key",
            "tests/test_data.py::test_config_errors_name_the_key_before_training",
        ],
    ),
    (
        "data.md",
        "and any unknown layer are refused, naming the layer's class and module path",
        [
            "tests/test_packing.py::test_packing_refusal_names_each_listed_stateful_architecture",
            "tests/test_packing.py::test_packing_is_refused_by_layer_class_and_path_for_layers_with_sequence_state",
        ],
    ),
    (
        "data.md",
        "A sample longer than `N`, an empty dataset, or `drop_last` with fewer batches than ranks is an error up front",
        [
            "tests/test_token_budget.py::test_plan_refuses_a_sample_longer_than_the_budget",
            "tests/test_token_budget.py::test_an_empty_dataset_or_no_step_is_an_error",
        ],
    ),
    (
        "data.md",
        "is an error naming the sample and both counts",
        ["tests/test_token_budget.py::test_an_under_reported_length_is_an_error_naming_the_sample"],
    ),
    (
        "data.md",
        "a batch that would then exceed `N` is an error naming the sample",
        ["tests/test_token_budget.py::test_a_replacement_record_keeps_the_row_within_the_budget"],
    ),
    (
        "data.md",
        "a record the builder refuses",
        ["tests/test_chat_lengths.py::test_a_cut_the_builder_refuses_is_built_not_counted"],
    ),
    (
        "data.md",
        "(`packing: true` alone, samples attending to each other, is refused)",
        ["tests/test_hf_data.py::test_config_errors_name_the_file_and_key"],  # basic_parameters.packing
    ),
    (
        "diffusion.md",
        "and `migrate` still refuses the launch script (`feature-extraction`)",
        ["tests/test_mindspeed_corpus.py::test_each_refusal_names_its_file_and_a_documented_reason"],
    ),
    (
        "diffusion.md",
        "tasks are refused by name",
        ["tests/test_extract_features.py::test_existing_outputs_and_other_tasks_are_refused_before_any_work"],
    ),
    (
        "diffusion.md",
        "A first feature file without `vace_context` is an error naming the file and the key",
        [
            "tests/test_wan_vace.py::test_vace_features_without_vace_context_are_an_error_naming_file_and_key",
            "tests/test_wan_vace.py::test_the_control_latents_reach_the_vace_model_and_only_it",
        ],
    ),
    (
        "diffusion.md",
        "a non-zero `initial_global_step_for_sampler` are refused",
        ["tests/test_wan_video.py::test_the_grouping_keys_are_checked"],
    ),
    (
        "hf-models.md",
        "is an error naming what to set",
        ["tests/test_derived_plan.py::test_models_the_derivation_cannot_decide_are_errors_naming_the_yaml_keys"],
    ),
    (
        "hf-models.md",
        "a batch that fails on one rank raises on that rank only",
        ["tests/test_batch_check.py::test_images_without_their_placeholders_are_an_error"],
    ),
    (
        "hf-models.md",
        "or context parallelism are refused with an error",
        [
            "tests/test_chunk_loss.py::test_context_parallelism_with_the_chunked_loss_is_refused",
            "tests/test_chunk_loss.py::test_bad_chunk_loss_config_is_named",  # logits_to_keep
        ],
    ),
    (
        "hf-models.md",
        "is an error naming the key, raised while the model is built",
        [
            "tests/test_lora.py::test_a_target_pattern_that_matches_nothing_is_an_error_naming_it",
            "tests/test_lora.py::test_adapters_under_a_frozen_module_are_an_error",
        ],
    ),
    (
        "hf-models.md",
        "`dcp-to-hf` refuses a checkpoint with adapters",
        ["tests/test_lora.py::test_dcp_to_hf_merge_lora_gives_the_trained_models_logits"],
    ),
    (
        "migration.md",
        "An unknown key or a missing file in the config is an error naming the key",
        [
            "tests/test_config.py::test_typo_is_an_error_that_suggests_the_key_and_names_the_file",
            "tests/test_config.py::test_missing_file_and_non_mapping",
        ],
    ),
    (
        "migration.md",
        "a target pattern that matches nothing is an error (not a warning)",
        ["tests/test_lora.py::test_a_target_pattern_that_matches_nothing_is_an_error_naming_it"],
    ),
    (
        "migration.md",
        "a bad key is an error naming it (and the nearest valid key)",
        ["tests/test_native_route.py::test_bad_parallel_sections_are_errors_naming_the_key"],
    ),
    (
        "migration.md",
        "a bad one refuses the migration naming the key and file",
        ["tests/test_mindspeed_semantics.py::test_native_values_out_of_range_are_refused_naming_the_key"],
    ),
    (
        "migration.md",
        "or with a `save` URL, is refused",
        ["tests/test_native_route.py::test_lora_packing_async_save_and_hf_format_are_written_under_the_agreed_names"],
    ),
    (
        "migration.md",
        "or refuses before the first step with the arithmetic",
        [
            "tests/test_mindspeed_semantics.py::test_a_global_batch_that_another_world_size_cannot_keep_is_refused_with_the_arithmetic"
        ],
    ),
    (
        "migration.md",
        "so `MMDataModule` refuses at setup a provider DataLoader whose batch size differs",
        ["tests/test_migrate.py::test_a_provider_loader_with_another_batch_size_than_the_launch_is_refused"],
    ),
    (
        "migration.md",
        "`packing: true` alone (samples that attend to each other) is refused",
        ["tests/test_hf_data.py::test_config_errors_name_the_file_and_key"],
    ),
    (
        "migration.md",
        "another id is an error listing the known ones",
        ["tests/test_migrate_mindspeed.py::test_unknown_and_megatron_model_configs_are_clear_errors"],
    ),
    (
        "migration.md",
        "A Megatron-route family without a twin here is refused (`megatron-model`)",
        [
            "tests/test_migrate_mindspeed.py::test_unknown_and_megatron_model_configs_are_clear_errors",
            "tests/test_mindspeed_corpus.py::test_each_refusal_names_its_file_and_a_documented_reason",
        ],
    ),
    (
        "migration.md",
        "HunyuanVideo 1.5's prompt templates and LTX-2 are refused (`not-implemented`",
        ["tests/test_mindspeed_corpus.py::test_every_file_migrates_or_is_refused_as_expected"],
    ),
    (
        "migration.md",
        "**143 files migrate, 142 are refused.**",
        [
            "tests/test_mindspeed_corpus.py::test_every_file_migrates_or_is_refused_as_expected",
            "tests/test_mindspeed_corpus.py::test_each_refusal_names_its_file_and_a_documented_reason",
        ],
    ),
    (
        "npu.md",
        "which the accelerator refuses with that hint",
        ["tests/test_npu.py::test_npu_accelerator_and_trainer_wiring_with_the_fake_npu_backend"],
    ),
    (
        "parallelism.md",
        "loads by parameter name when their hyper-parameters agree",
        ["tests/test_expert_parallel.py::test_optimizer_state_loads_into_parameters_grouped_differently"],
    ),
    (
        "parallelism.md",
        "is refused by `lightning-mm plan` and at setup, naming the layer's class and module path",
        ["tests/test_context_parallel.py::test_gated_deltanet_models_are_accepted_other_stateful_layers_refused"],
    ),
    (
        "parallelism.md",
        "`trainer.predict` with `C > 1` is refused at setup",
        ["tests/test_context_parallel.py::test_predict_is_refused_before_any_batch"],
    ),
    (
        "parallelism.md",
        "or that sits inside another compiled one, is an error before training",
        ["tests/test_compile.py::test_compile_modules_that_cannot_work_are_errors_before_training"],
    ),
    (
        "parallelism.md",
        "another model with the key set is refused at setup naming the key",
        ["tests/test_vision_balance.py::test_a_model_without_a_grid_tower_is_refused_naming_the_key"],
    ),
    (
        "strategy.md",
        "An unknown key is an error that suggests the nearest one",
        ["tests/test_config.py::test_typo_is_an_error_that_suggests_the_key_and_names_the_file"],
    ),
    (
        "strategy.md",
        "a contradicting Trainer precision is an error",
        ["tests/test_plan.py::test_contradictory_precision_is_an_error"],
    ),
    (
        "strategy.md",
        "`StochasticWeightAveraging` is refused at setup",
        ["tests/test_conformance.py::test_swa_is_refused_sync_batchnorm_converts_and_the_store_listens_on_loopback"],
    ),
    (
        "strategy.md",
        "each rank raises `lightning_mm.core.finite.NonFiniteError`",
        [
            "tests/test_finite.py::test_a_nan_loss_stops_before_the_step_naming_it",
            "tests/test_finite.py::test_a_nan_loss_on_one_rank_stops_both_ranks_non_zero_naming_step_and_rank",
        ],
    ),
    (
        "strategy.md",
        "A typo in a key is an error that suggests the right key",
        ["tests/test_config.py::test_typo_is_an_error_that_suggests_the_key_and_names_the_file"],
    ),
    (
        "strategy.md",
        "A pattern or index that matches no module is an error listing the closest existing paths",
        [
            "tests/test_patterns.py::test_typo_is_an_error_with_closest_paths",
            "tests/test_patterns.py::test_out_of_range_index_is_an_error_with_closest_paths",
        ],
    ),
    (
        "strategy.md",
        "`pin_memory` without `offload_to_cpu` is an error",
        [
            "tests/test_config.py::test_bad_values_name_the_key",  # {"pin_memory": True}
            "tests/test_config.py::test_sharding_size_must_divide_world",
        ],
    ),
    (
        "strategy.md",
        "a recomputed module with running statistics (BatchNorm) is an error before training",
        ["tests/test_recompute.py::test_a_recomputed_module_with_running_statistics_is_an_error_before_training"],
    ),
    (
        "strategy.md",
        "`bf16-mixed` with `param_dtype: fp16`) is an error",
        ["tests/test_plan.py::test_contradictory_precision_is_an_error"],
    ),
    (
        "migration.md",
        "A parameter that nothing initialises is an error naming it",
        ["tests/test_doc_refusals.py::test_a_meta_tensor_nothing_initialises_is_an_error_naming_it"],
    ),
    (
        "strategy.md",
        "anything left uninitialised is an error naming it",
        ["tests/test_doc_refusals.py::test_a_meta_tensor_nothing_initialises_is_an_error_naming_it"],
    ),
    (
        "migration.md",
        "`lightning-mm fit` refuses, before any weight is read, to resume a checkpoint of another model",
        ["tests/test_doc_refusals.py::test_resuming_another_models_checkpoint_is_refused_naming_both"],
    ),
    (
        "data.md",
        "Another plan (other lengths, seed, budget, buffer or packing) is refused",
        ["tests/test_doc_refusals.py::test_a_resume_under_another_token_budget_plan_is_refused"],
    ),
    (
        "data.md",
        "`qwen3_6_nothink` is refused",
        ["tests/test_doc_refusals.py::test_tool_turns_and_the_qwen3_6_nothink_template_are_refused"],
    ),
    (
        "parallelism.md",
        "is refused at the call",
        ["tests/test_doc_refusals.py::test_a_balanced_tower_called_with_tensor_arguments_or_other_outputs_is_refused"],
    ),
    (
        "cli.md",
        "every error lightning-mm raises for bad input is a `lightning_mm.errors.LightningMMError`",
        [
            "tests/test_error_family.py::test_every_exception_class_derives_from_lightning_mm_error",
            "tests/test_error_family.py::test_the_documented_example_is_true",
            "tests/test_error_family.py::test_one_checkpoint_error_hierarchy",
        ],
    ),
    (
        "cli.md",
        "A MindSpeed MM file given as `--config`",
        ["tests/test_plan_command.py::test_plan_refuses_a_mindspeed_file_and_says_to_migrate_it"],
    ),
    (
        "migration.md",
        "`lightning-mm plan --config` refuses a MindSpeed MM file with the `migrate` command to run first",
        ["tests/test_plan_command.py::test_plan_refuses_a_mindspeed_file_and_says_to_migrate_it"],
    ),
    (
        "migration.md",
        "`launch_kinds` / `refusals` (what is refused and why)",
        [
            "tests/test_mindspeed_corpus.py::test_every_file_migrates_or_is_refused_as_expected",
            "tests/test_mindspeed_corpus.py::test_each_refusal_names_its_file_and_a_documented_reason",
        ],
    ),
    (
        "migration.md",
        "and `plan` refuses it by name",
        ["tests/test_mindspeed_corpus.py::test_module_path_rules_name_modules_of_the_transformers_class"],
    ),
    (
        "diffusion.md",
        "a video outside its folder is refused",
        ["tests/test_extract_features.py::test_existing_outputs_and_other_tasks_are_refused_before_any_work"],
    ),
    (
        "diffusion.md",
        "`norm_latents: false` or `do_sample: true` is an error",
        ["tests/test_doc_refusals.py::test_extract_features_refuses_latents_it_does_not_compute"],
    ),
    (
        "diffusion.md",
        "No output file is overwritten: an existing one is refused",
        ["tests/test_extract_features.py::test_existing_outputs_and_other_tasks_are_refused_before_any_work"],
    ),
    (
        "diffusion.md",
        "and two records with the same caption (one feature file) are refused, naming the file, line and key",
        ["tests/test_vace_features.py::test_bad_vace_records_and_configs_are_refused_before_any_work"],
    ),
    (
        "diffusion.md",
        "The launch script stays refused by `migrate` (`feature-extraction`), which names this command",
        ["tests/test_vace_features.py::test_migrate_names_the_command_for_mindspeeds_vace_feature_extraction_launch"],
    ),
    (
        "parallelism.md",
        "`hybrid_cp_algo` is refused",
        [
            "tests/test_context_parallel.py::test_algorithm_names_and_the_yaml_key",
            "tests/test_context_parallel.py::test_native_ring_attention_size_maps_to_kv_allgather",
        ],
    ),
    (
        "parallelism.md",
        "Ulysses with TP needs each rank's heads",
        [
            "tests/test_tensor_parallel.py::test_context_parallel_groups_with_tensor_parallelism_and_ulysses_heads_per_rank"
        ],
    ),
    (
        "parallelism.md",
        "Without EP a model plan that splits experts is refused",
        ["tests/test_tensor_parallel.py::test_refuses_moe_experts_without_expert_parallelism"],
    ),
    (
        "parallelism.md",
        "Refused by name (`tensor_parallel_size`): an output layer",
        [
            "tests/test_tensor_parallel.py::test_refuses_what_the_vocabulary_parallel_loss_cannot_split",
            "tests/test_tensor_parallel.py::test_refused_before_compute",
        ],
    ),
    (
        "parallelism.md",
        "DoRA and adapter dropout are refused",
        ["tests/test_tensor_parallel.py::test_refuses_lora_settings_that_cannot_follow_the_split"],
    ),
    (
        "parallelism.md",
        "a `sequence_parallel` module must lie in a decoder layer",
        [
            "tests/test_tensor_parallel.py::test_refuses_an_incomplete_sequence_parallel_plan",
            "tests/test_doc_refusals.py::test_a_sequence_that_tensor_parallelism_cannot_split_is_refused_naming_the_key",
            "tests/test_tensor_parallel.py::test_refuses_sequence_parallelism_with_experts_or_lora",
        ],
    ),
]

GAPS: list[tuple[str, str, str]] = [
    # (page, fragment, what is promised and why no test is named)
]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _promises() -> list[tuple[str, str]]:
    """(page, sentence) of every sentence of docs/*.md with a refusal word."""
    found = []
    for page in sorted(DOCS.glob("*.md")):
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z`(*\-])", _flat(page.read_text(encoding="utf-8"))):
            if PROMISE.search(sentence):
                found.append((page.name, sentence))
    return found


def _entries() -> list[tuple[str, str]]:
    return [(page, fragment) for page, fragment, _ in REFUSALS] + [(page, fragment) for page, fragment, _ in GAPS]


@pytest.mark.parametrize(("page", "sentence"), _promises(), ids=lambda v: v[:60] if isinstance(v, str) else v)
def test_every_promised_refusal_has_an_entry(page: str, sentence: str) -> None:
    assert any(p == page and fragment in sentence for p, fragment in _entries()), (
        f"docs/{page}: a sentence promises a refusal but REFUSALS names no test for it: {sentence[:300]!r}"
    )


@pytest.mark.parametrize(("page", "fragment"), _entries())
def test_each_fragment_is_in_a_promising_sentence_of_its_page(page: str, fragment: str) -> None:
    assert any(p == page and fragment in sentence for p, sentence in _promises()), (
        f"docs/{page} no longer has a refusal sentence containing {fragment!r}: update REFUSALS"
    )


def _defined_tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def test_every_named_test_exists() -> None:
    missing = []
    for _, _, nodes in REFUSALS:
        assert nodes
        for node in nodes:
            file, _, name = node.partition("::")
            path = ROOT / file
            if not path.is_file() or name.split("[")[0] not in _defined_tests(path):
                missing.append(node)
    assert missing == []


def test_the_gaps_only_shrink() -> None:
    assert len(GAPS) == 0


# ------------------------------------------------------------------------- small checks for promises without a test
def test_a_meta_tensor_nothing_initialises_is_an_error_naming_it() -> None:
    import torch
    from torch import nn

    from lightning_mm.core.apply import MaterializationError, materialize_and_init

    class Scale(nn.Module):  # no reset_parameters: nothing initialises `gain`
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.empty(3))

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3), Scale())
    cpu = torch.device("cpu")
    with pytest.raises(
        MaterializationError, match=r"1 tensor\(s\) built on the meta device were not initialised: 1.gain"
    ):
        materialize_and_init(model, model, cpu, cpu)


def test_resuming_another_models_checkpoint_is_refused_naming_both(tmp_path: Path) -> None:
    import json

    from lightning_mm.commands.train import IDENTITY_KEY, check_model_identity, model_identity
    from lightning_mm.errors import ConfigError

    def config(layers: int) -> dict:
        directory = tmp_path / f"m{layers}"
        directory.mkdir()
        (directory / "config.json").write_text(
            json.dumps({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_hidden_layers": layers})
        )
        return {"init_args": {"transformers_model": {"init_from_hf_path": str(directory)}}}

    saved, current = config(2), config(4)
    checkpoint = {IDENTITY_KEY: model_identity(saved)}
    check_model_identity("c.ckpt", checkpoint, saved)  # the same model resumes
    with pytest.raises(ConfigError, match=r"num_hidden_layers 2.*num_hidden_layers 4.*another model's checkpoint"):
        check_model_identity("c.ckpt", checkpoint, current)


def test_a_resume_under_another_token_budget_plan_is_refused() -> None:
    from lightning_mm.core.token_budget_plan import TokenBudgetError
    from lightning_mm.datamodules.token_budget_loader import TokenBudgetLoader

    def loader(seed: int = 0, max_tokens: int = 8) -> TokenBudgetLoader:
        lengths = [3, 5, 2, 4, 6, 1]
        options = dict(buffer_size=4, shuffle=True, packing=True, drop_last=False, world_size=1, rank=0)
        return TokenBudgetLoader(list(range(6)), lengths, max_tokens, seed=seed, collate_fn=list, **options)

    state = loader().state_dict()
    loader().load_state_dict(state)  # the same plan resumes
    for other in (loader(seed=1), loader(max_tokens=9)):
        with pytest.raises(TokenBudgetError, match="token-budget batch plan differs from this run's"):
            other.load_state_dict(state)


def test_tool_turns_and_the_qwen3_6_nothink_template_are_refused() -> None:
    from lightning_mm.hf.chat_samples import template_for
    from lightning_mm.mindspeed.chat_dataset import ChatAttr, _turns

    attr = ChatAttr(
        "messages", "from", "value", "human", "gpt", "observation", "function_call", "system", None, None, None
    )
    turns = [{"from": "human", "value": "hi"}, {"from": "function_call", "value": "{}"}]
    with pytest.raises(ValueError, match=r"turn 2: role 'function_call' \(a tool turn\) is not supported"):
        _turns({"messages": turns}, attr)
    assert template_for("qwen3_6", "qwen3_5") is not None
    with pytest.raises(
        ValueError, match="template 'qwen3_6_nothink' is a MindSpeed MM template for a family not built"
    ):
        template_for("qwen3_6_nothink", "qwen3_5")


def test_a_balanced_tower_called_with_tensor_arguments_or_other_outputs_is_refused() -> None:
    """Both refusals come before any collective, so one process checks them."""
    import torch
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    from lightning_mm.hf.vision_tower_balance import VisionBalanceError, _balanced, _send_back

    tower = _balanced(lambda *args, **kwargs: None, None)  # type: ignore[arg-type]
    with pytest.raises(VisionBalanceError, match=r"called with tensor arguments \['pixel_mask'\]"):
        tower(torch.zeros(4, 3), torch.tensor([[1, 2, 2]]), pixel_mask=torch.ones(1))
    with pytest.raises(VisionBalanceError, match="returned tuple, not a Transformers ModelOutput"):
        _send_back((torch.zeros(1, 3),), None, [], True, 2, None)  # type: ignore[arg-type]
    out = BaseModelOutputWithPooling(last_hidden_state=torch.zeros(4, 3), attentions=(torch.zeros(1, 4, 4),))
    with pytest.raises(VisionBalanceError, match="output `attentions` is not one of the merged per-image features"):
        _send_back(out, None, [], True, 2, None)  # type: ignore[arg-type]


def test_extract_features_refuses_latents_it_does_not_compute() -> None:
    """docs/diffusion.md: ``norm_latents: false`` or ``do_sample: true`` is an error (the latents differ)."""
    from lightning_mm.errors import ConfigError
    from lightning_mm.mindspeed.feature_launch import check_ae_keys

    check_ae_keys({"norm_latents": True, "do_sample": False}, "model.json")
    for key, value in (("norm_latents", False), ("do_sample", True)):
        with pytest.raises(ConfigError, match=rf"`ae.{key}`"):
            check_ae_keys({key: value}, "model.json")


def test_a_sequence_that_tensor_parallelism_cannot_split_is_refused_naming_the_key() -> None:
    """docs/parallelism.md: under sequence parallelism the sequence length must divide by ``tensor_parallel_size``."""
    import torch
    from torch import nn

    from lightning_mm.core.tensor_parallel import TensorParallelError, _check_sequence

    check = _check_sequence("model.layers.0.input_layernorm", 2)
    check(nn.Identity(), (torch.zeros(1, 4, 8),))
    with pytest.raises(TensorParallelError, match="must divide by tensor_parallel_size 2"):
        check(nn.Identity(), (torch.zeros(1, 3, 8),))

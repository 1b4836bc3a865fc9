"""The Megatron route: a launch (its flags, or MindSpeed MM's single YAML) mapped onto a LightningCLI config.

The flags go through :data:`lightning_mm.mindspeed.flags.FLAGS`; the model.json (``--mm-model``), the data config
(``--mm-data``), LoRA and the launcher's process counts are mapped here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_mm.mindspeed.files import load_config_file, load_yaml
from lightning_mm.mindspeed.flags import (
    FLAGS,
    GLOBAL_BATCH,
    MINDSPEED_ENTRY_SCRIPTS,
    SEED_FUNCTIONS,
    TRANSFORMERS_MODULE,
    FlagState,
    defined_functions,
    map_encoder_dp_balance,
    map_load,
    module_path,
    set_path,
)
from lightning_mm.mindspeed.keys import MindSpeedConfigError
from lightning_mm.mindspeed.launch_script import UNEVALUATED, Launch
from lightning_mm.mindspeed.megatron_launcher import map_launcher
from lightning_mm.mindspeed.megatron_lora import map_lora, read_lora_args
from lightning_mm.mindspeed.report import MigrationReport

__all__ = ["migrate", "migrate_yaml"]


def migrate(
    launch: Launch,
    base_dir: Path | None = None,
    import_root: Path | None = None,
    keep_backend: bool = False,
    single_yaml: tuple[Path, Mapping[str, Any]] | None = None,
    hf_path: Path | None = None,
) -> MigrationReport:
    """Map a launch onto a LightningCLI config; everything not mapped is listed with the reason.

    Relative paths in the launch are taken from ``base_dir`` (the launch directory: by default the working
    directory) and written as absolute paths, so that the config works wherever it is written. The entry script's
    functions are named by their import path from ``import_root`` (default: the working directory when the script
    lies below it, else the script's folder): LightningCLI resolves class paths from the directory it runs in.
    ``--distributed-backend`` is left to the accelerator (nccl, hccl or gloo) unless ``keep_backend``.
    ``single_yaml`` is MindSpeed MM's single YAML (its path and content): its ``gpt_args`` replace the launch's
    training flags, as MindSpeed MM's ``read_yaml_config.py`` does, and its ``data`` / ``model`` sections are used.
    """
    cfg: dict[str, Any] = {
        "trainer": {},
        "model": {"class_path": "lightning_mm.MMLightningModule", "init_args": {}},
        "data": {"class_path": "lightning_mm.MMDataModule", "init_args": {}},
    }
    state = FlagState(cfg, MigrationReport(cfg), {}, Path.cwd() if base_dir is None else Path(base_dir), keep_backend)
    if hf_path is not None:
        state.values["hf_path"] = Path(hf_path).resolve()
    world = map_launcher(state, launch)
    functions = _map_entry_script(state, launch, import_root)
    flags = [(flag, value, f"{flag} {value}" if value is not None else flag) for flag, value in launch.flags]
    if single_yaml is not None:
        for _, _, shown in flags:
            state.out.unmapped.append(
                f"{shown}: after the YAML on the launch line, which MindSpeed MM ignores too "
                "(its read_yaml_config.py rebuilds the command line from gpt_args)"
            )
        flags = _map_single_yaml(state, *single_yaml)
    flags = _join_list_values(flags)
    for flag, value, shown in flags:
        handler = FLAGS.get(flag)
        if value is not None and UNEVALUATED in value:
            state.out.unmapped.append(
                f"{shown}: its value comes from shell that migrate does not run (see the notes); set it by hand"
            )
            continue
        if handler is None:
            state.out.unmapped.append(f"{shown}: unknown to lightning-mm migrate")
            continue
        try:
            handler(state, flag, value, shown)
        except MindSpeedConfigError as err:  # a value out of its range: the job cannot run as written
            raise MindSpeedConfigError(f"{shown}: {err}") from None
        except ValueError as err:  # not a number (e.g. a shell variable the reader could not evaluate)
            state.out.unmapped.append(f"{shown}: {err}")
    _map_combined(state, world)
    map_encoder_dp_balance(state)
    _map_dynamic_batching(state)
    _map_checkpointing(state)
    _map_model(state, launch, functions)
    map_lora(state)
    map_load(state)
    _map_data(state, launch, functions)
    for name in launch.env:
        if name in ("CUDA_DEVICE_MAX_CONNECTIONS",):
            state.out.unmapped.append(f"{name}: Megatron tuning variable, not needed by FSDP2")
    return state.out


def migrate_yaml(path: Path, base_dir: Path | None = None, keep_backend: bool = False) -> MigrationReport:
    """MindSpeed MM's single YAML (``gpt_args``, ``data``, ``model``) given by itself; relative paths in it are
    taken from ``base_dir`` (the launch directory, by default the working directory), as MindSpeed MM does."""
    return migrate(Launch(), base_dir=base_dir, keep_backend=keep_backend, single_yaml=(path, load_yaml(path)))


_YAML_SECTIONS = ("gpt_args", "lora_args", "data", "model", "MM_TOOL_PATH")


def _flatten_gpt_args(node: Mapping[str, Any], section: str) -> list[tuple[str, Any]]:
    """``gpt_args`` as MindSpeed MM flattens them: nested mappings dissolved, leaves kept, later keys winning."""
    items: dict[str, Any] = {}

    def walk(value: Mapping[str, Any]) -> None:
        for key, item in value.items():
            if isinstance(item, Mapping):
                walk(item)
            else:
                items.pop(str(key), None)
                items[str(key)] = item

    walk(node)
    return list(items.items())


def _map_single_yaml(state: FlagState, path: Path, config: Mapping[str, Any]) -> list[tuple[str, str | None, str]]:
    """The sections of MindSpeed MM's single YAML: ``gpt_args`` as flags (returned), ``data`` and ``model`` kept
    for :func:`_map_data` / :func:`_map_model`, every other key reported."""
    out = state.out
    gpt_args = config.get("gpt_args")
    if not isinstance(gpt_args, Mapping):
        raise MindSpeedConfigError(
            f"{path}: no `gpt_args` mapping; MindSpeed MM's single YAML has gpt_args, data and model sections"
        )
    flags: list[tuple[str, str | None, str]] = []
    for key, value in _flatten_gpt_args(gpt_args, "gpt_args"):
        flag = "--" + key.replace("_", "-")
        shown = f"gpt_args.{key}: {value}"
        if value is True:
            flags.append((flag, None, shown))
        elif value is False or value is None:
            out.notes.append(f"{shown}: off / unset, nothing to map")
        elif isinstance(value, list):
            flags += [(flag, str(item), f"{shown} [{i}]") for i, item in enumerate(value)]
        else:
            flags.append((flag, str(value), shown))
    if "data" in config:
        state.values["mm_data"] = (f"{path.name} data:", path)
    if "model" in config:
        state.values["mm_model"] = (f"{path.name} model:", path, config["model"])
    if "lora_args" in config:
        read_lora_args(state, f"{path}: ", config["lora_args"])
    if "MM_TOOL_PATH" in config:
        out.unmapped.append(
            f"MM_TOOL_PATH {config['MM_TOOL_PATH']} (--mm-tool): MindSpeed MM's tool definitions for "
            "its chat templates; not read by lightning-mm"
        )
    for key, value in config.items():
        if key in _YAML_SECTIONS:
            continue
        if isinstance(value, (Mapping, list)):
            out.unmapped.append(
                f"{path.name}: top-level section `{key}`: unknown to MindSpeed MM and to lightning-mm migrate"
            )
        else:
            out.notes.append(
                f"{path.name}: top-level `{key}: {value}`: MindSpeed MM reads no such key (values like "
                "this one are used through YAML anchors); nothing to map"
            )
    return flags


# MindSpeed MM's Megatron-route LoRA (mindspeed_mm/arguments.py `_add_lora_args`, tasks/finetune/lora/lora_patch.py:
# PEFT's LoraConfig(r, lora_alpha, target_modules, lora_dropout, bias="none")) -> the lora block of TransformersModel.
def _map_entry_script(state: FlagState, launch: Launch, import_root: Path | None) -> set[str]:
    """The seed functions the entry script defines, named by import path; returns their names.

    MindSpeed MM's own entry script (``pretrain_transformers.py``, or one whose ``model_provider`` builds
    ``TransformersModel`` from ``args.mm.model`` and whose provider calls ``build_mm_dataset``) reads Megatron's
    globals: those functions are replaced by lightning-mm's built-ins instead of being named.
    """
    cfg, out = state.cfg, state.out
    if not launch.script:
        return set()
    script = state.path_of(launch.script)
    defined = defined_functions(script)
    if import_root is None:
        import_root = Path.cwd() if script.is_relative_to(Path.cwd().resolve()) else script.parent
    out.import_root = Path(import_root).resolve()
    module = module_path(script, out.import_root) if script.is_relative_to(out.import_root) else script.stem
    if Path(launch.script).name in MINDSPEED_ENTRY_SCRIPTS:
        state.values["builtin_model"] = state.values["builtin_data"] = True
        out.import_root = None
        out.notes.append(
            f"{launch.script}: MindSpeed MM's own entry script; its model_provider, forward_step and "
            "datasets provider become lightning-mm's module for the model config (MMTransformersModule, or "
            "MMWanModule / MMHunyuan15Module for a Wan / HunyuanVideo 1.5 model.json) and MMDataModule(data_config)"
        )
        return set()
    if defined is None:
        out.import_root = None
        out.unmapped.append(
            f"{launch.script}: entry script not found ({script}); add "
            "model.init_args.model_provider / forward_step by hand"
        )
        return set()
    functions = set(defined) & set(SEED_FUNCTIONS)
    if "forward_step" in functions:  # forward_step calls get_batch and returns loss_func itself
        functions -= {"get_batch", "loss_func"}
    if "TransformersModel" in defined.get("model_provider", set()) and "mm" in defined["model_provider"]:
        state.values["builtin_model"] = True  # TransformersModel(args.mm.model): the model config is used
        functions.discard("model_provider")
        out.notes.append(
            f"{launch.script}: model_provider builds TransformersModel from --mm-model; the model "
            "config is written instead"
        )
    provider = defined.get("train_valid_test_datasets_provider", set())
    if "build_mm_dataset" in provider:
        state.values["builtin_data"] = True  # MindSpeed MM's dataset from --mm-data: MMDataModule(data_config)
        functions.discard("train_valid_test_datasets_provider")
        out.notes.append(
            f"{launch.script}: train_valid_test_datasets_provider builds MindSpeed MM's dataset from "
            "--mm-data; MMDataModule(data_config) reads that file instead"
        )
    for fn in sorted(functions, key=list(SEED_FUNCTIONS).index):
        set_path(cfg, SEED_FUNCTIONS[fn], f"{module}.{fn}")
        out.mapped.append(f"{launch.script}: {fn} -> {SEED_FUNCTIONS[fn]} = {module}.{fn}")
    if functions:
        out.notes.append(
            f"the entry script's functions are imported as `{module}`: run lightning-mm from "
            f"{out.import_root} (remove Megatron globals such as get_args() from them)"
        )
    else:
        out.import_root = None
    if "model_provider" not in functions and not state.values.get("builtin_model"):
        out.unmapped.append(
            f"{launch.script}: defines no `model_provider`; set {SEED_FUNCTIONS['model_provider']} by hand"
        )
    return functions


def _map_combined(state: FlagState, world: int | None) -> None:
    """Flags that become one key together: Adam betas, the warmup fraction, the global batch size."""
    cfg, out, values = state.cfg, state.out, state.values
    if "--adam-beta1" in values or "--adam-beta2" in values:
        set_path(cfg, "model.init_args.betas", [values.get("--adam-beta1", 0.9), values.get("--adam-beta2", 0.999)])
        out.mapped.append("--adam-beta1/--adam-beta2 -> model.init_args.betas")
    if "warmup_fraction" in values:
        if "train_iters" in values:
            set_path(cfg, "model.init_args.warmup_steps", round(values["warmup_fraction"] * values["train_iters"]))
            out.mapped.append("--lr-warmup-fraction -> model.init_args.warmup_steps (fraction x train-iters)")
        else:
            out.unmapped.append("--lr-warmup-fraction: needs --train-iters to become a step count")
    if "gbs" in values:
        mbs = values.get("mbs", 1)
        gbs = values["gbs"]
        _add_callback(cfg, {"class_path": GLOBAL_BATCH, "init_args": {"global_batch_size": gbs}})
        out.mapped.append(
            f"--global-batch-size {gbs} -> trainer.callbacks: GlobalBatchSize({gbs}) (the accumulation is derived "
            "from it at fit for the world size the run has: gbs / (micro batch x data-parallel ranks))"
        )
        cp = values.get("cp", 1)
        if world:
            from lightning_mm._utils.global_batch_math import accumulation_for
            from lightning_mm.errors import ConfigError

            try:
                accumulate = accumulation_for(gbs, mbs, world, cp if world % cp == 0 else 1)
            except ConfigError as err:  # MindSpeed MM refuses the launch too
                raise MindSpeedConfigError(f"--global-batch-size {gbs}: {err}") from None
            set_path(cfg, "trainer.accumulate_grad_batches", accumulate)
            out.mapped.append(
                f"--global-batch-size {gbs} -> trainer.accumulate_grad_batches {accumulate} at the launch's "
                f"{world} ranks ({gbs} / ({mbs} x {world // (cp if world % cp == 0 else 1)} data-parallel ranks))"
            )


def _add_callback(cfg: dict[str, Any], callback: dict[str, Any]) -> None:
    cfg.setdefault("trainer", {}).setdefault("callbacks", []).append(callback)


def _drop_global_batch(state: FlagState, why: str) -> None:
    """Token-budget batches have no fixed sample count: the global batch size cannot be kept; say so."""
    callbacks = state.cfg["trainer"].get("callbacks") or []
    kept = [c for c in callbacks if c.get("class_path") != GLOBAL_BATCH]
    if len(kept) == len(callbacks):
        return
    state.cfg["trainer"]["callbacks"] = kept
    state.cfg["trainer"].pop("accumulate_grad_batches", None)
    state.out.mapped = [m for m in state.out.mapped if not m.startswith("--global-batch-size")]
    state.out.unmapped.append(
        f"--global-batch-size {state.values['gbs']}: {why}: a batch holds a token budget, not a number of samples; "
        "set trainer.accumulate_grad_batches"
    )


def _map_dynamic_batching(state: FlagState) -> None:
    """MindSpeed MM's Megatron-route dynamic batching (samples concatenated up to ``--max-seq-len`` tokens, chosen
    from a buffer of ``--dynamic-batch-buffer-size``) -> MMDataModule's packed token-budget batches."""
    out, values = state.out, state.values
    sizes = [f for f in ("max_seq_len", "dynamic_batch_buffer_size") if f in values]
    if "dynamic_batching" not in values:
        out.unmapped += [
            f"--{f.replace('_', '-')} {values[f]}: used only with --use-txt-dynamic-batching" for f in sizes
        ]
        return
    if "max_seq_len" not in values:
        out.unmapped.append(
            "--use-txt-dynamic-batching: needs --max-seq-len (the tokens of one packed row); set "
            "data.init_args.max_tokens_per_rank by hand"
        )
        return
    set_path(state.cfg, "data.init_args.packing", True)
    set_path(state.cfg, "data.init_args.max_tokens_per_rank", values["max_seq_len"])
    out.mapped += [
        "--use-txt-dynamic-batching -> data.init_args.packing: True",
        f"--max-seq-len {values['max_seq_len']} -> data.init_args.max_tokens_per_rank",
    ]
    if "dynamic_batch_buffer_size" in values:
        set_path(state.cfg, "data.init_args.packing_buffer_size", values["dynamic_batch_buffer_size"])
        out.mapped.append(
            f"--dynamic-batch-buffer-size {values['dynamic_batch_buffer_size']} -> data.init_args.packing_buffer_size"
        )
    _drop_global_batch(state, "with dynamic batching")
    batch_size = state.cfg.get("data", {}).get("init_args", {}).pop("batch_size", None)
    if batch_size is not None:
        out.mapped = [m for m in out.mapped if not m.startswith("--micro-batch-size")]
        out.notes.append(
            f"--micro-batch-size {batch_size}: not used with dynamic batching (a batch holds as many "
            "samples as fit in --max-seq-len tokens, as in MindSpeed MM)"
        )


def _map_checkpointing(state: FlagState) -> None:
    """--save / --save-interval / --load: a ModelCheckpoint callback and ``ckpt_path``."""
    cfg, out, values = state.cfg, state.out, state.values
    if "save" not in values and "save_interval" not in values:
        return
    # "link": last.ckpt points at the newest checkpoint instead of being a second full copy of it
    checkpoint: dict[str, Any] = {"save_last": "link"}
    if values.get("save"):
        checkpoint["dirpath"] = str(state.path_of(values["save"]))
    if values.get("save_interval"):
        checkpoint["every_n_train_steps"] = values["save_interval"]
    callback = {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint", "init_args": checkpoint}
    _add_callback(cfg, callback)
    out.mapped.append(
        "--save/--save-interval -> trainer.callbacks: ModelCheckpoint(dirpath, every_n_train_steps, save_last: link)"
    )


def _map_model(state: FlagState, launch: Launch, functions: set[str]) -> None:
    """--mm-model (or the single YAML's ``model:``): a TransformersModel config, unless the entry script's own
    model_provider is used."""
    out = state.out
    if "mm_model" not in state.values:
        if state.values.get("builtin_model"):
            out.unmapped.append("no --mm-model (model.json): set model.init_args.transformers_model by hand")
        _note_ignored_modules(state)
        return
    shown, path, section = state.values["mm_model"]
    if "model_provider" in functions:
        out.unmapped.append(
            f"{shown}: read by the entry script's model_provider, which is used instead; build "
            "TransformersModel in it, or drop model_provider and give the model config "
            "(docs/migration.md)"
        )
        return
    if section is None:
        if not path.is_file():
            out.unmapped.append(f"{shown}: {path} does not exist; set model.init_args.transformers_model by hand")
            return
        section = load_config_file(path)
    from lightning_mm.mindspeed.diffusion import is_diffusion_model
    from lightning_mm.mindspeed.model_config import MindSpeedModelError, transformers_model_config

    source = f"{path} (model)" if path.suffix.lower() in (".yaml", ".yml") else str(path)
    if is_diffusion_model(section):  # LoRA flags: map_lora
        _map_diffusion_model(state, shown, section, source)
        return
    hf_dir, origin = _hf_dir(state)
    try:
        converted = transformers_model_config(
            section, source, state.base, hf_dir=hf_dir, hf_dir_origin=origin, hf_dir_overrides=origin == "--hf-path"
        )
    except MindSpeedModelError as err:
        if not err.megatron:
            raise
        from lightning_mm.mindspeed.refusals import Refused

        raise Refused(source, "megatron-model", "its towers are MindSpeed MM's own Megatron modules") from None
    if "init_from_hf_path" not in section and state.values.get("load"):
        # a Megatron-route model.json: --load names MindSpeed MM's converted (Megatron-format) weights, which the
        # Transformers twin cannot read; it starts from the Hugging Face directory they were converted from
        state.cfg.pop("ckpt_path", None)
        out.mapped = [m for m in out.mapped if not m.startswith("--load ")]
        out.unmapped = [u for u in out.unmapped if not u.startswith("--load ")]
        out.notes.append(
            f"--load {state.values['load']}: MindSpeed MM's Megatron-format weights of its own towers; not read "
            "here: the Transformers twin starts from init_from_hf_path (the Hugging Face directory they were "
            "converted from); ckpt_path is not set (a resume is a checkpoint written here)"
        )
    model = state.cfg["model"]
    model["class_path"] = TRANSFORMERS_MODULE
    model["init_args"] = {"transformers_model": converted.config, **model["init_args"]}
    out.mapped.append(f"{shown} -> model: {TRANSFORMERS_MODULE} with transformers_model {converted.config}")
    out.mapped += [f"  {shown} {item}" for item in converted.mapped]
    out.notes += [f"{shown} {item} (not applicable)" for item in converted.not_applicable]
    out.unmapped += [f"{shown} {item}" for item in converted.unmapped]
    _map_module_paths(state, converted.family, converted.megatron)


def _map_module_paths(state: FlagState, family: str | None, megatron: bool) -> None:
    """The FSDP2 YAML's MindSpeed MM module paths in the Transformers class's names (:mod:`.module_paths`)."""
    from lightning_mm.mindspeed.module_paths import translate_fsdp2_config

    init_args = state.cfg["trainer"].get("strategy", {}).get("init_args", {})
    keys, mapped, unmapped = translate_fsdp2_config(init_args.get("fsdp2_config"), family, megatron)
    if keys is not None:
        init_args["fsdp2_config"] = keys
    state.out.mapped += mapped
    state.out.unmapped += unmapped
    _map_ignored_modules(state)


def _map_ignored_modules(state: FlagState) -> None:
    """The strategy's FSDP2 config (MindSpeed MM's FSDP2 YAML) of a Transformers model with MindSpeed MM's
    ``ignored_modules`` default stated (:mod:`.ignored_default`): this project's default plan, which would keep a
    frozen tower out of FSDP, is the Transformers models' (a custom model's default plan is empty)."""
    from lightning_mm.mindspeed.ignored_default import with_ignored_default

    init_args = state.cfg["trainer"].get("strategy", {}).get("init_args", {})
    if "fsdp2_config" not in init_args:
        return
    value, mapped, unmapped = with_ignored_default(init_args["fsdp2_config"])
    init_args["fsdp2_config"] = value
    state.out.mapped += mapped
    state.out.unmapped += unmapped


def _note_ignored_modules(state: FlagState) -> None:
    """No model config: the strategy's FSDP2 YAML is kept, with a note on ``ignored_modules``
    (:mod:`.ignored_default`)."""
    from lightning_mm.mindspeed.ignored_default import note_without_model

    note = note_without_model(state.cfg["trainer"].get("strategy", {}).get("init_args", {}).get("fsdp2_config"))
    if note is not None:
        state.out.notes.append(note)


_LIST_FLAGS = ("--lora-target-modules",)
"""Flags that take several values (``--lora-target-modules q_proj k_proj v_proj``)."""


def _join_list_values(flags: list[tuple[str, str | None, str]]) -> list[tuple[str, str | None, str]]:
    """The words after a list flag, up to the next ``--flag``, as one comma-separated value."""
    out: list[tuple[str, str | None, str]] = []
    for flag, value, shown in flags:
        if out and out[-1][0] in _LIST_FLAGS and value is None and not flag.startswith("--"):
            last, values, _ = out[-1]
            joined = f"{values},{flag}" if values else flag
            out[-1] = (last, joined, f"{last} {joined.replace(',', ' ')}")
            continue
        out.append((flag, value, shown))
    return out


def _hf_dir(state: FlagState) -> tuple[str | None, str]:
    """The Hugging Face directory the job names: ``migrate --hf-path``, else its data config's
    ``dataset_param.preprocess_parameters.model_name_or_path`` (the processor's directory, the model's too)."""
    if state.values.get("hf_path"):
        return str(state.values["hf_path"]), "--hf-path"
    data = state.values.get("mm_data")
    if data is None or not data[1].is_file():
        return None, ""
    try:
        content: Mapping[str, Any] = load_config_file(data[1])
    except MindSpeedConfigError:
        return None, ""
    if "data" in content and "dataset_param" not in content:
        content = content["data"] if isinstance(content["data"], Mapping) else {}
    params = (content.get("dataset_param") or {}).get("preprocess_parameters") or {}
    value = params.get("model_name_or_path") if isinstance(params, Mapping) else None
    if not isinstance(value, str) or not value.strip():
        return None, ""
    return value, f"{data[0]} dataset_param.preprocess_parameters.model_name_or_path {value}"


def _map_diffusion_model(state: FlagState, shown: str, section: Mapping[str, Any], source: str) -> None:
    """A Wan (or HunyuanVideo 1.5) model.json: MMWanModule (MMHunyuan15Module), the diffusers path, with the weights
    of ``--load`` / ``--hf-path``."""
    from lightning_mm.mindspeed.diffusion import wan_module_config
    from lightning_mm.mindspeed.hunyuan15 import HUNYUAN15_PREDICTOR, hunyuan15_module_config

    out, cfg = state.out, state.cfg
    weights, origin = None, ""
    if state.values.get("hf_path"):
        weights, origin = str(Path(state.values["hf_path"]).resolve()), "--hf-path"
    elif state.values.get("load"):
        weights, origin = str(state.path_of(state.values["load"])), f"--load {state.values['load']}"
        cfg.pop("ckpt_path", None)  # on this route --load names the weights to start from, not a resume
        out.mapped = [m for m in out.mapped if not m.startswith("--load ")]
        out.unmapped = [u for u in out.unmapped if not u.startswith("--load ")]
    try:
        hunyuan = section["predictor"].get("model_id") == HUNYUAN15_PREDICTOR
        converted = (hunyuan15_module_config if hunyuan else wan_module_config)(section, source, weights, origin)
    except ValueError as err:
        raise MindSpeedConfigError(str(err)) from None
    init_args = {**cfg["model"].get("init_args", {}), **converted.model["init_args"]}
    strategy_args = cfg["trainer"].get("strategy", {}).get("init_args", {})
    if "fsdp2_config" in strategy_args:  # MindSpeed MM's Wan YAMLs are read by MMWanModule (their paths mapped)
        init_args["fsdp2_config"] = strategy_args.pop("fsdp2_config")
        out.mapped = [
            m.replace("-> trainer.strategy.init_args.fsdp2_config", "-> model.init_args.fsdp2_config")
            if m.startswith("--fsdp2-config-path")
            else m
            for m in out.mapped
        ]
        out.notes.append(
            f"--fsdp2-config-path: given to {converted.model['class_path'].rsplit('.', 1)[1]}(fsdp2_config=...), "
            f"which reads MindSpeed MM's {'HunyuanVideo 1.5' if hunyuan else 'Wan'} YAMLs as written (predictor.* "
            "paths mapped to diffusers' names)"
        )
    cfg["model"] = {"class_path": converted.model["class_path"], "init_args": init_args}
    out.mapped += [f"{shown} {m}" for m in converted.mapped]
    out.notes += [f"{shown} {n}" for n in converted.notes]
    out.unmapped += [f"{shown} {u}" for u in converted.unmapped]


def _map_data(state: FlagState, launch: Launch, functions: set[str]) -> None:
    """--mm-data (or the single YAML's ``data:``) as MMDataModule's data_config, unless the entry script's own
    dataset provider reads it."""
    out = state.out
    provider = "train_valid_test_datasets_provider" in functions
    if "mm_data" in state.values:
        shown, data_path = state.values["mm_data"]
        if provider:
            out.unmapped.append(
                f"{shown}: read by the entry script's train_valid_test_datasets_provider, which is "
                "used instead; pass the file to it, or drop the provider to use the file as "
                "MMDataModule's data_config (docs/migration.md)"
            )
        elif data_path.is_file():
            set_path(state.cfg, "data.init_args.data_config", str(data_path))
            out.mapped.append(f"{shown} -> data.init_args.data_config ({data_path})")
            _map_neat_packing(state, shown, data_path)
            out.run_from = state.base
            out.notes.append(
                f"{shown}: relative paths inside it are taken from the directory lightning-mm runs in, "
                f"as MindSpeed MM takes them from its launch directory: run from {state.base}"
            )
        else:
            out.unmapped.append(
                f"{shown}: {data_path} does not exist and the entry script defines no "
                "train_valid_test_datasets_provider; set data.init_args by hand"
            )
    elif launch.script and not provider:
        out.unmapped.append(
            "no --mm-data and no train_valid_test_datasets_provider in the entry script; set data.init_args by hand"
        )
    if "mbs" in state.values and provider:
        out.notes.append(
            f"--micro-batch-size {state.values['mbs']} -> data.init_args.batch_size: the batch size of "
            "the Datasets the provider returns; a DataLoader it returns must have this batch size "
            "(MMDataModule checks it at setup), or the global batch would differ from "
            "--global-batch-size"
        )


def _map_neat_packing(state: FlagState, shown: str, data_path: Path) -> None:
    """``neat_packing`` in the data config: MMDataModule packs rows of ``cutoff_len`` tokens (a token budget), which
    excludes a batch size, so ``--micro-batch-size`` is not written (MindSpeed MM packs to cutoff_len too)."""
    try:
        data = load_yaml(data_path)
    except MindSpeedConfigError:
        return  # MMDataModule reads the file and names what is wrong with it
    if isinstance(data.get("data"), Mapping):  # a single YAML's data: section
        data = data["data"]
    dataset = data.get("dataset_param")
    basic = dataset.get("basic_parameters") if isinstance(dataset, Mapping) else None
    if not (isinstance(basic, Mapping) and basic.get("neat_packing") is True):
        return
    state.out.mapped.append(
        f"{shown} dataset_param.basic_parameters.neat_packing, cutoff_len -> MMDataModule packing with "
        "max_tokens_per_rank = cutoff_len (read from the data config)"
    )
    _drop_global_batch(state, "with neat_packing")
    batch_size = state.cfg["data"]["init_args"].pop("batch_size", None)
    if batch_size is not None:
        state.out.mapped = [m for m in state.out.mapped if not m.endswith("-> data.init_args.batch_size")]
        state.out.notes.append(
            f"--micro-batch-size {batch_size}: not written: a packed batch holds cutoff_len tokens per rank "
            "(MMDataModule's batch_size and max_tokens_per_rank are exclusive)"
        )

"""The script route: a MindSpeed MM launch script read (:mod:`lightning_mm.mindspeed.launch_script`), refused for a
named reason or run through the route its entry script and YAML select (Megatron or native).
"""

from __future__ import annotations

from pathlib import Path

from lightning_mm.mindspeed.files import load_config_file
from lightning_mm.mindspeed.flags import FlagState
from lightning_mm.mindspeed.keys import MindSpeedConfigError
from lightning_mm.mindspeed.launch_script import Launch, parse_script, read_text_file
from lightning_mm.mindspeed.megatron_launcher import map_launcher
from lightning_mm.mindspeed.megatron_route import migrate
from lightning_mm.mindspeed.report import MigrationReport

__all__ = ["migrate_script"]

_PATH_FLAGS = ("--mm-data", "--mm-model", "--fsdp2-config-path")


def _launch_dir(script: Path, launch: Launch) -> tuple[Path, str]:
    """Where a launch script's relative paths start, and why: the script's folder, unless more of the files the
    launch names (its YAML, entry script, --mm-data, --mm-model, --fsdp2-config-path) are found from the working
    directory, as MindSpeed MM's scripts are run (``bash examples/qwen3vl/finetune_qwen3vl_8B.sh`` from its
    repository root)."""
    folder, cwd = script.resolve().parent, Path.cwd().resolve()
    named = [n for n in (launch.config_yaml, launch.script) if n]
    named += [value for flag, value in launch.flags if flag in _PATH_FLAGS and value]
    from_folder = [n for n in named if (folder / n).exists()]
    from_cwd = [n for n in named if (cwd / n).exists()]
    if folder != cwd and len(from_cwd) > len(from_folder):
        return cwd, f"{', '.join(from_cwd)} found from the working directory, not from the script's folder"
    return folder, "the script's folder"


def _launch_world(launch: Launch) -> int | None:
    """torchrun's ``--nproc_per_node`` x ``--nnodes`` when both are literal numbers (one node when no
    ``--nnodes``); None when either comes from shell the reader did not evaluate."""
    nproc, nnodes = launch.launcher.get("nproc_per_node"), launch.launcher.get("nnodes", "1")
    if nproc and nproc.isdigit() and nnodes and nnodes.isdigit():
        return int(nproc) * int(nnodes)
    return None


def migrate_script(
    path: Path,
    base_dir: Path | None,
    import_root: Path | None,
    keep_backend: bool,
    hf_path: Path | None,
    world_size: int | None = None,
) -> tuple[MigrationReport, list[Path]]:
    from lightning_mm.mindspeed.launch_kinds import (
        NATIVE_TRAINER,
        refuse_entry_script,
        refuse_model_ids,
        refuse_script_text,
    )
    from lightning_mm.mindspeed.native_route import is_native_route, migrate_native
    from lightning_mm.mindspeed.refusals import Refused

    source = str(path)
    text = read_text_file(path, "a launch script")
    refuse_script_text(text, source)
    launch = parse_script(text, source)
    from lightning_mm.mindspeed.feature_launch import ENTRY_SCRIPTS, command_for_launch

    if launch.script and Path(launch.script).name in ENTRY_SCRIPTS:  # Wan's, VACE's: lightning-mm extract-features
        raise Refused(source, "feature-extraction", command_for_launch(dict(launch.flags)))
    refuse_entry_script(launch.script, source)
    if base_dir is not None:
        base, why = Path(base_dir), "--base-dir"
    else:
        base, why = _launch_dir(path, launch)
    note = f"relative paths are taken from {base.resolve()} ({why})"
    read: list[Path] = []
    result: MigrationReport
    for flag, value in launch.flags:
        if flag == "--mm-model" and value and (base / value).is_file():
            refuse_model_ids(load_config_file(base / value), f"{source} (--mm-model {value})")
    if launch.config_yaml:
        yaml_path = (base / launch.config_yaml).resolve()
        if not yaml_path.is_file():
            raise MindSpeedConfigError(
                f"{path}: the launch's YAML {launch.config_yaml} is not found at {yaml_path}; "
                "give the launch directory with --base-dir"
            )
        read.append(yaml_path)
        try:
            content = load_config_file(yaml_path)
        except Refused as err:
            raise Refused(f"{source} ({launch.config_yaml})", err.code, err.detail) from None
        if is_native_route(content) or (launch.script and NATIVE_TRAINER.search(launch.script)):
            refuse_model_ids(content, f"{source} ({launch.config_yaml})", ("model",))
            if not is_native_route(content):
                raise MindSpeedConfigError(
                    f"{path}: {launch.script} is MindSpeed MM's native trainer, but {launch.config_yaml} has no "
                    "`parallel` section"
                )
            world = _launch_world(launch)
            if world is not None and world_size is not None and world != world_size:
                raise MindSpeedConfigError(
                    f"{path}: --world-size {world_size}, but the launch line starts {world} processes "
                    "(--nproc_per_node x --nnodes); give one"
                )
            native = migrate_native(yaml_path, content, base_dir=base, world_size=world or world_size)
            _map_native_launch(native, launch)
            result = native
        else:
            refuse_model_ids(content, f"{source} ({launch.config_yaml})", ("model",))
            result = migrate(
                launch,
                base_dir=base,
                import_root=import_root,
                keep_backend=keep_backend,
                single_yaml=(yaml_path, content),
                hf_path=hf_path,
            )
    else:
        try:
            result = migrate(launch, base_dir=base, import_root=import_root, keep_backend=keep_backend, hf_path=hf_path)
        except Refused as err:  # a refusal of a file the script names: the script is refused, naming both
            raise Refused(source, err.code, f"{err.source}: {err.detail}" if err.detail else err.source) from None
    result.notes.insert(0, note)
    _report_shell(result, launch)
    return result, read


def _map_native_launch(result: MigrationReport, launch: Launch) -> None:
    """The torchrun line of a native-route launch: process counts to the Trainer, every other option named."""
    state = FlagState(result.config, MigrationReport(result.config), {}, Path.cwd(), False)
    map_launcher(state, launch)
    result.mapped += state.out.mapped
    result.unmapped += state.out.unmapped
    result.notes += state.out.notes
    result.rendezvous.update(state.out.rendezvous)
    if "devices" in result.config.get("trainer", {}):  # the note asking for them is answered
        result.notes[:] = [n for n in result.notes if not n.startswith("trainer.devices / trainer.num_nodes")]
    for flag, value in launch.flags:
        shown = f"{flag} {value}" if value is not None else flag
        result.unmapped.append(
            f"{shown}: after the YAML on the launch line; MindSpeed MM's native trainer reads only the YAML"
        )


def _report_shell(result: MigrationReport, launch: Launch) -> None:
    """Name the shell the reader could not evaluate (``$(...)``, loops, ``source``...) and the flags written in
    variables that never reach the launch line."""
    for item in launch.unevaluated:
        result.notes.append(f"shell not evaluated: {item}")
    for item in launch.unused:
        result.notes.append(f"{item}: written, but not passed on the launch line; nothing to map")

"""LoRA of the Megatron route: the single YAML's ``lora_args`` and the ``--lora-*`` flags -> PEFT's LoRA on the
Transformers model (``transformers_model.lora``), or a Wan model.json's LoRA -> the diffusers module's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning_mm.mindspeed.flags import FlagState
from lightning_mm.mindspeed.keys import MindSpeedConfigError, expected_number, read_number

__all__ = ["LORA_FLAGS", "map_lora", "map_wan_lora", "read_lora_args"]


_LORA_ARGS = {
    "lora_r": "rank",
    "lora_alpha": "alpha",
    "lora_dropout": "dropout",
    "lora_target_modules": "target_modules",
}
_LORA_DEFAULTS = {"rank": 8, "alpha": 16, "dropout": 0.0}  # MindSpeed MM's argument defaults
_LORA_REFUSED = {
    "lora_target_parameters": "LoRA on raw parameters (routed experts' 3-D weights) is not supported here",
    "lora_apply_modules": "lora_mixed_training's module filter is not supported here",
    "lora_mixed_training": "training LoRA adapters together with unfrozen base weights is not supported here",
    "load_base_model": "a Megatron base checkpoint; the base weights here come from init_from_hf_path",
}


LORA_FLAGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_register_forward_hook")
"""The launch flags' names (``--lora-r`` ...) as :data:`FLAGS` keeps them; the same keys as ``lora_args``."""


def _lora_shown(key: str, where: str) -> str:
    """``lora_args.KEY`` of a single YAML (``where`` names the file), or the launch flag ``--lora-...``."""
    return f"lora_args.{key}" if where else "--" + key.replace("_", "-")


def read_lora_args(state: FlagState, where: str, lora: Any) -> None:
    """MindSpeed MM's LoRA arguments, from a single YAML's ``lora_args`` (``where`` is ``"FILE: "``) or the
    launch flags (``where`` is ``""``): checked (each value in its range, naming the key or flag) and kept
    for :func:`map_lora`, which writes them once the model config exists."""
    out = state.out
    if not isinstance(lora, Mapping):
        raise MindSpeedConfigError(f"{where}`lora_args`: expected a mapping, got {type(lora).__name__}")
    config: dict[str, Any] = dict(_LORA_DEFAULTS)
    for key, value in lora.items():
        shown = _lora_shown(key, where)
        if key in _LORA_ARGS:
            if key == "lora_target_modules":
                items = value if isinstance(value, list) else str(value).split(",")
                targets = [str(t).strip() for t in items if str(t).strip()]
                if not targets:
                    raise MindSpeedConfigError(f"{where}`{shown}`: expected module names, got {value!r}")
                config["target_modules"] = targets
            else:
                low, integer = (1, True) if key == "lora_r" else (0, False)
                number = _number_key(value, f"{where}`{shown}`", low, 1 if key == "lora_dropout" else None, integer)
                if key == "lora_dropout" and number >= 1:
                    raise MindSpeedConfigError(f"{where}`{shown}`: expected a probability below 1, got {value!r}")
                if key == "lora_alpha" and number <= 0:
                    raise MindSpeedConfigError(f"{where}`{shown}`: expected a number > 0, got {value!r}")
                config[_LORA_ARGS[key]] = int(number) if integer else number
        elif key == "lora_register_forward_hook":
            out.notes.append(
                f"{shown} {value}: MindSpeed MM marks these modules' outputs as needing gradients so that "
                "reentrant recomputation reaches the adapters; not needed here (recompute is non-reentrant "
                "unless use_reentrant is set)"
            )
        elif key in _LORA_REFUSED:
            (out.unmapped if value not in (None, False, [], "") else out.notes).append(
                f"{shown} {value}: {_LORA_REFUSED[key]}" if value not in (None, False, [], "") else f"{shown}: off"
            )
        else:
            out.unmapped.append(f"{shown}: not one of MindSpeed MM's LoRA arguments")
    if set(config) == set(_LORA_DEFAULTS) and not where and "lora_target_modules" not in lora:
        if any(k in lora for k in _LORA_ARGS):  # --lora-r without targets: MindSpeed MM's default [] is no LoRA
            raise MindSpeedConfigError(
                "`--lora-target-modules`: LoRA needs its target modules (MindSpeed MM's default is none)"
            )
        return  # only --lora-register-forward-hook: nothing to adapt
    if "target_modules" not in config:
        raise MindSpeedConfigError(
            f"{where}`{_lora_shown('lora_target_modules', where)}`: LoRA needs its target modules"
        )
    state.values["lora"] = config


def _number_key(value: Any, where: str, low: float | None, high: float | None, integer: bool) -> float:
    """A number written in a YAML, in its range; an error naming ``where`` (file and key) otherwise."""
    number = read_number(value, integer, low, high)
    if number is None:
        raise MindSpeedConfigError(f"{where}: expected {expected_number(integer, low, high)}, got {value!r}")
    return float(number)


def map_lora(state: FlagState) -> None:
    """MindSpeed MM's LoRA (the single YAML's ``lora_args``, kept by :func:`read_lora_args`, or the launch
    flags ``--lora-r``, ``--lora-alpha``, ``--lora-dropout``, ``--lora-target-modules``) ->
    ``model.init_args.transformers_model.lora`` (PEFT)."""
    flags = {key: state.values[key] for key in LORA_FLAGS if key in state.values}
    if flags and "lora" in state.values:
        raise MindSpeedConfigError("LoRA is given both as launch flags (--lora-*) and as lora_args; keep one")
    shown = ", ".join(_lora_shown(key, "") for key in flags if key != "lora_register_forward_hook")
    source = shown or "lora_args (lora_r, lora_alpha, lora_dropout, lora_target_modules)"
    model = state.cfg["model"].get("init_args", {}).get("transformers_model")
    from lightning_mm.mindspeed.diffusion import WAN_MODULE

    if state.cfg["model"].get("class_path") == WAN_MODULE and (shown or "lora" in state.values):
        if flags:
            read_lora_args(state, "", flags)
        if state.values.get("lora") is not None:
            map_wan_lora(state, state.values["lora"], source)
        return
    if not isinstance(model, dict):
        if shown or "lora" in state.values:
            state.out.unmapped.append(
                f"{source}: LoRA is mapped onto TransformersModel's lora only; set the model's lora (rank, alpha, "
                f"target_modules, dropout) by hand: {state.values.get('lora', flags)}"
            )
        elif flags:  # --lora-register-forward-hook alone: only its note
            read_lora_args(state, "", flags)
        return
    if flags:
        read_lora_args(state, "", flags)
    lora = state.values.get("lora")
    if lora is None:
        return
    model["lora"] = lora
    state.out.mapped.append(
        f"{source} -> model.init_args.transformers_model.lora "
        f"{lora} (a bare module name adapts every module whose path ends with it, as in MindSpeed MM)"
    )


def map_wan_lora(state: FlagState, lora: Mapping[str, Any], source: str) -> None:
    """MindSpeed MM's LoRA (range-checked by :func:`read_lora_args`) on a Wan job -> MMWanModule's
    ``diffusers_model.lora`` (PEFT on diffusers' WanTransformer3DModel), the targets renamed to diffusers' modules."""
    from lightning_mm.mindspeed.diffusion import wan_lora_targets

    out = state.out
    targets = lora.get("target_modules") or []
    names = [str(m) for m in (targets.split(",") if isinstance(targets, str) else targets) if str(m).strip()]
    patterns, unknown = wan_lora_targets(names)
    if unknown:
        out.unmapped.append(
            f"--lora-target-modules {' '.join(unknown)}: not a linear of MindSpeed MM's wandit with a diffusers "
            "counterpart (known: proj_q, proj_k, proj_v, proj_out, k_img, v_img, ffn.0, ffn.2); add its "
            "diffusers path to model.init_args.diffusers_model.lora.target_modules by hand"
        )
    if not patterns:
        return
    mapped: dict[str, Any] = {k: v for k, v in lora.items() if k != "target_modules"}
    mapped.setdefault("rank", 8)  # MindSpeed MM's defaults (mindspeed_mm/arguments.py)
    mapped.setdefault("alpha", 16)
    mapped["target_modules"] = patterns
    state.cfg["model"]["init_args"]["diffusers_model"]["lora"] = mapped
    out.mapped.append(
        f"{source} -> model.init_args.diffusers_model.lora (PEFT on WanTransformer3DModel; targets "
        f"{', '.join(names)} -> {', '.join(patterns)}); every other weight is frozen, as MindSpeed MM's PEFT model"
    )

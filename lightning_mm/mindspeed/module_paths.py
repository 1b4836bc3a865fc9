"""MindSpeed MM's module paths of one model family, in the names of the Transformers class that trains it here.

A MindSpeed MM FSDP2 YAML names modules of MindSpeed MM's own model object (``sub_modules_to_wrap``,
``recompute_modules``, ``ignored_modules``...). Where that object is laid out differently from the Transformers
class this project builds, ``migrate`` rewrites each pattern through the family's :class:`PathMap`; each rule is
read from MindSpeed MM's model or checkpoint-conversion code (named in :data:`FAMILIES`) and Transformers' class.

A rule is a pair of dotted prefixes; ``#`` stands for one index segment (``0``, ``{*}``, ``{0-3,7}``), carried over
unchanged. The longest matching rule wins and the rest of the pattern is kept. A pattern no rule matches is kept as
written, and a translation that names no module of the model stays an error at plan and setup (the project's rule
for patterns); a module with no single counterpart (Megatron's ``text_decoder``: the Transformers language model
plus ``lm_head``) has no rule on purpose.

Read, never imported: neither torch nor Transformers is imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lightning_mm.mindspeed.ignored_default import WHY, fsdp2_keys, states_ignored_modules

__all__ = ["PATH_KEYS", "PathMap", "FAMILIES", "family_of", "translate", "translate_keys", "translate_fsdp2_config"]

PATH_KEYS = ("sub_modules_to_wrap", "recompute_modules", "ignored_modules", "moe_modules", "compile_modules")
"""The FSDP2 YAML keys whose values are lists of module-path patterns."""


@dataclass(frozen=True)
class PathMap:
    """How one family's MindSpeed MM module paths read in the Transformers class."""

    name: str
    """The family as reports name it."""
    source: str
    """Where the rules come from (MindSpeed MM's file, and Transformers' class)."""
    rules: tuple[tuple[str, str], ...]
    """(MindSpeed MM prefix, Transformers prefix); ``#`` is one index segment."""


_MISTRAL3 = PathMap(
    "Mistral 3 (Magistral)",
    # MindSpeed MM's class subclasses Transformers 4.57's Mistral3ForConditionalGeneration, whose properties
    # language_model / vision_tower / multi_modal_projector return self.model.<name>, and MindSpeed MM resolves a
    # path by getattr (get_nested_module, mindspeed_mm/models/transformers/base_model.py); Transformers 5 has no
    # such properties: the modules are model.<name>.
    "mindspeed_mm/models/transformers/mistral3/mistral3.py: Transformers 4.57's properties language_model, "
    "vision_tower, multi_modal_projector (self.model.<name>)",
    (
        ("language_model", "model.language_model"),
        ("vision_tower", "model.vision_tower"),
        ("multi_modal_projector", "model.multi_modal_projector"),
    ),
)

_L = "language_model.model.layers.#"
_V = "vision_model.encoder.layers.#"
_TV = "model.vision_tower.encoder.layer.#"
_INTERNVL = PathMap(
    "InternVL (remote-code InternVLChatModel)",
    # mindspeed_mm/models/transformers/internvl3_5.py builds the checkpoint's remote-code InternVLChatModel, whose
    # names (vision_model, mlp1.0/1/3, language_model.model / .lm_head) checkpoint/vlm_model/converters/internvl.py
    # lists; Transformers' InternVLForConditionalGeneration names them as its convert_internvl_weights_to_hf.py
    # (vision_model -> vision_tower, layers -> layer, attn -> attention, norm1/2 -> layernorm_before/after, mlp1.N)
    # and its _checkpoint_conversion_mapping (language_model.model -> model.language_model, ... -> lm_head) do.
    "mindspeed_mm/models/transformers/internvl3_5.py (remote-code InternVLChatModel), "
    "checkpoint/vlm_model/converters/internvl.py",
    (
        ("vision_model", "model.vision_tower"),
        ("vision_model.encoder.layers", "model.vision_tower.encoder.layer"),
        (f"{_V}.attn", f"{_TV}.attention"),
        (f"{_V}.attn.proj", f"{_TV}.attention.projection_layer"),
        (f"{_V}.norm1", f"{_TV}.layernorm_before"),
        (f"{_V}.norm2", f"{_TV}.layernorm_after"),
        ("mlp1", "model.multi_modal_projector"),
        ("mlp1.0", "model.multi_modal_projector.layer_norm"),
        ("mlp1.1", "model.multi_modal_projector.linear_1"),
        ("mlp1.3", "model.multi_modal_projector.linear_2"),
        ("language_model.model", "model.language_model"),
        ("language_model.lm_head", "lm_head"),
    ),
)

_VB = "image_encoder.encoder.blocks.layers.#"
_TB = "model.visual.blocks.#"
_TD = "text_decoder.decoder.layers.#"
_TL = "model.language_model.layers.#"
_MEGATRON_TOWERS = (  # MindSpeed MM's Megatron towers, the same in its Qwen2.5-VL and Qwen3-VL
    ("image_encoder", "model.visual"),
    ("image_encoder.encoder.patch_embed", "model.visual.patch_embed"),
    ("image_encoder.encoder.rotary_pos_emb", "model.visual.rotary_pos_emb"),
    ("image_encoder.encoder.blocks.layers", "model.visual.blocks"),
    (f"{_VB}.self_attention", f"{_TB}.attn"),
    (f"{_VB}.self_attention.linear_qkv", f"{_TB}.attn.qkv"),
    (f"{_VB}.self_attention.linear_proj", f"{_TB}.attn.proj"),
    (f"{_VB}.input_layernorm", f"{_TB}.norm1"),
    (f"{_VB}.pre_mlp_layernorm", f"{_TB}.norm2"),
    (f"{_VB}.mlp", f"{_TB}.mlp"),
    ("image_encoder.projector", "model.visual.merger"),
    ("text_decoder.embedding", "model.language_model.embed_tokens"),
    ("text_decoder.embedding.word_embeddings", "model.language_model.embed_tokens"),
    ("text_decoder.rotary_pos_emb", "model.language_model.rotary_emb"),
    ("text_decoder.decoder.layers", "model.language_model.layers"),
    (f"{_TD}.self_attention", f"{_TL}.self_attn"),
    (f"{_TD}.self_attention.linear_proj", f"{_TL}.self_attn.o_proj"),
    (f"{_TD}.input_layernorm", f"{_TL}.input_layernorm"),
    (f"{_TD}.pre_mlp_layernorm", f"{_TL}.post_attention_layernorm"),
    (f"{_TD}.mlp", f"{_TL}.mlp"),
    (f"{_TD}.mlp.linear_fc2", f"{_TL}.mlp.down_proj"),
    ("text_decoder.decoder.final_layernorm", "model.language_model.norm"),
    ("text_decoder.output_layer", "lm_head"),
)
_MEGATRON_QWEN2_5_VL = PathMap(
    "Qwen2.5-VL (MindSpeed MM's Megatron towers)",
    # mindspeed_mm/models/vlm_model.py (VLMModel: image_encoder = encoder + projector, text_decoder = Megatron's
    # GPT model); each Megatron name is the Hugging Face name that checkpoint/vlm_model/converters/qwen2vl.py
    # (create_qwen2vl_ops, also used for Qwen2.5-VL) converts into it, placed as Transformers'
    # Qwen2_5_VLForConditionalGeneration._checkpoint_conversion_mapping places it (visual -> model.visual,
    # model -> model.language_model).
    "mindspeed_mm/models/vlm_model.py, checkpoint/vlm_model/converters/qwen2vl.py",
    (
        *_MEGATRON_TOWERS,
        (f"{_VB}.mlp.linear_fc2", f"{_TB}.mlp.down_proj"),
        ("image_encoder.projector.layernorm", "model.visual.merger.ln_q"),
        ("image_encoder.projector.encoder.linear_fc1", "model.visual.merger.mlp.0"),
        ("image_encoder.projector.encoder.linear_fc2", "model.visual.merger.mlp.2"),
    ),
)
_MEGATRON_QWEN3_VL = PathMap(
    "Qwen3-VL (MindSpeed MM's Megatron towers)",
    # The same towers; checkpoint/vlm_model/converters/qwen3vl_megatron.py names the Transformers modules directly
    # (model.visual.pos_embed, merger.norm / linear_fc*, self_attn.q_norm / k_norm ...).
    "mindspeed_mm/models/vlm_model.py, checkpoint/vlm_model/converters/qwen3vl_megatron.py",
    (
        *_MEGATRON_TOWERS,
        ("image_encoder.encoder.pos_embed", "model.visual.pos_embed"),
        ("image_encoder.projector.layernorm", "model.visual.merger.norm"),
        ("image_encoder.projector.encoder.linear_fc1", "model.visual.merger.linear_fc1"),
        ("image_encoder.projector.encoder.linear_fc2", "model.visual.merger.linear_fc2"),
        (f"{_TD}.self_attention.q_layernorm", f"{_TL}.self_attn.q_norm"),
        (f"{_TD}.self_attention.k_layernorm", f"{_TL}.self_attn.k_norm"),
    ),
)

FAMILIES: dict[tuple[str, bool], PathMap] = {
    ("mistral3", False): _MISTRAL3,
    ("internvl", False): _INTERNVL,
    ("qwen2_5_vl", True): _MEGATRON_QWEN2_5_VL,
    ("qwen3_vl", True): _MEGATRON_QWEN3_VL,  # Qwen3-VL and its MoE (MEGATRON_ROUTE_IDS)
}
"""(family key of :mod:`lightning_mm.mindspeed.model_config`, Megatron route?) -> its path map. Families absent here
are MindSpeed MM subclasses of the Transformers class laid out as Transformers 5 lays it out."""


def family_of(family: str | None, megatron: bool) -> PathMap | None:
    """The path map of a migrated model family, or None when MindSpeed MM's paths are the Transformers class's."""
    return FAMILIES.get((family, megatron)) if family is not None else None


def _index(segment: str) -> bool:
    return segment.isdigit() or (segment.startswith("{") and segment.endswith("}"))


def translate(pattern: str, paths: PathMap) -> str | None:
    """``pattern`` in the Transformers class's names, or None when no rule of ``paths`` applies."""
    parts = pattern.split(".")
    best: tuple[int, list[str]] | None = None
    for source, target in paths.rules:
        rule = source.split(".")
        if len(rule) > len(parts) or (best is not None and len(rule) <= best[0]):
            continue
        taken = []
        for want, got in zip(rule, parts):
            if want == "#" and _index(got):
                taken.append(got)
            elif want != got:
                break
        else:
            indices = iter(taken)
            head = [next(indices) if seg == "#" else seg for seg in target.split(".")]
            best = (len(rule), head + parts[len(rule) :])
    return None if best is None else ".".join(best[1])


def translate_keys(keys: Mapping[str, Any], paths: PathMap, where: str) -> tuple[dict[str, Any], list[str]]:
    """An FSDP2 YAML's keys with their module paths translated, and one report line per translated pattern
    (``where`` names the file). Values that are not lists of strings are left to the config's own checks."""
    out = dict(keys)
    lines: list[str] = []
    for key in PATH_KEYS:
        value = keys.get(key)
        if not isinstance(value, list):
            continue
        new = []
        for item in value:
            moved = translate(item, paths) if isinstance(item, str) else None
            new.append(item if moved is None else moved)
            if moved is not None and moved != item:
                lines.append(f"{where} {key}: {item} -> {moved}")
        out[key] = new
    return out, lines


def translate_fsdp2_config(
    fsdp2_config: Any, family: str | None, megatron: bool
) -> tuple[dict[str, Any] | None, list[str], list[str]]:
    """A migrated strategy's ``fsdp2_config`` (a YAML path or inlined keys) in the Transformers class's module
    paths: (the keys to inline, or None when nothing changes; mapped lines; not-mapped lines). The YAML file is
    never edited: when a path changes, its keys are written inline."""
    paths = family_of(family, megatron)
    if paths is None or fsdp2_config is None:
        return None, [], []
    keys, where, error = fsdp2_keys(fsdp2_config)
    if keys is None:
        return (
            None,
            [],
            [error or f"{where}: write its module paths in {paths.name}'s Transformers names ({paths.source})"],
        )
    new, lines = translate_keys(keys, paths, where)
    if not lines:
        return None, [], []
    if not states_ignored_modules(new):  # MindSpeed MM ignores what the YAML lists; here a frozen tower is by default
        new["ignored_modules"] = []
        lines.append(f"{where} ignored_modules: not set -> [] ({WHY})")
    head = (
        f"{where}: module paths of MindSpeed MM's {paths.name} -> the Transformers class's "
        f"(from {paths.source}); written inline in trainer.strategy.init_args.fsdp2_config, the file is unchanged"
    )
    return new, [head, *(f"  {line}" for line in lines)], []

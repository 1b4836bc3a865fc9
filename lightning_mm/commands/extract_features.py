"""``lightning-mm extract-features``: MindSpeed MM's Wan 2.1 text- and image-to-video and Wan VACE feature
extraction (``examples/wan2.1/feature_extract/feature_extraction.sh``, ``mindspeed_mm/tools/feature_extraction/
get_wan_feature.py``) in one process, writing the features ``dataset_type: feature`` trains on.

    lightning-mm extract-features --data data.json --model model_t2v.json --output OUT [--device cuda]

``--data``: a data config as the Wan raw-video path reads it (``dataset_param.basic_parameters.data_path``: the
records, JSON lines or a JSON list, each with the video ``path``, relative to ``data_folder`` and inside it, and its
caption ``cap``; ``preprocess_parameters`` ``num_frames``, ``frame_interval``, ``max_height``, ``max_width``;
``tokenizer_config``: ``from_pretrained`` and ``model_max_length``; ``enable_text_preprocessing`` with
``text_preprocess_methods`` ``whitespace_clean``). ``--model``: MindSpeed MM's feature-extraction ``model.json``
(``ae.from_pretrained``: the diffusers ``AutoencoderKLWan`` directory, ``text_encoder.from_pretrained``: the
``UMT5EncoderModel`` directory); ``--vae``, ``--text-encoder`` and ``--tokenizer`` name or override them. Paths in
the configs are relative to the working directory, as MindSpeed MM reads them.

Frames are decoded, resized and centre-cropped as the raw-video training path does
(:func:`~lightning_mm.data.wan_video.decode_model_frames`); the features are those of
:mod:`lightning_mm.diffusers.wan_features`. Every output file (``OUT/features/*.pt``, ``OUT/data.jsonl``) must
not exist yet: an existing one is refused, naming it, before any work. ``task: i2v`` adds the first-frame CLIP
and VAE features (``i2v_clip_feature``, ``i2v_vae_feature``) of MindSpeed MM's ``wan_i2v_processor.py``, with the
``CLIPVisionModel`` of ``ae.i2v_processor.image_encoder`` (or ``--image-encoder``).

A VACE data config (``dataset_type: vace``, MindSpeed MM's ``examples/vace/feature_extract/``) writes what its
``get_vace_feature.py`` writes: per record ``OUT/features/<MD5 of cap>.pt`` with ``video``, ``vace_context`` (the
control video's inactive / reactive latents and the mask's 8 x 8 patches), ``prompt_ids`` and ``prompt_mask``
(:mod:`lightning_mm.diffusers.vace_features`; the configs read by :mod:`lightning_mm.mindspeed.vace_extraction`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_mm.mindspeed.feature_launch import ExtractionPlan, training_hint
from lightning_mm.mindspeed.vace_extraction import VaceExtractionPlan, plan_any_extraction

__all__ = ["main", "run_extraction", "run_vace_extraction"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-mm extract-features", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--data", required=True, help="the data config (MindSpeed MM's data.json)")
    parser.add_argument("--model", default=None, help="MindSpeed MM's feature-extraction model.json (ae, text_encoder)")
    parser.add_argument("--vae", default=None, help="AutoencoderKLWan save_pretrained directory (default: ae)")
    parser.add_argument("--text-encoder", default=None, help="UMT5EncoderModel directory (default: text_encoder)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: tokenizer_config)")
    parser.add_argument("--image-encoder", default=None, help="i2v: CLIPVisionModel directory (default: ae)")
    parser.add_argument("--output", required=True, help="output directory (features/ and data.jsonl are written)")
    parser.add_argument("--device", default="cpu", help="torch device of the encoders (default cpu)")
    return parser


def run_vace_extraction(plan: VaceExtractionPlan, output: Path, device: str = "cpu") -> Path:
    """MindSpeed MM's ``get_vace_feature.py``: each record's ``video``, ``vace_context``, ``prompt_ids`` and
    ``prompt_mask`` to ``OUT/features/<md5 of cap>.pt``, then ``OUT/data.jsonl``; returns that file."""
    from lightning_mm.diffusers.vace_features import basic_clean, record_pixels, vace_context
    from lightning_mm.diffusers.wan_features import WanFeatureEncoders, check_outputs, save_features, whitespace_clean

    encoders = WanFeatureEncoders.load(plan.vae, plan.text_encoder, plan.tokenizer, plan.max_length, device)
    cleaners = {"basic_clean": basic_clean, "whitespace_clean": whitespace_clean}
    (output / "features").mkdir(parents=True, exist_ok=True)
    lines = []
    for entry in plan.records:
        pixels = record_pixels(
            entry.video, entry.src_video, entry.mask, entry.refs, entry.ids, entry.size, entry.width, plan.pipeline
        )
        caption = entry.caption
        for method in plan.text_methods:
            caption = cleaners[method](caption)
        prompt, mask = encoders.encode_text(caption)
        visual = vace_context(encoders.encode_video, pixels)
        (path,) = check_outputs(output, [f"features/{entry.name}"])
        save_features(path, {"video": visual["video"], "prompt_ids": prompt, "prompt_mask": mask, **visual})
        # As `VACEFeatureExtractor._write_data_info`: the record with its joined paths, `file` the feature file.
        lines.append(json.dumps({**entry.record, "file": f"features/{entry.name}"}, ensure_ascii=False))
    (jsonl,) = check_outputs(output, ["data.jsonl"])
    with open(jsonl, "x", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    return jsonl


def run_extraction(plan: ExtractionPlan, output: Path, device: str = "cpu") -> Path:
    """Encode every record and write its features, then ``OUT/data.jsonl``; returns that file."""
    from lightning_mm.data.record_files import DataError
    from lightning_mm.data.wan_video import decode_model_frames, probe_video, read_frames
    from lightning_mm.diffusers.wan_features import (
        WanFeatureEncoders,
        check_outputs,
        first_frame_inputs,
        save_features,
        whitespace_clean,
    )

    for video in plan.videos:  # a bad clip fails before anything is written
        problem = probe_video(video, plan.num_frames, plan.frame_interval)
        if problem is not None:
            raise DataError(f"{video}: {problem}")
    encoders = WanFeatureEncoders.load(
        plan.vae, plan.text_encoder, plan.tokenizer, plan.max_length, device, plan.image_encoder
    )
    features = output / "features"
    features.mkdir(parents=True, exist_ok=True)
    lines = []
    for record, video, caption, name, source in zip(
        plan.records, plan.videos, plan.captions, plan.names, plan.source_paths
    ):
        frames = decode_model_frames(video, plan.num_frames, plan.frame_interval, plan.height, plan.width)
        prompt, mask = encoders.encode_text(whitespace_clean(caption) if plan.clean_text else caption)
        (path,) = check_outputs(output, [f"features/{name}"])
        data = {"video": encoders.encode_video(frames), "prompt_ids": prompt, "prompt_mask": mask}
        if plan.task == "i2v":  # MindSpeed MM's wan_i2v_processor.py, on the first frame
            clip_size = encoders.image_encoder.config.image_size
            pixels, first = first_frame_inputs(read_frames(video, 1)[0], plan.height, plan.width, clip_size)
            data["i2v_clip_feature"] = encoders.encode_image(pixels)
            data["i2v_vae_feature"] = encoders.encode_condition(first, plan.num_frames)
        save_features(path, data)
        # As MindSpeed MM's `_write_data_info`: the record, its (joined) source `path`, `file` the feature file.
        lines.append(json.dumps({**record, "path": source, "file": f"features/{name}"}))
    (jsonl,) = check_outputs(output, ["data.jsonl"])
    with open(jsonl, "x", encoding="utf-8") as handle:
        handle.write("\n".join(lines) + "\n")
    return jsonl


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from lightning_mm.commands.failure import one_line, traceback_requested, user_error

    output = Path(args.output)
    try:
        plan = plan_any_extraction(
            Path(args.data),
            Path(args.model) if args.model else None,
            output,
            args.vae,
            args.text_encoder,
            args.tokenizer,
            args.image_encoder,
        )
        if isinstance(plan, VaceExtractionPlan):
            jsonl = run_vace_extraction(plan, output, args.device)
        else:
            jsonl = run_extraction(plan, output, args.device)
    except Exception as error:  # the user's to fix: one line (see lightning_mm.commands.failure); a bug: traceback
        cause = None if traceback_requested() else user_error(error)
        if cause is None:
            raise
        print(f"lightning-mm extract-features: error: {one_line(cause)}", file=sys.stderr)
        return 1
    print(f"wrote {len(plan.records)} feature file(s) and {jsonl}")
    print(training_hint(jsonl))
    return 0

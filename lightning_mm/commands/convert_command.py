"""``lightning-mm convert``: checkpoint conversion in one process, no GPU needed.

* ``dcp-to-torch SRC DST.pt``: any checkpoint this project writes (a ``torch_dcp`` directory, FSDP or HSDP, any
  world size; weights-only and converted ones too) as one ``torch.save`` file in Lightning's layout, with full
  tensors. It loads ``weights_only`` and resumes with ``MMFSDP2Strategy`` on any number of ranks.
* ``dcp-to-hf SRC OUT_DIR``: the Hugging Face model of a checkpoint (a ``transformers.PreTrainedModel`` built in
  ``model_provider``, e.g. through TransformersModel) as ``config.json`` + safetensors, for ``from_pretrained``,
  with the tokenizer, processor, chat template and generation config files of ``--pretrained-dir`` (default: the
  ``init_from_hf_path`` the checkpoint records, when it still exists), so that AutoTokenizer / AutoProcessor load it.
* ``dcp-to-diffusers SRC OUT_DIR --config MODEL_DIR``: the diffusers model of a checkpoint (``MMWanModule``'s
  ``model.predictor``) as diffusers' ``save_pretrained`` writes it, with the config of ``--config``.
* ``hf-to-dcp HF_DIR DST``: a Hugging Face model directory as a ``torch_dcp`` weights checkpoint:
  ``trainer.fit(ckpt_path=DST)`` starts training from those weights; validate/test/predict use them.

Every converter writes a new output (an existing one is refused unless ``--force`` and it is an earlier output of
the same converter; an output that is, lies inside or contains the source is always refused) through a hidden
``.partial-*`` sibling renamed into place when complete: a failure such as a full disk (ENOSPC) is one line and
leaves nothing behind, and a replaced output stays whole until the new one is.
"""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_mm.errors import ConfigError, OutputExistsError

__all__ = ["main"]


_FORCE_HELP = "replace {what} once the new output is complete (anything else that exists is still refused)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-mm convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{dcp-to-torch,dcp-to-hf,dcp-to-diffusers,hf-to-dcp}"
    )

    p = sub.add_parser("dcp-to-torch", help="consolidate a checkpoint into one torch.save file")
    p.add_argument("src", help="checkpoint directory (torch_dcp) or file")
    p.add_argument("dst", help="output file (must not exist)")
    p.add_argument("--model-only", action="store_true", help="leave out the optimizer state")
    p.add_argument("--force", action="store_true", help=_FORCE_HELP.format(what="an earlier output file"))

    p = sub.add_parser("dcp-to-hf", help="write the Hugging Face model of a checkpoint (config.json + safetensors)")
    p.add_argument("src", help="checkpoint directory (torch_dcp) or file")
    p.add_argument("out_dir", help="output directory (must not exist)")
    p.add_argument(
        "--prefix",
        default=None,
        help="key prefix of the HF model in the LightningModule (default: the recorded one, `model.`)",
    )
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="cast floating tensors")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument(
        "--config", default=None, help="config.json (or its directory) to use when the checkpoint records no HF config"
    )
    p.add_argument(
        "--merge-lora",
        action="store_true",
        help="merge the checkpoint's LoRA adapters into the weights (PEFT's merge_and_unload)",
    )
    p.add_argument(
        "--pretrained-dir",
        default=None,
        help="copy the tokenizer, processor, chat template and generation config files from this "
        "Hugging Face directory (default: the init_from_hf_path the checkpoint records, if it exists)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help=_FORCE_HELP.format(what="an earlier output directory (one with a config.json)"),
    )

    p = sub.add_parser("dcp-to-diffusers", help="write the diffusers model of a checkpoint (config.json + safetensors)")
    p.add_argument("src", help="checkpoint directory (torch_dcp) or file")
    p.add_argument("out_dir", help="output directory (must not exist)")
    p.add_argument("--config", required=True, help="the model's diffusers directory (or its config.json)")
    p.add_argument(
        "--prefix",
        default="model.predictor.",
        help="key prefix of the diffusers model in the LightningModule (default `model.predictor.`)",
    )
    p.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="cast floating tensors")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument(
        "--force",
        action="store_true",
        help=_FORCE_HELP.format(what="an earlier output directory (one with a config.json)"),
    )

    p = sub.add_parser("hf-to-dcp", help="a Hugging Face model directory as a torch_dcp weights checkpoint")
    p.add_argument("hf_dir", help="directory with config.json and safetensors (or pytorch_model.bin) weights")
    p.add_argument("dst", help="output checkpoint directory (must not exist)")
    p.add_argument(
        "--prefix",
        default="model.",
        help="key prefix of the model in the LightningModule (default `model.`: MMLightningModule.model)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help=_FORCE_HELP.format(what="an earlier output checkpoint (a directory with a .metadata)"),
    )
    for name in ("dcp-to-torch", "dcp-to-hf", "hf-to-dcp"):
        sub.choices[name].add_argument(
            "--storage-options",
            default=None,
            metavar="JSON_FILE",
            help="for a source or output given as a URL (s3://..., any fsspec protocol): a JSON file with the "
            "fsspec options (endpoint, credentials); without it, fsspec's own configuration is used",
        )
    return parser


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _check_paths(src: str, dst: str) -> None:
    """An output may not be (or lie inside) the source, nor contain it: a converter never writes into what it reads."""
    source, target = Path(src).resolve(), Path(dst).resolve()
    if target == source:
        raise OutputExistsError(f"output exists: {dst} (it is the source; write the output elsewhere)")
    if _inside(target, source):
        raise ConfigError(f"output {dst} is inside the source {src}; write it elsewhere")
    if _inside(source, target):
        raise ConfigError(f"output {dst} contains the source {src}; write it elsewhere")


def _one_line(error: BaseException, message: str) -> str:
    """The message, with the errno's name for an OS error (``... No space left on device (ENOSPC)``)."""
    code = getattr(error, "errno", None)
    if isinstance(error, OSError) and isinstance(code, int) and code in errno.errorcode:
        return f"{message} ({errno.errorcode[code]})"
    return message


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from lightning_mm.commands.failure import one_line, traceback_requested, user_error

    try:
        src, dst = (
            (args.hf_dir, args.dst)
            if args.command == "hf-to-dcp"
            else (args.src, args.dst if args.command == "dcp-to-torch" else args.out_dir)
        )
        from lightning_mm.checkpoint import remote

        if remote.is_url(src) or remote.is_url(dst):
            return _convert_urls(args, src, dst)
        if args.command == "dcp-to-diffusers":
            _check_paths(src, dst)
            from lightning_mm.diffusers.wan_export import dcp_to_diffusers
            from lightning_mm.hf.dcp_conversion import parse_size

            out = dcp_to_diffusers(
                args.src,
                args.out_dir,
                config=args.config,
                prefix=args.prefix,
                dtype=args.dtype,
                max_shard_size=parse_size(args.max_shard_size),
                force=args.force,
            )
            print(f"wrote {out}")
            return 0
        _check_paths(src, dst)
        from lightning_mm.checkpoint import consolidate
        from lightning_mm.hf import dcp_conversion as convert

        notes: list[str] = []
        if args.command == "dcp-to-torch":
            out = consolidate.dcp_to_torch(args.src, args.dst, model_only=args.model_only, force=args.force)
        elif args.command == "dcp-to-hf":
            max_shard_size = convert.parse_size(args.max_shard_size)  # before any work
            if args.merge_lora:
                from lightning_mm.hf.lora_export import dcp_to_hf_merged

                if args.pretrained_dir is not None:
                    raise ConfigError(
                        "--pretrained-dir is not supported with --merge-lora yet; copy the tokenizer "
                        "and processor files by hand"
                    )
                out = dcp_to_hf_merged(
                    args.src,
                    args.out_dir,
                    prefix=args.prefix,
                    dtype=args.dtype,
                    max_shard_size=max_shard_size,
                    force=args.force,
                )
            else:
                from lightning_mm.hf.lora_export import checkpoint_lora

                if args.config is None and checkpoint_lora(args.src, args.prefix) is not None:
                    raise ConfigError(
                        f"{args.src} holds LoRA adapters (keys `*.base_layer.*`, `*.lora_A.*`), which "
                        "Transformers cannot load as they are: add --merge-lora"
                    )
                out = convert.dcp_to_hf(
                    args.src,
                    args.out_dir,
                    prefix=args.prefix,
                    dtype=args.dtype,
                    max_shard_size=max_shard_size,
                    config=args.config,
                    pretrained_dir=args.pretrained_dir,
                    notes=notes,
                    force=args.force,
                )
        else:
            out = convert.hf_to_dcp(args.hf_dir, args.dst, prefix=args.prefix, force=args.force)
    except Exception as error:  # the user's to fix: one line (see lightning_mm.commands.failure); a bug: traceback
        cause = None if traceback_requested() else user_error(error)
        if cause is None:
            raise
        print(f"lightning-mm convert {args.command}: error: {_one_line(cause, one_line(cause))}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {out}")
    return 0


def _storage_options(path: str | None) -> dict | None:
    import json

    if path is None:
        return None
    try:
        options = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"--storage-options {path}: not a readable JSON file ({err})") from None
    if not isinstance(options, dict):
        raise ConfigError(f"--storage-options {path}: must hold a JSON object")
    return options


def _convert_urls(args: argparse.Namespace, src: str, dst: str) -> int:
    """A source or output at a URL: the source is copied into a temporary directory (a checkpoint checked against
    its manifest first), the output written there and copied to its URL when complete."""
    import tempfile

    from lightning_mm.checkpoint import remote

    options = _storage_options(args.storage_options)
    if remote.is_url(src) and remote.is_url(dst) and (src.rstrip("/") + "/").startswith(dst.rstrip("/") + "/"):
        raise ConfigError(f"output {dst} contains or is the source {src}; write it elsewhere")
    if (
        remote.is_url(dst)
        and remote.RemoteStore(dst, options).fs.exists(remote.RemoteStore(dst, options).root)
        and not args.force
    ):
        raise OutputExistsError(f"output exists: {dst} (add --force to replace it)")
    with tempfile.TemporaryDirectory(prefix="lightning-mm-convert-") as scratch:
        local_src, local_dst = Path(scratch) / "source", Path(scratch) / "output"
        argv = [args.command]
        if remote.is_url(src):
            local_src.mkdir()
            remote.download(src, local_src, options, checkpoint=args.command != "hf-to-dcp")
            argv.append(str(local_src))
        else:
            argv.append(src)
        argv.append(str(local_dst) if remote.is_url(dst) else dst)
        argv += _passed_options(args)
        status = main(argv)
        if status == 0 and remote.is_url(dst):
            remote.upload(local_dst, dst, options, force=args.force)
            print(f"wrote {dst}")
        return status


def _passed_options(args: argparse.Namespace) -> list[str]:
    """The conversion's own options, as given (for the local run of a URL conversion)."""
    out: list[str] = []
    for name in ("prefix", "dtype", "max_shard_size", "config", "pretrained_dir"):
        value = getattr(args, name, None)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    for name in ("model_only", "merge_lora", "force"):
        if getattr(args, name, False):
            out.append(f"--{name.replace('_', '-')}")
    return out


if __name__ == "__main__":
    sys.exit(main())

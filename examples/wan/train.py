"""Train a tiny Wan 2.1-shaped video diffusion transformer on generated clips, in one command:

    python -m examples.wan.train [--out runs/wan] [--steps 30] [--devices 2]     (from the repository root)

1. Clips: short RGB videos of a coloured square moving across a dark background (5 frames of 32 x 32), with a
   caption each ("red square moving right").
2. Features, as MindSpeed MM's feature extraction writes them (``dataset_type: feature``): a tiny random
   ``AutoencoderKLWan`` (diffusers) encodes each clip to latents ``(4, 3, 16, 16)``; a fixed random embedding per
   caption word stands in for Wan's UMT5 text encoder. One ``.pt`` per clip, listed in ``data.jsonl``.
3. A tiny random ``WanTransformer3DModel`` (2 blocks) is written with ``save_pretrained`` and trained by
   ``MMWanModule`` under ``MMFSDP2Strategy`` with MindSpeed MM's own ``examples/wan2.1/fsdp2_config.yaml``
   (a copy: ``tests/data/wan``; blocks and head as FSDP2 units, blocks recomputed, bf16 parameters) on 2 CPU
   processes, MindSpeed MM's flow-matching recipe (shift 5, 1000 timesteps).
   The loss is logged every step, as for the other examples: on the progress bar ("Epoch 0 · step 12/30") and in
   Lightning's CSV log (``out/lightning_logs/version_N/metrics.csv``: ``train/loss``, ``train/lr``...).
4. The checkpoint is converted to a diffusers directory (``out/diffusers``), loaded with
   ``WanTransformer3DModel.from_pretrained``, and a clip is generated from a caption with diffusers' flow-matching
   Euler scheduler and decoded by the VAE (``out/sample.gif``).

The VAE and the text embeddings are random stand-ins (no downloads): the model learns the latents of these clips,
not real videos.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=32,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
    rope_max_seq_len=64,
)
VAE = dict(
    base_dim=8,
    z_dim=4,
    dim_mult=[1, 2],
    num_res_blocks=1,
    attn_scales=[],
    temperal_downsample=[True],
    latents_mean=[0.0] * 4,
    latents_std=[1.0] * 4,
)
COLOURS = {"red": (1.0, -1.0, -1.0), "green": (-1.0, 1.0, -1.0), "blue": (-1.0, -1.0, 1.0)}
MOTIONS = {"right": (0, 1), "left": (0, -1), "down": (1, 0), "up": (-1, 0)}
WORDS = [*COLOURS, *MOTIONS, "square", "moving"]
FRAMES, SIZE, TEXT_LEN = 5, 32, 8


def clip(colour: str, motion: str, start: int) -> torch.Tensor:
    """A ``(3, FRAMES, SIZE, SIZE)`` clip in [-1, 1]: an 8-pixel square moving 4 pixels a frame."""
    video = torch.full((3, FRAMES, SIZE, SIZE), -0.8)
    dy, dx = MOTIONS[motion]
    for f in range(FRAMES):
        y, x = 12 + dy * (4 * f - 8) + start, 12 + dx * (4 * f - 8) + start
        video[:, f, max(y, 0) : max(y + 8, 0), max(x, 0) : max(x + 8, 0)] = torch.tensor(COLOURS[colour])[:, None, None]
    return video


def text_embeddings(caption: str) -> torch.Tensor:
    """``(TEXT_LEN, text_dim)``: a fixed random vector per word, zero-padded (as Wan pads its UMT5 output)."""
    table = torch.randn(len(WORDS), TRANSFORMER["text_dim"], generator=torch.Generator().manual_seed(0))
    out = torch.zeros(TEXT_LEN, TRANSFORMER["text_dim"])
    for i, word in enumerate(caption.split()):
        out[i] = table[WORDS.index(word)]
    return out


def prepare(out: Path) -> None:
    """The model directories, the clips' features and the MindSpeed MM data config (once)."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    if (out / "prepared").is_file():
        return
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    WanTransformer3DModel(**TRANSFORMER).save_pretrained(out / "transformer")
    vae = AutoencoderKLWan(**VAE).eval()
    vae.save_pretrained(out / "vae")
    features = out / "features"
    features.mkdir(exist_ok=True)
    records = []
    for colour in COLOURS:
        for motion in MOTIONS:
            for start in (-2, 0, 2):
                caption = f"{colour} square moving {motion}"
                with torch.no_grad():
                    latents = vae.encode(clip(colour, motion, start)[None]).latent_dist.mode()[0]
                name = f"{colour}_{motion}_{start + 2}.pt"
                torch.save({"video": latents, "prompt_ids": text_embeddings(caption)}, features / name)
                records.append({"file": name, "cap": caption})
    (features / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    data = {
        "dataset_param": {
            "dataset_type": "feature",
            "basic_parameters": {"data_path": str(features / "data.jsonl"), "data_folder": str(features)},
        },
        "dataloader_param": {"dataloader_mode": "sampler", "shuffle": True, "drop_last": True},
    }
    (out / "data.json").write_text(json.dumps(data, indent=2))
    (out / "prepared").write_text("ok\n")


def generate(out: Path, caption: str, steps: int = 20) -> Path:
    """A clip from ``caption`` with the converted model (diffusers only), decoded and written as a GIF."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanTransformer3DModel
    from PIL import Image

    model = WanTransformer3DModel.from_pretrained(out / "diffusers").eval()
    vae = AutoencoderKLWan.from_pretrained(out / "vae").eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    scheduler.set_timesteps(steps)
    latents = torch.randn(1, 4, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    text = text_embeddings(caption)[None]
    with torch.no_grad():
        for t in scheduler.timesteps:
            velocity = model(latents, t.expand(1), text, return_dict=False)[0]
            latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
        video = vae.decode(latents, return_dict=False)[0][0]  # (3, F, H, W) in about [-1, 1]
    frames = ((video.clamp(-1, 1) + 1) * 127.5).to(torch.uint8).permute(1, 2, 3, 0).numpy()
    images = [Image.fromarray(f).resize((128, 128), Image.NEAREST) for f in frames]
    path = out / "sample.gif"
    images[0].save(path, save_all=True, append_images=images[1:], duration=200, loop=0)
    return path


def make_trainer(out: Path, steps: int, devices: int) -> Any:
    """The example's Trainer: ``MMFSDP2Strategy``, bf16, ``steps`` steps; the loss every step on the progress bar
    (``lightning-mm fit``'s bar: "Epoch 0 · step 12/30", not Rich's "Epoch 0/-2") and in Lightning's CSV log."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_mm import MMFSDP2Strategy
    from lightning_mm.commands.progress import default_progress_bar

    return L.Trainer(
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        precision="bf16-mixed",
        logger=CSVLogger(out),
        callbacks=[default_progress_bar()],
        enable_checkpointing=False,
        log_every_n_steps=1,
        default_root_dir=out,
        strategy=MMFSDP2Strategy(),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/wan"))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--devices", type=int, default=2)
    args = parser.parse_args()
    out = args.out.resolve()
    prepare(out)

    from lightning_mm.datamodules import MMDataModule
    from lightning_mm.diffusers.wan_export import dcp_to_diffusers
    from lightning_mm.modules.wan_module import MMWanModule

    module = MMWanModule(
        {"init_from_path": str(out / "transformer")},
        noise_seed=0,
        lr=1e-3,
        fsdp2_config=ROOT / "tests" / "data" / "wan" / "wan2.1_fsdp2_config.yaml",
    )
    trainer = make_trainer(out, args.steps, args.devices)
    trainer.fit(module, datamodule=MMDataModule.from_config(out / "data.json", batch_size=2))
    trainer.save_checkpoint(out / "last.ckpt")
    if trainer.global_rank == 0:
        print(f"metrics: {Path(trainer.logger.log_dir) / 'metrics.csv'}")
        dcp_to_diffusers(out / "last.ckpt", out / "diffusers", config=out / "transformer", force=True)
        print(f"diffusers model: {out / 'diffusers'}; sample: {generate(out, 'red square moving right')}")


if __name__ == "__main__":
    main()

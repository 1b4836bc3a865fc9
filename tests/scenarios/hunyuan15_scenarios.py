"""HunyuanVideo 1.5 through diffusers on 2 ranks (``tests/test_hunyuan15.py``): the corpus' t2v and i2v launch
scripts as ``migrate`` writes them, run as ``lightning-mm fit --config`` runs them.

    python tests/scenarios/hunyuan15_scenarios.py fit_migrated OUTDIR --arg work=WORKDIR   (tests/helpers/scenario_kit)

``WORKDIR`` holds the tiny diffusers ``HunyuanVideo15Transformer3DModel`` (``model/``, from ``save_pretrained``), the
features in MindSpeed MM's layout (``features_<task>/``: ``video``, and ``prompt_ids`` / ``prompt_mask`` as lists of the
MLLM's and byT5's outputs, as ``get_sora_feature.py`` saves them for two text encoders; i2v adds its i2v processor's
``cond_latents`` and ``vision_states``; ``data_<task>.json``: ``dataset_type: feature``) written by
:func:`write_workdir`, and ``migrated_<task>.yaml``, the configs ``migrate`` wrote for :data:`SCRIPTS` with the tiny
stand-ins (:func:`write_migrated`). Each rank writes its loss per step; rank 0 the first step's gradients and the
final weights (:class:`Recorder`).

:func:`reference_losses` is the one-process diffusers reference: the same model directory, AdamW, samples per rank and
step, and its own re-telling of MindSpeed MM's ``Hunyuan_15_FlowMatchDiscreteScheduler.q_sample`` /
``training_losses`` (``mindspeed_mm/models/diffusion/hunyuan_video_15_scheduler.py``) and of the transformer call of
diffusers' ``HunyuanVideo15Pipeline`` (t2v: zero condition channels, 729 zero image tokens; i2v: the condition
latents and image states), with the noise and timestep drawn from
:func:`lightning_mm.diffusers.flow_matching.draw_generator`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402

TINY_HUNYUAN15 = dict(
    in_channels=9,  # latents (4) + zero condition latents (4) + mask (1)
    out_channels=4,
    num_attention_heads=2,
    attention_head_dim=8,
    num_layers=2,
    num_refiner_layers=1,
    text_embed_dim=16,
    text_embed_2_dim=8,
    image_embed_dim=8,
    rope_axes_dim=(2, 4, 2),
)
SAMPLES = 4  # 2 steps of 2 samples (one per rank)
LATENT_SHAPE = (4, 2, 4, 4)  # (C, F, H, W): 32 video tokens
TEXT_LEN, GLYPH_LEN = 6, 5
LR = 1e-3
STEPS = 2
SCRIPTS = {task: f"examples/hunyuanvideo_1.5/{task}/pretrain_hunyuanvideo_15.sh" for task in ("t2v", "i2v")}
IMAGE_TOKENS = 3  # i2v's SigLIP states (729 in the real model)


def write_workdir(work: Path) -> None:
    """The tiny model (seeded) and the features, in MindSpeed MM's layout (each encoder's output ``(1, L, D)``)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(0)
    HunyuanVideo15Transformer3DModel(**TINY_HUNYUAN15).save_pretrained(work / "model")
    for task in SCRIPTS:
        _write_features(work, task)


def _write_features(work: Path, task: str) -> None:
    features = work / f"features_{task}"
    features.mkdir()
    generator = torch.Generator().manual_seed(1 if task == "t2v" else 2)
    lines = []
    for i in range(SAMPLES):
        sample = {
            "video": torch.randn(LATENT_SHAPE, generator=generator),
            "prompt_ids": [
                torch.randn(1, TEXT_LEN, TINY_HUNYUAN15["text_embed_dim"], generator=generator),
                torch.randn(1, GLYPH_LEN, TINY_HUNYUAN15["text_embed_2_dim"], generator=generator),
            ],
            "prompt_mask": [
                torch.tensor([[1] * (TEXT_LEN - 1 - i % 2) + [0] * (1 + i % 2)]),
                torch.tensor([[1] * (i % 3) + [0] * (GLYPH_LEN - i % 3)]),  # sample 0: no glyph text
            ],
        }
        if task == "i2v":  # hunyuanvideo_15_i2v_processor: first-frame latents and mask; SigLIP's last hidden state
            condition = torch.zeros(LATENT_SHAPE[0] + 1, *LATENT_SHAPE[1:])
            condition[:-1, :1] = sample["video"][:, :1]
            condition[-1, 0] = 1
            sample["cond_latents"] = condition
            sample["vision_states"] = torch.randn(IMAGE_TOKENS, TINY_HUNYUAN15["image_embed_dim"], generator=generator)
        torch.save(sample, features / f"{i}.pt")
        lines.append(json.dumps({"file": f"{i}.pt", "cap": f"clip {i}"}))
    (features / "data.jsonl").write_text("\n".join(lines) + "\n")
    data = {
        "dataset_param": {
            "dataset_type": "feature",
            "basic_parameters": {"data_path": str(features / "data.jsonl"), "data_folder": str(features)},
        },
        "dataloader_param": {"dataloader_mode": "sampler", "shuffle": False, "drop_last": True},
    }
    (work / f"data_{task}.json").write_text(json.dumps(data, indent=2))


def write_migrated(work: Path, tree: Path, outdir: Path) -> None:
    """``lightning-mm migrate`` each of :data:`SCRIPTS` from ``tree`` (a copy of the corpus, as a MindSpeed MM
    checkout), written to ``WORKDIR/migrated_<task>.yaml`` with the tiny stand-ins: the model directory, the
    feature data, 2 CPU ranks (the YAML's ``sharding_size`` 8 of the 8-NPU job becomes 2), fp32, :data:`STEPS`
    steps, the reference's lr and no weight decay, the recording callback in place of the job's. Everything else
    (the model section, schedule, task, FSDP2 YAML with its recomputation, strategy) is as migrated."""
    import os

    import yaml

    from lightning_mm.commands.migrate import migrate_file

    before = Path.cwd()
    os.chdir(tree)
    try:
        results = {task: migrate_file(Path(script))[0] for task, script in SCRIPTS.items()}
    finally:
        os.chdir(before)
    for task, result in results.items():
        _write_config(yaml.safe_load(yaml.safe_dump(result.config)), task, work, outdir)


def _write_config(config: dict[str, Any], task: str, work: Path, outdir: Path) -> None:
    import yaml

    from lightning_mm.diffusers.hunyuan15_diffusion import mindspeed_hunyuan15_fsdp2_config

    init = config["model"]["init_args"]
    init["diffusers_model"]["init_from_path"] = str(work / "model")
    init.update(lr=LR, min_lr=LR, weight_decay=0.0, log_grad_norm=False, log_throughput=False)
    init["fsdp2_config"] = {
        **mindspeed_hunyuan15_fsdp2_config(init["fsdp2_config"]),
        "sharding_size": 2,
        "param_dtype": "fp32",
        "reduce_dtype": "fp32",
    }
    config["trainer"].update(
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        precision="32-true",
        max_steps=STEPS,
        gradient_clip_val=None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(work / f"run_{task}"),
        callbacks=[
            {
                "class_path": "tests.scenarios.hunyuan15_scenarios.Recorder",
                "init_args": {"outdir": str(outdir), "name": task},
            }
        ],
    )
    config["data"]["init_args"].update(data_config=str(work / f"data_{task}.json"), num_workers=0)
    (work / f"migrated_{task}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def _reference_draw(
    latents: torch.Tensor, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MindSpeed MM's ``q_sample`` (hunyuan_video_15_scheduler.py), re-told: ``noise = randn_like(latents)``, then
    ``TimestepSampler.sample`` (lognorm: ``u ~ N(0, 1)``, ``t = 1 / (1 + exp(-u)) * (t1 - t0) + t0`` with ``t0 =
    1e-5``, ``t1 = 1 - 1e-5``, times ``T = 1000``), ``timestep_transform`` with ``train_timestep_shift`` 3, and
    ``LinearInterpolationSchedule.forward``: ``(1 - t/T) x0 + (t/T) noise``. Returns (x_t, t, noise)."""
    noise = torch.randn(latents.shape, generator=generator)
    u = torch.normal(mean=0.0, std=1.0, size=(latents.shape[0],), generator=generator)
    t0, t1 = 1e-5, 1.0 - 1e-5
    timesteps = (1.0 / (1.0 + torch.exp(-u)) * (t1 - t0) + t0) * 1000
    normalized = timesteps / 1000
    timesteps = 3.0 * normalized / (1 + (3.0 - 1) * normalized) * 1000
    fraction = (timesteps / 1000).view(-1, 1, 1, 1, 1)
    return (1 - fraction) * latents + fraction * noise, timesteps, noise


def reference_losses(
    work: Path, steps: int, task: str, grads: dict | None = None, noise_seed: int = 0
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The one-process diffusers run of ``task`` (see the module docstring): per step the mean of the 2
    data-parallel ranks' losses, and the final weights; ``grads`` receives the first step's gradients."""
    from diffusers import HunyuanVideo15Transformer3DModel

    from lightning_mm.diffusers.flow_matching import draw_generator

    model = HunyuanVideo15Transformer3DModel.from_pretrained(work / "model")
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    losses = []
    for step in range(steps):
        total = 0.0
        optimizer.zero_grad()
        for rank in range(2):
            data = torch.load(work / f"features_{task}" / f"{2 * (step % 2) + rank}.pt", weights_only=True)
            latents = data["video"][None]
            noisy, timesteps, noise = _reference_draw(latents, draw_generator(noise_seed, "train", step, 0, rank))
            b, c, f, h, w = latents.shape
            if task == "i2v":  # the pipeline's image latents (first frame) and mask, and the image's SigLIP states
                condition, image = data["cond_latents"][None], data["vision_states"][None]
            else:
                condition = torch.cat([torch.zeros(b, c, f, h, w), torch.zeros(b, 1, f, h, w)], dim=1)
                image = torch.zeros(b, 729, TINY_HUNYUAN15["image_embed_dim"])
            out = model(
                hidden_states=torch.cat([noisy, condition], dim=1),
                timestep=timesteps,
                encoder_hidden_states=data["prompt_ids"][0],
                encoder_attention_mask=data["prompt_mask"][0],
                encoder_hidden_states_2=data["prompt_ids"][1],
                encoder_attention_mask_2=data["prompt_mask"][1],
                image_embeds=image,
                return_dict=False,
            )[0]
            loss = torch.nn.functional.mse_loss(out, noise - latents) / 2
            loss.backward()
            total += float(loss.detach())
        if step == 0 and grads is not None:
            grads.update(
                {f"model.predictor.{k}": v.grad.clone() for k, v in model.named_parameters() if v.grad is not None}
            )
        optimizer.step()
        losses.append(total)
    return losses, {f"model.predictor.{k}": v.detach().clone() for k, v in model.named_parameters()}


class Recorder(L.Callback):
    """Each rank's loss per step and the FSDP2 plan (``OUTDIR/<name>.rank{R}.json``); on rank 0 the first step's
    gradients (``<name>_grads.pt``) and the final weights (``<name>_final.pt``)."""

    def __init__(self, outdir: str, name: str) -> None:
        self.outdir, self.name = Path(outdir), name
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == 0:  # full_tensor is a collective: every rank
            from torch.distributed.tensor import DTensor

            grads = {
                f"model.{n}": (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                for n, p in pl_module.model.named_parameters()
                if p.grad is not None
            }
            if trainer.global_rank == 0:
                torch.save(grads, self.outdir / f"{self.name}_grads.pt")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        from torch.distributed.tensor import DTensor

        final = {
            f"model.{n}": (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in pl_module.model.named_parameters()
        }
        plan = {
            "units": [u.modules[0] for u in trainer.strategy.plan.units],
            "recompute": list(trainer.strategy.plan.recompute_modules),
        }
        info = {"losses": self.losses, "plan": plan}
        (self.outdir / f"{self.name}.rank{trainer.global_rank}.json").write_text(json.dumps(info))
        if trainer.global_rank == 0:
            torch.save(final, self.outdir / f"{self.name}_final.pt")


@scenario(exit_cleanly=False)
def fit_migrated(outdir: Path, work: str) -> None:
    from lightning_mm.commands.train import run_lightning_cli

    for task in SCRIPTS:
        run_lightning_cli(["fit", "--config", str(Path(work) / f"migrated_{task}.yaml")])


if __name__ == "__main__":
    scenario_kit.main()

"""Wan 2.x through diffusers on 2 ranks (``tests/test_wan.py``): training, resuming, and what the tests compare.

    python tests/scenarios/wan_scenarios.py fit_resume_cp OUTDIR --arg work=WORKDIR     (tests/helpers/scenario_kit.py)

``WORKDIR`` holds the tiny diffusers ``WanTransformer3DModel`` (``model/``, from ``save_pretrained``) and the
feature data (``data.json``: MindSpeed MM's ``dataset_type: feature``, ``features/``) written by
:func:`write_workdir`. The run: one epoch (2 steps) with MindSpeed MM's ``examples/wan2.1/fsdp2_config.yaml``
(recomputation of every block; its dtypes set to fp32 for the fp32 comparison), a checkpoint, then a new Trainer
resumed from it for a second epoch, and a final checkpoint. Each rank writes ``OUTDIR/wan.rank{R}.json`` (its loss
per step); rank 0 writes the gathered final weights to ``OUTDIR/final.pt``. Then ``CP_STEPS`` steps with
``context_parallel_size=2`` (both ranks on one sample, its video tokens split): ``cp_losses``, ``cp_grads.pt`` (the
first step's gradients) and ``cp_final.pt``. Then 2 epochs with LoRA (:data:`LORA`, PEFT adapters on the blocks'
attention and feed-forward linears, what ``migrate`` makes of MindSpeed MM's Wan ``finetune_lora*.sh``):
``lora_losses``, ``lora_grads.pt`` (the first step's gradients), ``lora_final.pt`` and ``lora.ckpt``. Last, the
configs ``migrate`` wrote for the corpus' Wan t2v scripts (:data:`MIGRATED`, :func:`write_migrated`: full weights
with MindSpeed MM's FSDP2 YAML, and LoRA) and its Wan 2.1 i2v scripts (full weights and LoRA; the i2v stand-ins
in ``WORKDIR/i2v``, :func:`write_i2v_workdir`), each run as ``lightning-mm fit --config`` does
(:class:`MigratedRecorder`), and those of its Wan VACE scripts (:data:`MIGRATED_VACE`: the tiny
``WanVACETransformer3DModel`` in ``vace_model/`` and MindSpeed MM's VACE features with ``vace_context`` in
``vace_features/``, ``vace_data.json``). Very last, the tiny VACE model fitted with context parallelism 2, which
is refused (:func:`vace_context_parallel_error`: ``vace_cp.rank{R}.txt``).
Real gloo collectives; nothing mocked.

:func:`reference_losses` is the one-process diffusers reference: the same model directory, AdamW, the same
samples per rank and step, the same timesteps and noise (:func:`lightning_mm.diffusers.flow_matching.draw_generator`).
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

TINY_WAN = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=16,
    ffn_dim=32,
    num_layers=2,
    rope_max_seq_len=32,
)
TINY_VACE = dict(
    TINY_WAN,
    num_layers=3,
    vace_layers=[0, 2],  # every other Wan block, as the 1.3B recipe's [0, 2, ..., 28]
    vace_in_channels=2 * TINY_WAN["in_channels"] + 64,  # inactive and reactive latents, the 8x8 mask
)
VACE_CONTEXT_SHAPE = (TINY_VACE["vace_in_channels"], 3, 8, 8)  # MindSpeed MM's vace_context: latents' F, H, W
SAMPLES = 4  # one epoch: 2 steps of 2 samples (one per rank)
LATENT_SHAPE = (4, 3, 8, 8)  # (C, F, H, W): 3 x 4 x 4 = 48 video tokens after the (1, 2, 2) patches
TEXT_LEN = 5
LR = 1e-3
NOISE_SEED = 7
CP_STEPS = 3
YAML = ROOT / "tests" / "data" / "wan" / "wan2.1_fsdp2_config.yaml"
LORA = {
    "rank": 4,
    "alpha": 8,  # not the rank: the scaling alpha / rank is checked too
    "target_modules": [
        f"blocks.{{*}}.{m}"
        for m in ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0")
        + ("attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2")
    ],
}
LORA_STEPS = 4
# The reference's own PEFT target (a regex over diffusers' module names), written independently of LORA's patterns.
LORA_REFERENCE_TARGETS = r"blocks\.\d+\.(attn1|attn2)\.(to_q|to_k|to_v|to_out\.0)|blocks\.\d+\.ffn\.net\.(0\.proj|2)"


def write_workdir(work: Path) -> None:
    """The tiny model (seeded) and the feature data, in MindSpeed MM's feature layout."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    WanTransformer3DModel(**TINY_WAN).save_pretrained(work / "model")
    features = work / "features"
    features.mkdir()
    generator = torch.Generator().manual_seed(1)
    lines = []
    for i in range(SAMPLES):
        sample = {
            "video": torch.randn(LATENT_SHAPE, generator=generator),
            "prompt_ids": torch.randn(TEXT_LEN, TINY_WAN["text_dim"], generator=generator),
            "prompt_mask": torch.tensor([1] * (TEXT_LEN - i % 2) + [0] * (i % 2)),
        }
        torch.save(sample, features / f"{i}.pt")
        lines.append(json.dumps({"file": f"{i}.pt", "cap": f"clip {i}"}))
    (features / "data.jsonl").write_text("\n".join(lines) + "\n")
    data = {
        "dataset_param": {
            "dataset_type": "feature",
            "basic_parameters": {"data_path": str(features / "data.jsonl"), "data_folder": str(features)},
            "preprocess_parameters": {"num_frames": 9, "max_height": 32, "max_width": 32},
        },
        "dataloader_param": {"dataloader_mode": "sampler", "shuffle": False, "drop_last": True},
    }
    (work / "data.json").write_text(json.dumps(data, indent=2))
    write_vace_workdir(work)


def write_vace_workdir(work: Path) -> None:
    """The tiny VACE model (seeded, ``vace_model/``) and VACE features as MindSpeed MM's ``get_vace_feature.py``
    writes them (``video``, ``prompt_ids``, ``prompt_mask``, ``vace_context``; ``vace_features/``), named by
    ``vace_data.json``, whose ``video_processor_type`` is MindSpeed MM's VACE one."""
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(2)
    WanVACETransformer3DModel(**TINY_VACE).save_pretrained(work / "vace_model")
    features = work / "vace_features"
    features.mkdir()
    generator = torch.Generator().manual_seed(3)
    lines = []
    for i in range(SAMPLES):
        sample = {
            "video": torch.randn(LATENT_SHAPE, generator=generator),
            "prompt_ids": torch.randn(TEXT_LEN, TINY_WAN["text_dim"], generator=generator),
            "prompt_mask": torch.tensor([1] * (TEXT_LEN - i % 2) + [0] * (i % 2)),
            "vace_context": torch.randn(VACE_CONTEXT_SHAPE, generator=generator),
        }
        torch.save(sample, features / f"{i}.pt")
        lines.append(json.dumps({"file": f"{i}.pt", "cap": f"clip {i}"}))
    (features / "data.jsonl").write_text("\n".join(lines) + "\n")
    data = {
        "dataset_param": {
            "dataset_type": "feature",
            "basic_parameters": {"data_path": str(features / "data.jsonl"), "data_folder": str(features)},
            "preprocess_parameters": {"video_processor_type": "VACEVideoProcessor", "num_frames": 9},
        },
        "dataloader_param": {"dataloader_mode": "sampler", "shuffle": False, "drop_last": True},
    }
    (work / "vace_data.json").write_text(json.dumps(data, indent=2))


VACE_REFERENCE_TRAINED = ("vace_patch_embedding.", "vace_blocks.")
"""The parameters MindSpeed MM's ``VACEModel.freeze`` leaves trainable (its ``vace_dit``), by diffusers' names."""


def vace_reference_losses(
    work: Path,
    steps: int,
    schedule_args: dict[str, Any],
    betas: tuple[float, float],
    eps: float,
    grads: dict | None = None,
) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    """The one-process diffusers VACE run: ``WanVACETransformer3DModel`` with the Wan part frozen, AdamW on the rest,
    the same samples per rank and step, timesteps and noise as the 2-rank run (seed 0, the migrated config's). Returns
    the mean loss per step, the final weights and the trained parameter names (``grads``: the first step's)."""
    from diffusers import WanVACETransformer3DModel

    from lightning_mm.diffusers.flow_matching import WanFlowMatchSchedule, draw, draw_generator

    model = WanVACETransformer3DModel.from_pretrained(work / "vace_model")
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(VACE_REFERENCE_TRAINED))
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, betas=betas, eps=eps, weight_decay=0.0)
    schedule = WanFlowMatchSchedule(**schedule_args)
    losses = []
    for step in range(steps):
        total = 0.0
        optimizer.zero_grad()
        for rank in range(2):
            data = torch.load(work / "vace_features" / f"{sample_of(step, rank)}.pt", weights_only=True)
            text = (data["prompt_ids"] * data["prompt_mask"][:, None])[None]
            flow = draw(schedule, data["video"][None], draw_generator(0, "train", step, 0, rank))
            out = model(
                flow.noisy, flow.timestep, text, control_hidden_states=data["vace_context"][None], return_dict=False
            )[0]
            loss = schedule.loss(out, flow) / 2
            loss.backward()
            total += float(loss.detach())
        if step == 0 and grads is not None:
            grads.update(
                {f"model.predictor.{k}": v.grad.clone() for k, v in model.named_parameters() if v.grad is not None}
            )
        optimizer.step()
        losses.append(total)
    names = sorted(f"model.predictor.{k}" for k, v in model.named_parameters() if v.requires_grad)
    return losses, {f"model.predictor.{k}": v.detach().clone() for k, v in model.named_parameters()}, names


def sample_of(step: int, rank: int) -> int:
    """The sample rank ``rank`` trains on at optimizer step ``step`` (unshuffled, one per rank, 2 steps an epoch)."""
    return 2 * (step % 2) + rank


def fsdp2_config() -> dict[str, Any]:
    from lightning_mm.diffusers.wan_diffusion import mindspeed_fsdp2_config

    return {**mindspeed_fsdp2_config(YAML), "param_dtype": "fp32", "reduce_dtype": "fp32"}


def reference_losses(
    work: Path,
    steps: int,
    data_ranks: int = 2,
    grads: dict | None = None,
    lora: bool = False,
    lora_shape: tuple[int, float] = (LORA["rank"], LORA["alpha"]),  # type: ignore[assignment]
    noise_seed: int = NOISE_SEED,
    i2v: bool = False,
    order: list[list[int]] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The one-process diffusers run: per step the mean of the data-parallel ranks' losses, and the final weights
    (``data_ranks`` 1: context parallelism over both ranks, one sample a step). ``grads`` receives the first step's
    gradients. ``lora``: PEFT's adapters (``lora_shape``: rank and alpha, seed 0) on the transformer, the rest
    frozen. ``noise_seed``: the run's seed of timesteps and noise. ``i2v``: the features are image-to-video ones
    (:func:`write_i2v_workdir`), conditioned as MindSpeed MM's Wan i2v training does (:func:`i2v_inputs`).
    ``order``: per step, each data-parallel rank's sample (a shuffling sampler's; default :func:`sample_of`)."""
    from diffusers import WanTransformer3DModel

    from lightning_mm.diffusers.flow_matching import WanFlowMatchSchedule, draw, draw_generator

    model = WanTransformer3DModel.from_pretrained(work / "model")
    if lora:
        from peft import LoraConfig, inject_adapter_in_model

        model.requires_grad_(False)
        torch.manual_seed(0)
        config = LoraConfig(r=lora_shape[0], lora_alpha=lora_shape[1], target_modules=LORA_REFERENCE_TARGETS)
        inject_adapter_in_model(config, model)
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LR, weight_decay=0.0)
    schedule = WanFlowMatchSchedule()
    losses = []
    for step in range(steps):
        total = 0.0
        optimizer.zero_grad()
        for rank in range(data_ranks):
            index = sample_of(step, rank) if data_ranks == 2 else step % SAMPLES
            index = order[step][rank] if order is not None else index
            data = torch.load(work / "features" / f"{index}.pt", weights_only=True)
            latents = data["video"][None]
            text = (data["prompt_ids"] * data["prompt_mask"][:, None])[None]
            flow = draw(schedule, latents, draw_generator(noise_seed, "train", step, 0, rank))
            noisy, image = i2v_inputs(flow.noisy, data) if i2v else (flow.noisy, None)
            out = model(noisy, flow.timestep, text, encoder_hidden_states_image=image, return_dict=False)[0]
            loss = schedule.loss(out, flow) / data_ranks
            loss.backward()
            total += float(loss.detach())
        if step == 0 and grads is not None:
            grads.update(
                {f"model.predictor.{k}": v.grad.clone() for k, v in model.named_parameters() if v.grad is not None}
            )
        optimizer.step()
        losses.append(total)
    return losses, {f"model.predictor.{k}": v.detach().clone() for k, v in model.named_parameters()}


def _fit(
    work: Path,
    outdir: Path,
    epochs: int,
    record: list,
    ckpt_path: str | None = None,
    cp: int = 1,
    lora: dict[str, Any] | None = None,
) -> Any:
    import lightning as L

    from lightning_mm import MMFSDP2Strategy
    from lightning_mm.datamodules import MMDataModule
    from lightning_mm.modules.wan_module import MMWanModule

    class Recorded(MMWanModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            tokens: list[int] = []
            hook = self.model.predictor.blocks[1].register_forward_pre_hook(lambda m, a: tokens.append(a[0].shape[1]))
            loss = super().training_step(batch, batch_idx)
            hook.remove()
            record.append([self.trainer.global_step, float(loss.detach()), tokens[0]])
            return loss

        def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
            if (cp > 1 or lora) and self.trainer.global_step == 0:  # a collective: every rank
                grads = {
                    f"model.{n}": p.grad.full_tensor() for n, p in self.model.named_parameters() if p.grad is not None
                }
                if self.trainer.global_rank == 0:
                    torch.save(grads, outdir / ("lora_grads.pt" if lora else "cp_grads.pt"))

    module = Recorded(
        {"init_from_path": str(work / "model"), **({"lora": lora} if lora else {})},
        noise_seed=NOISE_SEED,
        fsdp2_config=fsdp2_config(),
        lr=LR,
        log_grad_norm=False,
        log_throughput=False,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_epochs=epochs if cp == 1 else -1,
        max_steps=-1 if cp == 1 else CP_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=outdir,
        strategy=MMFSDP2Strategy(context_parallel_size=cp),
    )
    trainer.fit(module, datamodule=MMDataModule.from_config(work / "data.json", batch_size=1), ckpt_path=ckpt_path)
    return trainer, module


MIGRATED = {
    "t2v": "examples/wan2.1/14b/t2v/pretrain_fsdp2.sh",  # MindSpeed MM's Wan FSDP2 YAML, full weights
    "lora": "examples/wan2.1/1.3b/t2v/finetune_lora.sh",  # --lora-r 16 --lora-alpha 16, ffn.*, proj_*
    "i2v": "examples/wan2.1/1.3b/i2v/pretrain.sh",  # Wan 2.1 i2v (pretrain_sora.py, task i2v), full weights
    "i2v_lora": "examples/wan2.1/14b/i2v/finetune_lora.sh",  # Wan 2.1 i2v LoRA: --lora-r 16 --lora-alpha 16
}
"""The corpus' Wan launch scripts (tests/data/mindspeed_corpus) whose migrated configs the run trains."""
MIGRATED_VACE = {
    "vace": "examples/vace/1.3B/pretrain_fsdp.sh",  # Wan 2.1 VACE: VACE blocks trained, Wan frozen
    "vace_high": "examples/vace/A14B_wan2.2/pretrain_fsdp_high.sh",  # Wan 2.2 VACE's expert: timesteps [0, 0.358)
}
"""The corpus' Wan VACE launch scripts whose migrated configs the run trains (with ``vace_model``/``vace_data``)."""
MIGRATED_STEPS = 2
I2V_MIGRATED = ("i2v", "i2v_lora")
"""The :data:`MIGRATED` jobs of Wan 2.1 i2v: the tiny i2v model and features (``WORKDIR/i2v``), the corpus' own
``feature_data.json`` pointed at them."""


def write_migrated(work: Path, tree: Path, outdir: Path) -> None:
    """``lightning-mm migrate`` each :data:`MIGRATED` and :data:`MIGRATED_VACE` script from ``tree`` (a copy of the
    corpus, as a MindSpeed MM checkout), written to ``WORKDIR/migrated_<name>.yaml`` with the tiny stand-ins: the
    model directory, the feature data (i2v: the migrated config's own data config, the corpus' ``feature_data.json``,
    pointed at the tiny i2v features by :func:`point_data_config`), 2 CPU ranks (an FSDP2 YAML's sharding_size too),
    fp32, :data:`MIGRATED_STEPS` steps, the reference's lr and no weight decay or clipping (the diffusers reference
    has neither), the recording callback in place of the job's. Everything else (the model section, what trains,
    LoRA, schedule, FSDP2 YAML, strategy, Adam's betas) is as migrated."""
    import os

    import yaml

    from lightning_mm.commands.migrate import migrate_file
    from lightning_mm.diffusers.wan_diffusion import mindspeed_fsdp2_config

    before = Path.cwd()
    os.chdir(tree)
    try:
        results = {name: migrate_file(Path(script))[0] for name, script in {**MIGRATED, **MIGRATED_VACE}.items()}
    finally:
        os.chdir(before)
    write_i2v_workdir(work / "i2v")
    for name, result in results.items():
        home = migrated_work(work, name)
        config = yaml.safe_load(yaml.safe_dump(result.config))
        init = config["model"]["init_args"]
        vace = name in MIGRATED_VACE
        init["diffusers_model"]["init_from_path"] = str(work / "vace_model" if vace else home / "model")
        init.update(lr=LR, min_lr=LR, weight_decay=0.0, log_grad_norm=False, log_throughput=False)
        if "fsdp2_config" in init:
            init["fsdp2_config"] = {
                **mindspeed_fsdp2_config(init["fsdp2_config"]),
                "param_dtype": "fp32",
                "reduce_dtype": "fp32",
            }
            if "sharding_size" in init["fsdp2_config"]:  # the VACE YAML's 8 ranks: the 2 of this run
                init["fsdp2_config"]["sharding_size"] = 2
        config["trainer"].update(
            accelerator="cpu",
            devices=2,
            num_nodes=1,
            precision="32-true",
            max_steps=MIGRATED_STEPS,
            gradient_clip_val=None,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=str(work / f"run_{name}"),
            callbacks=[
                {
                    "class_path": "tests.scenarios.wan_scenarios.MigratedRecorder",
                    "init_args": {"outdir": str(outdir), "name": name},
                }
            ],
        )
        if name in I2V_MIGRATED:  # the corpus' own feature_data.json (shuffled, grouped), pointed at the tiny features
            point_data_config(Path(config["data"]["init_args"]["data_config"]), home / "features")
        else:
            data = work / "vace_data.json" if vace else home / "data.json"
            config["data"]["init_args"]["data_config"] = str(data)
        config["data"]["init_args"]["num_workers"] = 0
        (work / f"migrated_{name}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


TINY_WAN_I2V = {**TINY_WAN, "in_channels": 12, "image_dim": 16, "added_kv_proj_dim": 24}
"""Wan 2.1 i2v in small (Wan2.1-I2V: ``in_channels`` 36 = 16 noisy latent channels + MindSpeed MM's 4 first-frame
mask channels + 16 first-frame latent channels; ``image_dim`` 1280, the CLIP features; ``added_kv_proj_dim`` the
inner dimension, the cross-attention's image keys and values): 4 + 4 + 4 channels, inner dimension 2 x 12."""
I2V_TEXT_LEN = 512  # MindSpeed MM's text_len; diffusers' Wan i2v attention takes the last 512 positions as the text
I2V_IMAGE_TOKENS = 3  # MindSpeed MM's clip_token_len (257) in small


def migrated_work(work: Path, name: str) -> Path:
    """The stand-ins' directory (``model/``, ``features/``) of the migrated job ``name``."""
    return work / "i2v" if name in I2V_MIGRATED else work


def write_i2v_workdir(work: Path) -> None:
    """The tiny i2v model (seeded) and image-to-video features with MindSpeed MM's keys, as its feature extraction
    (``mindspeed_mm/tools/feature_extraction/get_sora_feature.py`` with ``wan_i2v_processor.py``) writes them:
    ``video`` ``(C, F, H, W)``, ``prompt_ids`` ``(512, D)`` and ``prompt_mask`` (padded to ``text_len``),
    ``i2v_clip_feature`` ``(N, image_dim)`` and ``i2v_vae_feature``, the first-frame mask (ones on the first latent
    frame, on 4 channels) and the first frame's latents concatenated on the channels ``(4 + C, F, H, W)``."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    WanTransformer3DModel(**TINY_WAN_I2V).save_pretrained(work / "model")
    features = work / "features"
    features.mkdir(parents=True)
    generator = torch.Generator().manual_seed(2)
    _, frames, height, width = LATENT_SHAPE
    mask = torch.zeros(4, frames, height, width)
    mask[:, 0] = 1
    lines = []
    for i in range(SAMPLES):
        sample = {
            "video": torch.randn(LATENT_SHAPE, generator=generator),
            "prompt_ids": torch.randn(I2V_TEXT_LEN, TINY_WAN["text_dim"], generator=generator),
            "prompt_mask": torch.tensor([1] * (TEXT_LEN - i % 2) + [0] * (I2V_TEXT_LEN - TEXT_LEN + i % 2)),
            "i2v_clip_feature": torch.randn(I2V_IMAGE_TOKENS, TINY_WAN_I2V["image_dim"], generator=generator),
            "i2v_vae_feature": torch.cat([mask, torch.randn(LATENT_SHAPE, generator=generator)]),
        }
        torch.save(sample, features / f"{i}.pt")
        lines.append(json.dumps({"file": f"{i}.pt", "cap": f"clip {i}"}))
    (features / "data.jsonl").write_text("\n".join(lines) + "\n")


def point_data_config(path: Path, features: Path) -> None:
    """Point the MindSpeed MM feature data config ``path`` (a copy) at ``features`` (its ``data.jsonl`` and
    feature files), as a user points it at their features; the rest of the file is kept as written."""
    data = json.loads(path.read_text())
    data["dataset_param"]["basic_parameters"] = {
        "data_path": str(features / "data.jsonl"),
        "data_folder": str(features),
    }
    path.write_text(json.dumps(data, indent=2))


def sample_index(features: Path, first: list[float]) -> int:
    """The sample whose latents begin with ``first`` (what :class:`MigratedRecorder` records per step)."""
    found = [
        i
        for i in range(SAMPLES)
        if torch.equal(
            torch.load(features / f"{i}.pt", weights_only=True)["video"].flatten()[: len(first)], torch.tensor(first)
        )
    ]
    assert len(found) == 1, (first, found)
    return found[0]


def i2v_inputs(noisy: torch.Tensor, data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's i2v conditioning of one sample's noisy latents ``(1, C, F, H, W)``, re-told from MindSpeed MM's
    ``WanDiT.forward`` (``mindspeed_mm/models/predictor/dits/wan_dit.py``, ``model_type`` i2v): the noise is drawn on
    the video latents alone (``SoraModel.forward``'s ``q_sample(latents)``), then ``x = torch.cat([x,
    i2v_vae_feature], dim=1)`` before the patch embedding, and the CLIP feature's embedding (``img_emb``) goes before
    the text's (``torch.cat([clip_embedding, prompt_emb], dim=1)``; diffusers' ``encoder_hidden_states_image``,
    which ``WanTransformer3DModel`` puts in front of the text in the same way). The loss is to the video latents'
    velocity only."""
    return torch.cat([noisy, data["i2v_vae_feature"][None]], dim=1), data["i2v_clip_feature"][None]


def _full(module: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {
        f"model.{n}": (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in module.named_parameters()
        if p.requires_grad or not trainable_only
    }


class MigratedRecorder(L.Callback):
    """For the migrated runs: each rank's loss per step (``OUTDIR/migrated_<name>.rank{R}.json``, with the names of
    the trained parameters), and on rank 0 the first step's gradients and the final weights
    (``migrated_<name>_grads.pt`` / ``migrated_<name>_final.pt``)."""

    def __init__(self, outdir: str, name: str) -> None:
        self.outdir, self.name = Path(outdir), name
        self.losses: list[float] = []
        self.firsts: list[list[float]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))
        self.firsts.append(batch["latents"].flatten()[:4].tolist())  # which sample: see sample_index

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if trainer.global_step == 0:  # full_tensor is a collective: every rank
            from torch.distributed.tensor import DTensor

            grads = {
                f"model.{n}": (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
                for n, p in pl_module.model.named_parameters()
                if p.grad is not None
            }
            if trainer.global_rank == 0:
                torch.save(grads, self.outdir / f"migrated_{self.name}_grads.pt")

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        final = _full(pl_module.model)
        trainable = sorted(f"model.{n}" for n, p in pl_module.model.named_parameters() if p.requires_grad)
        info = {"losses": self.losses, "trainable": trainable, "firsts": self.firsts}
        (self.outdir / f"migrated_{self.name}.rank{trainer.global_rank}.json").write_text(json.dumps(info))
        if trainer.global_rank == 0:
            torch.save(final, self.outdir / f"migrated_{self.name}_final.pt")


@scenario(exit_cleanly=False)
def fit_resume_cp(outdir: Path, work: str) -> None:
    from torch.distributed.tensor import DTensor

    work = Path(work)

    record: list = []
    trainer, module = _fit(work, outdir, 1, record)
    plan = {
        "units": [u.modules[0] for u in trainer.strategy.plan.units],
        "recompute": list(trainer.strategy.plan.recompute_modules),
    }
    trainer.save_checkpoint(outdir / "half.ckpt")
    trainer, module = _fit(work, outdir, 2, record, ckpt_path=str(outdir / "half.ckpt"))
    trainer.save_checkpoint(outdir / "final.ckpt")
    final = {
        f"model.{n}": (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in module.model.named_parameters()
    }
    if trainer.global_rank == 0:
        torch.save(final, outdir / "final.pt")
    cp_record: list = []
    trainer, module = _fit(work, outdir, 1, cp_record, cp=2)
    cp_final = {
        f"model.{n}": (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in module.model.named_parameters()
    }
    if trainer.global_rank == 0:
        torch.save(cp_final, outdir / "cp_final.pt")
    lora_record: list = []
    trainer, module = _fit(work, outdir, LORA_STEPS // 2, lora_record, lora=LORA)
    lora_final = {
        f"model.{n}": (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in module.model.named_parameters()
    }
    trainable = sorted(f"model.{n}" for n, p in module.model.named_parameters() if p.requires_grad)
    trainer.save_checkpoint(outdir / "lora.ckpt")
    if trainer.global_rank == 0:
        torch.save(lora_final, outdir / "lora_final.pt")
    from lightning_mm.commands.train import run_lightning_cli

    for name in {**MIGRATED, **MIGRATED_VACE}:  # the migrated corpus configs, as `lightning-mm fit --config` runs them
        run_lightning_cli(["fit", "--config", str(work / f"migrated_{name}.yaml")])
    (outdir / f"wan.rank{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "losses": record,
                "plan": plan,
                "cp_losses": cp_record,
                "lora_losses": lora_record,
                "lora_trainable": trainable,
            }
        )
    )

    (outdir / f"vace_cp.rank{trainer.global_rank}.txt").write_text(vace_context_parallel_error(work))  # last: it fails


def vace_context_parallel_error(work: Path) -> str:
    """The error of fitting the tiny VACE model (``vace_model``, ``vace_data.json``) with
    ``MMFSDP2Strategy(context_parallel_size=2)``, which ``MMWanModule.configure_model`` refuses before any step
    (``"<class>: <message>"``, ``"no error"`` where it trains)."""
    import lightning as L

    from lightning_mm import MMFSDP2Strategy
    from lightning_mm.datamodules import MMDataModule
    from lightning_mm.modules.wan_module import MMWanModule

    module = MMWanModule({"init_from_path": str(work / "vace_model")}, lr=LR, log_grad_norm=False)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=work / "run_vace_cp",
        strategy=MMFSDP2Strategy(context_parallel_size=2),
    )
    try:
        trainer.fit(module, datamodule=MMDataModule.from_config(work / "vace_data.json", batch_size=1))
    except Exception as error:  # recorded whatever it is: the test names the one expected
        return f"{type(error).__name__}: {error}"
    return "no error"


if __name__ == "__main__":
    scenario_kit.main()

"""Tiny Hugging Face models for the Transformers-integration tests, and their 2-rank scenarios.

    python tests/scenarios/hf_scenarios.py SCENARIO OUTDIR --arg ckptdir=CKPTDIR     (tests/helpers/scenario_kit.py)

``CKPTDIR`` holds the tiny checkpoints that :func:`save_tiny_checkpoints` wrote (the pytest side writes them
before launching, so the two ranks never race to write files). Each scenario trains with
``Trainer(accelerator="cpu", devices=2)`` and ``MMFSDP2Strategy`` (real gloo collectives, explicit CPU mesh;
Lightning's launcher re-runs this script for rank 1) and writes what each rank observed to
``OUTDIR/SCENARIO.rank{R}.json``. Nothing here is mocked.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario  # noqa: E402

VOCAB = 128
SEQ = 16
IMAGE_TOKEN = 5

_TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)

# family -> (architecture, config kwargs). Every family of the built-in adapters, fp32, a few kB each.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama_tied": ("LlamaForCausalLM", {**_TEXT, "tie_word_embeddings": True}),
    # 63 MLP rows: shards of 32 and 31 rows (FSDP2's uneven split) must be read from the right offsets.
    "qwen2": ("Qwen2ForCausalLM", {**_TEXT, "intermediate_size": 63, "tie_word_embeddings": False}),
    "qwen3": ("Qwen3ForCausalLM", {**_TEXT, "head_dim": 8, "tie_word_embeddings": False}),
    "internvl": (
        "InternVLForConditionalGeneration",
        dict(
            text_config={"model_type": "qwen2", **_TEXT},
            image_token_id=IMAGE_TOKEN,
            downsample_ratio=0.5,
            vision_config={**_VISION, "image_size": [28, 28], "patch_size": [14, 14]},
        ),
    ),
    "qwen2_5_vl": (
        "Qwen2_5_VLForConditionalGeneration",
        dict(
            text_config={
                **_TEXT,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
            },
            vision_config=dict(
                depth=2,
                hidden_size=32,
                intermediate_size=64,
                num_heads=4,
                out_hidden_size=32,
                fullatt_block_indexes=[1],
                window_size=28,
                patch_size=14,
                spatial_merge_size=2,
                temporal_patch_size=2,
            ),
            image_token_id=IMAGE_TOKEN,
            video_token_id=6,
            vision_start_token_id=7,
            vision_end_token_id=8,
        ),
    ),
    "llava": (
        "LlavaForConditionalGeneration",
        dict(
            text_config={"model_type": "llama", **_TEXT},
            vision_config={
                **_VISION,
                "model_type": "clip_vision_model",
                "image_size": 28,
                "patch_size": 14,
                "projection_dim": 32,
            },
            image_token_id=IMAGE_TOKEN,
        ),
    ),
}


def tiny_hf_model(family: str, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised tiny model of ``family`` (the plain Transformers class)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    arch, kwargs = FAMILIES[family]
    cls = getattr(transformers, arch)
    config_cls = cls.config_class
    assert config_cls is not None and config_cls.model_type in CONFIG_MAPPING
    torch.manual_seed(seed)
    config = config_cls(**kwargs)
    config.architectures = [arch]
    return cls(config).eval()


def save_tiny_checkpoints(directory: Path, families: list[str] | None = None) -> dict[str, Path]:
    """``save_pretrained`` each family's tiny model into ``directory/<family>``.

    Qwen3 is saved in several files with a ``model.safetensors.index.json``, as large checkpoints are.
    """
    out = {}
    for i, family in enumerate(families or list(FAMILIES)):
        path = Path(directory) / family
        shard = {"max_shard_size": "20KB"} if family == "qwen3" else {}
        tiny_hf_model(family, seed=i).save_pretrained(path, **shard)
        out[family] = path
    return out


class FamilyData(torch.utils.data.Dataset):
    """``n`` fixed samples for ``family``: token ids (plus an image and its tokens for the VLMs)."""

    def __init__(self, family: str, n: int = 4) -> None:
        self.family, self.n = family, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(10, VOCAB, (SEQ,), generator=g)
        labels = ids.clone()
        sample: dict[str, torch.Tensor] = {}
        if self.family == "internvl":  # 28x28 image, 2x2 patches, pixel shuffle 0.5 -> 1 token
            ids[1] = IMAGE_TOKEN
            sample["pixel_values"] = torch.randn(3, 28, 28, generator=g)
        elif self.family == "llava":  # 2x2 patches, CLS dropped -> 4 tokens
            ids[1:5] = IMAGE_TOKEN
            sample["pixel_values"] = torch.randn(3, 28, 28, generator=g)
        elif self.family in ("qwen2_5_vl", "qwen3_vl_moe"):  # grid 1x2x2 patches, merged 2x2 -> 1 token, in start/end
            ids[1], ids[2], ids[3] = 7, IMAGE_TOKEN, 8
            sample["pixel_values"] = torch.randn(4, 3 * 2 * 14 * 14, generator=g)
            sample["image_grid_thw"] = torch.tensor([[1, 2, 2]])
        if self.family in ("qwen2_5_vl", "qwen3_vl_moe"):  # their M-RoPE takes the image tokens' positions from here
            sample["mm_token_type_ids"] = (ids == IMAGE_TOKEN).long()
        if "pixel_values" in sample:
            labels[ids == IMAGE_TOKEN] = -100
        sample.update(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
        return sample


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A collated batch as forward kwargs (Qwen2.5-VL takes its image patches flattened over the batch)."""
    batch = dict(batch)
    if "image_grid_thw" in batch:
        batch["pixel_values"] = batch["pixel_values"].flatten(0, 1)
        batch["image_grid_thw"] = batch["image_grid_thw"].flatten(0, 1)
    return batch


# ------------------------------------------------------------------------------------- 2-rank scenarios
def _dump(name: str, outdir: str, rank: int, data: dict[str, Any]) -> None:
    Path(outdir, f"{name}.rank{rank}.json").write_text(json.dumps(data, indent=1))


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _fit_family(
    family: str, ckpt: Path, extra: dict[str, Any], steps: int = 4, sharding_size: Any = "auto"
) -> tuple[dict[str, Any], int]:
    """Train ``family`` loaded from ``ckpt`` for a few steps with the default plan; observe everything."""
    import lightning as L
    import transformers
    from torch.distributed.tensor import DTensor

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from lightning_mm.hf.pending_weights import pending_pretrained
    from lightning_mm.modules import TransformersModel

    model_config = {"init_from_hf_path": str(ckpt), **extra}

    class Module(MMLightningModule):
        def model_provider(self) -> torch.nn.Module:
            return TransformersModel(model_config)

        def get_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return model_inputs(batch)

    arch = FAMILIES[family][0]
    reference = getattr(transformers, arch).from_pretrained(str(ckpt), dtype=torch.float32).eval()
    ref_state = reference.state_dict()
    ref_buffers = {n: b.clone() for n, b in reference.named_buffers()}
    obs: dict[str, Any] = {"ref_losses": []}
    losses: list[float] = []

    class Observe(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            model = pl_module.model
            params = dict(model.named_parameters())
            obs["model_class"] = type(model).__name__
            obs["plan_units"] = [list(u.modules) for u in trainer.strategy.plan.units]
            obs["plan_ignored"] = list(trainer.strategy.plan.ignored_modules)
            obs["n_params"] = len(params)
            obs["not_equal"] = [n for n, p in params.items() if not torch.equal(_full(p.detach()), ref_state[n])]
            obs["buffers_not_equal"] = [n for n, b in model.named_buffers() if not torch.equal(b, ref_buffers[n])]
            layer = next(n for n in params if ".layers.0." in n and n.endswith("q_proj.weight"))
            obs["layer_param"] = layer
            obs["layer_is_dtensor"] = isinstance(params[layer], DTensor)
            obs["layer_local_shape"] = list(params[layer].to_local().shape)
            obs["layer_global_shape"] = list(params[layer].shape)
            obs["layer_placements"] = [str(p) for p in params[layer].placements]
            obs["mesh"] = list(trainer.strategy.device_mesh.shape)
            obs["sharded"] = sorted(n for n, p in params.items() if isinstance(p, DTensor))
            obs["pending_cleared"] = pending_pretrained(model) is None
            obs["initial"] = {n: float(_full(p.detach()).double().sum()) for n, p in params.items()}

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
            with torch.no_grad():
                obs["ref_losses"].append(float(reference(**model_inputs(batch)).loss))

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            losses.append(float(loss.detach()))

    module = Module(lr=2e-2)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        strategy=MMFSDP2Strategy({"sharding_size": sharding_size}),
        callbacks=[Observe()],
    )
    loader = torch.utils.data.DataLoader(FamilyData(family, n=4), batch_size=2)
    trainer.fit(module, train_dataloaders=loader)

    model = module.model
    params = dict(model.named_parameters())
    obs["losses"] = losses
    obs["final"] = {n: float(_full(p.detach()).double().sum()) for n, p in params.items()}
    obs["grad_none"] = sorted(n for n, p in params.items() if p.grad is None)
    obs["frozen"] = sorted(n for n, p in params.items() if not p.requires_grad)
    embeddings, head = model.get_input_embeddings(), model.get_output_embeddings()
    obs["tied_same_object"] = head.weight is embeddings.weight
    obs["tied_equal"] = bool(torch.equal(_full(head.weight.detach()), _full(embeddings.weight.detach())))
    return obs, trainer.global_rank


@scenario
def families(outdir: Path, ckptdir: str) -> None:
    """Every built-in family: sharded load, first-batch loss parity, training; tied LM; frozen vision tower."""
    results: dict[str, Any] = {}
    rank = 0
    for family in FAMILIES:
        extra = {"freeze": ["model.vision_tower"]} if family == "internvl" else {}
        results[family], rank = _fit_family(family, Path(ckptdir) / family, extra)
    _dump("families", outdir, rank, results)


@scenario
def random_init(outdir: Path, ckptdir: str) -> None:
    """No checkpoint: a Llama built from ``hf_config`` alone on the meta device, initialised after sharding."""
    import lightning as L
    from torch.distributed.tensor import DTensor

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from lightning_mm.modules import TransformersModel

    class Module(MMLightningModule):
        def model_provider(self) -> torch.nn.Module:
            return TransformersModel({"hf_config": {"model_type": "llama", **_TEXT, "initializer_range": 0.05}})

    obs: dict[str, Any] = {}

    class Observe(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            model = pl_module.model
            embed = _full(model.model.embed_tokens.weight.detach())
            q = _full(model.model.layers[0].self_attn.q_proj.weight.detach())
            obs["is_dtensor"] = isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)
            obs["any_nan"] = any(bool(torch.isnan(_full(p.detach())).any()) for p in model.parameters())
            obs["norms_one"] = all(
                bool(torch.all(_full(m.weight.detach()) == 1))
                for n, m in model.named_modules()
                if type(m).__name__.endswith("RMSNorm")
            )
            obs["pad_row_zero"] = bool(torch.all(embed[0] == 0))
            obs["q_std"] = float(q.std())
            obs["inv_freq"] = model.model.rotary_emb.inv_freq.tolist()
            obs["q_full_sum"] = float(q.double().sum())

    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            losses.append(float(outputs["loss"].detach()))

    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        strategy=MMFSDP2Strategy({"sharding_size": "auto"}),
        callbacks=[Observe(), Record()],
    )
    trainer.fit(Module(lr=1e-2), train_dataloaders=torch.utils.data.DataLoader(FamilyData("llama_tied"), batch_size=2))
    obs["losses"] = losses
    _dump("random_init", outdir, trainer.global_rank, obs)


@scenario
def hsdp_freeze(outdir: Path, ckptdir: str) -> None:
    """HSDP (``sharding_size: 1``: every rank holds whole tensors) from a multi-file checkpoint, with a frozen
    decoder layer (a whole unit) and a frozen attention block (part of a unit)."""
    freeze = {"freeze": ["model.layers.{0}", "model.layers.1.self_attn"]}
    obs, rank = _fit_family("qwen3", Path(ckptdir) / "qwen3", freeze, steps=3, sharding_size=1)
    _dump("hsdp_freeze", outdir, rank, obs)


@scenario
def all_scenarios(outdir: Path, ckptdir: str) -> None:
    """Every scenario above in one launch (each launch costs seconds of process start-up)."""
    families(outdir, ckptdir)
    random_init(outdir, ckptdir)
    hsdp_freeze(outdir, ckptdir)


if __name__ == "__main__":
    scenario_kit.main()

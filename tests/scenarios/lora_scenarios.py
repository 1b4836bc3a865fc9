"""LoRA fine-tuning on 2 CPU ranks (gloo) against a one-process PEFT reference.

    python tests/scenarios/lora_scenarios.py all_runs OUTDIR --arg ckptdir=CKPTDIR     (tests/helpers/scenario_kit.py)

``CKPTDIR`` holds tiny Qwen3 and Qwen2.5-VL checkpoints written by the pytest side
(:func:`tests.scenarios.hf_scenarios.save_tiny_checkpoints`). Each run trains with ``Trainer(accelerator="cpu",
devices=2)`` and ``MMFSDP2Strategy``; every rank also trains the reference (Transformers + PEFT's ``get_peft_model``
after ``torch.manual_seed(0)``, the same AdamW, the same global batches: the mean of the two ranks' losses) and writes
what it observed to ``OUTDIR/<name>.rank{R}.json``. Nothing is mocked.
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
from tests.scenarios.hf_scenarios import FAMILIES, FamilyData, model_inputs  # noqa: E402

LR = 5e-2
STEPS = 4
BATCH = 2  # per rank
# family -> (lora setting without target_modules' values resolved, extra TransformersModel keys, FSDP2 YAML)
SETTINGS: dict[str, dict[str, Any]] = {
    "qwen3": dict(
        lora={
            "rank": 4,
            "alpha": 8,
            "target_modules": [
                "model.layers.{*}.self_attn.q_proj",
                "model.layers.{*}.self_attn.v_proj",
                "model.layers.{1}.mlp",
            ],
        },
        extra={},  # use_cache stays on: recomputation turns the cache off itself
        fsdp2={"sharding_size": "auto", "recompute_modules": ["model.layers.{*}"], "use_reentrant": True},
    ),
    "qwen2_5_vl": dict(
        lora={"rank": 4, "alpha": 16, "target_modules": ["model.language_model.layers.{*}.self_attn"]},
        extra={"freeze": ["model.visual"]},
        fsdp2={"sharding_size": "auto"},
    ),
}


def _dump(name: str, outdir: str, rank: int, data: dict[str, Any]) -> None:
    Path(outdir, f"{name}.rank{rank}.json").write_text(json.dumps(data, indent=1))


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach()


def _batch(family: str, indices: list[int]) -> dict[str, torch.Tensor]:
    data = FamilyData(family, n=16)
    return model_inputs(torch.utils.data.default_collate([data[i] for i in indices]))


def _index_of(family: str, ids: torch.Tensor) -> int:
    """Which sample of the data set a row of token ids is (the reference trains on the same global batches)."""
    data = FamilyData(family, n=16)
    return next(i for i in range(len(data)) if torch.equal(data[i]["input_ids"], ids))


def _reference(
    family: str, ckpt: Path, targets: list[str], setting: dict[str, Any], indices: list[list[list[int]]]
) -> tuple[Any, dict, list]:
    """The one-process PEFT reference: its initial adapters and its per-step, per-rank losses."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = getattr(transformers, FAMILIES[family][0]).from_pretrained(str(ckpt), dtype=torch.float32)
    lora = setting["lora"]
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], target_modules=targets))
    initial = {
        n.removeprefix("base_model.model."): p.detach().clone() for n, p in model.named_parameters() if p.requires_grad
    }
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=0.0, betas=(0.9, 0.999))
    losses = []
    for step in range(STEPS):
        per_rank = [model(**_batch(family, indices[r][step])).loss for r in range(2)]
        optimizer.zero_grad()
        ((per_rank[0] + per_rank[1]) / 2).backward()
        optimizer.step()
        losses.append([float(x) for x in per_rank])
    return model.eval(), initial, losses


def _run(
    family: str,
    ckpt: Path,
    work: Path,
    ckpt_path: str | None = None,
    save: bool = False,
    precision: str = "32-true",
    lora: dict[str, Any] | None = None,
    steps: int = STEPS,
) -> tuple[Any, ...]:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from lightning_mm.modules import TransformersModel

    setting = SETTINGS[family]
    config = {"init_from_hf_path": str(ckpt), "lora": {**setting["lora"], **(lora or {})}, **setting["extra"]}

    class Module(MMLightningModule):
        def model_provider(self) -> torch.nn.Module:
            return TransformersModel(config)

        def get_batch(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return model_inputs(batch)

    obs: dict[str, Any] = {"losses": [], "indices": []}

    class Observe(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            model = pl_module.model
            obs["initial"] = {n: _full(p).clone() for n, p in model.named_parameters()}
            obs["trainable"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
            obs["plan"] = trainer.strategy.plan.describe()
            obs["plan_ignored"] = list(trainer.strategy.plan.ignored_modules)
            optimizer = trainer.optimizers[0]
            obs["optimizer_params"] = sum(p.numel() for g in optimizer.param_groups for p in g["params"])

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
            obs["indices"].append([_index_of(family, row) for row in batch["input_ids"]])

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            obs["losses"].append(float(outputs["loss"].detach()))

    callbacks: list[Any] = [Observe()]
    if save:
        callbacks.append(
            ModelCheckpoint(dirpath=work / "ckpt", filename="{step}", every_n_train_steps=2, save_top_k=-1)
        )
    module = Module(lr=LR)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=steps,
        logger=False,
        enable_checkpointing=save,
        precision=precision,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        strategy=MMFSDP2Strategy(setting["fsdp2"]),
        callbacks=callbacks,
    )
    loader = torch.utils.data.DataLoader(FamilyData(family, n=8), batch_size=BATCH)  # 2 steps an epoch: step 2 ends one
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    optimizer = trainer.optimizers[0]
    obs["optimizer_state"] = sum(
        _full(v).numel()
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.ndim > 0
    )
    return module, trainer, obs


def _family(family: str, ckptdir: str, outdir: str, resume: bool) -> None:
    """Train ``family`` with LoRA against the PEFT reference; exports; ``dcp-to-hf --merge-lora`` of the last
    checkpoint; with ``resume``, resume from the step-2 checkpoint."""
    import transformers
    from peft import PeftModel

    from lightning_mm.hf.lora import lora_parameter_names
    from lightning_mm.hf.lora_export import save_lora_adapters, save_merged_model

    ckpt = Path(ckptdir) / family
    work = Path(outdir) / family
    module, trainer, obs = _run(family, ckpt, work, save=True)
    rank = trainer.global_rank
    model = module.model
    adapters = lora_parameter_names(model)
    targets = sorted({n.split(".lora_")[0] for n in adapters})
    import torch.distributed as dist

    indices: list[Any] = [None, None]
    dist.all_gather_object(indices, obs["indices"])  # each rank's batches, step by step
    ref_model, ref_initial, ref_losses = _reference(family, ckpt, targets, SETTINGS[family], indices)

    final = {n: _full(p) for n, p in model.named_parameters()}
    ref_start = {n.removeprefix("base_model.model."): p for n, p in ref_model.named_parameters()}
    result: dict[str, Any] = {
        "losses": obs["losses"],
        "ref_losses": [step[rank] for step in ref_losses],
        "adapters": adapters,
        "trainable": obs["trainable"],
        "changed": sorted(n for n in final if not torch.equal(final[n], obs["initial"][n])),
        "base_not_loaded": sorted(
            n for n in final if n not in adapters and not torch.equal(obs["initial"][n], ref_start[n])
        ),
        "initial_not_peft": sorted(n for n in adapters if not torch.equal(obs["initial"][n], ref_initial[n])),
        "plan": obs["plan"],
        "plan_ignored": obs["plan_ignored"],
        "optimizer_params": obs["optimizer_params"],
        "optimizer_state": obs["optimizer_state"],
        "adapter_numel": sum(final[n].numel() for n in adapters),
    }
    # The trained model against the trained reference, PEFT's loading of the exported adapters, and Transformers'
    # loading of the merged export: logits on one fixed batch.
    data = FamilyData(family, n=16)
    raw = torch.utils.data.default_collate([data[0], data[1]])
    batch = model_inputs(raw)
    model.eval()
    with torch.no_grad():  # through the FSDP root, as Lightning runs a step
        logits = trainer.strategy.predict_step(raw, 0).logits
        ref_logits = ref_model(**batch).logits
    save_lora_adapters(model, work / "adapters", base_model_name_or_path=str(ckpt))
    save_merged_model(model, work / "merged")
    cls = getattr(transformers, FAMILIES[family][0])

    def rel(a: torch.Tensor) -> float:
        return float((a - logits).abs().max() / logits.abs().max())

    result["ref_logits_rel"] = rel(ref_logits)
    if rank == 0:
        base = cls.from_pretrained(str(ckpt), dtype=torch.float32)
        peft = PeftModel.from_pretrained(base, str(work / "adapters")).eval()
        merged = cls.from_pretrained(str(work / "merged"), dtype=torch.float32).eval()
        with torch.no_grad():
            result["peft_logits_rel"] = rel(peft(**batch).logits)
            result["merged_logits_rel"] = rel(merged(**batch).logits)
            result["merged_has_lora_keys"] = any("lora" in n or "base_layer" in n for n in merged.state_dict())
    trainer.strategy.barrier()
    if rank == 0:
        from lightning_mm.commands.convert_command import main as convert_main

        result["convert_unmerged_rc"] = convert_main(
            ["dcp-to-hf", str(work / "ckpt" / "step=4.ckpt"), str(work / "unmerged")]
        )
        result["unmerged_written"] = (work / "unmerged").exists()
        assert (
            convert_main(["dcp-to-hf", str(work / "ckpt" / "step=4.ckpt"), str(work / "converted"), "--merge-lora"])
            == 0
        )
        converted = work / "converted"
        with torch.no_grad():
            result["converted_logits_rel"] = rel(cls.from_pretrained(str(converted)).eval()(**batch).logits)
    if resume:
        # Another alpha computes another function from the same adapters: refused on every rank before training
        # (this process then trains on with a fresh Trainer, below).
        from lightning_mm.hf.lora import LoRAConfigError

        try:
            _run(
                family,
                ckpt,
                work / "changed",
                ckpt_path=str(work / "ckpt" / "step=2.ckpt"),
                lora={"alpha": 2 * SETTINGS[family]["lora"]["alpha"]},
            )
        except LoRAConfigError as err:
            result["changed_alpha_error"] = str(err)
        _, _, again = _run(family, ckpt, work / "again", ckpt_path=str(work / "ckpt" / "step=2.ckpt"))
        result["resumed_losses"] = again["losses"]
        result["resumed_indices"] = again["indices"]
        result["indices"] = obs["indices"]
        # Built on the meta device from the exported adapters: they are the starting point on every shard.
        _, _, start = _run(
            family, ckpt, work / "pretrained", steps=1, lora={"pretrained_lora_path": str(work / "adapters")}
        )
        result["pretrained_not_equal"] = sorted(n for n in adapters if not torch.equal(start["initial"][n], final[n]))
    _dump(family, outdir, rank, result)


# ----------------------------------------------------------------------------- a custom (non-HF) model
class _CustomData(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(500 + i)
        return {"x": torch.randn(8, generator=g), "y": torch.randn(1, generator=g)}


def _custom_model() -> torch.nn.Module:
    from torch import nn

    from lightning_mm.modules import FSDP2Mixin, WeightInitMixin

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return h + self.fc2(torch.tanh(self.fc1(h)))

    class Custom(nn.Module, FSDP2Mixin, WeightInitMixin):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Linear(8, 16), nn.Linear(16, 1)
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = self.embed(x)
            for block in self.blocks:
                h = block(h)
            return (self.head(h) - y).pow(2).mean()

    return Custom()


CUSTOM_LORA = {"rank": 2, "alpha": 4, "target_modules": ["blocks.{*}.fc1", "blocks.{1}"]}


def _custom(outdir: str) -> None:
    """A custom MMLightningModule model: ``apply_lora`` in ``model_provider``, built on the meta device."""
    import lightning as L
    import torch.distributed as dist
    from peft import LoraConfig, inject_adapter_in_model

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from lightning_mm.hf.lora import apply_lora, lora_parameter_names

    class Module(MMLightningModule):
        def model_provider(self) -> torch.nn.Module:
            return apply_lora(_custom_model(), CUSTOM_LORA)

    obs: dict[str, Any] = {"losses": [], "indices": []}
    data = _CustomData()

    class Observe(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            obs["initial"] = {n: _full(p).clone() for n, p in pl_module.model.named_parameters()}

        def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, idx: int) -> None:
            obs["indices"].append(
                [next(i for i in range(len(data)) if torch.equal(data[i]["x"], x)) for x in batch["x"]]
            )

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            obs["losses"].append(float(outputs["loss"].detach()))

    module = Module(lr=LR)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        strategy=MMFSDP2Strategy({"sharding_size": "auto", "sub_modules_to_wrap": ["blocks.{*}"]}),
        callbacks=[Observe()],
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=BATCH))
    indices: list[Any] = [None, None]
    dist.all_gather_object(indices, obs["indices"])
    adapters = lora_parameter_names(module.model)
    targets = sorted({n.split(".lora_")[0] for n in adapters})

    reference = _custom_model()
    torch.manual_seed(0)
    inject_adapter_in_model(LoraConfig(r=2, lora_alpha=4, target_modules=targets), reference)
    initial_peft = {n: p.detach().clone() for n, p in reference.named_parameters() if ".lora_" in n}
    with torch.no_grad():  # the sharded model's random base weights, then PEFT's adapters
        for n, p in reference.named_parameters():
            p.copy_(initial_peft[n] if n in initial_peft else obs["initial"][n])
            p.requires_grad_(n in initial_peft)
    optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR, weight_decay=0.0)
    ref_losses = []
    for step in range(STEPS):
        per_rank = [
            reference(**torch.utils.data.default_collate([data[i] for i in indices[r][step]])) for r in range(2)
        ]
        optimizer.zero_grad()
        ((per_rank[0] + per_rank[1]) / 2).backward()
        optimizer.step()
        ref_losses.append(per_rank[trainer.global_rank].item())
    final = {n: _full(p) for n, p in module.model.named_parameters()}
    _dump(
        "custom",
        outdir,
        trainer.global_rank,
        {
            "losses": obs["losses"],
            "ref_losses": ref_losses,
            "adapters": adapters,
            "initial_not_peft": sorted(n for n in adapters if not torch.equal(obs["initial"][n], initial_peft[n])),
            "changed": sorted(n for n in final if not torch.equal(final[n], obs["initial"][n])),
        },
    )


def _mixed(ckptdir: str, outdir: str) -> None:
    """Qwen3 with LoRA under ``bf16-mixed``: bf16 compute, fp32 adapters and optimiser."""
    module, trainer, obs = _run("qwen3", Path(ckptdir) / "qwen3", Path(outdir) / "mixed", precision="bf16-mixed")
    params = dict(module.model.named_parameters())
    _dump(
        "mixed",
        outdir,
        trainer.global_rank,
        {
            "losses": obs["losses"],
            "indices": obs["indices"],
            "adapter_dtypes": sorted({str(params[n].dtype) for n in obs["trainable"]}),
            "changed": sorted(n for n, p in params.items() if not torch.equal(_full(p), obs["initial"][n])),
            "trainable": obs["trainable"],
            "plan": obs["plan"],
        },
    )


@scenario
def all_runs(outdir: Path, ckptdir: str) -> None:
    """Qwen3 (recomputation, checkpoints, resume, convert), Qwen2.5-VL (frozen vision tower), a custom model and
    Qwen3 under bf16-mixed, in one launch."""
    _family("qwen3", ckptdir, outdir, resume=True)
    _family("qwen2_5_vl", ckptdir, outdir, resume=False)
    _custom(outdir)
    _mixed(ckptdir, outdir)


if __name__ == "__main__":
    scenario_kit.main()

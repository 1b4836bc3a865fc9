"""Multi-process scenarios for the tests: ``python tests/scenarios/dist_scenarios.py SCENARIO OUTDIR``
(tests/helpers/scenario_kit.py).

Each scenario trains with ``Trainer(accelerator="cpu", devices=2)``; Lightning's launcher re-runs this script
for rank 1, so collectives are real (gloo, explicit CPU mesh). Every rank writes what it observed to
``OUTDIR/SCENARIO.rank{R}.json``; the pytest side asserts on those files. Nothing here is mocked.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parents[2]

from examples.custom_model.model import TinyVLM, TinyVLMConfig  # noqa: E402
from lightning_mm import MMDataModule, MMFSDP2Strategy, MMLightningModule  # noqa: E402
from lightning_mm.modules import FSDP2Mixin, MultiModalModule, WeightInitMixin  # noqa: E402
from tests.helpers import scenario_kit  # noqa: E402
from tests.helpers.scenario_kit import scenario, write_result  # noqa: E402

SEED_YAML = ROOT / "examples" / "custom_model" / "fsdp2_config.yaml"


# ------------------------------------------------------------------------------------------- data
class CaptionData(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, seq: int = 12, vocab: int = 256) -> None:
        self.n, self.seq, self.vocab = n, seq, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        # Learnable: four caption patterns, each a run of consecutive tokens.
        g = torch.Generator().manual_seed(i)
        ids = (torch.arange(self.seq) * (1 + i % 4) + 7 * (i % 4)) % self.vocab
        return {"images": torch.randn(3, 32, 32, generator=g), "input_ids": ids, "labels": ids}


class RegressionData(torch.utils.data.Dataset):
    def __init__(self, n: int = 64, dim: int = 16) -> None:
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(n, dim, generator=g)
        self.y = torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def trainer(strategy: Any, max_steps: int, **kwargs: Any) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=2,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        log_every_n_steps=1,
    )
    defaults.update(kwargs)
    return L.Trainer(strategy=strategy, **defaults)


class LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss.detach()))


class NormCheck(L.Callback):
    """Compare the strategy's gradient norm with one computed from full, gathered gradients, before clipping
    (on_before_optimizer_step) and after it (an optimizer step post-hook: the clipped grads are still there)."""

    def __init__(self) -> None:
        self.records: list[dict[str, float]] = []

    @staticmethod
    def norms(module: nn.Module) -> tuple[float, float]:
        from lightning_mm.core.grad_clip import total_grad_norm

        grads = [full(p.grad).double() for p in module.parameters() if p.grad is not None]
        reference = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        return float(total_grad_norm(list(module.parameters()))), reference

    def on_train_start(self, trainer: L.Trainer, pl_module: Any) -> None:
        def after_clipping(*_: Any) -> None:
            ours, reference = self.norms(pl_module)
            self.records[-1].update(after=ours, after_reference=reference)

        trainer.optimizers[0].register_step_post_hook(after_clipping)  # grads stay until the next zero_grad

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        ours, reference = self.norms(pl_module)
        self.records.append({"before": ours, "before_reference": reference})


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def dump(name: str, outdir: str, rank: int, data: dict[str, Any]) -> None:
    write_result(outdir, name, data, rank)


# --------------------------------------------------------------------------- seed YAML on TinyVLM
class SeedModule(MMLightningModule):
    def model_provider(self) -> nn.Module:
        return TinyVLM(TinyVLMConfig())


def _watch_forward(block: nn.Module, log: list) -> None:
    """Record every run of ``block.qkv`` (recomputation included): input dtype, weight dtype, grad mode."""

    def hook(mod: nn.Module, args: tuple) -> None:
        log.append({"input": str(args[0].dtype), "weight": str(mod.weight.dtype), "grad": torch.is_grad_enabled()})

    block.qkv.register_forward_pre_hook(hook)


def _watch_reshard(layers: nn.ModuleList, log: list) -> None:
    """When layer 1's forward starts, is layer 0 (already run) resharded or still unsharded?"""

    def hook(*_: Any) -> None:
        if not log:
            group = layers[0]._get_fsdp_state()._fsdp_param_group
            log.append(str(group.fsdp_params[0].sharded_state).split(".")[-1])

    layers[1].register_forward_pre_hook(hook)


@scenario
def seed_yaml(outdir: str) -> None:
    """MindSpeed MM's fsdp2_config.yaml verbatim: shard shapes, dtypes, recompute, ignored sync, prefetch, buffers."""
    torch.manual_seed(0)
    module = SeedModule(lr=1e-2)
    calls: list = []
    reshard: list = []

    class Observe(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            model = pl_module.model
            _watch_forward(model.text_decoder.decoder.layers[0], calls)
            _watch_reshard(model.text_decoder.decoder.layers, reshard)
            self.setup_obs = {
                "qkv_local_shape": list(local(model.text_decoder.decoder.layers[0].qkv.weight).shape),
                "qkv_global_shape": list(model.text_decoder.decoder.layers[0].qkv.weight.shape),
                "embedding_is_dtensor": isinstance(model.text_decoder.embedding.weight, DTensor),
                "image_encoder_is_dtensor": any(isinstance(p, DTensor) for p in model.image_encoder.parameters()),
                "any_meta": any(local(p).is_meta for p in pl_module.parameters()),
                "norm_weight_ones": bool(torch.all(local(model.text_decoder.decoder.final_norm.weight) == 1)),
                "any_nan": any(bool(torch.isnan(local(p)).any()) for p in pl_module.parameters()),
                "shard_halves_differ": _halves_differ(model.text_decoder.decoder.layers[0].qkv.weight),
                "inv_freq": model.text_decoder.rotary_pos_emb.inv_freq.tolist(),
                "mesh": list(trainer.strategy.device_mesh.shape),
                "plan": trainer.strategy.plan.describe(),
            }

    observe = Observe()
    recorder = LossRecorder()
    norms = NormCheck()
    t = trainer(
        MMFSDP2Strategy(fsdp2_config=str(SEED_YAML)),
        max_steps=6,
        callbacks=[observe, recorder, norms],
        gradient_clip_val=0.5,
    )
    t.fit(module, datamodule=MMDataModule(train_dataset=CaptionData(), batch_size=4))

    model = module.model
    units = {id(m): n for n, m in model.named_modules()}
    layers = model.text_decoder.decoder.layers
    fwd = [[units.get(id(m), "?") for m in _prefetch_modules(layers[0], "forward")]]
    bwd = [[units.get(id(m), "?") for m in _prefetch_modules(layers[1], "backward")]]
    observed_order = [
        t.strategy.sharded_run.sharded.prefetch.name(u) for u in t.strategy.sharded_run.sharded.prefetch.order
    ]
    dump(
        "seed_yaml",
        outdir,
        t.global_rank,
        {
            **observe.setup_obs,
            "forward_calls_layer0": len(calls),
            "forward_calls_with_grad": sum(c["grad"] for c in calls),
            "dtypes": calls[0],
            "losses": recorder.losses,
            "image_encoder_weights": [float(p.detach().double().sum()) for p in model.image_encoder.parameters()],
            "layer0_full_sum": float(full(layers[0].qkv.weight).detach().double().sum()),
            "prefetch_forward_layer0": fwd[0],
            "prefetch_backward_layer1": bwd[0],
            "prefetch_order": observed_order,
            "norms": norms.records,
            "layer0_state_in_layer1_forward": reshard[0],
            "optimizer_groups": [
                {
                    "fused": j in t.strategy.fused_steps.groups(t.optimizers[0]),  # chosen (not written into g)
                    "dtensor": sorted({isinstance(p, DTensor) for p in g["params"]}),
                    "size": len(g["params"]),
                }
                for j, g in enumerate(t.optimizers[0].param_groups)
            ],
        },
    )


def _halves_differ(weight: torch.Tensor) -> bool:
    """Meta-device init must give each shard its own random values (not the same draw on every rank)."""
    whole = full(weight).detach()
    half = whole.shape[0] // 2
    return not torch.equal(whole[:half], whole[half:])


@scenario
def hsdp_meta_init(outdir: str) -> None:
    """HSDP replicas get identical initial weights even when the ranks' RNGs differ; ignored modules too."""
    torch.manual_seed(100 + int(os.environ.get("LOCAL_RANK", "0")))  # deliberately different per rank
    seen: dict[str, Any] = {}

    class Observe(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            model = pl_module.model
            seen["mesh"] = list(trainer.strategy.device_mesh.shape)
            seen["layer_sum"] = float(full(model.text_decoder.decoder.layers[0].qkv.weight).double().sum())
            seen["ignored_sum"] = float(model.image_encoder.patch.weight.double().sum())
            seen["norm_ones"] = bool(torch.all(local(model.text_decoder.decoder.final_norm.weight) == 1))

    config = {
        "sharding_size": 1,
        "sub_modules_to_wrap": ["text_decoder.decoder.layers.{*}"],
        "ignored_modules": ["image_encoder"],
    }
    t = trainer(MMFSDP2Strategy(config), max_steps=1, callbacks=[Observe()])
    t.fit(SeedModule(), datamodule=MMDataModule(train_dataset=CaptionData(), batch_size=4))
    dump("hsdp_meta_init", outdir, t.global_rank, seen)


def _prefetch_modules(module: nn.Module, kind: str) -> list[nn.Module]:
    state = module._get_fsdp_state()
    states = state._states_to_forward_prefetch if kind == "forward" else state._states_to_backward_prefetch
    return [s._modules[0] for s in states]


# ------------------------------------------------------------------------ parity with DDP (plain LM)
class MLP(L.LightningModule):
    """A plain LightningModule: config paths are relative to it."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.layers = nn.ModuleList([nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 32)])
        self.head = nn.Linear(32, 1)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


@scenario
def parity(outdir: str) -> None:
    """Same model, seed and data under DDP and MMFSDP2 (FSDP, then HSDP); with clipping and accumulation."""
    results: dict[str, Any] = {}
    common = dict(gradient_clip_val=0.05, accumulate_grad_batches=2)
    loader = lambda: torch.utils.data.DataLoader(RegressionData(), batch_size=4)  # noqa: E731
    rank = 0
    for name, strategy in [
        ("ddp", "ddp"),
        ("fsdp", MMFSDP2Strategy({"sharding_size": "auto", "sub_modules_to_wrap": ["layers.{*}"]})),
        ("hsdp", MMFSDP2Strategy({"sharding_size": 1, "sub_modules_to_wrap": ["layers.{0-2}", "head"]})),
    ]:
        recorder = LossRecorder()
        norms = NormCheck()
        module = MLP()
        t = trainer(strategy, max_steps=6, callbacks=[recorder, norms], **common)
        t.fit(module, train_dataloaders=loader())
        rank = t.global_rank
        weights = {n: full(p).detach().double().sum().item() for n, p in module.named_parameters()}
        results[name] = {"losses": recorder.losses, "weights": weights, "norms": norms.records}
        if name == "hsdp":
            w = module.layers[0].weight
            results[name]["mesh"] = list(t.strategy.device_mesh.shape)
            results[name]["mesh_names"] = list(t.strategy.device_mesh.mesh_dim_names)
            results[name]["placements"] = [str(p) for p in w.placements]
            results[name]["local_shape"] = list(local(w).shape)
    dump("parity", outdir, rank, results)


# ---------------------------------------------------------------- accumulation skips reduce-scatter
@scenario
def accumulation(outdir: str) -> None:
    observed: list[dict[str, Any]] = []

    class GradState(L.Callback):
        def on_after_backward(self, trainer: L.Trainer, pl_module: Any) -> None:
            w = pl_module.layers[0].weight
            observed.append({"sharded_grad": w.grad is not None, "batch": trainer.fit_loop.batch_idx})

    module = MLP()
    strategy = MMFSDP2Strategy({"sharding_size": "auto", "sub_modules_to_wrap": ["layers.{*}"]})
    t = trainer(strategy, max_steps=2, accumulate_grad_batches=3, callbacks=[GradState()])
    t.fit(module, train_dataloaders=torch.utils.data.DataLoader(RegressionData(), batch_size=4))
    dump("accumulation", outdir, t.global_rank, {"observed": observed})


# ---------------------------------------------------------- tied weights, custom hook, exec order
class TiedLM(MultiModalModule, FSDP2Mixin, WeightInitMixin):
    """Embedding and output layer share one weight; layers run in reverse of their registration order."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList([nn.Linear(32, 32) for _ in range(3)])
        self.out = nn.Linear(32, 64, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        logits = self.out(x)
        return F.cross_entropy(logits.reshape(-1, 64), ids.reshape(-1))


class TiedModule(MMLightningModule):
    def model_provider(self) -> nn.Module:
        return TiedLM()


class IdsData(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))


@scenario
def tied(outdir: str) -> None:
    torch.manual_seed(0)
    module = TiedModule(lr=1e-2)
    recorder = LossRecorder()
    config = {
        "sharding_size": "auto",
        "sub_modules_to_wrap": ["embed", "out", "layers.{*}"],
        "num_to_forward_prefetch": 1,
        "num_to_backward_prefetch": 1,
    }
    t = trainer(MMFSDP2Strategy(config), max_steps=8, callbacks=[recorder])
    t.fit(module, train_dataloaders=torch.utils.data.DataLoader(IdsData(), batch_size=8))
    model = module.model
    names = {id(m): n for n, m in model.named_modules()}
    dump(
        "tied",
        outdir,
        t.global_rank,
        {
            "still_tied": model.out.weight is model.embed.weight,
            "plan_units": [list(u.modules) for u in t.strategy.plan.units],
            "notes": list(t.strategy.plan.notes),
            "losses": recorder.losses,
            "order": [
                t.strategy.sharded_run.sharded.prefetch.name(u) for u in t.strategy.sharded_run.sharded.prefetch.order
            ],
            "forward_prefetch": {
                names.get(id(m), "?"): [names.get(id(x), "?") for x in _prefetch_modules(m, "forward")]
                for m in model.layers
            },
        },
    )


class CustomShardLM(TiedLM):
    calls: list = []

    def _fully_shard(self, fsdp2_kwargs: dict | None = None, fsdp2_config: Any = None) -> None:
        from torch.distributed.fsdp import fully_shard

        CustomShardLM.calls.append(
            {"config_attr": self.fsdp2_config is fsdp2_config, "mesh": list(fsdp2_kwargs["mesh"].shape)}
        )
        fully_shard([self.embed, self.out], **fsdp2_kwargs)
        for layer in self.layers:
            fully_shard(layer, **fsdp2_kwargs)


class CustomModule(MMLightningModule):
    def model_provider(self) -> nn.Module:
        return CustomShardLM()


@scenario
def custom_fully_shard(outdir: str) -> None:
    module = CustomModule(lr=1e-2)
    t = trainer(MMFSDP2Strategy({"sharding_size": "auto"}), max_steps=2)
    t.fit(module, train_dataloaders=torch.utils.data.DataLoader(IdsData(), batch_size=8))
    model = module.model
    dump(
        "custom_fully_shard",
        outdir,
        t.global_rank,
        {
            "calls": CustomShardLM.calls,
            "layer_local_shape": list(local(model.layers[0].weight).shape),
            "still_tied": model.out.weight is model.embed.weight,
        },
    )


# ------------------------------------------------------------------- byte accounting, measured
class AccountedModel(L.LightningModule):
    """Root-held embedding, three layers and a head as units, a trainable ignored encoder."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))
        self.vision = nn.Linear(16, 32)
        self.head = nn.Linear(32, 64)

    def training_step(self, batch: Any, idx: int) -> torch.Tensor:
        ids, feats = batch
        x = self.embed(ids) + self.vision(feats).unsqueeze(1)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), ids.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        from lightning_mm.core.optimizer import group_by_sharding

        return torch.optim.AdamW(group_by_sharding(self.parameters()), lr=1e-3)


def _bytes(tensors: Any) -> int:
    return sum(local(t).numel() * local(t).element_size() for t in tensors)


@scenario
def memory_accounting(outdir: str) -> None:
    """Bytes of parameters, gradients and AdamW state each rank really holds, next to ``per_rank_memory``."""
    from lightning_mm import FSDP2Config
    from lightning_mm.core.memory import per_rank_memory
    from lightning_mm.core.sharding_plan import build_plan

    config = {"sharding_size": "auto", "sub_modules_to_wrap": ["layers.{*}", "head"], "ignored_modules": ["vision"]}
    with torch.device("meta"):
        expected = per_rank_memory(meta := AccountedModel(), build_plan(FSDP2Config.load(config), meta, 2))
    measured: dict[str, int] = {}

    class Measure(L.Callback):
        def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
            measured["params"] = _bytes(pl_module.parameters())
            measured["grads"] = _bytes(p.grad for p in pl_module.parameters() if p.grad is not None)

        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
            state = trainer.optimizers[0].state
            measured["optimizer"] = _bytes(v for s in state.values() for k, v in s.items() if k != "step")

    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (32, 6), generator=g), torch.randn(32, 16, generator=g))
    t = trainer(MMFSDP2Strategy(config), max_steps=2, callbacks=[Measure()])
    t.fit(AccountedModel(), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=4))
    dump(
        "memory_accounting",
        outdir,
        t.global_rank,
        {
            "measured": measured,
            "expected": {
                "params": expected.params,
                "grads": expected.grads,
                "optimizer": expected.optimizer,
                "ddp_total": expected.ddp_total,
            },
        },
    )


# ------------------------------------------------------------------------- precision and offload
@scenario
def bf16_offload(outdir: str) -> None:
    """precision='bf16-mixed' with no dtypes in the YAML, and CPU offload with the non-reentrant recompute."""
    calls: list = []
    reshard: list = []

    class Observe(L.Callback):
        def on_fit_start(self, trainer: L.Trainer, pl_module: Any) -> None:
            _watch_forward(pl_module.model.text_decoder.decoder.layers[0], calls)
            _watch_reshard(pl_module.model.text_decoder.decoder.layers, reshard)

    module = SeedModule(lr=1e-3)
    config = {
        "sharding_size": "auto",
        "sub_modules_to_wrap": ["text_decoder.decoder.layers.{*}"],
        "recompute_modules": ["text_decoder.decoder.layers.{*}"],
        "use_reentrant": False,
        "offload_to_cpu": True,
        "reshard_after_forward": False,
    }
    t = trainer(MMFSDP2Strategy(config), max_steps=2, precision="bf16-mixed", callbacks=[Observe()])
    t.fit(module, datamodule=MMDataModule(train_dataset=CaptionData(), batch_size=4))
    layer = module.model.text_decoder.decoder.layers[0]
    group = layer._get_fsdp_state()._fsdp_param_group
    dump(
        "bf16_offload",
        outdir,
        t.global_rank,
        {
            "dtypes": calls[0],
            "forward_calls_with_grad": sum(c["grad"] for c in calls),
            "reduce_dtype": str(group.mp_policy.reduce_dtype),
            "param_dtype": str(group.mp_policy.param_dtype),
            "offload_policy": type(group.offload_policy).__name__,
            "shard_device": str(local(layer.qkv.weight).device),
            "sharded_param_dtype": str(layer.qkv.weight.dtype),
            "layer0_state_in_layer1_forward": reshard[0],
            "optimizer_groups": [
                {
                    "fused": j in t.strategy.fused_steps.groups(t.optimizers[0]),  # chosen (not written into g)
                    "dtensor": sorted({isinstance(p, DTensor) for p in g["params"]}),
                    "size": len(g["params"]),
                }
                for j, g in enumerate(t.optimizers[0].param_groups)
            ],
        },
    )


# --------------------------------------------------------------------------------- failures
class NoInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class NoInitModule(MMLightningModule):
    def model_provider(self) -> nn.Module:
        return nn.Sequential(NoInit())


class Marker(L.Callback):
    def __init__(self, outdir: str) -> None:
        self.outdir = outdir

    def on_train_batch_start(self, *args: Any) -> None:
        Path(self.outdir, "trained.marker").write_text("a training step ran")


@scenario
def uninitialised(outdir: str) -> None:
    t = trainer(MMFSDP2Strategy({"sharding_size": "auto"}), max_steps=1, callbacks=[Marker(outdir)])
    data = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
    t.fit(NoInitModule(), train_dataloaders=data)


@scenario
def bad_pattern(outdir: str) -> None:
    config = {"sharding_size": "auto", "sub_modules_to_wrap": ["text_decoder.decoder.layer.{*}"]}
    t = trainer(MMFSDP2Strategy(config), max_steps=1, callbacks=[Marker(outdir)])
    t.fit(SeedModule(), datamodule=MMDataModule(train_dataset=CaptionData(), batch_size=4))


@scenario
def bad_index(outdir: str) -> None:
    config = {"sharding_size": "auto", "recompute_modules": ["text_decoder.decoder.layers.{0-5}"]}
    t = trainer(MMFSDP2Strategy(config), max_steps=1, callbacks=[Marker(outdir)])
    t.fit(SeedModule(), datamodule=MMDataModule(train_dataset=CaptionData(), batch_size=4))


@scenario
def registered_name(outdir: str) -> None:
    """strategy='mm_fsdp2' takes its config from the LightningModule."""
    config = {"sharding_size": "auto", "sub_modules_to_wrap": ["text_decoder.decoder.layers.{*}"]}
    module = SeedModule(fsdp2_config=config)
    t = trainer("mm_fsdp2", max_steps=1)
    t.fit(module, datamodule=MMDataModule(train_dataset=CaptionData(), batch_size=4))
    dump(
        "registered_name",
        outdir,
        t.global_rank,
        {
            "strategy": type(t.strategy).__name__,
            "units": [list(u.modules) for u in t.strategy.plan.units],
        },
    )


# ------------------------------------------------------------- MMLightningModule under Lightning's DDP
def tuple_forward_step(data_iterator: Any, model: nn.Module) -> tuple[torch.Tensor, Any]:
    batch = next(data_iterator)
    return model(batch), lambda out: (out, {"doubled": 2 * out.detach()})


@scenario
def ddp_module(outdir: str) -> None:
    """MindSpeed MM's functions passed as callables (Megatron tuple form) train under plain DDP too."""
    recorder = LossRecorder()
    module = MMLightningModule(model_provider=TiedLM, forward_step=tuple_forward_step, lr=1e-2)
    t = trainer("ddp", max_steps=8, callbacks=[recorder])
    t.fit(module, train_dataloaders=torch.utils.data.DataLoader(IdsData(), batch_size=8))
    dump(
        "ddp_module",
        outdir,
        t.global_rank,
        {
            "losses": recorder.losses,
            "strategy": type(t.strategy).__name__,
            "logged": sorted(k for k in t.callback_metrics),
        },
    )


# ---------------------------------------------------------------------- mid-epoch resume of MMDataModule
class Fingerprints(L.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, float, float]] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        self.seen.append((trainer.global_step, float(batch[0].sum()), float(outputs["loss"].detach())))


@scenario
def resume_data(outdir: str) -> None:
    """MMDataModule's train loader is stateful: a mid-epoch resume continues with the next unseen batch."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(max_steps: int, ckpt_path: str | None, save: bool) -> list:
        prints = Fingerprints()
        callbacks: list = [prints]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=f"{outdir}/ckpt", every_n_train_steps=5, save_top_k=-1))
        t = trainer(
            MMFSDP2Strategy({"sharding_size": "auto", "sub_modules_to_wrap": ["layers.{*}"]}),
            max_steps=max_steps,
            callbacks=callbacks,
            enable_checkpointing=save,
        )
        data = MMDataModule(train_dataset=RegressionData(), batch_size=4, seed=7)  # 8 batches per epoch per rank
        t.fit(MLP(), datamodule=data, ckpt_path=ckpt_path)
        return [t.global_rank, prints.seen]

    rank, full_run = run(12, None, True)
    checkpoint = f"{outdir}/ckpt/epoch=0-step=5.ckpt"
    _, resumed = run(12, checkpoint, False)
    dump("resume_data", outdir, rank, {"full": full_run, "resumed": resumed})


if __name__ == "__main__":
    scenario_kit.main()

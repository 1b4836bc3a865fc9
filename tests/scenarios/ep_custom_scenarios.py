"""Expert-parallel cases beyond the built-in Transformers dispatch, run inside ``tests/scenarios/ep_scenarios.py``'s
launch.

* :data:`CUSTOM_CASES`: a plain torch MoE language model (:class:`CustomMoELM`) whose experts module has its own
  call shape (``experts(x [batch, seq, hidden], scores [batch, seq, experts])``, routing inside the module) plugs
  its dispatch in through ``FSDP2Mixin.expert_parallel_forward``; trained with EP 2 on 4 ranks and compared with
  the same model trained in one process without expert parallelism (:func:`custom_reference`).
* :data:`ZERO_ROUTER`: a tiny Qwen3-MoE whose routers are all zero trained through ``TransformersModel`` with EP 4:
  every token picks the same two experts (ties), so two of the four ranks receive no token in the first step.
  This is the benchmark's deadlock (a rank whose experts get no token skipped the dispatching all-to-all's
  backward and met the others' all-to-all with FSDP's reduce-scatter) in a real training step.
* :data:`HUB_LAYOUT_CASES`: Qwen3-MoE saved one tensor per expert (its Hub layout) trained with EP 2 and EP 4:
  which expert pieces each rank reads, and the losses.
* :data:`ROUTED_KERNELS`: the routed forward and backward over each of Transformers' experts kernels.

Each case runs under a watchdog: a rank still inside a case after :data:`CASE_LIMIT_S` seconds records the error
(with every thread's stack) and exits, so a deadlock fails the test instead of hanging the launch.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_mm.hf.mixins import FSDP2Mixin
from tests.helpers.parity import Case

DEVICES = 4
CASE_LIMIT_S = int(os.environ.get("EP_CASE_LIMIT_S", "240"))

# ------------------------------------------------------------------------------------ the custom MoE model
VOCAB, HIDDEN, INNER, EXPERTS, TOP_K, LAYERS, SEQ = 64, 16, 24, 4, 2, 2, 12
CUSTOM_LR = 0.5
"""Plain SGD (no momentum): a wrong gradient scale shows in the losses, which AdamW's normalisation would hide."""
CUSTOM_SAMPLES = 32  # 4 steps of 4 ranks x 2 samples
CUSTOM_PER_RANK = 2


class CustomExperts(nn.Module):
    """Experts with a call shape of their own: ``forward(x [B, S, H], scores [B, S, E]) -> [B, S, H]``.

    Routing happens inside (softmax, top-k, renormalised); the weights are stacked along a leading experts
    dimension (input projection stored ``[E, H, I]``, i.e. transposed against Transformers' layout, with biases).
    :meth:`compute` is the part that runs on the experts' owners: Transformers' call shape over the experts this
    module holds (all of them, or its local ones under expert parallelism).
    """

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.w_in = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INNER) * 0.2)
        self.b_in = nn.Parameter(torch.randn(EXPERTS, INNER) * 0.1)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, INNER, HIDDEN) * 0.2)

    @staticmethod
    def route(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = scores.float().softmax(dim=-1)
        weights, index = probs.topk(TOP_K, dim=-1)
        return index, (weights / weights.sum(dim=-1, keepdim=True)).to(scores.dtype)

    def compute(self, tokens: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` tokens, ``[T, k]`` expert indices into this module's experts, ``[T, k]`` weights."""
        out = torch.zeros_like(tokens)
        for e in range(self.w_in.shape[0]):
            rows, slot = torch.nonzero(index == e, as_tuple=True)
            if rows.numel() == 0:
                continue
            h = torch.nn.functional.gelu(tokens[rows] @ self.w_in[e] + self.b_in[e]) @ self.w_out[e]
            out = out.index_add(0, rows, h * weights[rows, slot].unsqueeze(-1))
        return out

    def forward(self, x: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        index, weights = self.route(scores)
        b, s, h = x.shape
        return self.compute(x.reshape(-1, h), index.reshape(-1, TOP_K), weights.reshape(-1, TOP_K)).view(b, s, h)


class CustomBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.mix = nn.Linear(HIDDEN, HIDDEN)  # with the previous token's state: tokens interact
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = CustomExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        previous = torch.nn.functional.pad(x, (0, 0, 1, 0))[:, :-1]
        x = x + torch.tanh(self.mix(previous))
        h = self.norm(x)
        return x + self.experts(h, self.gate(h))


class CustomMoELM(nn.Module, FSDP2Mixin):
    """A small plain-torch MoE language model; under expert parallelism its experts dispatch through the hook."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(CustomBlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.ep_forward_calls: list[str] = []

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1))

    def expert_parallel_forward(self, path: str, module: nn.Module, ep: Any) -> Callable[..., torch.Tensor]:
        from lightning_mm.core.expert_parallel import routed_forward

        assert isinstance(module, CustomExperts) and module.w_in.shape[0] == ep.experts_per_rank
        self.ep_forward_calls.append(path)
        routed = routed_forward(module, module.compute, ep)

        def forward(x: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            index, weights = module.route(scores)
            b, s, h = x.shape
            return routed(x.reshape(-1, h), index.reshape(-1, TOP_K), weights.reshape(-1, TOP_K)).view(b, s, h)

        return forward


def custom_model() -> CustomMoELM:
    torch.manual_seed(1234)
    return CustomMoELM()


def custom_sample(index: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(100 + index))


class CustomData(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return CUSTOM_SAMPLES

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": custom_sample(i), "index": i}


CUSTOM_CASES = [
    Case("custom_moe-ep2", "custom_moe", {"expert_parallel_size": 2, "moe_modules": ["blocks.{*}.experts"]}, steps=4),
    Case(
        "custom_moe-ep2-whole",
        "custom_moe",
        {"expert_parallel_size": 2, "moe_modules": ["blocks.{*}.experts"], "reshard_local_experts": False},
        steps=4,
    ),
]


def _fit_custom(case: Case, outdir: Path) -> None:
    import lightning as L

    from lightning_mm import MMFSDP2Strategy, MMLightningModule
    from tests.scenarios.parity_scenarios import _dump

    record: dict[str, Any] = {"losses": [], "indices": [], "steps": []}

    class Module(MMLightningModule):
        def __init__(self) -> None:
            super().__init__(lr=CUSTOM_LR, log_grad_norm=False)
            self.model = custom_model()  # built here, with real weights: every rank starts from the same ones

        def get_batch(self, batch: dict[str, Any]) -> dict[str, Any]:
            record["indices"].append(batch["index"].tolist())
            return {"input_ids": batch["input_ids"]}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            record["losses"].append(float(loss.detach()))
            record["steps"].append(self.trainer.global_step)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=CUSTOM_LR)

    module = Module()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=DEVICES,
        max_steps=case.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=outdir,
        strategy=MMFSDP2Strategy({"sharding_size": "auto", "sub_modules_to_wrap": ["blocks.{*}"], **case.fsdp2}),
    )
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(CustomData(), batch_size=CUSTOM_PER_RANK))
    model = module.model
    record["hook_calls"] = list(model.ep_forward_calls)
    record["local_experts"] = [int(b.experts.w_in.shape[0]) for b in model.blocks]
    _dump(case, outdir, trainer.global_rank, {"parts": [record], "error": None})


def custom_reference(steps: list[list[list[int]]]) -> list[float]:
    """The same model trained in one process without expert parallelism: per micro-batch the mean of the ranks'
    losses (data parallelism averages the ranks' gradients), with the same SGD."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = custom_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=CUSTOM_LR)
        losses = []
        for micro in steps:
            for ranks in micro:
                optimizer.zero_grad()
                per_rank = [model(torch.stack([custom_sample(i) for i in indices])) for indices in ranks]
                total = sum(per_rank) / len(per_rank)
                total.backward()
                losses.append(float(total.detach()))
            optimizer.step()
        return losses
    finally:
        torch.set_num_threads(threads)


# ------------------------------------------------------------------- Qwen3-MoE with all routers at zero
ZERO_ROUTER = Case(
    "qwen3_moe-ep4-zero-router",
    "qwen3_moe",
    {"expert_parallel_size": 4, "moe_modules": ["model.layers.{*}.mlp.experts"]},
    steps=3,
)


def _on_rank0_first(write: Callable[[], Any]) -> None:
    """``write()`` on rank 0, seen by every rank (Transformers saves on rank 0 alone once torch.distributed is up;
    without a process group yet this process is the launcher, and the other ranks start with the next Trainer)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_rank() == 0:
            write()
        dist.barrier()
    elif int(os.environ.get("LOCAL_RANK", "0")) == 0:
        write()


def zero_router_checkpoint(directory: Path) -> Path:
    """``directory/qwen3_moe``: the tiny Qwen3-MoE with every router weight zero."""
    from tests.helpers.moe_models import tiny_moe_model

    path = directory / "qwen3_moe"
    model = tiny_moe_model("qwen3_moe", seed=10)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.weight.zero_()
    model.save_pretrained(path, save_original_format=False)
    return path


def _zero_router(outdir: Path) -> None:
    from tests.scenarios.parity_scenarios import _finish, _fit

    ckpts = outdir / "zero_router_ckpt"
    _on_rank0_first(lambda: zero_router_checkpoint(ckpts))
    chosen: list[list[int]] = []

    def record_experts(module: nn.Module, args: tuple[Any, ...]) -> None:
        # the first step's MoE layers: the (global) experts this rank's tokens picked
        if type(module).__name__.endswith("MoeExperts") and len(chosen) < 2 and len(args) == 3:
            chosen.append(sorted(set(args[1].reshape(-1).tolist())))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(record_experts)
    try:
        record, (trainer, module) = _fit(ZERO_ROUTER, ckpts, outdir, ZERO_ROUTER.steps, devices=DEVICES)
    finally:
        handle.remove()
    record["chosen_experts"] = chosen
    _finish(ZERO_ROUTER, outdir, [record], trainer, module)


# ---------------------------------------------------- the routed forward over each Transformers experts kernel
IMPLEMENTATIONS = ("eager", "grouped_mm", "batched_mm")
ROUTED_KERNELS = Case("qwen3_moe-ep4-routed-kernels", "qwen3_moe")
"""The routed forward and backward (EP 4, no Trainer) with each of Transformers' experts implementations, once with
a routing that leaves the last rank's experts without a token and once with every expert busy, against the unsplit
module with the same implementation. ``TransformersModel`` models run ``eager`` (Transformers' support check reads
the source of the class's module, and the adapters' module does not name its decorator); Transformers' own models
default to ``grouped_mm``."""


def _routed_kernels(outdir: Path) -> None:
    import torch.distributed as dist

    from lightning_mm.core.expert_parallel import ExpertGroup, routed_forward, split_experts
    from tests.helpers.moe_models import tiny_moe_model
    from tests.scenarios.parity_scenarios import _dump

    rank = dist.get_rank()
    results: dict[str, Any] = {}
    for impl in IMPLEMENTATIONS:
        full, local = (tiny_moe_model("qwen3_moe").model.layers[0].mlp.experts for _ in range(2))
        full.config._experts_implementation = impl  # (the two share one config)
        ep = ExpertGroup(dist.group.WORLD, rank, DEVICES, full.num_experts)
        split_experts(local, "experts", ep)
        forward = routed_forward(local, local.forward, ep)
        for routing in ("idle", "busy"):
            gen = torch.Generator().manual_seed(10 * rank + len(routing))
            tokens, k = 6, 2
            hidden = torch.randn(tokens, full.hidden_dim, generator=gen)
            choices = full.num_experts - ep.experts_per_rank if routing == "idle" else full.num_experts
            index = torch.stack([torch.randperm(choices, generator=gen)[:k] for _ in range(tokens)])
            weights = torch.rand(tokens, k, generator=gen)
            runs = []
            for module, run in ((full, full.forward), (local, forward)):
                for p in module.parameters():
                    p.grad = None
                x, w = hidden.clone().requires_grad_(True), weights.clone().requires_grad_(True)
                out = run(x, index, w)
                (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
                runs.append((out.detach(), x.grad, w.grad, [p.grad.clone() for p in module.parameters()]))
            (ref_out, ref_x, ref_w, ref_grads), (out, x_grad, w_grad, grads) = runs
            for g in ref_grads:  # the next collective: it meets an all-to-all of a rank that skipped one
                dist.all_reduce(g)
            first, count = ep.first_expert, ep.experts_per_rank
            summed = torch.cat([g[first : first + count].reshape(-1) for g in ref_grads])
            local_flat = torch.cat([g.reshape(-1) * DEVICES for g in grads])  # scaled by 1/ep in the routed forward
            diff = lambda a, b: float((a - b).abs().max()) if a.numel() else 0.0  # noqa: E731
            results[f"{impl}-{routing}"] = {
                "out": diff(out, ref_out),
                "x_grad": diff(x_grad, ref_x),
                "w_grad": diff(w_grad, ref_w),
                "expert_grads": diff(local_flat, summed) / max(float(summed.abs().max()), 1e-30),
                "finite": bool(all(torch.isfinite(g).all() for g in grads)),
            }
    _dump(ROUTED_KERNELS, outdir, rank, {"error": None, "parts": [results]})


# ------------------------------------------------------- pretrained weights stored one tensor per expert (Hub layout)
HUB_LAYOUT_CASES = [
    Case(
        "qwen3_moe-hub-layout-ep2",
        "qwen3_moe",
        {"expert_parallel_size": 2, "moe_modules": ["model.layers.{*}.mlp.experts"]},
        steps=3,
    ),
    Case(
        "qwen3_moe-hub-layout-ep4-whole",
        "qwen3_moe",
        {"expert_parallel_size": 4, "moe_modules": ["model.layers.{*}.mlp.experts"], "reshard_local_experts": False},
        steps=3,
    ),
]
"""Qwen3-MoE saved in its original Hub layout (``mlp.experts.{e}.gate_proj.weight`` etc., which Transformers 5 fuses
into ``gate_up_proj``/``down_proj`` on load), trained with EP through ``TransformersModel``: each rank reads only the
pieces of the experts it holds; losses against one-process Transformers' ``from_pretrained`` of the same files."""


def hub_layout_checkpoint(directory: Path) -> Path:
    from tests.helpers.moe_models import tiny_moe_model

    path = directory / "qwen3_moe"
    tiny_moe_model("qwen3_moe", seed=10).save_pretrained(path, save_original_format=True)
    return path


def _hub_layout(case: Case, outdir: Path) -> None:
    from lightning_mm.hf import loading as hf_loading
    from tests.scenarios.parity_scenarios import _finish, _fit

    ckpts = outdir / "hub_layout_ckpt"
    _on_rank0_first(lambda: hub_layout_checkpoint(ckpts))
    read: list[list[Any]] = []
    original = hf_loading.read_region

    def recording(directory: Any, files: Any, info: Any, offsets: Any, sizes: Any, out: Any) -> None:
        if ".experts." in info.key:
            read.append([info.key, list(offsets), list(sizes)])
        original(directory, files, info, offsets, sizes, out)

    hf_loading.read_region = recording
    try:
        record, (trainer, module) = _fit(case, ckpts, outdir, case.steps, devices=DEVICES)
    finally:
        hf_loading.read_region = original
    record["expert_reads"] = read
    _finish(case, outdir, [record], trainer, module)


# --------------------------------------------------------------------------------------------- the launch
def _watched(case: Case, outdir: Path, run: Callable[[], None]) -> None:
    """``run`` with a deadline: past it, record the error with every thread's stack and leave the process."""
    from tests.scenarios.parity_scenarios import _dump, _guarded

    def fire() -> None:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("LOCAL_RANK", "0"))
        stacks = outdir / f"{case.name}.stacks.rank{rank}.txt"
        with open(stacks, "w") as f:
            faulthandler.dump_traceback(file=f, all_threads=True)
        message = f"{case.name}: rank {rank} still in the case after {CASE_LIMIT_S} s (deadlock?); its stacks:\n"
        _dump(case, outdir, rank, {"parts": [], "error": message + stacks.read_text()[-3000:]})
        print(message + stacks.read_text()[-1500:], file=sys.stderr, flush=True)
        os._exit(3)

    timer = threading.Timer(CASE_LIMIT_S, fire)
    timer.daemon = True
    timer.start()
    try:
        _guarded(case, outdir, run)
    finally:
        timer.cancel()


def run_cases(outdir: Path, only: set[str] | None = None) -> None:
    """Every case of this file, one after the other (``only``: the names to run)."""
    for case in CUSTOM_CASES:
        if not only or case.name in only:
            _watched(case, outdir, lambda case=case: _fit_custom(case, outdir))
    if not only or ZERO_ROUTER.name in only:
        _watched(ZERO_ROUTER, outdir, lambda: _zero_router(outdir))
    for case in HUB_LAYOUT_CASES:
        if not only or case.name in only:
            _watched(case, outdir, lambda case=case: _hub_layout(case, outdir))
    if not only or ROUTED_KERNELS.name in only:  # after a Trainer has set up the process group
        _watched(ROUTED_KERNELS, outdir, lambda: _routed_kernels(outdir))

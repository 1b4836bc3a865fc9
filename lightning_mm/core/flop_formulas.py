"""FLOPs of one training step from plain numbers (the formulas; Lightning- and Transformers-free).

What is counted: the matrix multiplications (linear layers, patch-embedding convolutions whose stride is their
kernel, the two products of attention). Elementwise work (norms, activations, rotary, softmax, the loss) is not:
it is a small share of a model of real size and what ``torch.utils.flop_counter.FlopCounterMode`` leaves out too.

* A linear layer of ``n`` tokens is ``2 * n * d_in * d_out`` FLOPs forward; its backward is the same again for the
  gradient of its input (only when something before it requires a gradient) and again for the gradient of its
  weight (only when the weight trains). A fully trained layer is 3x forward; a frozen one whose input needs its
  gradient (LoRA's base weights after the first adapter) 2x; one with nothing to differentiate 1x.
* Attention of one sequence of ``L`` tokens, ``h`` heads of width ``d`` (``d_v`` for the values) is
  ``2 * L * K * h * (d + d_v)`` forward with ``K = L`` keys per query (``min(L, window)`` for a sliding window).
  Causality is not halved, as a dense kernel (and ``FlopCounterMode``, and torchtitan's and Megatron's counts) has
  it. Packed rows count each sample on its own (``sum L_i^2``, as varlen kernels compute it), never the row's
  ``(sum L_i)^2``. Its backward is 2x forward when a gradient flows through it.
* Model FLOPs are those of one forward and backward. Recomputation replays a block's forward in the backward
  (the non-reentrant checkpoint all of it but its final product, see :class:`Block`): that
  is hardware FLOPs (``StepFlops.hardware``) and never model FLOPs (``StepFlops.model``), so MFU stays comparable
  between runs with and without it.

A model is described as :class:`Block` s in execution order; each block a sequence of stages, each stage the
:class:`Op` s that read the same input (``q``, ``k``, ``v``; ``gate``, ``up``). A gradient "flows" from the first
op whose weight trains (or from the start when the inputs need a gradient, e.g. a trained embedding) onward.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lightning_mm.errors import ConfigError

__all__ = [
    "Op",
    "Block",
    "StepFlops",
    "linear",
    "attention",
    "lora_ops",
    "training_flops",
    "window_lengths",
    "PEAK_TFLOPS",
    "peak_tflops",
]


@dataclass(frozen=True)
class Op:
    """One matrix product: its forward FLOPs and how its backward is counted.

    ``trainable``: the weight takes a gradient; ``None`` for a product without weights (attention), whose backward
    is 2x forward when the gradient flows. ``input_grad``: ``True`` when the op's input always needs its gradient
    (a LoRA ``B`` after its trained ``A``), ``None`` to follow the flow of the stream. ``backward``: the FLOPs of a
    product without weights whose backward is not 2x its forward (a linear attention's chunked scan), counted while
    the gradient flows.
    """

    forward: int
    trainable: bool | None = False
    input_grad: bool | None = None
    backward: int | None = None


@dataclass(frozen=True)
class Block:
    """Stages of ops in execution order; ``recompute``: the block's forward is replayed in its backward.

    ``reentrant``: the replay runs the whole forward (``checkpoint(use_reentrant=True)``). The non-reentrant
    checkpoint stops replaying once the last tensor the backward needs is rebuilt: the block's last stage (its final
    linear layer, or a LoRA ``B`` after it), whose output the backward does not need, is not replayed.
    ``exact_tail=False`` (a MoE block, whose experts run one after the other) replays every stage.
    """

    stages: tuple[tuple[Op, ...], ...]
    recompute: bool = False
    reentrant: bool = False
    exact_tail: bool = True

    def replayed(self) -> int:
        """The forward FLOPs the recomputation replays."""
        total = sum(op.forward for stage in self.stages for op in stage)
        if self.reentrant or not self.exact_tail or not self.stages:
            return total
        return total - sum(op.forward for op in self.stages[-1])


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one step: ``model`` (forward + backward as trained) and ``hardware`` (plus recomputation)."""

    model: int = 0
    hardware: int = 0
    forward: int = 0
    parts: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def recompute(self) -> int:
        """The FLOPs recomputation adds (hardware minus model)."""
        return self.hardware - self.model

    def __add__(self, other: StepFlops) -> StepFlops:
        parts = dict(self.parts)
        for key, value in other.parts.items():
            parts[key] = parts.get(key, 0) + value
        return StepFlops(self.model + other.model, self.hardware + other.hardware, self.forward + other.forward, parts)


def linear(tokens: int, d_in: int, d_out: int, trainable: bool = True) -> Op:
    """A linear layer (or a convolution whose stride equals its kernel) over ``tokens`` rows."""
    return Op(2 * tokens * d_in * d_out, trainable)


def attention(
    lengths: Iterable[int], heads: int, head_dim: int, value_dim: int | None = None, window: int | None = None
) -> Op:
    """Attention over independent sequences of ``lengths`` (a sliding ``window`` bounds the keys per query)."""
    value_dim = head_dim if value_dim is None else value_dim
    pairs = 0
    for length in lengths:
        if length < 0:
            raise ConfigError(f"a sequence length must be >= 0, got {length}")
        pairs += length * (length if window is None else min(length, window))
    return Op(2 * pairs * heads * (head_dim + value_dim), None)


def lora_ops(tokens: int, d_in: int, d_out: int, rank: int) -> tuple[Op, Op]:
    """LoRA's ``A`` (reads the base layer's input: add it to the base layer's stage) and ``B`` (its own stage)."""
    return Op(2 * tokens * d_in * rank, True), Op(2 * tokens * rank * d_out, True, input_grad=True)


def training_flops(blocks: Sequence[Block], inputs_need_grad: bool, *, backward: bool = True) -> StepFlops:
    """Model and hardware FLOPs of one forward (and, with ``backward``, backward) pass over ``blocks``."""
    flowing = inputs_need_grad
    forward = model = hardware = 0
    for block in blocks:
        block_forward = block_backward = 0
        for stage in block.stages:
            grows = False
            for op in stage:
                block_forward += op.forward
                input_grad = flowing if op.input_grad is None else op.input_grad
                if op.backward is not None:
                    block_backward += op.backward if input_grad else 0
                elif op.trainable is None:
                    block_backward += 2 * op.forward if input_grad else 0
                else:
                    block_backward += op.forward * (int(bool(op.trainable)) + int(input_grad))
                    grows = grows or op.trainable or input_grad
            flowing = flowing or grows
        forward += block_forward
        if backward:
            model += block_forward + block_backward
            replay = block.recompute and block_backward > 0
            hardware += block_forward + block_backward + (block.replayed() if replay else 0)
        else:
            model += block_forward
            hardware += block_forward
    return StepFlops(model=model, hardware=hardware, forward=forward)


def window_lengths(height: int, width: int, window: int) -> list[int]:
    """Sizes (in cells) of the ``window x window`` tiles of a ``height x width`` grid, the edge ones clipped."""
    if window <= 0:
        raise ConfigError(f"window must be > 0, got {window}")
    rows = [min(window, height - start) for start in range(0, height, window)]
    cols = [min(window, width - start) for start in range(0, width, window)]
    return [r * c for r in rows for c in cols]


# Dense bf16 peaks per device, TFLOP/s, without sparsity: NVIDIA's data sheets (SXM parts unless named), Huawei's
# published figures for Ascend. Approximate for the Ascend parts; override them with the meter's ``peak_tflops``.
PEAK_TFLOPS: dict[str, float] = {
    "B200": 2250.0,
    "H200": 989.0,
    "H100": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "A100": 312.0,
    "Ascend910B": 313.0,
    "Ascend910C": 780.0,
}


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a device from its name (``torch.cuda.get_device_name``, ``torch_npu``'s), or ``None``.

    The longest table key contained in the name (spaces and case ignored) wins: "H100 PCIe" before "H100".
    """
    name = device_name.replace(" ", "").lower()
    matches = [key for key in PEAK_TFLOPS if key.replace(" ", "").lower() in name]
    return PEAK_TFLOPS[max(matches, key=len)] if matches else None

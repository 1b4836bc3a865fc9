"""Tensor parallelism of a language model from a Transformers-notation plan, with torch's DTensor.

A plan maps module patterns (``layers.*.self_attn.q_proj``; ``*`` one path component) to a style in Transformers'
notation (``base_model_tp_plan``): ``colwise``, ``rowwise`` and ``replicated_with_grad_allreduce``. It is applied
with ``parallelize_module`` over the ``tp`` mesh before ``fully_shard`` (2-D: TP inside, FSDP2 across the
data-parallel ranks), as torchtitan does. Lightning-free.
"""

from __future__ import annotations

STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")
"""The styles of Transformers' plan notation that are supported."""

"""MindSpeed MM's ``internvl2_5`` conversation format: the text of a conversation and its assistant-only labels.

The text is MindSpeed MM's (``preprocess_internvl2_5``): a system turn (the record's own first ``system`` turn, or
the template's system message), then every turn as ``<|im_start|>{role}\\n{value}<|im_end|>\\n`` with the roles
``user`` (``human``) and ``assistant`` (``gpt``). Image placeholders (``<image>``) in user turns become the
processor's image token, which InternVL's processor expands into ``<img>`` + ``<IMG_CONTEXT>`` * N + ``</img>``.

Labels follow MindSpeed MM: system and user turns are not trained; in an assistant turn, the
``<|im_start|>assistant\\n`` header and the final ``\\n`` are not trained, so the answer and its ``<|im_end|>`` are.
MindSpeed tokenizes each turn separately; every turn starts with the special token ``<|im_start|>``, so tokenizing
the whole conversation at once (as the processor does) gives the same ids, and the turns are found again at the
``<|im_start|>`` ids. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning_mm.errors import DataError

__all__ = [
    "ConversationTemplate",
    "TEMPLATES",
    "IMAGE_PLACEHOLDER",
    "IGNORE_INDEX",
    "conversation_text",
    "assistant_labels",
    "ROLE_NAMES",
]

IMAGE_PLACEHOLDER = "<image>"
IGNORE_INDEX = -100
ROLE_NAMES = {"system": "system", "human": "user", "gpt": "assistant"}
"""MindSpeed MM's record roles (``from``) and the role names the template writes."""


@dataclass(frozen=True)
class ConversationTemplate:
    """One of MindSpeed MM's conversation templates (``template_name``)."""

    name: str
    system_message: str
    turn_start: str = "<|im_start|>"
    turn_end: str = "<|im_end|>"
    image_start: str = "<img>"
    image_context: str = "<IMG_CONTEXT>"
    image_end: str = "</img>"

    @property
    def assistant_header(self) -> str:
        return f"{self.turn_start}assistant\n"


TEMPLATES: dict[str, ConversationTemplate] = {
    "internvl2_5": ConversationTemplate(
        name="internvl2_5",
        system_message="你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。",
    ),
}
"""The templates reproduced here. MindSpeed MM's ``internvit_qwen3`` uses Qwen's vision tokens
(``<|vision_start|>``, ``<|image_pad|>``), which InternVL's processor does not write."""


def conversation_text(
    turns: Sequence[tuple[str, str]], template: ConversationTemplate, image_token: str
) -> tuple[str, list[str]]:
    """The conversation's text and the role of each turn in it (system first).

    ``turns`` are ``(from, value)`` pairs with ``from`` in ``system`` (first turn only), ``human``, ``gpt``.
    ``<image>`` in human turns becomes ``image_token``; elsewhere it stays text, as in MindSpeed MM.
    """
    turns = list(turns)
    if turns and turns[0][0] == "system":
        system, turns = turns[0][1], turns[1:]
    else:
        system = template.system_message
    pieces = [f"{template.turn_start}system\n{system}{template.turn_end}\n"]
    roles = ["system"]
    for role, value in turns:
        if role == "human":
            value = value.replace(IMAGE_PLACEHOLDER, image_token)
        elif role != "gpt":
            raise DataError(f"role {role!r} is not allowed here (system only as the first turn; human, gpt)")
        pieces.append(f"{template.turn_start}{ROLE_NAMES[role]}\n{value}{template.turn_end}\n")
        roles.append(role)
    return "".join(pieces), roles


def assistant_labels(
    input_ids: Sequence[int], roles: Sequence[str], turn_start_id: int, header_length: int
) -> list[int]:
    """Labels for ``input_ids``: assistant turns without their header and final token, the rest ignored.

    The turns are the spans starting at each ``turn_start_id``; tokens before the first one (a BOS) belong to the
    first turn. ``header_length`` is the number of tokens of ``<|im_start|>assistant\\n``.
    """
    starts = [i for i, token in enumerate(input_ids) if token == turn_start_id]
    if len(starts) != len(roles):
        raise DataError(f"the text has {len(starts)} turn-start tokens for {len(roles)} turns")
    labels = [IGNORE_INDEX] * len(input_ids)
    ends = [*starts[1:], len(input_ids)]
    for role, start, end in zip(roles, starts, ends):
        if role != "gpt":
            continue
        first, last = start + header_length, end - 1
        labels[first:last] = input_ids[first:last]
    return labels

"""Answer a question about a picture with a converted model directory, as a Transformers user would.

``python -m examples.generate_from_hf OUT_DIR IMAGE``: ``OUT_DIR`` is what ``lightning-mm convert dcp-to-hf`` wrote
(weights, config, tokenizer, processor and chat template); the model class is the one its ``config.json`` names.
The answer is greedy, so the same weights always give the same words.
"""

from __future__ import annotations

import argparse

from examples.vlm_stand_in import QUESTION


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("image")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    args = parser.parse_args(argv)

    import torch
    import transformers
    from PIL import Image
    from transformers import AutoConfig

    from lightning_mm.hf.vlm_processor import load_vlm_processor

    config = AutoConfig.from_pretrained(args.model_dir, local_files_only=True)
    model_class = getattr(transformers, config.architectures[0])
    model = model_class.from_pretrained(args.model_dir, local_files_only=True).eval()
    # AutoProcessor.from_pretrained, or, where torchvision is missing (Qwen-VL's video processor needs it), the same
    # processor class built from the directory's tokenizer, image processor and chat template without videos.
    processor = load_vlm_processor(args.model_dir).processor
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    with Image.open(args.image) as image:
        inputs = processor(text=[text], images=[image.convert("RGB")], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
    answer = processor.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)[0]
    print(f"{QUESTION} -> {answer.strip()!r}")


if __name__ == "__main__":
    main()

"""``lightning-mm extract-features``: MindSpeed MM's Wan text-to-video feature extraction
(``mindspeed_mm/tools/feature_extraction/get_wan_feature.py`` with ``get_sora_feature.py``'s ``FeatureExtractor``:
``features/<base name, dots as underscores>.pt`` holding ``video``, ``prompt_ids``, ``prompt_mask``) with tiny random
diffusers / Transformers models saved locally."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.scenarios.wan_scenarios import TINY_WAN
from tests.test_wan_video import VAE, _write_clip

WORDS = ["<pad>", "</s>", "<unk>", "a", "red", "clip", "of", "the", "sea", "slow"]
CAPTIONS = {"one.mp4": "a red  clip\tof the sea", "dir/two.v2.mp4": "the slow sea"}
MAX_LENGTH = 6
ROOT = Path(__file__).resolve().parents[1]


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(path)


def _workdir(root: Path) -> dict[str, Path]:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    clips = root / "clips"
    (clips / "dir").mkdir(parents=True)
    for name in CAPTIONS:
        _write_clip(clips / name, 7, 48, 64)
    records = [{"path": name, "cap": cap, "resolution": {"h": 48}} for name, cap in CAPTIONS.items()]
    # MindSpeed MM's data_storage_mode combine: data.txt lines `video folder,annotation JSON list`
    (clips / "anno.json").write_text(json.dumps(records))
    (root / "data.txt").write_text(f"{clips},{clips / 'anno.json'}\n")
    torch.manual_seed(0)
    AutoencoderKLWan(**VAE).save_pretrained(root / "vae")
    config = UMT5Config(vocab_size=len(WORDS), d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2)
    UMT5EncoderModel(config).save_pretrained(root / "text_encoder")
    _tokenizer(root / "tokenizer")
    WanTransformer3DModel(**TINY_WAN).save_pretrained(root / "transformer")
    data = {
        "dataset_param": {
            "dataset_type": "t2v",
            "basic_parameters": {"data_path": str(root / "data.txt"), "data_storage_mode": "combine"},
            "preprocess_parameters": {"num_frames": 5, "frame_interval": 1, "max_height": 32, "max_width": 32},
            "use_text_processer": True,
            "enable_text_preprocessing": True,
            "text_preprocess_methods": {"method": "whitespace_clean"},
            "tokenizer_config": {"from_pretrained": str(root / "tokenizer"), "model_max_length": MAX_LENGTH},
        }
    }
    (root / "data.json").write_text(json.dumps(data))
    model = {
        "ae": {"from_pretrained": str(root / "vae")},
        "text_encoder": {"from_pretrained": str(root / "text_encoder")},
    }
    (root / "model_t2v.json").write_text(json.dumps(model))
    return {"clips": clips, "data": root / "data.json", "model": root / "model_t2v.json", "out": root / "out"}


@pytest.fixture(scope="module")
def extracted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from lightning_mm.cli import main

    work = _workdir(tmp_path_factory.mktemp("extract"))
    argv = [
        "extract-features",
        "--data",
        str(work["data"]),
        "--model",
        str(work["model"]),
        "--output",
        str(work["out"]),
    ]
    assert main(argv) == 0
    return work


def test_features_equal_the_vae_and_the_text_encoder_called_directly(extracted: dict[str, Path]) -> None:
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, UMT5EncoderModel

    from lightning_mm.data.wan_video import decode_model_frames

    root, out = extracted["data"].parent, extracted["out"]
    vae = AutoencoderKLWan.from_pretrained(root / "vae").eval()
    encoder = UMT5EncoderModel.from_pretrained(root / "text_encoder").eval()
    tokenizer = AutoTokenizer.from_pretrained(root / "tokenizer")
    records = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    # MindSpeed MM's names: features/<base name with dots as underscores>.pt; the records keep their other keys
    assert [r["file"] for r in records] == ["features/one_mp4.pt", "features/two_v2_mp4.pt"]
    assert [r["cap"] for r in records] == list(CAPTIONS.values()) and records[0]["resolution"] == {"h": 48}
    mean, std = (torch.tensor(VAE[k]).view(1, 4, 1, 1, 1) for k in ("latents_mean", "latents_std"))
    for record, (name, caption) in zip(records, CAPTIONS.items()):
        got = torch.load(out / record["file"], weights_only=True)
        assert sorted(got) == ["prompt_ids", "prompt_mask", "video"]
        frames = decode_model_frames(extracted["clips"] / name, 5, 1, 32, 32)
        with torch.no_grad():
            latents = (vae.encode(frames[None]).latent_dist.mode() - mean) / std
            tokens = tokenizer(
                " ".join(caption.split()),
                max_length=MAX_LENGTH,
                padding="max_length",
                truncation=True,
                return_tensors="pt",
            )
            text = encoder(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask).last_hidden_state
        torch.testing.assert_close(got["video"], latents[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["prompt_ids"], text[0], rtol=1e-5, atol=1e-6)
        assert torch.equal(got["prompt_mask"], tokens.attention_mask[0])
    # As MindSpeed MM's `_write_data_info`: `path` is the data.txt folder joined to the annotation's path
    assert records[1]["path"] == os.path.join(str(extracted["clips"]), "dir/two.v2.mp4")
    assert 0 < int(got["prompt_mask"].sum()) < MAX_LENGTH


def _loss_and_grads(root: Path, data: Path) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from lightning_mm.datamodules import MMDataModule
    from lightning_mm.modules.wan_module import MMWanModule

    dm = MMDataModule.from_config(data, batch_size=1)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    module = MMWanModule({"init_from_path": str(root / "transformer")}, noise_seed=3)
    module.configure_model()
    inputs = module.get_batch(batch)
    loss = module.loss_func(module.forward_step(inputs), inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_a_training_step_on_the_features_equals_one_on_the_raw_videos(extracted: dict[str, Path]) -> None:
    root, out, clips = extracted["data"].parent, extracted["out"], extracted["clips"]
    features = {
        "dataset_param": {
            "dataset_type": "feature",
            "basic_parameters": {"data_path": str(out / "data.jsonl"), "data_folder": str(out)},
        },
        "dataloader_param": {"dataloader_mode": "sampler", "shuffle": False},
    }
    (root / "features.json").write_text(json.dumps(features))
    # The raw-video path: the same clip encoded online by the frozen VAE; its text features from a file
    text = torch.load(out / "features" / "one_mp4.pt", weights_only=True)
    torch.save({k: text[k] for k in ("prompt_ids", "prompt_mask")}, clips / "one_text.pt")
    (clips / "raw.jsonl").write_text(json.dumps({"path": "one.mp4", "file": "one_text.pt"}) + "\n")
    raw = {
        "dataset_param": {
            "dataset_type": "feature",
            "basic_parameters": {
                "data_path": str(clips / "raw.jsonl"),
                "data_folder": str(clips),
                "vae_path": str(root / "vae"),
            },
            "preprocess_parameters": {"num_frames": 5, "frame_interval": 1, "max_height": 32, "max_width": 32},
        },
        "dataloader_param": {"dataloader_mode": "sampler", "shuffle": False},
    }
    (root / "raw.json").write_text(json.dumps(raw))
    loss, grads = _loss_and_grads(root, root / "features.json")
    raw_loss, raw_grads = _loss_and_grads(root, root / "raw.json")
    assert loss > 0 and torch.allclose(loss, raw_loss, rtol=1e-5), (loss, raw_loss)
    assert sorted(grads) == sorted(raw_grads) and grads
    scale = max(g.abs().max().item() for g in raw_grads.values())
    for name, ref in raw_grads.items():
        assert torch.allclose(grads[name], ref, rtol=1e-5, atol=1e-6 * scale), name


def test_existing_outputs_and_other_tasks_are_refused_before_any_work(
    extracted: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lightning_mm.cli import main

    out = tmp_path / "out"
    (out / "features").mkdir(parents=True)
    (out / "features" / "two_v2_mp4.pt").write_text("mine")
    argv = ["extract-features", "--data", str(extracted["data"]), "--model", str(extracted["model"])]
    assert main([*argv, "--output", str(out)]) == 1
    assert "two_v2_mp4.pt: exists already" in capsys.readouterr().err
    assert sorted(p.name for p in out.rglob("*")) == ["features", "two_v2_mp4.pt"]  # nothing written
    i2v = tmp_path / "model_i2v.json"
    i2v.write_text(json.dumps({**json.loads(extracted["model"].read_text()), "task": "i2v"}))
    assert main(["extract-features", "--data", str(extracted["data"]), "--model", str(i2v), "--output", str(out)]) == 1
    assert "--image-encoder: not given and no `ae.i2v_processor.image_encoder`" in capsys.readouterr().err
    i2v.write_text(json.dumps({**json.loads(extracted["model"].read_text()), "task": "ti2v"}))
    assert main(["extract-features", "--data", str(extracted["data"]), "--model", str(i2v), "--output", str(out)]) == 1
    assert "`task: ti2v`: only t2v and i2v (Wan 2.1)" in capsys.readouterr().err
    data = json.loads(extracted["data"].read_text())
    escape = tmp_path / "escape.jsonl"
    escape.write_text(json.dumps({"path": "../../x.mp4", "cap": "a"}) + "\n")
    data["dataset_param"]["basic_parameters"] = {"data_path": str(escape), "data_folder": str(extracted["clips"])}
    (tmp_path / "escape.json").write_text(json.dumps(data))
    argv = ["extract-features", "--data", str(tmp_path / "escape.json"), "--model", str(extracted["model"])]
    assert main([*argv, "--output", str(tmp_path / "o2")]) == 1
    assert "escape.jsonl:1: `path` '../../x.mp4' resolves outside" in capsys.readouterr().err
    assert not (tmp_path / "o2").exists()


def test_migrate_names_the_command_for_mindspeeds_wan_feature_extraction_launch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lightning_mm.cli import main

    script = ROOT / "tests" / "data" / "mindspeed_corpus" / "examples" / "wan2.1" / "feature_extract"
    assert main(["migrate", str(script / "feature_extraction.sh")]) == 1
    err = capsys.readouterr().err
    assert "refused (feature-extraction)" in err
    assert (
        "run `lightning-mm extract-features --data ./examples/wan2.1/feature_extract/data.json --model "
        "./examples/wan2.1/feature_extract/model_t2v.json --output OUT`" in err
    )


def test_i2v_features_equal_clip_and_the_vae_called_directly(tmp_path: Path) -> None:
    """``task: i2v`` as MindSpeed MM's ``get_wan_feature.py`` with ``wan_i2v_processor.py``
    (``mindspeed_mm/utils/extra_processor/wan_i2v_processor.py``) and its Wan 2.1 recipe's first-frame pipelines
    (``examples/wan2.1/feature_extract/data.json``), re-told here: the first frame short-side resized
    (``shortsideresize``, bilinear, antialiased) and scaled to [0, 1]; for CLIP resized to its image size (the
    recipe's 224 for Wan's CLIP; bicubic) and normalised, ``hidden_states[-2]``; for the VAE resized to
    ``max_height`` x ``max_width`` (bilinear), normalised to [-1, 1], followed by ``num_frames - 1`` zero frames and
    encoded, after the mask (upstream's ``h // 8`` is the VAE's spatial factor, 4 in this tiny VAE)."""
    import av
    import torch.nn.functional as F
    from diffusers import AutoencoderKLWan
    from transformers import CLIPVisionConfig, CLIPVisionModel

    from lightning_mm.cli import main

    work = _workdir(tmp_path)
    vae_config = {**VAE, "dim_mult": [1, 2, 2], "temperal_downsample": [True, True]}  # 4x in time, as Wan's
    AutoencoderKLWan(**vae_config).save_pretrained(tmp_path / "vae_i2v")
    clip_config = CLIPVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=3, num_attention_heads=2, image_size=32, patch_size=8
    )
    CLIPVisionModel(clip_config).save_pretrained(tmp_path / "image_encoder")
    model = json.loads(work["model"].read_text())
    model["task"] = "i2v"
    model["ae"] = {
        "from_pretrained": str(tmp_path / "vae_i2v"),
        "i2v_processor": {
            "processor_id": "wan_i2v_processor",
            "image_encoder": str(tmp_path / "image_encoder"),
            "i2v_vae_encode_tiling": False,
        },
    }
    (tmp_path / "model_i2v.json").write_text(json.dumps(model))
    argv = ["extract-features", "--data", str(work["data"]), "--model", str(tmp_path / "model_i2v.json")]
    assert main([*argv, "--output", str(work["out"])]) == 0
    vae = AutoencoderKLWan.from_pretrained(tmp_path / "vae_i2v").eval()
    clip = CLIPVisionModel.from_pretrained(tmp_path / "image_encoder").eval()
    records = [json.loads(line) for line in (work["out"] / "data.jsonl").read_text().splitlines()]
    mean, std = (torch.tensor(VAE[k]).view(1, 4, 1, 1, 1) for k in ("latents_mean", "latents_std"))
    clip_mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]).view(1, 3, 1, 1)
    clip_std = torch.tensor([0.26862954, 0.26130258, 0.27577711]).view(1, 3, 1, 1)
    for record, name in zip(records, CAPTIONS):
        got = torch.load(work["out"] / record["file"], weights_only=True)
        assert sorted(got) == ["i2v_clip_feature", "i2v_vae_feature", "prompt_ids", "prompt_mask", "video"]
        with av.open(str(work["clips"] / name)) as container:
            pixels = next(container.decode(video=0)).to_ndarray(format="rgb24")
        frame = torch.from_numpy(pixels).permute(2, 0, 1)[None].float()
        h, w = frame.shape[-2:]
        size = (32, int(32 / h * w)) if h / w < 1 else (int(32 / w * h), 32)  # shortsideresize to (32, 32)
        first = F.interpolate(frame, size=size, mode="bilinear", align_corners=False, antialias=True) / 255.0
        clip_in = F.interpolate(first, size=(32, 32), mode="bicubic", align_corners=False, antialias=False)
        vae_in = F.interpolate(first, size=(32, 32), mode="bilinear", align_corners=False, antialias=False)
        vae_in = torch.cat([((vae_in - 0.5) / 0.5).unsqueeze(2), torch.zeros(1, 3, 4, 32, 32)], dim=2)
        with torch.no_grad():
            image = clip((clip_in - clip_mean) / clip_std, output_hidden_states=True).hidden_states[-2]
            latents = (vae.encode(vae_in).latent_dist.mode() - mean) / std
        bs, t, lh, lw = 1, 5, 32 // 4, 32 // 4
        mask = torch.ones(bs, t, lh, lw)
        mask[:, 1:] = 0
        mask = torch.concat([torch.repeat_interleave(mask[:, 0:1], repeats=4, dim=1), mask[:, 1:]], dim=1)
        mask = mask.view(bs, mask.shape[1] // 4, 4, lh, lw).transpose(1, 2)
        torch.testing.assert_close(got["i2v_clip_feature"], image[0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got["i2v_vae_feature"], torch.cat([mask, latents], dim=1)[0], rtol=1e-5, atol=1e-6)
        assert got["video"].shape[1] == 2  # 5 frames, 4x in time
    # The written data.jsonl loads as dataset_type: feature with the i2v batch keys
    from lightning_mm.datamodules import MMDataModule

    features = {
        "dataset_param": {
            "dataset_type": "feature",
            "basic_parameters": {"data_path": str(work["out"] / "data.jsonl"), "data_folder": str(work["out"])},
        },
        "dataloader_param": {"dataloader_mode": "sampler", "shuffle": False},
    }
    (tmp_path / "features.json").write_text(json.dumps(features))
    dm = MMDataModule.from_config(tmp_path / "features.json", batch_size=1)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    first = torch.load(work["out"] / records[0]["file"], weights_only=True)
    assert torch.equal(batch["image_embeds"][0], first["i2v_clip_feature"])
    assert torch.equal(batch["condition_latents"][0], first["i2v_vae_feature"])

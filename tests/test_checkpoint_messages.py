"""What a checkpoint error says (issue #14, point 3): a ``.metadata`` or ``meta.pt`` of another run is named as such,
not "truncated"; ``fit(ckpt_path="last")`` whose ``last`` link dangles is refused in one line naming the link and its
target (a missing ``last`` keeps Lightning's warning and fresh start)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from lightning_mm import MMFSDP2Strategy
from lightning_mm.checkpoint import store
from lightning_mm.checkpoint.checkpoint_errors import CheckpointIntegrityError, CheckpointNotFoundError

EXTRA = {"format_version": 1, "kind": "training", "world_size": 1, "rng_point": "next_batch", "hf": []}


def _save(path: Path, seed: int) -> Path:
    torch.manual_seed(seed)
    net = nn.Linear(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store.save({"epoch": 0, "global_step": seed, "state_dict": net.state_dict()}, path, "torch_dcp", EXTRA, None)
    return path


def test_a_metadata_or_meta_file_of_another_run_is_called_foreign_and_a_cut_one_truncated(tmp_path):
    mine = _save(tmp_path / "a.ckpt", 0)
    other = _save(tmp_path / "another-run" / "step=100.ckpt", 1)  # another path: a .metadata of another size
    assert (mine / ".metadata").stat().st_size != (other / ".metadata").stat().st_size
    for name, kind in ((".metadata", "DCP .metadata"), ("meta.pt", "torch file")):
        mixed = Path(shutil.copytree(mine, tmp_path / f"mixed{name}"))
        shutil.copyfile(other / name, mixed / name)
        with pytest.raises(CheckpointIntegrityError) as info:
            store.open_source(mixed)
        message = str(info.value)
        assert message.startswith(f"{mixed / name}: does not belong to this checkpoint: a complete {kind} of ")
        assert "the file of another checkpoint or run" in message and "truncated" not in message
    cut = Path(shutil.copytree(mine, tmp_path / "cut.ckpt"))
    data = (cut / ".metadata").read_bytes()
    (cut / ".metadata").write_bytes(data[:-7])
    with pytest.raises(CheckpointIntegrityError, match=r"cut\.ckpt/\.metadata: truncated"):
        store.open_source(cut)


class _Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.layer(batch).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(dirpath: Path) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=MMFSDP2Strategy(),
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=dirpath, save_last="link")],
    )


def test_resuming_from_a_last_link_whose_checkpoint_is_gone_is_refused_naming_link_and_target(tmp_path):
    (tmp_path / "last.ckpt").symlink_to("step=4.ckpt")  # its target was deleted
    data = torch.utils.data.DataLoader(torch.randn(4, 2), batch_size=2)
    with pytest.raises(CheckpointNotFoundError) as info:
        _trainer(tmp_path).fit(_Tiny(), train_dataloaders=data, ckpt_path="last")  # before: trained from step 0
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f'ckpt_path="last": {tmp_path / "last.ckpt"} is a link to step=4.ckpt '
        f"({tmp_path / 'step=4.ckpt'}), which does not exist"
    ), message
    assert (tmp_path / "last.ckpt").is_symlink()  # nothing was written


def test_without_any_last_checkpoint_lightning_warns_and_starts_fresh(tmp_path):
    from lightning_mm.strategies.launch import dangling_last_link

    trainer = _trainer(tmp_path)
    assert dangling_last_link(trainer) is None  # nothing there: Lightning's own warning and fresh start stay
    (tmp_path / "step=1.ckpt").mkdir()
    (tmp_path / "last.ckpt").symlink_to("step=1.ckpt")
    assert dangling_last_link(trainer) is None  # a link to a checkpoint that exists: Lightning resumes from it


def test_a_meta_file_with_bytes_appended_is_longer_than_written_not_foreign(tmp_path):
    extended = _save(tmp_path / "x.ckpt", 0)
    with open(extended / "meta.pt", "ab") as f:
        f.write(b"\0" * 100)
    with pytest.raises(CheckpointIntegrityError, match=r"x\.ckpt/meta\.pt: longer than written"):
        store.open_source(extended)

"""The Lightning version of pretrain_custom.py, in Python: the same five functions, passed by value.

python examples/migration/train_lightning.py      (from the repository root)
"""

import sys
from pathlib import Path

import lightning as L

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from examples.migration import pretrain_custom as seed  # noqa: E402
from lightning_mm import MMDataModule, MMFSDP2Strategy, MMLightningModule  # noqa: E402

if __name__ == "__main__":
    L.seed_everything(1234)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        max_steps=60,
        log_every_n_steps=5,
        enable_checkpointing=False,
        strategy=MMFSDP2Strategy(fsdp2_config=Path(__file__).with_name("fsdp2_config.yaml")),
        default_root_dir="runs/migration",
    )
    module = MMLightningModule(model_provider=seed.model_provider, forward_step=seed.forward_step, lr=3e-3)
    data = MMDataModule(train_valid_test_datasets_provider=seed.train_valid_test_datasets_provider)
    trainer.fit(module, datamodule=data)

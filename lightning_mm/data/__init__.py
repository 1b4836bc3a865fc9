"""Datasets without Lightning: records, the native data config, chat and Wan video samples (below the
translation layer ``lightning_mm.mindspeed`` and the Lightning data module ``lightning_mm.datamodules``)."""

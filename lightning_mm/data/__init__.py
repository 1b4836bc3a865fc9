"""Datasets without Lightning: records and their report, this project's data config and its multimodal dataset, the
replacing Dataset base, Wan video decoding. Below the translation layer (:mod:`lightning_mm.mindspeed`, whose data
readers build on them) and the Lightning data module (:mod:`lightning_mm.datamodules`)."""

"""MindSpeed MM's files read and translated: the only place that names MindSpeed MM's keys and flags.

Lightning-free; above :mod:`lightning_mm.core`, :mod:`lightning_mm.checkpoint`, :mod:`lightning_mm.hf`,
:mod:`lightning_mm.diffusers` and :mod:`lightning_mm.data`. The entry is :mod:`lightning_mm.mindspeed.load`; the data
config readers (:mod:`~lightning_mm.mindspeed.mindspeed_data` and the datasets it builds) are the DataModule's.
"""

"""MindSpeed MM's files read and translated: the only place that names MindSpeed MM's keys and flags.

Lightning-free; above :mod:`lightning_mm.core`, :mod:`lightning_mm.checkpoint` and :mod:`lightning_mm.hf`. The entry
is :mod:`lightning_mm.mindspeed.load`.
"""

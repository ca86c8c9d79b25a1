"""The analytical cost model (stage 1 of tuning): predicted kernel times from the work really done.

- :mod:`.core`: occupancy, waves and the SM / L2 / DRAM limits of one kernel launch (:func:`predict`), with
  the fitted constants in :class:`Calibration`;
- :mod:`.mask_profile`: per-row and per-tile-row work of a mask (:class:`MaskProfile`);
- :mod:`.attention`: block-wise, row-wise and (Hopper) wgmma attention candidates, their work, the ranking
  and the choice;
- :mod:`.explain`: the ``--explain`` report of the terms.

The hardware comes from :mod:`stof_tvm.hardware` (an H200 profile built in, or read from the device).
"""
from .attention import (AttentionCandidate, AttentionDecision, AttentionProblem, RankedCandidate,
                        attention_candidates, attention_work, choose_attention, decide_attention, rank_attention)
from .core import DEFAULT_CALIBRATION, Calibration, KernelWork, Prediction, occupancy, predict
from .mask_profile import MaskProfile

__all__ = ["AttentionCandidate", "AttentionDecision", "AttentionProblem", "decide_attention",
           "RankedCandidate", "attention_candidates", "attention_work",
           "choose_attention", "rank_attention", "DEFAULT_CALIBRATION", "Calibration", "KernelWork", "Prediction",
           "occupancy", "predict", "MaskProfile"]

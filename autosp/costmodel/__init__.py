"""Stage 2: hardware profiles (tables), op and collective time, overlap, memory accounting.

Reads the typed OpGraph (:mod:`autosp.graph`) and the strategies' cost declarations
(:mod:`autosp.strategies`); imports neither the planner nor the transform.
"""

from autosp.costmodel.predict import Prediction, predict
from autosp.costmodel.profile import HardwareProfile, load_profile, shipped_profiles

__all__ = ["HardwareProfile", "Prediction", "load_profile", "predict", "shipped_profiles"]

"""Transform: FX passes that apply SP, runtime collectives as custom ops, the compile backend."""

from autosp.transform.api import SequenceParallel, build
from autosp.transform.backend import autosp_backend, make_backend

__all__ = ["build", "SequenceParallel", "autosp_backend", "make_backend"]

"""Transform: FX passes that apply SP, runtime collectives as custom ops, the compile backend."""

from autosp.transform.api import SequenceParallel, compile
from autosp.transform.backend import autosp_backend, make_backend

__all__ = ["compile", "SequenceParallel", "autosp_backend", "make_backend"]

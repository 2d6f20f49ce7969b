import os
import sys

# tests/ holds user-style model factories addressed as "models_for_tests:factory".
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The compiler of every model a test does not name one for. Users get Inductor, which takes tens
# of seconds per graph on 2 CPU cores; the suite's default is AOTAutograd ("aot_eager": the same
# forward/backward partition, checkpointing and memory as Inductor, unfused) for the 2-process
# exactness tests (tests/test_sp_2proc.py, see its pool) and eager graphs elsewhere, so that CI stays
# within 30 minutes (every test through aot_eager: 364 passed in 34 minutes). A compiler set in the
# environment (AUTOSP_COMPILER=aot_eager python -m pytest -q) applies to every test.
SUITE_COMPILER = os.environ.get("AUTOSP_COMPILER")
os.environ.setdefault("AUTOSP_COMPILER", "eager")

import os
import sys

# tests/ holds user-style model factories addressed as "models_for_tests:factory".
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# The compiler of every model a test does not name one for: AOTAutograd ("aot_eager": the forward/
# backward partition, checkpointing tags and memory that Inductor gets, unfused), on every process
# the suite starts (the gloo pools, torchrun examples, DeepSpeed). Users get Inductor, which takes
# tens of seconds per graph on 2 CPU cores: the tests that are about it name it. Tests about eager
# graphs name "eager". A compiler set in the environment (AUTOSP_COMPILER=inductor python -m pytest)
# applies to every test that names none.
os.environ.setdefault("AUTOSP_COMPILER", "aot_eager")
SUITE_COMPILER = os.environ["AUTOSP_COMPILER"]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """How many multi-process tests ran their cases through each compiler (as the cases reported)."""
    import collections

    from dist_harness import COMPILED

    from autosp.options import COMPILERS

    if COMPILED:
        by = collections.Counter(c for compilers in COMPILED.values() for c in compilers)
        terminalreporter.write_line("multi-process tests by compiler that ran their cases: " + ", ".join(
            f"{c} {by[c]}" for c in COMPILERS) +
            f" (of {len(COMPILED)} multi-process tests; {sum(not c for c in COMPILED.values())} return no report)")

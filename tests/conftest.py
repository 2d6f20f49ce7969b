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


# Test modules that start processes (gloo pools, torchrun, DeepSpeed, a notebook kernel): under
# pytest-xdist (the README's `-n 2`) they run one after another on one worker, each process group
# having the two cores to itself as it would alone, while the other worker runs the one-process
# modules (planning, capture, cost model) beside them on the core they leave idle.
PROCESSES = {"test_sp_2proc", "test_sp_4proc", "test_tensor_parallel_4proc", "test_docs", "test_deepspeed",
             "test_example", "test_two_nodes", "test_fault", "test_hf_trainer", "test_profiler", "test_notebook"}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        if item.module.__name__.rpartition(".")[2] in PROCESSES:
            item.add_marker(pytest.mark.xdist_group("processes"))


def pytest_sessionfinish(session):
    """An xdist worker hands its multi-process tests' compilers to the controller's summary."""
    from dist_harness import COMPILED

    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["compiled"] = {k: sorted(v) for k, v in COMPILED.items()}


import pytest  # noqa: E402


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    from dist_harness import COMPILED

    for test, compilers in getattr(node, "workeroutput", {}).get("compiled", {}).items():
        COMPILED.setdefault(test, set()).update(compilers)


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

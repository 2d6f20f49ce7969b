"""The README and the docs site: every Python example in them runs, the README stays short, and
the site builds with warnings as errors.

Python blocks run on one process (``autosp.compile`` runs the model as it is without a process
group, so the examples run here unchanged), all in one interpreter, each in a fresh namespace; a
block marked ``<!-- run: torchrun N -->`` runs under torchrun on N gloo processes; a block that
includes a script (``--8<-- "examples/..."``) runs that script, on one process.
"""

import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:<!-- run: torchrun (\d+) -->\n)?```python\n(.*?)```", re.S)


def _blocks() -> list[tuple[str, int, str]]:
    """(where, processes, code) for every Python block; an include becomes the script it includes."""
    out = []
    for page in PAGES:
        for i, m in enumerate(BLOCK.finditer(page.read_text())):
            code = m.group(2)
            include = re.fullmatch(r'\s*--8<-- "(.+?)"\s*', code)
            if include:
                code = (ROOT / include.group(1)).read_text()
            out.append((f"{page.relative_to(ROOT)}#{i}", int(m.group(1) or 1), code))
    return out


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}


def test_the_readme_is_short_and_every_page_has_examples_that_run():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
    blocks = _blocks()
    assert len(blocks) >= 10 and {where.split("#")[0] for where, _, _ in blocks} >= {
        "README.md", "docs/index.md", "docs/howto/trainer.md", "docs/howto/dp-sp-zero.md"}


def test_every_one_process_example_runs(tmp_path):
    blocks = [(where, code) for where, n, code in _blocks() if n == 1 and "deepspeed" not in code]
    runner = tmp_path / "run_blocks.py"
    runner.write_text(textwrap.dedent('''
        import sys, traceback, warnings
        warnings.filterwarnings("ignore")
        failed = []
        for where, code in BLOCKS:
            try:
                exec(compile(code, where, "exec"), {"__name__": "__main__"})
            except SystemExit as e:
                if e.code:
                    failed.append((where, f"exit {e.code}"))
            except BaseException:
                failed.append((where, traceback.format_exc()[-1500:]))
        for where, err in failed:
            print("FAILED", where, err, sep="\\n")
        sys.exit(1 if failed else 0)
    ''').replace("BLOCKS", repr(blocks)))
    run = subprocess.run([sys.executable, str(runner)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-6000:]


@pytest.mark.parametrize("where,nproc,code", [b for b in _blocks() if b[1] > 1],
                         ids=[b[0] for b in _blocks() if b[1] > 1])
def test_every_multi_process_example_runs_under_torchrun(tmp_path, where, nproc, code):
    from autosp.tools.launch import free_port

    script = tmp_path / "example.py"
    script.write_text(code)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                          "--master-port", str(free_port()), str(script)], cwd=tmp_path, env=_env(),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (where, (run.stdout + run.stderr)[-4000:])


def test_the_docs_site_builds_with_warnings_as_errors(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("mkdocstrings")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "memory_limit" in (tmp_path / "site" / "reference" / "index.html").read_text()


def test_the_gpu_offload_check_runs_dry_on_cpu(tmp_path):
    """``bench/gpu_check.py --only offload`` is ready for a lent GPU: its CPU dry run offloads what the
    planner predicts for the same decisions, and writes every figure docs/benchmarks.md quotes."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--only", "offload", "--dry", "--out", str(tmp_path)],
                         cwd=root, env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads((tmp_path / "offload.json").read_text())
    assert res["host_bandwidth"]["d2h"] > 0 and res["host_bandwidth"]["h2d"] > 0
    kept, off = res["kept"], res["offload"]
    assert kept["offloaded_bytes"] == kept["host_peak_bytes"] == 0
    # 2 layers x 2 saved tensors (input, tiled MLP's) x 256 tokens x 128 x 4 bytes, as predicted
    assert off["offloaded_bytes"] == off["host_peak_bytes"] == off["predicted_host_bytes"] == 4 * 256 * 128 * 4
    assert [d["offload"] for d in off["decisions"]] == [True] and [d["offload"] for d in kept["decisions"]] == [False]
    # offloaded, the optimizer steps in host memory: fp32 masters and two moments, 12 bytes per parameter
    assert off["host_optimizer"] and not kept["host_optimizer"] and kept["optimizer_host_bytes"] == 0
    assert off["optimizer_host_bytes"] == off["predicted_optimizer_host_bytes"] > 0
    assert off["optimizer_step_s"] > 0 and off["predicted_optimizer_step_s"] > 0
    for r in (kept, off):
        assert r["step_s"] > 0 and r["predicted_step_s"] > 0 and abs(r["peak_bytes"] / r["predicted_peak_bytes"] - 1) < 0.25
    assert "host copies:" in run.stdout and "offload " in run.stdout


def test_the_gpu_sharded_step_check_runs_dry_on_cpu(tmp_path):
    """``bench/gpu_check.py --only e2e`` is ready for a lent GPU: its CPU dry run (Ulysses alone here)
    trains a bf16 Llama on 2 ranks (through AOTAutograd here, for time: on a GPU, Inductor), within bf16 tolerance of one process, sharded
    (and the same model split by tensor parallelism over the 2 ranks):
    Ulysses on both layers, 16 all-to-alls in a step (2 layers x 4 forward, 4 backward), and each
    rank's loss over its own labelled tokens (rank 0 holds the 31 ignored, shifted labels)."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--only", "e2e", "--dry", "--strategies", "ulysses,tp",
                          "--compiler", "aot_eager", "--out", str(tmp_path)], cwd=root, env={**os.environ, "PYTHONPATH": root},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    res = json.loads((tmp_path / "sharded_step.json").read_text())
    row, tp = res["rows"]
    assert res["compiler"] == row["compiler"] == "aot_eager" and row["dtype"] == "torch.bfloat16" and row["world"] == 2
    assert row["ok"] and row["loss_err"] < res["tolerance"] and row["grad_err"] < res["tolerance"], row
    assert row["ran"] == ["ulysses", "ulysses"] and row["collectives"]["all_to_all"]["calls"] == 16, row
    assert [r["loss_tokens"] for r in row["ranks"]] == [128 - 31, 128 - 1], row["ranks"]
    # observed as each rank's attention ran: its half of the 256 tokens at both layers
    assert [r["tokens_per_rank"] for r in row["ranks"]] == [[128, 128]] * 2 and row["outside_allocator_bytes"] is None
    assert "ulysses        ok" in run.stdout
    # the 2 ranks as one TP group: half of each block's heads and features, the modules' outputs and
    # input gradients summed over the group (2 layers x 2 modules x 2), within bf16 tolerance
    assert tp["ok"] and tp["tp_degree"] == 2 and tp["tp_collectives"]["all_reduce"] == 8, tp


def test_the_peer_benchmark_runs_its_smallest_case(tmp_path):
    """``bench/peers.py``'s smallest case (``gpu_check.py --only peers --dry``: 2 ranks, 256 tokens,
    every peer, one step each) against one process. autosp's shortest call, DeepSpeed AutoSP and the
    hand-written Ulysses are exact; ALST's loss and every gradient but the LM head's are, and the LM
    head's is its recipe's: ``TiledFusedLogitsLoss`` computes it inside the forward with an incoming
    gradient of 1 and never rescales it, so after the loss is divided by the 255 labelled tokens and
    the engine averages over the 2 ranks it is 255 / 2 times too large; PyTorch's context parallel
    stops at its SDPA rule on the CPU."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "bench/gpu_check.py", "--only", "peers", "--dry", "--out", str(tmp_path)],
                         cwd=root, env={**os.environ, "PYTHONPATH": root, "DS_ACCELERATOR": "cpu"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    res = json.loads((tmp_path / "peers.json").read_text())
    rows = {r["system"]: r for r in res["rows"]}
    assert res["device"] == "cpu" and set(rows) == {"autosp (shortest call)", "ALST", "DeepSpeed AutoSP",
                                                    "PyTorch context_parallel", "hand-written Ulysses"}
    assert all(r["world"] == 2 and r["seq_len"] == 256 for r in rows.values())
    for name in ("autosp (shortest call)", "DeepSpeed AutoSP", "hand-written Ulysses"):
        assert rows[name]["loss_err"] < 1e-5 and rows[name]["grad_err"] < 1e-4 and not rows[name]["off"], rows[name]
    assert rows["autosp (shortest call)"]["chose"], "the shortest call plans: its choice is reported"
    alst = rows["ALST"]
    assert alst["loss_err"] < 1e-5 and list(alst["off"]) == ["lm_head.weight"], alst
    assert abs(alst["off"]["lm_head.weight"] - (255 / 2 - 1)) < 1e-3, alst
    assert "does not have a sharding strategy registered" in rows["PyTorch context_parallel"]["error"]
    assert "**not exact** (lm_head.weight)" in run.stdout

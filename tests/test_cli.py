"""The CLI as a user runs it: tables, JSON, one-line errors."""

import json
import subprocess
import sys

from autosp.cli import main


def test_inspect_json(capsys):
    assert main(["inspect", "--model", "tiny", "--seq-len", "1024", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["seq_len"] == 1024 and doc["layer_classes"][0]["count"] == 2
    assert doc["totals"]["fwd_flops"] > 0


def test_inspect_table(capsys):
    assert main(["inspect", "--model", "tiny", "--seq-len", "512"]) == 0
    out = capsys.readouterr().out
    assert "LlamaDecoderLayer" in out and "total" in out


def test_errors_are_one_line_without_traceback():
    r = subprocess.run([sys.executable, "-m", "autosp.cli", "inspect", "--model", "nope", "--seq-len", "8"],
                       capture_output=True, text=True)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown model 'nope'" in lines[0] and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "autosp.cli", "inspect", "--model", "tiny", "--seq-len", "-5"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "positive integer" in r.stderr


def test_explain_runs_a_step_and_reports_what_ran(capsys):
    assert main(["explain", "--model", "tiny", "--seq-len", "256", "--strategy", "allgather_kv", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [a["strategy"] for a in doc["attention"]] == ["allgather_kv"] * 2
    assert all(a["tokens_per_rank"] == 128 for a in doc["attention"])
    assert doc["collectives"]["all_gather"]["calls"] == 4 and doc["collectives"]["reduce_scatter"]["calls"] == 4
    assert "send_recv" not in doc["collectives"] and "all_to_all" not in doc["collectives"]


def test_plan_without_the_host_optimizer_refuses_in_one_line_naming_what_fits(capsys):
    """At 4,079,872 tokens of Llama-3-8B on 8 H100s (ZeRO 3) only the optimizer on the host fits
    (tests/test_planner.py pins that plan); ``--no-host-optimizer`` refuses in one line, naming it."""
    args = ["plan", "--model", "llama3-8b", "--world-size", "8", "--profile", "h100-sxm", "--zero-stage", "3",
            "--seq-len", "4079872", "--no-host-optimizer"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stepping the optimizer on the host fits (drop --no-host-optimizer" in err[0], err

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


def test_plan_json_says_where_the_optimizer_steps_and_the_flag_keeps_it_on_the_device(capsys):
    """At 3,974,896 tokens of Llama-3-8B on 8 H100s (ZeRO 3) the plan keeps the optimizer on the host;
    ``--no-host-optimizer`` refuses that length in one line, naming what fits."""
    args = ["plan", "--model", "llama3-8b", "--world-size", "8", "--profile", "h100-sxm", "--zero-stage", "3",
            "--seq-len", "3974896"]
    assert main(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["mesh"]["host_optimizer"] is True and doc["predicted"]["memory"]["optimizer"] == 0
    assert main(args + ["--no-host-optimizer"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stepping the optimizer on the host fits (drop --no-host-optimizer" in err[0], err

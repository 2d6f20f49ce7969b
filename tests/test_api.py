"""``autosp.compile`` refuses bad arguments with one line naming the fix, before any process group exists."""

import pytest
import torch

import autosp
from autosp.errors import AutospError


def test_unknown_compiler_lists_the_known_ones():
    with pytest.raises(AutospError, match="unknown compiler 'tvm'; use one of inductor, aot_eager, eager"):
        autosp.compile(torch.nn.Linear(2, 2), plan="ulysses", runtime=autosp.Runtime(compiler="tvm"))


def test_unknown_strategy_lists_the_registered_ones():
    with pytest.raises(AutospError, match="unknown strategy 'magic'; use one of auto, .*ulysses.*hybrid:UxR"):
        autosp.compile(torch.nn.Linear(2, 2), plan="magic")


def test_a_layout_the_strategy_cannot_use_is_refused():
    with pytest.raises(AutospError, match="need layout='zigzag'"):
        autosp.compile(torch.nn.Linear(2, 2), plan=autosp.Decisions.of(
            strategy="zigzag_ring", mesh=autosp.MeshChoice(layout="contiguous")))


def test_cu_seqlens_to_positions_and_its_errors():
    import torch

    from autosp.errors import AutospError
    from autosp.transform.batch import positions_from_cu_seqlens

    pos = positions_from_cu_seqlens(torch.tensor([0, 3, 8, 10, 16]), batch=2, seq_len=8)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 0, 1, 2, 3, 4, 5]]
    with pytest.raises(AutospError, match="crosses a row boundary"):
        positions_from_cu_seqlens([0, 5, 12, 16], batch=2, seq_len=8)
    with pytest.raises(AutospError, match="rise strictly from 0"):
        positions_from_cu_seqlens([0, 8, 8, 16], batch=2, seq_len=8)


def test_the_default_compiler_is_inductor_unless_the_environment_names_another(monkeypatch):
    from autosp.transform.backend import default_compiler

    monkeypatch.delenv("AUTOSP_COMPILER", raising=False)
    assert default_compiler() == "inductor"
    monkeypatch.setenv("AUTOSP_COMPILER", "aot_eager")
    assert default_compiler() == "aot_eager"
    monkeypatch.setenv("AUTOSP_COMPILER", "tvm")
    with pytest.raises(AutospError, match="AUTOSP_COMPILER='tvm' is not a compiler; use one of inductor, aot_eager"):
        autosp.compile(torch.nn.Linear(2, 2), plan="ulysses")


def test_compile_is_one_function_with_few_parameters_each_documented():
    import inspect

    params = inspect.signature(autosp.compile).parameters
    assert len(params) <= 8, list(params)
    doc = autosp.compile.__doc__
    assert "Args:" in doc and all(f"    {name}:" in doc for name in params if name != "unknown")


def test_keywords_of_no_release_are_refused_naming_where_they_live(tmp_path, monkeypatch):
    """No deprecation layer: a keyword that belongs to an option group is refused in one line that
    names its spelling; an unknown one names the options. A strategy name is never read as a file."""
    with pytest.raises(AutospError, match=r"takes no strategy=, zero_stage=.*strategy: plan='ulysses'.*"
                                          r"zero_stage: zero=<stage>"):
        autosp.compile(torch.nn.Linear(2, 2), strategy="ring", zero_stage=1)
    with pytest.raises(AutospError, match=r"takes no strateg=; its options are plan, mesh, memory_limit, zero and "
                                          r"runtime \(see help"):
        autosp.compile(torch.nn.Linear(2, 2), strateg="ring")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ring").write_text("not a plan")
    with pytest.warns(UserWarning, match="not initialised"):
        assert isinstance(autosp.compile(torch.nn.Linear(2, 2), plan="ring"), torch.nn.Linear)
    with pytest.raises(AutospError, match="plan file missing.json does not exist"):
        autosp.compile(torch.nn.Linear(2, 2), plan="missing.json")
    with pytest.raises(AutospError, match="plan file .*ring is not valid JSON"):
        autosp.compile(torch.nn.Linear(2, 2), plan=tmp_path / "ring")


def test_option_groups_check_their_fields_where_they_are_made():
    from autosp.options import parse_bytes

    with pytest.raises(AutospError, match="ZeRO stage must be 0, 1, 2 or 3"):
        autosp.Zero(stage=4)
    with pytest.raises(AutospError, match="needs stage=3"):
        autosp.Zero(stage=2, shard="node")
    with pytest.raises(AutospError, match="unknown checkpointing 'most'"):
        autosp.Auto(checkpoint="most")
    with pytest.raises(AutospError, match="mlp_chunks must be a positive integer"):
        autosp.Decisions.of(strategy="ulysses", mlp_chunks=0)
    with pytest.raises(AutospError, match="one entry per transformer layer"):
        autosp.Decisions.of(strategy=["ulysses", "ring"], checkpoint=["none", "full", "full"])
    assert parse_bytes("40GiB") == 40 * 2 ** 30 and parse_bytes("1.5 GB") == 1.5e9 and parse_bytes(1e9) == 1e9
    with pytest.raises(AutospError, match="size such as '40GiB'"):
        parse_bytes("lots")
    with pytest.raises(AutospError, match="budget for the planner"):
        autosp.compile(torch.nn.Linear(2, 2), plan="ulysses", memory_limit="1GiB")


def test_per_layer_decisions_are_read_by_one_rule():
    """``Decisions.layer(i)``: one choice serves every layer; a list has one per layer, and an
    index past its end is refused (never wrapped around or defaulted)."""
    same = autosp.Decisions.of(strategy=["ulysses", "ulysses"], checkpoint="full")
    assert len(set(same.layers)) == 1 and len(same.layers) == 2
    assert same.layer(1) == autosp.LayerChoice("ulysses", "full")
    mixed = autosp.Decisions.of(strategy=["ulysses", "ring"], mlp_chunks=[1, 8])
    assert len(set(mixed.layers)) == 2 and mixed.any_layer(lambda c: c.mlp_chunks > 1)
    assert [mixed.layer(i) for i in (0, 1)] == [autosp.LayerChoice("ulysses"), autosp.LayerChoice("ring", "none", 8)]
    with pytest.raises(AutospError, match="per-layer decisions have 2 entries but the model has more layers "
                                          r"\(layer 2"):
        mixed.layer(2)
    one = autosp.Decisions.of(strategy="ring")
    assert one.layer(0) == one.layer(99) == autosp.LayerChoice("ring")


def test_the_backend_is_found_by_its_entry_point_without_importing_autosp_first():
    import subprocess
    import sys

    code = ("import sys, torch\nfrom torch._dynamo.backends.registry import lookup_backend\n"
            "assert 'autosp' not in sys.modules\nfn = lookup_backend('autosp')\n"
            "print(fn.__module__, fn.__name__)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["autosp.transform.backend", "autosp_backend"]


def test_lengths_are_planned_at_their_bucket():
    from autosp.transform.sequence_parallel import length_bucket

    assert [length_bucket(n, 2) for n in (64, 65, 102, 128, 300)] == [64, 128, 128, 128, 512]
    assert length_bucket(6, 4) == 8 and length_bucket(30, 3) == 36      # a multiple of 2 x SP degree


def test_the_trainer_refuses_metrics_over_sharded_logits(tmp_path):
    import transformers

    from autosp.hf import AutospTrainer

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1, vocab_size=64, attn_implementation="sdpa")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(AutospError, match="compute_metrics reads the logits"):
        AutospTrainer(model=model, args=args, compute_metrics=lambda p: {})
    AutospTrainer(model=model, args=args, compute_metrics=lambda p: {},
                  autosp={"runtime": autosp.Runtime(gather_outputs=True)})


def test_the_tokens_observed_at_an_attention_op_are_recorded_by_every_compiler():
    """``autosp::observe_tokens`` returns nothing: only its side effect keeps it in a compiled graph.
    Each compiler runs it at every call, at the length of that call (one graph, dynamic shapes)."""
    import torch

    from autosp.transform.observe import new_step, observe_tokens, observed

    def f(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        observe_tokens(q, 2, 7, "probe")
        return (q @ w).relu().sum()

    for backend in ("eager", "aot_eager", "inductor"):
        torch._dynamo.reset()
        g = torch.compile(f, backend=backend, dynamic=True)
        for tokens in (8, 24):
            new_step("probe")
            q = torch.randn(1, 2, tokens, 4, requires_grad=True)
            g(q, torch.randn(4, 3, requires_grad=True)).backward()
            assert observed("probe").attention_tokens == {7: tokens}, (backend, tokens)
    new_step("probe")

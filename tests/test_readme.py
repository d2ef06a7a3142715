"""Every example in README.md works: each policy spec parses and runs, each ``kveval`` command parses, cheap ones run.

What is extracted:

* commands: every line of an indented code block that runs ``kveval ...`` or
  ``python3 -m kveval ...`` (continuation lines joined), and every inline code
  span that starts with ``kveval ``;
* policy specs: inline code spans such as ``snapkv(ratio=0.5)+kivi(bits=4)``,
  the ``--policy`` of every command and the ``policy=`` of lm-eval model args.
  Spans that list a policy's parameters without values, such as
  ``streaming(sink, window)``, are parameter lists: their names must exist.

Cheap commands (``policies``, ``memory`` on presets, ``probes``) run here;
``generate`` runs on the embedded models under the ``slow`` mark.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest

from kveval.errors import UnsupportedModelError
import torch

from kveval.commands.main import COMMANDS
from kveval.policies.registry import POLICIES
from kveval.policies.spec import _split_terms, param_types, parse_policy
from kveval.runner.runspec import RunSpec

README = Path(__file__).resolve().parent.parent / "README.md"
TEXT = README.read_text(encoding="utf-8")

_SPAN = re.compile(r"`([^`\n]+)`")
_TERM = re.compile(r"^([a-z0-9_]+)(?:\((.*)\))?$")


def readme_commands() -> list[str]:
    """``kveval ...`` commands shown in README.md (without the leading ``kveval``, comments and ``[optional]`` parts)."""
    commands = []
    lines = TEXT.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("    "):
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i].strip()
            match = re.search(r"(?:^|\s|&&\s)(?:python3? -m )?kveval (.*)$", line.strip())
            if match:
                commands.append(match.group(1))
        i += 1
    # inline mentions such as `kveval policies`; a bare `kveval compare` names a command shown in full above
    commands += [span[len("kveval "):] for span in _SPAN.findall(TEXT)
                 if span.startswith("kveval ") and (" " in span[len("kveval "):] or span == "kveval policies")]
    cleaned = []
    for command in commands:
        command = re.sub(r"\s+#.*$", "", command)  # a trailing comment
        command = re.sub(r"\s*\[[^\]]*\]", "", command)  # [--optional ...] usage notation
        cleaned.append(command.strip())
    return list(dict.fromkeys(cleaned))


def _is_parameter_list(span: str) -> bool:
    return any("=" not in arg or "\\|" in arg or arg.endswith("=")
               for term in _split_terms(span) for arg in (_TERM.match(term).group(2) or "").split(",") if arg.strip())


def readme_specs() -> tuple[list[str], list[str]]:
    """(policy specs, parameter lists) shown in README.md."""
    specs, parameter_lists = [], []
    for span in _SPAN.findall(TEXT):
        terms = _split_terms(span)
        if "(" not in span or not all(_TERM.match(t) and _TERM.match(t).group(1) in POLICIES for t in terms):
            continue
        (parameter_lists if _is_parameter_list(span) else specs).append(span)
    for command in readme_commands():
        words = shlex.split(command)
        specs += [words[i + 1] for i, w in enumerate(words[:-1]) if w == "--policy"]
        for word in words:
            match = re.search(r"policy=(.*?)(?:,[a-z_]+=|$)", word)
            if match:
                specs.append(match.group(1))
    return list(dict.fromkeys(specs)), list(dict.fromkeys(parameter_lists))


SPECS, PARAMETER_LISTS = readme_specs()
COMMANDS_SHOWN = readme_commands()


def test_the_readme_stays_short():
    """Deep dives live in docs/; the README is at most 300 lines."""
    assert len(TEXT.splitlines()) <= 300


def test_the_readme_shows_what_this_test_covers():
    assert "lowrank(rank=16)+quant(bits=8)" in SPECS and "snapkv(ratio=0.5)+kivi(bits=4)" in SPECS
    assert {c.split()[0] for c in COMMANDS_SHOWN} == {"generate", "eval", "probes", "compare", "gate", "report", "sweep",
                                                      "memory", "lm-eval", "policies", "rescore"}


def smollm2_shaped_llama():
    """A tiny random Llama with SmolLM2-135M's attention layout (3 KV heads x head_dim 64, GQA 3:1).

    The README's specs are sized for the embedded models (``latent(rank=96)`` is 3 heads x 32,
    ``kivi(group=32)`` divides 64), so they must run on that layout, not on an arbitrary tiny one.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    from kveval.cache.attention import register_attention

    register_attention()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=72, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=1024,
                         attn_implementation="kveval", tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = None
    return model.eval()


@pytest.mark.parametrize("spec", SPECS)
def test_every_readme_policy_spec_parses_and_runs_on_a_tiny_model(spec):
    stack = parse_policy(spec.split("@")[0])
    if stack.quantization is not None and stack.quantization.indexer != "same":  # a DeepSeek-only term: on V4
        from tiny_models import tiny_model

        model = tiny_model("deepseek_v4")
        model.generation_config.eos_token_id = None
    else:
        model = smollm2_shaped_llama()
    try:
        run = RunSpec.parse(spec).for_model(model)
    except UnsupportedModelError:  # a format of DeepSeek's own cache (its record widths): on a tiny V4 of those widths
        from test_deepseek_records import V4_WIDTHS
        from tiny_models import tiny_model

        model = tiny_model("deepseek_v4", **V4_WIDTHS)
        model.generation_config.eos_token_id = None
        run = RunSpec.parse(spec).for_model(model)
    assert RunSpec.parse(run.spec).for_model(model).spec == run.spec  # the canonical spec reads back as itself
    from kveval.cache.compressed import CompressedCache

    ids = torch.randint(1, 128, (1, 48), generator=torch.Generator().manual_seed(0))
    cache = CompressedCache(model, parse_policy(run.policy))
    with torch.no_grad():
        logits = model(ids, cache=cache).logits
        if cache.awaiting_reconstruction:  # KVzip: its reconstruction forwards come between prefill and decode
            from kveval.runner.generation import reconstruct_and_compress

            from tiny_models import Tok

            reconstruct_and_compress(model, Tok(), cache, [ids[0].tolist()], 0)
        model(logits[:, -1:].argmax(-1), cache=cache, position_ids=torch.tensor([[48]]))
    assert cache.stats().kv_bytes > 0


@pytest.mark.parametrize("listing", PARAMETER_LISTS)
def test_every_readme_parameter_list_names_real_parameters(listing):
    for term in _split_terms(listing):
        name, args = _TERM.match(term).groups()
        names = {arg.split("=")[0].strip() for arg in (args or "").replace("\\|", "|").split(",") if arg.strip()}
        names = {n.strip() for part in names for n in part.split("|") if n.strip()}
        assert names <= set(param_types(POLICIES[name])), f"{listing}: {names - set(param_types(POLICIES[name]))}"


# README commands that are known not to parse or run yet: {command: the fix}. Strict: fixing the README fails the test
# until the entry is removed here.
KNOWN_BROKEN: dict[str, str] = {}


def _mark(commands: list[str]) -> list:
    return [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=KNOWN_BROKEN[c])) if c in KNOWN_BROKEN else c
            for c in commands]


def _parse(command: str) -> argparse.Namespace | None:
    words = shlex.split(command)
    if words[0] == "lm-eval":
        # `--model_args ...` is a placeholder for model arguments: any valid ones stand in for it
        words = ["pretrained=smollm2-135m" if w == "..." and words[i - 1] == "--model_args" else w for i, w in enumerate(words)]
        import sys

        from lm_eval._cli import HarnessCLI

        saved = sys.argv
        sys.argv = ["lm-eval", "run", *words[1:]]
        try:
            return HarnessCLI().parse_args()
        finally:
            sys.argv = saved
    parser = argparse.ArgumentParser(prog="kveval")
    sub = parser.add_subparsers(dest="command", required=True)
    module_name, _ = COMMANDS[words[0]]
    importlib.import_module(module_name).configure(sub.add_parser(words[0]))
    return parser.parse_args(words)


@pytest.mark.parametrize("command", _mark(COMMANDS_SHOWN))
def test_every_readme_command_parses(command):
    try:
        _parse(command)
    except SystemExit as exc:
        pytest.fail(f"README command `kveval {command}` does not parse (exit {exc.code})")


def _cheap(command: str) -> bool:
    words = command.split()
    if words[0] == "policies" or words[0] == "probes":
        return True
    return words[0] == "memory" and not any("/" in w for w in words[1:])  # presets, not placeholder paths


@pytest.mark.parametrize("command", _mark([c for c in COMMANDS_SHOWN if _cheap(c)]))
def test_cheap_readme_commands_run(command, tmp_path, monkeypatch, capsys):
    from kveval.commands.main import main

    monkeypatch.chdir(tmp_path)
    words = shlex.split(command)
    if words[0] == "probes":  # the README's command, fewer items
        words[words.index("--n") + 1] = "1"
    assert main(words) == 0, capsys.readouterr().err
    if words[0] == "probes":
        assert Path(words[words.index("--out") + 1]).stat().st_size > 0


GENERATE = [c for c in COMMANDS_SHOWN if c.startswith("generate")]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
# The README's stacking example, calibrated on 256 tokens instead of 2048: the same code path at an eighth of the time.
@pytest.mark.parametrize("policy", [None, "lowrank(rank=16,calib_tokens=256)+quant(bits=8)"])
def test_readme_generate_runs_on_the_embedded_models(model, policy, capsys):
    """The README's generate command, and its stacking example, on both embedded models (short prompt)."""
    from kveval.commands.main import main

    words = shlex.split(GENERATE[0])
    words[words.index("--model") + 1] = model
    if policy is not None:
        words[words.index("--policy") + 1] = policy
    words += ["--max-new-tokens", "4"]
    assert main(words) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "policy " in out and "ratio" in out


def test_the_add_a_policy_example_registers_parses_and_scores(tmp_path, monkeypatch):
    """The "Adding a policy" example (CONTRIBUTING.md, where the README points) is real code: imported as a module of
    one's own, it registers, stacks, and scores keys as it says."""
    assert "(CONTRIBUTING.md#adding-a-policy)" in TEXT.split("## Adding a policy", 1)[1]
    contributing = (README.parent / "CONTRIBUTING.md").read_text(encoding="utf-8")
    block = contributing.split("## Adding a policy", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    (tmp_path / "my_policies.py").write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        importlib.import_module("my_policies")
        stack = parse_policy("mynorm(ratio=0.5)+kivi(bits=4)")
        assert stack.selection.name == "mynorm" and stack.quantization.name == "kivi"
        keys = torch.tensor([[[1.0, -3.0], [0.5, 0.5], [2.0, 0.0]]])  # [kv_heads=1, tokens=3, head_dim=2]
        from kveval.tensors.scoring_state import ScoringState

        scores = stack.selection.scores(ScoringState(keys, torch.arange(3)[None], None, 0, 1))
        assert scores.tolist() == [[-3.0, -0.5, -2.0]]  # the key with the smallest largest coordinate scores best
    finally:
        POLICIES.pop("mynorm", None)
        sys.modules.pop("my_policies", None)

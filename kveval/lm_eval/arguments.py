"""Model arguments of the ``kveval`` lm-eval model type, parsed once at the edge (see :mod:`kveval.lm_eval.model`).

``--model_args`` strings keep a policy spec's commas inside its parentheses;
the ``policy``/``compress``/``kv_dtype`` arguments become one :class:`~kveval.runner.runspec.RunSpec`;
HFLM's big-model options become :func:`kveval.runner.models.load_model`'s placement.
"""

from __future__ import annotations

import torch

from kveval.dtypes import parse_kv_dtype
from kveval.errors import PolicySpecError, UsageError
from kveval.values import is_whole
from kveval.policies.base import PolicyStack
from kveval.policies.spec import parse_policy
from kveval.runner.runspec import RunSpec, parse_mode

# HFLM options that still mean something when HFLM receives a loaded model object.
HFLM_KEYS = {"max_length", "truncation", "add_bos_token", "prefix_token_id", "logits_cache", "softmax_dtype",
             "mixed_precision_dtype", "use_fast_tokenizer", "think_end_token", "enable_thinking",
             "chat_template_args", "backend"}
# HFLM loading options kveval does not support (it loads the model itself: whole, or placed by accelerate).
UNSUPPORTED = {"peft", "delta", "autogptq", "gptqmodel", "tp_plan", "offload_folder"}


def split_model_args(text: str) -> list[str]:
    """Split a ``key=value,key=value`` string on commas outside parentheses, brackets, braces and quotes."""
    parts, buf, depth, quote = [], [], 0, None
    for ch in text:
        if quote is not None:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(depth - 1, 0)
        elif ch == "," and depth == 0:
            parts.append("".join(buf))
            buf = []
            continue
        buf.append(ch)
    parts.append("".join(buf))
    return [p for p in parts if p.strip()]


def parse_model_args(text: str | None) -> dict:
    """``--model_args`` string to a dict, keeping a policy spec's commas inside its parentheses.

    Values are typed as lm-eval types them (``0.5`` -> float, ``true`` -> bool,
    quotes -> string). lm-eval's own ``simple_parse_args_string`` splits on
    every comma, which would cut ``snapkv(ratio=0.5,window=32)`` apart.
    """
    from lm_eval.utils import handle_arg_string

    result = {}
    for item in split_model_args((text or "").strip()):
        if "=" not in item:
            raise UsageError(f"model argument {item.strip()!r} is not key=value")
        key, value = item.split("=", 1)
        result[key.strip()] = handle_arg_string(value)
    return result


def whole_seed(seed) -> int:
    """``seed=`` as lm-eval hands it over (an int, or the text of ``--model_args``), refused in one line unless it is
    a whole number."""
    if isinstance(seed, str) and seed.strip().lstrip("-").isdigit():
        seed = int(seed)
    if not is_whole(seed):
        raise UsageError(f"model argument seed={seed!r} is not a whole number; give e.g. seed=0")
    return seed


def policy_from_arg(policy) -> PolicyStack:
    """Parse the ``policy`` model argument (``;`` allowed instead of ``,`` inside parentheses)."""
    return runspec_from_args(policy).policy


def runspec_from_args(policy, compress: str | None = None, kv_dtype=None) -> RunSpec:
    """The run spec of the ``policy``, ``compress`` and ``kv_dtype`` model arguments, parsed once.

    ``policy`` may carry a mode suffix (``snapkv(ratio=0.5)@query``) instead of ``compress=``.
    """
    if isinstance(policy, RunSpec):
        return policy
    if isinstance(policy, PolicyStack) or policy is None:
        return RunSpec(parse_policy(policy), parse_mode(compress), parse_kv_dtype(kv_dtype))
    if not isinstance(policy, str):
        raise PolicySpecError(f"policy={policy!r}: give a policy spec string such as 'snapkv(ratio=0.5)+kivi(bits=4)'")
    return RunSpec.parse(policy.replace(";", ","), mode=compress, kv_dtype=kv_dtype)


def placement_args(kwargs: dict) -> None:
    """HFLM's big-model options as :func:`kveval.runner.models.load_model` takes them, in place.

    ``parallelize=True`` means ``device_map="auto"`` (unless a ``device_map`` is
    given); ``max_memory_per_gpu`` and ``max_cpu_memory`` build ``max_memory``
    over the visible GPUs and the CPU, as ``--model hf`` does.
    """
    parallelize = kwargs.pop("parallelize", False)
    per_gpu, cpu = kwargs.pop("max_memory_per_gpu", None), kwargs.pop("max_cpu_memory", None)
    if parallelize and not kwargs.get("device_map"):
        kwargs["device_map"] = "auto"
    if per_gpu or cpu:
        memory = {i: per_gpu for i in range(torch.cuda.device_count())} if per_gpu else {}
        kwargs["max_memory"] = {**memory, **({"cpu": cpu} if cpu else {})}


def unescape(text: str) -> str:
    if "\\" not in text:
        return text
    return text.encode("latin-1", "backslashreplace").decode("unicode_escape")

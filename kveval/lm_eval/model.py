"""The ``kveval`` lm-eval model type: Hugging Face causal LMs with a compressed KV cache.

``--model kveval --model_args pretrained=smollm2-135m,policy=snapkv(ratio=0.5)+kivi(bits=4),compress=context``

Model arguments (everything else goes to ``from_pretrained`` through
:func:`kveval.runner.models.load_model`, or to lm-eval's ``HFLM`` for its own options
such as ``max_length``, ``add_bos_token``, ``truncation``):

``pretrained``
    An embedded model (``smollm2-135m``, ``gemma3-270m``), a Hub id, a local
    folder or a ``.gguf`` file; or, from Python, a model object loaded with
    ``attn_implementation="kveval"`` (then pass ``tokenizer`` too).
``policy``
    A kveval policy spec such as ``snapkv(ratio=0.5)+kivi(bits=4)`` (``none`` by
    default; a ``@query`` suffix may stand for ``compress=query``). It is parsed
    and checked against the model's config.json before the weights load: a bad
    spec is a :class:`~kveval.errors.PolicySpecError` (a ``ValueError``).
    Commas inside parentheses are fine on the lm-eval 0.4.13 command line (its
    ``--model_args`` parser splits on top-level commas only); ``;`` may be used
    instead of ``,`` inside the parentheses where a tool splits on every comma.
``compress``
    ``context`` (query-agnostic, default) or ``query`` (query-aware); see below.
``question_marker``
    Optional text that starts the question in every prompt (its last
    occurrence; backslash escapes such as ``\\n\\n`` are decoded). Without it
    kveval cannot tell context from question in an lm-eval prompt.
``kv_dtype``
    Dtype of the full-precision tokens the cache holds and of the bytes ratios
    are stated against (``bfloat16``, ``float16``, ``float32``); default the
    model's deployment dtype.
``seed``
    Base seed of the ``random`` control policy.
``device``, ``dtype``
    ``auto`` (default): CUDA + bfloat16 when a GPU is present, else CPU + float32.
``parallelize``, ``device_map``, ``max_memory``, ``max_memory_per_gpu``, ``max_cpu_memory``
    Models larger than one GPU, placed by accelerate as ``--model hf`` does
    (``parallelize=True`` is ``device_map=auto``); see :func:`kveval.runner.models.load_model`.

What is compressed
------------------
A request's prompt (lm-eval's context string, tokenized as ``HFLM`` does) is
split into *context* ``C`` and *question* ``Q``: ``Q`` starts at
``question_marker``; without a marker ``Q`` is the prompt's last token in
``compress=context`` mode and empty in ``compress=query`` mode.

* ``compress=context``: ``C`` is prefilled into a fresh
  :class:`~kveval.cache.compressed.CompressedCache` and compressed at the end of that
  pass, before ``Q`` is seen; ``Q`` (and, for loglikelihood, the continuation)
  is then processed against the compressed cache. Every scored or generated
  token therefore sees only the compressed context. Without a marker the
  question is inside ``C``, so policies that score tokens with the prefill's
  last queries (SnapKV and the like) do see it; set ``question_marker`` for
  strictly query-agnostic compression.
* ``compress=query``: ``C + Q`` are prefilled together, ``Q`` is kept out of
  selection and the policy compresses ``C`` with ``Q`` in view. As in deployed
  query-aware compression (and :func:`kveval.runner.generation.generate`), the first
  answer token is predicted by that prefill pass, i.e. before compression; later
  tokens see the compressed cache. A single-token continuation is therefore
  scored as uncompressed in this mode.

``loglikelihood`` (multiple choice): requests are grouped by their prefill, so
the choices of one question share ONE compressed prefill; each continuation is
then scored in one teacher-forced pass on a copy of that cache. Decode-phase
budgets (``window``, ``streaming``, ``decode_budget=``) and KIVI's residual act
after each pass, so within the continuation every token sees all earlier
continuation tokens: for long continuations under such budgets this can differ
from token-by-token greedy decoding.

``loglikelihood_rolling`` (perplexity tasks): stock ``HFLM`` behaviour,
uncompressed. lm-eval's rolling windows have a one-token prefix, so there is no
context to compress; the windows are scored exactly as ``--model hf`` scores
them, and a warning says so.

``generate_until``: :func:`kveval.runner.generation.generate` (greedy) with the
compressed cache for prefill and decoding, batched (answers do not depend on the
batch size), ``until`` stop strings and ``max_gen_toks``. Sampling
(``do_sample=True``) is refused.

One prefill for several policies: :meth:`KVEvalLM.share_prefill` makes a run
compute each request for other policies too (one uncompressed prefill, each
policy's cache derived from it as :func:`kveval.runner.generation.generate_each`
does) and leave their answers in a :class:`ResponseStore`, from which their
own runs of the same task are answered. ``kveval sweep`` does this for its
lm-eval tasks; every policy's samples and measured bytes equal a separate run's.

Measured cache bytes (after each loglikelihood prefill, and at the end of each
generation) are averaged over the requests the model computed and reported by
:meth:`KVEvalLM.get_model_info`, which lm-eval merges into
``results["config"]``. Requests answered from lm-eval's ``--use_cache`` are not
measured; its cache key does not include the model arguments, so give every
policy its own ``--use_cache`` path.

The file stays over 600 lines on purpose: it is one class, lm-eval's ``LM`` interface, whose request methods share
the plans, caches and measurements they build; a third of it is this page, the model type's reference.
"""

from __future__ import annotations

import json
import logging
from importlib import metadata as importlib_metadata

import lm_eval.models  # noqa: F401  (fills lm-eval's model registry first: registering before breaks get_model("hf"))
import torch
import torch.nn.functional as F
from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.huggingface import HFLM
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

import kveval
from kveval.cache.attention import ATTENTION_NAME, register_attention
from kveval.cache.compressed import CompressedCache, nominal_bytes_per_token
from kveval.dtypes import deployment_dtype_name
from kveval.errors import UsageError
from kveval.lm_eval import data_parallel
from kveval.lm_eval.arguments import (
    HFLM_KEYS,
    UNSUPPORTED,
    parse_model_args,
    placement_args,
    policy_from_arg,
    runspec_from_args,
    split_model_args,
    unescape,
    whole_seed,
)
from kveval.lm_eval.responses import ResponseStore, call_key
from kveval.modeling.rope import check_rope_batch, rope_switches
from kveval.modeling.sources import load_tokenizer
from kveval.policies.base import PolicyStack
from kveval.runner import models  # models.load_model, looked up when called (tests stand a fake in)
from kveval.runner.evaluate import hardware_of
from kveval.runner.runspec import model_identity
from kveval.runner.generation import (
    MODES,
    Prompt,
    can_share_prefill,
    check_batch_size,
    check_request,
    forward_batch_size,
    forward_rows,
    generate_each,
)
from kveval.runner.runspec import RunSpec
from kveval.runs import lm_eval_schema as schema

log = logging.getLogger(__name__)

MODEL_TYPE = "kveval"

def _version(name: str) -> str:
    try:
        return importlib_metadata.version(name)
    except importlib_metadata.PackageNotFoundError:
        return "unknown"


# --- cache helpers -------------------------------------------------------------------------------

def _whole_batch_size(value) -> int:
    """A batch size as lm-eval hands it over (an int, or digits from ``--batch_size``/``--model_args``), checked
    like every batch size of kveval."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    check_batch_size(value)
    return value


def _planned_batches(groups: dict, order: list, batch_size: int):
    """The forwards :meth:`KVEvalLM._score_plans` runs, in order, for :meth:`KVEvalLM._check_rope_forwards` to walk
    before any: per batch of ``batch_size`` prefill groups (``order``'s keys, ``groups[key]`` the requests sharing
    one), ``(first, keys, tail_batches)``, ``first`` the batch's first group and ``tail_batches`` its
    ``(row g, request i)`` pairs, ``batch_size`` at a time, each scored in one forward."""
    for first in range(0, len(order), batch_size):
        keys = order[first:first + batch_size]
        members = [(g, i) for g, key in enumerate(keys) for i in groups[key]]
        yield first, keys, [members[start:start + batch_size] for start in range(0, len(members), batch_size)]


def _fork_rows(cache: CompressedCache, index: list[int], memo: dict) -> CompressedCache:
    """A new cache whose row ``j`` is an independent copy of row ``index[j]`` of ``cache``.

    ``memo`` maps the model (and its modules and parameters) to themselves so
    that the copy never duplicates weights.
    """
    return cache.fork_rows(index, memo)  # also forks linear-attention/Mamba states (hybrid models)


# --- the model type ------------------------------------------------------------------------------

class KVEvalLM(HFLM):
    """lm-eval ``HFLM`` whose KV cache is compressed by a kveval policy (see the module docstring)."""

    def __init__(self, pretrained="smollm2-135m", tokenizer=None, policy="none", compress: str | None = None,
                 question_marker: str | None = None, seed: int = 0, device: str | None = "auto",
                 dtype="auto", batch_size=1, max_batch_size: int | None = 64, trust_remote_code: bool = False,
                 kv_dtype: str | None = None, **kwargs):
        # Our own arguments first, so a bad spec fails before anything loads.
        if compress is not None and compress not in MODES:
            raise UsageError(f"compress={compress!r}; use 'context' (query-agnostic: compress before the question) "
                             f"or 'query' (query-aware: compress with the question in view)")
        self.runspec = runspec_from_args(policy, compress, kv_dtype)
        selection = self.runspec.policy.selection
        if selection is not None and selection.reconstructs:
            raise UsageError(f"{selection.spec()}: KVzip scores with reconstruction forwards after the prefill, "
                             f"which kveval's lm-eval adapter does not run; evaluate it with kveval eval (probes)")
        if isinstance(pretrained, str):  # checked against its config.json before the weights load
            self.runspec = self.runspec.for_model(pretrained)
        self.question_marker = unescape(str(question_marker)) if question_marker not in (None, "") else None
        self.seed = whole_seed(seed)
        unsupported = sorted(k for k in UNSUPPORTED if kwargs.get(k))
        if unsupported:
            raise UsageError(f"model_args {', '.join(unsupported)} are not supported by --model kveval "
                             f"(it loads the whole model on one device)")
        for k in UNSUPPORTED:
            kwargs.pop(k, None)
        placement_args(kwargs)
        if "attn_implementation" in kwargs:
            raise UsageError("attn_implementation is set by kveval (the 'kveval' attention function); remove it from model_args")
        hflm_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in HFLM_KEYS}
        for k in ("revision", "subfolder", "gguf_file"):  # meaningful for from_pretrained only when given
            if kwargs.get(k) in (None, "", "main"):
                kwargs.pop(k, None)
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            log.warning("kveval: batch_size=%s is not supported; using 1", batch_size)
            batch_size = 1
        batch_size = _whole_batch_size(batch_size)  # 0 and "abc" ran as 1 without a word
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).replace("torch.", "")
        if isinstance(device, str) and device.startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's own CLI passes its default device="cuda:0" when given none, and the model type cannot tell it
            # from a user's choice (kveval lm-eval passes the device that runs instead: kveval.lm_eval.__main__).
            log.warning("kveval: device=%s (lm-eval's default when no --device is given) but CUDA is not available; "
                        "using the CPU", device)
            device = "cpu"
        launch = data_parallel.launch()  # one of several `accelerate launch` processes: this one answers a shard
        if launch is not None and isinstance(pretrained, str):
            device = launch.placement(kwargs)

        if isinstance(pretrained, str):
            model, loaded_tokenizer = models.load_model(pretrained, device=device or "auto", dtype=dtype or "auto",
                                                 trust_remote_code=trust_remote_code, **kwargs)
            self.model_name = pretrained
        else:
            model, loaded_tokenizer = pretrained, None
            if kwargs:
                log.warning("kveval: model_args %s are ignored when a loaded model is passed", sorted(kwargs))
            self.model_name = getattr(model, "kveval_name", None) or getattr(model.config, "name_or_path", "") or type(model).__name__
            if tokenizer is None:
                raise UsageError("pass tokenizer= along with a loaded model")
        self._ensure_kveval_attention(model)
        if isinstance(tokenizer, str):
            tokenizer = load_tokenizer(tokenizer)
        tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        self.runspec = self.runspec.for_model(model)
        self.model_identity = model_identity(self.model_name, kwargs.get("revision")) if isinstance(pretrained, str) else None
        if self.policy.quantization is not None:  # head_dim checks etc. before any request runs
            CompressedCache(model, self.policy, kv_dtype=self.kv_dtype)

        super().__init__(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_batch_size=max_batch_size,
                         trust_remote_code=trust_remote_code, **hflm_kwargs)
        self._memo = {id(model): model}
        for item in list(model.modules()) + list(model.parameters()) + list(model.buffers()):
            self._memo[id(item)] = item
        self._rolling = False
        self._warned: set[str] = set()
        self._measured = {"requests": 0, "tokens": 0, "kv_bytes": 0, "index_bytes": 0, "nominal_bytes": 0}
        self._companions: list[RunSpec] = []
        self._store: ResponseStore | None = None
        if launch is not None:
            launch.attach(self)

    @property
    def policy(self) -> PolicyStack:
        return self.runspec.policy

    @property
    def compress(self) -> str:
        return self.runspec.mode

    @compress.setter
    def compress(self, mode: str) -> None:
        self.runspec = self.runspec.with_mode(mode)

    @property
    def kv_dtype(self) -> "torch.dtype | None":
        return self.runspec.kv_dtype

    def share_prefill(self, companions: "list[RunSpec]", store: ResponseStore) -> None:
        """Compute every request for ``companions`` too, from this policy's prefill, and leave their answers in ``store``.

        The sweep's lm-eval tasks use it: the first policy's run of a task
        prefills each request once for all of the task's pending policies
        (:meth:`CompressedCache.derive`), and the other policies' runs (the
        same calls, each with its own :class:`KVEvalLM` on ``store``) are
        answered from ``store``. Every policy's answers and measured bytes equal
        a separate run's. ``companions`` must share this run's mode and KV dtype.
        An empty list stops sharing (the store is still read).
        """
        others = [c.for_model(self.model) for c in companions if c.key != self.runspec.key]
        if any((c.mode, c.kv_dtype) != (self.compress, self.kv_dtype) for c in others):
            raise UsageError("share_prefill: companions must have this run's mode and KV dtype")
        self._companions, self._store = others, store

    def _answered(self, kind: str, args: list, compute):
        """This call's answers from the store, or computed (``compute(stacks)``) for this policy and its companions.

        ``compute`` returns, per stack, ``(answers, records)``; ``records`` are
        :meth:`_record` arguments, replayed here so measurements equal a separate run's.
        """
        key = call_key(kind, args) if self._store is not None else None
        served = self._store.take(self.runspec.key, key) if key is not None else None
        if served is None:
            computed = compute([self.policy] + [c.policy for c in self._companions])
            for companion, answers_records in zip(self._companions, computed[1:]):
                self._store.put(companion.key, key, *answers_records)
            served = computed[0]
        answers, records = served
        for stats, weight in records:
            self._record(stats, weight)
        return answers

    @staticmethod
    def _ensure_kveval_attention(model) -> None:
        register_attention()
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        if getattr(config, "_attn_implementation", None) == ATTENTION_NAME:
            return
        try:
            model.set_attn_implementation(ATTENTION_NAME)
        except Exception as exc:  # noqa: BLE001
            raise UsageError(f"the model must use attn_implementation={ATTENTION_NAME!r} (load it with "
                             f"kveval.runner.models.load_model): {exc}") from exc

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        """Like ``LM.create_from_arg_string``, but commas inside a policy spec's parentheses do not split, and a key
        given in ``--model_args`` as well as by lm-eval's own flags (``batch_size``, ``device``) takes the model
        args' value (both reached the constructor: an internal TypeError)."""
        args = parse_model_args(arg_string)
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in args}
        return cls(**args, **extra)

    # --- helpers ---------------------------------------------------------------------------------
    def _warn_once(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    def _int_batch_size(self, override: int | None = None) -> int:
        # DeepSeek V3.2/V4: one row per forward (their compressors pool the batch's columns, padding too)
        return forward_batch_size(self.model, _whole_batch_size(override if override is not None else self.batch_size))

    def _question_length(self, text: str | None, tokens: list[int], encode) -> int:
        """Tokens at the end of ``tokens`` that belong to the question (from ``question_marker`` on)."""
        if not self.question_marker or not text:
            return 0
        pos = text.rfind(self.question_marker)
        if pos < 0:
            self._warn_once("marker", "kveval: question_marker %r not found in a prompt; its whole prompt is context",
                            self.question_marker)
            return 0
        head = encode(text[:pos])
        n = 0
        for a, b in zip(head, tokens):
            if a != b:
                break
            n += 1
        return len(tokens) - n

    def _record(self, stats, weight: int = 1) -> None:
        m = self._measured
        m["requests"] += weight
        m["tokens"] += weight * sum(stats.tokens_seen)
        m["kv_bytes"] += weight * stats.kv_bytes
        m["index_bytes"] += weight * stats.index_bytes
        m["nominal_bytes"] += weight * stats.nominal_bytes

    # --- loglikelihood ---------------------------------------------------------------------------
    def _plan(self, request) -> tuple[tuple[int, ...], int, list[int], list[int]]:
        """``(prefill tokens, protected tokens, tail tokens, continuation)`` of one loglikelihood request."""
        request_str, context, continuation = request
        assert len(context) > 0 and len(continuation) > 0
        if len(continuation) > self.max_length:
            raise UsageError(f"continuation of {len(continuation)} tokens exceeds max_length {self.max_length}")
        q = self._question_length(request_str[0] if request_str else None, context, self.tok_encode)
        total = context + continuation
        if len(total) > self.max_length + 1:  # left-truncate as HFLM does
            self._warn_once("truncate", "kveval: context + continuation exceed max_length %d; truncating the context from the left", self.max_length)
            context = total[-(self.max_length + 1):][:-len(continuation)]
        q = min(q, len(context) - 1)
        if self.compress == "context":
            if q == 0 and len(context) > 1:
                q = 1  # the prompt's last token is processed after compression, so every score sees the compressed cache
            split = len(context) - q
            return tuple(context[:split]), 0, context[split:] + continuation[:-1], continuation
        return tuple(context), q, continuation[:-1], continuation

    loglikelihood = data_parallel.shards_requests(HFLM.loglikelihood)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs: int | None = None):
        if self._rolling:
            return super()._loglikelihood_tokens(requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
        plans = [self._plan(r) for r in requests]
        answers = self._answered("loglikelihood", [list(r) for r in requests],
                                 lambda stacks: self._score_plans(plans, stacks, override_bs, disable_tqdm))
        for request, answer in zip(requests, answers):
            if request[0] is not None:
                self.cache_hook.add_partial("loglikelihood", request[0], answer)
        return answers

    def _score_plans(self, plans: list, stacks: list[PolicyStack], override_bs: int | None, disable_tqdm: bool) -> list:
        """``[(answers, records)]`` per stack: each prefill group compressed by each stack, its continuations scored.

        With several stacks (and :func:`can_share_prefill`) a group's prefill runs
        once and each stack's cache is derived from it, scored and released in turn.
        """
        groups: dict[tuple, list[int]] = {}
        for i, (prefill, protect, _, _) in enumerate(plans):
            groups.setdefault((prefill, protect), []).append(i)
        # Longest prefill first (as HFLM sorts), ties broken by the tokens: the order does not depend on the batch size.
        order = sorted(groups, key=lambda k: (-len(k[0]), k[0], k[1]))
        batch_size = self._int_batch_size(override_bs)
        self._check_rope_forwards(plans, groups, order, batch_size)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        share = (len(stacks) > 1 and can_share_prefill(self.model, self.kv_dtype)
                 and not any(s.prefills_alone for s in stacks))  # an engine's cache codes the prefill as it runs
        out = [([None] * len(plans), []) for _ in stacks]
        pbar = tqdm(total=len(plans) * len(stacks), disable=(disable_tqdm or self.rank != 0),
                    desc="Running loglikelihood requests (kveval)")
        with torch.no_grad():
            for first, keys, tail_batches in _planned_batches(groups, order, batch_size):
                protect, rows = [p for _, p in keys], [list(prefill) for prefill, _ in keys]
                if share:
                    shared = CompressedCache(self.model, PolicyStack(), seed=self.seed + first, defer_compression=True,
                                             kv_dtype=self.kv_dtype, scores_for=stacks)
                    first_logprobs = self._prefill(shared, rows, protect, pad_id)
                    shared.drop_batch_buffers()
                for stack, (answers, records) in zip(stacks, out):
                    if share:
                        cache = shared.derive(stack)
                    else:
                        cache = CompressedCache(self.model, stack, seed=self.seed + first, kv_dtype=self.kv_dtype)
                        first_logprobs = self._prefill(cache, rows, protect, pad_id)
                    cache.set_protected(None)
                    for g, key in enumerate(keys):
                        records.append((cache.stats(row=g), len(groups[key])))
                    self._score_members(cache, tail_batches, [len(k[0]) for k in keys], plans, first_logprobs, pad_id,
                                        answers)
                    del cache  # released before the next stack's cache is derived
                    pbar.update(sum(len(batch) for batch in tail_batches))
        pbar.close()
        return out

    def _check_rope_forwards(self, plans: list, groups: dict, order: list, batch_size: int) -> None:
        """Before any forward: the rows of every forward :meth:`_score_plans` will run (each batch's prefills, then
        its continuations' tails in batches), as :func:`~kveval.modeling.rope.check_rope_batch` checks each in
        :func:`~kveval.runner.generation.forward_rows`, so a RoPE refusal comes before hours of scoring, not after."""
        if not rope_switches(self.model):
            return
        for _, keys, tail_batches in _planned_batches(groups, order, batch_size):
            check_rope_batch(self.model, [0] * len(keys), [max(len(k[0]), 1) for k in keys], [bool(k[0]) for k in keys])
            for sub in tail_batches:
                tails = [plans[i][2] for _, i in sub]
                if any(tails):
                    seen = [len(keys[g][0]) for g, _ in sub]
                    check_rope_batch(self.model, seen, [max(n + len(t), 1) for n, t in zip(seen, tails)],
                                     [bool(t) for t in tails])

    def _prefill(self, cache: CompressedCache, rows: list[list[int]], protect: list[int], pad_id: int) -> torch.Tensor:
        """Prefill ``rows`` into ``cache`` (their last ``protect`` tokens kept); log-probs of the token after each."""
        cache.set_protected(protect)
        logits = forward_rows(self.model, cache, rows, [0] * len(rows), pad_id, logits_to_keep=1)[0]
        return F.log_softmax(logits[:, -1].float(), dim=-1)

    def _score_members(self, cache: CompressedCache, tail_batches: list[list[tuple[int, int]]],
                       prefill_lengths: list[int], plans: list, first_logprobs: torch.Tensor, pad_id: int,
                       answers: list) -> None:
        """Score each ``(row g, request i)`` of ``tail_batches`` (one forward each): request ``i``'s tail on a copy
        of ``cache``'s row ``g``."""
        for sub in tail_batches:
            index = [g for g, _ in sub]
            if len(tail_batches) == 1 and index == list(range(len(prefill_lengths))):
                run = cache  # each prefill is used once: no copy needed
            else:
                run = _fork_rows(cache, index, self._memo)
            tails = [plans[i][2] for _, i in sub]
            tail_logprobs = None
            if any(tails):
                tail_seen = [prefill_lengths[g] for g in index]
                # Only the last positions predict continuation tokens: skip the vocabulary projection elsewhere.
                needed = max(min(len(tail), len(plans[i][3])) for tail, (_, i) in zip(tails, sub))
                logits = forward_rows(self.model, run, tails, tail_seen, pad_id, logits_to_keep=needed)[0]
                tail_logprobs = F.log_softmax(logits.float(), dim=-1)
            for r, (g, i) in enumerate(sub):
                continuation = plans[i][3]
                t = min(len(tails[r]), len(continuation))
                preds = first_logprobs[g:g + 1]
                if t:
                    preds = torch.cat([preds, tail_logprobs[r, tail_logprobs.shape[1] - t:]], dim=0)
                preds = preds[-len(continuation):]
                target = torch.tensor(continuation, dtype=torch.long, device=preds.device)
                answers[i] = (float(preds.gather(1, target[:, None]).sum()), bool((preds.argmax(dim=-1) == target).all()))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        """Stock ``HFLM`` rolling loglikelihood, uncompressed (its windows have a one-token prefix: nothing to compress)."""
        self._warn_once("rolling", "kveval: loglikelihood_rolling (perplexity tasks) runs uncompressed, exactly as "
                        "--model hf: lm-eval's rolling windows have a one-token prefix, so there is no context to compress")
        self._rolling = True
        try:
            return super().loglikelihood_rolling(requests, disable_tqdm=disable_tqdm)
        finally:
            self._rolling = False

    # --- generation ------------------------------------------------------------------------------
    def _encode_for_generation(self, text: str) -> list[int]:
        ids, mask = self.tok_batch_encode([text])  # HFLM's tokenization of generation prompts
        return ids[0][mask[0].bool()].tolist()

    @data_parallel.shards_requests
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        args = [req.args for req in requests]
        jobs = self._generation_jobs(args)
        pbar = tqdm(total=len(args), disable=(disable_tqdm or self.rank != 0), desc="Running generate_until requests (kveval)")
        answers = self._answered("generate_until", [list(a) for a in args],
                                 lambda stacks: self._generate_jobs(jobs, len(args), stacks, pbar))
        pbar.close()
        for arg, text in zip(args, answers):
            self.cache_hook.add_partial("generate_until", arg, text)
        return answers

    def _generation_jobs(self, args: list) -> list[tuple[list[int], dict, list[str], int]]:
        """Requests grouped by generation kwargs: ``(request indices in order, prompts, stop strings, max_gen_toks)``.

        Refuses sampling here, before anything is computed or read from a store.
        """
        by_kwargs: dict[str, list[int]] = {}
        for i, (_, gen_kwargs) in enumerate(args):
            by_kwargs.setdefault(json.dumps(gen_kwargs, sort_keys=True, default=str), []).append(i)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        jobs = []
        for indices in by_kwargs.values():
            gen_kwargs = args[indices[0]][1]
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.pop("do_sample", False):
                raise UsageError("--model kveval generates greedily; set do_sample=false (and temperature=0) in the task's generation_kwargs")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            kwargs.pop("temperature", None)
            if kwargs:
                self._warn_once("gen_kwargs", "kveval: generation kwargs %s are ignored (greedy decoding)", sorted(kwargs))
            max_ctx_len = self.max_length - max_gen_toks
            if max_ctx_len <= 0:
                raise UsageError(f"max_gen_toks={max_gen_toks} leaves no room for the prompt in max_length={self.max_length}")
            prompts = {}
            for i in indices:
                text = args[i][0]
                ids = self._encode_for_generation(text)
                q = self._question_length(text, ids, self._encode_for_generation)
                if len(ids) > max_ctx_len:
                    self._warn_once("truncate_gen", "kveval: prompt longer than max_length - max_gen_toks = %d; truncating it from the left", max_ctx_len)
                    ids = ids[-max_ctx_len:]
                q = min(q, len(ids) - 1)
                if self.compress == "context" and q == 0 and len(ids) > 1:
                    q = 1  # the last prompt token runs against the compressed cache, as in loglikelihood
                prompts[i] = Prompt(context=ids[:len(ids) - q], question=ids[len(ids) - q:])
            # Longest prompt first, ties by text: batch composition never changes the order (nor the seeds).
            ordered = sorted(indices, key=lambda i: (-prompts[i].length, args[i][0]))
            jobs.append((ordered, prompts, until, max_gen_toks))
        return jobs

    def _generate_jobs(self, jobs: list, n: int, stacks: list[PolicyStack], pbar) -> list:
        """``[(texts, records)]`` per stack; each batch prefilled once for all stacks (:func:`generate_each`)."""
        out = [([None] * n, []) for _ in stacks]
        batch_size = self._int_batch_size()
        think_end = self.think_end_token if isinstance(self.think_end_token, str) else None
        for ordered, prompts, until, max_gen_toks in jobs:  # every batch checked before any runs
            for start in range(0, len(ordered), batch_size):
                chunk = ordered[start:start + batch_size]
                check_request(self.model, [prompts[i] for i in chunk], max_gen_toks, self.compress, len(chunk))
        for ordered, prompts, until, max_gen_toks in jobs:
            for start in range(0, len(ordered), batch_size):
                chunk = ordered[start:start + batch_size]
                batch = [prompts[i] for i in chunk]
                each = generate_each(self.model, self.tokenizer, batch, stacks, max_new_tokens=max_gen_toks, stop=until,
                                     seed=self.seed + start, **self.runspec.generation_kwargs())
                for (texts, records), (_, outputs) in zip(out, each):
                    for i, result in zip(chunk, outputs):
                        texts[i] = postprocess_generated_text(generation=result.text, stop=until, think_end_token=think_end)
                        records.append((result.stats, 1))
                pbar.update(len(chunk))
        return out

    # --- reporting -------------------------------------------------------------------------------
    def cache_summary(self) -> dict:
        """Measured cache size over the requests computed so far (keys: :mod:`kveval.runs.lm_eval_schema`)."""
        m = self._measured
        return {
            schema.MEASURED_REQUESTS: m["requests"],
            schema.MEASURED_TOKENS: m["tokens"],
            schema.MEASURED_BYTES: m["kv_bytes"] / m["tokens"] if m["tokens"] else None,
            schema.INDEX_BYTES: m["index_bytes"] / m["tokens"] if m["tokens"] else None,
            schema.UNCOMPRESSED_MEASURED_BYTES: m["nominal_bytes"] / m["tokens"] if m["tokens"] else None,
            schema.MEASURED_RATIO: m["kv_bytes"] / m["nominal_bytes"] if m["nominal_bytes"] else None,
        }

    def get_model_info(self) -> dict:
        """Merged by lm-eval into ``results["config"]``: the keys of :mod:`kveval.runs.lm_eval_schema`, plus model and versions."""
        model = self.model
        info = {
            "model_name": self.model_name,
            "model_num_parameters": sum(p.numel() for p in model.parameters()),
            "model_dtype": str(model.dtype),
            schema.POLICY: self.policy.spec,
            schema.COMPRESS: self.compress,
            schema.KV_DTYPE: self.runspec.kv_dtype_name or deployment_dtype_name(model),
            schema.MODEL_IDENTITY: self.model_identity,
            schema.QUESTION_MARKER: self.question_marker,
            schema.SEED: self.seed,
            schema.NOMINAL_RATIO: self.policy.ratio,
            schema.NOMINAL_BYTES: nominal_bytes_per_token(model, self.kv_dtype),
            schema.ROLLING: "uncompressed (stock HFLM)",
            schema.VERSION: getattr(kveval, "__version__", "unknown"),
            schema.HARDWARE: hardware_of(model),
            "transformers_version": _version("transformers"),
            "torch_version": torch.__version__,
            "lm_eval_version": _version("lm_eval"),
        }
        info.update(self.cache_summary())
        return info


def register_model_type() -> None:
    """Register :class:`KVEvalLM` as lm-eval model type ``kveval`` (idempotent)."""
    current = model_registry._objs.get(MODEL_TYPE) if hasattr(model_registry, "_objs") else None
    if current is KVEvalLM:
        return
    register_model(MODEL_TYPE)(KVEvalLM)


register_model_type()

__all__ = ["KVEvalLM", "MODEL_TYPE", "ResponseStore", "parse_model_args", "policy_from_arg", "register_model_type", "runspec_from_args",
           "split_model_args"]

"""lm-eval's data-parallel mode for the ``kveval`` model type: ``accelerate launch -m kveval.lm_eval ...``.

lm-eval shards a task's documents over the processes of an ``accelerate
launch`` when the model reports ``rank`` and ``world_size`` and holds an
``accelerator`` (``HFLM`` does this only for a model it loads itself, and only
on several GPUs). :class:`Launch` gives :class:`~kveval.lm_eval.model.KVEvalLM`
the same: each process loads the model on its own device (``cuda:LOCAL_RANK``;
on a machine without GPUs the CPU, over gloo), answers its shard, and lm-eval
gathers the samples and metrics on rank 0, which writes the results::

    accelerate launch --multi_gpu --num_processes 8 -m kveval.lm_eval --model kveval --model_args ... --tasks ...

(``--multi_gpu`` is accelerate's torchrun launcher; on a CPU-only machine it
starts CPU processes. ``accelerate launch --cpu`` starts one process unless
run through MPI.)

Two things lm-eval's data-parallel loop does not do for kveval, done here:

* **Padding.** lm-eval pads every rank to the same request count with copies of
  its last request (:func:`real_requests`). Those copies are answered with the
  copied request's answer, never computed, so they are neither measured nor timed.
* **Measured bytes.** Each rank measures only its own requests, and only rank 0
  reports (``get_model_info``). After every request call the ranks sum what they
  measured in that call (:func:`sum_over_ranks`), so every rank holds the
  totals a single process would have measured: the measurements are integer
  sums (bytes, tokens, requests), exact in any order.

Answers equal a single-process run's because kveval's answers do not depend on
the batch a request is in (see :mod:`kveval.runner.generation`); the ``random``
control policy is the exception, as its seeds follow the batch position.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch

from kveval.errors import UsageError

# A child of lm-eval's logger: its CLI prints it (kveval's own loggers have no handler there).
log = logging.getLogger("lm_eval.kveval.data_parallel")


@dataclass(frozen=True)
class Launch:
    """One process of a multi-process ``accelerate launch``: its accelerator, rank and the number of processes."""

    accelerator: object
    rank: int
    world_size: int

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def placement(self, kwargs: dict) -> str:
        """The device this process loads the whole model on; refuses accelerate's model placement alongside."""
        if kwargs.get("device_map") not in (None, "") or kwargs.get("max_memory"):
            raise UsageError(f"device_map/parallelize/max_memory split one model over devices, but this is one of "
                             f"{self.world_size} data-parallel processes (accelerate launch): launch a single process "
                             f"for a model larger than one device, or drop those model_args to shard the requests")
        return str(self.device)

    def attach(self, lm) -> None:
        """Make ``lm`` (an ``HFLM``) one rank of lm-eval's data-parallel loop."""
        lm.accelerator = self.accelerator
        lm._rank = self.rank
        lm._world_size = self.world_size


def launch() -> Launch | None:
    """This process's :class:`Launch` when started by ``accelerate launch`` with several processes, else ``None``."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    from datetime import timedelta

    from accelerate import Accelerator, InitProcessGroupKwargs

    # lm-eval's own timeout: a rank may wait at a gather for as long as another takes over its shard. Without
    # cpu=True accelerate sees no distributed run on a machine without GPUs (HFLM shards only on GPUs).
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(weeks=52))])
    if accelerator.num_processes <= 1:
        return None
    return Launch(accelerator, accelerator.process_index, accelerator.num_processes)


def real_requests(requests: list) -> int:
    """How many of ``requests`` are real: lm-eval's data-parallel padding is excluded.

    lm-eval appends its padding as more copies of the *same* last request object
    (``[req] * req.repeats`` per padding slot) after that request's own
    ``repeats`` copies; no real request repeats an object beyond its ``repeats``.
    """
    if not requests:
        return 0
    last = requests[-1]
    run = 0
    for request in reversed(requests):
        if request is not last:
            break
        run += 1
    return len(requests) - max(0, run - getattr(last, "repeats", run))


def sum_over_ranks(lm, before: dict) -> None:
    """Replace ``lm._measured``'s growth since ``before`` by its sum over all ranks (integers, in place)."""
    keys = sorted(before)
    grown = torch.tensor([lm._measured[k] - before[k] for k in keys], dtype=torch.long, device=lm.device)
    total = lm.accelerator.reduce(grown, reduction="sum")
    for key, value in zip(keys, total.tolist()):
        lm._measured[key] = before[key] + int(value)


def shards_requests(method):
    """Wrap a request method of :class:`~kveval.lm_eval.model.KVEvalLM` for lm-eval's data-parallel loop.

    On one rank of several: padding copies get their original's answer
    (:func:`real_requests`) and the measurements are summed over ranks
    (:func:`sum_over_ranks`). A single process runs ``method`` unchanged.
    """
    @functools.wraps(method)
    def wrapper(lm, requests, *args, **kwargs):
        if lm.world_size <= 1:
            return method(lm, requests, *args, **kwargs)
        before = dict(lm._measured)
        real = real_requests(requests)
        answers = list(method(lm, requests[:real], *args, **kwargs)) if real else []
        sum_over_ranks(lm, before)
        log.info("kveval: rank %d of %d computed %d %s requests (%d padding copies answered, not computed)",
                 lm.rank, lm.world_size, real, method.__name__, len(requests) - real)
        return answers + answers[-1:] * (len(requests) - real)

    return wrapper

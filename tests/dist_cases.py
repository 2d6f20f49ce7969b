"""The index of the cases run on every rank of a gloo pool (see dist_harness): each compares
autosp against a single-device run of the same model, weights and batch, computed in the same
process without any parallelism. The cases live by topic:

    dist_models       the models, batches and losses the cases share; train_compare
    cases_exactness   loss, gradients and parameters against one process
    cases_planning    memory budgets, saved plans, the first call's planner, lengths, documents
    cases_memory      what checkpointing, tiling, ring, written attention and offload hold
    cases_mesh        DP x SP, ZeRO 0-3, accumulation, resumable checkpoints
    cases_tensor_parallel  TP x SP (x DP) against one process
"""

from cases_exactness import *  # noqa: F401,F403
from cases_memory import *  # noqa: F401,F403
from cases_mesh import *  # noqa: F401,F403
from cases_planning import *  # noqa: F401,F403
from cases_tensor_parallel import *  # noqa: F401,F403
from dist_models import *  # noqa: F401,F403
from dist_models import _batch, _loss, _rel  # noqa: F401 - what jobs launched apart (deepspeed_job) read

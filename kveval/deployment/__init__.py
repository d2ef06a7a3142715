"""The deployment decision: which gated run to ship on a GPU at a target context and batch.

It stands above both halves it joins: the gate's verdicts (analysis) and the memory planner's cache sizes
(engine). Neither the gate nor the planner imports it; ``kveval gate``, ``kveval sweep`` and ``kveval rescore``
ask it (:mod:`kveval.deployment.decision`).
"""

from kveval.deployment.decision import (
    Deployment,
    add_deployment_arguments,
    check_deployment_inputs,
    deployment_decision,
    deployment_of,
)

__all__ = ["Deployment", "add_deployment_arguments", "check_deployment_inputs", "deployment_decision", "deployment_of"]

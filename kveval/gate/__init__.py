"""The regression gate: its rules, its verdicts, its config and its reports (the deployment decision that reads
the verdicts is :mod:`kveval.deployment`)."""

"""The regression gate: its rules, its config, its reports and the deployment decision."""

"""Sweeps: configs, planning, executors (in process or Ray), resume."""

"""Calibration done once per model and cached: K/V activations on calibration text, low-rank bases, retrieval heads."""

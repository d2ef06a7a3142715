"""Paired statistics of a candidate run against its baseline, item by item, and their text tables."""

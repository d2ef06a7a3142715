"""Run folders and result files: item records, loading and pairing runs, lm-eval sample files."""

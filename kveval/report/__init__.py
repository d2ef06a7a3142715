"""Leaderboard reports: rows, markdown, CSV, HTML and plots."""

"""Writes the run directory: meta.json and one event log per rank."""

"""Loads a run directory into one model and finds what went wrong."""

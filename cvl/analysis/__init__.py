"""Analyses of trained runs: the Mod-X rotation analysis (SAM, RAM, ImAV) in `rotation`.

Kept import-light (no torch) so `cvl --help` stays fast; use `cvl.analysis.rotation`.
"""

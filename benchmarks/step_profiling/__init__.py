"""The parts of ``benchmarks/step_profile.py`` (the entry point, whose docstring has the contract):
``engine`` (the step recorder, engine settings, prompts and timed rounds), ``trace`` (the torch
profile of one call and the step attribution of its chrome trace) and ``report`` (summary, printed
tables, JSON output)."""

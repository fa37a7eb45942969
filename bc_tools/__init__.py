"""Tools around vllm-boundary-checkpoints, not part of the plugin: the serving benchmark and demo
(``bc_tools.bench``: ``bc-bench``, ``bc-demo``) and the seeded tiny hybrid models the demo and the
tests serve (``bc_tools.fixtures``: ``bc-make-tiny-model``). The plugin never imports them.
"""

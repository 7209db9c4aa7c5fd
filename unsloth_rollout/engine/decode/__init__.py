"""The decode step: one new token for every running sequence, in one of a few variants behind one interface.

Where to read, top down:

- ``choose.py``: which variant runs, and why (the engine's ``auto``, and each step's fallback): the one place
  that knows every variant.
- ``steps.py``: the variants one engine runs, and each step run through the one ``choose_step`` picks.
- ``step.py``: the interface (``arrange`` the step's rows, ``run`` them -> logits) and the ``DecodeContext``
  every variant is handed.
- the variants: ``gather.py`` (each step gathers every row's history from the pool), ``workspace.py`` (the eager
  workspace step: persistent rows), ``compiled.py`` (the compiled step, with ``units.py``, ``trust.py`` and
  ``views.py``), ``graph.py`` (the graph step: the compiled step replayed as CUDA graphs).
- beside them: ``shared_prompts.py`` (the store of prompts a group's rows share) and ``cpu_kernel.py`` (the CPU
  decode attention kernel's binding).

Nothing is imported here: ``engine/attention.py`` imports ``cpu_kernel`` while the engine itself is importing.
"""

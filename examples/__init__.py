"""The demos, out of the library: each subpackage is a plugin (``unirl_core/plugins.py``) that registers its parts
when imported and ships its recipes in ``recipes/<kind>/`` (``rl``, ``sft``, ``compose``), found by name by the
recipe loaders. ``unirl_core`` never imports this package (``.importlinter``)."""

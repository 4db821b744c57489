"""Model bundles (diffusers / transformers), tiny offline presets, LoRA.

Heavy modules (diffusers, transformers) are imported by the submodules that need them, so
``import unirl_core.models.lora`` stays light.
"""

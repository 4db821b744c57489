"""Runs INSIDE the vLLM worker process (vLLM's venv): the weight-reload method the engine calls.

Started with ``--worker-extension-cls unirl_core.rollout.vllm.worker_ext.WeightSyncExtension``,
vLLM mixes this class into its worker, and ``POST /collective_rpc {"method":
"unirl_reload_weights"}`` calls it on every worker. Only torch and vLLM are imported here.

Why not vLLM's plain ``reload_weights``: its layer-wise in-place reload (vLLM 0.32) loads the
checkpoint layer by layer and puts the OLD kernel tensors back on any layer that received no
weights. With tied embeddings (``tie_word_embeddings``, e.g. small Qwen models) the checkpoint has
no ``lm_head.weight``: the embedding gets the new weights, the LM head's parameter still aliases
them, but its derived kernel state (on CPU the prepacked GEMM built from the weights) is the old
one. The server then samples from a mix of two policies (measured: |logp| off by ~1.6 against
both). After the reload we re-tie the head to the embedding if needed and re-run its post-load
processing, which rebuilds that state from the new weights.
"""

from __future__ import annotations


def _refresh_tied_lm_head(model) -> bool:
    """Re-tie a tied LM head to the embedding and rebuild its kernel state; True when it is tied."""
    config = getattr(model, "config", None)
    text_config = getattr(config, "get_text_config", lambda: config)()
    if not getattr(text_config, "tie_word_embeddings", False):
        return False
    head = getattr(model, "lm_head", None)
    inner = getattr(model, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if head is None or embed is None:
        return False
    if tuple(head.weight.shape) != tuple(embed.weight.shape):
        raise RuntimeError(f"tied lm_head {tuple(head.weight.shape)} != embed_tokens {tuple(embed.weight.shape)}")
    if head.weight is not embed.weight:
        head.weight = embed.weight
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
    return True


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def unirl_reload_weights(self, weights_path: str) -> dict:
        """Reload every weight in place from ``weights_path`` and keep tied heads tied."""
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        return {"refreshed_tied_lm_head": _refresh_tied_lm_head(model)}

"""Runs INSIDE the vLLM worker process (vLLM's venv): the weight-reload method the engine calls.

Started with ``--worker-extension-cls unirl_core.rollout.vllm.worker_ext.WeightSyncExtension``,
vLLM mixes this class into its worker, and ``POST /collective_rpc {"method":
"unirl_reload_weights"}`` calls it on every worker. Only torch, safetensors, vLLM and this package's light
modules are imported here.

Three ways a version arrives: ``unirl_reload_weights`` reads a staged folder; ``unirl_apply_delta`` XORs a delta
version (``checkpoint.weights_encoding: delta``) into the host copy of its base the worker kept from the last load,
checks the result against the version's digest and loads it through the same in-place reload; ``unirl_join_sync`` +
``unirl_receive_sync`` take it from the trainer's broadcast (``pool.publish: collective``): the worker joins the
pool's publish group as one more rank (NCCL on GPUs, gloo on CPU) and streams the buckets into the same
in-place reload, no file in between (``unirl_core.weightsync.stream``).

The delta path imports ``unirl_core.checkpoint.delta`` (the store's own XOR, zstd decode and digest), which needs
``zstandard`` (scripts/install_vllm.sh installs it; vLLM does not depend on it) and ``fsspec`` (the
``unirl_core.checkpoint`` package imports its store; huggingface_hub depends on it). A worker where that import
fails answers "not applied" and the engine sends the version in full.

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


def checkpoint_shapes(folder: str) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of every ``*.safetensors`` file in ``folder`` (headers only, no weights read)."""
    from pathlib import Path

    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                out[k] = tuple(st.get_slice(k).get_shape())
    if not out:
        raise RuntimeError(f"no safetensors weights in {folder}: the server's model folder")
    return out


def read_folder(folder: str) -> dict:
    """Every tensor of the ``*.safetensors`` files in ``folder``, on the host, in the file's dtypes."""
    from pathlib import Path

    from safetensors.torch import load_file

    out: dict = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(load_file(str(f), device="cpu"))
    return out


class WeightSyncExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker. ``_unirl_held``: (weights digest, host tensors) of
    the version the served model was last loaded from, kept when the engine asked (``keep_sha256``), the base a
    delta version is applied to; None when the worker holds no such copy."""

    def unirl_reload_weights(self, weights_path: str, keep_sha256: str | None = None) -> dict:
        """Reload every weight in place from ``weights_path`` and keep tied heads tied. ``keep_sha256``: the
        version's weights digest, to keep the folder's tensors on the host as the base of the next delta."""
        self._unirl_held = None
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        refreshed = _refresh_tied_lm_head(model)
        if keep_sha256:
            # The engine's word for the digest: a wrong one shows at the next delta's digest check (full then).
            self._unirl_held = (str(keep_sha256), read_folder(weights_path))
        return {"refreshed_tied_lm_head": refreshed, "kept": self._unirl_held is not None}

    def unirl_apply_delta(self, delta_path: str, size: int, base_sha256: str, sha256: str) -> dict:
        """Serve the delta version whose file (``model.xor.zst``, verified by the engine) is at ``delta_path``:
        XOR it into the kept copy of its base (``base_sha256``), check the result's digest against ``sha256`` and
        only then load it in place (tied head refreshed). ``{"applied": False, "reason": ...}`` leaves the served
        model untouched: another base, no kept copy, other names / shapes / dtypes, a digest mismatch (the copy is
        then dropped) or no ``unirl_core.checkpoint`` in this venv; the engine then sends the version in full."""
        import time

        t0 = time.perf_counter()
        held = getattr(self, "_unirl_held", None)
        if held is None or held[0] != base_sha256:
            return {"applied": False, "reason": "not at the delta's base" if held else "no kept base"}
        try:
            from unirl_core.checkpoint.delta import bits, decode_delta, weights_digest
            from unirl_core.errors import CheckpointError
        except ImportError as e:  # vLLM's venv without zstandard / fsspec
            return {"applied": False, "reason": f"cannot decode deltas here: {e}"}
        from pathlib import Path

        blob = Path(delta_path).read_bytes()
        try:
            xors = decode_delta(blob, int(size), delta_path)
        except CheckpointError as e:
            return {"applied": False, "reason": str(e)}
        tensors = held[1]
        if set(xors) != set(tensors) or any(tensors[k].dtype != x.dtype or tensors[k].shape != x.shape
                                            for k, x in xors.items()):
            return {"applied": False, "reason": "the delta's tensors are not the kept base's"}
        self._unirl_held = None  # from the first XOR on the copy is no version until its digest is checked
        for name, x in xors.items():
            bits(tensors[name]).bitwise_xor_(bits(x))
        del xors
        got = weights_digest(tensors)
        if got != sha256:
            return {"applied": False, "reason": f"digest {got} after the delta, the version's is {sha256}"}
        self.reload_weights(weights_iterator=iter(tensors.items()))
        refreshed = _refresh_tied_lm_head(self.model_runner.get_model())
        self._unirl_held = (got, tensors)
        return {"applied": True, "bytes_read": len(blob), "tensors": len(tensors),
                "seconds": time.perf_counter() - t0, "refreshed_tied_lm_head": refreshed}

    # ------------------------------------------------------------------ the trainer's broadcast
    def unirl_join_sync(self, master_addr: str, master_port: int, rank: int, num_engines: int,
                        timeout_s: float, bucket_mb: float) -> dict:
        """Join the pool's publish group as ``rank``; blocks until every rank joined. The names and shapes a
        sync must bring are the served checkpoint's (plus the LM head when it is tied to the embedding)."""
        from unirl_core.weightsync.stream import StreamReceiver
        from unirl_core.weightsync.sync import WeightSyncConfig

        self.unirl_close_sync()
        expected = checkpoint_shapes(self.model_config.model)
        config = getattr(self.model_config, "hf_config", None)
        text_config = getattr(config, "get_text_config", lambda: config)()
        optional = {}
        embed = expected.get("model.embed_tokens.weight")
        if getattr(text_config, "tie_word_embeddings", False) and embed is not None:
            optional["lm_head.weight"] = embed
        model = self.model_runner.get_model()
        device = next(model.parameters()).device
        cfg = WeightSyncConfig(master_addr=master_addr, master_port=int(master_port), num_engines=int(num_engines),
                               timeout_s=float(timeout_s), bucket_mb=float(bucket_mb))
        self._unirl_receiver = StreamReceiver(cfg, expected=expected, optional=optional, rank=int(rank),
                                              device=device)
        return {"rank": int(rank), "tensors": len(expected), "device": str(device)}

    def unirl_receive_sync(self) -> dict:
        """Receive the next broadcast version into the served model (vLLM's in-place reload, fed bucket by
        bucket); keep a tied head tied. Raises when no group was joined or the load failed (the trainer's
        send fails with it)."""
        receiver = getattr(self, "_unirl_receiver", None)
        if receiver is None:
            raise RuntimeError("unirl_receive_sync before unirl_join_sync: no publish group on this worker")
        self._unirl_held = None  # the broadcast version is not the kept copy's
        stats = receiver.receive(lambda tensors: self.reload_weights(weights_iterator=tensors))
        if stats is None:
            self.unirl_close_sync()
            return {"closed": True}
        refreshed = _refresh_tied_lm_head(self.model_runner.get_model())
        return {"version": stats.version, "bytes": stats.bytes, "buckets": stats.num_buckets,
                "seconds": stats.seconds, "refreshed_tied_lm_head": refreshed}

    def unirl_close_sync(self) -> dict:
        """Leave the publish group (a no-op when not in one)."""
        receiver = getattr(self, "_unirl_receiver", None)
        self._unirl_receiver = None
        if receiver is not None:
            receiver.close()
        return {"closed": receiver is not None}

"""Trainer -> engine weight publication on the wire: the header and bucket format (``wire``), the broadcast over a
dedicated process group (``sync``) and the streaming receiver an inference engine loads from (``stream``). Both the
trainer (train/, the pool) and the engines (rollout/) import it; it imports neither."""
